"""Compare across parallelism with tensor parallelism: a ``ColwiseParallel`` layer's output is
each rank's column shard; assembled side by side, a change planted on it (``up``'s output x1.001,
a forward hook) is named at the op after it, with the planted op as the prime suspect, whichever
run is A.  2 gloo ranks (``torchrun``, loopback) against one process, ``distributed_compare_train.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dispatchprobe.cli import main
from dispatchprobe.offline.compare.parallel import _split_dim

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
SCRIPT = Path(__file__).with_name("distributed_compare_train.py")


def test_pieces_join_along_the_one_dimension_that_makes_the_whole():
    assert _split_dim([(4, 8), (4, 8)], (8, 8)) == 0          # a batch split over data-parallel ranks
    assert _split_dim([(8, 8), (8, 8)], (8, 16)) == 1         # column shards
    assert _split_dim([(2, 4, 3), (2, 4, 5)], (2, 4, 8)) == 2
    assert _split_dim([(4, 8), (4, 8)], (8, 16)) is None      # data x tensor parallel: no one dimension
    assert _split_dim([(4, 4), (4, 4)], (4, 4)) is None       # the same shape: not pieces
    assert _split_dim([(4,), (4, 1)], (8,)) is None


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tp")
    env = {**os.environ, "DISPATCHPROBE_FUSED_STATS": "0", "OMP_NUM_THREADS": "1"}
    for launch, kind, run in (([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                "2"], "tp", "planted"), ([sys.executable], "single", "clean")):
        proc = subprocess.run([*launch, str(SCRIPT), kind, str(out / kind), run], capture_output=True, text=True,
                              timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def test_change_on_a_tensor_parallel_layer_output_is_named_at_that_layer(runs, tmp_path):
    import pandas as pd
    for a, b, side in (("tp/planted", "single/clean", "A"), ("single/clean", "tp/planted", "B")):
        res = CliRunner().invoke(main, ["compare", str(runs / a), str(runs / b), "-o", str(tmp_path / side)])
        assert res.exit_code == 2, res.output
        lines = res.output.splitlines()
        assert lines[1].startswith("the runs part at step 0 forward op aten.relu.default.0.forward [<root>] "
                                   "output.0 (error: "), res.output
        assert lines[2] == f"  right after an op present in one run only (prime suspect): aten.mul.Tensor.0.forward " \
                           f"[up] in run {side} only", res.output
        table = pd.read_csv(tmp_path / side / "compare.csv")
        up = table[(table["name"] == "aten.addmm.default.0.forward") & (table["step"] == 0)].iloc[0]
        # the layer's own output (before the hook) agrees: its column shards side by side
        assert up["status"] == "pass" and up[f"how_{side.lower()}"] == "concatenated over ranks 0-1 (dim 1)", up
