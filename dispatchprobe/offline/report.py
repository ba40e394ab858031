"""compare's reports: CSV, .xlsx (failing rows highlighted) and one self-contained HTML page (built
with the page kit, :mod:`.page_kit`, like run-ut's and the inline checks' pages).

The HTML has no external resource: plotly.js and the page's own script are inline, the data is an
inline JSON block.  No torch (docs/architecture.md: the offline side reads only records).
"""

from __future__ import annotations

import html
import math
import os

import numpy as np
import pandas as pd

from ..records.reader import RecordError, load
from ..records.writer import atomic_write_text
from ..standards import metrics as M
from ..standards.loader import standard
from ..standards.verdicts import ERROR, NOT_JUDGED, PASS, WARNING
from ..records import nonfinite
from .page_kit import (OPS_PER_NODE, cell, cells, col, fill, lines, meta_rows, num, scope_tree, up,
                       verdict_levels)

# columns a chart can show, and whether larger is worse: compare's metric columns and two of its own
CHART_METRICS = M.derived(lambda: {**{m: M.METRICS[m].larger_is_worse for m in M.compare_columns()},
                                   "error": True, "norm_rel_diff": True})


def write_reports(out: str, table: pd.DataFrame, verdict, manifest_a: dict, manifest_b: dict,
                  metric: str = "cosine", progress: bool = False) -> str:
    """Write compare.csv, unmatched.csv, pairing.csv, compare.xlsx, compare.html into ``out``; returns the folder.
    ``progress``: a tqdm bar over the four files (big runs spend seconds here)."""
    if metric not in CHART_METRICS:
        raise ValueError(f"--metric must be one of {', '.join(CHART_METRICS)}, not {metric!r}")
    os.makedirs(out, exist_ok=True)
    from tqdm import tqdm
    steps = [("compare.csv", lambda p: _write_csv(p, table)),
             ("unmatched.csv", lambda p: _write_csv(p, verdict.unmatched)),
             ("pairing.csv", lambda p: _write_csv(p, verdict.pairing.frame())),
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
    values = [cells(df[c]) for c in cols]
    ws.write_row(0, 0, cols, bold)
    ws.freeze_panes(1, 0)
    ws.autofilter(0, 0, max(len(df), 1), max(len(cols) - 1, 0))
    for j, (name, column) in enumerate(zip(cols, values)):
        sample = [len(v) if isinstance(v, str) else 11 for v in column[:500] if v is not None]
        ws.set_column(j, j, min(max([len(name) + 3] + sample), 48))
    for i, (row, f) in enumerate(zip(zip(*values), row_formats), 1):
        ws.write_row(i, 0, row, f)


# ---- HTML -------------------------------------------------------------------------------------------
# The page embeds what it shows, not the table: per-module aggregates, chart points (one per op output),
# and per module at most OPS_PER_NODE ops (failing and divergence ops first) with their tensor rows.
MAX_CHART_PARTS = 64   # step/rank parts charted (the selector lists them)
UNMATCHED_PER_NODE = 40
HEATMAP_MODULES = 60
# the explorer's levels by severity (templates/explorer.js): the verdict codes compare's rows carry
COMPARE_LEVELS = verdict_levels([NOT_JUDGED, PASS, WARNING, ERROR])
_SEVERITY = {lv["name"]: i for i, lv in enumerate(COMPARE_LEVELS)}
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
    records/nonfinite.py).  The rest (a causal mask's -inf written from a constant, inf/nan carried from an
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
    for d, text in verdict_marks(verdict):
        n = index.get(d.scope or "<top>") or index["<top>"]
        n["div"].append(d.stage)
        divs[d.stage] = {"node": n["id"], "op": d.op, "key": [d.step, d.rank, d.stage, d.kind, d.seq],
                         "side": d.side, "cause": d.cause, "text": text, "label": mark_label(d),
                         "departure": bool(d.departure),
                         "quiet": d.quiet}
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
        cols = {c: col(sub[c]) for c in row_cols + ["status", "reason", "origin"]}
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
            op = {"k": [int(r.step), int(r.rank), r.stage, r.kind, int(r.seq)], "op_a": cell(row0["op_a"]),
                  "op_b": cell(row0["op_b"]), "call": num(row0["call_a"]), "sev": int(r.sev),
                  "origin": bool(r.origin), "stack": st, "nf": _nf_note(r),
                  "rows": [[cols[c][i] for c in row_cols] + [cols["status"][i], cols["reason"][i],
                                                              bool(cols["origin"][i])] for i in ix]}
            index[r.skey or "<top>"]["ops"].append(len(rows_out))
            rows_out.append(op)
    um = verdict.unmatched
    if len(um):
        for scope, g in um.groupby(um["scope"].fillna("").astype(str), sort=False):
            index[scope or "<top>"]["um"] = [[str(x.side), str(x.stage), str(x.kind), int(x.seq), str(x.op),
                                             num(x.call), bool(x.is_cast), int(x.step), int(x.rank)]
                                            for x in g.head(UNMATCHED_PER_NODE).itertuples(index=False)]
    metric = chart_metric(table, metric)
    metrics = [m for m in CHART_METRICS if m in table.columns and pd.to_numeric(table[m], errors="coerce").notna().any()]
    if metric not in metrics:
        metrics.insert(0, metric)
    series, parts = _chart_series(table, metrics)
    first = next((d for d, _ in verdict_marks(verdict)), None)
    shown = f"{first.step}/{first.rank}" if first and f"{first.step}/{first.rank}" in series else \
        (next(iter(series)) if series else None)
    return {"nodes": nodes, "levels": COMPARE_LEVELS, "mark": "first {stage} divergence", "full_table": "compare.csv",
            "ops": rows_out, "row_cols": row_cols + ["status", "reason", "origin"],
            "stacks": stacks, "divs": divs, "metric": metric, "metrics": metrics,
            "worse_high": {m: bool(CHART_METRICS.get(m, True)) for m in metrics}, "series": series,
            "axis": {m: chart_axis(m) for m in metrics},
            "parts": parts, "shown_part": shown, "n_parts": len(verdict.parts),
            "heat": _heatmap(table, ops, metric) if len(verdict.parts) > 1 else None}


def verdict_marks(verdict) -> list:
    """What the page marks: exactly what the terminal names (``Verdict.__str__``), as (divergence, its
    terminal line).  Each stage's divergence; a stage's departure within tolerance where the terminal
    names it (the other stage has errors), or, when the runs agree within tolerance, the first departure
    only.  Nothing when the runs agree, are the same records or could be read only in part."""
    early = {d.stage: d for d in verdict.departures}
    marks = []
    for stage, div in (("forward", verdict.forward), ("backward", verdict.backward)):
        if div is not None:
            marks.append((div, div.describe().splitlines()[0]))
        elif stage in early and not verdict.passed:
            marks.append((early[stage], f"no {stage} divergence; " + early[stage].describe().splitlines()[0]))
    d = verdict.departure
    if verdict.passed and d is not None and not verdict.damaged and not verdict.same_run:
        line = d.describe("the runs agree within tolerance; first departure") if d.cause in ("op", "unmatched") \
            else "the runs agree within tolerance; first departure: " + d.describe()
        marks.append((d, line.splitlines()[0]))
    return marks


def mark_label(d) -> str:
    """A mark's badge and chart label, in the verdict's words: a divergence, a departure within tolerance
    (a quieter badge: the runs pass), inputs that already differ, or backward errors inherited."""
    if d.cause == "inputs":
        return f"{d.stage} inputs/parameters differ (first seen)" + (" within tolerance" if d.departure else "")
    if d.cause == "inherited":
        return f"{d.stage} errors follow from {d.inherited_from()} values"
    if d.cause == "noise":
        return f"{d.stage} differences follow from values zero up to rounding"
    if d.cause == "constant":
        return f"{d.stage} differences follow from constants the programs make differently"
    if d.cause == "after_random":
        return f"{d.stage} not judged: follows a random op"
    if d.cause == "after_inputs":
        return f"{d.stage} not judged: its inputs differ"
    return d.headline()


def chart_axis(metric: str) -> dict:
    """How a chart draws ``metric``: ``scale`` ``log`` (a larger-is-worse metric: it spans decades),
    ``one_minus`` (a larger-is-better one, a similarity or share at most 1: 1 - value on a log scale, so
    0.9999999998 reads 2e-10 instead of a cut-off run of nines), the axis title and the verdict's
    threshold on that axis where one value decides it (cosine: ``benchmark.cosine_min``)."""
    if CHART_METRICS.get(metric, True):
        return {"scale": "log", "title": f"{metric} (log scale)", "threshold": None}
    threshold = None
    if metric == "cosine":
        cos_min = standard()["benchmark"]["cosine_min"]
        threshold = {"y": 1 - cos_min, "text": f"error at cosine <= {cos_min}"}
    return {"scale": "one_minus", "title": f"1 - {metric} (log scale)", "threshold": threshold}


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
            "seq": s["seq"].astype(int).tolist(), "scope": col(s["scope"]), "op": col(s["op"]),
            "call": col(s["call"]), "sev": s["sev"].tolist(), "origin": s["origin"].tolist(),
            **{m: col(s[f"m_{m}"].astype(float)) for m in metrics}}
    return out, [f"{s}/{r}" for s, r in parts]


def _heatmap(table: pd.DataFrame, ops: pd.DataFrame, metric: str) -> dict | None:
    """Steps/ranks x modules: each cell the worst verdict of the module's op outputs (``sev``, an index
    into COMPARE_LEVELS: the colour), their worst ``metric`` and error/warning counts (the hover).  Scopes
    are cut at the deepest level with at most HEATMAP_MODULES modules; ``<top>``: ops outside every module.
    Colour follows the verdict, not the data's range: runs that pass are drawn pale however close."""
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
    v = pd.to_numeric(t[metric], errors="coerce") if metric in t.columns else pd.Series(np.nan, index=t.index)
    g = pd.DataFrame({"part": t["step"].astype(str) + "/" + t["rank"].astype(str), "mod": mod, "v": v,
                      "sev": t["status"].map(_SEVERITY).fillna(0).astype(int),
                      "err": (t["status"] == ERROR).astype(int), "warn": (t["status"] == WARNING).astype(int)})
    agg = g.groupby(["part", "mod"], sort=False).agg(v=("v", "max" if worse_high else "min"), sev=("sev", "max"),
                                                      err=("err", "sum"), warn=("warn", "sum"))
    mods = list(dict.fromkeys(mod.tolist()))
    parts = sorted(agg.index.get_level_values(0).unique(), key=lambda p: tuple(int(x) for x in p.split("/")))

    def grid(field, fill=None):
        frame = agg[field].unstack().reindex(index=parts, columns=mods)
        return [col(frame.loc[p].astype(float)) for p in parts] if fill is None else \
            frame.fillna(fill).astype(int).to_numpy().tolist()
    sev = [[None if x is None else int(x) for x in row] for row in grid("sev")]
    return {"modules": mods, "parts": parts, "z": grid("v"), "sev": sev, "errors": grid("err", 0),
            "warnings": grid("warn", 0), "metric": metric}


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
    return fill("compare.html", data, summary=lines(str(verdict).splitlines()), units=html.escape(units),
                 head=head, rows=rows,
                 meta=meta_rows(meta, {"A": manifest_a, "B": manifest_b}), n_suspicious=str(n_sus),
                 problems=problems or "<li>none</li>", n_unmatched=str(len(verdict.unmatched)), plotly=get_plotlyjs())


