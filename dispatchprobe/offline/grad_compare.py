"""Compare two grad-probe runs: per step and parameter, the share of gradient elements whose
direction (``grad > 0``) agrees; the step and parameter where the runs' gradients part.

Records only (numpy and pandas).  Each run's gradient of a parameter is assembled whole before it
is compared: a DTensor's shards are placed by their offsets, a plain gradient is taken from the
lowest rank that recorded it (DDP's ranks hold the same one), so runs of different parallelism
(one process, DDP, FSDP2) compare element for element.  Parameters pair by name; a name only one
run has pairs, in order, with the other run's next unpaired parameter of the same shape (another
framework's names: MindSpore's ``gamma``/``beta``, ``embedding_table``).

Level L0 records no directions but a checksum of each gradient's bytes: equal checksums of one
kind mean equal bytes.  Checksums of different kinds (msprobe's MD5 against the position-weighted
sums), of different dtypes or of shards cut differently are not comparable, and are said to be,
never counted as a difference.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from ..records.reader import RecordError, Run
from ..standards.loader import standard

COLUMNS = ["step", "param", "numel", "similarity", "flag", "norm_a", "norm_b", "max_a", "max_b", "min_a", "min_b",
           "zero_a", "zero_b", "checksum", "param_b"]
SUMMARY = "summary"


def is_grad_run(run: Run) -> bool:
    return (run.manifest.get("config") or {}).get("task") == "grad_probe" or \
        any(os.path.isfile(os.path.join(p.path, "grads.jsonl")) for p in run.parts.values())


def _by_step(run: Run) -> dict[int, dict[str, list]]:
    """step -> parameter -> [(part, record)] over ranks (lowest rank first), in record order."""
    out: dict = {}
    for (step, _), part in sorted(run.parts.items()):
        for rec in part.grads:
            out.setdefault(step, {}).setdefault(rec["param"], []).append((part, rec))
    return out


def whole_signs(entries: list) -> tuple[np.ndarray, np.ndarray | None] | None:
    """(signs of the whole gradient, mask of the elements known or None for all) from one
    parameter's records over ranks; None when they hold no signs (level L0)."""
    part, rec = entries[0]
    if "sign" not in rec:
        return None
    placements = (rec.get("dtensor") or {}).get("placements") or []
    if not any(p.startswith(("Shard", "_StridedShard", "S(")) for p in placements):
        return _local(part, rec), None
    shape = rec["shape"]
    signs, known = np.zeros(shape, bool), np.zeros(shape, bool)
    for part, rec in entries:
        d = rec["dtensor"]
        where = tuple(slice(o, o + n) for o, n in zip(d["offset"], d["local_shape"]))
        signs[where] = _local(part, rec)
        known[where] = True
    return signs, (None if known.all() else known)


def _local(part, rec) -> np.ndarray:
    local = (rec.get("dtensor") or {}).get("local_shape", rec["shape"])
    return np.unpackbits(part.tensor(rec["sign"]), count=math.prod(local)).astype(bool).reshape(local)


def _checksums(entries: list) -> tuple[str | None, list]:
    """(kind, [(offset, local shape, value)] over shards) of one parameter's L0 checksums; kind None
    when its records hold none.  A gradient that is not sharded: the lowest rank's."""
    part, rec = entries[0]
    kind = "md5" if "md5" in rec else (rec.get("checksum") or {}).get("kind")
    if kind is None:
        return None, []
    placements = (rec.get("dtensor") or {}).get("placements") or []
    if not any(p.startswith(("Shard", "_StridedShard", "S(")) for p in placements):
        entries = entries[:1]
    return kind, sorted((tuple((r.get("dtensor") or {}).get("offset", ())),
                         tuple((r.get("dtensor") or {}).get("local_shape", ())),
                         r["md5"] if kind == "md5" else (r.get("checksum") or {}).get("value")) for _, r in entries)


def checksum_match(entries_a: list, entries_b: list) -> tuple[str, str | None]:
    """("equal" / "unequal" / "not comparable" / "", why not comparable) of one parameter's L0
    checksums in two runs; "" when either run recorded none."""
    (kind_a, sums_a), (kind_b, sums_b) = _checksums(entries_a), _checksums(entries_b)
    if kind_a is None or kind_b is None:
        return "", None
    ra, rb = entries_a[0][1], entries_b[0][1]
    if kind_a != kind_b:
        return "not comparable", f"run A's checksums are {kind_a}, run B's {kind_b}: record both runs with the " \
                                 "same checksum setting"
    if ra["dtype"] != rb["dtype"]:
        return "not comparable", f"the gradients are {ra['dtype']} in A, {rb['dtype']} in B: checksums of " \
                                 "different bytes"
    if [x[:2] for x in sums_a] != [x[:2] for x in sums_b]:
        return "not comparable", "the runs shard the gradient differently: checksums are of each rank's shard"
    return ("equal" if [x[2] for x in sums_a] == [x[2] for x in sums_b] else "unequal"), None


def _pair_names(names_a: list[str], recs_a: dict, recs_b: dict) -> list[tuple[str, str]]:
    """(name in A, name in B): equal names, then the rest in order by equal shape."""
    other = {n: n for n in names_a if n in recs_b}
    rest_b = [n for n in recs_b if n not in recs_a]
    for n in (n for n in names_a if n not in recs_b):
        shape = recs_a[n][0][1]["shape"]
        match = next((m for m in rest_b if recs_b[m][0][1]["shape"] == shape), None)
        if match is not None:
            rest_b.remove(match)
            other[n] = match
    return [(n, other[n]) for n in names_a if n in other]       # in A's order


@dataclass
class GradVerdict:
    """What a grad compare concluded; ``str()`` is the terminal summary."""

    a: str
    b: str
    steps: list
    params: int
    overall: dict                              # step -> weighted similarity
    first: dict | None = None                  # the first flagged (step, parameter): its row
    flagged: list = field(default_factory=list)
    problems: list = field(default_factory=list)
    report: str | None = None
    damaged: list = field(default_factory=list)
    checksums: dict | None = None              # level L0: gradients whose checksums were equal, unequal, ...
    not_compared: list = field(default_factory=list)   # parameters left out at one step or more (warnings say why)

    @property
    def passed(self) -> bool:
        return self.first is None

    def __str__(self) -> str:
        rule = standard("compare_standards")["grad_probe"]
        lines = [f"grad compare: {self.a} (A) vs {self.b} (B): {len(self.steps)} step(s), {self.params} parameter(s)"]
        if self.checksums is not None:
            return self._checksum_summary(lines)
        lines.append("step  similarity (weighted over the parameters)")
        for step in self.steps:
            mark = ""
            hits = [f for f in self.flagged if f["step"] == step]
            if hits:
                mark = f"   {len(hits)} flagged: " + ", ".join(f"{f['param']} {f['similarity']:.4f}" for f in hits[:3]) \
                    + (" ..." if len(hits) > 3 else "")
            sim = self.overall[step]
            lines.append(f"{step:>4}  {'n/a' if sim != sim else f'{sim:.4f}':>6}{mark}")
        if self.first is None and self.not_compared:
            lines.append(f"no divergence among the compared gradients (direction similarity >= "
                         f"{rule['first_step_min']} at the first step, drops of no more than {rule['max_drop']})"
                         + self._not_compared_line())
        elif self.first is None:
            lines.append(f"agree: every parameter's direction similarity is >= {rule['first_step_min']} at the first "
                         f"step and drops by no more than {rule['max_drop']} from step to step")
        else:
            f = self.first
            lines.append(f"first divergence: step {f['step']}, parameter {f['param']}: direction similarity "
                         f"{f['similarity']:.4f} ({f['flag']})")
        lines += [f"warning: {p}" for p in self.problems]
        if self.report:
            lines.append(f"report: {self.report}")
        return "\n".join(lines)

    def _not_compared_line(self) -> str:
        """The parameters a partial compare leaves out: counted where the verdict is given, since
        "agree" about them would be a judgement nothing made (the warnings say why each is out)."""
        names = ", ".join(self.not_compared[:3]) + (" ..." if len(self.not_compared) > 3 else "")
        return f"; {len(self.not_compared)} parameter(s) not compared at one step or more ({names}): not judged, " \
               "see the warnings"

    def _checksum_summary(self, lines: list) -> str:
        """Level L0: the records hold checksums, not directions: equal bytes or not, per gradient."""
        c = self.checksums
        compared = c["equal"] + c["unequal"]
        lines.append(f"level L0 (no gradient directions): checksums of {compared} gradient(s) compared over the steps: "
                     f"{c['equal']} equal, {c['unequal']} unequal" +
                     (f", {c['not comparable']} not comparable" if c["not comparable"] else ""))
        if self.first is None and self.not_compared:
            lines.append("no difference among the compared gradients (equal checksums)" + self._not_compared_line())
        elif self.first is None:
            lines.append("agree: every compared gradient has the same bytes in both runs (equal checksums)")
        else:
            f = self.first
            lines.append(f"first difference: step {f['step']}, parameter {f['param']}: its checksums differ (the "
                         "bytes differ; record at L1 or L2 to see how far the directions part)")
        lines += [f"warning: {p}" for p in self.problems]
        if self.report:
            lines.append(f"report: {self.report}")
        return "\n".join(lines)


def grad_compare(run_a: Run, run_b: Run, out: str | None = None):
    """Compare two grad-probe runs (A under test, B the benchmark): ``(table, verdict)``."""
    from .compare.verdict import Result
    for run in (run_a, run_b):
        if not is_grad_run(run):
            raise RecordError(f"{run.path} is not a grad-probe run; compare a grad-probe run with another one")
    a, b = _by_step(run_a), _by_step(run_b)
    steps = sorted(set(a) & set(b))
    problems = [f"step {s}: only in {run.path}; not compared" for run, mine, other in ((run_a, a, b), (run_b, b, a))
                for s in sorted(set(mine) - set(other))]
    if not steps:
        raise RecordError(f"{run_a.path} and {run_b.path} have no step in common ({sorted(a)} vs {sorted(b)})")
    rows, no_signs, unpaired, incomparable = [], False, {}, {}
    for step in steps:
        pairs = _pair_names(list(a[step]), a[step], b[step])
        for side, names, used in (("A", a[step], {x for x, _ in pairs}), ("B", b[step], {y for _, y in pairs})):
            for n in names:
                if n not in used:
                    unpaired.setdefault((side, n), step)
        for name_a, name_b in pairs:
            ra, rb = a[step][name_a][0][1], b[step][name_b][0][1]
            match, why = checksum_match(a[step][name_a], b[step][name_b])
            if why:
                incomparable.setdefault(why, (step, name_a))
            row = {"step": step, "param": name_a, "param_b": name_b if name_b != name_a else "",
                   "numel": ra["numel"], "similarity": math.nan, "same": 0, "total": 0, "checksum": match}
            for side, rec in (("a", ra), ("b", rb)):
                st = rec.get("stats") or {}
                row.update({f"norm_{side}": st.get("norm"), f"max_{side}": st.get("max"), f"min_{side}": st.get("min"),
                            f"zero_{side}": (rec.get("distribution") or {}).get("zero")})
            strided = [n for n, r in ((name_a, ra), (name_b, rb))
                       if any(p.startswith("_StridedShard") for p in (r.get("dtensor") or {}).get("placements", ()))]
            sa = sb = None
            if strided:
                problems.append(f"step {step}: {strided[0]} is sharded in strides (_StridedShard), which compare "
                                "cannot place in the whole gradient; not compared")
            else:
                sa, sb = whole_signs(a[step][name_a]), whole_signs(b[step][name_b])
            if strided:
                pass
            elif sa is None or sb is None:
                no_signs = True
            elif sa[0].shape != sb[0].shape:
                problems.append(f"step {step}: {name_a} has shape {list(sa[0].shape)} in A, {list(sb[0].shape)} in B; "
                                "not compared")
            else:
                known = sa[1] if sb[1] is None else sb[1] if sa[1] is None else sa[1] & sb[1]
                same = sa[0] == sb[0]
                row["same"], row["total"] = (int(same.sum()), same.size) if known is None else \
                    (int(same[known].sum()), int(known.sum()))
                if row["total"]:
                    row["similarity"] = row["same"] / row["total"]
                else:       # no element known in both runs: nothing compared, no similarity (not 0)
                    problems.append(f"step {step}: {name_a}: no element of it is known in both runs (each recorded "
                                    "other shards of it); not compared")
            rows.append(row)
    problems += [f"{n}: only in run {side} (from step {step}), or no parameter of its shape to pair with; not compared"
                 for (side, n), step in unpaired.items()]
    problems += [f"checksums not compared from step {step} ({name} first): {why}"
                 for why, (step, name) in incomparable.items()]
    by_checksum = no_signs and not any(r["total"] for r in rows)       # level L0: no directions
    if by_checksum and not any(r["checksum"] in ("equal", "unequal") for r in rows):
        why = next(iter(incomparable), "record both at L1 or L2 to compare gradient directions")
        raise RecordError(f"the runs hold no gradient signs (grad_level L0) and no checksums to compare: {why}")
    table = pd.DataFrame(rows)
    table["flag"] = ""
    flagged = _flag_checksums(table) if by_checksum else _flag(table)
    overall = {s: _weighted(table[table["step"] == s]) for s in steps}
    summary = pd.DataFrame([{"step": s, "param": SUMMARY, "numel": int(table.loc[table["step"] == s, "total"].sum()),
                             "similarity": overall[s], "flag": "", "checksum": ""} for s in steps])
    params = table["param"].nunique()
    skipped = _not_compared(table, by_checksum) + [n for _, n in unpaired]
    table = pd.concat([table, summary], ignore_index=True)
    table = table[COLUMNS]
    verdict = GradVerdict(a=str(run_a.path), b=str(run_b.path), steps=steps, params=params, overall=overall,
                          first=flagged[0] if flagged else None, flagged=flagged, problems=problems,
                          checksums=_checksum_counts(table) if by_checksum else None,
                          not_compared=list(dict.fromkeys(skipped)))
    if out:
        verdict.report = _write(out, table, verdict, run_a, run_b)
    return Result(table, verdict)


def _not_compared(table: pd.DataFrame, by_checksum: bool) -> list:
    """The parameters (table order) with a step at which nothing was compared: no direction
    similarity, or at L0 no checksums of one kind both runs hold."""
    rows = table[table["param"] != SUMMARY]
    left = ~rows["checksum"].isin(["equal", "unequal"]) if by_checksum else rows["similarity"].isna()
    return list(dict.fromkeys(rows.loc[left, "param"]))


def _weighted(rows: pd.DataFrame) -> float:
    total = rows["total"].sum()
    return float(rows["same"].sum() / total) if total else math.nan


def _flag_checksums(table: pd.DataFrame) -> list[dict]:
    """Level L0: a parameter whose checksums differ is flagged (its bytes differ; the records hold
    no directions to say by how much).  Sets ``flag``; returns the flagged rows in table order."""
    out = []
    for i in table.index[table["checksum"] == "unequal"]:
        table.at[i, "flag"] = "checksums differ: the gradient's bytes differ (L0 records no directions)"
        out.append(table.loc[i].to_dict())
    return out


def _checksum_counts(table: pd.DataFrame) -> dict:
    """How many gradients' checksums were equal, unequal, not comparable."""
    counts = table["checksum"].value_counts()
    return {k: int(counts.get(k, 0)) for k in ("equal", "unequal", "not comparable")}


def _flag(table: pd.DataFrame) -> list[dict]:
    """msprobe's rule per parameter, in step order: below ``first_step_min`` at the first compared
    step, or a drop of more than ``max_drop`` from the previous compared step.  Sets ``flag``;
    returns the flagged rows, earliest step first (a step's parameters in run A's order)."""
    rule = standard("compare_standards")["grad_probe"]
    prev: dict[str, float] = {}
    out = []
    for i, row in table.iterrows():
        sim, name = row["similarity"], row["param"]
        if sim != sim:
            continue
        why = ""
        if name not in prev and sim < rule["first_step_min"]:
            why = f"below {rule['first_step_min']} at its first compared step"
        elif name in prev and prev[name] - sim > rule["max_drop"]:
            why = f"was {prev[name]:.4f} at the step before: a drop of more than {rule['max_drop']}"
        prev[name] = sim
        if why:
            table.at[i, "flag"] = why
            out.append(table.loc[i].to_dict())
    return out


def _write(out: str, table: pd.DataFrame, verdict: GradVerdict, run_a: Run, run_b: Run) -> str:
    """grad_compare.csv (one row per step and parameter), similarities.csv (msprobe's layout:
    parameters x steps, with the summary row) and grad_compare.html (the heat map)."""
    from ..records.writer import atomic_write_text
    from .frame_csv import csv_text
    from .grad_page import heat_map_page
    os.makedirs(out, exist_ok=True)
    atomic_write_text(os.path.join(out, "grad_compare.csv"), csv_text(table))
    wide = table.pivot(index="param", columns="step", values="similarity")
    order = list(dict.fromkeys(table["param"]))
    wide = wide.loc[order]
    atomic_write_text(os.path.join(out, "similarities.csv"), wide.to_csv(index_label="step"))
    page = os.path.join(out, "grad_compare.html")
    atomic_write_text(page, heat_map_page(table, verdict, run_a.manifest, run_b.manifest))
    return page
