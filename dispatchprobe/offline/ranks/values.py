"""The values a check reads from one rank's records: the saved tensor where there is one (judged
exactly), else the recorded statistics (judged within the statistics tolerance of
``compare_standards.yaml``).  Every metric and limit comes from :mod:`dispatchprobe.standards`."""

from __future__ import annotations

import numpy as np

from ...records.reader import Part, RecordError
from ...standards import metrics as M, rounding as R, statistics as S, verdicts as V
from ...standards.loader import short_dtype

STAT_KEYS = ("max", "min", "mean", "norm", "nan", "inf")


class Values:
    """Saved tensors of the parts of one step, read once each."""

    def __init__(self, parts: dict[int, Part], tensors: bool = True):
        self.parts = parts
        self.tensors = tensors
        self._cache: dict = {}

    def array(self, rank: int, spec: dict) -> np.ndarray | None:
        """The saved tensor of ``spec`` on ``rank`` (flat, as saved), or None."""
        key = spec.get("data")
        if not self.tensors or key is None or spec.get("undefined"):
            return None
        hit = self._cache.get((rank, key))
        if hit is None:
            part = self.parts[rank]
            try:
                hit = part.tensor(key).reshape(-1) if part.has_tensor(key) else False
            except RecordError:
                hit = False
            self._cache[rank, key] = hit
        return None if hit is False else hit


def judged(spec: dict) -> bool:
    """Whether a tensor's values can be judged at all (not uninitialised memory, values recorded)."""
    return not spec.get("undefined") and "no_values" not in spec and bool(spec.get("stats") or spec.get("data"))


def stats_of(spec: dict) -> dict:
    return {k: (spec.get("stats") or {}).get(k) for k in STAT_KEYS}


def same_stats(a: dict, b: dict) -> bool:
    """Statistics of equal values are equal (the same reduction over the same bytes): any
    difference proves the values differ.  nan compares equal to nan."""
    for k in STAT_KEYS:
        x, y = a.get(k), b.get(k)
        if x != y and not (isinstance(x, float) and isinstance(y, float) and x != x and y != y):
            return False
    return True


def same_arrays(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))


def difference(a: np.ndarray, b: np.ndarray) -> str:
    """How far ``a`` is from ``b`` (same size): elements that differ and the largest difference."""
    with np.errstate(invalid="ignore"):
        wa, wb = a.astype(np.float64), b.astype(np.float64)
        diff = np.abs(wa - wb)
        off = ~((wa == wb) | (np.isnan(wa) & np.isnan(wb)))
    finite = diff[off & np.isfinite(diff)]
    largest = float(finite.max()) if finite.size else float("nan")
    scale = float(np.nanmax(np.abs(wb))) if b.size and np.isfinite(wb).any() else 0.0
    rel = f" ({largest / scale:.3g} of the largest value)" if scale and largest == largest else ""
    return f"{int(off.sum())} of {a.size} elements differ, by up to {largest:.6g}{rel}"


def stats_difference(actual: dict, expected: dict) -> float:
    """The statistics' relative difference (:func:`dispatchprobe.standards.statistics.stats_error`)."""
    return float(S.stats_error({k: [actual.get(k)] for k in S.KEYS}, {k: [expected.get(k)] for k in S.KEYS})[0])


def judge_relation(actual: float, expected: float, scale: float, dtype: str) -> tuple[str, float]:
    """A statistic of a collective's result against the value its inputs' statistics give
    (``mean(all_reduce) = sum of the means``), relative to ``scale`` (the terms' magnitude): the
    verdict of the statistics limits of ``compare_standards.yaml`` and the error."""
    if actual is None or expected is None:
        return V.SKIP, float("nan")
    a, e = float(actual), float(expected)
    if not (np.isfinite(a) and np.isfinite(e)):
        return (V.PASS if a == e or (a != a and e != e) else V.ERROR), float("nan" if a == e else "inf")
    err = abs(a - e) / scale if scale > 0 else (0.0 if a == e else float("inf"))
    verdict, _ = S.judge_stats_columns(np.array([err]), [dtype], np.array([False]))
    return verdict[0], err


def judge_reduction(result: np.ndarray, expected: np.ndarray, terms: np.ndarray, dtype: str) -> tuple[str, str]:
    """A reduction's result against the float64 reduction of the inputs, as run-ut judges a sum:
    differences within the rounding of the terms (``terms``: per element, the sum of the terms'
    magnitudes) are discounted, then the compare rule of the result's dtype decides."""
    dtype = short_dtype(dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        discounted = R.discount(result.astype(np.float64), expected, R.term_bound(terms, dtype))
    metrics = M.compare_arrays(discounted, expected, dtype)
    scale = float(np.nanmax(np.abs(expected[np.isfinite(expected)]))) if np.isfinite(expected).any() else 0.0
    verdict, reason = V.judge_compare(metrics, dtype, scale)
    return verdict, reason or f"max abs error {metrics.get('max_abs_err', 0.0):.3g}"


def classes(members, same) -> list[list]:
    """``members`` grouped by equal values (``same(a, b)``), the largest group first (a tie: the
    group of the first member)."""
    groups: list[list] = []
    for r in members:
        for g in groups:
            if same(g[0], r):
                g.append(r)
                break
        else:
            groups.append([r])
    return sorted(groups, key=lambda g: (-len(g), g[0]))
