"""Per-op precision standards of run-ut and precision-compare (the one implementation).

Which category judges an op comes from ``data/api_precision_standard.yaml``; the metrics come
from :mod:`dispatchprobe.metrics` and the dtype thresholds from ``data/standards.yaml``.  No torch.

* :func:`category` -- the op's category: ``benchmark``, ``absolute_threshold``, ``ulp``,
  ``binary`` or ``thousandth``.
* :func:`judge` -- run-ut's two-way verdict of one output (device vs float64 benchmark).
* :func:`judge_three_way` -- precision-compare's verdict of one output: the device-under-test's
  errors against a reference device's errors, both measured against the float64 benchmark.
"""

from __future__ import annotations

import functools
import math
import os

import yaml

from ..core.op_traits import base_name
from .metrics import ERROR, PASS, WARNING, is_float, judge_benchmark, short_dtype, worst

SKIP = "SKIP"
CATEGORIES = ("benchmark", "absolute_threshold", "ulp", "binary", "thousandth")
_DATA = os.path.join(os.path.dirname(__file__), "data", "api_precision_standard.yaml")


@functools.lru_cache(maxsize=None)
def api_standard() -> dict:
    with open(_DATA, encoding="utf-8") as fh:
        data = yaml.safe_load(fh)
    table = {}
    for cat in CATEGORIES:
        for name in data.get(cat) or ():
            table[name] = cat
    return {"table": table, "default": data.get("default", "benchmark"), "thresholds": data["thresholds"]}


@functools.lru_cache(maxsize=4096)
def category(op: str) -> str:
    std = api_standard()
    name = base_name(op)
    return std["table"].get(name, std["table"].get(name.lstrip("_"), std["default"]))


def _thr() -> dict:
    return api_standard()["thresholds"]


def output_category(op_category: str, dtype: str) -> str:
    """Integer, bool and index outputs are judged by binary consistency whatever the op's category."""
    return op_category if is_float(dtype) else "binary"


# ---- run-ut: two-way --------------------------------------------------------------------------
def judge(cat: str, metrics: dict, dtype: str) -> tuple[str, str]:
    """(verdict, reason) of one output of ``dtype`` (the device dtype) by category ``cat``."""
    cat = output_category(cat, dtype)
    if cat == "binary":
        rate = metrics.get("binary_mismatch", 0.0)
        return (PASS, "") if rate == 0 else (ERROR, f"binary mismatch rate {rate:.3g} > 0")
    if metrics.get("inf_nan_mismatch"):
        return ERROR, f"{metrics['inf_nan_mismatch']} inf/nan mismatches"
    if cat == "absolute_threshold":
        bad = [f"{label} {metrics[key]:.3g} > 0" for key, label in
               (("rel_err_error_rate", "relative error rate"), ("small_value_error_rate", "absolute error rate"))
               if metrics.get(key, 0.0) > 0]
        return (ERROR, "; ".join(bad)) if bad else (PASS, "")
    if cat == "ulp":
        return _judge_ulp(metrics, dtype, None)
    if cat == "thousandth":
        lim = _thr()["thousandth_min"]
        ratio = metrics.get("one_thousandth", 1.0)
        return (PASS, "") if ratio > lim or metrics.get("elements", 1) == 0 else \
            (ERROR, f"one_thousandth ratio {ratio:.6f} <= {lim}")
    return judge_benchmark(metrics, dtype)


def _judge_ulp(dut: dict, dtype: str, ref: dict | None) -> tuple[str, str]:
    t = _thr()["ulp"]
    over, mean = dut.get("ulp_over_threshold", 0.0), dut.get("ulp_mean", 0.0)
    ref_over = ref.get("ulp_over_threshold") if ref else None
    if ref_over is not None and not (isinstance(ref_over, float) and math.isnan(ref_over)) and over < ref_over:
        return PASS, ""
    if short_dtype(dtype) in ("float16", "bfloat16"):
        if over < t["half_over_threshold"]:
            return PASS, ""
        return ERROR, f"ULP over-threshold ratio {over:.3g} >= {t['half_over_threshold']}"
    if mean < t["float32_ulp_mean"] or over < t["float32_over_threshold"]:
        return PASS, ""
    return ERROR, f"ULP mean {mean:.3g} >= {t['float32_ulp_mean']} and over-threshold ratio {over:.3g} >= " \
                  f"{t['float32_over_threshold']}"


# ---- precision-compare: three-way -------------------------------------------------------------
BENCHMARK_RATIOS = ("small_value_error_rate", "rmse", "max_rel_err", "mean_rel_err", "error_balance")
# error balance is reported but does not count towards the verdict (as in the seeds)
_NOT_JUDGED = ("error_balance",)


def ratio(dut: float, ref: float) -> float:
    """DUT error / REF error; a reference error below the floor counts as the floor."""
    if dut is None or ref is None or math.isnan(dut) or math.isnan(ref):
        return float("nan")
    if dut <= ref:
        return dut / ref if ref > 0 else 1.0 if dut == ref else 0.0
    return dut / max(ref, _thr()["ratio"]["floor"])


def ratio_verdict(metric: str, value: float) -> str:
    r = _thr()["ratio"]
    if value is None or math.isnan(value):
        return PASS
    if value <= r["pass"]:
        return PASS
    limit = r["max_rel_err_error"] if metric == "max_rel_err" else r["error"]
    return WARNING if value <= limit else ERROR


def judge_three_way(cat: str, dut: dict, ref: dict, dtype: str) -> tuple[str, dict, str]:
    """(verdict, {column: value}, message) of one output: DUT's errors judged against REF's.

    ``dut``/``ref`` hold run-ut's metrics of the same output on the two devices (each against
    the float64 benchmark).  float64 outputs are SKIP (the standard has no tier for them).
    """
    cat = output_category(cat, dtype)
    cols: dict = {}
    if cat != "binary" and short_dtype(dtype) == "float64":
        return SKIP, cols, "float64 is not covered by the precision standard"
    if cat == "binary":
        rate = dut.get("binary_mismatch", 0.0)
        v = PASS if rate == 0 else ERROR
        cols["binary_mismatch_verdict"] = v
        return v, cols, "" if v == PASS else f"binary mismatch rate {rate:.3g} > 0"
    if cat == "absolute_threshold":
        bad, verdicts = [], []
        for key in ("inf_nan_error_rate", "rel_err_error_rate", "abs_err_error_rate"):
            value = dut.get(key, 0.0) or 0.0
            v = PASS if value == 0 else ERROR
            cols[f"{key}_verdict"] = v
            verdicts.append(v)
            if v != PASS:
                bad.append(f"{key} {value:.3g} > 0")
        return worst(verdicts), cols, "; ".join(bad)
    if cat == "ulp":
        cols["ulp_over_threshold_ratio"] = ratio(dut.get("ulp_over_threshold", 0.0), ref.get("ulp_over_threshold", 0.0))
        v, reason = _judge_ulp(dut, dtype, ref)
        if dut.get("inf_nan_error_rate"):
            v, reason = ERROR, f"inf/nan error rate {dut['inf_nan_error_rate']:.3g} > 0"
        cols["ulp_verdict"] = v
        return v, cols, reason
    if cat == "thousandth":
        lim = _thr()["thousandth_min"]
        value = dut.get("one_thousandth", 1.0)
        v = PASS if value > lim else ERROR
        cols["one_thousandth_verdict"] = v
        return v, cols, "" if v == PASS else f"one_thousandth {value:.6f} <= {lim}"
    # benchmark comparison: ratios of DUT to REF errors
    verdicts, bad = [], []
    for key in BENCHMARK_RATIOS:
        value = ratio(dut.get(key, 0.0), ref.get(key, 0.0))
        v = ratio_verdict(key, value)
        cols[f"{key}_ratio"] = value
        cols[f"{key}_verdict"] = v
        if key not in _NOT_JUDGED:
            verdicts.append(v)
            if v != PASS:
                bad.append(f"{key} ratio {value:.3g}")
    if dut.get("inf_nan_error_rate") and not ref.get("inf_nan_error_rate"):
        verdicts.append(ERROR)
        bad.append("inf/nan mismatches only on the device under test")
    return worst(verdicts), cols, "; ".join(bad)
