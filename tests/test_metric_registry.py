"""The metric registry (one registration reaches every table) and the neutral record statistics."""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pandas as pd
import pytest
import torch

from dispatchprobe import compare
from dispatchprobe.offline import compare as compare_mod, precision_compare, report, run_ut
from dispatchprobe.standards import statistics
from dispatchprobe.standards.metrics import METRICS, compare_arrays, register_metric, unregister_metric
from dispatchprobe.torch import tensor_backend as backend

sys.path.insert(0, os.path.dirname(__file__))
from compare_helpers import record  # noqa: E402


@pytest.fixture
def max_sq_err():
    """A new metric, registered in one place (and removed again)."""
    before = (list(compare_mod.COLUMNS), list(run_ut.DETAIL_COLUMNS), dict(report.CHART_METRICS))
    register_metric("max_sq_err", "Max Sq Err", lambda b: float(b.abs_err.max()) ** 2, combine=max, compare=10)
    try:
        yield "max_sq_err"
    finally:
        unregister_metric("max_sq_err")
    assert (list(compare_mod.COLUMNS), list(run_ut.DETAIL_COLUMNS), dict(report.CHART_METRICS)) == before


def test_registered_metric_reaches_compare_arrays(max_sq_err):
    a, e = np.linspace(-1, 1, 200_000), np.linspace(-1, 1, 200_000) * 1.001   # several blocks
    m = compare_arrays(a, e, "float32")
    assert m[max_sq_err] == pytest.approx(m["max_abs_err"] ** 2)
    assert set(compare_arrays(a, e, "float32", only={"cosine"})) == {"cosine", "elements", "inf_nan_mismatch",
                                                                      "inf_nan_error_rate"}


def test_registered_metric_in_compare_reports(max_sq_err, tmp_path):
    a, b = record(tmp_path / "a"), record(tmp_path / "b", plant=True)
    table, _ = compare(a, b, out=str(tmp_path / "out"), metric=max_sq_err)
    csv = pd.read_csv(tmp_path / "out" / "compare.csv")
    cols = list(csv.columns)
    assert cols == compare_mod.COLUMNS and cols.index(max_sq_err) == cols.index("rel_l2_err") + 1
    rows = csv[csv["max_abs_err"].notna()]
    assert len(rows) and np.allclose(rows[max_sq_err], rows["max_abs_err"] ** 2)
    from openpyxl import load_workbook
    assert max_sq_err in [c.value for c in load_workbook(tmp_path / "out" / "compare.xlsx")["compare"][1]]
    assert max_sq_err in report.CHART_METRICS and f"{max_sq_err} (log scale)" in (tmp_path / "out" / "compare.html").read_text()


def test_registered_metric_in_run_ut_details(max_sq_err, tmp_path):
    res = run_ut.run_ut(record(tmp_path / "run"), tmp_path / "ut", limit=8)
    cols = list(res.details.columns)
    assert cols == run_ut.DETAIL_COLUMNS and cols[cols.index("ULP Over Threshold") + 1] == "Max Sq Err"
    assert precision_compare._METRICS["Max Sq Err"] == max_sq_err
    floats = res.details[res.details["Max Abs Err"] != ""]
    assert len(floats) and np.allclose(floats["Max Sq Err"].astype(float), floats["Max Abs Err"].astype(float) ** 2)


def test_registry_keeps_the_columns():
    assert compare_mod.TENSOR_METRICS == ["cosine", "max_abs_err", "max_rel_err", "rmse", "mape", "one_thousandth",
                                          "one_ten_thousandth", "inf_nan_mismatch", "rel_l2_err"]
    assert [METRICS[k].column for k in run_ut.METRIC_COLUMNS.values()] == list(run_ut.METRIC_COLUMNS)


# ---- statistics: one implementation, numpy and torch, against the backend's fast paths ---------------------
def _tensors():
    g = torch.Generator().manual_seed(0)
    big = torch.randn(1 << 16, generator=g)
    with_special = torch.randn(1000, generator=g)
    with_special[3], with_special[7], with_special[9] = math.nan, math.inf, -math.inf
    masked = torch.randn(2, 3, 40, 40, generator=g).masked_fill(torch.ones(40, 40, dtype=torch.bool).triu(1), -math.inf)
    infinities = torch.randn(3000, generator=g)
    infinities[5], infinities[11] = math.inf, -math.inf
    return {
        "f32 small": torch.randn(64, 33, generator=g), "f32 large": big, "f32 strided": big.view(256, 256).t(),
        "f32 nan/inf": with_special, "f32 causal mask": masked, "f32 +-inf": infinities,
        "f32 +inf only": torch.full((4,), math.inf), "f32 permuted": torch.randn(9, 40, 3, generator=g).permute(2, 0, 1),
        "f32 sliced": torch.randn(40, 30, generator=g)[:, ::2], "f32 all nan": torch.full((5,), math.nan),
        "f32 squares overflow": torch.tensor([1e30, -3e30, 2e25]), "f32 large overflow": big * 1e25,
        "f64": torch.randn(300, dtype=torch.float64, generator=g),
        "bf16": torch.randn(1 << 15, generator=g).bfloat16(), "bf16 inf": torch.tensor([1.0, math.inf, -2.0]).bfloat16(),
        "fp16": torch.randn(5000, generator=g).half(), "fp16 inf": torch.tensor([6e4, -6e4, math.inf]).half(),
        "int64": torch.randint(-50, 50, (4096,), generator=g), "int32": torch.arange(17, dtype=torch.int32),
        "bool": torch.rand(999, generator=g) > 0.3,
    }


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()   # bf16 values are exact in float32


@pytest.mark.parametrize("name", list(_tensors()))
def test_statistics_one_implementation(name):
    t = _tensors()[name]
    fast = backend.tensor_stats([t])[0]
    for xp, x in ((torch, t), (np, _numpy(t))):
        neutral = statistics.record(x, xp)
        assert neutral.keys() == fast.keys()
        for key, value in fast.items():
            if key in ("mean", "norm") and math.isfinite(value):   # accumulation order differs
                assert neutral[key] == pytest.approx(value, rel=1e-5), (name, xp.__name__, key)
            else:
                assert neutral[key] == value or (math.isnan(value) and math.isnan(neutral[key])), (name, key)
    row = backend.read_stats_rows([backend.device_stats_row(t)], [t.numel()])[0]
    if fast["nan"] == fast["inf"] == 0 and "overflow" not in name:   # the device row does not redo overflows
        assert row.keys() == fast.keys() and all(row[k] == pytest.approx(fast[k], rel=1e-5) for k in row)
