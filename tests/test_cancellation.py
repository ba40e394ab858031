"""Values that cancel to near zero are judged against the rounding of their terms (eps * sum|x|,
``dispatchprobe.standards.rounding``) by run-ut and compare alike, cosine included; a real error in
such an op is still one."""

from __future__ import annotations

import contextlib

import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from dispatchprobe import DispatchProbe
from dispatchprobe.cli import main
from dispatchprobe.offline.run_ut import run_ut

# planting a kernel makes torch warn that it overrides one
pytestmark = pytest.mark.filterwarnings("ignore:Warning only once for all operators")


class Renorm(nn.Module):
    """A layer norm over rows a first one already normalised: the second's means are ~1e-8 of rows
    whose |x| is ~1 (rounding noise, which float32 and float64 get differently)."""

    def __init__(self):
        super().__init__()
        self.fc, self.ln1, self.ln2 = nn.Linear(32, 96), nn.LayerNorm(96), nn.LayerNorm(96)

    def forward(self, x):
        return self.ln2(self.ln1(self.fc(x)))


class Attn(nn.Module):
    """Single-head attention: the key bias's gradient is mathematically zero (softmax does not
    change when q.b is added to a whole row of scores), so its backward sum is rounding noise."""

    def __init__(self, d=32):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2) / 8, -1) @ self.v(x)


def _record(path, model, x):
    probe = DispatchProbe(task="tensor", dump_path=str(path))
    with probe:
        model(x).square().sum().backward()
    probe.close()
    return str(path)


def _wrong_layer_norm(x, shape, weight=None, bias=None, eps=1e-5):
    """Right in float64 (the benchmark); in float32 its mean output is off by 1e-4 of mean |x|."""
    dims = tuple(range(-len(shape), 0))
    xd = x.double()
    mean = xd.mean(dims, keepdim=True)
    rstd = (xd.var(dims, unbiased=False, keepdim=True) + eps).rsqrt()
    out = (xd - mean) * rstd
    out = out * weight.double() if weight is not None else out
    out = out + bias.double() if bias is not None else out
    if x.dtype != torch.float64:
        mean = mean + 1e-4 * xd.abs().mean(dims, keepdim=True)
    return out.to(x.dtype), mean.to(x.dtype), rstd.to(x.dtype)


def _wrong_sum(x, dim, keepdim=False, dtype=None):
    """sum off by 1e-4 of the sum of its terms' magnitudes."""
    return torch.nansum(x, dim, keepdim=keepdim, dtype=dtype) + 1e-4 * torch.nansum(x.abs(), dim, keepdim=keepdim,
                                                                                     dtype=dtype)


@contextlib.contextmanager
def _planted(op, fn):
    lib = torch.library.Library("aten", "IMPL")
    lib.impl(op, fn, "CPU")
    try:
        yield
    finally:
        lib._destroy()


def _mean_rows(path, out):
    res = run_ut(path, str(out), api=r"native_layer_norm\.")
    d = res.details
    return d[d["API Name"].str.startswith("aten.native_layer_norm.default.1.") & (d["Output"] == "output.1")
             & (d["Judged"] == "replay")]


def test_run_ut_layer_norm_of_normalised_rows(tmp_path):
    torch.manual_seed(0)
    path = _record(tmp_path / "run", Renorm(), torch.randn(64, 32))
    row = _mean_rows(path, tmp_path / "ut")
    assert len(row) == 1 and float(row["Cosine"].iat[0]) < 0.99          # the raw cosine compares noise
    assert row["Status"].iat[0] == "pass", row[["Cosine", "Message"]].to_string()
    assert "within the rounding bound of its terms" in row["Message"].iat[0]
    with _planted("native_layer_norm", _wrong_layer_norm):
        bad = _mean_rows(path, tmp_path / "ut_bad")
    assert bad["Status"].iat[0] == "error", bad[["Cosine", "Message"]].to_string()


def _sum_row(a, b, out):
    res = CliRunner().invoke(main, ["compare", a, b, "-o", str(out)])
    table = pd.read_csv(out / "compare.csv")
    row = table[(table["op_a"] == "aten.sum.dim_IntList") & (table["scope"] == "Attn.k") & (table["io"] == "output")]
    assert len(row) == 1, table[["op_a", "scope", "io"]]
    return res, row.iloc[0]


def test_compare_mathematically_zero_bias_gradient(tmp_path):
    def run(name, scale, plant=None):
        torch.manual_seed(0)
        model, x = Attn(), torch.randn(4, 16, 32) * scale
        with _planted(*plant) if plant else contextlib.nullcontext():
            return _record(tmp_path / name, model, x)
    a = run("a", 1.0)
    b = run("b", 1 + 2.0 ** -20)               # a last-bit change of the input: the noise sums differ
    res, row = _sum_row(a, b, tmp_path / "cmp")
    assert row["cosine"] < 0.9 and row["status"] == "pass", row.to_dict()
    assert "within the rounding bound of their terms" in row["reason"]
    assert res.exit_code == 0 and "aten.sum" not in res.output, res.output
    planted = run("planted", 1.0, ("sum.dim_IntList", _wrong_sum))
    res, row = _sum_row(a, planted, tmp_path / "cmp_bad")
    assert row["status"] == "error" and res.exit_code == 2, row.to_dict()
