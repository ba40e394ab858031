"""compare_arrays writes each block's terms into per-thread scratch arrays (no allocation per block):
its metrics must be bit for bit those of fresh arrays, whatever a previous block or call left in
them, for every dtype, layout, size and non-finite pattern, and in threads."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from dispatchprobe.offline.compare.columns import COMPUTED
from dispatchprobe.standards import metrics as M

SIZES = (0, 1, 7, M._BLOCK - 1, M._BLOCK, M._BLOCK + 3, 2 * M._BLOCK + 1001)
DTYPES = (np.float16, np.float32, np.float64, np.complex64, np.complex128)


def _pair(n: int, dtype, layout: str, special: str, seed: int):
    """(actual, expected) of ``n`` elements: ``layout`` contiguous, transposed, strided or reversed;
    ``special`` the values: close, zeros in expected, non-finite (matched and not), signed zeros,
    or huge (float64 sums of squares overflow)."""
    rng = np.random.default_rng(seed)
    real = rng.standard_normal(2 * n + 8)
    if np.dtype(dtype).kind == "c":
        e = real[:n] + 1j * real[n:2 * n]
    else:
        e = real[:n] * 3.0
    a = e * (1 + 1e-3 * rng.standard_normal(n)) + 1e-6 * rng.standard_normal(n)
    if special == "zeros" and n:
        e[::5] = 0
        a[::10] = 0
    elif special == "nonfinite" and n:
        a[::7], e[::7] = np.nan, np.nan
        a[3::11], e[3::11] = np.inf, np.inf
        a[5::13] = -np.inf           # mismatches
        e[6::17] = np.nan
    elif special == "signed_zero" and n:
        e[::3], a[::3] = 0.0, -0.0
    elif special == "huge" and n and np.dtype(dtype) in (np.float64, np.complex128):
        a[::4] *= 1e300
        e[::4] *= 1e300
    a, e = a.astype(dtype), e.astype(dtype)
    if layout == "transposed" and n % 7 == 0 and n:
        a, e = a.reshape(7, -1).T, e.reshape(-1, 7)      # non-contiguous, same element count
    elif layout == "strided":
        a, e = np.repeat(a, 2)[::2], np.repeat(e, 2)[::2]
    elif layout == "reversed":
        a, e = a[::-1], e[::-1]
    return a, e


def _fresh(monkeypatch):
    """Scratch arrays made afresh at every request (what the terms were before the workspace)."""
    monkeypatch.setattr(M._Workspace, "view", lambda self, name, dtype, n: np.empty(n, dtype=dtype))


def _bits(metrics: dict) -> dict:
    return {k: repr(v) for k, v in metrics.items()}


CASES = [(n, d, layout, special) for n in SIZES for d in DTYPES
         for layout in ("contiguous", "transposed", "strided", "reversed")
         for special in ("close", "zeros", "nonfinite", "signed_zero", "huge")
         if not (layout in ("strided", "reversed") and n > M._BLOCK + 3)]


def _metrics(a, e, k: int):
    """Each variant compare uses and run-ut uses: symmetric or not, a scale, a subset, all metrics."""
    scale = np.abs(e).astype(np.float64) * 0.5 if k % 3 == 0 else None
    return [M.compare_arrays(a, e, "float32" if e.dtype != np.float16 else "float16", only=COMPUTED,
                             symmetric=True),
            M.compare_arrays(a, e, None, scale=scale, symmetric=bool(k % 2))]


def test_scratch_arrays_give_the_metrics_of_fresh_arrays(monkeypatch):
    # every case once with the scratch arrays (in an order that leaves big blocks' values behind
    # for small ones), then all again with fresh arrays
    order = sorted(range(len(CASES)), key=lambda k: (-CASES[k][0], k % 5))
    reused = {k: [_bits(m) for m in _metrics(*_pair(*CASES[k], seed=k), k)] for k in order}
    _fresh(monkeypatch)
    for k in order:
        assert reused[k] == [_bits(m) for m in _metrics(*_pair(*CASES[k], seed=k), k)], CASES[k]


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_order_free_metrics_match_their_definition(dtype):
    """The metrics no summation order affects, against whole-array float64 numpy (docs/compare.md):
    relative error ``|a - e| / max(min(|a|, |e|), small_value)``."""
    a, e = _pair(3 * M._BLOCK + 17, dtype, "transposed", "zeros", seed=1)
    got = M.compare_arrays(a, e, "float32", only=COMPUTED, symmetric=True)
    a64, e64 = a.astype(np.float64).reshape(-1), e.astype(np.float64).reshape(-1)
    err = np.abs(a64 - e64)
    rel = err / np.maximum(np.minimum(np.abs(a64), np.abs(e64)), M._limit("small_value", "float32"))
    assert got["max_abs_err"] == err.max() and got["max_rel_err"] == rel.max()
    for name, tol in (("one_hundredth", 1e-2), ("one_thousandth", 1e-3), ("one_ten_thousandth", 1e-4)):
        assert got[name] == np.count_nonzero(rel <= tol) / rel.size
    nonzero = e64 != 0
    assert got["mape"] == pytest.approx(np.mean(err[nonzero] / np.abs(e64[nonzero])), rel=1e-12)


def test_threads_keep_their_own_scratch_arrays():
    pairs = [_pair(M._BLOCK + 5000 * k, DTYPES[k % len(DTYPES)], "contiguous", "close", seed=k) for k in range(12)]
    serial = [_bits(M.compare_arrays(a, e, "float32", only=COMPUTED, symmetric=True)) for a, e in pairs]
    with ThreadPoolExecutor(max_workers=4) as pool:
        threaded = list(pool.map(lambda p: _bits(M.compare_arrays(*p, "float32", only=COMPUTED, symmetric=True)),
                                 pairs * 3))
    assert threaded == serial * 3


def test_a_metric_returning_a_term_keeps_each_blocks_values():
    """A registered metric whose partial is a term array itself gets a copy: the next block's terms
    overwrite the scratch arrays."""
    M.register_metric("abs_errs", block=lambda b: b.abs_err, combine=np.concatenate)
    try:
        a, e = _pair(2 * M._BLOCK + 9, np.float64, "contiguous", "close", seed=3)
        got = M.compare_arrays(a, e, "float64", only={"abs_errs"})["abs_errs"]
    finally:
        M.unregister_metric("abs_errs")
    assert np.array_equal(got, np.abs(a - e)) and not math.isnan(got.sum())
