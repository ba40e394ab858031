"""The Triton kernels of :mod:`.device_stats` (imported on first use: importing Triton takes a
while, and CPU-only torch has none): one tensor's chunks (``reduce_stats``), or the chunks a
table lists of many values copied into one buffer (``reduce_table``, :mod:`.device_batch`)."""

import triton
import triton.language as tl


@triton.jit
def _fold(x):
    # a block of 16 rows x 64 lanes: rows added by halving (row r + row r + 8, then r + 4, ...),
    # then lanes down to 16 (lane j + lane j + 32, then j + 16): statistics.tree_sums' block
    x = tl.sum(tl.reshape(x, [2, 8, 64]), axis=0)
    x = tl.sum(tl.reshape(x, [2, 4, 64]), axis=0)
    x = tl.sum(tl.reshape(x, [2, 2, 64]), axis=0)
    x = tl.reshape(tl.sum(tl.reshape(x, [2, 1, 64]), axis=0), [64])
    x = tl.sum(tl.reshape(x, [2, 32]), axis=0)
    return tl.sum(tl.reshape(x, [2, 16]), axis=0)


@triton.jit
def _chunk(blocks):
    # a chunk's 32 blocks of 16 float64 lanes: blocks added by halving, then the lanes
    x = tl.sum(tl.reshape(blocks, [2, 16, 16]), axis=0)
    x = tl.sum(tl.reshape(x, [2, 8, 16]), axis=0)
    x = tl.sum(tl.reshape(x, [2, 4, 16]), axis=0)
    x = tl.sum(tl.reshape(x, [2, 2, 16]), axis=0)
    x = tl.reshape(tl.sum(tl.reshape(x, [2, 1, 16]), axis=0), [16])
    x = tl.sum(tl.reshape(x, [2, 8]), axis=0)
    x = tl.sum(tl.reshape(x, [2, 4]), axis=0)
    x = tl.sum(tl.reshape(x, [2, 2]), axis=0)
    return tl.sum(x, axis=0)


@triton.jit
def _reduce(x_ptr, out, start, count, repeat, WIDE: tl.constexpr):
    # one chunk of 32 blocks of 16 x 64 values (statistics.tree_sums) from x_ptr + start, count of
    # them (a chunk's 32768 at most): a partial row (statistics.PARTIAL_FIELDS) at out of max and
    # min without nan, finite max and min, the sums in the lanes' type (float32; float64 for
    # float64 values: WIDE), nan and inf counts, the sums in float64 lanes, the repeat.  Launched
    # without fused multiply-adds: squares are rounded first.
    at = tl.arange(0, 16)[:, None] * 64 + tl.arange(0, 64)[None, :]
    index = tl.arange(0, 32)[:, None]
    hi = tl.full([16, 64], float("-inf"), tl.float64)
    lo = tl.full([16, 64], float("inf"), tl.float64)
    fhi = tl.full([16, 64], float("-inf"), tl.float64)
    flo = tl.full([16, 64], float("inf"), tl.float64)
    nan = tl.zeros([16, 64], tl.float64)
    inf = tl.zeros([16, 64], tl.float64)
    sums = tl.zeros([32, 16], tl.float64)
    squares = tl.zeros([32, 16], tl.float64)
    wide_sums = tl.zeros([32, 16], tl.float64)
    wide_squares = tl.zeros([32, 16], tl.float64)
    for b in range(0, 32):
        local = b * 1024 + at
        inside = local < count
        raw = tl.load(x_ptr + start + local, mask=inside, other=0.0)
        v = raw.to(tl.float64)
        is_nan = v != v
        is_inf = tl.abs(v) == float("inf")
        finite = inside & ~is_nan & ~is_inf
        keep = inside & ~is_nan
        hi = tl.maximum(hi, tl.where(keep, v, float("-inf")))
        lo = tl.minimum(lo, tl.where(keep, v, float("inf")))
        fhi = tl.maximum(fhi, tl.where(finite, v, float("-inf")))
        flo = tl.minimum(flo, tl.where(finite, v, float("inf")))
        nan += tl.where(inside & is_nan, 1.0, 0.0)
        inf += tl.where(inside & is_inf, 1.0, 0.0)
        if WIDE:
            lane = v
        else:
            lane = raw.to(tl.float32)
        here = index == b
        sums = tl.where(here, _fold(lane).to(tl.float64)[None, :], sums)
        squares = tl.where(here, _fold(lane * lane).to(tl.float64)[None, :], squares)
        wide_sums = tl.where(here, _fold(v)[None, :], wide_sums)
        wide_squares = tl.where(here, _fold(v * v)[None, :], wide_squares)
    tl.store(out + 0, tl.max(tl.max(hi, 1), 0))
    tl.store(out + 1, tl.min(tl.min(lo, 1), 0))
    tl.store(out + 2, tl.max(tl.max(fhi, 1), 0))
    tl.store(out + 3, tl.min(tl.min(flo, 1), 0))
    tl.store(out + 4, _chunk(sums))
    tl.store(out + 5, _chunk(squares))
    tl.store(out + 6, tl.sum(tl.sum(nan, 1), 0))
    tl.store(out + 7, tl.sum(tl.sum(inf, 1), 0))
    tl.store(out + 8, _chunk(wide_sums))
    tl.store(out + 9, _chunk(wide_squares))
    tl.store(out + 10, repeat.to(tl.float64))


@triton.jit
def reduce_stats(x_ptr, out_ptr, n, repeat, WIDE: tl.constexpr):
    # one program per chunk of one tensor's n values
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * 32768
    _reduce(x_ptr, out_ptr + pid * 11, start, n - start, repeat, WIDE)


@triton.jit
def reduce_table(x_ptr, table_ptr, out_ptr, WIDE: tl.constexpr):
    # one program per row of the table (int64: start in x, values, repeat, output row): the chunks
    # of many values copied into one buffer, reduced in one launch
    row = table_ptr + tl.program_id(0).to(tl.int64) * 4
    start = tl.load(row)
    count = tl.load(row + 1)
    repeat = tl.load(row + 2)
    at = tl.load(row + 3)
    _reduce(x_ptr, out_ptr + at * 11, start, count, repeat, WIDE)
