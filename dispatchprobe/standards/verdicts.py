"""Every verdict, once: the benchmark rule (:func:`judge_benchmark`), compare's (:func:`judge_compare`,
:func:`judge_cross_precision`; statistics-only rows in :mod:`.statistics`), run-ut's by the op's
category (:func:`judge`; ``data/api_precision_standard.yaml``) and precision-compare's three-way
one (:func:`judge_three_way`: the device's errors against a reference device's).  No torch.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from ..records.format import base_name
from . import rounding
from .loader import is_float, per_dtype, short_dtype, standard
from .metrics import FLOAT_LAYOUT

PASS, WARNING, ERROR = "pass", "warning", "error"
NOT_JUDGED = "not judged"   # status of a compared value the rules cannot judge (reason says why)
# reasons of a value with nothing in it to judge (not a verdict the rules could not reach)
UNDEFINED_CONTENTS = "undefined contents (uninitialised memory)"
OUT_PRIOR_CONTENTS = "prior contents of an out= argument (not an input)"
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
def smallest_normal(dtype: str) -> float:
    """The smallest positive normal value of ``dtype`` (float32's for dtypes it does not know)."""
    layout = FLOAT_LAYOUT.get(short_dtype(component_dtype(dtype)), FLOAT_LAYOUT["float32"])
    return 2.0 ** layout[1]


def shortcut_floor(dtype: str) -> float:
    """The lowest :func:`shortcut_limit` of ``dtype``: its smallest normal (values under it underflow,
    an output flushed to zero, and carry no relative precision to judge), but never above the
    absolute tolerance the standard gives small values (``small_value_atol``: fp16's smallest
    normal, 6.1e-5, is six times its 1e-5), so the shortcut passes no error the small-value rule
    would reject."""
    return min(smallest_normal(dtype), float(per_dtype("small_value_atol", dtype)))


def shortcut_limit(dtype: str, magnitude: float | None, rule: str = "benchmark") -> float:
    """The max abs error below which a benchmark output passes without its tiers being read.
    msprobe's ``max_abs_pass`` is absolute: a gradient of O(1e-3) that is 30 % wrong would pass it,
    so it is scaled by the expected output's ``magnitude`` (``max |value|``) when that is below 1.
    Never below :func:`shortcut_floor`.  ``magnitude`` None or 0: unscaled."""
    limit = float(standard()[rule]["max_abs_pass"])
    if magnitude is not None and math.isfinite(magnitude) and 0.0 < magnitude < 1.0:
        limit *= magnitude
    return max(limit, shortcut_floor(dtype))


def expected_magnitude(bench, spread=None) -> float:
    """``max |value|`` over the finite elements of the expected output (0 when none is finite),
    and over ``spread`` where given: an element that cancelled is as large as its terms."""
    mags = [np.abs(np.asarray(x)) for x in (bench, spread) if x is not None]
    finite = [m[np.isfinite(m)] for m in mags]
    return max((float(m.max()) for m in finite if m.size), default=0.0)


def judge_benchmark(metrics: dict, dtype: str, rule: str = "benchmark", direction: bool = True,
                    magnitude: float | None = None) -> tuple[str, str]:
    """``(verdict, reason)`` of one output by the per-output rule (cosine, max abs error, then the
    hundredth/thousandth ratios).  ``rule``: ``benchmark``, or ``mindspore_benchmark`` (cosine and
    max-abs only).  ``magnitude``: the expected output's, which scales the absolute-error shortcut
    (:func:`shortcut_limit`; None: msprobe's absolute one).  ``direction=False``
    (:func:`direction_readable`): the ratios alone decide; the cosine and the absolute-error
    shortcut, which only the cosine keeps honest, are not read."""
    std = standard()[rule]
    if metrics.get("inf_nan_mismatch"):
        return ERROR, f"{metrics['inf_nan_mismatch']} inf/nan mismatches"
    if not direction and rule == "benchmark":
        return _tiers(metrics, dtype)
    cos = metrics.get("cosine")
    if cos is not None and not math.isnan(cos) and cos <= std["cosine_min"]:
        return ERROR, f"cosine {cos:.6f} <= {std['cosine_min']}"
    limit = shortcut_limit(dtype, magnitude, rule)
    max_abs = metrics.get("max_abs_err", 0.0)
    if cos is not None and math.isnan(cos) and max_abs >= limit:
        return ERROR, f"one side is all zeros (max abs error {max_abs:.3g} >= {limit:.3g})"
    if max_abs < limit:
        return PASS, ""
    if rule != "benchmark":
        return ERROR, f"max abs error {max_abs:.3g} >= {limit:.3g}"
    return _tiers(metrics, dtype)


def _tiers(metrics: dict, dtype: str) -> tuple[str, str]:
    coarse, fine = (float(t) for t in per_dtype("benchmark.tiers", dtype))
    for tol, verdict in ((coarse, ERROR), (fine, WARNING)):
        if metrics[_TIERS[tol]] < 1 - tol:
            return verdict, f"{_TIERS[tol]} ratio {metrics[_TIERS[tol]]:.6f} < {1 - tol:g}"
    return PASS, ""


# ---- compare -------------------------------------------------------------------------------------
def judge_compare(metrics: dict, dtype: str, scale: float) -> tuple[str, str]:
    """:func:`judge_benchmark` with its absolute-error shortcut scaled by ``scale`` (``max(|max|,
    |min|)`` of the expected tensor; :func:`shortcut_limit`, the rule run-ut judges by too)."""
    return judge_benchmark(metrics, dtype, magnitude=scale)


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


def _lookup(table: dict, op: str, default=None):
    """``table``'s entry for ``op``: by ``name.overload`` (``round.decimals``), else by base name,
    else by base name without a leading ``_``."""
    name = base_name(op)
    parts = op.split(".")
    keys = ([f"{name}.{parts[2]}"] if len(parts) == 3 else []) + [name, name.lstrip("_")]
    return next((table[k] for k in keys if k in table), default)


@functools.lru_cache(maxsize=4096)
def category(op: str) -> str:
    return _lookup(_categories(), op, standard("api_precision_standard").get("default", "benchmark"))


def _thr() -> dict:
    return standard("api_precision_standard")["thresholds"]


_COMPONENT = {"complex32": "float16", "chalf": "float16", "complex64": "float32", "cfloat": "float32",
              "complex128": "float64", "cdouble": "float64"}


def component_dtype(dtype: str) -> str:
    """The real dtype whose tolerances judge ``dtype``: complex64 -> float32, others unchanged."""
    return _COMPONENT.get(short_dtype(dtype), dtype)


def output_category(op_category: str, dtype: str) -> str:
    """Integer, bool and index outputs are judged by binary consistency whatever the op's
    category; complex ones by the op's category, as complex numbers."""
    return op_category if is_float(component_dtype(dtype)) else "binary"


# ---- run-ut: traits of an op's outputs (data/api_precision_standard.yaml) ------------------------
@functools.lru_cache(maxsize=4096)
def is_reduction(op: str) -> bool:
    """Each output element sums products of input elements (``reductions``, ``staged_reductions``):
    its rounding error scales with the magnitude of its terms, not with its value, which may
    cancel to near zero."""
    return _reduction_kind(op) is not None


def reduction_kind(op: str, output: str) -> str | None:
    """How ``output`` of ``op`` rounds as a sum of terms (:func:`.rounding.term_bound`):
    ``"rounded_terms"`` (``rounded_term_outputs``), ``"staged"`` (:func:`is_staged`),
    ``"reduction"`` (:func:`is_reduction`, ``reduction_outputs``), or None: not a sum of terms."""
    data = standard("api_precision_standard")
    if output in (_lookup(data.get("rounded_term_outputs") or {}, op) or ()):
        return "rounded_terms"
    if output in (_lookup(data.get("reduction_outputs") or {}, op) or ()):
        return "reduction"
    return _reduction_kind(op)


def is_staged(op: str) -> bool:
    """Accumulates into its stored result term by term (``staged_reductions``)."""
    return _reduction_kind(op) == "staged"


@functools.lru_cache(maxsize=4096)
def _reduction_kind(op: str) -> str | None:
    data = standard("api_precision_standard")
    table = {**dict.fromkeys(data.get("reductions") or (), "reduction"),
             **dict.fromkeys(data.get("staged_reductions") or (), "staged")}
    return _lookup(table, op)


def output_trait(op: str, output: str) -> str | None:
    """``"undefined"`` (never judged), the name of a unique form (:data:`UNIQUE_FORMS`), or None."""
    data = standard("api_precision_standard")
    if output in (_lookup(data.get("undefined_outputs") or {}, op) or ()):
        return "undefined"
    return (_lookup(data.get("unique_forms") or {}, op) or {}).get(output)


def _h(x):
    return np.conj(np.swapaxes(x, -1, -2))


def _svd_left(outs):
    u, s = outs[0], outs[1]
    uk = u[..., :, :s.shape[-1]]
    return (uk * s[..., None, :]) @ _h(uk)


def _svd_right(outs):
    vh, s = outs[2], outs[1]
    vk = vh[..., :s.shape[-1], :]
    return _h(vk) @ (s[..., :, None] * vk)


def _eig_vectors(outs):
    values, v = outs[0], outs[1]
    return (v * values[..., None, :]) @ np.linalg.pinv(v)


def _eigh_vectors(outs):
    values, v = outs[0], outs[1]
    return (v * values[..., None, :]) @ _h(v)


# Singular and eigen vectors are unique only up to sign/phase (and to the basis of a repeated
# value's subspace; U's columns beyond min(m, n) are free): each is judged by the product it
# spans with its values, which is unique.  Functions of the op's output arrays, in order.
UNIQUE_FORMS = {
    "svd_left": ("U S Uᴴ", _svd_left),            # (U, S, Vh)
    "svd_right": ("V S Vᴴ", _svd_right),
    "eig_vectors": ("V diag(L) V⁻¹", _eig_vectors),   # (L, V)
    "eigh_vectors": ("V diag(L) Vᴴ", _eigh_vectors),
}


def unique_form(form: str, outputs: list) -> tuple[str, np.ndarray]:
    """(label, array) of unique form ``form`` computed from an op's output arrays."""
    label, fn = UNIQUE_FORMS[form]
    if any(np.size(o) == 0 for o in outputs):        # vectors not computed (compute_uv=False)
        return label, np.zeros(0)
    return label, fn([np.asarray(o) for o in outputs])


def cancelled_scale(bench, spread):
    """Per element: its spread where the value cancelled (spread above ``cancellation`` times
    |value|: a near-zero difference of larger terms, whose rounding is relative to those terms),
    else 0 (judged against its own value, so a conditioned op's errors are not excused)."""
    ratio = standard("api_precision_standard")["thresholds"]["cancellation"]
    spread = np.abs(np.asarray(spread)).astype(np.float64)
    return np.where(spread > ratio * np.abs(np.asarray(bench)), spread, 0.0)


def direction_readable(bench, scale, dtype: str) -> bool:
    """Whether the cosine can judge an output whose cancelled elements are measured against their
    spread (``scale``, :func:`cancelled_scale`): not when the errors the coarse tier tolerates
    there (tier x spread) could by themselves turn it to ``cosine_min``: the output is then mostly
    the rounding of larger terms (noise around zero), which two correct runs make differently, so
    its direction says nothing."""
    b = np.asarray(bench)
    b = np.where(np.isfinite(b), np.abs(b), 0.0).astype(np.float64)
    s = np.nan_to_num(np.abs(np.asarray(scale)).astype(np.float64), nan=0.0, posinf=0.0)
    coarse = float(per_dtype("benchmark.tiers", component_dtype(dtype))[0])
    cos_min = standard()["benchmark"]["cosine_min"]
    tolerated = coarse * coarse * float(np.vdot(s, s))
    # a tolerated error t orthogonal to the value: cosine ||b|| / sqrt(||b||^2 + ||t||^2)
    return tolerated < float(np.vdot(b, b)) * (1.0 / (cos_min * cos_min) - 1.0)


def within_terms(device, bench, terms, dtype: str, kind: str = "reduction", counts=None):
    """``device`` with each element's error reduced by the rounding bound of its terms (``terms``:
    the op on the inputs' absolute values, i.e. sum |x|; :mod:`.rounding`, the one bound);
    ``kind``: :func:`reduction_kind`; ``counts``: a staged element's number of terms."""
    bound = rounding.term_bound(terms, component_dtype(dtype), kind, counts)
    return rounding.discount(device, bench, bound)


def judge(cat: str, metrics: dict, dtype: str, direction: bool = True, magnitude: float | None = None,
          input_dtypes=()) -> tuple[str, str]:
    """(verdict, reason) of one output of ``dtype`` (the device dtype) by category ``cat``;
    ``direction``: whether the cosine is read (:func:`direction_readable`); ``magnitude``: the
    expected output's (:func:`expected_magnitude`); ``input_dtypes``: the op's input dtypes, whose
    lowest float precision the benchmark rule judges at (:func:`judging_precision`)."""
    cat = output_category(cat, dtype)
    dtype = component_dtype(dtype)
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
        return _judge_thousandth(metrics, dtype)
    return judge_benchmark(metrics, judging_precision(dtype, input_dtypes), direction=direction, magnitude=magnitude)


def judging_precision(dtype: str, input_dtypes=()) -> str:
    """The float dtype whose benchmark tolerances judge an output of ``dtype``: the lowest precision
    among it and the op's float inputs, as compare judges (``scoring.judging_precisions``): an
    fp32 layer-norm gradient computed from bf16 inputs under autocast carries bf16's rounding."""
    if precision_rank(dtype) < 0:
        return dtype
    floats = [d for d in input_dtypes if precision_rank(component_dtype(d)) >= 0]
    return min([dtype, *map(component_dtype, floats)], key=precision_rank)


def _judge_thousandth(metrics: dict, dtype: str) -> tuple[str, str]:
    """The dual-thousandth rule at the dtype's tolerance (``thousandth_tolerance``): bf16
    rounding alone is up to 0.2 %, so bf16 is held to the one-hundredth ratio."""
    lim = _thr()["thousandth_min"]
    tier = _TIERS[float(per_dtype(_thr()["thousandth_tolerance"], dtype))]
    value = metrics.get(tier, 1.0)
    if value > lim or metrics.get("elements", 1) == 0:
        return PASS, ""
    return ERROR, f"{tier} ratio {value:.6f} <= {lim}"


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
# error balance is reported but does not count towards the verdict (as in msprobe)
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
    dtype = component_dtype(dtype)
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
        v, reason = _judge_thousandth(dut, dtype)
        cols["one_thousandth_verdict"] = v
        return v, cols, reason
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
