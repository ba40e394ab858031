"""compare's reports: CSV, .xlsx (failing rows highlighted) and one self-contained HTML page.

The HTML has no external resource: plotly.js and the page's own script are inline, the data is an
inline JSON block.  No torch (docs/architecture.md: the offline side reads only records).
"""

from __future__ import annotations

import html
import json
import math
import os
import re

import numpy as np
import pandas as pd

from ..records.reader import RecordError, load
from ..records.writer import atomic_write_text
from ..standards import metrics as M
from ..standards.verdicts import NOT_JUDGED
from . import nonfinite

# columns a chart can show, and whether larger is worse: compare's metric columns and two of its own
CHART_METRICS = M.derived(lambda: {**{m: M.METRICS[m].larger_is_worse for m in M.compare_columns()},
                                   "error": True, "norm_rel_diff": True})


def write_reports(out: str, table: pd.DataFrame, verdict, manifest_a: dict, manifest_b: dict,
                  metric: str = "cosine", progress: bool = False) -> str:
    """Write compare.csv, unmatched.csv, compare.xlsx, compare.html into ``out``; returns the folder.
    ``progress``: a tqdm bar over the four files (big runs spend seconds here)."""
    if metric not in CHART_METRICS:
        raise ValueError(f"--metric must be one of {', '.join(CHART_METRICS)}, not {metric!r}")
    os.makedirs(out, exist_ok=True)
    from tqdm import tqdm
    steps = [("compare.csv", lambda p: _write_csv(p, table)),
             ("unmatched.csv", lambda p: _write_csv(p, verdict.unmatched)),
             ("compare.xlsx", lambda p: write_xlsx(p, table, verdict)),
             ("compare.html", lambda p: atomic_write_text(p, render_html(table, verdict, manifest_a, manifest_b,
                                                                          metric)))]
    with tqdm(total=len(steps), desc="report", unit="file", disable=not progress, leave=False) as bar:
        for name, write in steps:
            bar.set_postfix_str(name)
            write(os.path.join(out, name))
            bar.update()
    return os.path.abspath(out)


def _write_csv(path: str, df: pd.DataFrame) -> None:
    df.to_csv(path + ".tmp", index=False)
    os.replace(path + ".tmp", path)


# ---- spreadsheet ------------------------------------------------------------------------------------
# Rows in the ``compare`` sheet: every row of runs up to XLSX_MAX_ROWS; of bigger ones the failing rows
# (origin rows, then errors, then warnings, up to XLSX_MAX_ROWS), in execution order.  Why bounded: a
# spreadsheet cell costs ~4 us to write (13k rows x 55 columns took 11 s); compare.csv keeps every row.
XLSX_MAX_ROWS = 4000
_RANK = {"error": 1, "warning": 2}
_FILLS = {"origin": {"bg_color": "#C0392B", "font_color": "#FFFFFF", "bold": True},
          "error": {"bg_color": "#FFC7CE"}, "warning": {"bg_color": "#FFEB9C"}}


def xlsx_rows(table: pd.DataFrame) -> pd.DataFrame:
    """The rows of the ``compare`` sheet, in execution order."""
    if len(table) <= XLSX_MAX_ROWS:
        return table
    rank = table["status"].map(_RANK).fillna(9).to_numpy()
    rank = np.where(table["origin"].fillna(False).astype(bool).to_numpy() & (rank == 1), 0, rank)
    order = np.argsort(rank, kind="stable")[:XLSX_MAX_ROWS]
    return table.iloc[np.sort(order[rank[order] < 9])]


def write_xlsx(path: str, table: pd.DataFrame, verdict) -> None:
    """Sheets ``summary`` (the verdict, counts), ``compare`` (see XLSX_MAX_ROWS; origin rows bold on red,
    errors red, warnings yellow) and ``unmatched``; frozen header, autofilter, fitted widths."""
    import xlsxwriter

    tmp = path + ".tmp.xlsx"
    wb = xlsxwriter.Workbook(tmp, {"constant_memory": True, "strings_to_numbers": False,
                                   "strings_to_formulas": False, "strings_to_urls": False})
    bold = wb.add_format({"bold": True})
    fills = {k: wb.add_format(v) for k, v in _FILLS.items()}
    rows = xlsx_rows(table)

    ws = wb.add_worksheet("summary")
    ws.set_column(0, 0, 110)
    lines = str(verdict).splitlines()
    shown = (f"sheet compare: all {len(table)} rows" if len(rows) == len(table) else
             f"sheet compare: {len(rows)} failing rows of {len(table)} (origin rows, then errors, then warnings, "
             f"at most {XLSX_MAX_ROWS}; every row is in compare.csv)")
    r = 0
    for line in lines + ["", shown, "", "rows by stage and status"]:
        ws.write_string(r, 0, line, bold if r == 0 else None)
        r += 1
    if len(table):
        counts = table.groupby(["stage", "status"]).size().unstack(fill_value=0)
        ws.write_row(r, 1, [str(c) for c in counts.columns], bold)
        r += 1
        for stage, vals in counts.iterrows():
            ws.write_string(r, 0, str(stage))
            ws.write_row(r, 1, [int(v) for v in vals])
            r += 1

    status = rows["status"].tolist() if "status" in rows.columns else [None] * len(rows)
    origin = rows["origin"].fillna(False).astype(bool).tolist() if "origin" in rows.columns else [False] * len(rows)
    fmt = [fills["origin"] if o and s == "error" else fills.get(s) for s, o in zip(status, origin)]
    _sheet(wb.add_worksheet("compare"), rows, bold, fmt)
    _sheet(wb.add_worksheet("unmatched"), verdict.unmatched, bold, [None] * len(verdict.unmatched))
    wb.close()
    os.replace(tmp, path)


def _sheet(ws, df: pd.DataFrame, bold, row_formats: list) -> None:
    cols = list(df.columns)
    values = [_cells(df[c]) for c in cols]
    ws.write_row(0, 0, cols, bold)
    ws.freeze_panes(1, 0)
    ws.autofilter(0, 0, max(len(df), 1), max(len(cols) - 1, 0))
    for j, (name, col) in enumerate(zip(cols, values)):
        sample = [len(v) if isinstance(v, str) else 11 for v in col[:500] if v is not None]
        ws.set_column(j, j, min(max([len(name) + 3] + sample), 48))
    for i, (row, f) in enumerate(zip(zip(*values), row_formats), 1):
        ws.write_row(i, 0, row, f)


def _cells(s: pd.Series) -> list:
    """A column as cell values: numbers, bools, strings; None for a missing value, 'inf'/'nan' as text."""
    if pd.api.types.is_bool_dtype(s) and not s.hasnans:
        return s.tolist()
    if pd.api.types.is_integer_dtype(s) and not s.hasnans:
        return s.tolist()
    if pd.api.types.is_numeric_dtype(s) and not pd.api.types.is_bool_dtype(s):
        return [None if x != x else x if x - x == 0 else str(x) for x in s.to_numpy(np.float64).tolist()]
    return [_cell(v) for v in s.tolist()]


def _cell(v):
    """A spreadsheet cell: numbers as :func:`_num` gives them, sequences and others as text."""
    v = _num(v)
    if v is None or isinstance(v, (str, bool, int, float)):
        return v
    return str(list(v)) if isinstance(v, (tuple, list)) else str(v)


# ---- HTML -------------------------------------------------------------------------------------------
# The page embeds what it shows, not the table: per-module aggregates, chart points (one per op output),
# and per module at most OPS_PER_NODE ops (failing and divergence ops first) with their tensor rows.
MAX_CHART_PARTS = 64   # step/rank parts charted (the selector lists them)
OPS_PER_NODE = 40
UNMATCHED_PER_NODE = 40
HEATMAP_MODULES = 60
_SEVERITY = {"error": 3, "warning": 2, "pass": 1, NOT_JUDGED: 0}
# the explorer's levels by severity (templates/explorer.js): name, short count label, colour
COMPARE_LEVELS = [{"name": "not judged", "short": "", "color": "#bbb"}, {"name": "pass", "short": "", "color": "#3fa34d"},
                  {"name": "warning", "short": "warn", "color": "#f0b429"}, {"name": "error", "short": "err", "color": "#d9363e"}]
_ROW_COLS = ["io", "arg", "dtype_a", "dtype_b", "shape_a", "shape_b"] + \
    [f"{s}_{side}" for s in ("max", "min", "mean", "norm") for side in ("a", "b")] + \
    ["nan_a", "nan_b", "inf_a", "inf_b", "checksum_match"]
_ROW_METRICS = ["cosine", "max_abs_err", "max_rel_err", "rel_l2_err", "stats_err"]


def chart_metric(table: pd.DataFrame, metric: str) -> str:
    """``metric`` when the records have it (tensor records), else the statistics error, else ``error``."""
    for m in (metric, "stats_err", "error"):
        if m in table.columns and pd.to_numeric(table[m], errors="coerce").notna().any():
            return m
    return metric


def _num(v):
    if v is None or v is pd.NA:
        return None
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float):
        return v if v - v == 0 else (None if v != v else ("inf" if v > 0 else "-inf"))
    return v


def _col(s: pd.Series) -> list:
    """A column as JSON values (non-finite floats as null / 'inf')."""
    if pd.api.types.is_float_dtype(s):
        return [None if x != x else x if x - x == 0 else ("inf" if x > 0 else "-inf") for x in s.tolist()]
    if pd.api.types.is_bool_dtype(s) or pd.api.types.is_integer_dtype(s):
        return s.tolist()
    return [_cell(v) for v in s.tolist()]


def _op_groups(table: pd.DataFrame, nf: pd.DataFrame) -> pd.DataFrame:
    """One row per compared op/module call: key columns, worst status, origin, nan/inf worth a look
    (``nf``: made from finite values or differing between the runs; ``nfm``: made, ``nfa``/``nfb``: in
    run A/B; see nonfinite_rows), first row index."""
    t = table.assign(_sev=table["status"].map(_SEVERITY).fillna(0).astype(int),
                     _nf=nf["differ"].to_numpy() | nf["made_a"].to_numpy() | nf["made_b"].to_numpy(),
                     _nfm=nf["made_a"].to_numpy() | nf["made_b"].to_numpy(), _nfa=nf["made_a"].to_numpy(),
                     _nfb=nf["made_b"].to_numpy(),
                     _org=table["origin"].fillna(False).astype(bool) & (table["status"] == "error"),
                     _i=np.arange(len(table)))
    keys = ["step", "rank", "stage", "kind", "seq"]
    g = t.groupby(keys, sort=False).agg(scope=("scope", "first"), sev=("_sev", "max"), nf=("_nf", "any"),
                                         nfm=("_nfm", "any"), nfa=("_nfa", "any"), nfb=("_nfb", "any"),
                                         origin=("_org", "any"), first=("_i", "min"), n=("_i", "size"))
    return g.reset_index().sort_values("first", kind="stable")


def nonfinite_rows(table: pd.DataFrame, run_a: str | None, run_b: str | None) -> pd.DataFrame:
    """Per row of ``table``: ``differ`` (the runs' nan/inf counts differ) and ``made_a``/``made_b`` (an
    output that run A's / B's op made inf/nan in from finite values, as ``dispatchprobe show`` classifies it:
    offline/nonfinite.py).  The rest (a causal mask's -inf written from a constant, inf/nan carried from an
    input, equal in both runs) is intended or a consequence, not badged.  The runs' records are read again
    for the parts and records with nan/inf output only; a run that cannot be read is left unclassified."""
    def count(c):
        return pd.to_numeric(table[c], errors="coerce") if c in table.columns else pd.Series(np.nan, index=table.index)
    nan_a, nan_b, inf_a, inf_b = (count(c) for c in ("nan_a", "nan_b", "inf_a", "inf_b"))
    both = nan_a.notna() & nan_b.notna() & inf_a.notna() & inf_b.notna()
    out = pd.DataFrame({"differ": (both & ((nan_a != nan_b) | (inf_a != inf_b))).to_numpy(bool)}, index=table.index)
    is_out = (table["io"] == "output") if "io" in table.columns else pd.Series(False, index=table.index)
    for side, path, held in (("a", run_a, (nan_a > 0) | (inf_a > 0)), ("b", run_b, (nan_b > 0) | (inf_b > 0))):
        made = np.zeros(len(table), bool)
        rows = table[is_out & held]
        if len(rows) and path:
            by_name, with_ops = _records_by_name(path, set(zip(rows["step"], rows["rank"])))
            for i, key in enumerate(zip(rows["step"], rows["rank"], rows[f"name_{side}"])):
                rec = by_name.get(key)
                made[table.index.get_loc(rows.index[i])] = rec is not None and \
                    nonfinite.origin(rec, key[:2] in with_ops) == nonfinite.MADE
        out[f"made_{side}"] = made
    return out


def _records_by_name(path: str, parts: set) -> tuple[dict, set]:
    """(step, rank, record name) -> record, of run ``path``'s ``parts`` (a run of one part stands for any:
    compare pairs two single parts whatever their steps), and the parts whose ops are recorded (not only
    modules); nothing when the run cannot be read."""
    try:
        run = load(path)
    except (RecordError, OSError):
        return {}, set()
    out, with_ops = {}, set()
    for step, rank in parts:
        part = run.parts.get((int(step), int(rank)))
        if part is None and len(run.parts) == 1:
            part = next(iter(run.parts.values()))
        if part is None:
            continue
        try:
            records = part.records
        except (RecordError, OSError, ValueError):
            continue
        out.update({(step, rank, r.get("name")): r for r in records})
        if any(r.get("kind") == "op" for r in records):
            with_ops.add((step, rank))
    return out, with_ops


def scope_tree(paths, levels: int, **fields) -> tuple[list, dict]:
    """The module tree of dotted scopes (ancestors included, '' is ``<top>``) as the explorer's nodes:
    per node ``c`` (op counts by level), ``div`` (marked stages), ``own`` (ops directly in it), ``ops``
    (embedded op indexes) and a fresh copy of each of ``fields``; returns (nodes, index by path)."""
    nodes, index = [], {}

    def node(path):
        path = path or "<top>"
        if path in index:
            return index[path]
        parent = node(path.rsplit(".", 1)[0] if "." in path else "<top>") if path != "<top>" else None
        n = {"id": len(nodes), "name": path.rsplit(".", 1)[-1], "path": path, "parent": parent["id"] if parent else None,
             "children": [], "c": [0] * levels, "div": [], "own": 0, "ops": [],
             **{k: (list(v) if isinstance(v, list) else v) for k, v in fields.items()}}
        nodes.append(n)
        index[path] = n
        if parent:
            parent["children"].append(n["id"])
        return n

    node("<top>")
    for p in sorted(paths):
        node(p)
    return nodes, index


def up(nodes: list, n: dict, fn) -> None:
    """Apply ``fn`` to node ``n`` and each of its ancestors (subtree aggregates)."""
    while n is not None:
        fn(n)
        n = nodes[n["parent"]] if n["parent"] is not None else None


def _tree(table: pd.DataFrame, ops: pd.DataFrame, verdict) -> tuple[list, dict]:
    """Module tree nodes (both runs' scopes) with subtree aggregates; returns (nodes, index by path)."""
    um = verdict.unmatched
    paths = set(ops["scope"].fillna("").astype(str)) | set(um["scope"].fillna("").astype(str) if len(um) else [])
    nodes, index = scope_tree(paths, len(COMPARE_LEVELS), nf=0, nfm=0, ua=0, ub=0, um=[])
    if len(ops):
        agg = ops.assign(scope=ops["scope"].fillna("").astype(str)).groupby(["scope", "sev"]).size()
        for (scope, sev), cnt in agg.items():
            up(nodes, index[scope or "<top>"], lambda n: n["c"].__setitem__(int(sev), n["c"][int(sev)] + int(cnt)))
        for field in ("nf", "nfm"):     # op calls with nan/inf worth a look, and those of them that made it
            for scope, cnt in ops.groupby(ops["scope"].fillna("").astype(str))[field].sum().items():
                if cnt:
                    up(nodes, index[scope or "<top>"], lambda n: n.__setitem__(field, n[field] + int(cnt)))
    if len(um):
        comp = um[~um["is_cast"].astype(bool)]
        for (scope, side), cnt in comp.groupby([comp["scope"].fillna("").astype(str), "side"]).size().items():
            key = "ua" if side == "a" else "ub"
            up(nodes, index[scope or "<top>"], lambda n: n.__setitem__(key, n[key] + int(cnt)))
    return nodes, index


def report_data(table: pd.DataFrame, verdict, metric: str) -> dict:
    """What compare.html embeds (JSON): the tree, each node's ops (bounded), chart series, heatmap."""
    ops = _op_groups(table, nonfinite_rows(table, getattr(verdict, "a", None), getattr(verdict, "b", None))) \
        if len(table) else pd.DataFrame(columns=["step", "rank", "stage", "kind", "seq", "scope", "sev", "nf", "nfm",
                                                 "nfa", "nfb", "origin", "first", "n"])
    nodes, index = _tree(table, ops, verdict)
    divs = {}
    for d in (verdict.forward, verdict.backward, *verdict.departures):   # a departure: a stage without errors
        if d is None:
            continue
        n = index.get(d.scope or "<top>") or index["<top>"]
        n["div"].append(d.stage)
        divs[d.stage] = {"node": n["id"], "op": d.op, "key": [d.step, d.rank, d.stage, d.kind, d.seq],
                         "side": d.side, "cause": d.cause, "text": d.describe().splitlines()[0]}
    # ops embedded per node: failing, origin and divergence ops first, then in execution order
    div_keys = {tuple(v["key"]) for v in divs.values()}
    stacks, stack_ix = [], {}
    rows_out = []
    row_cols = [c for c in _ROW_COLS + _ROW_METRICS if c in table.columns]
    if len(ops):
        ops = ops.assign(skey=ops["scope"].fillna("").astype(str),
                         prio=-(ops["sev"] * 2 + ops["origin"].astype(int) * 4
                                 + [10 * (k in div_keys) for k in zip(ops["step"], ops["rank"], ops["stage"],
                                                                      ops["kind"], ops["seq"])]))
        chosen = (ops.sort_values(["prio", "first"], kind="stable").groupby("skey", sort=False)
                  .head(OPS_PER_NODE).sort_values("first", kind="stable"))
        for scope, cnt in ops.groupby("skey").size().items():
            index[scope or "<top>"]["own"] = int(cnt)
        keys = ["step", "rank", "stage", "kind", "seq"]
        sub = table.reset_index(drop=True).merge(chosen[keys + ["first"]], on=keys, how="inner")
        cols = {c: _col(sub[c]) for c in row_cols + ["status", "reason", "origin"]}
        stack = sub["stack"].tolist() if "stack" in sub.columns else [None] * len(sub)
        first_of = sub["first"].tolist()
        by_op = {}
        for i, f in enumerate(first_of):
            by_op.setdefault(f, []).append(i)
        for r in chosen.itertuples(index=False):
            ix = by_op.get(r.first, [])
            t0 = ix[0] if ix else None
            st = stack[t0] if t0 is not None else None
            if isinstance(st, str) and st:
                if st not in stack_ix:
                    stack_ix[st] = len(stacks)
                    stacks.append(st)
                st = stack_ix[st]
            else:
                st = None
            row0 = table.iloc[int(r.first)]
            op = {"k": [int(r.step), int(r.rank), r.stage, r.kind, int(r.seq)], "op_a": _cell(row0["op_a"]),
                  "op_b": _cell(row0["op_b"]), "call": _num(row0["call_a"]), "sev": int(r.sev),
                  "origin": bool(r.origin), "stack": st, "nf": _nf_note(r),
                  "rows": [[cols[c][i] for c in row_cols] + [cols["status"][i], cols["reason"][i],
                                                              bool(cols["origin"][i])] for i in ix]}
            index[r.skey or "<top>"]["ops"].append(len(rows_out))
            rows_out.append(op)
    um = verdict.unmatched
    if len(um):
        for scope, g in um.groupby(um["scope"].fillna("").astype(str), sort=False):
            index[scope or "<top>"]["um"] = [[str(x.side), str(x.stage), str(x.kind), int(x.seq), str(x.op),
                                             _num(x.call), bool(x.is_cast), int(x.step), int(x.rank)]
                                            for x in g.head(UNMATCHED_PER_NODE).itertuples(index=False)]
    metric = chart_metric(table, metric)
    metrics = [m for m in CHART_METRICS if m in table.columns and pd.to_numeric(table[m], errors="coerce").notna().any()]
    if metric not in metrics:
        metrics.insert(0, metric)
    series, parts = _chart_series(table, metrics)
    first = next((d for d in (verdict.forward, verdict.backward, *verdict.departures) if d), None)
    shown = f"{first.step}/{first.rank}" if first and f"{first.step}/{first.rank}" in series else \
        (next(iter(series)) if series else None)
    return {"nodes": nodes, "levels": COMPARE_LEVELS, "mark": "first {stage} divergence", "full_table": "compare.csv",
            "ops": rows_out, "row_cols": row_cols + ["status", "reason", "origin"],
            "stacks": stacks, "divs": divs, "metric": metric, "metrics": metrics,
            "worse_high": {m: bool(CHART_METRICS.get(m, True)) for m in metrics}, "series": series,
            # larger-is-worse metrics span decades: charted as log10 (hover shows the value itself)
            "axis": {m: f"log10({m})" if CHART_METRICS.get(m, True) else m for m in metrics},
            "parts": parts, "shown_part": shown, "n_parts": len(verdict.parts),
            "heat": _heatmap(table, ops, metric) if len(verdict.parts) > 1 else None}


def _nf_note(op) -> str | None:
    """What an op card says of its nan/inf (nonfinite_rows), or None when it has none worth a look."""
    if op.nfm:
        side = "runs A and B" if op.nfa and op.nfb else "run A" if op.nfa else "run B"
        return f"inf/nan made here from finite values ({side})"
    return "inf/nan differ between the runs" if op.nf else None


def _chart_series(table: pd.DataFrame, metrics: list) -> tuple[dict, list]:
    """Per step/rank part and stage: one point per op (its outputs' worst value of each metric)."""
    t = table[(table["io"] == "output") & (table["kind"] == "op")] if len(table) else table
    if not len(t):
        return {}, []
    t = t.assign(_sev=t["status"].map(_SEVERITY).fillna(0).astype(int),
                 _org=t["origin"].fillna(False).astype(bool) & (t["status"] == "error"))
    aggs = {m: (m, "max" if CHART_METRICS.get(m, True) else "min") for m in metrics}
    g = t.groupby(["step", "rank", "stage", "seq"], sort=True).agg(
        scope=("scope", "first"), op=("op_a", "first"), call=("call_a", "first"), sev=("_sev", "max"),
        origin=("_org", "any"), **{f"m_{k}": v for k, v in aggs.items()}).reset_index()
    parts = sorted({(int(a), int(b)) for a, b in zip(g["step"], g["rank"])})
    listed = parts[:MAX_CHART_PARTS]
    out = {}
    for (step, rank, stage), s in g.groupby(["step", "rank", "stage"], sort=True):
        if (int(step), int(rank)) not in listed:
            continue
        out.setdefault(f"{int(step)}/{int(rank)}", {})[stage] = {
            "seq": s["seq"].astype(int).tolist(), "scope": _col(s["scope"]), "op": _col(s["op"]),
            "call": _col(s["call"]), "sev": s["sev"].tolist(), "origin": s["origin"].tolist(),
            **{m: _col(s[f"m_{m}"].astype(float)) for m in metrics}}
    return out, [f"{s}/{r}" for s, r in parts]


def _heatmap(table: pd.DataFrame, ops: pd.DataFrame, metric: str) -> dict | None:
    """Steps/ranks x modules: each cell the worst ``metric`` of the module's ops (scopes cut at the
    deepest level with at most HEATMAP_MODULES modules; ``<top>``: ops outside every module); modules
    without a value of ``metric`` in any part are ``left_out`` (named under the map)."""
    t = table[table["io"] == "output"]
    if not len(t):
        return None
    scope = t["scope"].fillna("").astype(str)
    split = scope.str.split(".")
    depth = 1
    for d in range(1, int(split.str.len().max()) + 1):
        if split.str[:d].str.join(".").nunique() > HEATMAP_MODULES:
            break
        depth = d
    mod = split.str[:depth].str.join(".").replace("", "<top>")
    worse_high = bool(CHART_METRICS.get(metric, True))
    v = pd.to_numeric(t[metric], errors="coerce")
    g = pd.DataFrame({"part": t["step"].astype(str) + "/" + t["rank"].astype(str), "mod": mod, "v": v,
                      "err": (t["status"] == "error").astype(int)})
    agg = g.groupby(["part", "mod"], sort=False).agg(v=("v", "max" if worse_high else "min"), err=("err", "sum"))
    mods = list(dict.fromkeys(mod.tolist()))
    parts = sorted(agg.index.get_level_values(0).unique(), key=lambda p: tuple(int(x) for x in p.split("/")))
    z = agg["v"].unstack().reindex(index=parts, columns=mods)
    # a module none of whose outputs has the metric (scalars have no cosine) would be an empty column
    left_out = [m for m in mods if z[m].isna().all()]
    mods = [m for m in mods if m not in left_out]
    z = z[mods]
    e = agg["err"].unstack().reindex(index=parts, columns=mods).fillna(0).astype(int)
    return {"modules": mods, "parts": parts, "z": [_col(z.loc[p].astype(float)) for p in parts],
            "errors": e.to_numpy().tolist(), "metric": metric, "left_out": left_out}


def _suspicious(table: pd.DataFrame) -> tuple[str, str, int]:
    sus = table[table["origin"] & (table["io"] == "output") & (table["status"] == "error")]
    cols = ["step", "rank", "stage", "seq", "kind", "scope", "op_a", "op_b", "call_a", "arg", "dtype_a", "dtype_b",
            "cosine", "max_abs_err", "max_rel_err", "rel_l2_err", "stats_err", "status", "reason"]
    sus = sus[[c for c in cols if c in sus.columns]].head(2000)
    head = "".join(f'<th onclick="sortTable(this)">{html.escape(c)}</th>' for c in sus.columns)
    body = []
    for row in sus.itertuples(index=False):
        cells = []
        for v in row:
            txt = ("" if math.isnan(v) else f"{v:.6g}") if isinstance(v, float) else str(v)
            cells.append(f"<td>{html.escape(txt)}</td>")
        key = f"{row.step}-{row.rank}-{row.stage}-{row.kind}-{row.seq}"
        body.append(f'<tr class="{html.escape(str(row.status))}" data-op="{html.escape(key)}">{"".join(cells)}</tr>')
    return head, "".join(body), len(sus)


def render_html(table: pd.DataFrame, verdict, manifest_a: dict, manifest_b: dict, metric: str = "cosine") -> str:
    from plotly.offline import get_plotlyjs

    data = report_data(table, verdict, metric)
    head, rows, n_sus = _suspicious(table)
    meta = {"run A (under test)": verdict.a, "run B (benchmark)": verdict.b,
            "parts compared": ", ".join(f"step {s} rank {r}" for s, r in verdict.parts),
            "chart metric": data["metric"]}
    problems = "".join(f"<li>{html.escape(p)}</li>" for p in verdict.problems[:200])
    root = data["nodes"][0]["c"]
    units = (f"The counts above are tensors (rows of compare.csv). The module tree counts ops (op and module "
             f"calls, each at its worst tensor's verdict): "
             + ", ".join(f"{root[i]} {lv['name']}" for i, lv in reversed(list(enumerate(COMPARE_LEVELS)))) + " ops.")
    return _fill("compare.html", data, summary=_lines(str(verdict).splitlines()), units=html.escape(units),
                 head=head, rows=rows,
                 meta=_meta_rows(meta, {"A": manifest_a, "B": manifest_b}), n_suspicious=str(n_sus),
                 problems=problems or "<li>none</li>", n_unmatched=str(len(verdict.unmatched)), plotly=get_plotlyjs())


def _lines(lines) -> str:
    return "".join(f"<li>{html.escape(line)}</li>" for line in lines)


def _meta_rows(meta: dict, manifests: dict) -> str:
    """The run metadata table: ``meta`` and each run's manifest (``tag`` -> manifest), configs folded."""
    meta, configs = dict(meta), []
    for tag, m in manifests.items():
        prefix = f"{tag} " if tag else ""
        for k in ("framework", "framework_version", "device", "started_at", "host"):
            if m.get(k) is not None:
                meta[prefix + k] = m[k]
        if isinstance(m.get("config"), dict):
            configs.append((prefix + "config", json.dumps(m["config"], default=str, indent=1)))
    rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>" for k, v in meta.items())
    return rows + "".join(f"<tr><th>{html.escape(k)}</th><td><details><summary>{len(v.splitlines())} lines</summary>"
                          f"<pre>{html.escape(v)}</pre></details></td></tr>" for k, v in configs)


def _fill(template: str, data: dict, **fills) -> str:
    """A page from ``templates/``: ``{{name}}`` slots filled, the explorer's markup, style and script
    (``explorer.html/css/js``) and the page's JSON (``data``) inlined."""
    here = os.path.join(os.path.dirname(__file__), "templates")
    for part in ("html", "css", "js"):
        with open(os.path.join(here, f"explorer.{part}"), encoding="utf-8") as fh:
            fills[f"explorer_{part}"] = fh.read()
    fills["data"] = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    with open(os.path.join(here, template), encoding="utf-8") as fh:
        page = fh.read()
    return re.sub(r"\{\{(\w+)\}\}", lambda m: fills[m.group(1)], page)


# ---- op pages: run-ut results and overflow runs as the module tree (templates/ops.html) ---------------
def ops_page(ops: pd.DataFrame, *, title: str, tree_heading: str, summary: list, levels: list, mark: str,
             op_cols: list, row_cols: list, rows_of, meta: dict, manifest: dict, full_table: str, legend: str,
             message_col: str = "", fold_col: str = "", flags: list = ()) -> str:
    """One self-contained page: ``ops`` (one row per op: step, rank, stage, scope, op, sev -- an index into
    ``levels`` --, mark -- bool, the first marked op of each stage is marked in the tree --, and
    ``op_cols``) grouped by module scope, each node coloured by its worst level; per node at most
    OPS_PER_NODE ops are embedded (worst and marked first), each with ``rows_of(op row labels)`` ->
    {label: [[row_cols values]]} (its tensors).  ``message_col`` (an op or row column) is shown as a line of
    text, ``fold_col`` (an op column: a stack) folded.  ``flags``: (field, filter label, badge, bool per op):
    node[field] counts the flagged ops beneath it (a filter and a badge in the tree)."""
    ops = ops.reset_index(drop=True)
    scope = ops["scope"].fillna("").astype(str)
    nodes, index = scope_tree(set(scope), len(levels), **{f[0]: 0 for f in flags})
    for (sc, sev), cnt in ops.groupby([scope, "sev"]).size().items():
        up(nodes, index[sc or "<top>"], lambda n: n["c"].__setitem__(int(sev), n["c"][int(sev)] + int(cnt)))
    for field, _, _, hit in flags:
        for sc, cnt in scope[hit.to_numpy(bool)].value_counts().items():
            up(nodes, index[sc or "<top>"], lambda n: n.__setitem__(field, n[field] + int(cnt)))
    for sc, cnt in scope.value_counts().items():
        index[sc or "<top>"]["own"] = int(cnt)
    key = [[int(s), int(r), str(st), "op", i] for i, (s, r, st) in enumerate(zip(ops["step"], ops["rank"], ops["stage"]))]
    marks = {}
    for i in np.flatnonzero(ops["mark"].to_numpy(bool)):
        stage = str(ops.at[i, "stage"])
        if stage not in marks:
            n = index[scope[i] or "<top>"]
            n["div"].append(stage)
            marks[stage] = {"node": n["id"], "key": key[i], "i": int(i),
                            "text": f"{mark.replace('{stage}', stage)}: {ops.at[i, 'op']} (step {key[i][0]} rank {key[i][1]})"}
    prio = -(ops["sev"].astype(int) * 2) - 10 * ops.index.isin([m["i"] for m in marks.values()])
    chosen = (ops.assign(_p=prio, _s=scope).sort_values(["_p"], kind="stable").groupby("_s", sort=False)
              .head(OPS_PER_NODE).sort_index())
    rows = rows_of(chosen.index) if len(chosen) else {}
    cells = {c: _col(chosen[c]) for c in op_cols}
    out = []
    for j, i in enumerate(chosen.index):
        index[scope[i] or "<top>"]["ops"].append(len(out))
        out.append({"k": key[i], "op": _cell(ops.at[i, "op"]), "sev": int(ops.at[i, "sev"]),
                    "cells": [cells[c][j] for c in op_cols], "rows": rows.get(i, [])})
    worst = int(ops["sev"].max()) if len(ops) else len(levels) - 1      # the worst level present
    first = next((m for m in marks.values()), None)
    if first is None and (ops["sev"] == worst).any():
        i = int(np.argmax(ops["sev"].to_numpy() == worst))
        first = {"node": index[scope[i] or "<top>"]["id"], "key": key[i]}
    data = {"nodes": nodes, "levels": levels, "mark": mark, "full_table": full_table, "ops": out, "op_cols": op_cols,
            "row_cols": row_cols, "message_col": message_col, "fold_col": fold_col,
            "flags": [{"field": f, "label": label, "badge": badge} for f, label, badge, _ in flags],
            "marks": {s: {k: v for k, v in m.items() if k != "i"} for s, m in marks.items()},
            "first": first and {"node": first["node"], "key": first["key"]},
            "expand": sorted({index[sc or "<top>"]["id"] for sc in scope[ops["sev"] == worst]})}
    return _fill("ops.html", data, title=html.escape(title), tree_heading=html.escape(tree_heading),
                 summary=_lines(summary), legend=legend, meta=_meta_rows(meta, {"": manifest}))


# run-ut statuses as levels (SKIP: not replayed or nothing judged)
RUN_UT_LEVELS = [{"name": "SKIP", "short": "", "color": "#bbb"}, {"name": "pass", "short": "", "color": "#3fa34d"},
                 {"name": "warning", "short": "warn", "color": "#f0b429"}, {"name": "error", "short": "err", "color": "#d9363e"}]
_RUN_UT_SEVERITY = {lv["name"]: i for i, lv in enumerate(RUN_UT_LEVELS)}


def run_ut_html(results: pd.DataFrame, details: pd.DataFrame, *, summary: list, records: str, manifest: dict,
                result_csv: str) -> str:
    """run-ut's results by module: each op's status (forward or backward) as its level, the first forward
    and backward error marked, every module holding an error opened; per op its outputs' metrics."""
    fwd, bwd = results["Forward Test Success"], results["Backward Test Success"]
    status = fwd.where(fwd != "", bwd)
    ops = pd.DataFrame({"step": results["Step"].astype(int), "rank": results["Rank"].astype(int),
                        "stage": results["Stage"], "scope": results["Scope"], "op": results["API Name"],
                        "sev": status.map(_RUN_UT_SEVERITY).fillna(0).astype(int), "mark": status == "error",
                        "status": status, "Category": results["Category"], "Message": results["Message"],
                        "Elapsed (s)": pd.to_numeric(results["Elapsed (s)"], errors="coerce")})
    METRIC_COLUMNS = M.columns()          # run-ut's details columns, from the metric registry
    head = ["Output", "Device Dtype", "Bench Dtype", "Shape"]
    metric_cols = [c for c in METRIC_COLUMNS if c in details.columns and (details[c] != "").any()]
    row_cols = head + metric_cols + ["Status", "Message"]
    by_op = details.groupby(["Step", "Rank", "API Name"], sort=False).indices
    # the inf/nan filter: ops with an output whose inf/nan pattern differs from the benchmark's
    inf_nan = next((c for c, k in METRIC_COLUMNS.items() if k == "inf_nan_error_rate" and c in details.columns), None)
    flags = []
    if inf_nan:
        bad = details[pd.to_numeric(details[inf_nan], errors="coerce").fillna(0) > 0]
        bad = set(zip(bad["Step"], bad["Rank"], bad["API Name"]))
        flags = [("nf", "inf/nan differs only", "inf/nan",
                  pd.Series([k in bad for k in zip(results["Step"], results["Rank"], results["API Name"])]))]

    def rows_of(labels):
        """Each chosen op's output rows, read from ``details`` in one take."""
        keys = zip(results["Step"][labels], results["Rank"][labels], results["API Name"][labels])
        spans = [(i, by_op.get(k, [])) for i, k in zip(labels, keys)]
        take = details.iloc[np.concatenate([ix for _, ix in spans] + [np.zeros(0, int)])][row_cols]
        values = take.to_numpy(object).tolist()
        number = [c in metric_cols for c in row_cols]
        out, at = {}, 0
        for i, ix in spans:
            rows = values[at:at + len(ix)]
            at += len(ix)
            out[i] = [[_text_number(v) if num else v for v, num in zip(r, number)] for r in rows if r[0] != ""]
        return out

    return ops_page(ops, title="dispatchprobe run-ut", tree_heading="Replayed ops by module", summary=summary,
                    levels=RUN_UT_LEVELS, mark="first {stage} error", rows_of=rows_of, message_col="Message", flags=flags,
                    op_cols=["status", "Category", "Message", "Elapsed (s)"], row_cols=row_cols,
                    meta={"records": records, "results": result_csv}, manifest=manifest,
                    full_table=os.path.basename(result_csv),
                    legend="Each op is judged on its own recorded inputs (device against a float64 benchmark): "
                           "an error is the op's own, not inherited.")


def _text_number(text: str):
    """A CSV cell as the page's JSON value: a number ('inf' for infinities), None when empty or nan."""
    try:
        return _num(float(text))
    except ValueError:
        return text or None


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
        lines.append("no op moved past its limit")
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
    return _cell(v)


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
