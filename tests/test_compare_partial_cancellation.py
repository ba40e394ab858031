"""A value whose terms only partly cancel (a matrix product's output, its terms a few times its norm)
passes by the cancellation rule between a float32 and a bfloat16 run, but it is no rounding noise: a
wrong kernel reading it (a ``silu_backward`` 30% too large, in the bfloat16 run only) is still named,
and without one no op is accused.  Both orders, statistics task."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dispatchprobe import DispatchProbe
from dispatchprobe.offline.compare import compare


class MLP(nn.Module):
    def __init__(self, dim: int = 32):
        super().__init__()
        self.up, self.down, self.head = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim), nn.Linear(dim, 4)

    def forward(self, x):
        return self.head(x + self.down(F.silu(self.up(x))))


def _wrong_silu_backward(grad, x):
    s = torch.sigmoid(x)
    return grad * s * (1 + x * (1 - s)) * 1.3


def _record(path, dtype, plant: bool = False):
    torch.manual_seed(0)
    model = MLP().to(dtype)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 16, 32, generator=g), torch.randn(8, 16, 4, generator=g)
    lib = torch.library.Library("aten", "IMPL") if plant else None
    if plant:
        with warnings.catch_warnings():       # torch warns that a CPU kernel is overridden: that is the point
            warnings.simplefilter("ignore")
            lib.impl("silu_backward", _wrong_silu_backward, "CPU")
    try:
        probe = DispatchProbe(task="statistics", dump_path=str(path))
        with probe:
            F.mse_loss(model(x.to(dtype)).float(), y).backward()
        probe.step()
        probe.close()
    finally:
        if lib is not None:
            lib._destroy()
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("partial")
    return {"fp32": _record(root / "fp32", torch.float32), "bf16": _record(root / "bf16", torch.bfloat16),
            "bf16_wrong": _record(root / "bf16_wrong", torch.bfloat16, plant=True)}


@pytest.mark.parametrize("order", [("fp32", "bf16_wrong"), ("bf16_wrong", "fp32")])
def test_a_wrong_kernel_reading_a_partly_cancelled_value_is_named(runs, order):
    _, v = compare(*(runs[k] for k in order))
    assert v.backward is not None and v.backward.cause == "op", str(v)
    assert (v.backward.op, v.backward.scope) == ("aten.silu_backward.default", "MLP"), str(v)


@pytest.mark.parametrize("order", [("fp32", "bf16"), ("bf16", "fp32")])
def test_without_a_wrong_kernel_no_backward_op_is_named(runs, order):
    _, v = compare(*(runs[k] for k in order))
    assert v.backward is None or v.backward.cause not in ("op", "unmatched"), str(v)
