"""What recording adds per op, for two or more source trees side by side in one run.

    python benchmarks/per_op_cost.py --tree old=/tmp/old-checkout --tree new=. [--rounds 6] [--ops 700]

A chain of small float32 ops (``mm``, ``mul``, ``tanh`` on 64x64 values, each output the next
op's input: one new value per op, the others cache hits) is run uninstrumented, under an empty
``TorchDispatchMode`` (torch's own floor for any dispatch-mode tool) and under
``DispatchProbe(task="statistics")`` writing to ``--dump-root`` (``/dev/shm`` by default, so the
disk is out of it).  Times are the CPU time of the stepping thread (``time.thread_time``, one
intra-op thread): on a machine shared with other work they move far less than wall time.

Each tree is measured in its own child process (``PYTHONPATH`` set to the tree), the trees
alternating, ``--rounds`` times; each child times ``--reps`` alternations of the three modes and
reports each mode's least time (other work on the machine only adds to a time).  Printed per tree: the range over rounds of the µs each recorded op adds
over the uninstrumented chain, and of the empty mode's.  ``--settle``: seconds a child waits
after the probe starts, for trees that load their native code in the background.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time


def child(args) -> None:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from dispatchprobe import DispatchProbe

    class Empty(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    torch.set_num_threads(1)
    torch.manual_seed(0)
    w = torch.randn(64, 64) / 8

    def chain(n: int) -> None:
        x = torch.randn(64, 64)
        for _ in range(n):
            x = torch.tanh(torch.mul(torch.mm(x, w), 0.5))

    dump = os.path.join(args.dump_root, f"dp-per-op-{os.getpid()}")
    shutil.rmtree(dump, ignore_errors=True)
    probe = DispatchProbe(task="statistics", dump_path=dump)
    for _ in range(2):                       # warm: first-use costs land in no timed round
        with probe:
            chain(50)
        probe.step()
    time.sleep(args.settle)
    n, times = args.ops, {"bare": [], "empty": [], "probe": []}
    for _ in range(args.reps):
        start = time.thread_time()
        chain(n)
        times["bare"].append(time.thread_time() - start)
        start = time.thread_time()
        with Empty():
            chain(n)
        times["empty"].append(time.thread_time() - start)
        start = time.thread_time()
        with probe:
            chain(n)
        times["probe"].append(time.thread_time() - start)
        probe.step()                         # outside the timed region: one part per repetition
    probe.close()
    shutil.rmtree(dump, ignore_errors=True)
    # the least of each mode's times: other work on the machine only ever adds to a time
    best = {k: min(v) / (3 * n) * 1e6 for k, v in times.items()}
    print(json.dumps({"bare": best["bare"], "empty": best["empty"] - best["bare"],
                      "probe": best["probe"] - best["bare"]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH",
                        help="a source tree to measure (repeatable); default: this checkout")
    parser.add_argument("--rounds", type=int, default=6, help="children per tree, the trees alternating")
    parser.add_argument("--reps", type=int, default=9, help="timed repetitions inside each child")
    parser.add_argument("--ops", type=int, default=400, help="links of the chain (three ops each)")
    parser.add_argument("--dump-root", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    parser.add_argument("--settle", type=float, default=0.0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dump_root is None:
        import tempfile
        args.dump_root = tempfile.gettempdir()
    if args.child:
        child(args)
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = [t.split("=", 1) for t in args.tree] or [["this", here]]
    results: dict[str, list[dict]] = {label: [] for label, _ in trees}
    for _ in range(args.rounds):
        for label, path in trees:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(path))
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--reps", str(args.reps),
                                  "--ops", str(args.ops), "--dump-root", args.dump_root, "--settle", str(args.settle)],
                                 env=env, capture_output=True, text=True, check=True)
            results[label].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"µs per op, thread CPU time; {args.rounds} rounds x {args.reps} reps of {3 * args.ops} ops")
    for label, rows in results.items():
        def span(key: str) -> str:
            values = sorted(r[key] for r in rows)
            return f"{values[0]:5.1f}-{values[-1]:5.1f} (median {statistics.median(values):5.1f})"
        print(f"  {label:10s} recorded op adds {span('probe')}; empty mode adds {span('empty')}; "
              f"uninstrumented op {span('bare')}")


if __name__ == "__main__":
    main()
