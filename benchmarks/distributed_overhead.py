"""Per-rank cost of statistics recording under DDP and FSDP2 (2 gloo ranks), beside one process.

One model (the tiny transformer of ``dispatchprobe.models``) and one global batch: one process
trains on all of it; under ``torchrun`` each of the ranks trains on its share, wrapped in DDP or
FSDP2 (``fully_shard`` per layer and the root), or not wrapped (``local``: the ranks' work side
by side on the machine, no communication).  Each process times its steps (forward, backward,
optimizer step) unprobed and under ``DispatchProbe(task="statistics")``, alternating, and
reports the median of each (wall time, and the CPU time of the thread that runs the step, which
other work on a shared machine moves less; a row of several threads leaves the others' out) and
the records a probed step wrote; the table gives each rank's
ratio beside two 1-process ones: the whole batch on the machine's threads, and one rank's work
alone (its share of the batch and its thread count), which separates what recording a
distributed step costs from what recording a smaller step does.  The rank's-work-alone row is
timed again after the ranks, so that a change of the machine's load between them shows.  Last, each
distributed rank's ratio over that one's (wall time and CPU time), before and after.

    python benchmarks/distributed_overhead.py [--steps 8] [--quick] [--nproc 2] [--kinds local,ddp] [--bucket-mb 1]

``--bucket-mb``: DDP's bucket size (torch's default 25 MB makes one bucket of this model, reduced
after the backward; 1 MB makes several, whose asynchronous all-reduces overlap the rest of the
backward, as in a large model's step).

The ranks are launched with ``python -m torch.distributed.run --standalone`` (gloo on loopback).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from dispatchprobe import DispatchProbe
from dispatchprobe.models import TinyTransformer, lm_batch, lm_loss


def _model(quick: bool):
    kw = dict(vocab=256, dim=64, heads=4, layers=2, seq=32) if quick else \
        dict(vocab=1024, dim=256, heads=8, layers=4, seq=128)
    torch.manual_seed(0)
    return TinyTransformer(**kw), kw


def _wrap(kind: str, model, bucket_mb: float | None = None):
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model, **({"bucket_cap_mb": bucket_mb} if bucket_mb else {}))
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    return model


def measure(kind: str, steps: int, quick: bool, dump: str, shares: int = 1, bucket_mb: float | None = None) -> dict:
    """Median seconds per step, unprobed and probed (alternating), in this process; ``shares``
    (one process only): train on the first of that many shares of the batch, as a rank does."""
    rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if kind != "single" else (0, 1)
    model, kw = _model(quick)
    model = _wrap(kind, model, bucket_mb)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = 8
    tokens, targets = lm_batch(batch=batch, seq=kw["seq"], vocab=kw["vocab"])
    share = batch // max(world, shares)
    tokens, targets = tokens[rank * share:(rank + 1) * share], targets[rank * share:(rank + 1) * share]
    probe = DispatchProbe(task="statistics", dump_path=os.path.join(dump, kind), overwrite=True)

    def step(probed: bool) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.thread_time()
        if probed:
            probe.start()
        lm_loss(model, tokens, targets).backward()
        opt.step()
        opt.zero_grad()
        if probed:
            probe.step()
        return time.perf_counter() - t0, time.thread_time() - c0

    step(False)                   # warm-up: allocations, FSDP's first all-gathers
    step(True)
    plain, probed = [], []
    for _ in range(steps):
        plain.append(step(False))
        probed.append(step(True))
    probe.close()
    return {"kind": kind if shares == 1 else f"{kind} 1/{shares}", "rank": rank, "world": world,
            "threads": torch.get_num_threads(), "plain": statistics.median(t for t, _ in plain),
            "probed": statistics.median(t for t, _ in probed),
            "plain_cpu": statistics.median(c for _, c in plain), "probed_cpu": statistics.median(c for _, c in probed),
            "records": _records_per_step(os.path.join(dump, kind), rank)}


def _records_per_step(run: str, rank: int) -> int:
    """The median number of records a probed step wrote on ``rank`` (the work the probe did)."""
    counts = []
    for step in os.listdir(run):
        path = os.path.join(run, step, f"rank{rank}", "ops.jsonl")
        if step.startswith("step") and os.path.exists(path):
            with open(path, "rb") as f:
                counts.append(sum(1 for _ in f))
    return int(statistics.median(counts)) if counts else 0


def _worker(kind: str, steps: int, quick: bool, dump: str, out: str, bucket_mb: float | None) -> None:
    torch.distributed.init_process_group("gloo")
    res = measure(kind, steps, quick, dump, bucket_mb=bucket_mb)
    with open(os.path.join(out, f"{kind}-rank{res['rank']}.json"), "w") as f:
        json.dump(res, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="a smaller transformer (smoke runs)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks of the DDP and FSDP2 runs")
    parser.add_argument("--kinds", default="local,ddp,fsdp2",
                        help="the distributed runs, comma-separated (local: the ranks not wrapped)")
    parser.add_argument("--bucket-mb", type=float, help="DDP's bucket_cap_mb (default: torch's)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--tmp", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.steps, args.quick, os.path.join(args.tmp, "runs"), args.tmp, args.bucket_mb)
        return
    tmp = tempfile.mkdtemp(prefix="dist_overhead_")
    try:
        rows = [measure("single", args.steps, args.quick, os.path.join(tmp, "runs"))]
        # the same work as one rank, alone: its share of the batch, its thread count
        threads, rank_threads = torch.get_num_threads(), int(os.environ.get("OMP_NUM_THREADS", "1"))

        def rank_alone(label=""):
            torch.set_num_threads(rank_threads)
            rows.append(measure("single", args.steps, args.quick, os.path.join(tmp, "runs"), shares=args.nproc))
            rows[-1]["kind"] += label
            torch.set_num_threads(threads)
        rank_alone()
        env = {**os.environ, "OMP_NUM_THREADS": str(rank_threads)}
        for kind in args.kinds.split(","):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
                   os.path.abspath(__file__), "--worker", kind, "--tmp", tmp, "--steps", str(args.steps)]
            if args.bucket_mb:
                cmd += ["--bucket-mb", str(args.bucket_mb)]
            done = subprocess.run(cmd + (["--quick"] if args.quick else []), capture_output=True, text=True, env=env)
            if done.returncode:
                raise SystemExit(f"{kind} ranks failed:\n{done.stderr[-3000:]}")
            for r in range(args.nproc):
                with open(os.path.join(tmp, f"{kind}-rank{r}.json")) as f:
                    rows.append(json.load(f))
        rank_alone(" after")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{'setup':<16} {'rank':>4} {'threads':>7} {'unprobed ms/step':>17} {'statistics ms/step':>19} {'ratio':>6}"
          f" {'cpu ms/step':>13} {'cpu ratio':>9} {'records/step':>12}")
    for r in rows:
        print(f"{r['kind']:<16} {r['rank']:>2}/{r['world']:<1} {r['threads']:>7} {1e3 * r['plain']:>17.1f} "
              f"{1e3 * r['probed']:>19.1f} {r['probed'] / r['plain']:>6.2f} "
              f"{1e3 * r['plain_cpu']:>6.1f}/{1e3 * r['probed_cpu']:<6.1f} {r['probed_cpu'] / r['plain_cpu']:>9.2f} "
              f"{r['records']:>12}")
    # each rank's ratio against the one-process ratio of its share of the work (before and after)
    alone = [r for r in rows if r["kind"].startswith("single 1/")]
    for r in rows:
        if r["kind"] != "single" and not r["kind"].startswith("single "):
            print(f"{r['kind']} rank {r['rank']}: ratio " + " / ".join(
                f"{(r['probed'] / r['plain']) / (a['probed'] / a['plain']):.2f}x" for a in alone)
                + " of a rank's share alone (before / after), cpu ratio " + " / ".join(
                f"{(r['probed_cpu'] / r['plain_cpu']) / (a['probed_cpu'] / a['plain_cpu']):.2f}x" for a in alone))


if __name__ == "__main__":
    main()
