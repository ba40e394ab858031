"""compare's reports: CSV columns, xlsx highlighting, and the HTML page rendered in headless Chromium."""

from __future__ import annotations

import os
import sys

import html

import numpy as np
import pandas as pd
import pytest

from dispatchprobe.offline.compare import COLUMNS
from dispatchprobe import compare

sys.path.insert(0, os.path.dirname(__file__))
from compare_helpers import record, record_net, scaled_gelu  # noqa: E402
from html_check import (WIDTHS, assert_fits, counts, cut_labels, is_red, layout, needs_chromium, rgb,  # noqa: E402
                        screenshot)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("rep")
    a, b = record(root / "a"), record(root / "b", plant=True)
    table, verdict = compare(a, b, out=str(root / "out"), metric="rel_l2_err")
    return root / "out", table, verdict


def test_csv_and_xlsx(report):
    out, table, verdict = report
    csv = pd.read_csv(out / "compare.csv")
    assert list(csv.columns) == COLUMNS and len(csv) == len(table)
    from openpyxl import load_workbook
    wb = load_workbook(out / "compare.xlsx")
    assert wb.sheetnames == ["summary", "compare", "unmatched"]
    summary = [r[0] for r in wb["summary"].iter_rows(values_only=True)]
    lines = [x for x in str(verdict).splitlines() if not x.startswith("report: ")]   # set once written
    assert summary[:len(lines)] == lines
    ws = wb["compare"]
    assert ws.freeze_panes == "A2" and ws.auto_filter.ref == f"A1:{ws.cell(1, len(COLUMNS)).column_letter}{len(table) + 1}"
    header = [c.value for c in ws[1]]
    assert header == COLUMNS and ws.max_row == len(table) + 1   # a small run: every row
    status, origin = header.index("status"), header.index("origin")
    fills = {}
    for row in ws.iter_rows(min_row=2):
        key = "origin" if row[origin].value and row[status].value == "error" else row[status].value
        fills[key] = (row[status].fill.fgColor.rgb, bool(row[status].font.b))
    assert fills["error"] == ("FFFFC7CE", False) and fills["origin"] == ("FFC0392B", True)
    assert fills["pass"][0] in (None, "00000000")
    widths = {header[i]: ws.column_dimensions[ws.cell(1, i + 1).column_letter].width for i in (0, header.index("scope"))}
    assert widths["scope"] > widths["step"] >= 8


def test_pairing_share_is_said_everywhere(report):
    """How each run's op records were paired (op by op, at a boundary, unpaired), per stage: counted
    once (``verdict.pairing``), in the terminal lines, pairing.csv, the xlsx summary and the page."""
    out, table, verdict = report
    lines = verdict.pairing.lines()
    assert [x.split(":")[0] for x in lines] == ["forward records paired op by op", "backward records paired op by op"]
    assert all(x in str(verdict).splitlines() for x in lines)
    csv = pd.read_csv(out / "pairing.csv")
    assert csv.equals(verdict.pairing.frame()) and set(csv["run"]) == {"A", "B"}
    assert (csv["records"] == csv["op_by_op"] + csv["at_boundary"] + csv["unpaired"]).all()
    assert (csv["op_by_op"] == csv["records"]).all()       # two runs of one model: every op pairs op by op
    assert verdict.pairing.share("a") == 1.0
    page = (out / "compare.html").read_text()
    assert all(html.escape(x) in page for x in lines)


def test_pairing_share_at_level_module_counts_module_records(tmp_path):
    a = record(tmp_path / "a", task="statistics", level="module")
    _, verdict = compare(a, a)
    csv = verdict.pairing.frame()
    assert len(csv) == 4 and (csv["records"] > 0).all() and (csv["at_boundary"] == csv["records"]).all(), csv
    assert "forward records paired op by op: A 0/" in str(verdict)


def test_xlsx_of_a_big_run_holds_the_failing_rows(report, tmp_path):
    """Past XLSX_MAX_ROWS rows the compare sheet holds origin rows, errors, then warnings (in execution
    order); the summary says so and compare.csv keeps every row."""
    from openpyxl import load_workbook
    from dispatchprobe.offline import report as R
    _, table, verdict = report
    big = pd.concat([table.assign(step=k) for k in range(30)], ignore_index=True)   # 30 parts, ~13k rows
    path = tmp_path / "big.xlsx"
    R.write_xlsx(str(path), big, verdict)
    wb = load_workbook(path, read_only=True)
    rows = list(wb["compare"].iter_rows(min_row=2, values_only=True))
    failing = big[big["status"].isin(["error", "warning"])]
    status, origin, step = COLUMNS.index("status"), COLUMNS.index("origin"), COLUMNS.index("step")
    assert len(rows) == min(len(failing), R.XLSX_MAX_ROWS) and all(r[status] != "pass" for r in rows)
    assert sum(bool(r[origin]) for r in rows) == int((failing["origin"] & (failing["status"] == "error")).sum())
    assert [r[step] for r in rows] == sorted(r[step] for r in rows)
    assert any(f"of {len(big)}" in (r[0] or "") for r in wb["summary"].iter_rows(values_only=True))


def test_progress_bar_covers_the_report(tmp_path, capsys):
    a = record(tmp_path / "a", task="statistics")
    compare(a, a, out=str(tmp_path / "out"), progress=True)
    err = capsys.readouterr().err
    assert "compare.xlsx" in err and "compare.html" in err


def test_html_structure(report):
    out, table, verdict = report
    page = (out / "compare.html").read_text()
    for needle in ('id="chart-forward"', 'id="chart-backward"', 'id="tree"', 'id="report-data"', 'id="suspicious"',
                   "sortTable", 'id="metadata"', "aten._softmax.default", 'href="unmatched.csv"', "Plotly.react"):
        assert needle in page
    assert f"Unmatched records: {len(pd.read_csv(out / 'unmatched.csv'))} (" in page      # as unmatched.csv has them
    import re
    # self-contained: no resource loaded from elsewhere (plotly.js's own strings may name URLs)
    assert not re.search(r'<(script|link|img|iframe)[^>]+(src|href)="(https?:)?//', page)
    from dispatchprobe.offline.report import report_data
    data = report_data(table, verdict, "rel_l2_err")
    fwd = data["nodes"][data["divs"]["forward"]["node"]]
    assert fwd["path"] == verdict.forward.scope and "forward" in fwd["div"] and fwd["c"][3] > 0
    # the marks say the terminal's words: its lines, the divergences' headlines, none of them quiet
    assert all(d["text"] in str(verdict).splitlines() for d in data["divs"].values()), data["divs"]
    assert [(d["label"], d["departure"]) for d in data["divs"].values()] == \
        [("first forward divergence", False), ("first backward divergence", False)]
    assert data["metric"] == "rel_l2_err" and set(data["series"]) == {"0/0"}
    root = next(n for n in data["nodes"] if n["parent"] is None)
    assert root["c"][3] == table.groupby(["step", "rank", "stage", "kind", "seq"])["status"].apply(
        lambda s: (s == "error").any()).sum()
    embedded = [op for n in data["nodes"] for op in n["ops"]]
    assert len(embedded) == len(set(embedded)) and all(len(n["ops"]) <= 40 for n in data["nodes"])


def test_html_statistics_records_default_to_stats_err(tmp_path):
    """Statistics records have no cosine: the chart shows stats_err; several steps get a heatmap."""
    a = record(tmp_path / "a", steps=2, task="statistics")
    b = record(tmp_path / "b", steps=2, task="statistics", plant=True)
    table, verdict = compare(a, b, out=str(tmp_path / "out"))
    from dispatchprobe.offline.report import report_data
    data = report_data(table, verdict, "cosine")
    assert data["metric"] == "stats_err" and "cosine" not in data["metrics"]
    assert set(data["series"]) == {"0/0", "1/0"} and data["heat"]["parts"] == ["0/0", "1/0"]
    page = (tmp_path / "out" / "compare.html").read_text()
    import re
    ids = re.findall(r'id="([^"]+)"', re.sub(r"<script.*?</script>", "", page, flags=re.S))
    assert len(ids) == len(set(ids)) and "part-select" in ids and "heatmap" in ids


def test_html_marks_structure_differences(tmp_path):
    """Ops present in one run only mark their module ('in one run only') in the tree."""
    from compare_helpers import record as rec
    a = rec(tmp_path / "a", task="statistics", autocast=True)
    b = rec(tmp_path / "b", task="statistics")
    table, verdict = compare(a, b)
    from dispatchprobe.offline.report import report_data
    data = report_data(table, verdict, "cosine")
    um = verdict.unmatched[~verdict.unmatched["is_cast"]]
    assert len(verdict.unmatched) and verdict.unmatched["is_cast"].any()
    root = next(n for n in data["nodes"] if n["parent"] is None)
    assert root["ua"] + root["ub"] == len(um)
    assert sum(len(n["um"]) for n in data["nodes"]) == min(len(verdict.unmatched), sum(
        min(40, c) for c in verdict.unmatched.groupby(verdict.unmatched["scope"].fillna("")).size()))


def csv_counts(out) -> tuple[dict, dict]:
    """From compare.csv: tensors (rows) by status, and ops (op/module calls, each at its worst row) by status."""
    csv = pd.read_csv(out / "compare.csv", keep_default_na=False)
    worst = csv.assign(sev=csv["status"].map({"error": 3, "warning": 2, "pass": 1}).fillna(0)).groupby(
        ["step", "rank", "stage", "kind", "seq"])["sev"].max()
    names = {3: "error", 2: "warning", 1: "pass", 0: "not judged"}
    ops = {name: int((worst == sev).sum()) for sev, name in names.items()}
    return csv["status"].value_counts().to_dict(), ops


@needs_chromium
@pytest.mark.parametrize("width", WIDTHS)
def test_html_renders_in_headless_chromium(report, tmp_path, width):
    """At 1400 and 1000 px: the first forward divergence is expanded, visible, marked and selected (its op
    row highlighted), both charts drawn, nothing is wider than the page or the detail pane in any module's
    cards, no number or dtype wraps; the heading counts tensors and the tree ops, each as compare.csv has them."""
    out, _, verdict = report
    png = screenshot(out / "compare.html", tmp_path, width)
    assert len(png) > 10_000 and png[:8] == b"\x89PNG\r\n\x1a\n"
    res = layout(out / "compare.html", tmp_path, width)
    fwd = res["marks"]["forward"]
    assert fwd["marked"] and fwd["visible"] and fwd["selected"] and res["rows"] >= 1, res
    assert fwd["badge"] == "first forward divergence" and res["detail"] == verdict.forward.scope
    assert res["plots"] >= 2, res
    assert "attn" in res["search"] and "mlp" not in res["search"] and "attn" in res["worst_only"]
    assert_fits(res)
    tensors, ops = csv_counts(out)
    assert f"compared {sum(tensors.values())} tensors" in res["summary"]
    assert all(f"{k} {tensors.get(k, 0)}" in res["summary"] for k in ("pass", "warning", "error"))
    assert counts(res["root_counts"]) == ops and "ops beneath" in res["root_counts"]
    assert counts(res["units"].split(": ", 1)[1]) == ops and "tensors (rows of compare.csv)" in res["units"]
    # the tree's badges name their unit: the root (<top>: the loss's ops are outside every module) counts every error op
    root = dict(res["badges"])["<top>"]
    assert f"{ops['error']} err ops" in root, res["badges"]


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """Two steps of full tensors, a wrong softmax planted in run B's layers.1.attn: a heat map."""
    root = tmp_path_factory.mktemp("heat")
    a, b = record(root / "a", steps=2), record(root / "b", steps=2, plant=True)
    return compare(a, b)


@needs_chromium
@pytest.mark.parametrize("metric", ["cosine", "rel_l2_err"])
def test_heatmap_darker_is_worse(two_steps, tmp_path, metric):
    """The heat map's cell of the planted module (an error) is drawn darker than the best-agreeing one
    (a pass, pale), whichever metric is charted; no axis label is cut."""
    from dispatchprobe.offline.report import COMPARE_LEVELS, write_reports
    table, verdict = two_steps
    out = tmp_path / "out"
    write_reports(str(out), table, verdict, {}, {}, metric=metric)
    res = layout(out / "compare.html", tmp_path, 1000)
    heat = res["heat"]
    assert heat["worst"]["module"] == "TinyTransformer.layers.1.attn", heat
    assert heat["worst"]["lum"] < heat["best"]["lum"] - 100, heat      # darker is worse
    names = [lv["name"] for lv in COMPARE_LEVELS]
    assert names[heat["worst"]["sev"]] == "error" and names[heat["best"]["sev"]] == "pass", heat
    assert heat["best"]["lum"] > 200, heat
    assert "<top>" in heat["modules"]
    assert not cut_labels(res), cut_labels(res)
    assert_fits(res)


def test_heatmap_cells_are_the_verdicts(two_steps):
    """Each cell's level is the worst status of the module's outputs in that part (its colour), whatever
    the metric's values: a module agreeing exactly (0) is a pass with the value 0, one without the metric
    at all (scalars have no cosine) still drawn at its verdict."""
    from dispatchprobe.offline.report import COMPARE_LEVELS, report_data
    table, verdict = two_steps
    t = table.copy()
    t.loc[t["scope"] == "TinyTransformer.head", "rel_l2_err"] = 0.0
    t.loc[t["scope"].fillna("") == "", "rel_l2_err"] = float("nan")
    heat = report_data(t, verdict, "rel_l2_err")["heat"]
    names = [lv["name"] for lv in COMPARE_LEVELS]
    depth = max(len(m.split(".")) for m in heat["modules"])     # scopes cut at the map's depth
    out = t[t["io"] == "output"]
    out = out.assign(part=out["step"].astype(str) + "/" + out["rank"].astype(str),
                     module=out["scope"].fillna("").str.split(".").str[:depth].str.join(".").replace("", "<top>"))
    for i, part in enumerate(heat["parts"]):
        for j, module in enumerate(heat["modules"]):
            rows = out[(out["part"] == part) & (out["module"] == module)]
            assert heat["sev"][i][j] == max(names.index(s) for s in rows["status"]), (part, module)
            assert heat["errors"][i][j] == (rows["status"] == "error").sum()
    head, top = heat["modules"].index("TinyTransformer.head"), heat["modules"].index("<top>")
    assert all(row[head] == 0 for row in heat["z"]) and all(row[top] is None for row in heat["z"])
    assert all(row[top] is not None for row in heat["sev"])


@pytest.fixture(scope="module")
def within_tolerance(tmp_path_factory):
    """Two steps of the MLP + encoder net, run B's gelu 1e-6 too large: every tensor passes (cosines of
    1 - 1e-12), the first departure within tolerance is that gelu."""
    root = tmp_path_factory.mktemp("tol")
    a = record_net(root / "a", steps=2)
    b = record_net(root / "b", steps=2, setup=lambda m: scaled_gelu(1e-6))
    table, verdict = compare(a, b, out=str(root / "out"))
    return root / "out", table, verdict


@needs_chromium
@pytest.mark.parametrize("width", WIDTHS)
def test_agreement_within_tolerance_is_not_shouted(within_tolerance, tmp_path, width):
    """The terminal says the runs agree within tolerance (first departure: the gelu): the page says the
    same and no more.  The gelu's module carries the quiet departure badge (not red, never "divergence"),
    the forward chart marks the departure as such, no backward mark (the terminal names one departure),
    every heat-map cell is drawn in the pass colour (pale), and no tick label or axis title is cut."""
    out, table, verdict = within_tolerance
    assert verdict.passed and verdict.forward is None and verdict.backward is None, str(verdict)
    d = verdict.departure
    assert (d.op, d.scope, d.stage) == ("aten.gelu.default", "Net.mlp.1", "forward"), str(verdict)
    assert table["cosine"].min() > 0.99999 and (table["status"] == "pass").all()
    res = layout(out / "compare.html", tmp_path, width)
    words = [b for _, bs in res["badges"] for b in bs] + [t for t, _ in res["badge_colors"]] + res["annotations"]
    assert not [w for w in words if "divergence" in w], words
    assert not [b for b in res["badge_colors"] if is_red(b[1])], res["badge_colors"]
    mark = res["marks"]["forward"]
    assert mark["badge"] == "first forward departure (within tolerance)" and mark["quiet"], mark
    assert mark["name"] == "1" and mark["visible"] and mark["selected"] and not is_red(mark["badge_bg"]), mark
    assert list(res["marks"]) == ["forward"], res["marks"]
    terminal = str(verdict).splitlines()
    said = [t for t, _ in res["badge_colors"] if t.startswith("the runs agree")]
    assert said and all(t in terminal for t in said), (said, terminal)
    marked = [a for a in res["annotations"] if not a.startswith("error at cosine <= ")]     # the threshold's line
    assert marked == ["first forward departure (within tolerance): aten.gelu.default"], res["annotations"]
    heat = res["heat"]
    assert heat and len(heat["cells"]) == 2 * len(heat["modules"]), heat
    passing = [lv["name"] for lv in _levels(out)].index("pass")
    assert all(c["sev"] == passing for c in heat["cells"]), heat["cells"][:3]
    pale = rgb(next(lv["fill"] for lv in _levels(out) if lv["name"] == "pass"))
    assert all(max(abs(x - y) for x, y in zip(c["rgb"], pale)) <= 8 and c["lum"] > 200 for c in heat["cells"]), \
        heat["worst"]
    ticks = [t for t in res["axes"] if not t["title"] and t["plot"] == "chart-forward" and t["axis"] == "y"]
    assert len(ticks) >= 2 and not cut_labels(res), (cut_labels(res), ticks)
    assert_fits(res)


def _levels(out) -> list:
    from html_check import page_data
    return page_data((out / "compare.html").read_text())["levels"]


def test_an_uninitialised_buffer_leaves_an_op_at_its_other_rows_level():
    """An op's uninitialised buffer has nothing to judge: it leaves the op at its other rows' level (an
    ``index_put_`` into ``empty`` still passes); an op with nothing else, or one with a row the rules could
    not judge (past a discrete choice), is "not judged", which outranks pass on the page."""
    from dispatchprobe.offline.report_digest import COMPARE_LEVELS, op_groups
    from dispatchprobe.standards.verdicts import UNDEFINED_CONTENTS
    rows = [(0, "pass", ""), (0, "not judged", f"{UNDEFINED_CONTENTS} in both runs"),
            (1, "not judged", f"{UNDEFINED_CONTENTS} in run A"),
            (2, "pass", ""), (2, "not judged", "follows a discrete choice the runs made differently"),
            (3, "warning", ""), (3, "not judged", "follows a discrete choice the runs made differently")]
    table = pd.DataFrame({"step": 0, "rank": 0, "stage": "forward", "kind": "op", "seq": [r[0] for r in rows],
                          "scope": "m", "status": [r[1] for r in rows], "reason": [r[2] for r in rows],
                          "origin": False})
    nf = pd.DataFrame({k: np.zeros(len(rows), bool) for k in ("differ", "made_a", "made_b")})
    names = [lv["name"] for lv in COMPARE_LEVELS]
    assert [names[s] for s in op_groups(table, nf)["sev"]] == ["pass", "not judged", "not judged", "warning"]
