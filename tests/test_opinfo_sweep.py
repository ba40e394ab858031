"""run-ut over PyTorch's OpInfo samples (a fixed subset of ``benchmarks/opinfo_sweep.py``): stock
kernels give no false errors, every call is replayed (random ops skipped with the reason), and
planted wrong kernels -- elementwise, a reduction, a complex op -- are still flagged."""

from __future__ import annotations

import importlib.util
import math
import pathlib
import sys

import pytest
import torch

_spec = importlib.util.spec_from_file_location(
    "opinfo_sweep", pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "opinfo_sweep.py")
opinfo_sweep = sys.modules["opinfo_sweep"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(opinfo_sweep)

# one or more OpInfos per known cause of false errors, plus plain ones
SUBSET = [
    # complex outputs
    "fft.fft", "fft.rfft", "fft.ifft", "polar", "view_as_complex",
    # non-unique outputs (singular/eigen vectors)
    "linalg.svd", "svd", "linalg.eigh", "linalg.eig",
    # undefined auxiliary outputs
    "nn.functional.embedding_bag", "nn.functional.ctc_loss",
    # round with decimals
    "round.decimals_3", "round.decimals_neg_3",
    # bf16 rounding against strict rules
    "nn.functional.conv2d", "nn.functional.grid_sample", "nn.functional.batch_norm", "log_softmax", "addbmm",
    "linalg.cross", "logit", "sub", "addr",
    # reductions that cancel
    "sum", "mean", "cumsum", "matmul", "nn.functional.linear",
    # integer and bool ops
    "bitwise_and", "eq", "argmax", "nonzero", "remainder",
    # written arguments that must be upcast too
    "lerp", "quantile", "nn.functional.instance_norm",
    # plain
    "nn.functional.gelu", "softmax", "exp", "mul", "div.no_rounding_mode",
]
LIMIT = {"float32": 0.003, "bfloat16": 0.01}


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("opinfo"))
    return {dtype: opinfo_sweep.sweep(dtype, only=SUBSET, workdir=tmp) for dtype in LIMIT}


@pytest.mark.parametrize("dtype", list(LIMIT))
def test_no_false_errors_full_coverage(sweeps, dtype):
    s = sweeps[dtype]
    assert s.opinfos >= {"float32": 35, "bfloat16": 25}[dtype] and s.calls >= s.opinfos   # linalg and fft: no bf16
    assert len(s.false_errors) <= LIMIT[dtype] * s.judged, s.false_errors[["OpInfo", "Op", "Message"]].to_string()
    assert s.coverage >= 0.97
    skipped = s.results[s.status == "SKIP"]
    assert skipped["Message"].str.startswith("random op").all(), skipped[["OpInfo", "Op", "Message"]].to_string()


def test_genuine_bf16_findings_stay_found(tmp_path):
    s = opinfo_sweep.sweep("bfloat16", only=["rsqrt", "matrix_exp", "nn.functional.grid_sample"], workdir=str(tmp_path))
    assert {("bfloat16", op) for op in s.errors["Op"]} == opinfo_sweep.GENUINE, \
        s.results[["OpInfo", "Op", "Message"]].to_string()


def _wrong_gelu(x, approximate="none"):
    if x.dtype == torch.float64:
        return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    y = x.float()
    return (0.5 * y * (1 + torch.erf(y / math.sqrt(2))) * (1 + 1e-2)).to(x.dtype)


def _wrong_mm(a, b):
    """mm with 1e-2 relative error below float64 (a reduction: judged after its terms' bound)."""
    exact = (a.double().unsqueeze(-1) * b.double().unsqueeze(0)).sum(1)
    return exact if a.dtype == torch.float64 else (exact * (1 + 1e-2)).to(a.dtype)


def _wrong_polar(r, theta):
    out = torch.complex(r * torch.cos(theta), r * torch.sin(theta))
    return out if r.dtype == torch.float64 else out * (1 + 1e-2)


PLANTED = {"gelu": ("nn.functional.gelu", _wrong_gelu), "mm": ("mm", _wrong_mm), "polar": ("polar", _wrong_polar)}


@pytest.mark.parametrize("dtype", list(LIMIT))
def test_planted_kernels_flagged(tmp_path, dtype):
    lib = torch.library.Library("aten", "IMPL")
    for op, (_, fn) in PLANTED.items():
        lib.impl(op, fn, "CPU")
    try:
        s = opinfo_sweep.sweep(dtype, only=[name for name, _ in PLANTED.values()], workdir=str(tmp_path))
    finally:
        lib._destroy()      # at once: a dropped Library lives until collected, its kernels with it
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    exact = (a.double().unsqueeze(-1) * b.double().unsqueeze(0)).sum(1).float()
    assert torch.allclose(torch.ops.aten.mm.default(a, b), exact, rtol=1e-5, atol=1e-5)   # right again for later tests
    planted = s.results["Op"].str.replace("aten.", "", regex=False).isin(
        [op if "." in op else f"{op}.default" for op in PLANTED])
    assert planted.any()
    assert (s.status[planted] == "error").all(), s.results[planted][["OpInfo", "Op", "Message"]].to_string()
    assert set(s.results[planted]["OpInfo"]) == {name for name, _ in PLANTED.values()
                                               if dtype == "float32" or name != "polar"}
    assert not (s.status[~planted] == "error").any(), s.errors[["OpInfo", "Op", "Message"]].to_string()
