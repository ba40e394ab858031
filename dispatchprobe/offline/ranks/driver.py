"""``dispatchprobe ranks RUN``: one run's ranks checked against each other, step by step.

:func:`check_parts` does the work for any list of (step, rank) parts (each step is checked with
the ranks listed for it), so that the steps can be shared out; :func:`merge` turns the results
into one table and verdict; :func:`check_run` does both for a whole run and writes the outputs."""

from __future__ import annotations

import os
from typing import NamedTuple

import pandas as pd

from ...core.collective_roles import role
from ...records.reader import Run, load
from ..launcher import engine_for, gathered, said_by_rank0
from ...standards import verdicts as V
from .collectives import calls_of, check_call
from .inf_nan import describe, first_nonfinite
from .groups import data_shares, replicas
from .replicas import find_drifts
from .values import Values

COLUMNS = ["step", "check", "status", "rank", "ranks", "group", "seq", "kind", "op", "name", "scope", "stage", "id",
           "arg", "size", "detail"]
AGREE, NOT_JUDGED, DIFFERS = "agree", "not judged", "differs"
ORIGIN, RECEIVED, CAME_IN = "inf/nan origin", "inf/nan received", "inf/nan came in"


class StepResult(NamedTuple):
    step: int
    ranks: list
    rows: list              # dicts with COLUMNS
    compared: int           # replicated values compared
    missing: list           # "why it cannot judge" lines
    unnumbered: int = 0     # collective records without a sequence number (an earlier record format)
    apart: int = 0          # ops a rank ran on other pieces than its tensor-parallel peers: not judged
    tp_groups: list = []    # the tensor-parallel groups (ranks computing on one share of the batch)
    first_apart: str = ""   # the first of those ops, where it ran ("" where none)


def check_parts(run: Run | str, parts, *, tensors: bool = True, progress: bool = False) -> list[StepResult]:
    """Check the given (step, rank) parts of ``run``: each step with the ranks listed for it."""
    run = load(run) if isinstance(run, (str, os.PathLike)) else run
    by_step: dict[int, list] = {}
    for step, rank in sorted(parts):
        by_step.setdefault(step, []).append(rank)
    from tqdm import tqdm
    out = []
    with tqdm(total=sum(map(len, by_step.values())), desc="ranks", unit="part", disable=not progress,
              leave=False) as bar:
        for step, ranks in by_step.items():
            out.append(check_step(run, step, ranks, tensors=tensors))
            bar.update(len(ranks))
    return out


def check_step(run: Run, step: int, ranks: list, *, tensors: bool = True) -> StepResult:
    parts = {r: run.part(step, r) for r in ranks}
    records = {r: p.records for r, p in parts.items()}
    values = Values(parts, tensors)
    rows: list[dict] = []
    missing: list[str] = []
    # 1. collectives, joined by (group, seq)
    joined: dict = {}
    for r in ranks:
        for key, call in calls_of(r, records[r]).items():
            joined.setdefault(key, []).append(call)
    absent = set()
    for (group, seq), calls in sorted(joined.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        members = calls[0].members
        gone = sorted(set(members) - set(ranks))
        if gone:
            absent.update(gone)
            continue
        finding = check_call(calls, values)
        rec = calls[0].record
        status = {V.PASS: AGREE, V.ERROR: DIFFERS}.get(finding.status, NOT_JUDGED)
        named = finding.ranks[0] if finding.ranks else calls[0].rank
        first = next((c for c in calls if c.rank == named), calls[0])
        rows.append(_row(step, "collective", status, first.rank, finding.ranks, first.record, first.index,
                         arg="", size=finding.size, detail=finding.detail, group=group, seq=seq,
                         kind=rec["collective"].get("kind")))
    missing += [_absent(run, step, r, "its groups' collectives cannot be joined") for r in sorted(absent)]
    # 2. replicas: each value on the ranks that must hold it equal
    held = replicas(records)
    for r in sorted({r for g in held.values() for r in g} - set(ranks) - absent):
        missing.append(_absent(run, step, r, f"its replicas {sorted(next(g for g in held.values() if r in g))} "
                                             "are compared without it"))
    peers = {r: frozenset(share) for share in data_shares(records) for r in share}
    drifts, compared, apart, first_apart = find_drifts(records, values, {r: parts[r].params for r in ranks}, held,
                                                       peers=peers)
    for d in drifts:
        rows.append(_row(step, "replica", DIFFERS, d.ranks[0], d.ranks, d.record, d.index, arg=d.arg, size=d.size,
                         detail=f"{d.what} {d.arg} differs on rank {', '.join(map(str, d.ranks))} from rank "
                                f"{d.reference}: {d.detail}{_no_majority(d)}; {d.context}; held equal by ranks "
                                + ", ".join(map(str, d.group))))
    # 3. inf/nan: where they started
    firsts = [f for f in (first_nonfinite(r, records[r]) for r in ranks) if f is not None]
    for f in firsts:
        status = {"made": ORIGIN, "received": RECEIVED}.get(f.how, CAME_IN)
        info = f.record.get("collective") or {}
        rows.append(_row(step, "inf/nan", status, f.rank, [f.rank], f.record, f.index, arg="", detail=describe(f),
                         group=info.get("group", ""), seq=info.get("seq"), kind=info.get("kind", "")))
    unnumbered = sum(1 for r in ranks for rec in records[r]
                     if "collective" not in rec and rec.get("kind") == "op" and role(rec["op"]) is not None)
    shares = [share for share in data_shares(records) if len(share) > 1]
    alone = "" if first_apart is None else (f"{first_apart[1]['op']} [{first_apart[1].get('scope') or '<top>'}] "
                                            f"(step {step}, {first_apart[1].get('stage')}) on rank {first_apart[0]}")
    return StepResult(step, list(ranks), rows, compared, missing, unnumbered, apart, shares, alone)


def _no_majority(drift) -> str:
    """Where the ranks that differ are as many as those that agree with the reference (two
    tensor-parallel peers: one against one), which is wrong the ranks alone cannot tell."""
    if len(drift.group) - len(drift.ranks) > len(drift.ranks):
        return ""
    return (f" (no majority: rank {drift.reference} is the reference as the lowest rank, not as the right one; "
            "compare against another run to tell which is wrong)")


def _absent(run: Run, step: int, rank: int, consequence: str) -> str:
    """Why a rank the checks need is not there: its part is missing from the run, or (a caller's
    share of the parts) not among those given."""
    if (step, rank) in run.parts:
        return f"step {step}: rank {rank}'s records were not among the parts checked ({consequence})"
    return f"step {step}: rank {rank}'s records are missing ({consequence})"


def _row(step, check, status, rank, ranks, record, index, *, arg, detail, size=float("nan"), group="", seq=None,
         kind="") -> dict:
    return {"step": step, "check": check, "status": status, "rank": rank, "ranks": " ".join(map(str, ranks)),
            "group": group if group is not None else "", "seq": seq, "kind": kind, "op": record["op"],
            "name": record["name"], "scope": record.get("scope") or "", "stage": record.get("stage"),
            "id": record.get("id", index), "arg": arg, "size": size, "detail": detail}


class RanksVerdict:
    """What ``dispatchprobe ranks`` says: the finding first, then the counts.  ``code``: 0 the ranks
    agree, 2 they do not (or inf/nan started on some rank), 1 it cannot judge."""

    def __init__(self, lines: list[str], code: int):
        self.lines = lines
        self.code = code
        self.problems: list[str] = []      # record problems met on the way (a truncated tail, ...)

    def __str__(self) -> str:
        return "\n".join(self.lines)


def merge(results: list[StepResult], run_ranks=None) -> tuple[pd.DataFrame, RanksVerdict]:
    """One table (step, then check order) and the verdict of a list of step results."""
    rows = [r for res in sorted(results, key=lambda x: x.step) for r in res.rows]
    table = pd.DataFrame(rows, columns=COLUMNS)
    table["seq"] = table["seq"].astype("Int64")
    missing = [m for res in results for m in res.missing]
    coll = table[table["check"] == "collective"]
    counts = coll["status"].value_counts()
    steps = sorted({res.step for res in results})
    ranks = sorted({r for res in results for r in res.ranks})
    compared = sum(res.compared for res in results)
    drifts = table[table["check"] == "replica"]
    summary = (f"{len(coll)} collective calls on {coll['group'].nunique()} group(s) over {len(steps)} step(s) and "
               f"{len(ranks)} rank(s): {int(counts.get(AGREE, 0))} agree, {int(counts.get(DIFFERS, 0))} differ, "
               f"{int(counts.get(NOT_JUDGED, 0))} not judged; "
               + (f"{compared} replicated values compared, {len(drifts)} drift(s)" if compared else
                  "no replicas to compare (no gradient was reduced over a data-parallel group, and no other value "
                  "is held equal across ranks)"))
    summary += _tensor_parallel_note(results)
    finding = _first_finding(table)
    if finding:
        lines = [finding, summary]
        first_step = table.loc[table["check"] == "inf/nan", "step"].min()
        lines += [f"  {r.detail} (step {r.step})" for r in table[table["check"] == "inf/nan"].itertuples()
                  if r.step == first_step and not finding.startswith("inf/nan")][:6]
        return table, RanksVerdict(lines + [f"cannot judge: {m}" for m in missing], 2)
    if missing:
        return table, RanksVerdict([f"cannot judge: {missing[0]}", summary]
                                   + [f"cannot judge: {m}" for m in missing[1:]], 1)
    if len(ranks) < 2:
        return table, RanksVerdict([f"cannot judge: the run holds rank {ranks[0] if ranks else '-'} only; "
                                    "`ranks` compares the ranks of one distributed run", summary], 1)
    if not len(coll):
        unnumbered = sum(res.unnumbered for res in results)
        why = (f"{unnumbered} collective record(s) carry no sequence number (recorded by an earlier version: "
               "record the run again)" if unnumbered else
               "no collective is recorded (record the steps under torchrun; collectives left out by `list` or "
               "`scope` still count, but are not recorded)")
        return table, RanksVerdict([f"cannot judge: {why}", summary], 1)
    unjudged = _not_judged_alone(results)
    if unjudged:
        return table, RanksVerdict([unjudged, f"the ranks agree on what they could judge: {summary}"], 1)
    return table, RanksVerdict([f"the ranks agree: {summary}"], 0)


def _not_judged_alone(results: list) -> str:
    """Why the ranks' agreement covers only part of the run, or "": under tensor parallelism each rank
    computes ops on pieces no other rank holds (a column-wise layer's column shards and what follows
    from them, a row-wise layer's partial sums), so no check here sees a wrong kernel among them:
    what follows them is all-reduced into values every rank holds equal, wrong or right."""
    apart = [res for res in results if res.apart]
    if not apart:
        return ""
    first = min(apart, key=lambda res: res.step)
    return (f"cannot judge: {sum(res.apart for res in apart)} op(s) tensor-parallel ranks ran on pieces of their "
            f"own (column or sequence shards, partial sums; the first: {first.first_apart}): no other rank holds "
            "their values, so a wrong kernel among them shows in no check here; compare the run with a run of "
            "other parallelism to judge them")


def _tensor_parallel_note(results: list) -> str:
    """What the checks leave to a compare where tensor parallelism splits the work: the ops each
    rank ran on its own pieces (column or sequence shards, partial sums), which no other rank holds."""
    groups = sorted({tuple(g) for res in results for g in res.tp_groups})
    if not groups:
        return ""
    apart = sum(res.apart for res in results)
    return (f"; tensor-parallel groups {', '.join(str(list(g)) for g in groups)}: ops their members ran on equal "
            f"inputs compared across them, {apart} op(s) a rank ran on its own pieces (column or sequence shards, partial sums) "
            "not judged here (compare the run with a run of other parallelism to judge those)")


def _first_finding(table: pd.DataFrame) -> str | None:
    """The one line that leads the verdict: a rank calling another collective, a collective that
    broke its semantics, a replica drift, where inf/nan started -- the earliest step first."""
    for check, status in (("collective", DIFFERS), ("replica", DIFFERS), ("inf/nan", ORIGIN), ("inf/nan", CAME_IN)):
        hit = table[(table["check"] == check) & (table["status"] == status)]
        if not len(hit):
            continue
        r = hit.sort_values("step", kind="stable").iloc[0]
        where = f"{r['op']} [{r['scope'] or '<top>'}] (step {r['step']}, {r['stage']})"
        if check == "collective":
            return f"collective #{r['seq']} on group {r['group']} differs: {where}: {r['detail']}"
        if check == "replica":
            return f"replica drift on rank {r['ranks']}: {where}: {r['detail']}"
        recv = table[(table["step"] == r["step"]) & (table["status"] == RECEIVED)]
        via = "; ".join(f"rank {x.rank} received them through {x.op} #{x.seq} on group {x.group} "
                        f"[{x.scope or '<top>'}]" for x in recv.itertuples())
        return f"inf/nan started on rank {r['rank']}: {where}: {r['detail']}" + (f"; {via}" if via else "")
    return None


def check_run(path, out: str | None = None, *, tensors: bool = True, progress: bool = False):
    """Check every part of a run; write ``ranks.csv`` and ``ranks.html`` to ``out`` when given."""
    run = load(path)
    if not run.parts:
        raise ValueError(f"{path}: no step*/rank* folders with records")
    # under a launcher (torchrun ... -m dispatchprobe ranks) each rank checks every world-th step
    # (with all of its ranks); rank 0 merges and writes the report
    engine = engine_for(run)
    steps = sorted({step for step, _ in run.parts})
    results = gathered(engine, steps, lambda share: check_parts(
        run, [k for k in run.parts if k[0] in share], tensors=tensors, progress=progress))
    return said_by_rank0(engine, lambda: _report(run, results, out), lambda verdict: (pd.DataFrame(), verdict))


def _report(run, results: list, out: str | None):
    table, verdict = merge(results)
    verdict.problems = run.problems + [line for part in run.parts.values() for line in part.damaged_shards()]
    if out:
        from ...records.writer import atomic_write_text
        from ..frame_csv import csv_text
        from .page import ranks_html
        os.makedirs(out, exist_ok=True)
        atomic_write_text(os.path.join(out, "ranks.csv"), csv_text(table))
        atomic_write_text(os.path.join(out, "ranks.html"), ranks_html(run, table, verdict))
    return table, verdict
