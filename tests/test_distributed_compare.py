"""compare over distributed runs (2 gloo ranks under ``torchrun``): rank by rank with ``-j``, and
across parallelism (1 process vs 2-rank DDP / FSDP2 of one model and global batch: loss, forward
ops assembled over the ranks, parameter gradients after reduction, parameters after each step).
The runs are recorded by ``distributed_compare_train.py``; a planted x1.001 on ``up``'s output
(a forward hook) must be named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from click.testing import CliRunner

from dispatchprobe import compare
from dispatchprobe.cli import main
from parallel_models import record_runs

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
SCRIPT = Path(__file__).with_name("distributed_compare_train.py")
ENV = {**os.environ, "DISPATCHPROBE_FUSED_STATS": "0", "OMP_NUM_THREADS": "1"}


def _record(kind: str, out: Path, *runs: str) -> None:
    record_runs(SCRIPT, kind, out, *runs, env=ENV)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("parallel")
    _record("single", out / "single", "clean", "planted", "stats", "mixed", "divided", "xent", "bf16autocast",
            "extraaddmm")
    _record("ddp", out / "ddp", "clean", "planted", "planted1", "kernel1", "stats", "outside", "optimizer", "mixed",
            "divided", "dividedkernel1", "dividedbackward1", "xent", "xentbackward1", "sampled", "sampledkernel1")
    _record("tp", out / "tp", "clean")
    return out


@pytest.fixture(scope="module")
def fsdp_runs(runs) -> Path:
    """``runs`` with a clean FSDP2 run (its own fixture: torch 2.5's FSDP2 does not run on CPU)."""
    _record("fsdp", runs / "fsdp", "clean", "kernel1", "stats", "bf16", "bf16kernel1", "fp16overflow")
    return runs


def test_ddp_runs_rank_by_rank_in_workers(runs):
    """Two 2-rank runs: step and rank paired, parts in 2 worker processes, one verdict naming
    step, rank and the planted op."""
    table, verdict = compare(runs / "ddp" / "planted", runs / "ddp" / "clean", jobs=2)
    assert sorted(verdict.parts) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert set(table["rank"]) == {0, 1} and set(table["step"]) == {0, 1}
    fwd = verdict.forward
    assert (fwd.step, fwd.rank, fwd.op, fwd.scope, fwd.cause) == (0, 0, "aten.mul.Tensor", "DistributedDataParallel.module.up",
                                                                  "unmatched")
    assert "step 0 rank 0" in str(verdict) and "(steps 0-1 x ranks 0-1)" in str(verdict)
    clean = compare(runs / "ddp" / "clean", runs / "ddp" / "clean", jobs=2).verdict
    assert clean.passed


def test_a_line_names_both_runs_calls_where_they_differ(runs, tmp_path):
    """One process calling an unused ``addmm`` before the model, every ``addmm`` 5% off, against 2-rank DDP:
    its model's ``addmm`` records are one call later than DDP's, and the line naming ``up``'s names both
    runs' calls (its name counts calls within the module, alike in both), mirrored in the other order."""
    single, ddp = runs / "single" / "extraaddmm", runs / "ddp" / "clean"
    for a, b, calls in ((single, ddp, "call A 1, B 0"), (ddp, single, "call A 0, B 1")):
        table, verdict = compare(a, b, out=tmp_path / a.parent.name)
        assert f"the runs part at step 0 forward op aten.addmm.default.0.forward [up] ({calls}) output.0 (error: " \
            in str(verdict), str(verdict)
        up = table[(table["what"] == "forward") & (table["scope"] == "up") & (table["step"] == 0)].iloc[0]
        assert f"call A {up['call_a']}, B {up['call_b']}" == calls, up


def test_ddp_agrees_with_one_process(runs, tmp_path):
    table, verdict = compare(runs / "ddp" / "clean", runs / "single" / "clean", out=tmp_path / "cmp")
    assert verdict.passed, str(verdict)
    assert "run A has 2 ranks (0, 1), run B 1 rank (0)" in str(verdict)
    for step in (0, 1):
        rows = table[table["step"] == step]
        assert set(rows[rows["what"] == "grad"]["name"]) == {"up.weight", "up.bias", "down.weight", "down.bias"}
        assert set(rows[rows["what"] == "value"]["name"]) == {"up.weight", "up.bias", "down.weight", "down.bias"}
        loss = rows[rows["what"] == "loss"]
        assert len(loss) == 1 and loss["how_a"].iloc[0] == "mean over ranks 0-1"
        # activations: each rank's half of the batch, concatenated back
        up = rows[(rows["what"] == "forward") & (rows["scope"] == "up")]
        assert up["how_a"].iloc[0] == "concatenated over ranks 0-1 (dim 0)" and up["shape_a"].iloc[0] == [8, 16]
    assert (tmp_path / "cmp" / "compare.csv").is_file()


@pytest.mark.parametrize("a, b", [("ddp/mixed", "single/mixed"), ("single/mixed", "ddp/mixed")])
def test_ops_counted_per_module_and_each_ranks_own_numbers_are_not_laid_side_by_side(runs, a, b):
    """DDP's own ``cat`` of its buffers at the root comes before the model's ``cat`` in ``mix``:
    counted per module, the model's still pairs with the one process's (counted over the whole
    step it was 'cat 1' against 'cat 0').  ``arange(batch)`` is each rank's own 0..3, not a quarter
    of the one process's 0..7: not laid side by side (which made a clean pair err), said unpaired."""
    table, verdict = compare(runs / a, runs / b)
    assert verdict.passed, str(verdict)
    cat = table[(table["name"] == "aten.cat.default.0.forward") & (table["scope"] == "mix")]
    assert len(cat) == 2 and (cat["status"] == "pass").all(), cat
    assert any("forward op aten.arange.default.0.forward [mix]: made from the program's numbers on each rank"
               in u for u in verdict.unpaired), verdict.unpaired


@pytest.mark.parametrize("a, b", [("ddp/divided", "single/divided"), ("single/divided", "ddp/divided")])
def test_a_loss_divided_after_its_mean_agrees_across_parallelism(runs, a, b):
    """``loss / 2`` after the mean, as gradient accumulation divides it: the mean's backward reads the
    division's 0-dim gradient through an expand no record shows.  Its base found, each rank's piece is
    known to carry the loss's gradient and is not laid beside the one process's as it is (2 ranks
    each averaging half the batch: twice the one process's values, once exit 2 naming the mean's
    backward ``div``), in both orders."""
    table, verdict = compare(runs / a, runs / b)
    assert verdict.passed, str(verdict)
    assert not (table["status"] == "error").any(), table[table["status"] == "error"]
    assert {"loss", "forward", "backward", "grad", "value"} <= set(table["what"]), set(table["what"])
    # the loss scales each share's mean as the one process's: its gradients pair, divided by the 2 shares
    assert not any("scale of its gradients" in x for x in verdict.unpaired), verdict.unpaired
    relu = table[(table["what"] == "backward") & (table["name"] == "aten.threshold_backward.default.0.backward")]
    assert len(relu) == 2 and set(relu["status"]) == {"pass"}, relu


@pytest.mark.parametrize("a, b", [("ddp/dividedkernel1", "single/divided"), ("single/divided", "ddp/dividedkernel1")])
def test_a_wrong_kernel_is_named_across_parallelism_where_the_loss_is_divided(runs, a, b):
    """Rank 1's wrong relu kernel under ``loss / 2``: named, in both orders."""
    res = CliRunner().invoke(main, ["compare", str(runs / a), str(runs / b)])
    assert res.exit_code == 2, res.output
    parted = next(line for line in res.output.splitlines() if line.startswith("the runs part at step 0"))
    assert "forward op aten.relu.default.0.forward" in parted, res.output


@pytest.mark.parametrize("a, b", [("ddp/dividedbackward1", "single/divided"), ("single/divided", "ddp/dividedbackward1")])
def test_a_wrong_backward_kernel_is_named_across_parallelism_where_the_loss_is_divided(runs, a, b):
    """Rank 1's wrong relu backward under ``loss / 2``: named at its op in both orders (once only the
    parameter gradients after it parted: the backward was not paired, its scale taken for unknown)."""
    res = CliRunner().invoke(main, ["compare", str(runs / a), str(runs / b)])
    assert res.exit_code == 2, res.output
    assert res.output.splitlines()[1].startswith("the runs part at step 0 backward op "
                                                 "aten.threshold_backward.default.0.backward [<root>] output.0"), res.output


@pytest.mark.parametrize("a, b", [("ddp/xent", "single/xent"), ("single/xent", "ddp/xent")])
def test_a_cross_entropy_loss_pairs_its_backward_across_parallelism(runs, a, b):
    """``cross_entropy``: a mean ``nll_loss``, each share's over the targets it counts (its
    ``total_weight``).  The loss is averaged over the shares and the values computed from its
    gradient divided by the 2 shares, as a ``mean``'s (once the loss and every backward op were not
    paired, their scale taken for unknown), in both orders."""
    table, verdict = compare(runs / a, runs / b)
    assert verdict.passed, str(verdict)
    assert set(table["status"]) == {"pass"}, table[table["status"] != "pass"]
    loss = table[(table["what"] == "loss") & (table["step"] == 0)]
    assert list(loss["name"]) == ["aten.nll_loss_forward.default.0.forward"], loss
    backward = table[(table["what"] == "backward") & (table["step"] == 0)]
    assert {"aten.nll_loss_backward.default.0.backward", "aten.threshold_backward.default.0.backward"} <= \
        set(backward["name"]), backward
    assert not any("scale of its gradients" in x for x in verdict.unpaired), verdict.unpaired


@pytest.mark.parametrize("a, b", [("ddp/xentbackward1", "single/xent"), ("single/xent", "ddp/xentbackward1")])
def test_a_wrong_backward_kernel_is_named_across_parallelism_under_cross_entropy(runs, a, b):
    res = CliRunner().invoke(main, ["compare", str(runs / a), str(runs / b)])
    assert res.exit_code == 2, res.output
    assert res.output.splitlines()[1].startswith("the runs part at step 0 backward op "
                                                 "aten.threshold_backward.default.0.backward [<root>] output.0"), res.output


@pytest.mark.fsdp2
@pytest.mark.parametrize("a, b", [("fsdp/bf16", "single/stats"), ("single/stats", "fsdp/bf16")])
def test_bfloat16_fsdp2_against_float32_one_process_is_judged_at_bfloat16(fsdp_runs, a, b):
    """FSDP2 computing in bfloat16 against one float32 process: a float32 value computed from bfloat16
    values (a parameter's gradient FSDP2 reduces in float32) carries bfloat16's rounding and is
    judged at it (once 8 error rows at float32's, exit 2), in both orders."""
    table, verdict = compare(fsdp_runs / a, fsdp_runs / b)
    assert verdict.passed, str(verdict)
    grads = table[(table["what"] == "grad") & (table["status"] != "pass")]
    assert len(grads) and grads["reason"].str.endswith("(bfloat16)").all(), grads


@pytest.mark.fsdp2
@pytest.mark.parametrize("a, b", [("fsdp/bf16kernel1", "single/stats"), ("single/stats", "fsdp/bf16kernel1")])
def test_a_wrong_kernel_in_bfloat16_fsdp2_is_named_against_float32_one_process(fsdp_runs, a, b):
    res = CliRunner().invoke(main, ["compare", str(fsdp_runs / a), str(fsdp_runs / b)])
    assert res.exit_code == 2, res.output
    assert "first error: step 0 forward op aten.relu.default.0.forward [<root>] output.0" in res.output, res.output


@pytest.mark.fsdp2
@pytest.mark.parametrize("a, b", [("fsdp/fp16overflow", "single/bf16autocast"),
                                  ("single/bf16autocast", "fsdp/fp16overflow")])
def test_a_skipped_update_leaves_the_later_steps_unjudged_across_parallelism(fsdp_runs, a, b):
    """FSDP2 under float16 autocast whose GradScaler skips step 0's update (its scaled gradients
    overflow), against one bfloat16-autocast process that steps: step 1 starts from parameters that
    differ by the program's design (once 'first error: step 1 forward op aten._to_copy...', exit 2).
    Its rows are not judged, saying why, and no op is named, in both orders."""
    res = CliRunner().invoke(main, ["compare", str(fsdp_runs / a), str(fsdp_runs / b)])
    assert res.exit_code == 0, res.output
    skipper = "A" if a.startswith("fsdp") else "B"
    assert f"run {skipper} records no parameters after step 0's optimizer step while the other run does" in \
        res.output, res.output
    assert "first error" not in res.output, res.output
    table, _ = compare(fsdp_runs / a, fsdp_runs / b)
    later = table[table["step"] == 1]
    assert len(later) and (later["status"] == "not judged").all(), later


def test_statistics_runs_agree_across_parallelism(runs):
    """No tensors saved: the ranks' statistics combined (max, min, mean by size, norm) and judged."""
    table, verdict = compare(runs / "ddp" / "stats", runs / "single" / "stats")
    assert verdict.passed, str(verdict)
    assert {"loss", "forward", "grad", "value"} <= set(table["what"]) and table["cosine"].isna().all()


def test_a_rank_filtered_run_is_compared_rank_by_rank(runs, tmp_path):
    """A run that recorded rank 0 of a 2-rank job (config rank=[0]) is not another parallelism."""
    import shutil
    import json
    sub = tmp_path / "rank0"
    shutil.copytree(runs / "ddp" / "clean", sub)
    for step in (0, 1):
        shutil.rmtree(sub / f"step{step}" / "rank1")
    manifest = json.loads((sub / "manifest.json").read_text())
    manifest["config"]["rank"] = [0]
    (sub / "manifest.json").write_text(json.dumps(manifest))
    table, verdict = compare(sub, runs / "ddp" / "clean")
    assert verdict.passed and sorted(verdict.parts) == [(0, 0), (1, 0)]
    assert "steps 0, 1 x rank 1: 2 step/rank part(s) only in" in str(verdict)


def test_an_optimizer_step_that_moves_a_parameter_apart_is_named(runs):
    """The optimizer runs outside the probe (no op record of it): step 1's inputs differ, step 0's
    op records agree, and the parameter records name the parameter its step moved apart."""
    res = CliRunner().invoke(main, ["compare", str(runs / "ddp" / "optimizer"), str(runs / "ddp" / "outside")])
    assert res.exit_code == 2, res.output
    assert ("step 0's op records agree; they come from its optimizer step: parameter up.weight differs after it"
            in res.output and "while its gradient as the optimizer applied it agrees" in res.output), res.output


@pytest.mark.parametrize("a, b, side", [("ddp/clean", "ddp/planted1", "B"), ("ddp/planted1", "ddp/clean", "A")])
def test_a_change_on_one_rank_is_named_on_that_rank(runs, a, b, side):
    """One bad device: rank 1 alone scales up's output.  Rank 0's values differ only through the
    gradient all-reduce (its forward line would say it follows from backward values, its backward
    from the all-reduced bucket): the verdict names rank 1's op, in both stages, whichever run is A."""
    res = CliRunner().invoke(main, ["compare", str(runs / a), str(runs / b)])
    assert res.exit_code == 2, res.output
    for stage in ("forward", "backward"):
        line = next(line for line in res.output.splitlines() if line.startswith(f"first {stage} divergence"))
        assert line.startswith(f"first {stage} divergence: aten.mul.Tensor [DistributedDataParallel.module.up]"), line
        assert "step 0 rank 1" in line and f"present only in run {side} (prime suspect)" in line, line
    assert "follow from differing" not in res.output, res.output


@pytest.mark.parametrize("kind, planted, clean", [("ddp", "kernel1", "clean"),
                                                   pytest.param("fsdp", "kernel1", "clean", marks=pytest.mark.fsdp2),
                                                   pytest.param("fsdp", "bf16kernel1", "bf16", marks=pytest.mark.fsdp2)])
def test_a_wrong_kernel_on_one_rank_is_named_on_that_rank(kind, planted, clean, request):
    """Rank 1 alone runs a wrong relu kernel (x1.05, torch.library on CPU: no op of its own).  Rank 0
    sees it only through the collectives: DDP's all-reduce and FSDP2's reduce-scatter give it
    gradients that differ while what rank 0 gave them agrees -- values received from rank 1, not a
    divergence of rank 0's (a reduce-scatter's output buffer, measured as it left it, once made that
    an input no op made differing; FSDP2 hands its gradients on as views no record shows).  The
    verdict names rank 1's relu, and no collective, in both orders; under FSDP2 in bfloat16 too,
    where the optimizer's float32 gradients once 'differed already at their inputs'."""
    runs = request.getfixturevalue("fsdp_runs" if kind == "fsdp" else "runs")
    for a, b in ((f"{kind}/{planted}", f"{kind}/{clean}"), (f"{kind}/{clean}", f"{kind}/{planted}")):
        res = CliRunner().invoke(main, ["compare", str(runs / a), str(runs / b)])
        assert res.exit_code == 2, res.output
        lines = res.output.splitlines()
        forward = next(line for line in lines if line.startswith("first forward divergence"))
        assert forward.startswith("first forward divergence: aten.relu.default [") and "step 0 rank 1)" in forward, \
            res.output
        backward = next(line for line in lines if line.startswith(("first backward", "backward:")))
        assert "c10d." not in backward and "step 0 rank 1)" in backward, res.output
        assert "differ already at their inputs" not in res.output, res.output


@pytest.mark.parametrize("a, b, side", [("ddp/clean", "single/planted", "B"),
                                        pytest.param("single/planted", "fsdp/clean", "A", marks=pytest.mark.fsdp2)])
def test_planted_change_is_named_across_parallelism(a, b, side, request):
    runs = request.getfixturevalue("fsdp_runs" if "fsdp" in a + b else "runs")
    res = CliRunner().invoke(main, ["compare", str(runs / a), str(runs / b)])
    assert res.exit_code == 2, res.output
    lines = res.output.splitlines()
    parted = next(line for line in lines if line.startswith("the runs part at step 0"))
    assert "aten.relu.default.0.forward" in parted, res.output
    assert f"prime suspect): aten.mul.Tensor.0.forward [up] in run {side} only" in res.output, res.output


def test_swapped_runs_of_other_parallelism_give_the_mirrored_verdict(runs):
    """compare A B and compare B A across parallelism: every pair judged alike, the same place where
    the runs part and the same first error and departure, the same suspect and unpaired lines with
    the run labels swapped."""
    ab, ba = compare(runs / "ddp" / "clean", runs / "single" / "planted"), compare(runs / "single" / "planted",
                                                                                  runs / "ddp" / "clean")
    assert ab.verdict.counts == ba.verdict.counts and not ab.verdict.passed, str(ab.verdict)
    cols = ["step", "what", "name", "scope", "arg", "status", "reason", "rel_l2_err", "cosine", "stats_err"]
    assert ab.table[cols].fillna(-1).values.tolist() == ba.table[cols].fillna(-1).values.tolist()

    def mirror(text: str) -> str:
        return text.replace("run A", "run \0").replace("run B", "run A").replace("run \0", "run B")

    for which in ("parted", "first", "departure"):
        one, other = getattr(ab.verdict, which), getattr(ba.verdict, which)
        assert (one is None) == (other is None), which
        if one is not None:
            assert [one[c] for c in cols[:7]] == [other[c] for c in cols[:7]], which
            assert mirror(one["after_one_run_only"]) == other["after_one_run_only"], which
    assert "in run B only" in ab.verdict.parted["after_one_run_only"]      # the plant, in the one-process run
    assert sorted(map(mirror, ab.verdict.unpaired)) == sorted(ba.verdict.unpaired)


@pytest.mark.fsdp2
def test_fsdp2_agrees_with_one_process(fsdp_runs):
    runs = fsdp_runs
    table, verdict = compare(runs / "fsdp" / "clean", runs / "single" / "clean")
    assert verdict.passed, str(verdict)
    grads = table[table["what"] == "grad"]
    assert len(grads) == 8 and grads["how_a"].eq("gathered (Shard(dim=0))").all()
    assert (table[table["what"] == "value"]["shape_a"].map(tuple) == table[table["what"] == "value"]["shape_b"].map(tuple)).all()


@pytest.mark.fsdp2
def test_fsdp2_in_bfloat16_against_float32_follows_the_gradients_through_the_reduce_scatter(fsdp_runs):
    """FSDP2 computing in bfloat16 (``MixedPrecisionPolicy``, gradients reduced in float32) against
    float32 FSDP2, statistics: the optimizer reads each gradient as a contiguous view of its
    reduce-scatter's flat result, which no record shows, and the reduce-scatter reads the flat
    buffer ``chunk_cat`` wrote, which its record once left out.  Both had no producer, so the
    float32 gradients, computed from bfloat16 ones, were judged as float32 values that 'differ
    already at their inputs' (exit 2).  Followed through both, they carry bfloat16's rounding and
    are judged at it: the runs agree within tolerance, with the bfloat16 difference as warnings,
    whichever run is A."""
    runs = fsdp_runs
    verdicts = [compare(runs / "fsdp" / a, runs / "fsdp" / b)[1] for a, b in (("bf16", "stats"), ("stats", "bf16"))]
    for verdict in verdicts:
        assert "differ already at their inputs" not in str(verdict), str(verdict)
        assert verdict.passed and verdict.counts["warning"] > 0, str(verdict)
    assert verdicts[0].counts == verdicts[1].counts
    table, _ = compare(runs / "fsdp" / "bf16", runs / "fsdp" / "stats")
    # the SGD step's gradient (add_'s input.1) is judged at bfloat16: it was computed from bfloat16 values
    grads = table[(table["op_a"] == "aten.add_.Tensor") & (table["arg"] == "input.1") & (table["dtype_a"] == "float32")]
    assert len(grads) and grads["status"].isin(["pass", "warning"]).all(), grads[["status", "reason"]]
    assert grads["reason"].dropna().str.endswith("(bfloat16)").all(), grads["reason"]


@pytest.mark.fsdp2
@pytest.mark.parametrize("a, b", [("ddp", "fsdp"), ("fsdp", "ddp")])
def test_ddp_and_fsdp2_of_the_same_ranks_are_compared_on_what_both_hold(fsdp_runs, a, b):
    """2-rank DDP against 2-rank FSDP2 of one model and global batch: the rank counts agree but the
    ranks hold other pieces of the parameters (whole replicas against shards), so their ops do not
    pair one to one; compared across parallelism, rank with rank for the activations, whichever run
    is A (rank by rank they once 'differed already at their inputs', exit 2, on a clean pair)."""
    runs = fsdp_runs
    table, verdict = compare(runs / a / "clean", runs / b / "clean")
    assert verdict.passed, str(verdict)
    assert "run A has 2 ranks (0, 1), run B 2 ranks (0, 1) holding other pieces of the parameters (parameter " \
           "up.weight on rank 0: " in str(verdict), str(verdict)
    forward = table[table["what"] == "forward"]
    assert len(forward) and forward["how_a"].str.endswith("(rank by rank)").all(), forward
    assert len(table[table["what"] == "loss"]) == 2 and len(table[table["what"] == "grad"]) == 8
    # a change on rank 1 alone (up's output x1.001 there, a forward hook) is named on that rank
    planted = ("ddp/planted1", "fsdp/clean") if a == "ddp" else ("fsdp/clean", "ddp/planted1")
    res = CliRunner().invoke(main, ["compare", *(str(runs / p) for p in planted)])
    assert res.exit_code == 2, res.output
    assert "the runs part at step 0 forward op aten.relu.default.0.forward [<root>] output.0 on rank 1 (error: " \
           in res.output, res.output
    side = "A" if a == "ddp" else "B"
    assert f"prime suspect): aten.mul.Tensor.0.forward [up] in run {side} only" in res.output, res.output


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node 2 -m dispatchprobe ARGS`` (gloo on loopback)."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "dispatchprobe", *args], capture_output=True, text=True, timeout=300, env=ENV)


@pytest.mark.parametrize("a, b", [("ddp/planted", "ddp/clean"), ("ddp/clean", "single/planted")])
def test_compare_under_torchrun_writes_the_one_process_report(runs, tmp_path, a, b):
    """Each rank compares every second step/rank part (or step), rank 0 merges: the same verdict
    and the same CSVs as one process; the verdict is printed once."""
    one = CliRunner().invoke(main, ["compare", str(runs / a), str(runs / b), "-o", str(tmp_path / "one")])
    done = _torchrun("compare", str(runs / a), str(runs / b), "-o", str(tmp_path / "two"))
    assert one.exit_code == 2 and done.returncode != 0, (one.output, done.stderr[-3000:])   # torchrun: a rank exited 2
    assert done.stdout.replace(str(tmp_path / "two"), "OUT") == one.output.replace(str(tmp_path / "one"), "OUT")
    for name in ("compare.csv", "unmatched.csv", "pairing.csv"):
        if (tmp_path / "one" / name).exists():
            assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name


def test_run_ut_under_torchrun_equals_one_process(runs, tmp_path):
    import pandas as pd
    from dispatchprobe.offline.run_ut import TIMING_COLUMNS, run_ut
    one = run_ut(runs / "ddp" / "clean", tmp_path / "one", progress=False)
    done = _torchrun("run-ut", str(runs / "ddp" / "clean"), "-o", str(tmp_path / "two"))
    errs = (one.results[["Forward Test Success", "Backward Test Success"]] == "error").any(axis=None)
    assert done.returncode == (1 if errs else 0), done.stderr[-3000:]    # torchrun: 1 when a rank exited 2
    assert done.stdout.count("run-ut:") == 1          # rank 0 says it
    read = lambda kind: pd.read_csv(next((tmp_path / "two").glob(f"accuracy_checking_{kind}_*.csv")), dtype=str,  # noqa: E731
                                    keep_default_na=False)
    results, details = read("result"), read("details")
    assert set(results["Rank"]) == {"0", "1"} and len(results) == len(one.results)
    drop = [c for c in TIMING_COLUMNS if c in results.columns]
    assert results.drop(columns=drop).values.tolist() == one.results.drop(columns=drop).values.tolist()
    assert details.values.tolist() == one.details.values.tolist()


def test_ranks_under_torchrun_writes_the_one_process_report(runs, tmp_path):
    """``ranks``: each rank checks every second step (with all of its ranks), rank 0 merges."""
    one = CliRunner().invoke(main, ["ranks", str(runs / "ddp" / "clean"), "-o", str(tmp_path / "one")])
    done = _torchrun("ranks", str(runs / "ddp" / "clean"), "-o", str(tmp_path / "two"))
    assert one.exit_code == 0 and done.returncode == 0, (one.output, done.stderr[-3000:])
    assert "the ranks agree" in one.output
    assert done.stdout.replace(str(tmp_path / "two"), "OUT") == one.output.replace(str(tmp_path / "one"), "OUT")
    for name in ("ranks.csv", "ranks.html"):
        assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name


def test_tensor_parallel_agrees_with_one_process(runs):
    """ColwiseParallel up, RowwiseParallel down: parameters and gradients gathered from their
    shards; the local ops' column shards side by side, the row-wise layer's partial sums (its output
    before the all-reduce) added up."""
    table, verdict = compare(runs / "tp" / "clean", runs / "single" / "clean")
    assert verdict.passed, str(verdict)
    grads = table[table["what"] == "grad"]
    assert set(grads["name"]) == {"up.weight", "up.bias", "down.weight", "down.bias"}
    assert set(grads[grads["name"] != "down.bias"]["how_a"]) == {"gathered (Shard(dim=0))", "gathered (Shard(dim=1))"}
    down = table[(table["what"] == "forward") & (table["scope"] == "down") & (table["name"] == "aten.addmm.default.0.forward")]
    assert list(down["how_a"]) == ["summed over ranks 0-1"] * 2 and set(down["status"]) == {"pass"}, down
    assert not [u for u in verdict.unpaired if "forward op aten" in u], verdict.unpaired
    assert len(table[table["what"] == "loss"]) == 2


@pytest.fixture(scope="module")
def uneven_runs(tmp_path_factory) -> Path:
    """One process and 2-rank DDP on a global batch of 5, split 3 and 2 over the ranks."""
    out = tmp_path_factory.mktemp("uneven")
    _record("single", out / "single", "uneven", "unevenstats")
    _record("ddp", out / "ddp", "uneven", "unevenstats", "unevenkernel1")
    return out


@pytest.mark.parametrize("run", ["uneven", "unevenstats"])
@pytest.mark.parametrize("ddp_is_a", [True, False])
def test_unequal_shares_are_weighed_by_their_size_and_their_reduction_not_judged(uneven_runs, run, ddp_is_a):
    """Shares of 3 and 2 samples: the loss is the shares' means weighed by their sizes and each
    share's gradient pieces are taken times its part of the batch (3/5, 2/5), so both pass against
    one process; DDP's average of the shares' gradients weighs the samples otherwise by design, so
    the parameters' gradients and values, and every later step, are not judged (no divergence
    claimed), whichever run is A."""
    a, b = uneven_runs / "ddp" / run, uneven_runs / "single" / run
    table, verdict = compare(*((a, b) if ddp_is_a else (b, a)))
    assert verdict.passed and verdict.parted is None, str(verdict)
    step0 = table[table["step"] == 0]
    judged = step0[step0["what"].isin(["loss", "forward", "backward"])]
    assert set(judged["status"]) == {"pass"} and set(judged["what"]) == {"loss", "forward", "backward"}, judged
    how = table[table["what"] == "backward"][["how_a", "how_b"]].stack()
    assert how.str.contains("times its part of the batch (0.6, 0.4 by rank)", regex=False).any(), how
    params = step0[step0["what"].isin(["grad", "value"])]
    assert len(params) and set(params["status"]) == {"not judged"}, params
    assert params["reason"].str.startswith("unequal shares of the batch").all(), params["reason"]
    later = table[table["step"] > 0]
    assert len(later) and set(later["status"]) == {"not judged"}, later
    assert "not judged" in str(verdict) and "unequal shares" in str(verdict), str(verdict)


@pytest.mark.parametrize("ddp_is_a", [True, False])
def test_a_wrong_kernel_on_one_rank_of_unequal_shares_is_named(uneven_runs, ddp_is_a):
    """relu x1.05 on rank 1 (2 of the 5 samples) is named at relu, whichever run is A."""
    a, b = uneven_runs / "ddp" / "unevenkernel1", uneven_runs / "single" / "uneven"
    _, verdict = compare(*((a, b) if ddp_is_a else (b, a)))
    assert not verdict.passed and verdict.parted["step"] == 0, str(verdict)
    assert verdict.parted["name"] == "aten.relu.default.0.forward", str(verdict)


@pytest.mark.parametrize("a, b", [("single/clean", "ddp/sampled"), ("ddp/sampled", "single/clean")])
def test_a_batch_split_in_turn_is_laid_as_the_program_split_it(runs, a, b, tmp_path):
    """DDP fed by ``DistributedSampler`` (rank k of 2 takes samples k, k+2, ...) against one process
    of the whole batch: the ranks' saved activations are laid back in turn, not rank after rank
    (every forward op an error before), in both orders; a wrong relu on rank 1 is still named."""
    res = CliRunner().invoke(main, ["compare", str(runs / a), str(runs / b), "-o", str(tmp_path / "clean")])
    assert res.exit_code == 0, res.output
    table = pd.read_csv(tmp_path / "clean" / "compare.csv")
    side = "b" if b.startswith("ddp") else "a"
    forward = table[table["what"] == "forward"]
    assert len(forward) and forward[f"how_{side}"].str.contains("interleaved").all() and \
        (forward["status"] == "pass").all(), forward
    planted = (str(runs / a), str(runs / "ddp" / "sampledkernel1")) if side == "b" else \
        (str(runs / "ddp" / "sampledkernel1"), str(runs / b))
    res = CliRunner().invoke(main, ["compare", *planted, "-o", str(tmp_path / "planted")])
    assert res.exit_code == 2 and res.output.splitlines()[1].startswith(
        "the runs part at step 0 forward op aten.relu.default.0.forward"), res.output
