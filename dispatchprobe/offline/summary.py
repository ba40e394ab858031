"""Text summaries of a run for ``dispatchprobe show`` (records only; no torch)."""

from __future__ import annotations

import re

import pandas as pd

from ..records.reader import Run


def summarize(run: Run, top: int = 10, stage: str | None = None) -> str:
    """Steps, ranks, op counts per stage, most frequent ops, and every tensor with nan/inf."""
    m = run.manifest
    ops = run.ops
    # an overflow hit in a compiled graph and its eager re-run are one op call: count the hit once
    reruns = _reruns(run)
    if reruns:
        ops = ops[~_keyed(ops, reruns)]
    if stage:
        ops = ops[ops["stage"] == stage]
    lines = [f"run        {run.path}"]
    if m:
        cfg = m.get("config", {})
        lines.append(f"framework  {m.get('framework')} {m.get('framework_version')}  device {m.get('device')}  "
                     f"task {cfg.get('task')}  level {cfg.get('level')}")
    steps = sorted({s for s, _ in run.parts})
    ranks = sorted({r for _, r in run.parts})
    lines.append(f"steps      {_ranges(steps)}   ranks {_ranges(ranks)}   records {len(ops)}")
    kernel = ops[ops["kind"] == "op"]
    if len(kernel):
        counts = kernel.groupby("stage").size()
        lines.append("op calls   " + "   ".join(f"{s} {n}" for s, n in counts.items())
                     + f"   distinct ops {kernel['op'].nunique()}")
        lines.append(f"top ops")
        for op, n in kernel["op"].value_counts().head(top).items():
            lines.append(f"  {n:7d}  {op}")
    modules = ops[ops["kind"] == "module"]
    if len(modules):
        lines.append(f"module records {len(modules)} ({modules['scope'].nunique()} modules)")
    if reruns:
        lines.append(f"re-runs    {len(reruns)} eager re-run(s) of compiled overflow records (same name, counted once)")
    tensors = run.tensors
    if reruns:
        tensors = tensors[~_keyed(tensors, reruns)]
    if stage:
        tensors = tensors[tensors["stage"] == stage]
    bad = tensors[(tensors["nan"].fillna(0) > 0) | (tensors["inf"].fillna(0) > 0)]
    if len(bad):
        lines.append(f"nan/inf    {len(bad)} tensors in {bad['name'].nunique()} records; first:")
        for _, row in bad.head(5).iterrows():
            lines.append(f"  step {row['step']} rank {row['rank']} {row['name']} {row['arg']} [{row['scope']}] "
                         f"nan={int(row['nan'] or 0)} inf={int(row['inf'] or 0)}")
    else:
        lines.append("nan/inf    none")
    unseen = {cell: why for p in run.parts.values() if p.checks
              for cell, why in (p.checks.get("backward_not_observable") or {}).items()}
    for cell, why in sorted(unseen.items()):
        lines.append(f"unseen     backward of {cell}: {why}")
    checks = [p.checks for p in run.parts.values() if p.checks and "checked" in p.checks]
    if checks:
        total = {k: sum(c.get(k, 0) for c in checks) for k in ("checked", "flagged")}
        lines.append(f"checks     {checks[0].get('task')}: {total['checked']} op calls checked, "
                     f"{total['flagged'] or 'none'} flagged" + ("" if total["flagged"] else
                                                                 " (nothing to list: no records)"))
    for part in run.parts.values():
        if part.truncated:
            lines.append(f"truncated  step {part.step} rank {part.rank}: records end early (process killed?)")
    return "\n".join(lines)


def matching_records(run: Run, pattern: str, stage: str | None = None) -> pd.DataFrame:
    """Tensor rows of the records whose op or name matches ``pattern`` (substring or regex)."""
    try:
        rx = re.compile(pattern)
    except re.error:
        rx = re.compile(re.escape(pattern))
    tensors = run.tensors
    hit = tensors["op"].map(lambda s: bool(rx.search(str(s)))) | tensors["name"].map(lambda s: bool(rx.search(str(s))))
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


def _reruns(run: Run) -> set:
    """(step, rank, id) of the records that re-run a compiled record eagerly (``compiled.rerun``)."""
    return {(step, rank, r["id"]) for (step, rank), part in run.parts.items() for r in part.records
            if (r.get("compiled") or {}).get("rerun")}


def _keyed(rows: pd.DataFrame, keys: set) -> pd.Series:
    return pd.Series([k in keys for k in zip(rows["step"], rows["rank"], rows["id"])], index=rows.index, dtype=bool)


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
