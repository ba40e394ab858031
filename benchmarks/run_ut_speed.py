"""run-ut throughput (ops/second) on the tiny transformer's tensor records, -j 1 and -j 2,
beside msprobe's acc_check when it is installed.

    python benchmarks/run_ut_speed.py [--steps 2]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from dispatchprobe import DispatchProbe
from dispatchprobe.models import TinyTransformer, lm_batch, lm_loss
from dispatchprobe.run_ut import run_ut


def record(path: str, steps: int) -> None:
    torch.manual_seed(0)
    model = TinyTransformer()
    probe = DispatchProbe(task="tensor", dump_path=path, model=model)
    for step in range(steps):
        tokens, targets = lm_batch(seed=step)
        with probe:
            lm_loss(model, tokens, targets).backward()
        probe.step()
    probe.close()


def msprobe_speed() -> str:
    try:
        import msprobe  # noqa: F401
    except ImportError:
        return "unavailable (mindstudio-probe not installed: `pip install mindstudio-probe` timed out or failed here)"
    # msprobe's acc_check needs its own dump (api_info json from msprobe's PrecisionDebugger);
    # we time it from the command line on such a dump when one is given
    return "installed, but needs an msprobe dump of the same model (not produced by this script)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="run_ut_speed_")
    try:
        rec = f"{tmp}/records"
        record(rec, args.steps)
        print(f"records: TinyTransformer, {args.steps} step(s), forward+backward, fp32 (torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads)")
        print(f"{'mode':<8}{'ops':>6}{'seconds':>10}{'ops/s':>10}")
        for jobs in (1, 2):
            t0 = time.perf_counter()
            res = run_ut(rec, f"{tmp}/ut_j{jobs}", jobs=jobs, progress=False)
            dt = time.perf_counter() - t0
            print(f"-j {jobs:<5}{res.replayed:>6}{dt:>10.2f}{res.replayed / dt:>10.1f}")
        print(f"msprobe acc_check: {msprobe_speed()}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
