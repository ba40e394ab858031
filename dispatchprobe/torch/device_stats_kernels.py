"""The Triton kernel of :mod:`.device_stats` (imported on first use: importing Triton takes a
while, and CPU-only torch has none)."""

import triton
import triton.language as tl


@triton.jit
def reduce_stats(x_ptr, out_ptr, n, chunk, BLOCK: tl.constexpr):
    # elements [pid*chunk, min(n, (pid+1)*chunk)): max and min without nan (inf kept), finite
    # max and min, sum, sum of squares, nan and inf counts: one partial row of 8 per program
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * chunk
    end = tl.minimum(start + chunk, n)
    hi = tl.full([BLOCK], float("-inf"), tl.float64)
    lo = tl.full([BLOCK], float("inf"), tl.float64)
    fhi = tl.full([BLOCK], float("-inf"), tl.float64)
    flo = tl.full([BLOCK], float("inf"), tl.float64)
    total = tl.zeros([BLOCK], tl.float64)
    sumsq = tl.zeros([BLOCK], tl.float64)
    nan = tl.zeros([BLOCK], tl.float64)
    inf = tl.zeros([BLOCK], tl.float64)
    for s in range(start, end, BLOCK):
        offs = s + tl.arange(0, BLOCK)
        inside = offs < end
        v = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float64)
        is_nan = v != v
        is_inf = tl.abs(v) == float("inf")
        finite = inside & ~is_nan & ~is_inf
        keep = inside & ~is_nan
        hi = tl.maximum(hi, tl.where(keep, v, float("-inf")))
        lo = tl.minimum(lo, tl.where(keep, v, float("inf")))
        fhi = tl.maximum(fhi, tl.where(finite, v, float("-inf")))
        flo = tl.minimum(flo, tl.where(finite, v, float("inf")))
        total += v
        sumsq += v * v
        nan += tl.where(inside & is_nan, 1.0, 0.0)
        inf += tl.where(inside & is_inf, 1.0, 0.0)
    out = out_ptr + pid * 8
    tl.store(out + 0, tl.max(hi, 0))
    tl.store(out + 1, tl.min(lo, 0))
    tl.store(out + 2, tl.max(fhi, 0))
    tl.store(out + 3, tl.min(flo, 0))
    tl.store(out + 4, tl.sum(total, 0))
    tl.store(out + 5, tl.sum(sumsq, 0))
    tl.store(out + 6, tl.sum(nan, 0))
    tl.store(out + 7, tl.sum(inf, 0))
