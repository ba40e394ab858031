"""Speed of `dispatchprobe compare`: prints a table.

1. statistics compare of two synthetic 100k-op runs (records written as JSON lines directly);
2. tensor compare of two recorded transformer steps (a bigger TinyTransformer);
3. msprobe's compare on the same dumps, when mindstudio-probe is importable (else "unavailable").

    python benchmarks/compare_speed.py [--ops 100000] [--skip-tensor]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def synthetic_run(path: str, n_ops: int, seed: int, noise: float) -> None:
    from dispatchprobe.writer import write_manifest
    rng = np.random.default_rng(seed)
    write_manifest(path, framework="synthetic", framework_version="0", device="cpu", config={"task": "statistics"})
    folder = os.path.join(path, "step0", "rank0")
    os.makedirs(folder, exist_ok=True)
    ops = ["aten.mm.default", "aten.add.Tensor", "aten.gelu.default", "aten._softmax.default"]
    base = np.random.default_rng(0).standard_normal((n_ops, 4))
    vals = base * (1 + noise * rng.standard_normal((n_ops, 4)))
    with open(os.path.join(folder, "ops.jsonl"), "w") as f:
        for i in range(n_ops):
            op = ops[i % 4]
            stage = "forward" if i < n_ops // 2 else "backward"
            mx, mn, mean, norm = abs(vals[i, 0]) + 1, -abs(vals[i, 1]) - 1, vals[i, 2] * 0.1, abs(vals[i, 3]) * 30 + 10
            t = {"type": "tensor", "dtype": "float32", "shape": [64, 64], "stride": [64, 1], "device": "cpu",
                 "requires_grad": False, "stats": {"max": mx, "min": mn, "mean": mean, "norm": norm, "nan": 0, "inf": 0}}
            rec = {"id": i, "kind": "op", "name": f"{op}.{i}.{stage}", "op": op, "stage": stage,
                   "scope": f"Model.layers.{(i // 40) % 500}", "call": i, "grad_fn": None, "stack": None,
                   "inputs": [t, t], "kwargs": {}, "output_type": "single", "outputs": [t]}
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")


def timed_subprocess(code: str) -> tuple[float, float, str]:
    """Run code in a fresh interpreter; (seconds, peak RSS MB, stdout)."""
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", code + "\nimport resource, sys\n"
                          "print('RSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"],
                         capture_output=True, text=True)
    dt = time.perf_counter() - t
    if res.returncode:
        return dt, float("nan"), res.stderr.strip().splitlines()[-1]
    rss = [l for l in res.stdout.splitlines() if l.startswith("RSS")]
    return dt, int(rss[-1].split()[1]) / 1024, res.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", type=int, default=100_000)
    ap.add_argument("--skip-tensor", action="store_true")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        a, b = os.path.join(tmp, "sa"), os.path.join(tmp, "sb")
        t = time.perf_counter()
        synthetic_run(a, args.ops, 1, 0.0)
        synthetic_run(b, args.ops, 2, 1e-4)
        gen = time.perf_counter() - t
        dt, rss, _ = timed_subprocess(f"from dispatchprobe import compare\nt, v = compare({a!r}, {b!r})\n"
                                      f"print(len(t))")
        rows.append((f"statistics, {args.ops:,} ops x 3 tensors", "dispatchprobe", dt, rss))
        if not args.skip_tensor:
            from compare_helpers import record
            kw = {"dim": 256, "heads": 8, "layers": 4, "seq": 128, "vocab": 1024}
            ta, tb = os.path.join(tmp, "ta"), os.path.join(tmp, "tb")
            record(ta, model_kw=kw, batch=8)
            record(tb, model_kw=kw, batch=8, plant=True)
            size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ta) for f in fs) / 2**20
            dt, rss, _ = timed_subprocess(f"from dispatchprobe import compare\nt, v = compare({ta!r}, {tb!r})")
            rows.append((f"tensor, transformer step ({size:.0f} MB per run)", "dispatchprobe", dt, rss))
            try:
                import msprobe  # noqa: F401
                rows.append(("tensor, transformer step", "msprobe",
                             float("nan"), float("nan")))  # its compare needs msprobe's own dump format
                ms_note = "mindstudio-probe installed, but it compares only its own dump.json/.pt format; " \
                          "not run on dispatchprobe records"
            except Exception as exc:  # noqa: BLE001
                ms_note = f"msprobe unavailable ({type(exc).__name__}: {exc})"
        else:
            ms_note = "tensor compare skipped"
    print(f"(synthetic runs generated in {gen:.1f} s)")
    print(f"{'case':48s} {'tool':14s} {'seconds':>8s} {'peak RSS MB':>12s}")
    for case, tool, dt, rss in rows:
        print(f"{case:48s} {tool:14s} {dt:8.2f} {rss:12.0f}")
    print(ms_note)


if __name__ == "__main__":
    main()
