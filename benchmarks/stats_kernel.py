"""The CPU statistics of one tensor: the one-pass kernel (``dispatchprobe.torch.fused_stats``)
against torch's reductions for the same record and a plain ``torch.sum``, per tensor size and
dtype, with the tensor in cache (just written, as an op's output is when the probe reads it).
Then the library's own call (``fused_stats.rows``, and a compiled window's
``window_row_lists``) in the calling thread's CPU time, from 32 tiny tensors to 4 MB, against
torch's aminmax + sum + dot of the same values.

    python benchmarks/stats_kernel.py [--threads N]
"""

from __future__ import annotations

import argparse
import time
import timeit

import torch

from dispatchprobe.torch import tensor_backend as backend, fused_stats

SIZES = [16_384, 131_072, 1_048_576, 4_194_304]
LIBRARY_VALUES = [1024, 16_384, 262_144, 1_048_576]        # 4 KB to 4 MB of float32


def per_call_us(fn, n: int) -> float:
    reps = max(20, int(2e7 // n))
    return min(timeit.repeat(fn, number=reps, repeat=5)) / reps * 1e6


def thread_us(fn, values: int) -> float:
    """Best of 5 of the calling thread's CPU time per call (OpenMP workers not counted)."""
    reps = max(20, int(2e6 // max(values, 1)))
    best = float("inf")
    for _ in range(5):
        start = time.thread_time()
        for _ in range(reps):
            fn()
        best = min(best, (time.thread_time() - start) / reps)
    return best * 1e6


def three_reductions(xs: list) -> None:
    """torch's aminmax, sum and dot (float32) of each tensor: the reference the library replaces."""
    for x in xs:
        flat = x.reshape(-1).float()
        flat.aminmax(), flat.sum(), flat.dot(flat)


def library_table() -> None:
    print("\nthe library's call, calling thread's CPU time, µs per call, best of 5")
    print("| dtype | values | fused_stats.rows | window_row_lists | aminmax + sum + dot |")
    print("| --- | --- | --- | --- | --- |")
    from dispatchprobe.standards import statistics
    for dtype in (torch.float32, torch.bfloat16):
        cases = [("32 tensors of 32", [torch.randn(8, 4).to(dtype) for _ in range(32)])]
        cases += [(f"{n:,}", [torch.randn(n).to(dtype)]) for n in LIBRARY_VALUES]
        for label, xs in cases:
            values = sum(x.numel() for x in xs)
            lib = thread_us(lambda: fused_stats.rows(xs), values)
            window = thread_us(lambda: fused_stats.window_row_lists(xs, statistics.nonfinite_row), values)
            ref = thread_us(lambda: three_reductions(xs), values)
            print(f"| {str(dtype).removeprefix('torch.')} | {label} | {lib:.1f} | {window:.1f} | {ref:.1f} |")


def torch_reductions(x: torch.Tensor) -> dict:
    """The record from torch's reductions (what the probe uses without the kernel)."""
    kernel = fused_stats.tree_rows
    fused_stats.tree_rows = None           # what the probe reads the library by
    try:
        return backend._cpu_stats(x)
    finally:
        fused_stats.tree_rows = kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    fused_stats.build_native()
    if fused_stats.stats4 is None:
        raise SystemExit(f"the one-pass kernel is not available: {fused_stats.error}")
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads; "
          "µs per tensor, best of 5")
    print("| dtype | values | torch's reductions | one-pass kernel | torch.sum |")
    print("| --- | --- | --- | --- | --- |")
    for dtype in (torch.float32, torch.bfloat16):
        for n in SIZES:
            x = torch.randn(n).to(dtype)
            three = per_call_us(lambda: torch_reductions(x), n)
            one = per_call_us(lambda: backend._cpu_stats(x), n)
            total = per_call_us(lambda: x.sum(), n)
            print(f"| {str(dtype).removeprefix('torch.')} | {n:,} | {three:.1f} | {one:.1f} | {total:.1f} |")
    library_table()


if __name__ == "__main__":
    main()
