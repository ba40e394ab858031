"""The one error bound for reductions: a value summed from terms is rounded relative to the sum of
the terms' magnitudes, ``slack * eps * sum|x|``, not to its own value, which can cancel to near
zero (a layer norm's mean of already-normalised rows, a bias gradient that is mathematically zero).
run-ut discounts errors within it element by element before any metric (cosine included) is
computed; compare, which has the two runs' values but no float64 benchmark, holds the difference of
an output that is a sum of terms (a reduction, an element-wise add or sub, a matrix product) and
cancelled to the same bound carried to the L2 norm, from each run's record (:func:`carried_bound`).
Numbers in ``data/api_precision_standard.yaml`` (``thresholds.reduction_slack``, ``staged_slack``,
``rounded_terms_slack``, ``cancellation``)."""

from __future__ import annotations

import math

import numpy as np

from ..records.format import base_name, walk
from .loader import short_dtype, standard

EPS = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24, "float64": 2.0 ** -53}
# the largest finite value of each float dtype (torch.finfo(d).max)
LARGEST = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38,
           "float64": 1.7976931348623157e308}

# reductions of one input over some of its dimensions: compare bounds them from that input's norm
_SUMS = {"sum": 1, "nansum": 1, "mean": 0,      # 0: divided by the number of terms
         "ReduceSum": 1, "SumExt": 1, "ReduceMean": 0, "MeanExt": 0,
         "BiasAddGrad": 1}                       # MindSpore's bias gradient: dout summed but over channels
# outputs that are a sum of the op's first input over all but some dimensions, of ops that are not
_OUTPUT_SUMS = {"convolution_backward": {"output.2": 1},    # the bias gradient: grad_output summed but over channels
                # the saved mean of a normalisation: its input averaged over the normalised elements (the
                # mean of an already normalised value is rounding noise around zero)
                **dict.fromkeys(("native_layer_norm", "native_group_norm", "native_batch_norm",
                                 "_native_batch_norm_legit", "_native_batch_norm_legit_no_training"),
                                {"output.1": 0})}


def _thresholds() -> dict:
    return standard("api_precision_standard")["thresholds"]


def term_bound(terms, dtype: str, kind: str = "reduction", counts=None) -> np.ndarray:
    """Per element, the rounding error a correct kernel may make: ``reduction_slack * eps * terms``
    (``terms``: sum |x| of the element's terms) with float32's eps for half types (correct kernels
    accumulate them in float32); ``kind`` ``"staged"`` (accumulating into its stored result) rounds
    each partial sum to ``dtype``: ``staged_slack * eps(dtype) * terms * (1 - 1/counts)``;
    ``"rounded_terms"`` forms each term in ``dtype``: ``rounded_terms_slack * eps(dtype) * terms``."""
    thr = _thresholds()
    dtype = short_dtype(dtype)
    terms = np.abs(np.asarray(terms)).astype(np.float64)
    if kind == "rounded_terms":
        return thr["rounded_terms_slack"] * EPS.get(dtype, EPS["float32"]) * terms
    if kind == "staged":
        bound = thr["staged_slack"] * EPS.get(dtype, EPS["float32"]) * terms
        if counts is not None:
            bound = bound * (1 - 1 / np.maximum(np.abs(np.asarray(counts)).astype(np.float64), 1))
        return bound
    return thr["reduction_slack"] * min(EPS.get(dtype, EPS["float32"]), EPS["float32"]) * terms


def discount(device, bench, bound):
    """``device`` with each element's error reduced by ``bound``: an error that rounding of the
    terms explains is not one; what exceeds it is judged in full (non-finite elements unchanged)."""
    d, b = np.asarray(device), np.asarray(bench)
    err = d - b
    mag = np.abs(err)
    with np.errstate(invalid="ignore", divide="ignore"):
        keep = np.where(mag > bound, (mag - bound) / np.where(mag > 0, mag, 1), 0.0)
    return np.where(np.isfinite(d) & np.isfinite(b), b + err * keep, d)


# ---- compare: the terms of an output, from one run's record ----------------------------------------
# outputs that add or subtract their inputs element by element: (positional index of the coefficient,
# index of the input it scales); a scalar second operand is a term too
_SIGNED = {"add": (2, 1), "sub": (2, 1), "rsub": (2, 0), "Add": (2, 1), "Sub": (2, 1), "AddExt": (2, 1),
           "SubExt": (2, 1)}
# products summed over an inner dimension, with a bias added: (index of x, of y, of the bias or None,
# of the products' coefficient alpha or None, of the bias's beta or None); keywords by those names
_PRODUCTS = {"mm": (0, 1, None, None, None), "bmm": (0, 1, None, None, None), "matmul": (0, 1, None, None, None),
             "mv": (0, 1, None, None, None), "dot": (0, 1, None, None, None), "vdot": (0, 1, None, None, None),
             "inner": (0, 1, None, None, None), "linear": (0, 1, 2, None, None),
             "addmm": (1, 2, 0, 4, 3), "baddbmm": (1, 2, 0, 4, 3), "addmv": (1, 2, 0, 4, 3),
             **dict.fromkeys(("MatMul", "MatMulExt", "BatchMatMul", "BatchMatMulExt", "Mm"), (0, 1, None, None, None)),
             "Dense": (0, 1, 2, None, None)}


def terms_norm(record: dict, output: str) -> float | None:
    """An upper bound, from one run's record (its inputs' statistics, shapes and scalars), of the L2
    norm over output ``output`` of each element's sum|terms|: the magnitude the element is computed
    from, which its value can cancel far below.  For the outputs that are sums of terms: a sum or
    mean of one input (sum|x| <= sqrt(n) ||row||), an element-wise add/sub (||x|| and |alpha| ||y||,
    each repeated where broadcast), a matrix product (|| |X||Y| || <= ||X|| ||Y||, batched too) with
    its bias.  None for other ops, or where a statistic is missing."""
    name = base_name(record.get("op", ""))
    kind = _SUMS.get(name, _OUTPUT_SUMS.get(name, {}).get(output))
    if kind is None and (output != "output.0" or (name not in _SIGNED and name not in _PRODUCTS)):
        return None       # no sum of terms (most ops): nothing more to read
    ins = record.get("inputs") or []
    kw = record.get("kwargs") or {}
    out = _output_spec(record, output)
    if out is None:
        return None
    n_out = max(math.prod(out.get("shape") or ()), 1)
    if kind is not None:
        x = _tensor(ins, 0)
        if x is None:
            return None
        n = x[1] / n_out
        if not n >= 1:
            return None
        return x[0] * math.sqrt(n) / (1 if kind else n)
    if output != "output.0":
        return None
    if name in _SIGNED:
        k_coef, k_scaled = _SIGNED[name]
        coef = _scalar(ins, kw, k_coef, "alpha", 1.0)
        total = 0.0
        for k in (0, 1):
            term = _spread_norm(ins, k, n_out)
            if term is None or coef is None:
                return None
            total += term * (abs(coef) if k == k_scaled else 1.0)
        return total
    if name in _PRODUCTS:
        kx, ky, kb, k_alpha, k_beta = _PRODUCTS[name]
        x, y = _tensor(ins, kx), _tensor(ins, ky)
        alpha = 1.0 if k_alpha is None else _scalar(ins, kw, k_alpha, "alpha", 1.0)
        beta = 1.0 if k_beta is None else _scalar(ins, kw, k_beta, "beta", 1.0)
        if x is None or y is None or alpha is None or beta is None:
            return None
        total = abs(alpha) * x[0] * y[0]
        bias = None if kb is None else _arg(ins, kw, kb, "bias")
        if bias is not None and bias.get("type") == "tensor":
            term = _spread_norm([bias], 0, n_out)
            if term is None:
                return None
            total += abs(beta) * term
        return total
    return None


def _arg(ins: list, kw: dict, k: int, key: str):
    return ins[k] if k < len(ins) else kw.get(key)


def _output_spec(record: dict, output: str):
    outs = record.get("outputs") or []
    parts = output.split(".")
    if len(parts) != 2 or parts[0] != "output" or not parts[1].isdigit() or int(parts[1]) >= len(outs):
        return None
    spec = outs[int(parts[1])]
    return spec if spec.get("type") == "tensor" else None


def _tensor(ins: list, k: int):
    """(L2 norm, elements) of positional input ``k`` if it is a tensor with a finite norm."""
    spec = ins[k] if k < len(ins) else None
    if not spec or spec.get("type") != "tensor":
        return None
    norm = (spec.get("stats") or {}).get("norm")
    try:
        norm = float(norm)
    except (TypeError, ValueError):
        return None
    return (norm, max(math.prod(spec.get("shape") or ()), 1)) if math.isfinite(norm) else None


def _spread_norm(ins: list, k: int, n_out: int):
    """The L2 norm of input ``k`` as the output's elements see it: a tensor's norm times the square root
    of how often each element is repeated (broadcast), a scalar's |value| times sqrt(elements)."""
    spec = ins[k] if k < len(ins) else None
    if spec is not None and spec.get("type") == "tensor":
        t = _tensor(ins, k)
        return None if t is None else t[0] * math.sqrt(max(n_out / t[1], 1.0))
    value = _number(spec)
    return None if value is None else abs(value) * math.sqrt(n_out)


def _scalar(ins: list, kw: dict, k: int, key: str, default: float):
    """A numeric argument, positional ``k`` or keyword ``key``; ``default`` when absent, None when it
    is there but not a plain number (a tensor coefficient: its size is not a scalar's)."""
    spec = ins[k] if k < len(ins) else kw.get(key)
    if spec is None:
        return default
    return _number(spec)


def _number(spec):
    if not isinstance(spec, dict) or spec.get("type") not in ("int", "float", "bool"):
        return None
    try:
        value = float(spec.get("value"))
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def carried_bound(record: dict, output: str, carried: str | None = None,
                  terms: float | None = None) -> tuple[float, float] | None:
    """``(bound, terms)`` of one run's output ``output`` (None where :func:`terms_norm` is): how far
    that output's L2 norm may move from rounding alone: the op's own (:func:`term_bound`, run-ut's:
    half types accumulate in float32) plus one rounding of each term in the lowest precision among
    the op's float inputs, that output and ``carried`` (the precision the values were computed from,
    where lower: a float32 gradient of a bfloat16 layer's output), relative to the terms, not to the
    value.  Two runs' inputs each carry that rounding (a bfloat16 input is rounded to bfloat16
    whatever the kernel accumulates in).  ``terms``: :func:`terms_norm` of it, where the caller
    has it already."""
    if terms is None:
        terms = terms_norm(record, output)
    if terms is None:
        return None
    specs = [s for _, _, s in walk(record, outputs=False)] + [_output_spec(record, output)]
    dtypes = [d for d in [short_dtype(s.get("dtype", "")) for s in specs if s] + [short_dtype(carried or "")]
              if d in EPS]
    low = max(dtypes, key=EPS.get, default="float32")
    return float(term_bound(terms, low)) + EPS[low] * terms, terms


def cancelled(terms: float, value_norm: float) -> bool:
    """The value cancelled: its terms are more than ``cancellation`` times its own norm (the ratio
    run-ut's spread uses, ``thresholds.cancellation``)."""
    return math.isfinite(terms) and terms > _thresholds()["cancellation"] * abs(value_norm)
