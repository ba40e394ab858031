"""compare's reports: CSV, .xlsx (failing rows highlighted) and one self-contained HTML page (built
with the page kit, :mod:`.page_kit`, like run-ut's and the inline checks' pages).

The HTML has no external resource: plotly.js and the page's own script are inline, the data is an
inline JSON block.  No torch (docs/architecture.md: the offline side reads only records).
"""

from __future__ import annotations

import html
import math
import os

import pandas as pd

from ..records.writer import atomic_write_text
from ..standards.loader import standard
from .frame_csv import csv_pieces, csv_text
from .page_kit import OPS_PER_NODE, cells, col, fill, lines, meta_rows, num, scope_tree, up
from .report_digest import (CHART_METRICS, COMPARE_LEVELS, OP_KEYS, PAIRED_AT, ROW_COLS, ROW_METRICS, XLSX_MAX_ROWS,
                            TableDigest, digest, paired_record_words)


class ReportWriter:
    """compare's report files, written as the table comes, a chunk of step/rank parts at a time:
    ``compare.csv`` appended (every row), the rest from a :class:`~.report_digest.TableDigest` of
    the chunks once the verdict is known (:meth:`finish`), so that no file needs the whole table
    held.  Each file is whole or absent: written under a temporary name and renamed."""

    def __init__(self, out: str, run_a: str | None = None, run_b: str | None = None, metric: str = "cosine"):
        if metric not in CHART_METRICS:
            raise ValueError(f"--metric must be one of {', '.join(CHART_METRICS)}, not {metric!r}")
        os.makedirs(out, exist_ok=True)
        self.out, self.metric = out, metric
        self.digest = TableDigest(run_a, run_b)
        self._csv = os.path.join(out, "compare.csv")
        self._file = None
        self._header: list | None = None

    def add(self, table: pd.DataFrame, marks=()) -> None:
        """The next rows (whole step/rank parts, in execution order, the reported columns; ``marks``:
        :meth:`TableDigest.add`)."""
        self._append(table)
        self.digest.add(table, marks)

    def _append(self, table: pd.DataFrame) -> None:
        if self._file is None:
            self._file = open(self._csv + ".tmp", "w", newline="", encoding="utf-8")
            self._header = list(table.columns)
            self._file.write(csv_text(table.iloc[:0]))
        elif not set(table.columns) <= set(self._header):   # a column no earlier part had: widen what is written
            self._widen([c for c in table.columns if c not in self._header])
        if len(table):
            self._file.writelines(csv_pieces(table.reindex(columns=self._header), header=False))

    def _widen(self, new: list) -> None:
        self._file.close()
        written = pd.read_csv(self._csv + ".tmp", dtype=str, keep_default_na=False)
        self._header += new
        with open(self._csv + ".tmp", "w", newline="", encoding="utf-8") as f:
            f.write(csv_text(written.reindex(columns=self._header, fill_value="")))
        self._file = open(self._csv + ".tmp", "a", newline="", encoding="utf-8")

    def finish(self, verdict, manifest_a: dict, manifest_b: dict, progress: bool = False) -> str:
        """Close compare.csv and write unmatched.csv, pairing.csv, compare.xlsx and compare.html; returns
        the folder.  ``progress``: a tqdm bar over the files (big runs spend seconds here)."""
        from tqdm import tqdm
        if self._file is None:
            self._append(pd.DataFrame(columns=self.digest.columns))
        self._file.close()
        os.replace(self._csv + ".tmp", self._csv)
        steps = [("unmatched.csv", lambda p: _write_csv(p, verdict.unmatched)),
                 ("pairing.csv", lambda p: _write_csv(p, verdict.pairing.frame())),
                 ("compare.xlsx", lambda p: _write_xlsx(p, self.digest, verdict)),
                 ("compare.html", lambda p: atomic_write_text(p, _render_html(self.digest, verdict, manifest_a,
                                                                               manifest_b, self.metric)))]
        with tqdm(total=len(steps), desc="report", unit="file", disable=not progress, leave=False) as bar:
            for name, write in steps:
                bar.set_postfix_str(name)
                write(os.path.join(self.out, name))
                bar.update()
        return os.path.abspath(self.out)


def write_reports(out: str, table: pd.DataFrame, verdict, manifest_a: dict, manifest_b: dict,
                  metric: str = "cosine", progress: bool = False) -> str:
    """Write compare.csv, unmatched.csv, pairing.csv, compare.xlsx, compare.html into ``out`` from a
    whole table; returns the folder (compare itself feeds a :class:`ReportWriter` part by part)."""
    writer = ReportWriter(out, getattr(verdict, "a", None), getattr(verdict, "b", None), metric)
    writer.add(table, _marked(verdict))
    return writer.finish(verdict, manifest_a, manifest_b, progress)


def _write_csv(path: str, df: pd.DataFrame) -> None:
    atomic_write_text(path, csv_text(df))


# ---- spreadsheet ------------------------------------------------------------------------------------
_FILLS = {"origin": {"bg_color": "#C0392B", "font_color": "#FFFFFF", "bold": True},
          "error": {"bg_color": "#FFC7CE"}, "warning": {"bg_color": "#FFEB9C"}}


def xlsx_rows(table: pd.DataFrame) -> pd.DataFrame:
    """The rows of the ``compare`` sheet of a whole table, in execution order (see XLSX_MAX_ROWS)."""
    return digest(table).sheet_rows()


def write_xlsx(path: str, table: pd.DataFrame, verdict) -> None:
    """The spreadsheet of a whole table (:func:`_write_xlsx`)."""
    _write_xlsx(path, _whole(table, verdict), verdict)


def _write_xlsx(path: str, digest: TableDigest, verdict) -> None:
    """Sheets ``summary`` (the verdict, counts), ``compare`` (see XLSX_MAX_ROWS; origin rows bold on red,
    errors red, warnings yellow) and ``unmatched``; frozen header, autofilter, fitted widths."""
    import xlsxwriter

    tmp = path + ".tmp.xlsx"
    wb = xlsxwriter.Workbook(tmp, {"constant_memory": True, "strings_to_numbers": False,
                                   "strings_to_formulas": False, "strings_to_urls": False})
    bold = wb.add_format({"bold": True})
    fills = {k: wb.add_format(v) for k, v in _FILLS.items()}
    rows = digest.sheet_rows()

    ws = wb.add_worksheet("summary")
    ws.set_column(0, 0, 110)
    lines = str(verdict).splitlines()
    shown = (f"sheet compare: all {digest.rows} rows" if len(rows) == digest.rows else
             f"sheet compare: {len(rows)} failing rows of {digest.rows} (origin rows, then errors, then warnings, "
             f"at most {XLSX_MAX_ROWS}; every row is in compare.csv)")
    r = 0
    for line in lines + ["", shown, "", "rows by stage and status"]:
        ws.write_string(r, 0, line, bold if r == 0 else None)
        r += 1
    if digest.rows:
        counts = digest.stage_status()
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
UNMATCHED_PER_NODE = 40


def _tree(digest: TableDigest, verdict) -> tuple[list, dict]:
    """Module tree nodes (both runs' scopes) with subtree aggregates; returns (nodes, index by path)."""
    um = verdict.unmatched
    paths = set(digest.own) | set(um["scope"].fillna("").astype(str) if len(um) else [])
    nodes, index = scope_tree(paths, len(COMPARE_LEVELS), nf=0, nfm=0, ua=0, ub=0, um=[])
    for (scope, sev), cnt in digest.scope_sev.items():
        up(nodes, index[scope or "<top>"], lambda n: n["c"].__setitem__(int(sev), n["c"][int(sev)] + int(cnt)))
    for field, counts in (("nf", digest.scope_nf), ("nfm", digest.scope_nfm)):
        for scope, cnt in counts.items():    # op calls with nan/inf worth a look, and those of them that made it
            up(nodes, index[scope or "<top>"], lambda n: n.__setitem__(field, n[field] + int(cnt)))
    if len(um):
        comp = um[~um["is_cast"].astype(bool)]
        for (scope, side), cnt in comp.groupby([comp["scope"].fillna("").astype(str), "side"]).size().items():
            key = "ua" if side == "a" else "ub"
            up(nodes, index[scope or "<top>"], lambda n: n.__setitem__(key, n[key] + int(cnt)))
    return nodes, index


def report_data(table: pd.DataFrame, verdict, metric: str) -> dict:
    """What compare.html embeds (JSON) for a whole table (:func:`page_data`)."""
    return page_data(_whole(table, verdict), verdict, metric)


def page_data(digest: TableDigest, verdict, metric: str) -> dict:
    """What compare.html embeds (JSON): the tree, each node's ops (bounded), chart series, heatmap."""
    nodes, index = _tree(digest, verdict)
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
    row_cols = [c for c in ROW_COLS + ROW_METRICS if c in digest.columns]
    ops = digest.ops
    if len(ops):
        ops = ops.assign(prio=ops["prio"] - [10 * (k in div_keys) for k in zip(*(ops[c] for c in OP_KEYS))])
        chosen = (ops.sort_values(["prio", "first"], kind="stable").groupby("skey", sort=False)
                  .head(OPS_PER_NODE).sort_values("first", kind="stable"))
        for scope, cnt in digest.own.items():
            index[scope or "<top>"]["own"] = int(cnt)
        sub = digest.op_rows[digest.op_rows["first"].isin(chosen["first"])]
        cols = {c: col(sub[c]) for c in row_cols + ["status", "reason", "origin", "op_a", "op_b"]}
        at = {c: sub[c].tolist() if c in sub.columns else [None] * len(sub) for c in PAIRED_AT}
        stack = sub["stack"].tolist() if "stack" in sub.columns else [None] * len(sub)
        by_op = {}
        for i, f in enumerate(sub["first"].tolist()):
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
            op = {"k": [int(r.step), int(r.rank), r.stage, r.kind, int(r.seq)], "op_a": cols["op_a"][t0],
                  "op_b": cols["op_b"][t0], "sev": int(r.sev),
                  "named": paired_record_words(r.stage, r.step, r.rank, r.seq, *(at[c][t0] for c in PAIRED_AT))
                  if t0 is not None else paired_record_words(r.stage, r.step, r.rank, r.seq),
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
    metric = digest.chart_metric(metric)
    metrics = digest.chart_metrics(metric)
    series, parts = digest.chart(metrics)
    first = next((d for d, _ in verdict_marks(verdict)), None)
    shown = f"{first.step}/{first.rank}" if first and f"{first.step}/{first.rank}" in series else \
        (next(iter(series)) if series else None)
    return {"nodes": nodes, "levels": COMPARE_LEVELS, "mark": "first {stage} divergence", "full_table": "compare.csv",
            "first": first.stage if first else None,
            "ops": rows_out, "row_cols": row_cols + ["status", "reason", "origin"],
            "stacks": stacks, "divs": divs, "metric": metric, "metrics": metrics,
            "worse_high": {m: bool(CHART_METRICS.get(m, True)) for m in metrics}, "series": series,
            "axis": {m: chart_axis(m) for m in metrics},
            "parts": parts, "shown_part": shown, "n_parts": len(verdict.parts),
            "heat": digest.heatmap(metric) if len(verdict.parts) > 1 else None}


def verdict_marks(verdict) -> list:
    """What the page marks: exactly what the terminal names (``Verdict.__str__``), as (divergence, its
    terminal line).  Each stage's divergence; a stage's departure within tolerance where the terminal
    names it (the other stage has errors), or, when the runs agree within tolerance, the first departure
    only.  Nothing when the runs agree, are the same records or could be read only in part."""
    early = {d.stage: d for d in verdict.departures}
    marks = []
    for stage, div in verdict.stages_in_order():
        if div is not None:
            marks.append((div, div.describe().splitlines()[0]))
        elif stage in early and not verdict.passed:
            marks.append((early[stage], f"no {stage} divergence; " + early[stage].describe().splitlines()[0]))
    d = verdict.departure
    if verdict.passed and d is not None and not verdict.damaged and not verdict.same_run:
        line = d.describe("the runs agree within tolerance; first departure") if d.cause in ("op", "unmatched", "region") \
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
    if d.cause == "received":
        return f"{d.stage} differences received from other ranks"
    if d.cause == "noise":
        return f"{d.stage} differences follow from values zero up to rounding"
    if d.cause == "rounding":
        return f"{d.stage} errors grew from differences of rounding size"
    if d.cause == "skipped":
        return f"{d.stage} errors follow from an update one run's loss scaler skipped"
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


def _suspicious(digest: TableDigest) -> tuple[str, str, int]:
    sus = digest.suspicious_rows()
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
    """The page of a whole table (:func:`_render_html`)."""
    return _render_html(_whole(table, verdict), verdict, manifest_a, manifest_b, metric)


def _whole(table: pd.DataFrame, verdict) -> TableDigest:
    """The digest of a whole table with its verdict."""
    return digest(table, getattr(verdict, "a", None), getattr(verdict, "b", None), _marked(verdict))


def _marked(verdict) -> set:
    """The ops the page marks (:func:`verdict_marks`), as :meth:`TableDigest.add` takes them."""
    return {(d.step, d.rank, d.stage, d.kind, d.seq) for d, _ in verdict_marks(verdict)}


def _render_html(digest: TableDigest, verdict, manifest_a: dict, manifest_b: dict, metric: str = "cosine") -> str:
    from plotly.offline import get_plotlyjs

    data = page_data(digest, verdict, metric)
    head, rows, n_sus = _suspicious(digest)
    meta = {"run A (under test)": verdict.a, "run B (benchmark)": verdict.b,
            "parts compared": ", ".join(f"step {s} rank {r}" for s, r in verdict.parts),
            "chart metric": data["metric"]}
    problems = "".join(f"<li>{html.escape(p)}</li>" for p in verdict.problems[:200])
    root = data["nodes"][0]["c"]
    units = ("The counts above are tensors (rows of compare.csv). The module tree counts ops (op and module "
             "calls, each at its worst tensor's verdict): "
             + ", ".join(f"{root[i]} {lv['name']}" for i, lv in reversed(list(enumerate(COMPARE_LEVELS)))) + " ops.")
    return fill("compare.html", data, summary=lines(str(verdict).splitlines()), units=html.escape(units),
                 head=head, rows=rows,
                 meta=meta_rows(meta, {"A": manifest_a, "B": manifest_b}), n_suspicious=str(n_sus),
                 problems=problems or "<li>none</li>", n_unmatched=str(len(verdict.unmatched)), plotly=get_plotlyjs())


