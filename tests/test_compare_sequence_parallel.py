"""compare across parallelism with sequence parallelism (``sequence_parallel_train.py``: 2 gloo
ranks under ``torchrun``, against one process): the sequence shards laid side by side, the partial
sums a reduce-scatter adds up (a row-wise layer's output, a column-wise layer's input gradient)
added, the LayerNorm's Partial weight gradients summed where tensors are saved, so every forward
op pairs; a wrong relu on rank 1 is named on rank 1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dispatchprobe import compare

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
SCRIPT = Path(__file__).with_name("sequence_parallel_train.py")
ENV = {**os.environ, "DISPATCHPROBE_FUSED_STATS": "0", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sequence_parallel")
    for launch, kind in (([sys.executable], "single"),
                         ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"], "sp")):
        proc = subprocess.run([*launch, str(SCRIPT), kind, str(out / kind), "clean", "stats", "relu1"],
                              capture_output=True, text=True, timeout=300, env=ENV, check=False)
        assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def _both_orders(runs: Path, a: str, b: str):
    return [compare(runs / a, runs / b), compare(runs / b, runs / a)]


@pytest.mark.parametrize("run", ["clean", "stats"])
def test_sequence_parallel_pairs_every_forward_op_with_one_process(runs, run):
    for table, verdict in _both_orders(runs, f"sp/{run}", f"single/{run}"):
        assert verdict.passed and verdict.parted is None, str(verdict)
        assert not [u for u in verdict.unpaired if " op aten" in u], verdict.unpaired
        step0 = table[table["step"] == 0]
        how = step0["how_a"] + " | " + step0["how_b"]       # the run of 2 ranks is A or B
        forward = step0[step0["what"] == "forward"]
        assert len(forward) == 8 and set(forward["status"]) == {"pass"}, forward
        norm = how[forward[forward["scope"] == "norm"].index]
        assert len(norm) == 3 and norm.str.contains("concatenated over ranks 0-1 (dim 1)", regex=False).all(), norm
        summed = step0[how.str.contains("summed over ranks 0-1", regex=False)]
        assert set(zip(summed["what"], summed["scope"])) == {("forward", "down"), ("backward", "head"),
                                                             ("backward", "up")}, summed
        grads = step0[step0["what"] == "grad"]
        assert ("norm.weight" in set(grads["name"])) == (run == "clean"), grads   # a Partial sum: from tensors


def test_a_wrong_kernel_on_one_rank_under_sequence_parallelism_is_named_on_it(runs):
    for _, verdict in _both_orders(runs, "sp/relu1", "single/clean"):
        assert not verdict.passed, str(verdict)
        assert "the runs part at step 0 forward op aten.relu.default.0.forward [<root>] output.0 on rank 1" in str(verdict)
