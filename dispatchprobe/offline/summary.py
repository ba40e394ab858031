"""Text summaries of a run for ``dispatchprobe show`` (records only; no torch)."""

from __future__ import annotations

import itertools
import re

import pandas as pd

from ..records import part_summary
from ..records.reader import Run
from .coverage import graphs_note, higher_order_note, unrecorded_steps_note


def summarize(run: Run, top: int = 10, stage: str | None = None) -> str:
    """Steps, ranks, op counts per stage, most frequent ops, and every tensor with nan/inf
    (a grad-probe run: :func:`grad_summary`).  Read from each part's ``summary.json`` where it
    describes the part's records as they are (records/part_summary.py), else from the records."""
    from .grad_compare import is_grad_run
    if is_grad_run(run):
        return grad_summary(run)
    m = run.manifest
    digests = {key: part_digest(part) for key, part in run.parts.items()}
    # an overflow hit in a compiled graph and its eager re-run are one op call: count the hit once
    reruns = sum(d["reruns"] for d in digests.values())
    per_stage = [(key, name, st) for key, d in digests.items() for name, st in d["stages"].items()
                 if stage is None or name == stage]
    lines = [f"run        {run.path}"]
    if m:
        cfg = m.get("config", {})
        lines.append(f"framework  {m.get('framework')} {m.get('framework_version')}  device {m.get('device')}  "
                     f"task {cfg.get('task')}  level {cfg.get('level')}")
        graphs = graphs_note(m)
        if graphs:
            lines.append(f"compiled   {graphs}")
        hops = higher_order_note(m)
        if hops:
            lines.append(f"unrecorded {hops}")
        if unrecorded := unrecorded_steps_note(m):
            lines.append(f"unrecorded {unrecorded}")
    steps = sorted({s for s, _ in run.parts})
    ranks = sorted({r for _, r in run.parts})
    lines.append(f"steps      {_ranges(steps)}   ranks {_ranges(ranks)}   "
                 f"records {sum(st['records'] for _, _, st in per_stage)}")
    counts = {}
    for _, name, st in per_stage:
        if st["ops"]:
            counts[name] = counts.get(name, 0) + sum(st["ops"].values())
    if counts:
        calls = _op_calls(digests, stage)
        lines.append("op calls   " + "   ".join(f"{s} {counts[s]}" for s in sorted(counts))
                     + f"   distinct ops {len(calls)}")
        lines.append(f"top ops")
        for op, n in calls.sort_values(ascending=False).head(top).items():
            lines.append(f"  {n:7d}  {op}")
    modules = sum(st["modules"] for _, _, st in per_stage)
    if modules:
        scopes = {scope for _, _, st in per_stage for scope in st["module_scopes"] if scope is not None}
        lines.append(f"module records {modules} ({len(scopes)} modules)")
    if reruns:
        lines.append(f"re-runs    {reruns} eager re-run(s) of compiled overflow records (same name, counted once)")
    lines += _nonfinite_lines([(key, st["nonfinite"]) for key, _, st in per_stage if st["nonfinite"]])
    unseen = {cell: why for p in run.parts.values() if p.checks
              for cell, why in (p.checks.get("backward_not_observable") or {}).items()}
    for cell, why in sorted(unseen.items()):
        lines.append(f"unseen     backward of {cell}: {why}")
    checks = [p.checks for p in run.parts.values() if p.checks and "checked" in p.checks]
    if checks:
        lines.append("checks     " + checks_line(checks))
    for key, part in run.parts.items():
        # a part whose summary holds has whole records (summarised from complete lines): its own
        # problems, if any, are those of its other files
        whole = digests[key]["ops_bytes"] is not None
        if part.files_end_early if whole else part.truncated:
            lines.append(f"truncated  step {part.step} rank {part.rank}: records end early (process killed?)")
        elif part.closed is False:
            lines.append(f"partial    step {part.step} rank {part.rank}: this step never closed (the process stopped "
                         "during it, or probe.step()/probe.close() did not run): its records may stop mid-step")
    return "\n".join(lines)


def part_digest(part) -> dict:
    """A part's summary (records/part_summary.py): its ``summary.json`` where that still describes
    its ``ops.jsonl``, else reduced from its records now (``ops_bytes`` None: read from records)."""
    digest = part_summary.read(part.path)
    if digest is None:
        digest = part_summary.reduce(part.records, None)
    return digest


def _op_calls(digests: dict, stage: str | None) -> pd.Series:
    """Op calls per op over the parts (in ``stage``, or all), in the order ops first appear in the
    run: sorted by count, ties keep that order as ``value_counts`` over the records would."""
    total: dict[str, int] = {}
    for d in digests.values():
        names = d["op_order"] if stage is None else d["stages"].get(stage, {}).get("ops", ())
        for op in names:
            total[op] = total.get(op, 0) + sum(st["ops"].get(op, 0) for name, st in d["stages"].items()
                                               if stage is None or name == stage)
    return pd.Series(total, dtype="int64")


# what an inline check's counts mean, for the one line that the demo and `show` both print
CHECK_NOTES = {
    "propagated": "propagated inf/nan (from an input or a constant such as a -inf mask; listed in overflow.csv)",
    "suspicious growth": "suspicious growth",
    "expected": "expected (backward overflows in steps the loss scaler skipped; not counted as flagged)",
    "scale collapse": "loss scale collapsing (steps skipped in a row)",
    "discarded": "discarded inf/nan (masked, clamped, compared or cast to integers before any use; "
                 "listed in overflow.json, not counted as flagged)",
    "skipped": "skipped",
    "not_widened": "other op calls left unchecked (float32 inputs only: improve_precision re-runs 16-bit ones)",
    "not_judged": "op calls not judged (a step function such as histc or floor: noise measures nothing there)",
}


def checks_line(checks: list[dict]) -> str:
    """One account of an inline check over the given parts (``checks.json`` or ``probe.summary()``):
    what was checked, what was flagged and every other count the CSV lists."""
    task = checks[0].get("task")
    total = {}
    for c in checks:
        for k, v in c.items():
            if isinstance(v, int) and not isinstance(v, bool):
                total[k] = total.get(k, 0) + v
    line = f"{task}: {total.get('checked', 0)} op calls checked, {total.get('flagged', 0) or 'none'} flagged"
    others = [f"{total[k]} {note}" for k, note in CHECK_NOTES.items() if total.get(k)]
    if others:
        line += "; " + ", ".join(others)
    elif not total.get("flagged"):
        line += " (nothing to list: no records)"
    return line


def demo_report(dump_path: str, task: str, counts: dict | None, example_op: str | None = None) -> str:
    """What a demo prints after training, for every framework's demo: the inline check's account
    (``counts``, its probe's summary) when it flagged nothing, else the run's summary and where to
    look next."""
    import os
    from ..records.reader import load
    checks = task in ("overflow", "free_benchmark")       # records only for what they flag
    lines = [checks_line([counts])] if checks else []     # the same account as `dispatchprobe show`
    if checks and not counts["flagged"]:
        return "\n".join(lines + [f"\nno op was flagged (records in {os.path.abspath(dump_path)}; "
                                   f"see them with: dispatchprobe show {dump_path})"])
    lines += [summarize(load(dump_path)), f"\nrecords written to {os.path.abspath(dump_path)}"]
    if checks:
        lines.append(f"flagged ops: {dump_path}/step*/rank*/{task}.csv;  next: dispatchprobe show {dump_path} "
                     f"--html {task}.html")
    elif example_op:
        lines.append(f"next: dispatchprobe show {dump_path} --op {example_op}")
    return "\n".join(lines)


def _nonfinite_lines(found: list) -> list[str]:
    """The tensors holding nan/inf, sorted by where their values came from (records/nonfinite.py): made
    by the op from finite values (what to look at), written as a constant (a causal mask's -inf:
    intended), or carried from an input (or, a module call's, from the op within it that made them).
    ``found``: ((step, rank), a stage's nan/inf account of part_summary.reduce) in the run's order."""
    if not found:
        return ["nan/inf    none"]
    tensors = sum(nf["tensors"] for _, nf in found)
    made = sum(nf["made"] for _, nf in found)
    constant = sum(nf["constant"] for _, nf in found)
    n_records = sum(nf["records"] for _, nf in found)
    lines = [f"nan/inf    {tensors} tensors in {n_records} records: {made or 'none'} made from finite "
             f"values, {constant} written from an inf/nan constant (masks such as masked_fill(-inf): intended), "
             f"{tensors - made - constant} carried from an input"]
    lines.append("  first made from finite values:" if made else "  first:")
    # each part's stages hold their first rows; the run's first are the first over parts, in tensor order
    rows = []
    for key, group in itertools.groupby(found, key=lambda kn: kn[0]):
        rows += [(key, row) for row in sorted((row for _, nf in group for row in nf["first_made" if made else "first"]),
                                               key=lambda row: row["pos"])]
    for (step, rank), row in rows[:part_summary.FIRST_ROWS]:
        lines.append(f"  step {step} rank {rank} {row['name']} {row['arg']} [{row['scope']}] "
                     f"nan={row['nan']} inf={row['inf']}"
                     + ("" if made else f" ({row['origin']})")
                     + (" (expected: a step the loss scaler skipped)" if row["expected"] else ""))
    return lines


def matching_records(run: Run, pattern: str, stage: str | None = None) -> pd.DataFrame:
    """Tensor rows of the records whose op or name matches ``pattern`` (substring or regex)."""
    search = name_matcher(pattern)
    tensors = run.tensors
    hit = tensors["op"].map(lambda s: bool(search(str(s)))) | tensors["name"].map(lambda s: bool(search(str(s))))
    rows = tensors[hit]
    if stage:
        rows = rows[rows["stage"] == stage]
    cols = ["step", "rank", "name", "scope", "io", "arg", "dtype", "shape", "max", "min", "mean", "norm", "nan", "inf"]
    kernels = _kernels(run)
    if kernels:
        # compiled records (probe_backend with inductor): the generated kernels that computed them
        rows = rows.assign(kernels=[kernels.get(k, "") for k in zip(rows["step"], rows["rank"], rows["id"])])
        cols.append("kernels")
    return rows[cols]


def _kernels(run: Run) -> dict:
    """(step, rank, id) -> the inductor kernels of a compiled record (its ``compiled.kernels``)."""
    out = {}
    for (step, rank), part in run.parts.items():
        for r in part.records:
            names = (r.get("compiled") or {}).get("kernels")
            if names:
                out[(step, rank, r["id"])] = " ".join(names)
    return out


def _ranges(values: list[int]) -> str:
    if not values:
        return "-"
    out, start, prev = [], values[0], values[0]
    for v in values[1:] + [None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(out)


def grad_summary(run: Run) -> str:
    """A grad-probe run per step: parameters, the global gradient norm (over the parameters), the
    largest parameter norm, max and min, and the share of elements exactly zero (level L2)."""
    import math
    cfg = (run.manifest.get("config") or {})
    gp = cfg.get("grad_probe") or {}
    lines = [f"run        {run.path}",
             f"framework  {run.manifest.get('framework')} {run.manifest.get('framework_version')}  device "
             f"{run.manifest.get('device')}  task grad_probe  grad_level {gp.get('grad_level')}  bounds {gp.get('bounds')}"]
    per_step = _grads_per_step(run)
    names = {n for recs in per_step.values() for n in recs}
    lines.append(f"steps      {_ranges(sorted(per_step))}   ranks {_ranges(sorted({r for _, r in run.parts}))}   "
                 f"parameters {len(names)}")
    rows, bad = [], []
    for step, recs in per_step.items():
        norms = {n: r["stats"]["norm"] for n, r in recs.items()}
        top = max(norms, key=lambda n: norms[n] if norms[n] == norms[n] else math.inf)
        zero = [(r["distribution"]["zero"], r["numel"]) for r in recs.values() if r.get("distribution")]
        total = sum(n for _, n in zero)
        rows.append({"step": step, "params": len(recs),
                     "global norm": math.sqrt(sum(v * v for v in norms.values())),
                     "largest norm": norms[top], "parameter": top,
                     "max": max(r["stats"]["max"] for r in recs.values()),
                     "min": min(r["stats"]["min"] for r in recs.values()),
                     "zero share": sum(z * n for z, n in zero) / total if total else None})
        bad += [f"step {step}: {n} (norm {v})" for n, v in norms.items() if not math.isfinite(v)]
    table = pd.DataFrame(rows)
    if "zero share" in table and table["zero share"].isna().all():
        table = table.drop(columns=["zero share"])
    with pd.option_context("display.max_rows", 200, "display.width", 200, "display.max_colwidth", 60):
        lines.append(table.to_string(index=False) if len(table) else "no gradient records")
    if bad:
        lines.append(f"non-finite {len(bad)} gradient(s); first: {bad[0]}")
    for part in run.parts.values():
        if part.truncated:
            lines.append(f"truncated  step {part.step} rank {part.rank}: records end early (process killed?)")
    return "\n".join(lines)


def _grads_per_step(run: Run) -> dict:
    """step -> parameter -> its record; the statistics are the whole gradient's on every rank, so the
    lowest rank's record stands for the step."""
    per_step: dict = {}
    for (step, _), part in sorted(run.parts.items()):
        for rec in part.grads:
            per_step.setdefault(step, {}).setdefault(rec["param"], rec)
    return per_step


def name_matcher(pattern: str):
    """``pattern`` as a search over names: a regex, or the literal text where it is no valid regex."""
    try:
        return re.compile(pattern).search
    except re.error:
        return re.compile(re.escape(pattern)).search


def grad_parameter_rows(run: Run, pattern: str | None = None) -> pd.DataFrame:
    """A grad-probe run's parameters, one row per step and parameter whose name matches ``pattern``
    (substring or regex; all when None): the gradient's norm, max, min and (level L2) share of zeros,
    so a user sees *which* parameter moved without opening the records."""
    match = name_matcher(pattern) if pattern else (lambda name: True)
    rows = [{"step": step, "parameter": name, "dtype": rec["dtype"], "shape": tuple(rec["shape"]),
             "norm": rec["stats"]["norm"], "max": rec["stats"]["max"], "min": rec["stats"]["min"],
             "zero share": (rec.get("distribution") or {}).get("zero")}
            for step, recs in _grads_per_step(run).items() for name, rec in recs.items() if match(name)]
    table = pd.DataFrame(rows, columns=["step", "parameter", "dtype", "shape", "norm", "max", "min", "zero share"])
    order = {name: i for i, name in enumerate(dict.fromkeys(table["parameter"]))}     # the optimizer's order
    table = table.sort_values(["parameter", "step"], key=lambda c: c.map(order) if c.name == "parameter" else c,
                              kind="stable", ignore_index=True)
    if table["zero share"].isna().all():        # levels L0, L1 record no distribution
        table = table.drop(columns=["zero share"])
    return table
