"""dispatchprobe_ms/graph_scopes.py: a compiled graph's kernel gets the cell its source trace names, before the
one its full name names (MindSpore names a primitive's gradient after the first cell that used it: a loss's
division gradient lands under the model's GELU)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.mindspore      # dispatchprobe_ms imports MindSpore (ci/matrix.py's mindspore leg)
pytest.importorskip("mindspore")

from mindspore import nn

from dispatchprobe_ms.graph_scopes import GraphScopes, _where


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.act = nn.GELU()

    def construct(self, x):
        return self.act(x)


# a loss's kernel whose gradient MindSpore named after the model's act cell
NAMED_IN_ACT = "Gradients/Default/network-WithLossCell/_backbone-Net/act-GELU/Grad_Div/Div-op0"
OUTSIDE = [("/ms/nn/wrap/cell_wrapper.py", 423, "    def construct(self, *inputs):", "def construct(self, *inputs):"),
           ("/ms/ops/function/nn_func.py", 4305, "def cross_entropy(input, target):", "cross_entropy")]


def _inside(scopes) -> list:
    """A trace through the model's construct (as its own kernels have)."""
    file, line = scopes._construct
    return [OUTSIDE[0], (file, line, "    def construct(self, x):", "def construct(self, x):")]


def test_a_kernel_traced_outside_the_model_has_no_scope_whatever_its_name():
    scopes = GraphScopes(Net())
    assert scopes("Default/network-WithLossCell/_backbone-Net/act-GELU/Erf-op0", _inside(scopes))[1] == "Net"
    assert scopes(NAMED_IN_ACT, OUTSIDE) == ("backward", "")


def test_the_name_decides_where_the_trace_cannot():
    """No trace, or no trace yet seen to enter the model's construct (it may not be found in this
    graph's traces at all): the name's cell, as before."""
    scopes = GraphScopes(Net())
    assert scopes(NAMED_IN_ACT, OUTSIDE)[1] == "Net.act"
    assert scopes("Gradients/Default/network-WithLossCell/_backbone-Net/act-GELU/AddN-op1", ())[1] == "Net.act"
    assert _where(Net.construct) == scopes._construct
