"""Speed of `dispatchprobe show` on a long run: from the per-step summaries written when each step
closes (``summary.json``) against reading every record, and what the summaries cost the run.

Records ``--steps`` steps of a tiny transformers Llama with AdamW (task statistics, level op; about
260 records and 0.23 MB a step, so 1,000 steps hold about 260,000 records), timing each step's
summary at its close. Then, alternately, each ``show`` in a fresh interpreter (wall time, imports
included, and its peak RSS):

* ``summaries``: the run as recorded;
* ``records``: the same run without its summaries (hard links; as a run written before them, or
  by a process killed at each close) — this tree reading every record;
* ``old tree``: ``--old-tree DIR`` (a git worktree of an older commit) on the recorded run.

Every mode must print the same text. Time it alone: ``flock /tmp/bench.lock python
benchmarks/show_speed.py``.

    python benchmarks/show_speed.py [--steps 1000] [--rounds 3] [--old-tree /tmp/old] [--dump DIR]
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)        # this tree's dispatchprobe records the run


def record(path: str, steps: int) -> tuple[float, list[float]]:
    """Record the run; (seconds per recorded step, seconds of each summary written at a close).
    Run in a child process (``--record``), so that the children timing ``show`` start from a
    small process (Linux keeps a process's peak RSS across exec)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dispatchprobe import DispatchProbe
    from dispatchprobe.records import part_summary

    spent: list[float] = []
    write = part_summary.write

    def timed_write(folder):
        t = time.perf_counter()
        try:
            return write(folder)
        finally:
            spent.append(time.perf_counter() - t)

    part_summary.write = timed_write     # the writer calls it through the module at each close
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 256, (1, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    probe = DispatchProbe(dump_path=path, task="statistics", level="op", overwrite=True)
    t = time.perf_counter()
    for _ in range(steps):
        with probe:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        probe.step()
    probe.close()
    per_step = (time.perf_counter() - t) / steps
    part_summary.write = write
    return per_step, spent


def without_summaries(run: str, copy: str) -> None:
    """``run`` hard-linked into ``copy``, its summaries left out."""
    for folder, _, files in os.walk(run):
        target = os.path.join(copy, os.path.relpath(folder, run))
        os.makedirs(target, exist_ok=True)
        for name in files:
            if name != "summary.json":
                os.link(os.path.join(folder, name), os.path.join(target, name))


def show(tree: str, run: str) -> tuple[float, float, str]:
    """``dispatchprobe show RUN`` of ``tree`` in a fresh interpreter: (seconds, peak RSS MB, output)."""
    env = {**os.environ, "PYTHONPATH": tree}
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "dispatchprobe", "show", run], cwd=tree, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = proc.stdout.read().decode()
    _, status, usage = os.wait4(proc.pid, 0)
    dt = time.perf_counter() - t
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"show failed in {tree}:\n{out[-2000:]}")
    return dt, usage.ru_maxrss / 1024, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--old-tree", default=None, help="a worktree of an older commit to time beside this one")
    ap.add_argument("--dump", default=None, help="where to record (default: a temporary folder, removed after)")
    ap.add_argument("--record", default=None, help=argparse.SUPPRESS)     # the child that records
    args = ap.parse_args()
    if args.record:
        per_step, spent = record(args.record, args.steps)
        print(json.dumps({"per_step": per_step, "spent": spent}))
        return
    tmp = tempfile.mkdtemp(prefix="show_speed_", dir=args.dump)
    try:
        run, plain = os.path.join(tmp, "run"), os.path.join(tmp, "records_only")
        child = subprocess.run([sys.executable, __file__, "--record", run, "--steps", str(args.steps)],
                               stdout=subprocess.PIPE, text=True, check=True)
        timings = json.loads(child.stdout.strip().splitlines()[-1])
        per_step, spent = timings["per_step"], timings["spent"]
        without_summaries(run, plain)
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(run) for f in fs
                   if f == "ops.jsonl")
        n_records = sum(1 for d, _, fs in os.walk(run) if "ops.jsonl" in fs
                        for _ in open(os.path.join(d, "ops.jsonl"), "rb"))
        summary_bytes = sum(os.path.getsize(os.path.join(d, "summary.json")) for d, _, fs in os.walk(run)
                            if "summary.json" in fs)
        print(f"run: {args.steps} steps, {n_records} records, ops.jsonl {size / 2**20:.0f} MB, "
              f"summaries {summary_bytes / 2**20:.1f} MB; recorded step {per_step * 1e3:.1f} ms")
        print(f"summary at each step's close: median {statistics.median(spent) * 1e3:.2f} ms, "
              f"max {max(spent) * 1e3:.2f} ms ({statistics.median(spent) / per_step:.1%} of the recorded step)")
        modes = {"summaries": (ROOT, run), "records": (ROOT, plain)}
        if args.old_tree:
            modes["old tree"] = (os.path.abspath(args.old_tree), run)
        times: dict[str, list] = {m: [] for m in modes}
        rss: dict[str, float] = {}
        outputs: dict[str, str] = {}
        for _ in range(args.rounds):
            for mode, (tree, path) in modes.items():
                dt, peak, out = show(tree, path)
                times[mode].append(dt)
                rss[mode] = max(rss.get(mode, 0), peak)
                outputs[mode] = out.replace(plain, run)
        base = statistics.median(times["summaries"])
        print(f"\nshow of the run ({args.rounds} rounds, alternating; fresh interpreter each, wall seconds):")
        print(f"  {'mode':<12} {'median':>8} {'ratio':>8} {'peak MB':>9}   all")
        for mode, ts in times.items():
            med = statistics.median(ts)
            print(f"  {mode:<12} {med:8.2f} {med / base:7.2f}x {rss[mode]:9.0f}   "
                  + " ".join(f"{t:.2f}" for t in ts))
        same = len(set(outputs.values())) == 1
        print(f"\nsame output in every mode: {'yes' if same else 'NO'}")
        if not same:
            for mode, out in outputs.items():
                print(f"--- {mode}\n{out}")
            sys.exit(1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
