"""Distributed runs checked across ranks: DDP, FSDP2 and DTensor tensor-parallel steps on 2 gloo
ranks (``torchrun``, loopback; ``ranks_train.py``) record every rank's collectives with their
process group and per-group sequence numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
SCRIPT = Path(__file__).with_name("ranks_train.py")
_RUNS: dict = {}


def launch(kind: str, out: Path, plant: str = "") -> Path:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "error::UserWarning"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(SCRIPT), kind, str(out), *([plant] if plant else [])],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One launch per parallelism and plant, shared by the tests of this module."""
    def get(kind: str, plant: str = "") -> Path:
        key = (kind, plant)
        if key not in _RUNS:
            _RUNS[key] = launch(kind, tmp_path_factory.mktemp(f"{kind}{plant}"), plant)
        return _RUNS[key]
    return get


def records(out: Path, task: str, step: int, rank: int) -> list[dict]:
    path = out / task / f"step{step}" / f"rank{rank}" / "ops.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("kind,collectives,mesh_dim", [
    ("ddp", {"c10d.allreduce_.default"}, None),
    ("fsdp", {"c10d._allgather_base_.default", "c10d._reduce_scatter_base_.default"}, "dp"),
    ("tp", {"_c10d_functional.all_reduce.default"}, "tp"),
])
def test_every_rank_records_its_collectives_with_group_and_sequence(runs, kind, collectives, mesh_dim):
    out = runs(kind)
    for task in ("statistics", "tensor"):
        seqs = {}
        for step in (0, 1):
            for rank in (0, 1):
                recs = [r for r in records(out, task, step, rank) if "collective" in r]
                assert collectives <= {r["op"] for r in recs}, (task, step, rank)
                for r in recs:
                    group = next(a for a in r["inputs"] if a.get("type") == "process_group")
                    assert group["ranks"] == [0, 1] and group["group_rank"] == rank
                    assert group.get("mesh_dim") == mesh_dim
                    assert r["collective"]["group"] == group["name"]
                seqs[step, rank] = [(r["op"], r["collective"]["seq"]) for r in recs]
        # numbered from 0 at the probe's start, continuing over steps, the same calls on both ranks
        assert seqs[0, 0] == seqs[0, 1] and seqs[1, 0] == seqs[1, 1]
        numbers = [n for _, n in seqs[0, 0] + seqs[1, 0]]
        assert numbers == list(range(len(numbers)))
        reducing = [r for r in records(out, task, 0, 0)
                    if r.get("collective", {}).get("kind") in ("all_reduce", "reduce_scatter")]
        assert reducing and all(r["collective"]["reduce_op"] in ("SUM", "AVG") for r in reducing)


def test_parameters_are_marked(runs):
    out = runs("ddp")
    addmm = [r for r in records(out, "statistics", 0, 1) if r["op"] == "aten.addmm.default" and r["stage"] == "forward"]
    # bias, input, transposed weight: the parameters (and the view of one) are marked, the batch is not
    assert [[t.get("param", False) for t in r["inputs"]] for r in addmm] == [[True, False, True]] * 2
