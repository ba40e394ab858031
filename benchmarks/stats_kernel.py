"""The CPU statistics of one tensor: the one-pass kernel (``dispatchprobe.torch.fused_stats``)
against torch's reductions for the same record and a plain ``torch.sum``, per tensor size and
dtype, with the tensor in cache (just written, as an op's output is when the probe reads it).

    python benchmarks/stats_kernel.py [--threads N]
"""

from __future__ import annotations

import argparse
import timeit

import torch

from dispatchprobe.torch import tensor_backend as backend, fused_stats

SIZES = [16_384, 131_072, 1_048_576, 4_194_304]


def per_call_us(fn, n: int) -> float:
    reps = max(20, int(2e7 // n))
    return min(timeit.repeat(fn, number=reps, repeat=5)) / reps * 1e6


def torch_reductions(x: torch.Tensor) -> dict:
    """The record from torch's reductions (what the probe uses without the kernel)."""
    kernel = fused_stats.stats4
    fused_stats.stats4 = None
    try:
        return backend._cpu_stats(x)
    finally:
        fused_stats.stats4 = kernel


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


if __name__ == "__main__":
    main()
