"""Async collectives on two process groups that each rank issues and waits for in its own order
(rank 0: A then B, rank 1: B then A), on 2 gloo ranks, under the statistics and tensor tasks; run
by ``test_collective_overlap.py`` as ``torchrun --nproc-per-node 2 overlap_train.py OUT`` (and with
``--nproc-per-node 1 ... OUT functional``: functional collectives, :func:`functional`; an early use
of a pending buffer, :func:`early`).  A probe
that waited for each collective at its call would block both ranks (rank 0 in A, which rank 1 has
not issued, rank 1 in B): the groups' timeout turns that into an error instead of a hang.  Each
rank writes ``OUT/result{rank}.json``: the reduced values it computed, and whether they match the
unprobed step's."""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from dispatchprobe import DispatchProbe
from dispatchprobe.torch import collectives
from parallel_models import run_and_end

TIMEOUT = datetime.timedelta(seconds=60)


def step(groups, rank: int) -> list:
    a = torch.arange(6.0) + 10 * rank
    b = torch.linspace(-1.0, 1.0, 5) * (rank + 2)
    order = [("A", a), ("B", b)] if rank == 0 else [("B", b), ("A", a)]
    x = a.exp()             # computation while the collectives are in flight
    works = [(name, dist.all_reduce(t, group=groups[name], async_op=True)) for name, t in order]
    y = (x * 2).sum()
    for _, w in works:
        w.wait()
    values = [a.tolist(), b.tolist(), float(y + a.sum() + b.sum())]
    a.mul_(0.5)             # the reduced buffer overwritten right after the wait (as DDP's averaging does)
    return values


def late(out: str, group, rank: int) -> None:
    """Rank 0 ends a step without waiting for an all-reduce that rank 1 joins only afterwards:
    the probe waits a bounded time at the step's end, records the result as not waited for, and
    the program's own wait later gets the sum."""
    marker = os.path.join(out, "late-step-ended")
    x = torch.full((3,), float(rank + 1))
    if rank == 0:
        collectives.SETTLE_S = 1.0
        probe = DispatchProbe(task="statistics", dump_path=os.path.join(out, "late"))
        with probe:
            work = dist.all_reduce(x, group=group, async_op=True)
        probe.step()
        probe.close()
        open(marker, "w").close()
        work.wait()
    else:
        deadline = time.monotonic() + 60
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        dist.all_reduce(x, group=group)
    with open(os.path.join(out, f"late{rank}.json"), "w") as f:
        json.dump(x.tolist(), f)


def early(out: str, group, rank: int) -> None:
    """Rank 0 takes a view of an all-reduce's buffer (an op on its memory) before rank 1 has
    joined it: the probe does not wait for the work there (rank 1 joins only after the view), and
    records the sum once rank 0's own wait has completed it."""
    marker = os.path.join(out, "early-viewed")
    x = torch.arange(3.0) + 10 * rank
    if rank == 0:
        probe = DispatchProbe(task="statistics", dump_path=os.path.join(out, "early"))
        with probe:
            work = dist.all_reduce(x, group=group, async_op=True)
            t0 = time.monotonic()
            x.view(3, 1)
            viewed_s = time.monotonic() - t0
            open(marker, "w").close()
            work.wait()
        probe.step()
        probe.close()
        with open(os.path.join(out, "early0.json"), "w") as f:
            json.dump({"viewed_s": viewed_s, "sum": x.tolist()}, f)
    else:
        deadline = time.monotonic() + 60
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        dist.all_reduce(x, group=group)


def functional(out: str) -> None:
    """Functional collectives (DTensor's): one whose result is used (recorded with its values
    where it was called), one never waited for (its outputs recorded as not waited for)."""
    import torch.distributed._functional_collectives as fc
    probe = DispatchProbe(task="statistics", dump_path=os.path.join(out, "functional"))
    x = torch.arange(4.0)
    with probe:
        used = fc.all_reduce(x, "sum", dist.group.WORLD)
        (used * 2).sum()
        fc.all_reduce(x + 1, "sum", dist.group.WORLD)
        (x - 1).sum()
    probe.step()
    probe.close()


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo", timeout=TIMEOUT)
    if sys.argv[2:] == ["functional"]:
        functional(out)
        dist.destroy_process_group()
        return
    rank = dist.get_rank()
    groups = {"A": dist.new_group([0, 1], timeout=TIMEOUT), "B": dist.new_group([0, 1], timeout=TIMEOUT)}
    plain = step(groups, rank)
    result = {}
    for task in ("statistics", "tensor"):
        probe = DispatchProbe(task=task, dump_path=os.path.join(out, task))
        for _ in range(2):
            with probe:
                probed = step(groups, rank)
            probe.step()
        probe.close()
        result[task] = {"identical": probed == plain, "values": probed}
    late(out, groups["A"], rank)
    early(out, groups["A"], rank)
    with open(os.path.join(out, f"result{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_and_end(main)
