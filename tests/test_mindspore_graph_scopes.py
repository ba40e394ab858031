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


class Block(nn.Cell):
    def __init__(self):
        super().__init__()
        self.up, self.act = nn.Dense(4, 4), nn.GELU(approximate=False)

    def construct(self, x):
        return self.act(self.up(x))


GRAD = "Gradients/Default/network-WithLossCell/_backbone-Block"
# the sum of the exact GELU's two gradient branches, which MindSpore names after the cell that made their input
SUM = f"{GRAD}/up-Dense/AddN-op1"


def _untraced_sum(scopes, *makers: str | None):
    """The graph's AddN with no trace, of one argument per entry of ``makers``: a gradient kernel traced
    in that cell of ``Block``, or a parameter (None: no kernel of the graph made it)."""
    from dispatchprobe_ms.graph_ir import Node
    file, line = scopes._construct
    model = (file, line, "    def construct(self, x):", "def construct(self, x):")

    def traced(cell):
        return [OUTSIDE[0], model, (file, line + 4, "        return self.act(self.up(x))", f"self.{cell}"),
                ("/ms/nn/layer/basic.py", 700, "    def construct(self, x):", "def construct(self, x):")]
    args = [f"%{i}" if cell else f"%para{i}" for i, cell in enumerate(makers)]
    nodes = [Node(name=f"{GRAD}/{cell}/Mul-op{i}", op="Mul", ref=arg, frames=traced(cell)) if cell else None
             for i, (arg, cell) in enumerate(zip(args, makers))]
    return Node(name=SUM, op="AddN", ref="%9", args=args, makers=nodes)


@pytest.mark.parametrize("makers", [("act", "act"), ("act", "act", "up")])
def test_a_kernel_with_no_trace_is_in_the_cell_its_inputs_were_made_in(makers):
    """MindSpore names the AddN summing the GELU's gradient branches after Dense ``up``; its inputs are
    branches of ``act``'s backward (with a residual's gradient from elsewhere added in), summed inside
    aten's gelu_backward: it is ``Block.act``'s."""
    scopes = GraphScopes(Block())
    assert scopes.kernel(SUM, _untraced_sum(scopes, *makers)) == ("backward", "Block.act")


@pytest.mark.parametrize("makers", [("act", "up"), ("act", "act", "up", "up"), ("act", "act", None)])
def test_the_name_decides_where_the_inputs_of_an_untraced_kernel_name_no_one_cell(makers):
    """One input from each of two cells (gradients of a value two cells use), two cells giving several,
    or an input the IR names no kernel of (a parameter): the name's cell, as before."""
    scopes = GraphScopes(Block())
    assert scopes.kernel(SUM, _untraced_sum(scopes, *makers)) == ("backward", "Block.up")
    assert scopes.kernel(SUM, None) == ("backward", "Block.up")
