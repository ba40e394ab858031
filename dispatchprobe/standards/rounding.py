"""The one error bound for reductions: a value summed from terms is rounded relative to the sum of
the terms' magnitudes, ``slack * eps * sum|x|``, not to its own value, which can cancel to near
zero (a layer norm's mean of already-normalised rows, a bias gradient that is mathematically zero).
run-ut discounts errors within it element by element before any metric (cosine included) is
computed; compare, which has the two runs' values but no float64 benchmark, holds the difference of
a reduction's outputs to the same bound carried to the L2 norm.  Numbers in
``data/api_precision_standard.yaml`` (``thresholds.reduction_slack``, ``staged_slack``)."""

from __future__ import annotations

import math

import numpy as np

from ..records.format import base_name
from .loader import short_dtype, standard

EPS = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24, "float64": 2.0 ** -53}

# reductions of one input over some of its dimensions: compare bounds them from that input's norm
_SUMS = {"sum": 1, "nansum": 1, "mean": 0}      # 0: divided by the number of terms
# outputs that are a sum of the op's first input over all but some dimensions, of ops that are not
_OUTPUT_SUMS = {"convolution_backward": {"output.2": 1}}    # the bias gradient: grad_output summed but over channels


def _thresholds() -> dict:
    return standard("api_precision_standard")["thresholds"]


def term_bound(terms, dtype: str, staged: bool = False, counts=None) -> np.ndarray:
    """Per element, the rounding error a correct kernel may make: ``reduction_slack * eps * terms``
    (``terms``: sum |x| of the element's terms) with float32's eps for half types (correct kernels
    accumulate them in float32); a staged reduction (accumulating into its stored result) rounds
    each partial sum to ``dtype``: ``staged_slack * eps(dtype) * terms * (1 - 1/counts)``."""
    thr = _thresholds()
    dtype = short_dtype(dtype)
    terms = np.abs(np.asarray(terms)).astype(np.float64)
    if staged:
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


def norm_bound(op: str, input_norm: float, terms_per_element: float, dtype: str, output: str = "") -> float | None:
    """The L2 norm of the rounding error ``term_bound`` allows over a whole output of ``op`` (a sum or
    mean of one input over some dimensions), from the input's L2 norm: per element sum|x| <=
    sqrt(n) * ||row|| (n terms), so the bound's norm is at most ``slack * eps * sqrt(n) * ||x||``
    (over n for a mean).  ``output``: which output (``output.2`` of ``convolution_backward``, the
    bias gradient, is a sum of its first input).  None for other ops and outputs, or unknown sizes."""
    kind = _SUMS.get(base_name(op), _OUTPUT_SUMS.get(base_name(op), {}).get(output))
    n = terms_per_element
    if kind is None or not (n >= 1) or not math.isfinite(input_norm):
        return None
    bound = float(term_bound(input_norm * math.sqrt(n), dtype))
    return bound if kind else bound / n
