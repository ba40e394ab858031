"""An output that is only rounding noise around zero (every element cancelled relative to the
magnitude it is computed from) is judged by its errors relative to that spread, not by its cosine:
the float32 and float64 runs round it differently.  A wrong kernel is still an error."""

from __future__ import annotations

import contextlib

import pytest
import torch

from dispatchprobe import DispatchProbe
from dispatchprobe.offline.run_ut import run_ut

# planting a kernel makes torch warn that it overrides one
pytestmark = pytest.mark.filterwarnings("ignore:Warning only once for all operators")

OP = "aten._softmax_backward_data.default"


def _exact(grad, out, dim):
    g, y = grad.double(), out.double()
    return y * (g - (g * y).sum(dim, keepdim=True))


def _scaled(grad, out, dim, input_dtype):
    """Right in float64 (the benchmark), 1 % too large in float32."""
    r = _exact(grad, out, dim)
    return (r if grad.dtype == torch.float64 else r * 1.01).to(grad.dtype)


def _not_zero(grad, out, dim, input_dtype):
    """Right in float64; in float32 adds 1 % of y * g, where a constant gradient is due a zero."""
    r = _exact(grad, out, dim)
    return (r if grad.dtype == torch.float64 else r + 0.01 * out.double() * grad.double()).to(grad.dtype)


@contextlib.contextmanager
def _planted(fn):
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_softmax_backward_data", fn, "CPU")
    try:
        yield
    finally:
        lib._destroy()      # at once: a dropped Library lives until collected, its kernels with it


def _record(path, weight=None):
    """softmax over 32 scores, summed (the gradient is constant: softmax's backward is zero but for
    rounding) or weighted by ``weight`` (a real gradient)."""
    torch.manual_seed(0)
    x = (torch.randn(8, 16) * 0.3).requires_grad_()
    w = torch.randn(16, 32) * 0.3
    probe = DispatchProbe(task="tensor", dump_path=str(path))
    with probe:
        y = torch.softmax(x @ w, -1)
        (y.sum() if weight is None else (y * weight).sum()).backward()
    probe.close()
    return str(path)


def _row(path, out):
    res = run_ut(path, str(out), api=r"_softmax_backward_data", progress=False)
    d = res.details
    row = d[(d["API Name"].str.startswith(OP)) & (d["Judged"] == "replay")]
    assert len(row) == 1, d[["API Name", "Judged"]]
    return row.iloc[0]


def test_softmax_backward_of_a_constant_gradient_is_noise_not_an_error(tmp_path):
    path = _record(tmp_path / "sum")
    row = _row(path, tmp_path / "ut")
    assert float(row["Cosine"]) < 0.99, row          # the raw cosine compares two roundings of zero
    assert row["Status"] == "pass", row["Message"]
    assert "cosine not read" in row["Message"], row["Message"]
    with _planted(_not_zero):
        bad = _row(path, tmp_path / "ut_bad")
    assert float(bad["Max Abs Err"]) < 1e-3          # below the absolute shortcut: the spread decides
    assert bad["Status"] == "error", bad["Message"]


def test_softmax_backward_scaled_by_one_percent_is_an_error(tmp_path):
    torch.manual_seed(1)
    path = _record(tmp_path / "weighted", torch.randn(8, 32) * 30)
    assert _row(path, tmp_path / "ut")["Status"] == "pass"
    with _planted(_scaled):
        bad = _row(path, tmp_path / "ut_bad")
    assert bad["Status"] == "error", bad["Message"]
