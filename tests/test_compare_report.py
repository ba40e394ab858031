"""compare's reports: CSV columns, xlsx highlighting, and the HTML page rendered in headless Chromium."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pandas as pd
import pytest

from dispatchprobe.offline.compare import COLUMNS
from dispatchprobe import compare

sys.path.insert(0, os.path.dirname(__file__))
from compare_helpers import record  # noqa: E402


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
    out, _, verdict = report
    page = (out / "compare.html").read_text()
    for needle in ('id="chart-forward"', 'id="chart-backward"', 'class="first-divergence"', 'id="suspicious"',
                   "sortTable", 'id="metadata"', "aten._softmax.default"):
        assert needle in page
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "https://" not in page


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


# In CI the README's test command installs Chromium, so a missing browser there is a failure.
@pytest.mark.skipif(_chromium() is None and not os.environ.get("CI"),
                    reason="no chromium on this machine (the README's test command installs it): "
                           "HTML checked structurally only")
def test_html_renders_in_headless_chromium(report, tmp_path):
    out, _, _ = report
    shot = tmp_path / "shot.png"
    base = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={tmp_path / 'ud'}"]
    url = (out / "compare.html").as_uri()
    subprocess.run(base + [f"--screenshot={shot}", "--window-size=1000,1200", url], capture_output=True, timeout=90)
    assert shot.stat().st_size > 10_000
    with open(shot, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    dom = subprocess.run(base + ["--dump-dom", url], capture_output=True, text=True, timeout=90).stdout
    assert 'id="chart-forward"' in dom and 'class="first-divergence"' in dom and "<tr class=\"error\">" in dom


def test_html_charts_every_part(tmp_path):
    """Multi-step runs: one chart block per step/rank, a selector to switch, ids unique."""
    a = record(tmp_path / "a", steps=2, task="statistics")
    b = record(tmp_path / "b", steps=2, task="statistics", plant=True)
    compare(a, b, out=str(tmp_path / "out"))
    page = (tmp_path / "out" / "compare.html").read_text()
    assert 'id="part-select"' in page and "showPart" in page
    for s in (0, 1):
        assert f'id="part-step{s}-rank0"' in page
    import re
    ids = re.findall(r'id="([^"]+)"', page)
    assert len(ids) == len(set(ids)) and "chart-forward" in ids and "chart-backward-step1-rank0" in ids
