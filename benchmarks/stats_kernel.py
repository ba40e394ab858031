"""The CPU statistics of one tensor: the one-pass kernel (``dispatchprobe.torch.fused_stats``)
against torch's reductions for the same record and a plain ``torch.sum``, per tensor size and
dtype, with the tensor in cache (just written, as an op's output is when the probe reads it).
Then the library's own call (``fused_stats.rows``, and a compiled window's
``window_row_lists``) in the calling thread's CPU time, from 32 tiny tensors to 4 MB, against
torch's aminmax + sum + dot of the same values.

    python benchmarks/stats_kernel.py [--threads N]
    python benchmarks/stats_kernel.py --tree old=/tmp/old-checkout --tree new=. [--rounds 3] [--threads N]

``--tree`` (repeatable) times the one-pass kernel's record (the first table's middle column) of two
or more source trees side by side: each tree in its own child process (``PYTHONPATH`` set to the
tree; its library built or loaded as that tree does it), the trees alternating ``--rounds`` times;
printed per tree, the least µs per tensor over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import timeit

import torch

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


def _modules():
    """This tree's record backend and native-statistics module (older trees name the backend
    ``dispatchprobe.torch.backend``)."""
    from dispatchprobe.torch import fused_stats
    try:
        from dispatchprobe.torch import tensor_backend as backend
    except ImportError:
        from dispatchprobe.torch import backend
    return backend, fused_stats


backend, fused_stats = _modules()


def _load_native() -> None:
    """Build or load the tree's library as the tree does it; exit saying why where it is not used."""
    if hasattr(fused_stats, "build_native"):
        fused_stats.build_native()
    else:                                   # older trees: a torch extension built in the background
        fused_stats.build(wait=True)
    if fused_stats.stats4 is None:
        raise SystemExit(f"the one-pass kernel is not available: {getattr(fused_stats, 'error', None)}")


def _tree_child() -> None:
    """Child process of ``--tree``: µs per tensor of the kernel's record, as a JSON line."""
    _load_native()
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for n in SIZES:
            x = torch.randn(n).to(dtype)
            out[f"{str(dtype).removeprefix('torch.')} {n}"] = per_call_us(lambda: backend._cpu_stats(x), n)
    print(json.dumps({"package": os.path.dirname(os.path.dirname(fused_stats.__file__)), "us": out}))


def _trees(trees, rounds: int, threads) -> None:
    best: dict = {label: {} for label, _ in trees}
    for _ in range(rounds):
        for label, path in trees:
            path = os.path.abspath(path)
            env = dict(os.environ, PYTHONPATH=path)
            cmd = [sys.executable, os.path.abspath(__file__), "--tree-child"] + (["--threads", str(threads)] if threads else [])
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"tree {label} ({path}) failed:\n{done.stderr[-3000:]}")
            row = json.loads(done.stdout.strip().splitlines()[-1])
            if not os.path.realpath(row["package"]).startswith(os.path.realpath(path) + os.sep):
                raise SystemExit(f"tree {label}: dispatchprobe was imported from {row['package']}, not {path}")
            for key, us in row["us"].items():
                best[label][key] = min(us, best[label].get(key, float("inf")))
    labels = [label for label, _ in trees]
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, "
          f"{threads or torch.get_num_threads()} threads; the one-pass kernel's record, µs per tensor, "
          f"least of {rounds} rounds (trees alternating) x best of 5")
    print("| dtype | values | " + " | ".join(labels) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in labels) + " |")
    for key in best[labels[0]]:
        dtype, n = key.split()
        print(f"| {dtype} | {int(n):,} | " + " | ".join(f"{best[label][key]:.1f}" for label in labels) + " |")


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
    ap.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH",
                    help="a source tree to time (repeatable): the kernel's record of each, side by side")
    ap.add_argument("--rounds", type=int, default=3, help="--tree: children per tree, the trees alternating")
    ap.add_argument("--tree-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tree:
        return _trees([t.split("=", 1) for t in args.tree], args.rounds, args.threads)
    if args.tree_child:
        return _tree_child()
    _load_native()
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
