"""Cost of recording a training step with its optimizer step: the transformers Llama of
``record_overhead.py`` trained with AdamW (one tensor at a time, and ``foreach``), unprobed, under
torch's DebugMode and under ``DispatchProbe(task="statistics")``.

    python benchmarks/optimizer_overhead.py [--steps 12] [--quick]

An optimizer step is a chain of in-place updates per parameter (AdamW: ``mul_``, ``lerp_``,
``mul_``, ``addcmul_``, ``sqrt``, ``div``, ``add_``, ``addcdiv_``), each recorded, plus the probe's
parameter records (each gradient before the step, each value after it).  Each mode runs in a
process of its own (a fresh heap, as a user's run has), steps timed whole (forward, backward,
optimizer step, ``zero_grad``), and the optimizer's part (step and ``zero_grad``) timed alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import record_overhead as overhead

MODES = ("uninstrumented", "torch DebugMode", "dispatchprobe statistics")


def child(mode: str, foreach: bool, steps: int, quick: bool, tmp: str) -> dict:
    """Time ``steps`` steps of one mode (after three untimed ones) in this process."""
    from dispatchprobe import DispatchProbe
    torch.manual_seed(0)
    _, model, step = overhead.llama_case(quick)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=foreach)
    probe = DispatchProbe(task="statistics", dump_path=os.path.join(tmp, "run"), model=model) \
        if mode == "dispatchprobe statistics" else None

    def context():
        if probe is not None:
            return probe
        if mode == "torch DebugMode":
            from torch.utils._debug_mode import DebugMode
            return DebugMode()
        return overhead._Null()

    whole, part = [], []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        with context():
            step()
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad()
        if probe is not None:
            probe.step()
        t2 = time.perf_counter()
        if i >= 3:
            whole.append(t2 - t0)
            part.append(t2 - t1)
    if probe is not None:
        probe.close()
    return {"step": statistics.median(whole), "optimizer": statistics.median(part)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="a smaller Llama (smoke runs)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--foreach", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(child(args.child, args.foreach, args.steps, args.quick, tmp)))
        return
    print(f"device cpu, torch {torch.__version__}, {torch.get_num_threads()} threads, {args.steps} timed steps, "
          "each mode in a process of its own")
    print(f"{'AdamW':<14} {'mode':<26} {'step ms':>8} {'ratio':>6} {'optimizer ms':>13} {'ratio':>6}")
    for foreach in (False, True):
        base = None
        for mode in MODES:
            cmd = [sys.executable, __file__, "--child", mode, "--steps", str(args.steps)]
            cmd += ["--foreach"] * foreach + ["--quick"] * args.quick
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"{mode} failed:\n{done.stderr[-3000:]}")
            res = json.loads(done.stdout.strip().splitlines()[-1])
            base = base or res
            print(f"{'foreach' if foreach else 'one tensor':<14} {mode:<26} {1e3 * res['step']:>8.1f} "
                  f"{res['step'] / base['step']:>5.2f}x {1e3 * res['optimizer']:>13.1f} "
                  f"{res['optimizer'] / base['optimizer']:>5.2f}x")


if __name__ == "__main__":
    main()
