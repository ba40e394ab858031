"""compare_arrays computes its sums with one BLAS thread, whatever the process allows (and restores
that after): the metrics' digits do not depend on the machine's core count, and a busy machine's
split dots do not wait on each other."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from dispatchprobe.offline.compare.columns import COMPUTED
from dispatchprobe.standards import metrics as M


def _blas_threads() -> list:
    """The threads of the BLAS libraries loaded when metrics were first computed (numpy's; a
    framework imported later brings its own, which the metrics do not call)."""
    return [lib["num_threads"] for lib in M._blas_controller().info() if lib["user_api"] == "blas"]


@pytest.fixture
def seen_threads():
    """A metric recording the BLAS threads each block is computed with."""
    seen: list = []
    M.register_metric("blas_threads", block=lambda b: seen.append(_blas_threads()) or 0)
    try:
        yield seen
    finally:
        M.unregister_metric("blas_threads")


def _pair(n: int, seed: int):
    rng = np.random.default_rng(seed)
    e = rng.standard_normal(n).astype(np.float32)
    return (e * (1 + 1e-3 * rng.standard_normal(n))).astype(np.float32), e


def test_metrics_are_the_same_with_any_blas_threads():
    a, e = _pair(3 * M._BLOCK + 123, seed=0)
    results = []
    for threads in (1, 2, 4):
        with threadpool_limits(limits=threads, user_api="blas"):
            results.append(repr(M.compare_arrays(a, e, "float32", only=COMPUTED, symmetric=True)))
    assert results[0] == results[1] == results[2]


def test_one_blas_thread_inside_and_the_limit_restored_after(seen_threads):
    with threadpool_limits(limits=2, user_api="blas"):
        before = _blas_threads()
        M.compare_arrays(*_pair(2 * M._BLOCK, seed=1), "float32", only={"blas_threads"})
        assert _blas_threads() == before
    assert seen_threads and all(t and set(t) == {1} for t in seen_threads)


def test_threads_computing_metrics_keep_one_blas_thread_until_the_last_ends(seen_threads):
    pairs = [_pair(M._BLOCK * (1 + k % 3) + k, seed=k) for k in range(16)]
    with threadpool_limits(limits=2, user_api="blas"):
        before = _blas_threads()
        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(lambda p: M.compare_arrays(*p, "float32", only={"blas_threads"}), pairs))
        assert _blas_threads() == before
    assert len(seen_threads) >= 16 and all(set(t) == {1} for t in seen_threads)
