"""Every accuracy metric, once, in one registry (docs/architecture.md).

A metric is one :func:`register_metric` call: its name, run-ut CSV title (``column``), place
among compare's columns (``compare``), chart direction, and how :func:`compare_arrays` computes
it over cache-sized blocks: ``block`` maps a :class:`Block` (finite pairs in float64 plus shared
terms such as ``rel`` and ``ulp``, computed once per block) to a partial, ``combine`` merges the
partials (sum or max), ``finish`` makes the value.  Entries with ``finish`` only come from the
inf/nan screen and are always returned; entries with neither are columns filled elsewhere
(``binary_mismatch``; ``abs_err_error_rate``, which run-ut copies from ``small_value_error_rate``).

numpy only.  Relative error is ``|a - e| / max(|e|, small_value(dtype))`` (``data/standards.yaml``),
``dtype`` being the actual side's: a near-zero output cannot make a huge one from a tiny absolute one.
With ``symmetric`` (compare: two runs, neither the reference) errors are relative to the smaller of
``|a|`` and ``|e|`` per element and ``rel_l2_err`` to the smaller norm, the worse of the two
directions, so swapping the arrays changes no metric a verdict reads.
Complex arrays are compared as complex numbers: errors and magnitudes are moduli, cosine is the
real part of the inner product over the norms (the cosine of the (re, im) pairs).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .loader import per_dtype, short_dtype

# Mantissa bits and minimum normal exponent, for ULP sizes (run-ut's ULP rule and the repro scripts that mirror it).
FLOAT_LAYOUT = {"float16": (10, -14), "bfloat16": (7, -126), "float32": (23, -126), "float64": (52, -1022)}
_BLOCK = 1 << 16   # elements per pass: float64 blocks that stay in cache
_limit = functools.lru_cache(maxsize=None)(per_dtype)


def _ulp(b) -> np.ndarray:
    """|a - e| in units in the last place of the dtype at the expected value."""
    mantissa, min_exp = FLOAT_LAYOUT.get(b.dtype, FLOAT_LAYOUT["float32"])
    with np.errstate(divide="ignore"):
        exponent = np.floor(np.log2(b.mag))
    exponent = np.maximum(np.where(np.isfinite(exponent), exponent, min_exp), min_exp)
    return b.abs_err / np.exp2(exponent - mantissa)


def _sumsq(x) -> float:
    return float(np.vdot(x, x).real)


def _inner(a, e) -> float:
    """Re <a, e>: the dot product of real arrays, of the (re, im) pairs of complex ones."""
    return float(np.vdot(e, a).real)


class _Workspace(threading.local):
    """Per-thread scratch arrays of ``_BLOCK`` elements, one per (term, dtype), that every block's
    terms are written into.  Why: a block's terms are ~10 arrays of 512 KB; allocated afresh per
    block, glibc hands the freed ones back to the kernel (the heap's top grows past its trim
    threshold) and maps them again, page faults and zeroing included, for the next block: about
    four fifths of compare_arrays' time (24 ns an element against 4 reused)."""

    def __init__(self):
        self.arrays: dict = {}

    def view(self, name: str, dtype, n: int) -> np.ndarray:
        """The first ``n`` elements of scratch array ``name`` of ``dtype`` (made on first use)."""
        key = (name, np.dtype(dtype))
        buf = self.arrays.get(key)
        if buf is None:
            buf = self.arrays[key] = np.empty(_BLOCK, dtype=dtype)
        return buf[:n]

    def filled(self, value: float, n: int) -> np.ndarray:
        """``n`` float64 copies of ``value``: ``np.maximum(x, value)`` reads a scalar at a third of
        the speed of an array (numpy 2.4)."""
        key = ("filled", value)
        buf = self.arrays.get(key)
        if buf is None:
            buf = self.arrays[key] = np.full(_BLOCK, value, dtype=np.float64)
        return buf[:n]


_WORK = _Workspace()


class _Term:
    """A per-block term metrics share: computed on first use, then an attribute of the block."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __set_name__(self, owner, name: str):
        self.name = name

    def __get__(self, block, owner=None):
        value = block.__dict__[self.name] = self.fn(block)
        return value


class Block:
    """One block's finite pairs (``a`` actual, ``e`` expected, float64) and its shared terms.

    The array terms live in per-thread scratch arrays (:meth:`scratch`) that the next block
    overwrites: a metric's ``block`` function returns numbers (or arrays of its own), never a term."""

    def __init__(self, a: np.ndarray, e: np.ndarray, dtype: str, scale: np.ndarray | None = None,
                 symmetric: bool = False):
        self.a, self.e, self.dtype, self.n, self.scale, self.symmetric = a, e, dtype, a.size, scale, symmetric

    def scratch(self, name: str, dtype=np.float64) -> np.ndarray:
        """An uninitialised array of ``n`` elements for term or temporary ``name``, reused by the
        next block (no allocation per block: see :class:`_Workspace`)."""
        return _WORK.view(name, dtype, self.n)

    diff = _Term(lambda b: np.subtract(b.a, b.e, out=b.scratch("diff", b.a.dtype)))
    abs_err = _Term(lambda b: np.abs(b.diff, out=b.scratch("abs_err")))
    abs_e = _Term(lambda b: np.abs(b.e, out=b.scratch("abs_e")))
    mag = _Term(lambda b: _magnitude(b))
    floor = _Term(lambda b: _floor(b))
    rel = _Term(lambda b: np.divide(b.abs_err, b.floor, out=b.scratch("rel")))
    small = _Term(lambda b: np.less(b.mag, _limit("small_value", b.dtype), out=b.scratch("small", bool)))
    n_small = _Term(lambda b: int(np.count_nonzero(b.small)))
    ss_e = _Term(lambda b: _sumsq(b.e))
    ss_a = _Term(lambda b: _sumsq(b.a))
    ss_diff = _Term(lambda b: _sumsq(b.diff))
    ulp = _Term(_ulp)


def _magnitude(b: Block) -> np.ndarray:
    """The magnitude errors are relative to: ``|e|``, or with ``symmetric`` the smaller of ``|a|`` and
    ``|e|``; at least the element's scale when one is given."""
    if b.symmetric:
        mag = np.abs(b.a, out=b.scratch("mag"))
        np.minimum(mag, b.abs_e, out=mag)
    else:
        mag = b.abs_e
    return mag if b.scale is None else np.maximum(mag, b.scale, out=b.scratch("mag"))


def _floor(b: Block) -> np.ndarray:
    """The magnitude, at least ``small_value``: the denominator of relative errors.  Symmetric
    without a scale (compare's case) in one buffer, ``|a|`` taking the minimum and the floor in
    place: two passes more than ``|e|``'s, no more arrays."""
    small = _limit("small_value", b.dtype)
    if b.symmetric and b.scale is None and "mag" not in b.__dict__:
        out = np.abs(b.a, out=b.scratch("floor"))
        np.minimum(out, b.abs_e, out=out)
        return np.maximum(out, _WORK.filled(small, b.n), out=out)
    return np.maximum(b.mag, _WORK.filled(small, b.n), out=b.scratch("floor"))


class _Screen:
    """The inf/nan screen of :func:`compare_arrays`: counts mismatching non-finite elements
    (same positions, same kind: nan, +inf, -inf) and hands on the finite pairs."""

    def __init__(self, dtype: str, size: int, symmetric: bool = False):
        self.dtype, self.size, self.n, self.mismatch, self.symmetric = dtype, size, 0, 0, symmetric

    def block(self, a: np.ndarray, e: np.ndarray, scale: np.ndarray | None = None) -> Block | None:
        # finite sums of squares (which cosine and rel_l2_err read anyway) mean finite elements: the
        # element-wise screen only where one is not (an inf/nan, or squares past the float range)
        ss_a, ss_e = _sumsq(a), _sumsq(e)
        if math.isfinite(ss_a) and math.isfinite(ss_e):
            if a.size == 0:
                return None
            self.n += a.size
            block = Block(a, e, self.dtype, scale, self.symmetric)
            block.ss_a, block.ss_e = ss_a, ss_e
            return block
        fin_a, fin_e = np.isfinite(a), np.isfinite(e)
        if not (fin_a.all() and fin_e.all()):
            special_a = np.where(fin_a, 0, np.where(np.isnan(a), 2, np.sign(a)))
            special_e = np.where(fin_e, 0, np.where(np.isnan(e), 2, np.sign(e)))
            self.mismatch += int(np.count_nonzero(special_a != special_e))
            both = fin_a & fin_e
            a, e = a[both], e[both]
            scale = None if scale is None else scale[both]
        if a.size == 0:
            return None
        self.n += a.size
        return Block(a, e, self.dtype, scale, self.symmetric)


def _sum(parts: list):
    """Sum of the blocks' partials (elementwise for tuples)."""
    return tuple(map(sum, zip(*parts))) if isinstance(parts[0], tuple) else sum(parts)


@dataclass(frozen=True)
class Metric:
    name: str
    column: str | None = None                     # run-ut / precision-compare CSV title
    block: Callable[[Block], Any] | None = None   # one block -> partial
    finish: Callable | None = None                # (total, screen) -> value; screen has n, size, mismatch
    combine: Callable = _sum                      # the blocks' partials (a list) -> total: _sum or max
    perfect: Any = 0.0                            # value of identical arrays, and with no finite pair
    empty: Callable | None = None                 # screen -> value with no finite pair (default: perfect)
    compare: float | None = None                  # position among compare's metric columns (None: not shown)
    larger_is_worse: bool = True                  # charts


METRICS: dict[str, Metric] = {}
_DERIVED: list = []


def register_metric(name: str, column: str | None = None, block=None, finish=None, **fields) -> Metric:
    """Add metric ``name`` (fields: see :class:`Metric`); tables derived from the registry follow.
    A value metric's ``finish`` defaults to the total itself.  A second metric of the same name is
    refused (:func:`unregister_metric` first to replace one)."""
    if name in METRICS:
        raise ValueError(f"register_metric: a metric named {name!r} is already registered")
    if block is not None and finish is None:
        finish = lambda total, screen: total   # noqa: E731
    METRICS[name] = metric = Metric(name, column, block, finish, **fields)
    _refresh()
    return metric


def unregister_metric(name: str) -> None:
    del METRICS[name]
    _refresh()


def derived(build: Callable[[], Any]):
    """The list, dict or set ``build()`` makes from the registry, rebuilt in place whenever a
    metric is (un)registered: module constants derived from it stay current."""
    value = build()
    _DERIVED.append((value, build))
    return value


def _refresh() -> None:
    _plan.cache_clear()
    for value, build in _DERIVED:
        new = build()
        if isinstance(value, list):
            value[:] = new
        else:
            value.clear()
            value.update(new)


def columns() -> dict[str, str]:
    """{CSV title: metric name} of the titled metrics, in registration order (run-ut's details)."""
    return {m.column: m.name for m in METRICS.values() if m.column}


def compare_columns() -> list[str]:
    """The metrics compare shows, in column order."""
    shown = [m for m in METRICS.values() if m.compare is not None]
    return [m.name for m in sorted(shown, key=lambda m: m.compare)]


@functools.lru_cache(maxsize=64)
def _plan(only: frozenset | None) -> tuple[list, list]:
    """(screen metrics, value metrics to compute) for ``only``."""
    return ([m for m in METRICS.values() if m.block is None and m.finish],
            [m for m in METRICS.values() if m.block and (only is None or m.name in only)])


def compare_arrays(actual, expected, dtype: str | None = None, only=None, scale=None,
                   symmetric: bool = False) -> dict[str, Any]:
    """The value metrics ``only`` (default: all) and the screen metrics of ``actual`` against
    ``expected`` (same size), judged by ``dtype``'s tolerance (default: the actual array's).

    Non-finite elements are left out of the value metrics and counted in ``inf_nan_mismatch``
    when the two sides disagree on them.  ``scale`` (same size, optional): a magnitude per element
    that relative and ULP errors are measured against when larger than ``|expected|`` (the
    magnitude an element was computed from, where its value cancelled).  ``symmetric``: neither
    side is the reference (compare's two runs): relative and ULP errors against the smaller of
    the two magnitudes, ``rel_l2_err`` against the smaller norm, so the metrics a verdict reads are
    the same with the arrays swapped (``mape`` stays relative to ``expected``).  Computed in
    cache-sized blocks (equal to whole-array passes up to rounding of the sums)."""
    dtype = short_dtype(dtype or getattr(actual, "dtype", "float32"))
    a_all = np.asarray(actual).reshape(-1)
    e_all = np.asarray(expected).reshape(-1)
    if a_all.size != e_all.size:
        raise ValueError(f"cannot compare {a_all.size} elements with {e_all.size}")
    screened, active = _plan(None if only is None else frozenset(only))
    wide = np.complex128 if np.iscomplexobj(a_all) or np.iscomplexobj(e_all) else np.float64
    s_all = None if scale is None else np.nan_to_num(np.abs(np.asarray(scale)).astype(np.float64).reshape(-1),
                                                     nan=0.0, posinf=0.0)
    rows = []                         # per block: each active metric's partial
    screen = _Screen(dtype, a_all.size, symmetric)
    with _one_blas_thread:
        for start in range(0, a_all.size, _BLOCK):
            block = screen.block(_widened(a_all[start:start + _BLOCK], "a", wide),
                                 _widened(e_all[start:start + _BLOCK], "e", wide),
                                 None if s_all is None else s_all[start:start + _BLOCK])
            if block is not None:
                rows.append([_detached(m.block(block)) for m in active])
                del block                 # free its terms before the next block's
    out = {m.name: m.finish(None, screen) for m in screened}
    if not rows:
        out.update((m.name, m.empty(screen) if m.empty else m.perfect) for m in active)
        return out
    totals = rows[0] if len(rows) == 1 else [m.combine(list(p)) for m, p in zip(active, zip(*rows))]
    for m, total in zip(active, totals):
        out[m.name] = m.finish(total, screen)
    return out


class _OneBlasThread:
    """numpy's BLAS limited to one thread while any thread computes metrics (restored after the
    last).  Why: a block's sums of squares and inner products are BLAS dots, which OpenBLAS splits
    over every core above 10,000 elements; each core's share is summed apart, so the metrics'
    last digits depended on the machine's core count, and on a busy machine (or under ``-j``)
    each split dot waited on its threads: milliseconds a dot instead of microseconds (the tensor
    compare of a transformer step took 10-60 s instead of 2-3).  One thread: the same sums on any
    core count."""

    def __init__(self):
        self.lock, self.users, self.limit = threading.Lock(), 0, None

    def __enter__(self):
        with self.lock:
            if self.users == 0:
                with _any_thread_may_set():
                    self.limit = _blas_controller().limit(limits=1, user_api="blas")
            self.users += 1

    def __exit__(self, *exc):
        with self.lock:
            self.users -= 1
            if self.users == 0:
                with _any_thread_may_set():
                    self.limit.restore_original_limits()
                self.limit = None


@functools.cache
def _blas_controller():
    """threadpoolctl's view of the loaded BLAS libraries (found once: a look costs ~1 ms)."""
    from threadpoolctl import ThreadpoolController
    return ThreadpoolController()


@contextlib.contextmanager
def _any_thread_may_set():
    """threadpoolctl (3.6+) lets only the first thread that set OpenBLAS's threads set them again,
    the others silently doing nothing; the first and the last thread computing metrics may differ
    (``DISPATCHPROBE_THREADS``), so no thread keeps that right past one set (they take turns under
    :class:`_OneBlasThread`'s lock)."""
    from threadpoolctl import OpenBLASController
    clear = getattr(OpenBLASController, "clear_controlling_thread", None)
    if clear is not None:
        clear(force=True)
    try:
        yield
    finally:
        if clear is not None:
            clear(force=True)


_one_blas_thread = _OneBlasThread()


def _detached(partial):
    """A block's partial that does not point into the scratch arrays the next block overwrites: a
    metric that returns a term itself (an array partial) gets a copy of it."""
    if isinstance(partial, tuple):
        return tuple(map(_detached, partial))
    if isinstance(partial, np.ndarray) and any(np.may_share_memory(partial, w) for w in _WORK.arrays.values()):
        return partial.copy()
    return partial


def _widened(part: np.ndarray, name: str, wide) -> np.ndarray:
    """A block of one side in the ``wide`` dtype: itself where it has that dtype, else cast into the
    side's scratch array (``np.asarray(part, dtype=wide)``'s values, no allocation per block)."""
    if part.dtype == wide:
        return part
    out = _WORK.view(name, wide, part.size)
    np.copyto(out, part, casting="unsafe")
    return out


def _mean(total, screen):
    return total / screen.n


def _rate(total, screen):
    """(count, out of) -> count / out of, 0 when out of nothing."""
    return total[0] / total[1] if total[1] else 0.0


def _cosine(total, screen) -> float:
    """Two all-zero vectors are identical (1.0), one all-zero is nan."""
    dot, ss_a, ss_e = total
    na, ne = math.sqrt(ss_a), math.sqrt(ss_e)
    if na == 0 and ne == 0:
        return 1.0
    return math.nan if na == 0 or ne == 0 else max(-1.0, min(1.0, dot / (na * ne)))


def _mape(b: Block):
    if np.count_nonzero(b.e) == b.n:       # no zero to leave out (one pass, no mask)
        return float(np.sum(np.divide(b.abs_err, b.abs_e, out=b.scratch("mape")))), b.n
    nonzero = b.e != 0
    k = int(np.count_nonzero(nonzero))
    return (float(np.sum(b.abs_err[nonzero] / b.abs_e[nonzero])) if k else 0.0), k


def _small_errors(b: Block):
    """Small expected values (below ``small_value``) judged by absolute error."""
    bad = int(np.count_nonzero(b.abs_err[b.small] > _limit("small_value_atol", b.dtype))) if b.n_small else 0
    return bad, b.n_small


def _normal_errors(b: Block):
    """The other values judged by relative error against the free-benchmark threshold."""
    return int(np.count_nonzero(b.rel[~b.small] > _limit("free_benchmark_threshold", b.dtype))), b.n - b.n_small


def _rel_l2(total, screen) -> float:
    """||a - e|| / ||e||: the scale-free error of the whole tensor (symmetric: over the smaller norm)."""
    ss_diff, ss_e, ss_a = total
    ss = min(ss_e, ss_a) if screen.symmetric else ss_e
    return math.sqrt(ss_diff / ss) if ss > 0 else (0.0 if ss_diff == 0 else math.inf)


# ---- the metrics, in run-ut's column order ---------------------------------------------------
register_metric("elements", finish=lambda _, s: int(s.size), perfect=0)
register_metric("inf_nan_mismatch", finish=lambda _, s: s.mismatch, perfect=0, compare=8)
register_metric("cosine", "Cosine", lambda b: (_inner(b.a, b.e), b.ss_a, b.ss_e), _cosine,
                perfect=1.0, empty=lambda s: 1.0 if s.mismatch == 0 else math.nan, compare=1, larger_is_worse=False)
register_metric("max_abs_err", "Max Abs Err", lambda b: float(b.abs_err.max()), combine=max, compare=2)
# untitled, so free to go first: its temporary is gone before the relative-error terms are made
register_metric("mape", block=_mape, finish=_rate, compare=5)
for _name, _title, _tol, _rank in (("one_hundredth", "One Hundredth", 1e-2, None),
                                   ("one_thousandth", "One Thousandth", 1e-3, 6),
                                   ("one_ten_thousandth", "One Ten Thousandth", 1e-4, 7)):
    # the share of elements whose relative error is within the tolerance
    register_metric(_name, _title, lambda b, tol=_tol: int(np.count_nonzero(
                        np.less_equal(b.rel, tol, out=b.scratch("within", bool)))), _mean, perfect=1.0,
                    compare=_rank, larger_is_worse=False)
register_metric("binary_mismatch", "Binary Mismatch Rate")
# the mean *signed* relative error: a bias that rounding should not have
register_metric("error_balance", "Error Balance",
                lambda b: np.sum(np.divide(b.diff, b.floor, out=b.scratch("balance", b.diff.dtype))).item(),
                lambda t, s: abs(t / s.n))
register_metric("rmse", "RMSE", lambda b: b.ss_diff, lambda t, s: math.sqrt(t / s.n), compare=4)
register_metric("small_value_error_rate", "Small Value Error Rate", _small_errors, _rate)
register_metric("max_rel_err", "Max Rel Err", lambda b: float(b.rel.max()), combine=max, compare=3)
register_metric("mean_rel_err", "Mean Rel Err", lambda b: float(b.rel.sum()), _mean)
register_metric("inf_nan_error_rate", "Inf/Nan Error Rate", finish=lambda _, s: s.mismatch / s.size if s.size else 0.0)
register_metric("rel_err_error_rate", "Rel Err Error Rate", _normal_errors, _rate)
register_metric("abs_err_error_rate", "Abs Err Error Rate")
register_metric("ulp_max", "ULP Max", lambda b: float(b.ulp.max()), combine=max)
register_metric("ulp_mean", "ULP Mean", lambda b: float(b.ulp.sum()), _mean)
register_metric("ulp_over_threshold", "ULP Over Threshold",
                lambda b: int(np.count_nonzero(b.ulp > _limit("ulp_threshold", b.dtype))), _mean)
# elements pointing the other way: opposite signs (complex: more than 90 degrees apart)
register_metric("sign_flips", block=lambda b: int(np.count_nonzero(
    (b.a * np.conj(b.e)).real < 0 if np.iscomplexobj(b.a) else np.sign(b.a) * np.sign(b.e) < 0)), perfect=0)
register_metric("rel_l2_err", block=lambda b: (b.ss_diff, b.ss_e, b.ss_a if b.symmetric else 0.0), finish=_rel_l2,
                compare=9)


def binary_mismatch(actual, expected) -> float:
    """Fraction of elements that are not bit-for-bit equal (integer, bool, index outputs)."""
    a, e = np.asarray(actual).reshape(-1), np.asarray(expected).reshape(-1)
    if a.size != e.size:
        return 1.0
    if a.size == 0:
        return 0.0
    same = (a == e) | (np.isnan(a) & np.isnan(e)) if a.dtype.kind in "fc" else (a == e)
    return float(np.count_nonzero(~same) / a.size)


# ---- free benchmark ----------------------------------------------------------------------------
def perturbation_change(actual, expected, dtype: str) -> dict[str, Any]:
    """:func:`perturbation_terms` of numpy arrays, as Python numbers (the tests' reference)."""
    a = np.asarray(actual, dtype=np.float64).reshape(-1)
    e = np.asarray(expected, dtype=np.float64).reshape(-1)
    max_rel, flips = perturbation_terms(a, e, per_dtype("small_value", dtype), np)
    return {"max_rel": float(max_rel), "sign_flips": int(flips)}


class WholeArray:
    """The reductions of :func:`perturbation_terms` over the whole flat array (a segmented one,
    ``torch.perturb.Segments``, measures many concatenated arrays at once)."""

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
    """(max_rel, sign_flips) of the flat arrays ``a`` (re-run) and ``e`` (reference) in the
    namespace ``xp`` (numpy, or torch on the accelerator), with no data-dependent branch (no host
    sync).  ``reduce`` (default :class:`WholeArray`) says what is reduced together.

    ``max_rel``: the largest ``|a - e| / max(|e|, floor)``, ``floor = max(small, rms(e))``: an
    element far below the tensor's typical magnitude (a dot product whose terms cancel) is judged
    against that magnitude, while an op whose *whole* output lost its digits still shows the loss
    in full.  inf when the inf/nan patterns differ.  ``sign_flips``: elements above ``small``
    whose sign changed."""
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
