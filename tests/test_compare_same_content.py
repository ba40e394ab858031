"""A run saves one value under several keys (an op's output and the next op's input): compare measures
such tensors once (scoring.same_content).  Only bit-identical tensors may share their metrics, and the
table must be the one measuring each pair gives, in both orders."""

from __future__ import annotations

import os
import sys

import numpy as np
import pandas as pd
import pytest

from dispatchprobe import compare
from dispatchprobe.offline.compare import scoring

sys.path.insert(0, os.path.dirname(__file__))
from compare_helpers import record  # noqa: E402


def _tensors():
    rng = np.random.default_rng(0)
    base = rng.standard_normal((64, 33)).astype(np.float32)
    late = base.copy()
    late.flat[-7] += 1.0                          # the sampled elements agree, one other does not
    zeros, neg = np.zeros(9, np.float32), np.zeros(9, np.float32)
    neg[4] = -0.0                                 # equal values, other bytes
    nan_a = np.full(5, np.nan, np.float64)
    nan_b = nan_a.copy()
    nan_b.view(np.uint64)[2] ^= 1                 # another nan payload
    return {
        "x": base, "x_again": base.copy(), "x_late": late, "x_t": np.ascontiguousarray(base.T).T,  # strided copy
        "x_flat": base.reshape(-1), "x_f64": base.astype(np.float64),
        "z": zeros, "z_neg": neg, "n": nan_a, "n_same": nan_a.copy(), "n_payload": nan_b,
        "e0": np.zeros((0, 3), np.float32), "e1": np.zeros((0, 3), np.float32), "e2": np.zeros((3, 0), np.float32),
        "s": np.array(2.5, np.float16), "s_again": np.array(2.5, np.float16),
        "b": rng.standard_normal(8).astype(np.complex64), "none": None,
    }


def test_same_content_groups_only_bit_identical_tensors():
    same = scoring.same_content(_tensors())
    # x_t: x's elements in another layout; x_flat: in another shape (the metrics read them flattened)
    assert same == {"x": "x", "x_again": "x", "x_late": "x_late", "x_t": "x", "x_flat": "x", "x_f64": "x_f64",
                    "z": "z", "z_neg": "z_neg", "n": "n", "n_same": "n", "n_payload": "n_payload",
                    "e0": "e0", "e1": "e0", "e2": "e0", "s": "s", "s_again": "s", "b": "b"}


class _Saved:
    """A part whose saved tensors are the given arrays."""

    def __init__(self, arrays: dict):
        self.arrays = arrays

    def tensors_of(self, keys):
        return {k: self.arrays[k] for k in keys}


def test_pairs_sharing_contents_get_the_metrics_each_pair_gets():
    """Pairs of the same contents in several layouts, signed zeros (equal values, other bytes), nan,
    another dtype and a binary pair: their shared metrics are each pair's own."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((40, 30)).astype(np.float32)
    y = x.copy()
    y[::3] = -y[::3] * 0.0 + 0.0     # zeros in both, signs differing below
    x[::3] = -0.0
    xn, yn = x.copy(), y.copy()
    xn[5, 5] = yn[5, 5] = np.nan
    arrays_a = {"x": x, "x2": x.copy(), "x_t": np.ascontiguousarray(x.T).T, "x_t2": np.ascontiguousarray(x.T).T,
                "n": xn, "n2": xn.copy(), "d": x.astype(np.float64), "i": np.arange(6), "i2": np.arange(6)}
    arrays_b = {"y": y, "y2": y.copy(), "y_t": np.ascontiguousarray(y.T).T, "y_t2": np.ascontiguousarray(y.T).T,
                "n": yn, "n2": yn.copy(), "d": y.astype(np.float64), "i": np.arange(6) % 4, "i2": np.arange(6) % 4}
    pairs = [("x", "y"), ("x2", "y2"), ("x_t", "y_t"), ("x_t2", "y_t2"), ("x", "y_t"), ("x_t", "y"), ("n", "n"),
             ("n2", "n2"), ("d", "d"), ("i", "i"), ("i2", "i2"), ("x2", "y2")]
    judged = ["float32"] * 8 + ["float64", "int64", "int64", "bfloat16"]
    measured = []
    metrics_of = scoring._metrics_of

    def counted(a, b, d, same=None):
        measured.append(1)
        return metrics_of(a, b, d, same)
    scoring._metrics_of = counted
    try:
        got = scoring._tensor_metrics(_Saved(arrays_a), _Saved(arrays_b), [p[0] for p in pairs],
                                      [p[1] for p in pairs], np.array(judged, object), None, [])
    finally:
        scoring._metrics_of = metrics_of
    each = [metrics_of(arrays_a[ka], arrays_b[kb], d) for (ka, kb), d in zip(pairs, judged)]
    assert repr(got) == repr(each)
    # x/x2 (bytes differ), x_t/x_t2 (equal values: perfect), x with y_t (bytes differ: x's), n/n2, d, i/i2,
    # bfloat16
    assert len(measured) == 6


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("same_content")
    return str(record(tmp / "a")), str(record(tmp / "b", plant=True))


@pytest.mark.parametrize("swap", [False, True])
def test_tensors_measured_once_give_the_table_of_each_measured(runs, swap, monkeypatch):
    a, b = runs[::-1] if swap else runs
    measured = []
    metrics_of = scoring._metrics_of
    monkeypatch.setattr(scoring, "_metrics_of", lambda x, y, d, same=None: measured.append(1) or metrics_of(x, y, d, same))
    once, verdict_once = compare(a, b)
    shared = len(measured)
    monkeypatch.setattr(scoring, "same_content", lambda tensors: {})
    each, verdict_each = compare(a, b)
    assert shared < len(measured)                 # the runs do save values twice
    pd.testing.assert_frame_equal(once, each, check_exact=True)
    assert str(verdict_once) == str(verdict_each)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.complex64, np.int64, np.bool_, np.uint8])
@pytest.mark.parametrize("n", [1, 3, 8, 1001, 65536])
def test_byte_comparison_is_memoryviews(dtype, n):
    """_same_bytes on contiguous arrays compares words, not bytes one by one: the answer of a byte
    by byte comparison, for every size (a byte count not a multiple of 8 too) and a change in any byte."""
    rng = np.random.default_rng(n)
    x = rng.integers(0, 2, n).astype(dtype) if dtype in (np.bool_, np.uint8) else rng.standard_normal(n).astype(dtype)
    for k in (0, n // 2, n - 1):
        for flip in (0, 1):
            y = x.copy()
            if flip:
                y.view(np.uint8)[k * x.itemsize + (x.itemsize - 1 if x.itemsize > 1 else 0)] ^= 1
            expected = memoryview(x).cast("B") == memoryview(y).cast("B")
            assert scoring._same_bytes(x, y) == expected and expected == (not flip)
    signed = np.zeros(n, np.float32)
    flipped = signed.copy()
    flipped[-1] = -0.0
    assert not scoring._same_bytes(signed, flipped) and scoring._same_bytes(signed, signed.copy())
