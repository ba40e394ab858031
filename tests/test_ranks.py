"""Distributed runs checked across ranks: DDP, FSDP2 and DTensor tensor-parallel steps on 2 gloo
ranks (``torchrun``, loopback; ``ranks_train.py``) record every rank's collectives with their
process group and per-group sequence numbers; on N-D device meshes (4 gloo ranks: FSDP2 with
tensor parallelism and HSDP on 2x2 meshes; 8: both on a 2x2x2 mesh) ``ranks`` takes its groups
from the process groups each collective reduces over."""

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


PLANTS = {"ddp": ("clean", "calls", "nudge", "hook", "inf"), "fsdp": ("clean",), "tp": ("clean", "relu1")}


ND = {"nd": (4, ("fsdp_tp-clean", "hsdp-clean", "hsdp-nudge")),      # launch -> ranks, plants
      "nd3": (8, ("hsdp_tp-clean", "hsdp_tp-nudge"))}
PLANTS.update({k: plants for k, (_, plants) in ND.items()})


def launch(kind: str, out: Path) -> Path:
    # FSDP2 warns that a row-wise parallel layer returns a view (its output is the local tensor)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "error::UserWarning,ignore:FSDP2-wrapped module"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(ND[kind][0] if kind in ND else 2), str(SCRIPT), "nd" if kind in ND else kind, str(out),
                           *PLANTS[kind]],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One launch per parallelism (every plant of it), shared by the tests of this module."""
    def get(kind: str, plant: str = "clean") -> Path:
        if kind not in _RUNS:
            _RUNS[kind] = launch(kind, tmp_path_factory.mktemp(kind))
        return _RUNS[kind] / plant
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


# ---- dispatchprobe ranks --------------------------------------------------------------------------
def ranks(run: Path, *args) -> tuple[int, str]:
    from click.testing import CliRunner
    from dispatchprobe.cli import main
    res = CliRunner().invoke(main, ["ranks", str(run), *args])
    return res.exit_code, res.output


def assert_agree(code: int, out: str, tensor_parallel: bool) -> None:
    """The ranks agree: exit 0; under tensor parallelism only on what they could judge, the ops each rank
    ran on pieces of its own not judged: exit 1, that said first, never an error."""
    lines = out.splitlines()
    if not tensor_parallel:
        assert code == 0 and lines[0].startswith("the ranks agree: ") and " 0 differ, 0 not judged;" in lines[0], out
        return
    assert code == 1, out
    assert lines[0].startswith("cannot judge: ") and " op(s) tensor-parallel ranks ran on pieces of their own " \
        "(column or sequence shards, partial sums; the first: " in lines[0], out
    assert lines[1].startswith("the ranks agree on what they could judge: ") and " 0 differ, 0 not judged;" in lines[1], out


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "tp"])
def test_clean_runs_agree(runs, kind, tmp_path):
    import pandas as pd
    for task in ("statistics", "tensor"):
        code, out = ranks(runs(kind) / task, "-o", str(tmp_path / task))
        assert_agree(code, out, kind == "tp")
        table = pd.read_csv(tmp_path / task / "ranks.csv")
        calls = table[table["check"] == "collective"]
        assert len(calls) and (calls["status"] == "agree").all()
        if task == "tensor":      # values checked against the semantics, from the saved tensors
            assert not calls["detail"].str.contains("not checked").any(), calls["detail"].tolist()


def test_a_wrong_kernel_on_one_ranks_column_shards_is_not_said_to_agree(runs, tmp_path):
    """relu x1.05 on rank 1 of a 2-rank tensor-parallel MLP, on its column shards of ``up``'s output: no
    other rank holds those values and the row-wise ``down`` all-reduces what follows from them into values
    both ranks hold equal, so no check here can see it.  The verdict says it cannot judge those ops
    (exit 1), as of the clean run, never that the ranks agree."""
    for task in ("statistics", "tensor"):
        verdicts = {}
        for plant in ("relu1", "clean"):
            code, out = ranks(runs("tp", plant) / task)
            assert_agree(code, out, True)
            verdicts[plant] = out.splitlines()[0]
        assert verdicts["relu1"] == verdicts["clean"], verdicts
        assert "the first: aten.addmm.default [MLP.up] (step 0, forward) on rank 0" in verdicts["relu1"], verdicts


def test_each_kind_of_collective_is_checked(runs, tmp_path):
    """Every collective agrees with its semantics.  The ranks reduce over their group in the forward
    only, as tensor-parallel peers do, and copy or scale values of their own (``clone``): ops no other
    rank holds, so the verdict cannot judge those (exit 1), never that everything agrees."""
    import pandas as pd
    for task in ("statistics", "tensor"):
        code, out = ranks(runs("ddp", "calls") / task, "-o", str(tmp_path / task))
        assert_agree(code, out, True)
        calls = pd.read_csv(tmp_path / task / "ranks.csv")
        assert set(calls["op"]) == {"c10d.allreduce_.default", "c10d._allgather_base_.default",
                                    "c10d._reduce_scatter_base_.default", "c10d.broadcast_.default",
                                    "_c10d_functional.all_reduce.default",
                                    "_c10d_functional.all_gather_into_tensor.default"}
        assert (calls["status"] == "agree").all() and len(calls) == 14, calls
    run = _copy(runs("ddp", "calls") / "statistics", tmp_path / "edited")

    def moved(r):         # rank 0's broadcast result is no longer root rank 1's input
        r["outputs"][0]["value"][0]["stats"]["max"] += 1.0
    _edit(run / "step1" / "rank0", "c10d.broadcast_.default", moved)
    code, out = ranks(run)
    assert code == 2 and out.startswith("collective #11 on group 0 differs: c10d.broadcast_.default [<top>] "
                                        "(step 1, forward): rank 0's result is not root rank 1's input"), out


def test_replica_nudged_after_ddp_broadcast_is_named(runs):
    for task, how in (("statistics", "statistics differ"), ("tensor", "1 of 128 elements differ, by up to 0.001")):
        code, out = ranks(runs("ddp", "nudge") / task)
        assert code == 2, out
        first = out.splitlines()[0]
        assert first.startswith("replica drift on rank 1: aten.addmm.default [DistributedDataParallel.module.up] "
                                "(step 0, forward): parameter input.2 differs on rank 1 from rank 0: "), first
        assert how in first


def test_comm_hook_that_alters_one_ranks_bucket_is_named(runs):
    for task in ("statistics", "tensor"):
        code, out = ranks(runs("ddp", "hook") / task)
        assert code == 2, out
        first = out.splitlines()[0]
        # the gradient the optimizer applies (the parameter records), after DDP's all-reduce
        assert first.startswith("replica drift on rank 1: param.grad [up.weight] (step 0, optimizer): gradient (as "
                                "the optimizer applies it) up.weight differs on rank 1 from rank 0: "), first
        # the collective the replicas came out of equal (the hook's rescaling runs in its future's
        # callback, in gloo's thread as unprobed: the probe no longer waits at the call, which
        # ran it inline, so the op is not recorded and the drift is named after the collective)
        assert "the last collective before it: c10d.allreduce_.default #0 on group 0 " \
               "[DistributedDataParallel.module.up]" in first
        assert " 0 differ," in out.splitlines()[1]        # the all-reduce itself is right


def test_inf_planted_on_one_rank_is_traced_to_its_origin(runs, tmp_path):
    import pandas as pd
    for task in ("statistics", "tensor"):
        code, out = ranks(runs("ddp", "inf") / task, "-o", str(tmp_path / task))
        assert code == 2, out
        assert out.splitlines()[0] == (
            "inf/nan started on rank 1: aten.pow.Tensor_Scalar [<top>] (step 0, forward): rank 1 made inf/nan from "
            "finite inputs in aten.pow.Tensor_Scalar [<top>] (forward); rank 0 received them through "
            "c10d.allreduce_.default #0 on group 0 [DistributedDataParallel.module.up]"), out
        table = pd.read_csv(tmp_path / task / "ranks.csv")
        rows = table[(table["check"] == "inf/nan") & (table["step"] == 0)].set_index("rank")
        assert rows.loc[1, "status"] == "inf/nan origin" and rows.loc[0, "status"] == "inf/nan received"
        assert rows.loc[0, "op"] == "c10d.allreduce_.default" and rows.loc[0, "seq"] == 0


def _copy(run: Path, tmp_path: Path) -> Path:
    import shutil
    dest = tmp_path / run.name
    shutil.copytree(run, dest)
    return dest


def _edit(part: Path, op: str, change, every: bool = False) -> None:
    lines = [json.loads(line) for line in (part / "ops.jsonl").read_text().splitlines()]
    for r in lines:
        if r["op"].startswith(op):
            change(r)
            if not every:
                break
    (part / "ops.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_collective_semantics_and_mismatched_calls_are_named(runs, tmp_path):
    run = _copy(runs("fsdp") / "statistics", tmp_path / "a")

    def shifted(r):       # rank 1's all-gather result moved: it no longer holds what rank 0's does
        r["outputs"][0]["stats"]["mean"] += 0.01
    _edit(run / "step1" / "rank1", "c10d._allgather_base_.default", shifted)
    code, out = ranks(run)
    assert code == 2 and out.startswith("collective #6 on group 0 differs: c10d._allgather_base_.default "
                                        "[FSDPMLP.up] (step 1, forward): results differ across ranks: rank 1"), out

    run = _copy(runs("ddp") / "statistics", tmp_path / "b")

    def reshaped(r):      # rank 1 reduces a bucket of another size at the same sequence number
        r["inputs"][0]["value"][0]["shape"] = [140]
    _edit(run / "step0" / "rank1", "c10d.allreduce_.default", reshaped)
    code, out = ranks(run)
    assert code == 2 and "rank 1 calls c10d.allreduce_.default SUM (float32[140]) where rank 0 calls " \
                         "c10d.allreduce_.default SUM (float32[280])" in out.splitlines()[0], out


def test_missing_rank_cannot_be_judged(runs, tmp_path):
    import shutil
    run = _copy(runs("ddp") / "statistics", tmp_path)
    shutil.rmtree(run / "step1" / "rank1")
    code, out = ranks(run)
    assert code == 1 and out.startswith("cannot judge: step 1: rank 1's records are missing"), out


def test_ranks_page_marks_the_first_finding(runs, tmp_path):
    from html_check import page_data
    ranks(runs("ddp", "nudge") / "tensor", "-o", str(tmp_path))
    data = page_data((tmp_path / "ranks.html").read_text())
    mark = data["marks"]["forward"]
    assert data["nodes"][mark["node"]]["path"] == "DistributedDataParallel.module.up"
    assert mark["text"] == "first forward finding: aten.addmm.default (step 0 rank 1)"


def test_a_result_that_is_not_the_reduction_is_named_from_statistics(runs, tmp_path):
    run = _copy(runs("ddp") / "statistics", tmp_path)

    def off(r):           # both ranks' results equal, but no longer the sum of what they gave
        r["outputs"][0]["value"][0]["stats"]["mean"] *= 1.5
    for rank in (0, 1):
        _edit(run / "step0" / f"rank{rank}", "c10d.allreduce_.default", off)
    code, out = ranks(run)
    assert code == 2 and out.startswith("collective #0 on group 0 differs: c10d.allreduce_.default "
                                        "[DistributedDataParallel.module.up] (step 0, backward): rank 0's result is "
                                        "not the SUM of the inputs: its mean"), out


def test_records_without_sequence_numbers_cannot_be_judged(runs, tmp_path):
    run = _copy(runs("ddp") / "statistics", tmp_path)
    for part in run.glob("step*/rank*"):
        _edit(part, "c10d.", lambda r: r.pop("collective"), every=True)
    code, out = ranks(run)
    assert code == 1 and "carry no sequence number" in out.splitlines()[0], out


@pytest.mark.skipif(not __import__("html_check").chromium(), reason="no chromium")
def test_ranks_page_in_headless_chromium(runs, tmp_path):
    from html_check import assert_fits, layout
    ranks(runs("ddp", "hook") / "tensor", "-o", str(tmp_path))
    seen = layout(tmp_path / "ranks.html", tmp_path, 1000)
    assert seen["marks"]["forward"]["marked"] and seen["marks"]["forward"]["selected"]
    assert_fits(seen)


def test_collectives_left_out_of_the_records_still_count(tmp_path):
    """One gloo rank in this process: a ``list`` filter records the all-reduces only, and their
    sequence numbers still count the broadcasts between them (so ranks with other filters join)."""
    import torch.distributed as dist
    from dispatchprobe import DispatchProbe
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        probe = DispatchProbe(task="statistics", dump_path=str(tmp_path / "run"), list=["allreduce"])
        with probe:
            t = torch.ones(4)
            for _ in range(2):
                dist.broadcast(t, src=0)
                dist.all_reduce(t)
        probe.close()
    finally:
        dist.destroy_process_group()
    recs = [json.loads(line) for line in (tmp_path / "run" / "step0" / "rank0" / "ops.jsonl").read_text().splitlines()]
    assert [(r["op"], r["collective"]["seq"]) for r in recs] == [("c10d.allreduce_.default", 1),
                                                                 ("c10d.allreduce_.default", 3)]


# ---- N-D device meshes (4 ranks on 2-D meshes, 8 on the 3-D one) ------------------------------------
def _tp_backward_all_reduce(out: Path, n: int) -> set:
    """The groups tensor parallelism all-reduced an input's gradient over in the backward."""
    return {tuple(next(a for a in r["inputs"] if a.get("type") == "process_group")["ranks"])
            for rank in range(n) for r in records(out, "statistics", 0, rank)
            if r["op"] == "_c10d_functional.all_reduce.default" and r["stage"] == "backward"}


@pytest.mark.parametrize("launch_kind,layout,held", [
    ("nd", "fsdp_tp", {0: (0, 2), 1: (1, 3), 2: (0, 2), 3: (1, 3)}),     # 2x2 dp x tp: the same tp coordinate
    ("nd", "hsdp", {r: (0, 1, 2, 3) for r in range(4)}),                 # 2x2 replicate x shard: every rank
    ("nd3", "hsdp_tp", {r: tuple(range(r % 2, 8, 2)) for r in range(8)}),  # 2x2x2: the same tp coordinate
])
def test_clean_runs_on_nd_meshes_agree(runs, launch_kind, layout, held, tmp_path):
    """The replicas come from the groups the gradients were reduced over, not from every rank nor
    from tensor parallelism's backward all-reduces (over its own groups, in both layouts with tp)."""
    import pandas as pd
    from dispatchprobe.offline.ranks.groups import replicas
    out, n = runs(launch_kind, f"{layout}-clean"), len(held)
    recs = {rank: records(out, "statistics", 0, rank) for rank in range(n)}
    assert {r: tuple(sorted(g)) for r, g in replicas(recs).items()} == held
    if "tp" in layout:
        assert _tp_backward_all_reduce(out, n) == {(r, r + 1) for r in range(0, n, 2)}
    for task in ("statistics", "tensor"):
        code, text = ranks(out / task, "-o", str(tmp_path / task))
        assert_agree(code, text, "tp" in layout)
        assert f"over 2 step(s) and {n} rank(s)" in text and " 0 drift(s)" in text, text
        table = pd.read_csv(tmp_path / task / "ranks.csv")
        assert (table["status"] == "agree").all() and len(table) >= 20, table


def test_drifting_hsdp_replica_is_named_with_its_group(runs, tmp_path):
    """HSDP on a 2x2 mesh (replicate x shard): one element of rank 3's shard nudged before the first
    step.  Ranks 2 and 3 gather the moved parameter, ranks 0 and 1 the others: named at the first
    op that receives it, on the four ranks that must see it equal; after the step the shard
    differs between rank 3 and its replica over the replicate dimension, rank 1."""
    import pandas as pd
    for task, how in (("statistics", "statistics differ"), ("tensor", "1 of 128 elements differ, by up to 0.001")):
        code, out = ranks(runs("nd", "hsdp-nudge") / task, "-o", str(tmp_path / task))
        assert code == 2, out
        first = out.splitlines()[0]
        assert first.startswith("replica drift on rank 2 3: aten.addmm.default [FSDPInputMLP.block.up] (step 0, "
                                "forward): parameter input.2 differs on rank 2, 3 from rank 0: "), first
        assert how in first and first.endswith("; held equal by ranks 0, 1, 2, 3"), first
        table = pd.read_csv(tmp_path / task / "ranks.csv")
        shard = table[(table["check"] == "replica") & (table["op"] == "param.value")]
        assert list(shard["step"]) == [0, 1] and list(shard["scope"]) == ["block.up.weight"] * 2, shard
        assert shard["detail"].str.startswith("parameter after the step block.up.weight differs on rank 3 from "
                                              "rank 1: ").all(), shard["detail"].tolist()
        assert shard["detail"].str.endswith("held equal by ranks 1, 3").all(), shard["detail"].tolist()
        # only the block's up weight moved: no other parameter, gradient or collective is named
        drifts = table[table["check"] == "replica"]
        assert set(drifts["scope"]) <= {"FSDPInputMLP.block.up", "block.up.weight"}, drifts
        assert (table[table["check"] == "collective"]["status"] == "agree").all()


def test_drifting_shard_on_a_3d_mesh_is_named_with_its_group(runs, tmp_path):
    """HSDP with tensor parallelism on a 2x2x2 mesh (replicate x shard x tp), rank 3's shard nudged:
    its parameters as ops receive them are tensor-parallel shards (no replicas), so the drift is
    the shard after the step, on rank 3 and its replica over the replicate dimension, rank 7."""
    import pandas as pd
    for task in ("statistics", "tensor"):
        code, out = ranks(runs("nd3", "hsdp_tp-nudge") / task, "-o", str(tmp_path / task))
        assert code == 2, out
        first = out.splitlines()[0]
        assert first.startswith("replica drift on rank 7: param.value [block.up.weight] (step 0, optimizer): "
                                "parameter after the step block.up.weight differs on rank 7 from rank 3: "), first
        assert first.endswith("; held equal by ranks 3, 7"), first
        table = pd.read_csv(tmp_path / task / "ranks.csv")
        assert list(table.loc[table["check"] == "replica", "step"]) == [0, 1]
        assert (table[table["check"] == "collective"]["status"] == "agree").all()


def test_missing_is_said_only_of_missing_records(runs, tmp_path):
    """On the 2x2 FSDP2 + tensor-parallel run, rank 3's step 1 removed: rank 3, and only rank 3, is
    missing; a check given some of the parts says the others were not given, not that they are
    missing."""
    import shutil
    from dispatchprobe.offline.ranks import check_parts, merge
    run = _copy(runs("nd", "fsdp_tp-clean") / "statistics", tmp_path)
    shutil.rmtree(run / "step1" / "rank3")
    code, out = ranks(run)
    lines = out.splitlines()
    assert code == 1 and lines[0] == ("cannot judge: step 1: rank 3's records are missing (its groups' collectives "
                                      "cannot be joined)"), out
    assert not [line for line in lines[1:] if "rank 0" in line or "rank 1" in line or "rank 2" in line], out
    _, verdict = merge(check_parts(str(run), [(0, 0), (0, 1), (0, 2)]))
    assert verdict.code == 1 and str(verdict).startswith(
        "cannot judge: step 0: rank 3's records were not among the parts checked"), str(verdict)
    assert "missing" not in str(verdict), str(verdict)
