"""The Triton kernels of :mod:`.device_stats` (imported on first use: importing Triton takes a
while, and CPU-only torch has none). Triton resolves a kernel's helpers as module globals, so
they live at module level here."""

import triton
import triton.language as tl


@triton.jit
def store_row(row_ptr, hi, lo, fhi, flo, total, sumsq, nan, inf):
    # torch's max/min propagate nan; with inf/nan and some finite values, the finite max and
    # min take the sum and norm slots (statistics.from_row derives mean and norm from the rest)
    some_nan = nan > 0
    carry_finite = (nan + inf > 0) & (fhi >= flo)
    tl.store(row_ptr + 0, tl.where(some_nan, float("nan"), hi))
    tl.store(row_ptr + 1, tl.where(some_nan, float("nan"), lo))
    tl.store(row_ptr + 2, tl.where(carry_finite, fhi, total))
    tl.store(row_ptr + 3, tl.where(carry_finite, flo, tl.sqrt(sumsq)))
    tl.store(row_ptr + 4, nan)
    tl.store(row_ptr + 5, inf)

@triton.jit
def reduce_stats(x_ptr, out_ptr, n, chunk, BLOCK: tl.constexpr, FINAL: tl.constexpr):
    # elements [pid*chunk, min(n, (pid+1)*chunk)): max and min without nan (inf kept), finite
    # max and min, sum, sum of squares, nan and inf counts; FINAL (one program): the row itself
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
    if FINAL:
        store_row(out_ptr, tl.max(hi, 0), tl.min(lo, 0), tl.max(fhi, 0), tl.min(flo, 0),
                   tl.sum(total, 0), tl.sum(sumsq, 0), tl.sum(nan, 0), tl.sum(inf, 0))
    else:
        out = out_ptr + pid * 8
        tl.store(out + 0, tl.max(hi, 0))
        tl.store(out + 1, tl.min(lo, 0))
        tl.store(out + 2, tl.max(fhi, 0))
        tl.store(out + 3, tl.min(flo, 0))
        tl.store(out + 4, tl.sum(total, 0))
        tl.store(out + 5, tl.sum(sumsq, 0))
        tl.store(out + 6, tl.sum(nan, 0))
        tl.store(out + 7, tl.sum(inf, 0))

@triton.jit
def finish_stats(part_ptr, row_ptr, parts, BLOCK: tl.constexpr):
    # combine the partials of a large tensor in one program, in a fixed order
    hi = tl.full([BLOCK], float("-inf"), tl.float64)
    lo = tl.full([BLOCK], float("inf"), tl.float64)
    fhi = tl.full([BLOCK], float("-inf"), tl.float64)
    flo = tl.full([BLOCK], float("inf"), tl.float64)
    total = tl.zeros([BLOCK], tl.float64)
    sumsq = tl.zeros([BLOCK], tl.float64)
    nan = tl.zeros([BLOCK], tl.float64)
    inf = tl.zeros([BLOCK], tl.float64)
    for s in range(0, parts, BLOCK):
        p = s + tl.arange(0, BLOCK)
        m = p < parts
        base = part_ptr + p * 8
        hi = tl.maximum(hi, tl.load(base + 0, mask=m, other=float("-inf")))
        lo = tl.minimum(lo, tl.load(base + 1, mask=m, other=float("inf")))
        fhi = tl.maximum(fhi, tl.load(base + 2, mask=m, other=float("-inf")))
        flo = tl.minimum(flo, tl.load(base + 3, mask=m, other=float("inf")))
        total += tl.load(base + 4, mask=m, other=0.0)
        sumsq += tl.load(base + 5, mask=m, other=0.0)
        nan += tl.load(base + 6, mask=m, other=0.0)
        inf += tl.load(base + 7, mask=m, other=0.0)
    store_row(row_ptr, tl.max(hi, 0), tl.min(lo, 0), tl.max(fhi, 0), tl.min(flo, 0),
               tl.sum(total, 0), tl.sum(sumsq, 0), tl.sum(nan, 0), tl.sum(inf, 0))
