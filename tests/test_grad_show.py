"""``dispatchprobe show`` of a grad-probe run: a row per step and parameter with --op (name or regex),
and with --html each selected parameter's gradient norm over the steps (docs/grad-probe.md)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from click.testing import CliRunner

from dispatchprobe import DispatchProbe
from dispatchprobe.cli import main


def _grad_run(path, steps=4, inf_at=None, scale_from=None):
    """SGD steps of a small MLP under the grad probe (L2); with ``inf_at``, the last layer's bias gradient
    is inf at that step (its norm too); with ``scale_from``, the first layer's weight gradient is 3x and
    10 % of its signs flipped from that step on."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    step = [0]
    if inf_at is not None:
        model[2].bias.register_hook(lambda g: g * math.inf if step[0] == inf_at else g)
    if scale_from is not None:
        flip = torch.where(torch.rand(16, 8, generator=torch.Generator().manual_seed(7)) < 0.1, -3.0, 3.0)
        model[0].weight.register_hook(lambda g: g * flip if step[0] >= scale_from else g)
    probe = DispatchProbe(task="grad_probe", dump_path=str(path), grad_level="L2", model=model)
    gen = torch.Generator().manual_seed(3)
    for i in range(steps):
        step[0] = i
        (model(torch.randn(32, 8, generator=gen)) ** 2).sum().backward()
        opt.step()
        opt.zero_grad()
    probe.close()
    return path


def _recorded(path) -> dict:
    """(step, parameter) -> the record in grads.jsonl (one rank)."""
    out = {}
    for step_dir in sorted(path.glob("step*")):
        for line in (step_dir / "rank0" / "grads.jsonl").read_text().splitlines():
            rec = json.loads(line)
            out[(int(step_dir.name[4:]), rec["param"])] = rec
    return out


@pytest.fixture(scope="module")
def grad_run(tmp_path_factory):
    return _grad_run(tmp_path_factory.mktemp("g") / "run")


def _table(output: str) -> list[list[str]]:
    return [line.split() for line in output.strip().splitlines()]


def test_op_lists_each_step_of_the_matching_parameters_as_recorded(grad_run):
    res = CliRunner().invoke(main, ["show", str(grad_run), "--op", "2.weight"])
    assert res.exit_code == 0, res.output
    head, *rows = _table(res.output)
    assert head[:3] == ["step", "parameter", "dtype"] and {"norm", "max", "min", "zero", "share"} <= set(head)
    recorded = _recorded(grad_run)
    assert [(int(r[0]), r[1]) for r in rows] == [(s, "2.weight") for s in range(4)]
    norm, mx, mn = head.index("norm") + 1, head.index("max") + 1, head.index("min") + 1   # "(16, 4)" is 2 tokens
    for r in rows:
        rec = recorded[(int(r[0]), r[1])]
        assert float(r[norm]) == pytest.approx(rec["stats"]["norm"], rel=1e-5)
        assert float(r[mx]) == pytest.approx(rec["stats"]["max"], rel=1e-5, abs=1e-6)
        assert float(r[mn]) == pytest.approx(rec["stats"]["min"], rel=1e-5, abs=1e-6)
        assert float(r[-1]) == pytest.approx(rec["distribution"]["zero"], abs=1e-6)


def test_a_regex_selects_parameters_and_no_match_is_one_line(grad_run):
    res = CliRunner().invoke(main, ["show", str(grad_run), "--param", r"\.bias$"])
    assert res.exit_code == 0, res.output
    rows = _table(res.output)[1:]
    assert [r[1] for r in rows] == ["0.bias"] * 4 + ["2.bias"] * 4       # grouped by parameter, steps in order
    miss = CliRunner().invoke(main, ["show", str(grad_run), "--op", "emb"])
    assert miss.exit_code == 1
    assert miss.output.strip() == "error: no parameter matches 'emb' (a substring or regex of parameter names, " \
                                  "e.g. 0.weight)"
    plain = CliRunner().invoke(main, ["show", str(grad_run)])          # without --op: a row per step
    assert plain.exit_code == 0 and "global norm" in plain.output and len(re.findall(r"^\s+\d+\s+4\s", plain.output,
                                                                                     re.M)) == 4, plain.output


def _lines(page: str) -> dict:
    """parameter -> [(x, y)] of its drawn line, and the crosses of non-finite norms."""
    out = {}
    for name, body in re.findall(r'<g class="param" data-param="([^"]+)">(.*?)</g>', page):
        points = re.search(r'points="([^"]*)"', body).group(1).split()
        out[name] = {"points": [tuple(map(float, p.split(","))) for p in points],
                     "crosses": re.findall(r'class="nonfinite"[^>]*>[^<]*<title>([^<]*)</title>', body)}
    return out


def test_html_draws_each_selected_parameters_norm_over_the_steps(grad_run, tmp_path):
    page = tmp_path / "norms.html"
    res = CliRunner().invoke(main, ["show", str(grad_run), "--op", "weight", "--html", str(page)])
    assert res.exit_code == 0, res.output
    drawn = _lines(page.read_text())
    assert set(drawn) == {"0.weight", "2.weight"}
    recorded = _recorded(grad_run)
    every = [(name, s, recorded[(s, name)]["stats"]["norm"]) for name in drawn for s in range(4)]
    ys = {(name, s): drawn[name]["points"][s][1] for name, s, _ in every}
    for name in drawn:
        xs = [x for x, _ in drawn[name]["points"]]
        assert xs == sorted(xs) and len(set(xs)) == 4                 # a point per step, left to right
    # a larger norm is drawn higher (smaller y), across parameters and steps
    by_norm = sorted(every, key=lambda t: t[2])
    assert [ys[(n, s)] for n, s, _ in by_norm] == sorted((ys[(n, s)] for n, s, _ in by_norm), reverse=True)
    assert "2 parameter(s), 4 step(s)" in page.read_text()


def test_html_marks_a_non_finite_norm_off_the_scale(tmp_path):
    run = _grad_run(tmp_path / "inf", inf_at=3)
    page = tmp_path / "inf.html"
    res = CliRunner().invoke(main, ["show", str(run), "--op", "2.bias", "--html", str(page)])
    assert res.exit_code == 0, res.output
    line = _lines(page.read_text())["2.bias"]
    assert len(line["points"]) == 3 and line["crosses"] == ["2.bias step 3: norm inf"], line


def test_grad_compare_page_draws_the_flagged_parameters_norms_of_both_runs(grad_run, tmp_path):
    from dispatchprobe import compare
    changed = _grad_run(tmp_path / "c", scale_from=2)
    table, verdict = compare(changed, grad_run, out=str(tmp_path / "out"))
    assert verdict.first["param"] == "0.weight", str(verdict)
    said = CliRunner().invoke(main, ["compare", str(changed), str(grad_run)])      # the command line says it too
    assert said.exit_code == 2 and "first divergence: step 2, parameter 0.weight" in said.output, said.output
    drawn = _lines((tmp_path / "out" / "grad_compare.html").read_text())
    flagged = set(table.loc[(table["flag"] != "") & (table["param"] != "summary"), "param"])
    assert "0.weight" in flagged and set(drawn) == {f"{p} ({s})" for p in flagged for s in "AB"}   # flagged only
    a, b = drawn["0.weight (A)"]["points"], drawn["0.weight (B)"]["points"]
    assert a[:2] == b[:2] and all(pa[1] < pb[1] for pa, pb in zip(a[2:], b[2:]))   # A's 3x norm drawn higher

