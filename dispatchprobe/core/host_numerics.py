"""The numbers a tensor backend computes, in numpy, on host copies: for adapters whose framework
lacks the kernels on its device (MindSpore's CPU has no aminmax, vector norm or dot) or gains
nothing from them.  Each function takes numpy arrays; the adapter converts.  The formulas are the
standards' (:mod:`dispatchprobe.standards.statistics`, :func:`~dispatchprobe.standards.metrics.perturbation_terms`).
"""

from __future__ import annotations

import math

import numpy as np

from ..standards import statistics
from ..standards.loader import per_dtype
from ..standards.metrics import perturbation_terms

_INT_VIEW = {np.dtype(np.float16): np.int16, np.dtype(np.float32): np.int32, np.dtype(np.float64): np.int64}


def stats(x: np.ndarray) -> dict | None:
    return statistics.record(x, np)


def sq_norm(x: np.ndarray) -> float:
    """Squared L2 norm, accumulated in float32 (float64 for float64): finite iff ``x`` is, unless
    the squares overflow float32 (the overflow check then counts the non-finite values)."""
    flat = x.reshape(-1).astype(np.float64 if x.dtype == np.float64 else np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        return float(np.dot(flat, flat))


def nonfinite_counts(x: np.ndarray) -> tuple[int, int]:
    return int(np.isnan(x).sum()), int(np.isinf(x).sum())


def max_abs_finite(x: np.ndarray) -> float:
    finite = x[np.isfinite(x)]
    return float(np.abs(finite).max()) if finite.size else 0.0


def _noisy(x: np.ndarray, dtype: str) -> np.ndarray:
    """Where an element gets noise: finite and at least msprobe's small-value threshold."""
    return np.isfinite(x) & (np.abs(x) >= per_dtype("small_value", dtype))


def bit_noise(x: np.ndarray, dtype: str) -> np.ndarray:
    """The last mantissa bit of every noisy element flipped (a new array)."""
    ints = _INT_VIEW[x.dtype]
    out = np.ascontiguousarray(x).copy()
    out.view(ints)[...] ^= _noisy(x, dtype).astype(ints)
    return out


class NoiseSource:
    """x * (1 + u * eps(dtype)), u uniform in [-1, 1) from a private seeded generator (never a
    global RNG), on noisy elements only; the product is rounded once from float32 (float64)."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def apply(self, x: np.ndarray, dtype: str) -> np.ndarray:
        wide = np.float64 if x.dtype == np.float64 else np.float32
        e = float(np.finfo(x.dtype).eps)
        u = self.rng.uniform(-1.0, 1.0, size=x.shape).astype(wide)
        factor = 1 + np.where(_noisy(x, dtype), u * e, 0).astype(wide)
        noisy = (x.astype(wide) * factor).astype(x.dtype)
        return np.where(np.isinf(noisy), x, noisy)     # a finite value at the range's edge stays finite


def swap_first_last(x: np.ndarray, axis: int) -> np.ndarray:
    """A copy with the first and last slices along ``axis`` exchanged."""
    idx = np.arange(x.shape[axis])
    if idx.size > 1:
        idx[0], idx[-1] = idx[-1], idx[0]
    return np.take(x, idx, axis=axis)


def changes(actual: np.ndarray, expected: np.ndarray, small: float) -> tuple[float, float]:
    """(max_rel, sign_flips) of one pair, in float64 (the free benchmark's measure)."""
    a = actual.reshape(-1).astype(np.float64)
    e = expected.reshape(-1).astype(np.float64)
    with np.errstate(all="ignore"):
        max_rel, flips = perturbation_terms(a, e, small, np)
    return float(max_rel), float(flips)


def within(actual: np.ndarray, expected: np.ndarray, limit: float, small: float) -> bool:
    max_rel, _ = changes(actual, expected, small)
    return math.isfinite(max_rel) and max_rel <= limit
