"""A value whose terms only partly cancel (a matrix product's output, its terms a few times its norm)
passes by the cancellation rule between a float32 and a bfloat16 run, but it is no rounding noise: a
wrong kernel reading it (a ``silu_backward`` 30% too large, in the bfloat16 run only) is still named,
and without one no op is accused.  Both orders, statistics task."""

from __future__ import annotations

import pytest
import torch
from compare_helpers import SiluMLP, record_mse_step, wrong_silu_backward

from dispatchprobe.offline.compare import compare


def _record(path, dtype, plant: bool = False):
    torch.manual_seed(0)
    return record_mse_step(path, SiluMLP().to(dtype), dtype, plant="silu_backward" if plant else None,
                           kernel=wrong_silu_backward)


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
