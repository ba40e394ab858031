"""A float32 run against the same model in bfloat16 (``model.to(torch.bfloat16)``): an RMSNorm's
``x.to(torch.float32)`` is the value itself in float32 and a copy in bfloat16, so autograd sums x's
gradient in one group in one run and in two (a cast between) in the other.  The rows of those sums
compare different partial sums of the same terms: they are not judged, and the sum one run alone
makes is no prime suspect; a hook that really scales one group of the sum is still named.  Both
orders."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from compare_helpers import record_mse_step
from torch import nn
from torch.nn import functional as F

from dispatchprobe.cli import main
from dispatchprobe.offline.compare import NOT_JUDGED, compare
from dispatchprobe.offline.compare.origin import PARTIAL_SUMS


class RMSNorm(nn.Module):
    """Llama's: computed in float32, handed back in the input's dtype.  ``grad_scale``: a hook
    scales the gradient of the float32 copy (only where it is a copy: a bfloat16 model)."""

    grad_scale = None

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.to(torch.float32)
        if self.grad_scale is not None and h is not x and h.requires_grad:
            h.register_hook(lambda g: g * self.grad_scale)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm, self.up, self.down = RMSNorm(dim), nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.down(F.silu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, dim: int = 32):
        super().__init__()
        self.inp, self.blocks, self.head = nn.Linear(dim, dim), nn.Sequential(Block(dim), Block(dim)), nn.Linear(dim, 4)

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))


def _record(path, dtype, grad_scale=None):
    torch.manual_seed(0)
    model = Net().to(dtype)
    model.blocks[1].norm.grad_scale = grad_scale
    return record_mse_step(path, model, dtype, batch=(4, 8))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("regrouped")
    return {"fp32": _record(root / "fp32", torch.float32), "bf16": _record(root / "bf16", torch.bfloat16),
            "bf16_hook": _record(root / "bf16_hook", torch.bfloat16, grad_scale=1.3)}


@pytest.mark.parametrize("order", [("fp32", "bf16"), ("bf16", "fp32")])
def test_regrouped_gradient_sum_is_no_suspect(runs, order):
    """Before: 'first backward divergence: aten.add.Tensor [Net.blocks.1.norm] call 0 ..., present
    only in run A (prime suspect)', exit 2, from an add operand row comparing t1 with t1 + t2."""
    a, b = (runs[k] for k in order)
    table, v = compare(a, b)
    partial = table[table["reason"] == PARTIAL_SUMS]
    # each norm's gradient sum: the add both runs make, in the norm's scope, in the backward
    assert len(partial) and set(partial["op_a"]) == {"aten.add.Tensor"}, table
    assert set(partial["stage"]) == {"backward"} and all(s.endswith(".norm") for s in partial["scope"])
    assert (partial["status"] == NOT_JUDGED).all()
    assert v.backward is None and v.passed, str(v)
    assert "partial sums the runs group differently" in str(v)
    res = CliRunner().invoke(main, ["compare", str(a), str(b)])
    assert res.exit_code == 0, res.output
    assert "prime suspect" not in res.output and "first backward divergence" not in res.output, res.output


@pytest.mark.parametrize("order", [("fp32", "bf16_hook"), ("bf16_hook", "fp32")])
def test_hook_inside_a_regrouped_sum_is_named(runs, order):
    """The bfloat16 run's hook scales one group of x's gradient by 1.3 (a mul that run alone makes):
    the total differs, and the mul, not a partial sum of either run, is the prime suspect."""
    a, b = (runs[k] for k in order)
    _, v = compare(a, b)
    hooked = "a" if order[0] == "bf16_hook" else "b"
    assert v.backward is not None, str(v)
    assert (v.backward.cause, v.backward.op, v.backward.scope, v.backward.side) == \
        ("unmatched", "aten.mul.Tensor", "Net.blocks.1.norm", hooked), str(v)
    res = CliRunner().invoke(main, ["compare", str(a), str(b)])
    assert res.exit_code == 2 and "first backward divergence: aten.mul.Tensor [Net.blocks.1.norm]" in res.output, \
        res.output
