"""run-ut throughput (ops/second) on the tiny transformer's tensor records, -j 1 and -j 2,
beside msprobe's own API pre-check (``msprobe acc_check``, formerly ``run_ut``) on msprobe's
dump of the same steps, so "dispatchprobe / msprobe" is measured rather than assumed.

msprobe side: the same TinyTransformer forward+backward steps (same seed, batches) are dumped by
msprobe's ``PrecisionDebugger`` (task "tensor", level "L1": acc_check needs real tensors) in a child
interpreter (the debugger is a process-wide singleton), then ``msprobe acc_check -api_info
<dump.json> -o <out>`` is timed in another child; APIs checked = rows of its
accuracy_checking_result_*.csv that are not SKIP.  acc_check compares a CPU golden run against the
same API on "cuda" (no torch_npu) or "npu": on a machine with neither it fails in
``torch.cuda.set_device``; that error is printed in the table instead of a number.

    python benchmarks/run_ut_speed.py [--steps 2]
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from dispatchprobe import DispatchProbe
from dispatchprobe.models import TinyTransformer, lm_batch, lm_loss
from dispatchprobe.offline.run_ut import run_ut


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


def msprobe_dump(out: str, steps: int) -> None:
    """Child process: the same steps as record() under msprobe's PrecisionDebugger (tensor, L1)."""
    from msprobe.pytorch import PrecisionDebugger
    torch.manual_seed(0)
    model = TinyTransformer()
    cfg = out + ".json"
    with open(cfg, "w") as f:
        json.dump({"task": "tensor", "dump_path": out, "rank": [], "step": [], "level": "L1",
                   "tensor": {"scope": [], "list": [], "data_mode": ["all"]}}, f)
    debugger = PrecisionDebugger(config_path=cfg)
    for step in range(steps):
        tokens, targets = lm_batch(seed=step)
        debugger.start(model)
        lm_loss(model, tokens, targets).backward()
        debugger.stop()
        debugger.step()


def _why(text: str) -> str:
    """The reason a child failed: its exception chain (cause first) and msprobe's last [ERROR] line."""
    lines = [l.strip() for l in text.strip().splitlines() if l.strip()]
    excs = [l for l in lines if l.split(":", 1)[0].endswith(("Error", "Exception", "Exit"))
            and " " not in l.split(":", 1)[0]]
    logged = [l.split("[ERROR]", 1)[1].strip() for l in lines if "[ERROR]" in l]
    why = " -> ".join(excs) if excs else (lines[-1] if lines else "no output")
    return why + (f" [msprobe log: {logged[-1]}]" if logged else "")


def msprobe_speed(tmp: str, steps: int) -> tuple[int, float, str]:
    """(APIs checked, seconds, note); APIs < 0 when it could not be measured (note says why)."""
    try:
        import msprobe  # noqa: F401
    except ImportError as exc:
        return -1, float("nan"), f"mindstudio-probe not importable ({exc})"
    out = os.path.join(tmp, "msprobe_dump")
    res = subprocess.run([sys.executable, __file__, "--msprobe-dump", out, "--steps", str(steps)],
                         capture_output=True, text=True)
    dumps = sorted(glob.glob(os.path.join(out, "step*", "*", "dump.json")))
    if res.returncode or not dumps:
        return -1, float("nan"), f"msprobe dump failed: {_why(res.stderr or res.stdout)}"
    n_apis = n_skip = 0
    seconds = 0.0
    for i, dump in enumerate(dumps):  # one acc_check per step dump, as msprobe's docs run it
        ut_out = os.path.join(tmp, f"msprobe_ut{i}")
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, "-c", "import sys\nfrom msprobe.msprobe import main\n"
                              "sys.argv = ['msprobe'] + sys.argv[1:]\nmain()",
                              "acc_check", "-api_info", dump, "-o", ut_out],
                             capture_output=True, text=True)
        seconds += time.perf_counter() - t0
        csvs = glob.glob(os.path.join(ut_out, "accuracy_checking_result_*.csv"))
        if res.returncode or not csvs:
            with open(dump) as f:
                n_fwd = sum(k.endswith(".forward") for k in json.load(f).get("data", {}))
            return -1, float("nan"), (f"acc_check failed (exit {res.returncode}) on a dump of {n_fwd} "
                                      f"forward APIs: "
                                      f"{_why(res.stderr + res.stdout)}")
        with open(csvs[0], newline="", encoding="utf-8-sig") as f:
            rows = list(csv.reader(f))[1:]  # API name, Forward Test Success, Backward Test Success, Message
        # a SKIP row was not checked (e.g. "Torch not compiled with CUDA enabled"): not counted
        n_apis += sum(1 for r in rows if len(r) > 1 and r[1] != "SKIP")
        n_skip += sum(1 for r in rows if len(r) > 1 and r[1] == "SKIP")
    if n_apis == 0:
        return -1, float("nan"), f"acc_check ran but checked no API ({n_skip} SKIP rows)"
    return n_apis, seconds, (f"{len(dumps)} step dump(s), {n_skip} SKIP rows not counted, "
                             "wall time incl. interpreter start")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--msprobe-dump", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.msprobe_dump:
        msprobe_dump(args.msprobe_dump, args.steps)
        return
    tmp = tempfile.mkdtemp(prefix="run_ut_speed_")
    try:
        rec = f"{tmp}/records"
        record(rec, args.steps)
        print(f"records: TinyTransformer, {args.steps} step(s), forward+backward, fp32 (torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads, cuda {'yes' if torch.cuda.is_available() else 'no'})")
        rows = []
        for jobs in (1, 2):
            t0 = time.perf_counter()
            res = run_ut(rec, f"{tmp}/ut_j{jobs}", jobs=jobs, progress=False)
            dt = time.perf_counter() - t0
            rows.append((f"dispatchprobe run-ut -j {jobs}", res.replayed, dt))
        n_ms, dt_ms, note = msprobe_speed(tmp, args.steps)
        ms_rate = n_ms / dt_ms if n_ms > 0 else None
        print(f"{'tool':<28}{'ops/APIs':>9}{'seconds':>9}{'ops/s':>9}  vs msprobe")
        for tool, n, dt in rows:
            ratio = f"{n / dt / ms_rate:.1f}x" if ms_rate else "n/a"
            print(f"{tool:<28}{n:>9}{dt:>9.2f}{n / dt:>9.1f}  {ratio}")
        if n_ms >= 0:
            print(f"{'msprobe acc_check':<28}{n_ms:>9}{dt_ms:>9.2f}{n_ms / dt_ms:>9.1f}  1.0x  ({note})")
        else:
            print(f"{'msprobe acc_check':<28}{'-':>9}{'-':>9}{'-':>9}  n/a  ({note})")
        print("units: dispatchprobe counts aten ops replayed (forward and backward); msprobe counts the torch-level "
              "APIs in its result csv (one row per forward API, its backward checked in the same row)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
