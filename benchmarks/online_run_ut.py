"""Online run-ut on this machine: ops/s judged by a ``run-ut --listen`` checker, the training-side
cost of streaming against writing a local tensor dump, and the send queue's memory bound.

The tiny transformer trains ``--steps`` steps four ways, each in a fresh probe:

* unprobed (the baseline of the per-step times);
* task "tensor" writing a local dump;
* streaming to a checker on loopback (plain TCP; the checker is a child process, ``-j --jobs``):
  training's time per step, then the checker's ops judged per second from the first frame to
  its exit (it exits once everything is judged);
* streaming with a deliberately small queue (``--small-queue-mb``, ``online_wait_s=0``) to a
  checker that is paused while training runs: the queue's peak bytes stay within its bound plus
  one frame, and the ops that did not fit are counted as dropped.

    python benchmarks/online_run_ut.py [--steps 3] [--jobs 2] [--layers 2] [--dim 128]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import torch

from dispatchprobe import DispatchProbe
from dispatchprobe.models import TinyTransformer, lm_batch, lm_loss


def train(probe, steps: int, layers: int, dim: int) -> list[float]:
    """Seconds per step (forward, backward, optimizer) of the tiny transformer."""
    torch.manual_seed(0)
    model = TinyTransformer(layers=layers, dim=dim)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for step in range(steps):
        tokens, targets = lm_batch(seed=step)
        t0 = time.perf_counter()
        if probe is not None:
            with probe:
                lm_loss(model, tokens, targets).backward()
        else:
            lm_loss(model, tokens, targets).backward()
        opt.step()
        opt.zero_grad()
        if probe is not None:
            probe.step()
        times.append(time.perf_counter() - t0)
    return times


class Checker:
    def __init__(self, out: str, jobs: int):
        self.proc = subprocess.Popen([sys.executable, "-m", "dispatchprobe.cli", "run-ut", "--listen", "127.0.0.1:0",
                                      "-o", out, "-j", str(jobs)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.log: list[str] = []
        self.first_frame = None
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + 60
        while not any("listening on" in x for x in self.log):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("the checker did not start:\n" + "\n".join(self.log))
            time.sleep(0.05)
        self.port = int(re.search(r"127\.0\.0\.1:(\d+)", next(x for x in self.log if "listening" in x)).group(1))

    def _read(self):
        for line in self.proc.stderr:
            if "connected from" in line and self.first_frame is None:
                self.first_frame = time.perf_counter()
            self.log.append(line.rstrip())

    def judged(self) -> int:
        out = self.proc.stdout.read()
        m = re.search(r"run-ut: (\d+) ops", out)
        return int(m.group(1)) if m else 0


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=2, help="the checker's run-ut workers")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--small-queue-mb", type=float, default=0.05)
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="online_bench_")
    shape = dict(steps=args.steps, layers=args.layers, dim=args.dim)

    base = train(None, **shape)
    local = train(DispatchProbe(task="tensor", dump_path=os.path.join(tmp, "local")), **shape)

    checker = Checker(os.path.join(tmp, "ut"), args.jobs)
    probe = DispatchProbe(task="tensor", online_run_ut=True, host="127.0.0.1", port=checker.port,
                          dump_path=os.path.join(tmp, "unused"))
    streamed = train(probe, **shape)
    probe.close()                                   # waits for the checker's judged count
    checker.proc.wait(timeout=600)
    judged_s = time.perf_counter() - (checker.first_frame or time.perf_counter())
    judged = checker.judged()
    peak = probe.online.peak_bytes

    slow = Checker(os.path.join(tmp, "ut_small"), 1)
    small = DispatchProbe(task="tensor", online_run_ut=True, host="127.0.0.1", port=slow.port,
                          dump_path=os.path.join(tmp, "unused2"), online_queue_mb=args.small_queue_mb,
                          online_wait_s=0.0)
    os.kill(slow.proc.pid, signal.SIGSTOP)          # a checker that reads nothing while training runs
    try:
        train(small, **shape)
    finally:
        os.kill(slow.proc.pid, signal.SIGCONT)
    small.close()
    slow.proc.wait(timeout=600)
    bound = int(args.small_queue_mb * (1 << 20))

    rows = [("unprobed", f"{median(base) * 1e3:.1f} ms/step", ""),
            ("tensor dump to local disk", f"{median(local) * 1e3:.1f} ms/step", f"x{median(local) / median(base):.2f}"),
            ("streaming to a checker (loopback)", f"{median(streamed) * 1e3:.1f} ms/step",
             f"x{median(streamed) / median(base):.2f}"),
            (f"checker, -j {args.jobs}", f"{judged / judged_s:.1f} ops/s judged" if judged_s > 0 else "n/a",
             f"{judged} ops in {judged_s:.1f} s"),
            ("send queue peak (256 MB bound)", f"{peak / 2**20:.2f} MB", ""),
            (f"send queue peak ({args.small_queue_mb:g} MB bound, paused checker)",
             f"{small.online.peak_bytes / 2**20:.2f} MB", f"{small.online.dropped} ops dropped, counted; "
                                                          f"within max(bound, largest op frame): "
                                                          f"{small.online.peak_bytes <= max(bound, small.online.largest)}")]
    width = max(len(r[0]) for r in rows)
    print(f"online run-ut, TinyTransformer(layers={args.layers}, dim={args.dim}), {args.steps} steps, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    for name, value, note in rows:
        print(f"  {name:<{width}}  {value:>22}  {note}")
    print(f"  accounts: {probe.online_account}\n            {small.online_account}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
