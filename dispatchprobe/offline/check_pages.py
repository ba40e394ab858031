"""The pages of the inline checks (overflow, free benchmark): a run's flagged ops as the module tree."""

from __future__ import annotations

import json
import os

import numpy as np
import pandas as pd

from .page_kit import cell, ops_page
from .summary import CHECK_NOTES

# ---- inline-check runs (overflow, free_benchmark) as the module tree: one renderer, a mode per task ------
_TENSOR_COLS = ["io", "arg", "dtype", "shape", "max", "min", "mean", "norm", "nan", "inf"]

# overflow classes as levels (docs/inline-checks.md): critical created inf/nan from finite inputs
OVERFLOW_LEVELS = [{"name": "expected", "short": "expected", "color": "#8a9ba8"},     # a step the loss scaler skipped
                   {"name": "suspicious growth", "short": "growth", "color": "#f0b429"},
                   {"name": "propagated", "short": "propagated", "color": "#7a3cbd"},
                   {"name": "critical", "short": "critical", "color": "#d9363e"}]
_OVERFLOW_COLS = ["class", "call", "dtype", "nan", "inf", "growth", "replay", "float64_max_abs", "dtype_max",
                  "exceeds_dtype_range", "loss_scale", "grad_fn", "stack"]
# free-benchmark flags as levels, by how far the op's output moved past its dtype's limit (max_rel / threshold)
FREE_BENCHMARK_LEVELS = [{"name": "over the limit", "short": "flagged", "color": "#f0b429"},
                         {"name": "over 10x the limit", "short": "10x", "color": "#e8702a"},
                         {"name": "inf/nan differ", "short": "inf/nan", "color": "#d9363e"}]
_FREE_BENCHMARK_COLS = ["max_rel", "threshold", "x limit", "pert_mode", "dtype", "shape", "output_index", "sign_flips"]


def check_task(run) -> str:
    """The inline check a run was recorded with (``overflow`` or ``free_benchmark``), from its step/rank
    folders' ``checks.json`` or check files; a ValueError for any other run."""
    for part in run.parts.values():
        task = (part.checks or {}).get("task")
        if task in CHECK_PAGES:
            return task
        for task, mode in CHECK_PAGES.items():
            if os.path.isfile(os.path.join(part.path, mode["file"])):
                return task
    raise ValueError(f"{run.path}: not an overflow or free_benchmark run (no overflow.json, free_benchmark.csv or "
                     "checks.json of either task in any step/rank folder); record with task='overflow' or "
                     "task='free_benchmark'")


def _part_files(run, name: str, read) -> list:
    """``read(path)`` of each step/rank folder's file ``name`` that exists, in (step, rank) order."""
    paths = [os.path.join(run.parts[k].path, name) for k in sorted(run.parts)]
    return [read(p) for p in paths if os.path.isfile(p)]


def overflow_rows(run) -> pd.DataFrame:
    """Every part's ``overflow.json`` rows, as the page's ops (class as the level, critical ones marked)."""
    rows = [r for part in _part_files(run, "overflow.json", _read_json) for r in part["rows"]]
    rows = pd.DataFrame(rows, columns=["step", "rank", "id", "stage", "op", "name", "scope"] + _OVERFLOW_COLS)
    levels = {lv["name"]: i for i, lv in enumerate(OVERFLOW_LEVELS)}
    levels["scale collapse"] = levels["critical"]      # the loss scaler skipping step after step: a row of its own
    return rows.assign(sev=rows["class"].map(levels).fillna(0)
                       .astype(int), mark=rows["class"] == "critical", op=rows["name"].where(rows["name"] != "", rows["op"]))


def free_benchmark_rows(run) -> pd.DataFrame:
    """Every part's ``free_benchmark.csv`` rows, as the page's ops: the level by max_rel / threshold, every
    flagged op marked (the first of each stage is the tree's mark)."""
    parts = _part_files(run, "free_benchmark.csv", lambda p: pd.read_csv(p, dtype={"output_index": str, "shape": str,
                                                                                  "id": "Int64"}, keep_default_na=False))
    cols = ["rank", "pert_mode", "stage", "step", "api_name", "max_rel", "dtype", "shape", "output_index",
            "threshold", "sign_flips", "scope", "op", "id"]
    rows = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=cols)
    rel = pd.to_numeric(rows["max_rel"], errors="coerce").astype(float)
    ratio = rel / pd.to_numeric(rows["threshold"], errors="coerce").astype(float)
    sev = np.where(~np.isfinite(rel.to_numpy()), 2, np.where(ratio.to_numpy() > 10, 1, 0))
    return rows.assign(max_rel=rel, **{"x limit": ratio.round(3)}, sev=sev, mark=True,
                       op=rows["api_name"].where(rows["api_name"] != "", rows["op"]),
                       scope=rows["scope"].replace("", None))


def _read_json(path: str):
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _checked(run) -> tuple[dict, int]:
    """The run's check counts summed over its parts, and the number of parts."""
    counts = {}
    for p in run.parts.values():
        for k, v in (p.checks or {}).items():
            if isinstance(v, int) and not isinstance(v, bool):
                counts[k] = counts.get(k, 0) + v
    return counts, len(run.parts)


def overflow_summary(run, rows: pd.DataFrame) -> list[str]:
    """What the page's heading says: the counts, and the op that first created inf/nan in each stage."""
    counts, parts = _checked(run)
    by_class = rows["class"].value_counts()
    lines = [f"overflow run: {counts.get('checked', 0)} op calls checked in {parts} step/rank part(s): "
             + ", ".join(f"{int(by_class.get(lv['name'], 0))} {lv['name']}" for lv in reversed(OVERFLOW_LEVELS))]
    critical = rows[rows["class"] == "critical"]
    for stage, r in critical.groupby("stage", sort=False).head(1).set_index("stage").iterrows():
        replay = f"; float64 replay: {r['replay']}" if r["replay"] else ""
        if r["replay"] == "precision" and r["exceeds_dtype_range"] in (True, "True"):
            replay += f" (float64 max {float(r['float64_max_abs']):.6g} > {r['dtype']} max {float(r['dtype_max']):.6g})"
        lines.append(f"first op to create inf/nan in {stage}: {r['op']} [{r['scope'] or '<top>'}] call {r['call']} "
                     f"(step {r['step']} rank {r['rank']}): {r['inf']} inf, {r['nan']} nan from finite inputs{replay}")
    for _, r in rows[rows["class"] == "scale collapse"].head(1).iterrows():
        lines.append(f"loss scale collapsing (step {r['step']} rank {r['rank']}): {r['loss_scale']}")
    expected = rows[rows["class"] == "expected"]
    if len(expected):
        r = expected.iloc[0]
        lines.append(f"{len(expected)} expected backward overflow(s) in steps the loss scaler skipped (first: {r['op']} "
                     f"[{r['scope'] or '<top>'}] step {r['step']} rank {r['rank']}: {r['loss_scale']})")
    if not len(critical):
        lines.append("no op created inf/nan from finite inputs" + (" outside the skipped steps" if len(expected) else ""))
    return lines


def free_benchmark_summary(run, rows: pd.DataFrame) -> list[str]:
    """What the page's heading says: mode, counts, the first flagged op of each stage and the largest excess."""
    counts, parts = _checked(run)
    cfg = ((run.manifest or {}).get("config") or {}).get("free_benchmark") or {}
    modes = ", ".join(sorted(set(rows["pert_mode"].astype(str)))) or cfg.get("pert_mode", "?")
    by_level = np.bincount(rows["sev"].to_numpy(int), minlength=len(FREE_BENCHMARK_LEVELS))
    lines = [f"free_benchmark run ({modes}, {cfg.get('handler_type', 'check')}): {counts.get('checked', 0)} op calls "
             f"re-run in {parts} step/rank part(s), {len(rows)} flagged: "
             + ", ".join(f"{by_level[i]} {lv['name']}" for i, lv in reversed(list(enumerate(FREE_BENCHMARK_LEVELS))))]

    def say(r) -> str:
        return (f"{r['op']} [{r['scope'] or '<top>'}] (step {r['step']} rank {r['rank']}): max_rel {r['max_rel']:.6g} > "
                f"limit {r['threshold']:.6g} ({r['x limit']:.3g}x), {r['dtype']} {r['shape']}")
    for stage, r in rows.groupby("stage", sort=False).head(1).set_index("stage").iterrows():
        lines.append(f"first flagged op in {stage}: " + say(r))
    if len(rows) > 1:
        lines.append("largest excess: " + say(rows.iloc[int(np.nanargmax(rows["x limit"].fillna(np.inf).to_numpy()))]))
    if not len(rows):
        lines.append("no op moved past its limit" + (" of those judged" if counts.get("not_judged") else ""))
    if counts.get("not_judged"):      # as `show` says them: a page says no more than the check did
        lines.append(f"{counts['not_judged']} {CHECK_NOTES['not_judged']}")
    if counts.get("not_widened"):
        lines.append(f"{counts['not_widened']} float32-only op calls not re-run (improve_precision widens 16-bit ops; "
                     "set free_benchmark.widen_float32 to check float32 ops against float64)")
    return lines


# one page per inline check: its file, rows, heading, levels, mark, op columns, filters and legend
CHECK_PAGES = {
    "overflow": {"file": "overflow.json", "rows": overflow_rows, "summary": overflow_summary,
                 "title": "dispatchprobe overflow", "tree_heading": "Where inf/nan appeared: module tree",
                 "levels": OVERFLOW_LEVELS, "mark": "first {stage} overflow", "op_cols": _OVERFLOW_COLS,
                 "full_table": "overflow.csv", "flags": [("nan", "nan only", "nan")],    # nan, not only inf
                 "legend": "critical: finite inputs, inf/nan output (the op that created it); propagated: inf/nan "
                           "in and out; suspicious growth: output norm over 100x the largest input norm; expected: "
                           "a backward overflow in a step the loss scaler skipped; scale collapse: the loss scaler "
                           "skipped many steps in a row.  A "
                           "recorded op lists its tensors' statistics; its inputs are saved for run-ut."},
    "free_benchmark": {"file": "free_benchmark.csv", "rows": free_benchmark_rows, "summary": free_benchmark_summary,
                       "title": "dispatchprobe free_benchmark", "tree_heading": "Ops flagged by the free benchmark: "
                       "module tree", "levels": FREE_BENCHMARK_LEVELS, "mark": "first {stage} flagged op",
                       "op_cols": _FREE_BENCHMARK_COLS, "full_table": "free_benchmark.csv", "flags": [],
                       "legend": "Each op was re-run on perturbed inputs (pert_mode) and flagged when its output moved "
                                 "more than its dtype's limit (max_rel > threshold; x limit = max_rel / threshold); "
                                 "ops not flagged are not listed.  A flagged op lists its tensors' statistics; its "
                                 "inputs are saved for run-ut."},
}


def _stat(v, nan_count):
    """A tensor statistic as the page shows it: a missing value of a tensor holding nan is 'nan' (not blank)."""
    if isinstance(v, float) and v != v and nan_count and nan_count == nan_count and nan_count > 0:
        return "nan"
    return cell(v)


def check_html(run) -> str:
    """An inline-check run as the module tree (CHECK_PAGES): each listed op at its level, the first marked
    op of each stage (the op that first created inf/nan; the first flagged op) marked and selected; an op
    with a record shows its tensors' statistics."""
    mode = CHECK_PAGES[check_task(run)]
    ops = mode["rows"](run).reset_index(drop=True)

    def rows_of(labels):
        """Each chosen op's tensors, from its part's records by record id."""
        out = {}
        for i in labels:
            rec_id = ops.at[i, "id"]
            if rec_id is None or rec_id is pd.NA or rec_id == "" or rec_id != rec_id:
                continue
            t = run.parts[(int(ops.at[i, "step"]), int(ops.at[i, "rank"]))].tensors
            t = t[t["id"] == int(rec_id)]
            out[i] = [[_stat(v, r.nan) for v in r] for r in t[_TENSOR_COLS].itertuples(index=False)]
        return out

    flags = [(field, label, badge, pd.to_numeric(ops[field], errors="coerce").fillna(0) > 0)
             for field, label, badge in mode["flags"]]
    return ops_page(ops, title=mode["title"], tree_heading=mode["tree_heading"], summary=mode["summary"](run, ops),
                    levels=mode["levels"], mark=mode["mark"], op_cols=mode["op_cols"], row_cols=_TENSOR_COLS,
                    rows_of=rows_of, fold_col="stack" if "stack" in mode["op_cols"] else "", flags=flags,
                    meta={"run": run.path}, manifest=run.manifest or {}, full_table=mode["full_table"],
                    legend=mode["legend"])
