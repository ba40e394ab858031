"""Every verdict, once: the benchmark rule (:func:`judge_benchmark`), compare's (:func:`judge_compare`,
:func:`judge_cross_precision`; statistics-only rows in :mod:`.statistics`), run-ut's by the op's
category (:func:`judge`; ``data/api_precision_standard.yaml``) and precision-compare's three-way
one (:func:`judge_three_way`: the device's errors against a reference device's).  No torch.
"""

from __future__ import annotations

import functools
import math

from ..core.op_traits import base_name
from .loader import is_float, per_dtype, short_dtype, standard

PASS, WARNING, ERROR = "pass", "warning", "error"
SKIP = "SKIP"
CATEGORIES = ("benchmark", "absolute_threshold", "ulp", "binary", "thousandth")
_TIERS = {0.01: "one_hundredth", 0.001: "one_thousandth", 0.0001: "one_ten_thousandth"}
# the metrics compare's verdicts read (compare computes these besides the ones it shows)
COMPARE_READS = ("inf_nan_mismatch", "cosine", "max_abs_err", *_TIERS.values(), "rel_l2_err")


def worst(verdicts) -> str:
    """Combine verdicts: any error -> error, else any warning -> warning, else pass."""
    verdicts = set(verdicts)
    return ERROR if ERROR in verdicts else WARNING if WARNING in verdicts else PASS


# float dtypes from the coarsest tolerance to the finest (bf16 below fp16: fewer mantissa bits)
PRECISIONS = ("bfloat16", "float16", "float32", "float64")
_PRECISION_RANK = {d: k for k, d in enumerate(PRECISIONS)}


def precision_rank(dtype: str) -> int:
    """Position of ``dtype`` in :data:`PRECISIONS`; -1 for dtypes outside it (integers, complex)."""
    return _PRECISION_RANK.get(short_dtype(dtype), -1)


def lower_precision(dtype_a: str, dtype_b: str) -> str:
    """The dtype whose tolerance applies when two sides differ (bf16 vs fp32 -> bf16)."""
    rank = _PRECISION_RANK
    a, b = short_dtype(dtype_a), short_dtype(dtype_b)
    if a not in rank or b not in rank:
        return a if a not in rank else b
    return a if rank[a] <= rank[b] else b


# ---- the benchmark rule (run-ut and compare) --------------------------------------------------
def judge_benchmark(metrics: dict, dtype: str, rule: str = "benchmark") -> tuple[str, str]:
    """``(verdict, reason)`` of one output by the per-output rule (cosine, max abs error, then the
    hundredth/thousandth ratios).  ``rule``: ``benchmark``, or ``mindspore_benchmark`` (cosine and
    max-abs only)."""
    std = standard()[rule]
    if metrics.get("inf_nan_mismatch"):
        return ERROR, f"{metrics['inf_nan_mismatch']} inf/nan mismatches"
    cos = metrics.get("cosine")
    if cos is not None and not math.isnan(cos) and cos <= std["cosine_min"]:
        return ERROR, f"cosine {cos:.6f} <= {std['cosine_min']}"
    if cos is not None and math.isnan(cos) and metrics.get("max_abs_err", 0) >= std["max_abs_pass"]:
        return ERROR, "one side is all zeros"
    if metrics.get("max_abs_err", 0.0) < std["max_abs_pass"]:
        return PASS, ""
    if rule != "benchmark":
        return ERROR, f"max abs error {metrics['max_abs_err']:.3g} >= {std['max_abs_pass']}"
    coarse, fine = (float(t) for t in per_dtype("benchmark.tiers", dtype))
    for tol, verdict in ((coarse, ERROR), (fine, WARNING)):
        if metrics[_TIERS[tol]] < 1 - tol:
            return verdict, f"{_TIERS[tol]} ratio {metrics[_TIERS[tol]]:.6f} < {1 - tol:g}"
    return PASS, ""


# ---- compare -------------------------------------------------------------------------------------
def judge_compare(metrics: dict, dtype: str, scale: float) -> tuple[str, str]:
    """:func:`judge_benchmark` with its absolute-error shortcut (``max_abs_err < max_abs_pass``)
    scaled by ``scale`` (``max(|max|, |min|)`` of the expected tensor) when that is below 1:
    gradients are often O(1e-4), and one with 10 % relative error would pass on absolute error."""
    factor = min(1.0, scale) if scale and math.isfinite(scale) else 1.0
    scaled = dict(metrics)
    if factor < 1.0 and factor > 0.0:
        scaled["max_abs_err"] = metrics.get("max_abs_err", 0.0) / factor
    verdict, reason = judge_benchmark(scaled, dtype)
    if reason.startswith("max abs"):
        reason = f"max abs error {metrics['max_abs_err']:.3g} >= {standard()['benchmark']['max_abs_pass']} x {factor:.3g}"
    return verdict, reason


def judge_cross_precision(metrics: dict, dtype: str) -> tuple[str, str]:
    """Verdict for a compare of runs in different precisions (see ``compare_standards.yaml``)."""
    if metrics.get("inf_nan_mismatch"):
        return ERROR, f"{metrics['inf_nan_mismatch']} inf/nan mismatches"
    cos = metrics.get("cosine")
    cos_min = standard()["benchmark"]["cosine_min"]
    if cos is not None and not math.isnan(cos) and cos <= cos_min:
        return ERROR, f"cosine {cos:.6f} <= {cos_min}"
    limit = per_dtype("cross_precision_rel_l2", dtype, "compare_standards")
    rel = metrics.get("rel_l2_err", 0.0)
    if rel > limit:
        return ERROR, f"relative L2 error {rel:.3g} > {limit:g} ({short_dtype(dtype)}, cross-precision)"
    return PASS, ""


# ---- run-ut: categories and the two-way verdict -------------------------------------------------
@functools.cache
def _categories() -> dict:
    data = standard("api_precision_standard")
    return {name: cat for cat in CATEGORIES for name in data.get(cat) or ()}


@functools.lru_cache(maxsize=4096)
def category(op: str) -> str:
    name, table = base_name(op), _categories()
    default = standard("api_precision_standard").get("default", "benchmark")
    return table.get(name, table.get(name.lstrip("_"), default))


def _thr() -> dict:
    return standard("api_precision_standard")["thresholds"]


def output_category(op_category: str, dtype: str) -> str:
    """Integer, bool and index outputs are judged by binary consistency whatever the op's category."""
    return op_category if is_float(dtype) else "binary"


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
    if value is None or math.isnan(value) or value <= r["pass"]:
        return PASS
    limit = r["max_rel_err_error"] if metric == "max_rel_err" else r["error"]
    return WARNING if value <= limit else ERROR


def judge_three_way(cat: str, dut: dict, ref: dict, dtype: str) -> tuple[str, dict, str]:
    """(verdict, {column: value}, message) of one output: DUT's run-ut metrics (against float64)
    judged against REF's.  float64 outputs are SKIP (the standard has no tier for them)."""

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
