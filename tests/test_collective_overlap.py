"""Collectives are recorded when the program's wait completes them, never waited for at their call:
async all-reduces on two groups that the 2 gloo ranks issue and wait for in opposite orders
(``overlap_train.py``, ``torchrun`` on loopback) finish under the probe as they do unprobed, with
each record at its call's place and holding the reduced values; one still running when the step
ends is recorded as not waited for after a bounded wait."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dispatchprobe.cli import main

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
SCRIPT = Path(__file__).with_name("overlap_train.py")


def _records(out: Path, task: str, step: int, rank: int) -> list[dict]:
    path = out / task / f"step{step}" / f"rank{rank}" / "ops.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _launch(nproc: int, *args) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_rank_dependent_waits_on_two_groups_do_not_block(tmp_path):
    # the groups time out after 60 s: a probe that waited at the call fails the launch, never hangs it
    _launch(2, tmp_path)
    reduced = {"A": (20.0, 10.0), "B": (5.0, -5.0)}        # (max, min) of the sums over both ranks
    for rank in (0, 1):
        result = json.loads((tmp_path / f"result{rank}.json").read_text())
        assert all(r["identical"] for r in result.values()), result
        names = {}
        for task in ("statistics", "tensor"):
            for step in (0, 1):
                records = _records(tmp_path, task, step, rank)
                ops = [r["op"] for r in records]
                calls = [r for r in records if r["op"] == "c10d.allreduce_.default"]
                assert len(calls) == 2
                # in call order: the exp before both, the multiply after both, whatever the completion
                assert ops.index("aten.exp.default") < records.index(calls[0])
                assert records.index(calls[1]) < len(ops) - 1 - ops[::-1].index("aten.mul.Tensor")
                assert [r["id"] for r in records] == list(range(len(records)))
                for rec in calls:
                    out = rec["outputs"][0]["value"][0]
                    assert "no_values" not in out
                    group = rec["collective"]["group"]
                    names.setdefault(group, "A" if out["stats"]["max"] == 20.0 else "B")
                    assert (out["stats"]["max"], out["stats"]["min"]) == reduced[names[group]], (rank, rec)
                    assert rec["collective"]["seq"] == step
                # rank 0 issues A first, rank 1 B first
                first = names[calls[0]["collective"]["group"]]
                assert first == ("A" if rank == 0 else "B")
    for task in ("statistics", "tensor"):
        # the collectives agree; the ranks reduce in the forward only, as tensor-parallel peers do, and the
        # ops on each rank's own values are held by no other rank: not judged, so exit 1
        res = CliRunner().invoke(main, ["ranks", str(tmp_path / task)])
        lines = res.output.splitlines()
        assert res.exit_code == 1 and lines[0].startswith("cannot judge: "), res.output[-3000:]
        assert lines[1].startswith("the ranks agree on what they could judge: ") and \
            " 0 differ, 0 not judged;" in lines[1], res.output[-3000:]
    # a collective still running when the step ended: a bounded wait, then recorded as not waited for
    assert [json.loads((tmp_path / f"late{rank}.json").read_text()) for rank in (0, 1)] == [[3.0] * 3] * 2
    (late,) = [r for r in _records(tmp_path, "late", 0, 0) if r["op"] == "c10d.allreduce_.default"]
    assert late["outputs"][0]["value"][0]["no_values"] == "collective not complete 1 s after the step's end"
    assert late["inputs"][0]["value"][0]["stats"]["max"] == 1.0        # the input as given (copied first)
    # a view of a buffer whose all-reduce the other rank has not joined: no wait there, the sum recorded
    early = json.loads((tmp_path / "early0.json").read_text())
    assert early["sum"] == [10.0, 12.0, 14.0] and early["viewed_s"] < 0.5, early
    (reduced_rec,) = [r for r in _records(tmp_path, "early", 0, 0) if r["op"] == "c10d.allreduce_.default"]
    out = reduced_rec["outputs"][0]["value"][0]
    assert "no_values" not in out and (out["stats"]["max"], out["stats"]["min"]) == (14.0, 10.0), out


def test_functional_collective_is_recorded_at_its_first_use(tmp_path):
    _launch(1, tmp_path, "functional")
    records = _records(tmp_path, "functional", 0, 0)
    used, unused = [r for r in records if r["op"] == "_c10d_functional.all_reduce.default"]
    ops = [r["op"] for r in records]
    # each at its call's place: before the ops that ran while it was pending
    assert ops.index("aten.mul.Tensor") > records.index(used) and ops.index("aten.sub.Tensor") > records.index(unused)
    assert used["outputs"][0]["stats"]["max"] == 3.0 and "no_values" not in used["outputs"][0]
    assert unused["outputs"][0]["no_values"] == "result of a collective not waited for within the step"
    assert unused["inputs"][0]["stats"]["max"] == 4.0          # its input, as given


def _one_rank(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    return dist


def test_a_write_no_version_counter_sees_leaves_the_record_as_the_collective_left_it(tmp_path):
    """A thread the probe does not see writes the reduced buffer through ``.data`` (its own version
    counter: the buffer's does not move) after the work completed and before the next op: the
    record holds the result as the collective left it (the bytes differ from the copy taken at
    completion), the next op reads the buffer as written."""
    import threading
    from dispatchprobe import DispatchProbe
    dist = _one_rank(tmp_path)
    try:
        probe = DispatchProbe(task="statistics", dump_path=str(tmp_path / "run"))
        x = torch.arange(4.0)
        with probe:
            work = dist.all_reduce(x, async_op=True)
            work.get_future().then(lambda _: None).wait()    # callbacks run in order: the probe's copy is taken
            version = x._version
            writer = threading.Thread(target=lambda: x.data.mul_(2))
            writer.start()
            writer.join()
            assert x._version == version
            (x + 1).sum()
        probe.close()
    finally:
        dist.destroy_process_group()
    records = _records(tmp_path, "run", 0, 0)
    (reduced,) = [r for r in records if r["op"] == "c10d.allreduce_.default"]
    assert reduced["outputs"][0]["value"][0]["stats"]["max"] == 3.0
    assert reduced["inputs"][0]["value"][0]["stats"]["max"] == 3.0
    (added,) = [r for r in records if r["op"] == "aten.add.Tensor"]
    assert added["inputs"][0]["stats"]["max"] == 6.0


@pytest.mark.parametrize("make", [
    lambda: torch.randn(1000),
    lambda: torch.tensor([float("nan"), 1.0, float("inf")]),
    lambda: torch.randn(6, 5).t(),                  # not contiguous: compared word by word
    lambda: torch.randn(7, dtype=torch.float64)[1:],
    lambda: torch.arange(9, dtype=torch.uint8),
    lambda: torch.empty(0),
])
def test_same_bytes_is_bit_equality(make):
    from dispatchprobe.torch.collectives import _same_bytes
    a = make()
    assert _same_bytes(a, a.clone())
    if a.numel():
        b, last = a.clone(), (-1,) * a.dim()
        old = a[last].item()
        b[last] = (0.5 if old != 0.5 else 0.25) if a.dtype.is_floating_point else (int(old) + 1) % 256
        assert not _same_bytes(a, b)
    assert not _same_bytes(torch.tensor([0.0]), torch.tensor([-0.0]))      # equal numbers, other bits


def test_a_send_before_a_receive_on_both_ranks_does_not_block(tmp_path):
    """Both ranks send before they receive; gloo's send and receive works give no future, and a probe
    waiting at the call blocked both ranks until the group timed out.  Now each is recorded when it
    has completed: the program receives what the peer sent, and the records hold the values sent."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(SCRIPT.with_name("p2p_train.py")), str(tmp_path)], capture_output=True, text=True,
                          timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"result{rank}.json").read_text())
        assert got == {"received": [2.0 - rank] * 4, "doubled": [2 * (2.0 - rank)] * 4}
        recs = _records(tmp_path, "run", 0, rank)
        send = next(r for r in recs if r["op"] == "c10d.send.default")
        assert send["inputs"][0]["value"][0]["stats"]["max"] == rank + 1.0
        assert [r["op"] for r in recs if r["op"].startswith("c10d.")] == ["c10d.send.default", "c10d.recv_.default"]
        doubled = next(r for r in recs if r["op"] == "aten.mul.Tensor")
        assert doubled["outputs"][0]["stats"]["max"] == 2 * (2.0 - rank)
