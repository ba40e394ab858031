"""compare's reports: CSV, .xlsx (failing rows highlighted) and one self-contained HTML page.

The HTML has no external resource: the charts are inline SVG built here, the table sorting is a
few lines of inline JavaScript.  No torch (DESIGN invariant 1).
"""

from __future__ import annotations

import html
import json
import math
import os

import numpy as np
import pandas as pd

from ..records.writer import atomic_write_text
from ..standards import metrics as M
from .compare import NOT_JUDGED

_TEMPLATE = os.path.join(os.path.dirname(__file__), "templates", "compare.html")
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
    if v is None or v is pd.NA:
        return None
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float):
        return None if v != v else v if v - v == 0 else str(v)
    if isinstance(v, (str, bool, int)):
        return v
    return str(list(v)) if isinstance(v, (tuple, list)) else str(v)


# ---- HTML -------------------------------------------------------------------------------------------
MAX_CHART_PARTS = 64   # step/rank parts charted in one HTML page (the selector lists them)


def _series(table: pd.DataFrame, stage: str, metric: str, part=None) -> pd.DataFrame:
    """One point per op output along the stage's sequence of one step/rank ``part`` (default: the first)."""
    t = table[(table["stage"] == stage) & (table["io"] == "output")]
    if not len(t):
        return t
    if part is None:
        first = t[["step", "rank"]].drop_duplicates().sort_values(["step", "rank"]).iloc[0]
        part = (first["step"], first["rank"])
    t = t[(t["step"] == part[0]) & (t["rank"] == part[1]) & (t["kind"] == "op")]
    worse_high = CHART_METRICS[metric]
    vals = pd.to_numeric(t[metric], errors="coerce")
    if metric == "cosine":
        vals = vals.fillna(1.0)
    t = t.assign(_v=vals)
    agg = t.groupby("seq", sort=True).agg(v=("_v", "max" if worse_high else "min"), scope=("scope", "first"),
                                           op=("op_a", "first"), call=("call_a", "first"),
                                           status=("status", lambda s: "error" if (s == "error").any() else
                                                   "warning" if (s == "warning").any() else "pass"),
                                           origin=("origin", "any"))
    return agg.reset_index()


def _svg_chart(points: pd.DataFrame, metric: str, stage: str, first_seq, svg_id: str | None = None) -> str:
    w, h, pad = 900, 220, 40
    svg_id = svg_id or f"chart-{stage}"
    if not len(points):
        return f'<svg class="chart" id="{svg_id}" width="{w}" height="60"><text x="10" y="30">no {stage} ops compared</text></svg>'
    v = points["v"].to_numpy(np.float64)
    finite = v[np.isfinite(v)]
    log = bool(CHART_METRICS[metric]) and len(finite) > 0
    if log:
        y = np.log10(np.clip(np.where(np.isfinite(v), v, finite.max() if len(finite) else 1.0), 1e-12, None))
    else:
        y = np.where(np.isfinite(v), v, np.nan)
    lo, hi = (np.nanmin(y), np.nanmax(y)) if np.isfinite(y).any() else (0.0, 1.0)
    if hi - lo < 1e-12:
        lo, hi = lo - 1, hi + 1
    n = len(points)
    xs = pad + (np.arange(n) / max(n - 1, 1)) * (w - 2 * pad)
    ys = h - pad - (np.nan_to_num(y, nan=lo) - lo) / (hi - lo) * (h - 2 * pad)
    path = " ".join(f"{'M' if i == 0 else 'L'}{x:.1f},{yy:.1f}" for i, (x, yy) in enumerate(zip(xs, ys)))
    dots = []
    for i, r in enumerate(points.itertuples()):
        color = {"error": "#d33", "warning": "#e90"}.get(r.status, "#3a3")
        tip = html.escape(f"#{r.seq} {r.op} [{r.scope}] call {r.call}: {metric}={r.v:.4g}")
        dots.append(f'<circle cx="{xs[i]:.1f}" cy="{ys[i]:.1f}" r="2.5" fill="{color}"><title>{tip}</title></circle>')
    marker = ""
    if first_seq is not None and (points["seq"] == first_seq).any():
        i = int(np.flatnonzero(points["seq"].to_numpy() == first_seq)[0])
        marker = (f'<line class="first-divergence" x1="{xs[i]:.1f}" x2="{xs[i]:.1f}" y1="{pad - 10}" y2="{h - pad}" '
                  f'stroke="#d33" stroke-dasharray="4 3"/><text x="{xs[i] + 4:.1f}" y="{pad - 14}" fill="#d33" '
                  f'font-size="12">first divergence: {html.escape(points["op"].iat[i])}</text>')
    label = f"log10({metric})" if log else metric
    return (f'<svg class="chart" id="{svg_id}" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
            f'xmlns="http://www.w3.org/2000/svg"><rect width="{w}" height="{h}" fill="#fafafa"/>'
            f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="#888"/>'
            f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="#888"/>'
            f'<text x="{pad}" y="{h - 10}" font-size="12">{stage} op sequence (0..{int(points["seq"].max())})</text>'
            f'<text x="4" y="{pad - 24}" font-size="12">{html.escape(label)}: {lo:.3g} .. {hi:.3g}</text>'
            f'<path d="{path}" fill="none" stroke="#36c" stroke-width="1"/>{"".join(dots)}{marker}</svg>')


def _charts(table: pd.DataFrame, verdict, metric: str) -> list:
    """Forward and backward charts of every step/rank part (up to MAX_CHART_PARTS), one part shown at
    a time through a selector; the part of the first divergence is shown first.  The shown part's
    charts have the ids ``chart-forward`` / ``chart-backward``."""
    parts = (sorted({(int(s), int(r)) for s, r in zip(table["step"], table["rank"])}) if len(table) else []) \
        or [(0, 0)]
    first = next((d for d in (verdict.forward, verdict.backward) if d), None)
    shown = (first.step, first.rank) if first and (first.step, first.rank) in parts else parts[0]
    listed = parts[:MAX_CHART_PARTS]
    if shown not in listed:
        listed = [shown] + listed[:-1]
    out = []
    if len(parts) > 1:
        opts = "".join(f'<option value="step{s}-rank{r}"{" selected" if (s, r) == shown else ""}>step {s} rank {r}'
                       f'</option>' for s, r in listed)
        more = f" (first {MAX_CHART_PARTS} of {len(parts)} parts)" if len(parts) > len(listed) else ""
        out.append(f'<p><label>step/rank: <select id="part-select" onchange="showPart(this.value)">{opts}'
                   f'</select></label>{more}</p>')
    for s, r in listed:
        is_shown = (s, r) == shown
        block = [f'<div class="part" id="part-step{s}-rank{r}"{"" if is_shown else " hidden"}>']
        for stage, div in (("forward", verdict.forward), ("backward", verdict.backward)):
            pts = _series(table, stage, metric, (s, r))
            seq = div.seq if div and (div.step, div.rank) == (s, r) else None
            svg_id = f"chart-{stage}" if is_shown else f"chart-{stage}-step{s}-rank{r}"
            block.append(f"<h3>{stage} (step {s} rank {r})</h3>" + _svg_chart(pts, metric, stage, seq, svg_id))
        block.append("</div>")
        out.append("".join(block))
    return out


def render_html(table: pd.DataFrame, verdict, manifest_a: dict, manifest_b: dict, metric: str = "cosine") -> str:
    charts = _charts(table, verdict, metric)
    sus = table[table["origin"] & (table["io"] == "output") & (table["status"] == "error")]
    cols = ["step", "rank", "stage", "seq", "kind", "scope", "op_a", "op_b", "call_a", "arg", "dtype_a", "dtype_b",
            "cosine", "max_abs_err", "max_rel_err", "rel_l2_err", "status", "reason"]
    sus = sus[[c for c in cols if c in sus.columns]].head(2000)
    head = "".join(f'<th onclick="sortTable(this)">{html.escape(c)}</th>' for c in sus.columns)
    body = []
    for row in sus.itertuples(index=False):
        cells = []
        for v in row:
            if isinstance(v, float):
                txt = "" if math.isnan(v) else f"{v:.6g}"
            else:
                txt = str(v)
            cells.append(f"<td>{html.escape(txt)}</td>")
        body.append(f'<tr class="{html.escape(str(row.status))}">{"".join(cells)}</tr>')
    summary = "".join(f"<li>{html.escape(line)}</li>" for line in str(verdict).splitlines())
    meta = {"run A (under test)": verdict.a, "run B (benchmark)": verdict.b,
            "parts compared": ", ".join(f"step {s} rank {r}" for s, r in verdict.parts),
            "chart metric": metric}
    for tag, m in (("A", manifest_a), ("B", manifest_b)):
        for k in ("framework", "framework_version", "device", "started_at", "host"):
            if m.get(k) is not None:
                meta[f"{tag} {k}"] = m[k]
        if isinstance(m.get("config"), dict):
            meta[f"{tag} config"] = json.dumps(m["config"], default=str)[:300]
    meta_rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>" for k, v in meta.items())
    problems = "".join(f"<li>{html.escape(p)}</li>" for p in verdict.problems[:200])
    with open(_TEMPLATE, encoding="utf-8") as fh:
        page = fh.read()
    return (page.replace("{{summary}}", summary).replace("{{charts}}", "".join(charts))
            .replace("{{head}}", head).replace("{{rows}}", "".join(body)).replace("{{meta}}", meta_rows)
            .replace("{{n_suspicious}}", str(len(sus)))
            .replace("{{problems}}", problems or "<li>none</li>")
            .replace("{{n_unmatched}}", str(len(verdict.unmatched))))
