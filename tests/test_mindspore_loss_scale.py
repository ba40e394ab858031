"""MindSpore's loss scalers (``amp.StaticLossScaler``/``DynamicLossScaler``: ``scaler.scale(loss)``
inside the function given to ``value_and_grad``, ``scaler.unscale(grads)`` after): a scaled run
against an unscaled one, of MindSpore or of PyTorch, compares its backward unscaled, in both
orders; a wrong backward kernel in the scaled run is still named.  The scalers multiply in compiled
graphs whose kernels the probe records at the end of the step, or not at all: either way backward's
seed, read by the first PyNative op, is the scale.  Runs where mindspore is installed, in blocking
mode."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

pytestmark = pytest.mark.mindspore      # run in MindSpore's own environment (ci/matrix.py)
os.environ.setdefault("MS_DEV_LAUNCH_BLOCKING", "1")
ms = pytest.importorskip("mindspore")
torch = pytest.importorskip("torch")

from mindspore import amp, nn, ops

from dispatchprobe import DispatchProbe as TorchProbe
from dispatchprobe import compare
from dispatchprobe_ms import DispatchProbe
from dispatchprobe_ms.demo import TinyNet, batch

ms.set_context(mode=ms.PYNATIVE_MODE)
SCALE = 1024.0


class Gelu(nn.Cell):
    """Exact GELU with its gradient written out (a bprop: recorded op by op); ``error``: that
    gradient's relative error, the planted wrong backward kernel (0: none)."""

    def __init__(self, error: float = 0.0):
        super().__init__()
        self.factor = 1.0 + error

    def construct(self, x):
        return x * 0.5 * (1 + ops.erf(x / math.sqrt(2)))

    def bprop(self, x, out, dout):
        pdf = ops.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        return (dout * (0.5 * (1 + ops.erf(x / math.sqrt(2))) + x * pdf) * self.factor,)


class Net(nn.Cell):
    """Two bias-free layers: every backward kernel runs inside the dispatch mode on CPU."""

    def __init__(self, error: float = 0.0):
        super().__init__()
        self.up, self.act, self.down = nn.Dense(16, 32, has_bias=False), Gelu(error), nn.Dense(32, 8, has_bias=False)

    def construct(self, x):
        return self.down(self.act(self.up(x)))


def _scaler(kind: str | None, scale: float = SCALE):
    if kind == "static":
        return amp.StaticLossScaler(scale)
    return amp.DynamicLossScaler(scale, 2, 1000) if kind == "dynamic" else None


def _data():
    rng = np.random.RandomState(0)
    return rng.randn(8, 16).astype(np.float32), rng.randn(8, 8).astype(np.float32)


def ms_step(path, net, scaler: str | None, inputs, scale_value: float = SCALE) -> str:
    """One step of ``net`` on a mean squared error, its loss scaled by ``scaler``'s kind (None: not)."""
    scale = _scaler(scaler, scale_value)

    def loss_fn(x, y):
        loss = ((net(x) - y) ** 2).mean()
        return scale.scale(loss) if scale is not None else loss
    grad_fn = ms.value_and_grad(loss_fn, None, net.trainable_params())
    probe = DispatchProbe(task="statistics", dump_path=str(path), model=net)
    with probe:
        _, grads = grad_fn(*map(ms.Tensor, inputs))
        if scale is not None:
            scale.unscale(grads)
    probe.step()
    probe.close()
    return str(path)


def torch_step(path, weights: dict, inputs) -> str:
    """The PyTorch twin of :class:`Net` with the same weights: one unscaled step."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(16, 32, bias=False), torch.nn.Linear(32, 8, bias=False)

        def forward(self, x):
            return self.down(torch.nn.functional.gelu(self.up(x)))
    net = Net()
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(torch.from_numpy(weights[name]))
    x, y = map(torch.from_numpy, inputs)
    with TorchProbe(task="statistics", dump_path=str(path), model=net):
        ((net(x) - y) ** 2).mean().backward()
    return str(path)


def _net(error: float = 0.0) -> Net:
    ms.set_seed(0)
    return Net(error)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ms_loss_scale")
    data = _data()
    out = {"plain": ms_step(root / "plain", _net(), None, data),
           "torch": torch_step(root / "torch", {n: p.asnumpy() for n, p in _net().parameters_and_names()}, data)}
    for kind in ("static", "dynamic"):
        out[kind] = ms_step(root / kind, _net(), kind, data)
        out[kind + "_wrong"] = ms_step(root / f"{kind}_wrong", _net(error=0.3), kind, data)
    # inputs 300 times larger and the largest float32 power of two as the scale: the scaled
    # gradients overflow float32 (inf, and nan after them), as a scaler starting high does
    large = tuple(v * 300 for v in data)
    out["large_plain"] = ms_step(root / "large_plain", _net(), None, large)
    out["large_overflow"] = ms_step(root / "large_overflow", _net(), "dynamic", large, scale_value=2.0 ** 127)
    ms.set_seed(0)
    out["tiny_plain"] = ms_step(root / "tiny_plain", TinyNet(), None, batch(0))
    ms.set_seed(0)
    out["tiny_static"] = ms_step(root / "tiny_static", TinyNet(), "static", batch(0))
    return out


def _both_orders(runs, x, y):
    for order in ((x, y), (y, x)):
        yield order, *compare(runs[order[0]], runs[order[1]])


@pytest.mark.parametrize("other", ["plain", "torch"])
@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_a_scaled_mindspore_run_is_compared_unscaled(runs, kind, other):
    for order, table, v in _both_orders(runs, other, kind):
        assert v.passed and v.forward is None and v.backward is None, (order, str(v))
        assert not (table["status"] == "error").any(), order
        side = "A" if order[0] == kind else "B"
        unscaled = table["reason"].str.contains(f"compared unscaled: run {side}'s loss scale 1024", regex=False)
        # every gradient the matmuls compute (MindSpore's own vocabulary, or aten's against torch)
        gradients = (table["stage"] == "backward") & table["op_a"].isin(["MatMul", "aten.mm.default"]) \
            & (table["arg"] == "output.0")
        assert gradients.sum() == 3 and unscaled[gradients].all(), order
        # the scaler's kernels (the multiplies, the reciprocal, the unscale), where recorded: explained (so
        # are the pieces of the written-out GELU against torch's gelu, compared at the cell's boundary)
        um = v.unmatched
        assert um.empty or (um["explained"] != "").all(), (order, um)
        scalers = um[(um["side"] == side.lower()) & (um["scope"] == "")] if len(um) else um
        assert scalers.empty or scalers["explained"].str.startswith("loss scaling: ").all(), (order, scalers)


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_a_wrong_backward_kernel_in_the_scaled_run_is_named(runs, kind):
    for order, _, v in _both_orders(runs, "plain", kind + "_wrong"):
        assert v.backward is not None and v.backward.cause == "op", (order, str(v))
        assert v.backward.scope == "Net.act", (order, str(v))


def test_values_after_a_kernel_the_probe_cannot_observe_are_not_judged(runs):
    """TinyNet's softmax, bias and layer-norm gradients run outside the dispatch mode on CPU: what
    backward computes from their outputs may carry the scale or not, so it is not judged, and
    nothing is named."""
    for order, table, v in _both_orders(runs, "tiny_plain", "tiny_static"):
        assert v.forward is None and v.backward is None, (order, str(v))
        assert not (table["status"] == "error").any(), order
        reasons = table.loc[table["status"] == "not judged", "reason"]
        assert reasons.str.contains("a kernel the probe cannot observe", regex=False).any(), order


def test_a_loss_scale_overflowing_names_no_op(runs):
    """The scaled run's gradients overflow to inf and nan: those values are not judged (the scaler
    skips the step), and no value holding nan is paired with another by its statistics: a
    multiply whose operand is nan in one run keeps its operands in order (nan statistics are as far
    from everything as can be; an exchange of operands chosen by nan distances made a false error)."""
    for order, table, v in _both_orders(runs, "large_plain", "large_overflow"):
        assert v.forward is None and v.backward is None, (order, str(v))
        assert not (table["status"] == "error").any(), (order, table[table["status"] == "error"])
        assert any("loss scale overflows in this step" in p for p in v.problems), (order, v.problems)
        assert (table["status"] == "not judged").sum() > 0, order
