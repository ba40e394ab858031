"""Record statistics, once for every framework, against an array namespace
``xp`` (numpy or torch): :func:`record`, or a backend's own reductions completed by :func:`finish`
or :func:`from_row`; and how compare compares them.

Sums and sums of squares follow one summation order, :func:`tree_sums`, on every path (this
module's numpy and torch code, the torch adapter's native library and device kernels), so equal
values give equal records, bit for bit, whichever path measured them."""

from __future__ import annotations

import functools
import math

import numpy as np

from .loader import per_dtype
from .verdicts import ERROR, PASS, WARNING

KEYS = ("max", "min", "mean", "norm")   # besides the "nan"/"inf" counts (and finite_max/finite_min)
_KEEP = ("float32", "float64", "float16", "bfloat16")


@functools.lru_cache(maxsize=None)
def _plan(dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name.startswith("complex"):
        return "abs"
    return "keep" if name in _KEEP else "float32" if name.startswith("float") or name == "bool" else "float64"


def source_plan(dtype) -> str:
    """How :func:`source` takes values of ``dtype`` (a dtype or its name): ``"keep"`` (the four
    float dtypes as they are), ``"abs"`` (complex), or the dtype name they are converted to
    (``"float32"``, ``"float64"``): a device path that copies values to reduce them later converts
    them in the copy."""
    return _plan(dtype)


def source(x, xp):
    """The values statistics are taken of: ``|x|`` for complex; half and single floats as they
    are (accumulated in float32, far cheaper than float64 on CPU); other floats and bool as
    float32; integers as float64 (exact below 2**53)."""
    plan = _plan(x.dtype)
    if plan == "keep":
        return x
    if plan == "abs":
        return source(xp.abs(x), xp)
    return xp.asarray(x, dtype=getattr(xp, plan))


def accumulator(x, xp):
    """The dtype sums and norms of :func:`source` values are accumulated in."""
    return xp.float64 if x.dtype == xp.float64 else xp.float32


# The summation order (:func:`tree_sums`): a block is ROWS x LANES values, a chunk CHUNK_BLOCKS blocks.
ROWS, LANES, FOLDED_LANES, CHUNK_BLOCKS = 16, 64, 16, 32


def _zeros(like, shape, dtype, xp):
    return like.new_zeros(shape, dtype=dtype) if hasattr(like, "new_zeros") else xp.zeros(shape, dtype=dtype)


def _halve(x, axis: int, size: int):
    """Pairwise halving along ``axis`` of length ``size`` (a power of two) down to one: element
    ``i`` is added to element ``i + size/2``, then again on the first half, ..."""
    lead = (slice(None),) * axis
    while size > 1:
        size //= 2
        x = x[lead + (slice(0, size),)] + x[lead + (slice(size, 2 * size),)]
    return x[lead + (0,)]


def halve(x, axis: int, size: int):
    """:func:`tree_sums`' pairwise halving along ``axis`` (a device path summing many values' blocks
    at once follows it step by step)."""
    return _halve(x, axis, size)


def tree_sums(seq, xp, wide: bool = False):
    """``[sum, sum of squares]`` of the 1-D sequence ``seq`` as a float64 array of 2 on its device,
    in one order every path follows, so that equal values give equal bits anywhere:

    - lanes are float32 (float64 for float64 values or with ``wide``); squares are rounded to the
      lane type before they are added (never fused into the sum);
    - the sequence, padded with zeros, is cut in blocks of ROWS x LANES values (row-major); each
      block's rows are added by pairwise halving (row ``r`` + row ``r + 8``, then ``r + 4``, ...),
      then its lanes the same way down to FOLDED_LANES, which are widened to float64;
    - blocks are grouped in chunks of CHUNK_BLOCKS, added by halving within the chunk, then the
      chunk's FOLDED_LANES lanes by halving, then the chunks by halving (padded with zeros to a
      power of two);
    - a zero result is +0.0.
    Adding a padding zero never changes a value (up to the sign of a zero), so a kernel may skip
    them; any split of the chunks among threads gives the same result."""
    n = seq.shape[0]
    lane = xp.float64 if wide or seq.dtype == xp.float64 else xp.float32
    v = xp.asarray(seq, dtype=lane)
    block = ROWS * LANES
    blocks = max(1, -(-n // block))
    x = _zeros(v, (2, blocks * block), lane, xp)
    x[0, :n] = v
    x[1, :n] = v * v
    x = _halve(x.reshape(2, blocks, ROWS, LANES), 2, ROWS)                 # (2, blocks, LANES)
    while x.shape[-1] > FOLDED_LANES:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    x = xp.asarray(x, dtype=xp.float64)                                     # (2, blocks, FOLDED_LANES)
    chunks = -(-blocks // CHUNK_BLOCKS)
    y = _zeros(x, (2, chunks * CHUNK_BLOCKS, FOLDED_LANES), xp.float64, xp)
    y[:, :blocks] = x
    y = _halve(y.reshape(2, chunks, CHUNK_BLOCKS, FOLDED_LANES), 2, CHUNK_BLOCKS)
    y = _halve(y, 2, FOLDED_LANES)                                          # (2, chunks)
    width = 1 << (chunks - 1).bit_length()
    if width != chunks:
        z = _zeros(y, (2, width), xp.float64, xp)
        z[:, :chunks] = y
        y = z
    return _halve(y, 1, width) + 0.0


def sums(seq, xp, wide: bool = False) -> tuple[float, float]:
    """:func:`tree_sums` as Python floats (inf and nan where the lanes overflowed or met them)."""
    with np.errstate(over="ignore", invalid="ignore"):
        total, squares = (float(v) for v in tree_sums(seq, xp, wide).tolist())
    return total, squares


def record(x, xp) -> dict | None:
    """The statistics record of array ``x`` (None when it is empty): its values in C order."""
    x = source(x, xp)
    if math.prod(x.shape) == 0:
        return None
    flat = x.reshape(-1)
    total, squares = sums(flat, xp)
    return finish(flat, [float(x.max()), float(x.min()), total, math.sqrt(squares)], xp)


def finite_record(hi: float, lo: float, total: float, norm: float, n: int) -> dict:
    """The record of ``n`` values whose max, min, sum and L2 norm are finite: what :func:`finish`
    gives them, callable without the values (from a kernel's numbers).  A zero max or min is +0.0
    (which of +0.0 and -0.0 a reduction keeps depends on its order)."""
    return {"max": hi + 0.0, "min": lo + 0.0, "mean": total / n, "norm": norm, "nan": 0, "inf": 0}


def finish(x, values, xp, repeat: int = 1) -> dict:
    """The record from (max, min, sum, L2 norm) of :func:`source` values ``x`` (a 1-D sequence in
    :func:`tree_sums` order, each value standing for ``repeat`` equal ones: an expanded tensor's),
    completing the rare non-finite cases."""
    hi, lo, total, norm = values
    if math.isfinite(hi) and math.isfinite(lo) and not (math.isfinite(norm) and math.isfinite(total)):
        # float32 lanes of finite values that overflowed (attention masks at finfo.min): float64 lanes
        wide_total, wide_squares = sums(x.reshape(-1), xp, wide=True)
        if not math.isfinite(norm):
            norm = math.sqrt(wide_squares * repeat)
        if not math.isfinite(total):
            total = wide_total * repeat
    stats = finite_record(hi, lo, total, norm, math.prod(x.shape) * repeat)
    if not (math.isfinite(hi) and math.isfinite(lo) and math.isfinite(total)):
        # count exactly, and give max/min over the finite values so they still mean something
        stats.update(nan=int(xp.isnan(x).sum()) * repeat, inf=int(xp.isinf(x).sum()) * repeat)
        finite = x[xp.isfinite(x)]
        if finite.shape[0]:
            stats["finite_max"], stats["finite_min"] = float(finite.max()) + 0.0, float(finite.min()) + 0.0
    return stats


def from_row(row, n: int) -> dict:
    """The record from a device row (max, min, sum, L2 norm, nan count, inf count) of ``n`` elements.

    A row of values holding inf/nan may carry their finite max and min in its sum and norm slots,
    which are then finite (a true sum or norm of such values never is): those are derived from the
    other fields, so the record is the one :func:`finish` gives the values, with ``finite_max`` and
    ``finite_min``, without a second pass over them."""
    hi, lo, total, norm, nan, inf = row
    stats = {"max": hi + 0.0, "min": lo + 0.0, "mean": total / n, "norm": norm, "nan": int(nan), "inf": int(inf)}
    if nan or inf:
        if math.isfinite(total) and math.isfinite(norm):
            stats["finite_max"], stats["finite_min"] = total + 0.0, norm + 0.0
            stats["mean"] = math.nan if nan or (hi == math.inf and lo == -math.inf) else hi if math.isinf(hi) else lo
            stats["norm"] = math.nan if nan else math.inf
    elif not math.isfinite(total):       # finite values whose sum overflowed, as finish gives them
        stats["finite_max"], stats["finite_min"] = hi + 0.0, lo + 0.0
    return stats


def nonfinite_row(total: float, squares: float, nan: int, inf: int, hi: float, lo: float, fhi: float,
                  flo: float) -> list:
    """The :func:`from_row` row of values holding inf or nan, from their sums, counts, max and min
    without nan (``hi``, ``lo``) and finite max and min (what a one-pass kernel gathers): max and
    min are nan where any value is, and the finite max and min, where there are finite values,
    take the sum and norm slots."""
    carry = fhi >= flo
    return [math.nan if nan else hi, math.nan if nan else lo, fhi if carry else total,
            flo if carry else math.sqrt(squares), nan, inf]


def nonfinite_record(total: float, squares: float, nan: int, inf: int, hi: float, lo: float, fhi: float,
                     flo: float, n: int) -> dict:
    """The record of ``n`` values holding inf or nan from what a one-pass kernel gathers of them
    (:func:`nonfinite_row`'s arguments): what :func:`finish` gives them, without their values."""
    return from_row(nonfinite_row(total, squares, nan, inf, hi, lo, fhi, flo), n)


# A partial row: what a device kernel gives of one chunk (statistics.tree_sums' CHUNK_BLOCKS
# blocks) of a tensor's values in memory order, each standing for `repeat` elements.
PARTIAL_FIELDS = ("max", "min", "finite_max", "finite_min", "sum", "squares", "nan", "inf", "wide_sum",
                  "wide_squares", "repeat")


def _halved(values: list) -> float:
    """The chunks' sums added by halving, padded with zeros to a power of two (tree_sums' last step)."""
    width = 1 << (len(values) - 1).bit_length()
    v = values + [0.0] * (width - len(values))
    while width > 1:
        width //= 2
        v = [v[i] + v[i + width] for i in range(width)]
    return v[0] + 0.0


def row_from_partials(parts: list) -> list:
    """The :func:`from_row` row of values reduced a chunk at a time, from each chunk's partial row
    (:data:`PARTIAL_FIELDS`: max and min without nan, finite max and min, the sums in float32
    lanes, nan and inf counts, the sums in float64 lanes, the repeat), in chunk order: the row
    the CPU paths give the same values (a float32 lane sum of finite values that overflowed is
    taken from the float64 lanes, as :func:`finish` does)."""
    hi, lo, fhi, flo = -math.inf, math.inf, -math.inf, math.inf
    nan = inf = 0
    repeat = int(parts[0][10])
    for p in parts:
        hi, lo, fhi, flo = max(hi, p[0]), min(lo, p[1]), max(fhi, p[2]), min(flo, p[3])
        nan += int(p[6])
        inf += int(p[7])
    with np.errstate(over="ignore", invalid="ignore"):
        total, squares = (_halved([p[k] for p in parts]) * repeat for k in (4, 5))
    nan, inf = nan * repeat, inf * repeat
    if nan or inf:
        return nonfinite_row(total, squares, nan, inf, hi, lo, fhi, flo)
    if not math.isfinite(total):
        total = _halved([p[8] for p in parts]) * repeat
    if not math.isfinite(squares):
        squares = _halved([p[9] for p in parts]) * repeat
    return [hi, lo, total, math.sqrt(squares), 0, 0]


def to_row(stats: dict, n: int) -> list:
    """The device row of a record, in :func:`from_row`'s layout (``from_row(to_row(s, n), n) == s``)."""
    nan, inf = stats["nan"], stats["inf"]
    if (nan or inf) and "finite_max" in stats:
        return [stats["max"], stats["min"], stats["finite_max"], stats["finite_min"], nan, inf]
    return [stats["max"], stats["min"], stats["mean"] * n, stats["norm"], nan, inf]


# ---- compare: statistics-only rows, whole columns at once -------------------------------------------
def compare_stats_columns(actual: dict, expected: dict) -> dict:
    """``{key}_diff`` (a - b) and ``{key}_rel_diff`` of each statistic over whole columns (nan: absent)."""
    out = {}
    with np.errstate(divide="ignore", invalid="ignore"):
        for key in KEYS:
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
    """One relative error per row: the largest of the norm's relative difference and the max/min/mean
    differences over the expected magnitude ``max(|max|, |min|)`` (so a near-zero mean cannot make a huge one)."""
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
        err = np.fmax.reduce(np.vstack(parts), axis=0)     # nanmax without its warning on all-nan rows
    return np.nan_to_num(err, nan=0.0, posinf=np.inf)


def judge_stats_columns(error: np.ndarray, dtypes, nonfinite_differs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Verdicts for statistics-only rows: nan/inf counts differ -> error; else :func:`stats_error`
    against the dtype's ``pass``/``error`` limits in ``compare_standards.yaml``."""
    codes, uniques = factorize(np.asarray(dtypes, dtype=object))   # look up each distinct dtype once
    pass_lim, err_lim = (np.array([per_dtype(f"statistics.{k}", d, "compare_standards") for d in uniques],
                                  dtype=np.float64)[codes] for k in ("pass", "error"))
    error = np.asarray(error, dtype=np.float64)
    # 0 pass, 1 warning, 2 error; each row's verdict one of the three shared strings (a long run's
    # table holds a row per tensor: no string of its own per row)
    level = np.where(nonfinite_differs, 2, np.where(error > err_lim, 2, np.where(error > pass_lim, 1, 0)))
    verdict = np.array([PASS, WARNING, ERROR], dtype=object)[level]
    nonfinite = np.broadcast_to(np.asarray(nonfinite_differs, dtype=bool), level.shape)
    reason = np.array(["", "nan/inf counts differ"], dtype=object)[nonfinite.astype(np.intp)]
    moved = np.flatnonzero((level != 0) & ~nonfinite)
    if len(moved):   # the limit crossed (the error itself is the stats_err column), per distinct one
        crossed = codes[moved] * 2 + (level[moved] == 2)
        kinds, inverse = np.unique(crossed, return_inverse=True)
        texts = [f"statistics differ: error > {per_dtype(f'statistics.{kind}', uniques[c], 'compare_standards'):g} "
                 f"({uniques[c]})" for c, kind in ((k // 2, "error" if k % 2 else "pass") for k in kinds)]
        reason[moved] = np.array(texts, dtype=object)[inverse.reshape(-1)]
    return verdict, reason


def factorize(values) -> tuple[np.ndarray, list]:
    """(codes, distinct values) of a 1-D sequence, in order of first appearance."""
    uniques = list(dict.fromkeys(values))
    index = {v: i for i, v in enumerate(uniques)}
    return np.fromiter(map(index.__getitem__, values), dtype=np.int64, count=len(values)), uniques
