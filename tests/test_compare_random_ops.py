"""Two runs whose values first differ at a random op (dropout: each run, device type or compiled
graph draws its own numbers) get no precision verdict: compare names the random op, does not judge
the backward computed after it, and exits 1, in either order; a precision error before the random
op is still named as such; ``seed_all(rm_dropout=True)`` makes such runs comparable."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from torch import nn

from dispatchprobe import DispatchProbe, seed_all
from dispatchprobe.cli import main
from dispatchprobe.core import op_traits
from dispatchprobe.offline.compare import compare
from dispatchprobe.offline.compare.choice import AFTER, MADE

sys.path.insert(0, os.path.dirname(__file__))
from compare_helpers import scaled_gelu  # noqa: E402

transformers = pytest.importorskip("transformers")


def gpt2_run(path, draws: int, rm_dropout: bool = False):
    """One training step of a tiny GPT-2 (dropout 0.1 everywhere, transformers' default): weights from
    seed 0, the dropout masks from seed ``draws``."""
    if rm_dropout:
        seed_all(0, rm_dropout=True)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64,
                                                                 n_positions=16))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(draws)
    probe = DispatchProbe(task="statistics", dump_path=str(path))
    with probe:
        model(input_ids=ids, labels=ids).loss.backward()
    probe.close()
    return path / "step0" / "rank0"


class DropoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.act, self.drop, self.down = nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.5), nn.Linear(16, 4)

    def forward(self, x):
        return self.down(self.drop(self.act(self.up(x))))


def net_run(path, draws: int, bug: bool = False):
    torch.manual_seed(0)
    model = DropoutNet()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(draws)
    probe = DispatchProbe(task="statistics", dump_path=str(path))
    if bug:
        with scaled_gelu(0.02), probe:
            model(x).square().mean().backward()
    else:
        with probe:
            model(x).square().mean().backward()
    probe.close()
    return path / "step0" / "rank0"


@pytest.fixture
def functional_restored(monkeypatch):
    """seed_all(rm_dropout=True) replaces torch.nn.functional's dropouts: put back after the test."""
    for name in ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
                 "scaled_dot_product_attention"):
        monkeypatch.setattr(F, name, getattr(F, name))


def test_runs_that_draw_differently_get_no_precision_verdict(tmp_path):
    a, b = gpt2_run(tmp_path / "a", draws=1), gpt2_run(tmp_path / "b", draws=2)
    seen = []
    for x, y in ((a, b), (b, a)):
        _, v = compare(x, y)
        f = v.forward
        assert f.cause == "random" and op_traits.is_random(f.op), v
        assert v.backward is None or v.backward.cause == "after_random", v
        assert v.random_only and not v.passed
        seen.append((f.scope, f.call, f.op))
        res = CliRunner().invoke(main, ["compare", str(x), str(y)])
        assert res.exit_code == 1, res.output
        assert "first forward difference, at a random op" in res.output and "not a precision verdict" in res.output
        assert "first forward divergence" not in res.output and "rm_dropout=True" in res.output
        if v.backward is not None:
            assert "backward: not judged" in res.output
    assert seen[0] == seen[1]          # the same op named whichever run is A


def test_the_page_marks_a_random_op_quietly_in_the_terminal_words(tmp_path):
    from dispatchprobe.offline.report import report_data
    table, v = compare(gpt2_run(tmp_path / "a", draws=1), gpt2_run(tmp_path / "b", draws=2), out=str(tmp_path / "out"))
    data = report_data(table, v, "stats_err")
    assert data["divs"] and all(d["quiet"] and not d["departure"] for d in data["divs"].values()), data["divs"]
    assert all(d["text"] in str(v).splitlines() for d in data["divs"].values())
    assert data["divs"]["forward"]["label"] == "first forward difference, at a random op"
    assert "divergence" not in " ".join(d["label"] for d in data["divs"].values())
    # no row, count or op on the page says more than the verdict: the dropouts' draws and what is
    # computed from them are not judged, none an error's origin
    assert not (table["status"] == "error").any() and not table["origin"].any()
    drawn = table[table["reason"] == MADE["random"]]
    assert len(drawn) and drawn["op_a"].map(op_traits.is_random).all()
    after = table[table["reason"].str.startswith(AFTER["random"])]
    assert len(after) and (after["status"] == "not judged").all() and set(after["stage"]) == {"forward", "backward"}
    assert v.after_random == len(drawn) + len(after) and "values a random op's draws decide" in str(v)
    error = [lv["name"] for lv in data["levels"]].index("error")
    assert not any(op["origin"] or op["sev"] == error for op in data["ops"])


def test_the_same_draws_agree_and_rm_dropout_makes_runs_comparable(tmp_path, functional_restored):
    _, v = compare(gpt2_run(tmp_path / "a", draws=1), gpt2_run(tmp_path / "b", draws=1))
    assert v.passed and v.forward is None and v.backward is None, v
    _, v = compare(gpt2_run(tmp_path / "c", draws=1, rm_dropout=True),
                   gpt2_run(tmp_path / "d", draws=2, rm_dropout=True))
    assert v.passed and v.forward is None and v.backward is None, v


def test_a_precision_error_before_the_random_op_is_still_named(tmp_path):
    clean, bug = net_run(tmp_path / "clean", draws=1), net_run(tmp_path / "bug", draws=2, bug=True)
    for x, y in ((bug, clean), (clean, bug)):
        _, v = compare(x, y)
        assert (v.forward.cause, v.forward.op) == ("op", "aten.gelu.default"), v
        assert not v.random_only
        assert CliRunner().invoke(main, ["compare", str(x), str(y)]).exit_code == 2
