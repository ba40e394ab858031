"""A value whose terms only partly cancel (a matrix product's output, its terms a few times its norm)
passes by the cancellation rule between a float32 and a bfloat16 run, but it is no rounding noise: a
wrong kernel reading it (a ``silu_backward`` 30% too large, in the bfloat16 run only) is still named,
and without one no op is accused.  Both orders, statistics task."""

from __future__ import annotations

import pytest
import torch
from compare_helpers import SiluMLP, planted_kernel, wrong_silu_backward
from torch.nn import functional as F

from dispatchprobe import DispatchProbe
from dispatchprobe.offline.compare import compare


def _record(path, dtype, plant: bool = False):
    torch.manual_seed(0)
    model = SiluMLP().to(dtype)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 16, 32, generator=g), torch.randn(8, 16, 4, generator=g)
    with planted_kernel("silu_backward" if plant else None, wrong_silu_backward):
        probe = DispatchProbe(task="statistics", dump_path=str(path))
        with probe:
            F.mse_loss(model(x.to(dtype)).float(), y).backward()
        probe.step()
        probe.close()
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
    assert (v.backward.op, v.backward.scope) == ("aten.silu_backward.default", "SiluMLP"), str(v)


@pytest.mark.parametrize("order", [("fp32", "bf16"), ("bf16", "fp32")])
def test_without_a_wrong_kernel_no_backward_op_is_named(runs, order):
    _, v = compare(*(runs[k] for k in order))
    assert v.backward is None or v.backward.cause not in ("op", "unmatched"), str(v)
