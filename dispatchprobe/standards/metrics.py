"""The one implementation of every accuracy metric (DESIGN invariant 2).

compare, run-ut, precision-compare and free-benchmark all call these functions.  They take
numpy arrays (never torch), compute in float64, and accept different dtypes on the two sides:
the *actual* array is judged by the tolerance of its own dtype (``dtype`` argument), so a
bf16-vs-fp32 compare is judged by bf16's tolerance rather than failing every row.

Relative error everywhere is ``|actual - expected| / max(|expected|, floor)`` where ``floor``
is the dtype's small-value threshold (``data/standards.yaml``): an output that is near zero
cannot produce a huge relative error from a tiny absolute one.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import numpy as np
import yaml

_DATA = os.path.join(os.path.dirname(__file__), "data", "standards.yaml")

HALF_TYPES = ("float16", "bfloat16")
FLOAT_TYPES = ("float16", "bfloat16", "float32", "float64")

# Mantissa bits and minimum normal exponent, for ULP sizes.
_FLOAT_LAYOUT = {"float16": (10, -14), "bfloat16": (7, -126), "float32": (23, -126), "float64": (52, -1022)}


@functools.lru_cache(maxsize=None)
def standards() -> dict:
    """The shipped precision standards (``dispatchprobe/standards/data/standards.yaml``)."""
    with open(_DATA, encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def per_dtype(table: str, dtype: str):
    """Look up a per-dtype value of ``table`` in the standards, falling back to ``default``."""
    values = standards()[table]
    return values.get(short_dtype(dtype), values["default"])


def short_dtype(dtype: str) -> str:
    """``torch.float16`` / ``Float16`` / ``float16`` -> ``float16``."""
    name = str(dtype).rsplit(".", 1)[-1].lower()
    return {"half": "float16", "float": "float32", "double": "float64", "bf16": "bfloat16"}.get(name, name)


def is_float(dtype: str) -> bool:
    return short_dtype(dtype) in FLOAT_TYPES


# ---- element-wise pieces ---------------------------------------------------------------------
def relative_error(actual: np.ndarray, expected: np.ndarray, dtype: str, abs_err=None, abs_expected=None) -> np.ndarray:
    """``|a - e| / max(|e|, small_value(dtype))`` in float64 (``abs_err`` / ``abs_expected``: those
    already computed, to save passes)."""
    floor = per_dtype("small_value", dtype)
    if abs_err is None:
        abs_err = np.abs(actual - expected)
    if abs_expected is None:
        abs_expected = np.abs(expected)
    return abs_err / np.maximum(abs_expected, floor)


def ulp_error(actual: np.ndarray, expected: np.ndarray, dtype: str) -> np.ndarray:
    """|a - e| in units in the last place of ``dtype`` at the expected value."""
    mantissa, min_exp = _FLOAT_LAYOUT.get(short_dtype(dtype), _FLOAT_LAYOUT["float32"])
    with np.errstate(divide="ignore"):
        exponent = np.floor(np.log2(np.abs(expected)))
    exponent = np.maximum(np.where(np.isfinite(exponent), exponent, min_exp), min_exp)
    return np.abs(actual - expected) / np.exp2(exponent - mantissa)


# ---- the metric set ----------------------------------------------------------------------------
ALL_METRICS = ("cosine", "max_abs_err", "max_rel_err", "mean_rel_err", "rmse", "mape", "one_hundredth",
               "one_thousandth", "one_ten_thousandth", "small_value_error_rate", "rel_err_error_rate", "ulp_max",
               "ulp_mean", "ulp_over_threshold", "error_balance", "sign_flips", "rel_l2_err")


_BLOCK = 1 << 16   # elements per pass: float64 blocks that stay in cache


def compare_arrays(actual, expected, dtype: str | None = None, only=None) -> dict[str, Any]:
    """All metrics of ``actual`` against ``expected`` (same number of elements).

    ``dtype`` is the dtype whose tolerance applies (default: the actual array's dtype).
    Non-finite elements are excluded from the value metrics and counted in
    ``inf_nan_mismatch`` when the two sides disagree on them.  ``only`` (a set of names from
    :data:`ALL_METRICS`) computes just those value metrics (same values; ``elements``,
    ``inf_nan_mismatch`` and ``inf_nan_error_rate`` are always there): compare uses it to skip
    the ULP and rate passes it does not report.

    Computed in float64 over blocks of 64k elements that stay in cache (sums, maxima and
    counts are combined across blocks): about 5x faster on large tensors than whole-array
    passes, equal to them up to float64 rounding of the sums.
    """
    want = (lambda k: True) if only is None else (lambda k: k in only)
    dtype = short_dtype(dtype or getattr(actual, "dtype", "float32"))
    a_all = np.asarray(actual).reshape(-1)
    e_all = np.asarray(expected).reshape(-1)
    if a_all.size != e_all.size:
        raise ValueError(f"cannot compare {a_all.size} elements with {e_all.size}")
    acc = _Sums(dtype, want)
    for start in range(0, a_all.size, _BLOCK):
        acc.add(np.asarray(a_all[start:start + _BLOCK], dtype=np.float64),
                np.asarray(e_all[start:start + _BLOCK], dtype=np.float64))
    return acc.result(a_all.size)


class _Sums:
    """Accumulates the sums, maxima and counts behind :func:`compare_arrays` block by block."""

    def __init__(self, dtype: str, want):
        self.dtype, self.want = dtype, want
        self.small_value = per_dtype("small_value", dtype)
        self.need_rel = any(want(k) for k in ("max_rel_err", "mean_rel_err", "one_hundredth", "one_thousandth",
                                              "one_ten_thousandth", "rel_err_error_rate"))
        self.need_ulp = want("ulp_max") or want("ulp_mean") or want("ulp_over_threshold")
        self.need_small = want("small_value_error_rate") or want("rel_err_error_rate")
        self.mismatch = self.n = 0
        self.dot = self.ss_a = self.ss_e = self.ss_diff = 0.0
        self.max_abs = self.max_rel = self.sum_rel = 0.0
        self.within = {1e-2: 0, 1e-3: 0, 1e-4: 0}
        self.mape_sum, self.mape_n = 0.0, 0
        self.n_small = self.small_err = self.n_normal = self.normal_err = 0
        self.ulp_max = self.ulp_sum = 0.0
        self.ulp_over = 0
        self.signed_rel = 0.0
        self.flips = 0

    def add(self, a: np.ndarray, e: np.ndarray) -> None:
        want = self.want
        fin_a, fin_e = np.isfinite(a), np.isfinite(e)
        if not (fin_a.all() and fin_e.all()):
            # inf/nan must match exactly: same positions, same kind (nan, +inf, -inf).
            special_a = np.where(fin_a, 0, np.where(np.isnan(a), 2, np.sign(a)))
            special_e = np.where(fin_e, 0, np.where(np.isnan(e), 2, np.sign(e)))
            self.mismatch += int(np.count_nonzero(special_a != special_e))
            both = fin_a & fin_e
            a, e = a[both], e[both]
        if a.size == 0:
            return
        self.n += a.size
        diff = a - e
        abs_err = np.abs(diff)
        abs_e = np.abs(e)
        if want("cosine"):
            self.dot += float(np.dot(a, e))
            self.ss_a += float(np.dot(a, a))
        if want("cosine") or want("rel_l2_err"):
            self.ss_e += float(np.dot(e, e))
        if want("max_abs_err"):
            self.max_abs = max(self.max_abs, float(abs_err.max()))
        if want("rmse") or want("rel_l2_err"):
            self.ss_diff += float(np.dot(diff, diff))
        if want("mape"):
            nonzero = e != 0
            if nonzero.all():
                self.mape_sum += float(np.sum(abs_err / abs_e))
                self.mape_n += a.size
            elif nonzero.any():
                self.mape_sum += float(np.sum(abs_err[nonzero] / abs_e[nonzero]))
                self.mape_n += int(np.count_nonzero(nonzero))
        if self.need_rel or want("error_balance"):
            floor = np.maximum(abs_e, self.small_value)
            rel = abs_err / floor
            self.max_rel = max(self.max_rel, float(rel.max()))
            self.sum_rel += float(rel.sum())
            for tol in self.within:
                self.within[tol] += int(np.count_nonzero(rel <= tol))
            if want("error_balance"):
                # the mean *signed* relative error: a bias that rounding should not have
                self.signed_rel += float(np.sum(diff / floor))
            if self.need_small:
                small = abs_e < self.small_value
                n_small = int(np.count_nonzero(small))
                self.n_small += n_small
                if n_small:
                    self.small_err += int(np.count_nonzero(abs_err[small] > per_dtype("small_value_atol", self.dtype)))
                normal = ~small
                self.n_normal += a.size - n_small
                self.normal_err += int(np.count_nonzero(rel[normal] > per_dtype("free_benchmark_threshold", self.dtype)))
        if self.need_ulp:
            ulp = ulp_error(a, e, self.dtype)
            self.ulp_max = max(self.ulp_max, float(ulp.max()))
            self.ulp_sum += float(ulp.sum())
            self.ulp_over += int(np.count_nonzero(ulp > per_dtype("ulp_threshold", self.dtype)))
        if want("sign_flips"):
            self.flips += int(np.count_nonzero((np.sign(a) * np.sign(e)) < 0))

    def result(self, size: int) -> dict[str, Any]:
        want, n = self.want, self.n
        out: dict[str, Any] = {"elements": int(size), "inf_nan_mismatch": self.mismatch,
                               "inf_nan_error_rate": self.mismatch / size if size else 0.0}
        if n == 0:
            values = dict(cosine=1.0 if self.mismatch == 0 else float("nan"), max_abs_err=0.0, max_rel_err=0.0,
                          mean_rel_err=0.0, rmse=0.0, mape=0.0, one_hundredth=1.0, one_thousandth=1.0,
                          one_ten_thousandth=1.0, small_value_error_rate=0.0, rel_err_error_rate=0.0,
                          ulp_max=0.0, ulp_mean=0.0, ulp_over_threshold=0.0, error_balance=0.0, sign_flips=0,
                          rel_l2_err=0.0)
        else:
            na, ne = math.sqrt(self.ss_a), math.sqrt(self.ss_e)
            cos = 1.0 if na == 0 and ne == 0 else float("nan") if na == 0 or ne == 0 else \
                max(-1.0, min(1.0, self.dot / (na * ne)))
            values = dict(
                cosine=cos, max_abs_err=self.max_abs, max_rel_err=self.max_rel, mean_rel_err=self.sum_rel / n,
                rmse=math.sqrt(self.ss_diff / n), mape=self.mape_sum / self.mape_n if self.mape_n else 0.0,
                one_hundredth=self.within[1e-2] / n, one_thousandth=self.within[1e-3] / n,
                one_ten_thousandth=self.within[1e-4] / n,
                small_value_error_rate=self.small_err / self.n_small if self.n_small else 0.0,
                rel_err_error_rate=self.normal_err / self.n_normal if self.n_normal else 0.0,
                ulp_max=self.ulp_max, ulp_mean=self.ulp_sum / n, ulp_over_threshold=self.ulp_over / n,
                error_balance=abs(self.signed_rel / n), sign_flips=self.flips,
                # ||a - e|| / ||e||: the scale-free error of the whole tensor
                rel_l2_err=math.sqrt(self.ss_diff / self.ss_e) if self.ss_e > 0 else
                (0.0 if self.ss_diff == 0 else math.inf))
        out.update((k, v) for k, v in values.items() if want(k))
        return out


def cosine(a: np.ndarray, e: np.ndarray) -> float:
    """Cosine similarity; two all-zero vectors are identical (1.0), one all-zero is nan."""
    na, ne = float(np.linalg.norm(a)), float(np.linalg.norm(e))
    if na == 0.0 and ne == 0.0:
        return 1.0
    if na == 0.0 or ne == 0.0:
        return float("nan")
    return float(np.clip(np.dot(a, e) / (na * ne), -1.0, 1.0))


def binary_mismatch(actual, expected) -> float:
    """Fraction of elements that are not bit-for-bit equal (integer, bool, index outputs)."""
    a, e = np.asarray(actual).reshape(-1), np.asarray(expected).reshape(-1)
    if a.size != e.size:
        return 1.0
    if a.size == 0:
        return 0.0
    same = (a == e) | (np.isnan(a) & np.isnan(e)) if a.dtype.kind == "f" else (a == e)
    return float(np.count_nonzero(~same) / a.size)


def max_relative_change(actual, expected, dtype: str) -> float:
    """The free-benchmark measure: largest relative change (floored), inf if inf/nan differ."""
    a = np.asarray(actual, dtype=np.float64).reshape(-1)
    e = np.asarray(expected, dtype=np.float64).reshape(-1)
    fin_a, fin_e = np.isfinite(a), np.isfinite(e)
    if not np.array_equal(fin_a, fin_e) or not np.array_equal(a[~fin_a], e[~fin_e], equal_nan=True):
        return float("inf")
    if not fin_a.all():
        a, e = a[fin_a], e[fin_e]
    return float(relative_error(a, e, dtype).max()) if a.size else 0.0


# ---- statistics-only comparison --------------------------------------------------------------
STAT_KEYS = ("max", "min", "mean", "norm")


def compare_stats(actual: dict, expected: dict) -> dict[str, Any]:
    """Differences of the recorded statistics (for statistics-only records)."""
    out: dict[str, Any] = {}
    for key in STAT_KEYS:
        a, e = _num(actual.get(key)), _num(expected.get(key))
        diff = a - e if a is not None and e is not None else None
        out[f"{key}_diff"] = diff
        if diff is None or not math.isfinite(diff):
            out[f"{key}_rel_diff"] = None if diff is None else (0.0 if a == e else float("inf"))
        else:
            out[f"{key}_rel_diff"] = abs(diff) / abs(e) if e != 0 else (0.0 if diff == 0 else float("inf"))
    return out


def _num(value) -> float | None:
    if value is None:
        return None
    if isinstance(value, str):  # non-finite values are stored as strings
        return float(value)
    return float(value)


# ---- verdicts ----------------------------------------------------------------------------------
PASS, WARNING, ERROR = "pass", "warning", "error"


def judge_benchmark(metrics: dict, dtype: str, rule: str = "benchmark") -> tuple[str, str]:
    """The seeds' per-output rule (cosine, max abs error, dual-hundredth/thousandth/...).

    Returns ``(verdict, reason)``.  ``rule`` is ``benchmark`` (PyTorch run-ut and compare) or
    ``mindspore_benchmark`` (cosine and max-abs only).
    """
    std = standards()[rule]
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
    coarse, fine = per_dtype_tiers(dtype)
    names = {0.01: "one_hundredth", 0.001: "one_thousandth", 0.0001: "one_ten_thousandth"}
    if metrics[names[coarse]] < 1 - coarse:
        return ERROR, f"{names[coarse]} ratio {metrics[names[coarse]]:.6f} < {1 - coarse:g}"
    if metrics[names[fine]] < 1 - fine:
        return WARNING, f"{names[fine]} ratio {metrics[names[fine]]:.6f} < {1 - fine:g}"
    return PASS, ""


def per_dtype_tiers(dtype: str) -> tuple[float, float]:
    tiers = standards()["benchmark"]["tiers"]
    coarse, fine = tiers.get(short_dtype(dtype), tiers["default"])
    return float(coarse), float(fine)


def worst(verdicts) -> str:
    """Combine verdicts: any error -> error, else any warning -> warning, else pass."""
    verdicts = list(verdicts)
    if ERROR in verdicts:
        return ERROR
    if WARNING in verdicts:
        return WARNING
    return PASS


# ---- compare: scale-aware judgement and vectorised statistics (appended for `compare`) ----------
_COMPARE_DATA = os.path.join(os.path.dirname(__file__), "data", "compare_standards.yaml")


@functools.lru_cache(maxsize=None)
def compare_standards() -> dict:
    """Thresholds of ``compare`` that the seeds leave open (``data/compare_standards.yaml``)."""
    with open(_COMPARE_DATA, encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def lower_precision(dtype_a: str, dtype_b: str) -> str:
    """The dtype whose tolerance applies when two sides differ (bf16 vs fp32 -> bf16)."""
    rank = {"bfloat16": 0, "float16": 1, "float32": 2, "float64": 3}
    a, b = short_dtype(dtype_a), short_dtype(dtype_b)
    if a not in rank or b not in rank:
        return a if a not in rank else b
    return a if rank[a] <= rank[b] else b


def judge_compare(metrics: dict, dtype: str, scale: float) -> tuple[str, str]:
    """The benchmark rule for compare: :func:`judge_benchmark` with its absolute-error shortcut
    (``max_abs_err < max_abs_pass``) scaled by the expected tensor's magnitude when that is below 1.

    Activations are O(1) but gradients are often O(1e-4): without scaling, a gradient with 10 %
    relative error would pass on absolute error alone.  ``scale`` is ``max(|max|, |min|)`` of
    the expected tensor.
    """
    factor = min(1.0, scale) if scale and math.isfinite(scale) else 1.0
    scaled = dict(metrics)
    if factor < 1.0 and factor > 0.0:
        scaled["max_abs_err"] = metrics.get("max_abs_err", 0.0) / factor
    verdict, reason = judge_benchmark(scaled, dtype)
    if reason.startswith("max abs"):
        reason = f"max abs error {metrics['max_abs_err']:.3g} >= {standards()['benchmark']['max_abs_pass']} x {factor:.3g}"
    return verdict, reason


def compare_stats_columns(actual: dict, expected: dict) -> dict:
    """:func:`compare_stats` over whole columns (numpy float arrays, nan where absent); same formulas."""
    out = {}
    with np.errstate(divide="ignore", invalid="ignore"):
        for key in STAT_KEYS:
            a = np.asarray(actual[key], dtype=np.float64)
            e = np.asarray(expected[key], dtype=np.float64)
            diff = a - e
            out[f"{key}_diff"] = diff
            rel = np.abs(diff) / np.abs(e)
            rel = np.where(e == 0, np.where(diff == 0, 0.0, np.inf), rel)
            rel = np.where(np.isfinite(diff), rel, np.where(a == e, 0.0, np.inf))
            rel = np.where(np.isnan(a) | np.isnan(e), np.nan, rel)
            out[f"{key}_rel_diff"] = rel
    return out


def stats_error(actual: dict, expected: dict) -> np.ndarray:
    """One relative error per row from statistics alone (columns as in :func:`compare_stats_columns`):
    the largest of the norm's relative difference and the max/min/mean differences divided by the
    expected tensor's magnitude ``max(|max|, |min|)``.  Dividing by the magnitude rather than by
    each statistic keeps a near-zero mean from producing a huge relative difference."""
    with np.errstate(divide="ignore", invalid="ignore"):
        e_max = np.asarray(expected["max"], dtype=np.float64)
        e_min = np.asarray(expected["min"], dtype=np.float64)
        scale = np.fmax(np.abs(e_max), np.abs(e_min))
        scale = np.where(np.isfinite(scale) & (scale > 0), scale, 1.0)
        parts = []
        for key in ("max", "min", "mean"):
            a = np.asarray(actual[key], dtype=np.float64)
            e = np.asarray(expected[key], dtype=np.float64)
            d = np.abs(a - e) / scale
            parts.append(np.where(np.isfinite(a) | np.isfinite(e), np.where(a == e, 0.0, d), 0.0))
        a_n = np.asarray(actual["norm"], dtype=np.float64)
        e_n = np.asarray(expected["norm"], dtype=np.float64)
        rel_n = np.abs(a_n - e_n) / np.where(e_n > 0, e_n, 1.0)
        parts.append(np.where(a_n == e_n, 0.0, rel_n))
        err = np.nanmax(np.vstack(parts), axis=0)
    return np.nan_to_num(err, nan=0.0, posinf=np.inf)


def judge_stats_columns(error: np.ndarray, dtypes, nonfinite_differs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Verdicts for statistics-only rows: nan/inf counts differ -> error; else :func:`stats_error`
    against the dtype's ``pass``/``error`` limits in ``compare_standards.yaml``."""
    std = compare_standards()["statistics"]
    dtypes = np.asarray(dtypes, dtype=object)
    if len(dtypes):  # look up each distinct dtype once
        codes, uniques = pd_factorize(dtypes)
        pass_lim = np.array([std["pass"].get(short_dtype(d), std["pass"]["default"]) for d in uniques],
                            dtype=np.float64)[codes]
        err_lim = np.array([std["error"].get(short_dtype(d), std["error"]["default"]) for d in uniques],
                           dtype=np.float64)[codes]
    else:
        pass_lim = err_lim = np.zeros(0)
    error = np.asarray(error, dtype=np.float64)
    verdict = np.where(nonfinite_differs, ERROR, np.where(error > err_lim, ERROR, np.where(error > pass_lim, WARNING, PASS)))
    reason = np.where(nonfinite_differs, "nan/inf counts differ",
                      np.where(verdict == PASS, "", "statistics differ"))
    return verdict.astype(object), reason.astype(object)


def pd_factorize(values) -> tuple[np.ndarray, list]:
    """(codes, distinct values) of a 1-D object array, in order of first appearance."""
    index: dict = {}
    codes = np.fromiter((index.setdefault(v, len(index)) for v in values), dtype=np.int64, count=len(values))
    return codes, list(index)


def judge_cross_precision(metrics: dict, dtype: str) -> tuple[str, str]:
    """Verdict for a compare of runs in different precisions (see ``compare_standards.yaml``)."""
    if metrics.get("inf_nan_mismatch"):
        return ERROR, f"{metrics['inf_nan_mismatch']} inf/nan mismatches"
    cos = metrics.get("cosine")
    cos_min = standards()["benchmark"]["cosine_min"]
    if cos is not None and not math.isnan(cos) and cos <= cos_min:
        return ERROR, f"cosine {cos:.6f} <= {cos_min}"
    limits = compare_standards()["cross_precision_rel_l2"]
    limit = limits.get(short_dtype(dtype), limits["default"])
    rel = metrics.get("rel_l2_err", 0.0)
    if rel > limit:
        return ERROR, f"relative L2 error {rel:.3g} > {limit:g} ({short_dtype(dtype)}, cross-precision)"
    return PASS, ""


def perturbation_change(actual, expected, dtype: str) -> dict[str, Any]:
    """The free-benchmark measure of a re-run ``actual`` against ``expected`` (same size), as
    Python numbers: :func:`perturbation_terms` on numpy float64 arrays -- the entry for a
    framework side that hands over numpy arrays (and the tests' reference); the torch side
    calls :func:`perturbation_terms` on device tensors directly."""
    a = np.asarray(actual, dtype=np.float64).reshape(-1)
    e = np.asarray(expected, dtype=np.float64).reshape(-1)
    max_rel, flips = perturbation_terms(a, e, per_dtype("small_value", dtype), np)
    return {"max_rel": float(max_rel), "sign_flips": int(flips)}


class WholeArray:
    """The reductions of :func:`perturbation_terms` over the whole (flat) array; a framework
    side may pass its own with the same four methods to measure many concatenated arrays at
    once (one result per segment, see ``dispatchprobe.perturb.Segments``)."""

    def __init__(self, xp):
        self.xp = xp

    def count(self, mask):
        return mask.sum()

    def sumsq(self, x):
        return self.xp.vdot(x, x)

    def max(self, x):
        return x.max()

    def spread(self, per_segment):
        return per_segment


def perturbation_terms(a, e, small: float, xp, reduce=None):
    """(max_rel, sign_flips) of the flat arrays ``a`` (re-run) and ``e`` (reference), as arrays
    of the namespace ``xp`` -- ``numpy``, or ``torch`` so that the free benchmark can measure on
    the accelerator and read many results back in one go.  The one implementation of the
    measure: written without data-dependent branches (nothing forces a host sync) and with the
    names numpy and torch share.  ``reduce`` (default :class:`WholeArray`: 0-d results) says
    what is reduced together; a segmented one gives one result per segment.

    ``max_rel``: the largest ``|a - e| / max(|e|, floor)`` with ``floor = max(small, rms(e))``:
    an element far below the tensor's typical magnitude is judged against that magnitude, not
    against itself, so an output that happens to be near zero (a dot product whose terms
    cancel) cannot raise a false alarm, while an op whose *whole* output lost its digits
    (catastrophic cancellation) still shows the loss in full.  inf when the inf/nan patterns
    differ.  ``sign_flips``: elements above ``small`` whose sign changed."""
    reduce = reduce or WholeArray(xp)
    if a.shape[0] == 0:                    # nothing to compare: (0, 0) in the namespace's type
        return xp.abs(a).sum(), xp.abs(a).sum()
    fin = xp.isfinite(e)
    # inf/nan patterns differ: finite on one side only, or different non-finite values (nan = nan)
    differs = (xp.isfinite(a) != fin) | (~fin & (a != e) & ((a == a) | (e == e)))
    a, e = xp.where(fin, a, 0.0), xp.where(fin, e, 0.0)
    n = reduce.count(fin).clip(min=1)
    floor = xp.sqrt(reduce.sumsq(e) / n).clip(min=small)
    abs_e = xp.abs(e)
    max_rel = reduce.max(xp.abs(a - e) / xp.maximum(abs_e, reduce.spread(floor)))
    max_rel = xp.where(reduce.count(differs) > 0, float("inf"), max_rel)
    flips = reduce.count((abs_e > small) & (xp.sign(a) * xp.sign(e) < 0))
    return max_rel, flips
