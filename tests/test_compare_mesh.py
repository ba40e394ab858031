"""A data-parallel x tensor-parallel mesh (4 gloo ranks: FSDP2 over ``dp`` x DTensor tensor
parallelism over ``tp``, ``torchrun``, loopback; ``mesh_compare_train.py``) against one process of
the same model and global batch.  compare pairs every forward op and the backward ops but the
weights' gradients before their reduction: the ranks of one tensor-parallel group hold one share
of the batch (replicas taken once, column shards side by side, partial sums added), the shares
concatenated along the batch, a gradient divided by the 2 shares whose losses are means.  A wrong tanh kernel on rank
1 alone, before the tensor-parallel block, is named with its rank by compare (in both orders) and
by ``ranks`` (rank 1 and its tensor-parallel peer rank 0 ran tanh on equal inputs); a wrong relu
on rank 1 inside the block's column shards is named at relu, on rank 1 where tensors are saved; a
clean run passes both, ``ranks`` saying what tensor parallelism leaves it unable to judge.  A Llama
MLP with a residual around it (``gated``) sums its input's gradient terms in another order on the mesh
(the residual's last, after the tensor-parallel all-reduces): those partial sums are not paired, never
an error, and a wrong gelu on rank 1 is still named with its rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from click.testing import CliRunner

from dispatchprobe import compare as compare_runs
from dispatchprobe.cli import main

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
SCRIPT = Path(__file__).with_name("mesh_compare_train.py")
TASKS = ("statistics", "tensor")
FORWARD = {("pre", "aten.addmm.default.0.forward"): "each equal",
           ("", "aten.tanh.default.0.forward"): "each equal",
           ("block.up", "aten.addmm.default.0.forward"): "each side by side (dim 1)",
           ("block", "aten.relu.default.0.forward"): "each side by side (dim 1)",
           ("block.down", "aten.addmm.default.0.forward"): "each summed",
           ("", "aten.pow.Tensor_Scalar.0.forward"): "each equal"}
BACKWARD = {("block.down", "aten.mm.default.0.backward"): "each side by side (dim 1)",   # down's input gradient
            ("block", "aten.threshold_backward.default.0.backward"): "each side by side (dim 1)",
            ("block.up", "aten.mm.default.0.backward"): "each summed",        # up's input gradient, before its all-reduce
            ("", "aten.tanh_backward.default.0.backward"): "each equal"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mesh")
    # FSDP2 warns that a row-wise parallel layer returns a view (its output is the local tensor)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "error::UserWarning,ignore:FSDP2-wrapped module"}
    for launch, kind, plants in (([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                   "4"], "fsdp_tp", ("clean", "tanh1", "relu1", "gated", "gatedgelu1")),
                                 ([sys.executable], "single", ("clean", "gated"))):
        proc = subprocess.run([*launch, str(SCRIPT), kind, str(out / kind), *plants], capture_output=True, text=True,
                              timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def compare(a: Path, b: Path, out: Path) -> tuple[int, list[str], pd.DataFrame]:
    res = CliRunner().invoke(main, ["compare", str(a), str(b), "-o", str(out)])
    return res.exit_code, res.output.splitlines(), pd.read_csv(out / "compare.csv")


@pytest.mark.parametrize("task", TASKS)
def test_clean_mesh_pairs_every_forward_op_with_one_process(runs, task, tmp_path):
    mesh, single = runs / "fsdp_tp" / "clean" / task, runs / "single" / "clean" / task
    for a, b, side in ((mesh, single, "a"), (single, mesh, "b")):
        code, lines, table = compare(a, b, tmp_path / side)
        assert code == 0 and lines[1].startswith("the runs agree"), lines
        forward = table[table["what"] == "forward"]
        for step in (0, 1):
            rows = forward[forward["step"] == step]
            how = {(str(sc) if sc == sc else "", n): h for sc, n, h in zip(rows["scope"], rows["name"], rows[f"how_{side}"])}
            assert set(how) == set(FORWARD), how
            for key, joined in FORWARD.items():
                assert how[key] == f"concatenated (dim 0) over shares [[0, 1], [2, 3]], {joined}", (key, how[key])
        backward = table[(table["what"] == "backward") & (table["step"] == 0)]
        how = {(str(sc) if sc == sc else "", n): h for sc, n, h in zip(backward["scope"], backward["name"],
                                                                      backward[f"how_{side}"])}
        for key, joined in BACKWARD.items():
            assert how[key] == (f"concatenated (dim 0) over shares [[0, 1], [2, 3]], {joined}, divided by 2 (a mean "
                                "over each of 2 shares)"), (key, how)
        assert set(table["status"]) == {"pass"}, table[table["status"] != "pass"]
        # what stays unpaired: RowwiseParallel's own op (its bias divided over the group) and the weights'
        # gradients before their reduction over the data-parallel group, never a forward value
        unpaired = [x for x in lines if x.startswith("not paired:") and "forward op(s) in run" not in x]
        assert unpaired and all(" backward op aten." in x and "each share's own sum over its part of the batch (a "
                                "weight's gradient before its reduction" in x for x in unpaired if "more" not in x), lines


def _part_on_rank_1(mesh, single, name: str, tmp_path) -> dict:
    """Both orders of the mesh run against the single one: exit 2, the runs parting at step 0's
    forward op ``name`` on rank 1; each order's table, by the mesh run's side."""
    tables = {}
    for a, b, side in ((mesh, single, "a"), (single, mesh, "b")):
        code, lines, tables[side] = compare(a, b, tmp_path / side)
        assert code == 2, lines
        assert lines[1].startswith(f"the runs part at step 0 forward op {name} [<root>] output.0 on rank 1 (error: "), \
            lines
    return tables


@pytest.mark.parametrize("task", TASKS)
def test_wrong_kernel_on_one_tensor_parallel_rank_is_named_with_its_rank(runs, task, tmp_path):
    mesh, single = runs / "fsdp_tp" / "tanh1" / task, runs / "single" / "clean" / task
    for side, table in _part_on_rank_1(mesh, single, "aten.tanh.default.0.forward", tmp_path).items():
        tanh = table[(table["step"] == 0) & (table["name"] == "aten.tanh.default.0.forward")].iloc[0]
        assert tanh[f"how_{side}"].startswith("rank 1 (its tensor-parallel peers differ): "), tanh
        before = table[(table["step"] == 0) & (table["scope"] == "pre") & (table["what"] == "forward")].iloc[0]
        assert before["status"] == "pass", before


@pytest.mark.parametrize("task", TASKS)
def test_wrong_kernel_inside_column_shards_is_placed_in_its_rank_where_tensors_are_saved(runs, task, tmp_path):
    """relu x1.01 on rank 1, whose pieces are its own columns of the block's activation: the whole
    value errs at relu; saved tensors place the difference in rank 1's columns, statistics cannot
    (the verdict names the op alone)."""
    mesh, single = runs / "fsdp_tp" / "relu1" / task, runs / "single" / "clean" / task
    on = " on rank 1" if task == "tensor" else ""
    for a, b, side in ((mesh, single, "a"), (single, mesh, "b")):
        code, lines, _ = compare(a, b, tmp_path / side)
        assert code == 2, lines
        assert lines[1].startswith(f"the runs part at step 0 forward op aten.relu.default.0.forward [block] "
                                   f"output.0{on} (error: "), lines


def ranks(run: Path) -> tuple[int, list[str]]:
    res = CliRunner().invoke(main, ["ranks", str(run)])
    return res.exit_code, res.output.splitlines()


@pytest.mark.parametrize("task", TASKS)
def test_ranks_judges_tensor_parallel_peers_on_equal_inputs(runs, task):
    code, lines = ranks(runs / "fsdp_tp" / "clean" / task)
    # the ops each rank ran on its own column shards are held by no other rank: not judged, so exit 1
    assert code == 1 and lines[0].startswith("cannot judge: ") and \
        " op(s) tensor-parallel ranks ran on pieces of their own " in lines[0], lines
    assert lines[1].startswith("the ranks agree on what they could judge: "), lines
    assert "tensor-parallel groups [0, 1], [2, 3]: ops their members ran on equal inputs compared across them, " \
           in lines[1] and "not judged here (compare the run with a run of other parallelism" in lines[1], lines
    code, lines = ranks(runs / "fsdp_tp" / "tanh1" / task)
    assert code == 2, lines
    assert lines[0].startswith("replica drift on rank 1: aten.tanh.default [FSDPInputMLP] (step 0, forward): computed "
                               "by tensor-parallel peers from equal inputs output.0 differs on rank 1 from rank 0: "), lines
    assert "(no majority: rank 0 is the reference as the lowest rank, not as the right one" in lines[0], lines
    assert lines[0].endswith("held equal by ranks 0, 1"), lines


@pytest.mark.parametrize("task", TASKS)
def test_gradient_terms_summed_in_another_order_are_not_paired(runs, task, tmp_path):
    """The block's input gradient: one process adds the residual's term to ``up``'s, then ``gate``'s;
    the mesh adds ``up``'s and ``gate``'s after their all-reduces, then the residual's.  The n-th
    backward ``add`` of a module then sums other terms in each run: not paired (once an error naming
    ``add`` for two clean runs), while what reads the whole sum (gelu's backward) is, in both orders."""
    mesh, single = runs / "fsdp_tp" / "gated" / task, runs / "single" / "gated" / task
    for a, b, side in ((mesh, single, "a"), (single, mesh, "b")):
        code, lines, table = compare(a, b, tmp_path / side)
        assert code == 0 and lines[1].startswith("the runs agree"), lines
        assert set(table["status"]) == {"pass"}, table[table["status"] != "pass"]
        backward = table[(table["what"] == "backward") & (table["step"] == 0)]
        assert "aten.gelu_backward.default.0.backward" in set(backward["name"]), backward
        assert "aten.add.Tensor.0.backward" not in set(backward["name"]), backward
        unpaired = next(x for x in compare_runs(a, b).verdict.unpaired
                        if x.startswith("step 0 backward op aten.add.Tensor.0.backward"))
        single_run = "A" if side == "b" else "B"
        assert f"read by run {single_run} only: aten.threshold_backward.default.0.backward [<root>]" in unpaired, unpaired


@pytest.mark.parametrize("task", TASKS)
def test_wrong_gelu_before_a_gated_block_is_named_with_its_rank(runs, task, tmp_path):
    mesh, single = runs / "fsdp_tp" / "gatedgelu1" / task, runs / "single" / "gated" / task
    _part_on_rank_1(mesh, single, "aten.gelu.default.0.forward", tmp_path)
    code, lines = ranks(mesh)
    assert code == 2 and lines[0].startswith("replica drift on rank 1: aten.gelu.default [FSDPResidualGatedMLP] (step "
                                             "0, forward): computed by tensor-parallel peers from equal inputs "), lines


@pytest.fixture(scope="module")
def mesh3_runs(runs) -> Path:
    """The gated MLP on the 2x2x2 mesh (HSDP over replicate x shard, tensor parallelism over tp; 8 ranks)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "error::UserWarning,ignore:FSDP2-wrapped module"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8",
                           str(SCRIPT), "hsdp_tp", str(runs / "hsdp_tp"), "gated", "gatedgelu1"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return runs


@pytest.mark.parametrize("task", TASKS)
def test_shares_of_a_3d_mesh_follow_the_flattened_data_parallel_rank(mesh3_runs, task, tmp_path):
    """HSDP's two data-parallel dimensions split the batch as their flattened rank (replicate-major): the
    shares are laid in that order, not by the shard index alone (which interleaves the replicas' quarters
    and made every forward op an error on the clean run's tensors), in both orders; a wrong gelu on rank 1
    is still named with its rank."""
    mesh, single = mesh3_runs / "hsdp_tp" / "gated" / task, mesh3_runs / "single" / "gated" / task
    for a, b, side in ((mesh, single, "a"), (single, mesh, "b")):
        code, lines, table = compare(a, b, tmp_path / side)
        assert code == 0 and lines[1].startswith("the runs agree"), lines
        forward = table[table["what"] == "forward"]
        assert len(forward) and (forward["status"] == "pass").all(), forward
        assert forward[f"how_{side}"].str.startswith("concatenated (dim 0) over shares [[0, 1], [2, 3], [4, 5], [6, 7]]").all()
    _part_on_rank_1(mesh3_runs / "hsdp_tp" / "gatedgelu1" / task, single, "aten.gelu.default.0.forward", tmp_path)
