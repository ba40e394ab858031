"""run-ut's results page and the inline-check pages (overflow, free_benchmark): the module tree of the tiny
transformer with the planted wrong kernel / fp16 overflow / bf16-only gelu marked, checked in the page's data
and as a person sees it (headless Chromium); the grad compare's heat map coloured as its verdict flags."""

from __future__ import annotations

import math
import os
import re
import sys

import pandas as pd
import pytest
import torch
from click.testing import CliRunner

from dispatchprobe import DispatchProbe, load
from dispatchprobe.cli import main
from dispatchprobe.models import TinyTransformer, lm_batch, lm_loss
from dispatchprobe.offline.run_ut import run_ut, summary_text

sys.path.insert(0, os.path.dirname(__file__))
from html_check import (WIDTHS, assert_fits, counts, heat_cells, is_red, layout, luminance,  # noqa: E402
                        needs_chromium, page_data)
from test_run_ut import record, wrong_gelu  # noqa: E402

GELU_SCOPES = ["TinyTransformer.layers.0.mlp", "TinyTransformer.layers.1.mlp"]


def node(data, path) -> dict:
    return next(n for n in data["nodes"] if n["path"] == path)


@pytest.fixture(scope="module")
def gelu_run(tmp_path_factory):
    """run-ut of a float32 tiny-transformer step with a wrong gelu kernel (both gelu calls err)."""
    root = tmp_path_factory.mktemp("ut_page")
    rec = record(root / "rec")
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("gelu", wrong_gelu, "CPU")
    try:
        partial = run_ut(rec, root / "out", limit=40)
        partial_page = open(partial.report_html).read()
        res = run_ut(rec, resume=partial.result_csv)
    finally:
        lib._destroy()      # at once: a dropped Library lives until collected, its kernels with it
    return partial, partial_page, res


def test_run_ut_page_beside_the_csvs_and_rewritten_on_resume(gelu_run):
    partial, _, res = gelu_run
    ts = re.match(r"accuracy_checking_result_(.+)\.csv", os.path.basename(res.result_csv)).group(1)
    assert res.report_html == os.path.join(os.path.dirname(res.result_csv), f"accuracy_checking_report_{ts}.html")
    assert partial.report_html == res.report_html and f"report: {res.report_html}" in summary_text(res)
    page = open(res.report_html).read()
    assert "incomplete" not in page and not re.search(r'<(script|link|img)[^>]+(src|href)="', page)
    data = page_data(open(res.report_html).read())
    root = next(n for n in data["nodes"] if n["parent"] is None)
    assert root["c"] == [len(res.results) - 2, 0, 0, 2]          # pass, not judged, warning, error
    assert [n["path"] for n in data["nodes"] if any(data["ops"][i]["sev"] == 3 for i in n["ops"])] == GELU_SCOPES
    assert {data["nodes"][i]["path"] for i in data["expand"]} == set(GELU_SCOPES)
    fwd = data["marks"]["forward"]
    assert data["nodes"][fwd["node"]]["path"] == GELU_SCOPES[0] and "backward" not in data["marks"]
    gelu = data["ops"][next(i for i in node(data, GELU_SCOPES[0])["ops"] if data["ops"][i]["sev"] == 3)]
    assert gelu["op"] == "aten.gelu.default.0.forward" and gelu["cells"][0] == "error"
    cosine = data["row_cols"].index("Cosine")
    assert gelu["rows"][0][0] == "output.0" and isinstance(gelu["rows"][0][cosine], float)


def _run_ut_tables(ops):
    """run-ut's two tables for ``ops`` [(scope, forward status)], one output row each."""
    results = pd.DataFrame([{"Step": 0, "Rank": 0, "API Name": f"aten.op.{i}.forward", "Op": "aten.op", "Stage": "forward",
                             "Scope": scope, "Category": "benchmark", "Judged": "replay",
                             "Forward Test Success": status, "Backward Test Success": "", "Message": "",
                             "Elapsed (s)": "0.1"} for i, (scope, status) in enumerate(ops)])
    details = pd.DataFrame([{"Step": 0, "Rank": 0, "API Name": f"aten.op.{i}.forward", "Output": "output.0",
                             "Device Dtype": "torch.float32", "Bench Dtype": "torch.float64", "Shape": "[4]",
                             "Cosine": "" if status == "SKIP" else "1.0", "Status": status, "Message": ""}
                            for i, (_, status) in enumerate(ops)])
    return results, details


def _worst_level(data, path) -> str:
    """The level the explorer colours a node with: its worst level holding an op (explorer.js worst())."""
    n = node(data, path)
    return next(data["levels"][i]["name"] for i in reversed(range(len(n["c"]))) if n["c"][i])


def test_run_ut_page_never_shows_a_module_with_a_skipped_op_as_passing():
    """A module holding an op run-ut could not judge (SKIP) is "not judged", above pass, as on compare's
    page: one ranking for both pages, so a page never says more than the verdict."""
    from dispatchprobe.offline.report_digest import COMPARE_LEVELS
    from dispatchprobe.offline.run_ut_page import run_ut_html
    results, details = _run_ut_tables([("M.a", "pass"), ("M.a", "SKIP"), ("M.b", "pass"), ("M.c", "")])
    data = page_data(run_ut_html(results, details, summary=[], records="rec", manifest={}, result_csv="r.csv"))
    assert data["levels"] == COMPARE_LEVELS
    assert _worst_level(data, "M.a") == "not judged" and _worst_level(data, "M.b") == "pass"
    assert _worst_level(data, "M.c") == "not judged"          # a status no rule gave is no pass either
    assert _worst_level(data, "M") == "not judged"


def test_run_ut_page_of_an_interrupted_run_says_so(gelu_run):
    """A run stopped early (``limit``) writes the page of the ops judged so far and says how to go on."""
    partial, partial_page, res = gelu_run
    assert len(partial.results) == 40 < len(res.results)
    assert f"incomplete: 40 of {len(res.results)} ops judged; continue with --resume {partial.result_csv}" in partial_page
    assert sum(sum(n["c"]) for n in page_data(partial_page)["nodes"] if n["parent"] is None) == 40


@needs_chromium
@pytest.mark.parametrize("width", WIDTHS)
def test_run_ut_page_in_headless_chromium(gelu_run, tmp_path, width):
    """At 1400 and 1000 px: the first gelu error's module is expanded, marked, selected, its op row
    highlighted; nothing is wider than the page, no number wraps; the counts are the result CSV's ops."""
    _, _, res = gelu_run
    from pathlib import Path
    seen = layout(Path(res.report_html), tmp_path, width)
    csv = pd.read_csv(res.result_csv, keep_default_na=False)
    status = csv["Forward Test Success"].where(csv["Forward Test Success"] != "", csv["Backward Test Success"])
    by_status = {k: int((status == k).sum()) for k in ("error", "warning", "pass", "SKIP")}
    shown = {"not judged" if k == "SKIP" else k: n for k, n in by_status.items()}     # the page's name of SKIP
    assert counts(seen["root_counts"]) == shown and "ops beneath" in seen["root_counts"]
    assert f"{len(csv)} ops: {by_status['pass']} pass, {by_status['warning']} warning, {by_status['error']} error" \
        in seen["summary"]
    assert dict(seen["badges"])["TinyTransformer"] == [f"{by_status['error']} err ops"]
    fwd = seen["marks"]["forward"]
    assert fwd["marked"] and fwd["visible"] and fwd["selected"] and fwd["badge"] == "first forward error", seen
    assert seen["detail"] == GELU_SCOPES[0] and seen["rows"] == 1 and "aten.gelu.default.0.forward" in seen["row_text"]
    assert "error" in seen["row_text"]
    assert "mlp" in seen["search"] and "attn" not in seen["search"] and seen["worst_only"].count("mlp") == 2
    assert_fits(seen)


def record_overflow(path, *, plant_weight: bool = False, loss_scale: float = 1.0):
    """One fp16 training step of the tiny transformer under task='overflow' (keep going): ``plant_weight``
    scales layers.1.mlp.up's weight by 1e5 (its addmm overflows in forward); ``loss_scale`` too large
    overflows the first backward cast."""
    torch.manual_seed(0)
    model = TinyTransformer().half()
    if plant_weight:
        with torch.no_grad():
            model.layers[1].mlp.up.weight.mul_(1e5)
    tokens, targets = lm_batch()
    probe = DispatchProbe(task="overflow", dump_path=str(path), model=model, overflow_nums=-1)
    with probe:
        (lm_loss(model, tokens, targets) * loss_scale).backward()
    probe.close()
    return path


@pytest.fixture(scope="module")
def overflow_pages(tmp_path_factory):
    """`dispatchprobe show RUN --html` of a forward and of a backward overflow."""
    root = tmp_path_factory.mktemp("ovf_page")
    pages = {}
    for stage, kw in (("forward", {"plant_weight": True}), ("backward", {"loss_scale": 2.0 ** 24})):
        run = record_overflow(root / stage, **kw)
        out = root / f"{stage}.html"
        result = CliRunner().invoke(main, ["show", str(run), "--html", str(out)])
        assert result.exit_code == 0, result.output
        assert f"report: {out}" in result.output
        pages[stage] = out
    return pages


@pytest.mark.parametrize("stage, scope, op", [("forward", "TinyTransformer.layers.1.mlp.up", "aten.addmm.default"),
                                              ("backward", "<top>", "aten._to_copy.default")])
def test_overflow_page_marks_the_op_that_created_inf_nan(overflow_pages, stage, scope, op):
    page = overflow_pages[stage]
    data = page_data(page.read_text())
    assert list(data["marks"]) == [stage]
    marked = data["nodes"][data["marks"][stage]["node"]]
    assert marked["path"] == scope and stage in marked["div"] and marked["c"][3] == 1     # one critical op
    crit = [data["ops"][i] for i in marked["ops"] if data["ops"][i]["sev"] == 3]
    assert len(crit) == 1 and crit[0]["op"].startswith(op) and crit[0]["k"][2] == stage
    # the recorded critical op lists its tensors: finite inputs, inf in the output
    ios = {(r[0], r[1]): r for r in crit[0]["rows"]}
    inf = data["row_cols"].index("inf")
    assert ios[("output", "output.0")][inf] > 0 and all(r[inf] == 0 for (io, _), r in ios.items() if io == "input")
    root = next(n for n in data["nodes"] if n["parent"] is None)
    assert root["c"][3] == 1 and root["c"][2] > 0       # the overflow propagated beyond its op
    text = open(page).read()
    assert f"first op to create inf/nan in {stage}: {op}" in text


@needs_chromium
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("stage, name", [("forward", "up"), ("backward", "<top>")])
def test_overflow_page_in_headless_chromium(overflow_pages, tmp_path, stage, name, width):
    seen = layout(overflow_pages[stage], tmp_path, width)
    # the heading, the root's counts and the tree's badges: overflow.csv's rows, each an op call
    csv = pd.read_csv(overflow_pages[stage].parent / stage / "step0" / "rank0" / "overflow.csv")
    by_class = {k: int((csv["class"] == k).sum()) for k in ("critical", "propagated",
                                                                        "suspicious growth", "expected")}
    assert counts(seen["root_counts"]) == by_class and "ops beneath" in seen["root_counts"]
    assert ", ".join(f"{v} {k}" for k, v in by_class.items()) in seen["summary"]
    root_badges = seen["badges"][0][1]
    assert root_badges[0] == f"{by_class['critical']} critical op", seen["badges"]
    mark = seen["marks"][stage]
    assert mark["marked"] and mark["visible"] and mark["selected"] and mark["name"] == name, seen
    assert mark["badge"] == f"first {stage} overflow" and seen["rows"] == 1 and "critical" in seen["row_text"]
    assert "output.0" in seen["row_text"]      # the highlighted op lists its tensors
    assert name in seen["search"] and name in seen["worst_only"]      # critical only: the marked module stays
    assert_fits(seen)


def bf16_gelu(x, approximate="none"):
    """gelu 2% off in bfloat16 only: the free benchmark's float32 re-run (improve_precision) is right."""
    y = x.float()
    out = 0.5 * y * (1 + torch.erf(y / math.sqrt(2)))
    return (out * (1 + 2e-2) if x.dtype == torch.bfloat16 else out).to(x.dtype)


def record_free_benchmark(path):
    """One bf16 training step of the tiny transformer under task='free_benchmark' (improve_precision) with
    bf16_gelu planted."""
    torch.manual_seed(0)
    model = TinyTransformer().to(torch.bfloat16)
    tokens, targets = lm_batch()
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("gelu", bf16_gelu, "CPU")
    try:
        probe = DispatchProbe(task="free_benchmark", dump_path=str(path), model=model, pert_mode="improve_precision")
        with probe:
            lm_loss(model, tokens, targets).backward()
        probe.close()
    finally:
        lib._destroy()      # at once: a dropped Library lives until collected, its kernels with it
    return path


@pytest.fixture(scope="module")
def free_benchmark_page(tmp_path_factory):
    """`dispatchprobe show RUN --html` of the free-benchmark run, and the run's free_benchmark.csv rows."""
    root = tmp_path_factory.mktemp("fb_page")
    run = record_free_benchmark(root / "run")
    out = root / "fb.html"
    result = CliRunner().invoke(main, ["show", str(run), "--html", str(out)])
    assert result.exit_code == 0 and f"report: {out}" in result.output, result.output
    return run, out, pd.read_csv(run / "step0" / "rank0" / "free_benchmark.csv")


def test_free_benchmark_page_marks_the_flagged_op(free_benchmark_page):
    """Every flagged op is in the tree; the planted gelu is the first forward flag, marked, with its
    max_rel / limit / pert_mode and its recorded tensors."""
    _, page, csv = free_benchmark_page
    data = page_data(page.read_text())
    root = next(n for n in data["nodes"] if n["parent"] is None)
    assert sum(root["c"]) == len(csv) and data["levels"][0]["name"] == "over the limit"
    fwd = data["marks"]["forward"]
    assert data["nodes"][fwd["node"]]["path"] == GELU_SCOPES[0] and "forward" in data["nodes"][fwd["node"]]["div"]
    gelus = csv[(csv["op"] == "aten.gelu.default") & (csv["stage"] == "forward")]
    assert list(gelus["scope"]) == GELU_SCOPES and (gelus["max_rel"] > gelus["threshold"]).all()
    op = data["ops"][next(i for i in node(data, GELU_SCOPES[0])["ops"])]
    cell = dict(zip(data["op_cols"], op["cells"]))
    assert op["op"] == "aten.gelu.default.0.forward" and op["k"][2] == "forward"
    assert cell["max_rel"] == pytest.approx(gelus["max_rel"].iloc[0]) and cell["threshold"] == 0.004
    assert cell["pert_mode"] == "improve_precision" and cell["x limit"] == pytest.approx(cell["max_rel"] / 0.004, rel=1e-3)
    assert [r[:2] for r in op["rows"]] == [["input", "input.0"], ["output", "output.0"]]
    text = page.read_text()
    assert "first flagged op in forward: aten.gelu.default.0.forward [TinyTransformer.layers.0.mlp]" in text


def test_free_benchmark_levels_by_excess(free_benchmark_page, tmp_path):
    """Levels: over the limit, over 10x the limit, inf/nan differ (max_rel inf); a row without a record
    (no id) is listed without tensors."""
    import shutil
    run, _, csv = free_benchmark_page
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    extra = csv.iloc[:1].assign(api_name=["aten.mul.Tensor.9.forward"], op="aten.mul.Tensor", id=None,
                                scope="TinyTransformer.head")
    far = extra.assign(max_rel=0.05, api_name="aten.mul.Tensor.8.forward")
    diff = extra.assign(max_rel=float("inf"))
    pd.concat([csv, far, diff]).to_csv(copy / "step0" / "rank0" / "free_benchmark.csv", index=False)
    from dispatchprobe.offline.check_pages import check_html
    data = page_data(check_html(load(copy)))
    head = node(data, "TinyTransformer.head")
    assert head["c"] == [0, 1, 1] and {data["ops"][i]["op"]: data["ops"][i]["rows"] for i in head["ops"]} == {
        "aten.mul.Tensor.8.forward": [], "aten.mul.Tensor.9.forward": []}
    assert data["nodes"][data["marks"]["forward"]["node"]]["path"] == GELU_SCOPES[0]   # still the first in order


@needs_chromium
@pytest.mark.parametrize("width", WIDTHS)
def test_free_benchmark_page_in_headless_chromium(free_benchmark_page, tmp_path, width):
    _, page, csv = free_benchmark_page
    seen = layout(page, tmp_path, width)
    # the heading, the root's counts and the tree's badges: free_benchmark.csv's rows (all over the limit here)
    assert counts(seen["root_counts"]) == {"inf/nan differ": 0, "over 10x the limit": 0, "over the limit": len(csv)}
    assert f"{len(csv)} flagged: 0 inf/nan differ, 0 over 10x the limit, {len(csv)} over the limit" in seen["summary"]
    assert dict(seen["badges"])["TinyTransformer"] == [f"{len(csv)} flagged ops"]
    mark = seen["marks"]["forward"]
    assert mark["marked"] and mark["visible"] and mark["selected"] and mark["name"] == "mlp", seen
    assert mark["badge"] == "first forward flagged op" and seen["rows"] == 1
    assert "aten.gelu.default.0.forward" in seen["row_text"] and "improve_precision" in seen["row_text"]
    assert seen["search"].count("mlp") == 2 and "norm" not in seen["search"]
    assert seen["worst_only"] == []          # no inf/nan differ in this run
    assert_fits(seen)


def test_show_html_needs_an_inline_check_run(tmp_path):
    run = record(tmp_path / "rec", task="statistics")
    result = CliRunner().invoke(main, ["show", run, "--html", str(tmp_path / "x.html")])
    assert result.exit_code == 1 and "not an overflow or free_benchmark run" in result.output
    assert not (tmp_path / "x.html").exists() and len(result.output.strip().splitlines()) == 1
    assert load(run).parts      # the records are untouched and readable


# ---- the grad compare's heat map ------------------------------------------------------------------------
def _grad_run(path, flip_from=None, steps=5):
    """SGD steps of a small tanh MLP under the grad probe (L2); with ``flip_from``, from that step on 10 % of
    the first layer's gradient elements change sign: a drop at that step (flagged), the same low similarity
    after it (not flagged: no further drop)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    step = [0]
    if flip_from is not None:
        flip = torch.rand(model[0].weight.shape, generator=torch.Generator().manual_seed(7)) < 0.1
        model[0].weight.register_hook(lambda g: torch.where(flip, -g, g) if step[0] >= flip_from else g)
    probe = DispatchProbe(task="grad_probe", dump_path=str(path), grad_level="L2", model=model)
    gen = torch.Generator().manual_seed(3)
    for i in range(steps):
        step[0] = i
        (model(torch.randn(32, 8, generator=gen)) ** 2).sum().backward()
        opt.step()
        opt.zero_grad()
    probe.close()
    return path


@needs_chromium
def test_grad_page_colours_what_the_verdict_flags(tmp_path):
    """Only the flagged cell (the drop at step 2) is drawn as a fault (the error's dark fill, white text);
    the steps after it, as low in similarity but not flagged by the rule, are drawn pale, like every
    other cell."""
    from dispatchprobe import compare
    a, c = _grad_run(tmp_path / "a"), _grad_run(tmp_path / "c", flip_from=2)
    table, verdict = compare(c, a, out=str(tmp_path / "out"))
    rows = table[table["param"] == "0.weight"].set_index("step")
    assert rows.loc[2, "flag"] and not rows.loc[3, "flag"] and not rows.loc[4, "flag"], rows
    assert rows.loc[3, "similarity"] < 0.95 and rows.loc[4, "similarity"] < 0.95, rows      # low, not flagged
    cells = heat_cells(tmp_path / "out" / "grad_compare.html", tmp_path)
    flagged = [x for x in cells if x["flag"]]
    assert len(flagged) == int((table["flag"] != "").sum()) >= 1, cells
    assert all(luminance(x["bg"]) > 215 and not is_red(x["bg"]) for x in cells if not x["flag"]), \
        [x for x in cells if not x["flag"]]
    assert all(luminance(x["bg"]) < 90 and luminance(x["color"]) > 200 for x in flagged), flagged


def _page_cells(page) -> dict:
    """The grad compare page's heat-map cells as written: (parameter, step) -> background."""
    cells = re.findall(r'<td class="s[^"]*" style="background:([^"]+)" title="([^"]+?) step (\d+):', page.read_text())
    return {(param, int(step)): bg for bg, param, step in cells}


@pytest.mark.parametrize("order", ["ab", "ba"])
def test_grad_page_at_l0_draws_checksums_as_the_verdict_says(tmp_path, order):
    """Level L0 (checksums, no similarity): an unequal checksum (flagged) is drawn in the error's fill and an
    equal one white, in both run orders."""
    from dispatchprobe import compare
    from dispatchprobe.offline.page_kit import VERDICT_LEVELS
    from test_grad_probe import _l0_run
    error = next(lv["fill"] for lv in VERDICT_LEVELS if lv["name"] == "error")
    for name, kw in (("a", {}), ("c", {"nudge_from": 1})):
        _l0_run(tmp_path / name, **kw)
    a, b = (tmp_path / "a", tmp_path / "c")[::1 if order == "ab" else -1]
    table, verdict = compare(a, b, out=str(tmp_path / "out"))
    cells = _page_cells(tmp_path / "out" / "grad_compare.html")
    rows = table[table["param"] != "summary"]
    assert not verdict.passed and set(rows["checksum"]) == {"equal", "unequal"} and len(cells) == len(table)
    for param, step, checksum in zip(rows["param"], rows["step"], rows["checksum"]):
        want = error if checksum == "unequal" else "hsl(50, 90%, 100%)"
        assert cells[(param, int(step))] == want, (param, step, checksum)


def test_grad_page_draws_a_gradient_nothing_compared_as_not_judged(tmp_path):
    """A cell without a similarity or an equal checksum (shapes that differ, checksums of other kinds) is
    "not judged"'s grey, as on compare's page: never the white of a similarity of 1."""
    from types import SimpleNamespace
    from dispatchprobe.offline.grad_compare import COLUMNS
    from dispatchprobe.offline.grad_page import heat_map_page
    from dispatchprobe.offline.page_kit import VERDICT_LEVELS
    fills = {lv["name"]: lv["fill"] for lv in VERDICT_LEVELS}
    rows = [{"step": 0, "param": p, "similarity": sim, "flag": "", "checksum": ck}
            for p, sim, ck in (("w", 1.0, ""), ("b", math.nan, ""), ("c", math.nan, "not comparable"))]
    table = pd.DataFrame(rows).reindex(columns=COLUMNS).fillna({"flag": "", "checksum": "", "param_b": ""})
    page = tmp_path / "g.html"
    page.write_text(heat_map_page(table, SimpleNamespace(a="A", b="B"), {}, {}))
    cells = _page_cells(page)
    assert cells[("w", 0)] == "hsl(50, 90%, 100%)"
    assert cells[("b", 0)] == cells[("c", 0)] == fills["not judged"], cells


def test_free_benchmark_page_says_the_op_calls_it_did_not_judge():
    """The page's heading counts the op calls the free benchmark could not judge (step functions), as
    ``show`` does: "no op moved past its limit" is said of the judged ones only."""
    from types import SimpleNamespace
    from dispatchprobe.offline.check_pages import free_benchmark_summary
    from dispatchprobe.offline.summary import checks_line
    checks = {"task": "free_benchmark", "checked": 5, "flagged": 0, "not_judged": 3}
    run = SimpleNamespace(parts={(0, 0): SimpleNamespace(checks=checks)}, manifest={})
    rows = pd.DataFrame(columns=["pert_mode", "sev", "stage", "x limit"])
    heading = free_benchmark_summary(run, rows)
    shown = checks_line([checks])
    said = "3 op calls not judged"
    assert said in shown and any(line.startswith(said) for line in heading), heading
    assert "no op moved past its limit of those judged" in heading, heading
