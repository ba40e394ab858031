"""A value the two runs compute with other ops: one run's kernel stands in for several of the other's
(the backward of ``unbind`` is one ``stack``; of three indexings it is three ``select_backward`` and the
``add`` of them), paired by output shape, the other run's pieces present in that run only.  Where the
value differs while what both runs read agrees, the wrong kernel may be either run's: compare named the
first ``select_backward`` as the prime suspect also where the ``stack`` was the wrong one.  Now, on
statistics, the value is named with both runs' ops; with tensors, a float64 re-run of the two stand-in
records tells which side holds the wrong kernel."""

from __future__ import annotations


import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dispatchprobe import DispatchProbe
from dispatchprobe.offline.compare.driver import compare_parts
from dispatchprobe.records.reader import load

from compare_helpers import planted


class _Attention(nn.Module):
    def __init__(self, split: str):
        super().__init__()
        self.split = split
        self.qkv = nn.Linear(16, 48)
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        qkv = self.qkv(x).view(2, 8, 3, 16).permute(2, 0, 1, 3)
        q, k, v = qkv.unbind(0) if self.split == "unbind" else (qkv[0], qkv[1], qkv[2])
        return self.proj(F.softmax(q @ k.transpose(-1, -2), -1) @ v)


def _wrong_stack(ts, dim=0):
    return torch.cat([t.unsqueeze(dim) for t in ts], dim) * 1.01


def _wrong_select_backward(grad, sizes, dim, index):
    out = grad.new_zeros(sizes)
    out.select(dim, index).copy_(grad * 1.01)
    return out


WRONG = {"stack": _wrong_stack, "select_backward": _wrong_select_backward}


def _record(path, task: str, split: str, wrong: str = ""):
    """One backward of the attention, its q, k, v split by ``unbind`` or by indexing; ``wrong``: that
    aten kernel 1% too large on CPU."""
    torch.manual_seed(0)
    model, x = _Attention(split), torch.randn(2, 8, 16)
    with planted({wrong: WRONG[wrong]} if wrong else {}):
        probe = DispatchProbe(task=task, dump_path=str(path))
        with probe:
            model(x).square().mean().backward()
        probe.close()
    return load(path).part(0, 0)


def _backward_lines(tmp_path, task: str, wrong: str) -> list:
    """The backward divergence of both orders: the run holding the wrong kernel against a clean run
    that splits the other way."""
    split_wrong, split_clean = ("unbind", "index") if wrong == "stack" else ("index", "unbind")
    bad = _record(tmp_path / "bad", task, split_wrong, wrong)
    good = _record(tmp_path / "good", task, split_clean)
    found = []
    for a, b in ((bad, good), (good, bad)):
        divs = {d.stage: d for d in compare_parts(a, b).divergences}
        assert divs.get("forward") is None, divs
        found.append(divs["backward"])
    return found


@pytest.mark.parametrize("wrong", ["stack", "select_backward"])
def test_on_statistics_the_value_is_named_with_both_runs_ops(tmp_path, wrong):
    for d in _backward_lines(tmp_path, "statistics", wrong):
        assert d.cause == "region", d.describe()
        assert {d.op, d.other_op} == {"aten.stack.default", "aten.add.Tensor"}, d.describe()
        assert sorted(d.region.values()) == [["aten.select_backward.default", "aten.select_backward.default",
                                              "aten.add.Tensor", "aten.select_backward.default", "aten.add.Tensor"],
                                             ["aten.stack.default"]], d.region
        line = d.describe()
        assert "prime suspect" not in line and "cannot tell which" in line, line


def test_with_tensors_a_wrong_stand_in_is_named(tmp_path):
    for d in _backward_lines(tmp_path, "tensor", "stack"):
        assert d.cause == "op" and not d.approximate, d.describe()
        assert {d.op, d.other_op} == {"aten.stack.default", "aten.add.Tensor"}, d.describe()


def test_with_tensors_a_wrong_piece_is_named(tmp_path):
    for d in _backward_lines(tmp_path, "tensor", "select_backward"):
        assert (d.cause, d.op) == ("unmatched", "aten.select_backward.default"), d.describe()


def _softmax_backward_slightly_off(grad, out, dim, dtype):
    return (grad - (grad * out).sum(dim, keepdim=True)) * out * 1.0003


@pytest.mark.parametrize("wrong", ["stack", "select_backward"])
def test_a_value_adding_far_more_than_it_is_given_is_named_not_what_it_was_given(tmp_path, wrong):
    """The softmax's backward 0.03% off (below the error line) in the run holding the wrong kernel,
    before the value both runs compute with other ops: that value differs some 30 times more than what
    enters it, so it is the source (on statistics, with both runs' ops), in both orders."""
    split_wrong, split_clean = ("unbind", "index") if wrong == "stack" else ("index", "unbind")
    kernels = {wrong: WRONG[wrong], "_softmax_backward_data": _softmax_backward_slightly_off}
    recs = []
    for path, split, planted_here in (("bad", split_wrong, kernels), ("good", split_clean, {})):
        torch.manual_seed(0)
        model, x = _Attention(split), torch.randn(2, 8, 16)
        with planted(planted_here):
            probe = DispatchProbe(task="statistics", dump_path=str(tmp_path / path))
            with probe:
                model(x).square().mean().backward()
            probe.close()
        recs.append(load(tmp_path / path).part(0, 0))
    for a, b in (recs, recs[::-1]):
        d = {d.stage: d for d in compare_parts(a, b).divergences}["backward"]
        line = d.describe()
        assert d.cause == "region" and {d.op, d.other_op} == {"aten.stack.default", "aten.add.Tensor"}, line
        assert "adds a difference of its own" in line and "from aten._softmax_backward_data.default" in line, line
        assert "agree up to rounding" not in line and "prime suspect" not in line, line
