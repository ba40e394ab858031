"""compare of 2-rank FSDP2 against one process, both a tiny ``transformers`` Llama in bfloat16
(``model.to(torch.bfloat16)``), AdamW, 2 steps, statistics (``fsdp2_bf16_train.py``, gloo).

Step 0 agrees within tolerance, but FSDP2's reduce-scatter sums the gradients in another order
than one process's backward: the parameters differ by bfloat16's rounding after the update, and
step 1's values computed from them part past bfloat16's limits with no kernel computing wrongly.
compare once named an op there ("first error: step 1 backward op ...", exit 2).  Under a
``GradScaler`` the found-inf check's all-reduce of a one-element flag, outside the backward, was
taken for tensor parallelism's forward all-reduce: every value was then joined as a
tensor-parallel group's pieces ("unequal on the ranks [0, 1] of one tensor-parallel group"); and
the scaler's multiply of the loss by a tensor holding the scale left the loss and the backward
unpaired."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dispatchprobe import compare
from dispatchprobe.cli import main
from parallel_models import record_runs
from dispatchprobe.offline.ranks.groups import data_parallel_groups, tensor_parallel_groups

SCRIPT = Path(__file__).with_name("fsdp2_bf16_train.py")
ENV = {**os.environ, "DISPATCHPROBE_FUSED_STATS": "0", "OMP_NUM_THREADS": "1"}
BOTH_ORDERS = [True, False]


def _record(kind: str, out: Path, *runs: str) -> None:
    record_runs(SCRIPT, kind, out, *runs, env=ENV)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed not built")
    out = tmp_path_factory.mktemp("fsdp2_bf16")
    _record("single", out / "single", "bf16", "scaler")
    _record("fsdp", out / "fsdp", "bf16", "silu1", "scaler")
    return out


def _pair(runs: Path, fsdp: str, single: str, fsdp_is_a: bool) -> tuple:
    a, b = runs / "fsdp" / fsdp, runs / "single" / single
    return (a, b) if fsdp_is_a else (b, a)


@pytest.mark.fsdp2
@pytest.mark.parametrize("fsdp_is_a", BOTH_ORDERS)
def test_a_later_step_grown_from_rounding_names_no_op(runs, fsdp_is_a):
    """Step 1's rows past bfloat16's limits grew from the rounding step 0's update left in the
    parameters: not judged, said on a line of their own, no op named, exit code 1 (not 'agree')."""
    a, b = _pair(runs, "bf16", "bf16", fsdp_is_a)
    res = CliRunner().invoke(main, ["compare", str(a), str(b)])
    assert res.exit_code == 1, res.output
    assert "first error" not in res.output, res.output
    grown = next(line for line in res.output.splitlines() if line.startswith("grew from rounding: "))
    assert "of step 1 not judged, computed from parameters that differ by rounding after step 0's update" in grown, \
        grown
    assert "no op named" in grown, grown
    table, verdict = compare(a, b)
    assert verdict.passed and verdict.undecided and verdict.grown.step == 0, str(verdict)
    step0 = table[table["step"] == 0]
    assert (step0["status"] != "error").all() and not step0["reason"].str.startswith("computed from").any()
    set_aside = table[table["reason"].str.startswith("computed from parameters that differ by rounding", na=False)]
    assert len(set_aside) == verdict.grown.rows > 0 and (set_aside["step"] == 1).all(), set_aside


@pytest.mark.fsdp2
def test_the_two_orders_set_aside_the_same_rows(runs):
    one, other = (compare(*_pair(runs, "bf16", "bf16", order)) for order in BOTH_ORDERS)
    assert one.verdict.counts == other.verdict.counts
    cols = ["step", "what", "name", "scope", "arg", "status", "reason"]
    assert one.table[cols].fillna("").values.tolist() == other.table[cols].fillna("").values.tolist()


@pytest.mark.fsdp2
@pytest.mark.parametrize("fsdp_is_a", BOTH_ORDERS)
def test_a_wrong_kernel_at_the_later_step_is_still_named(runs, fsdp_is_a):
    """silu x1.01 on rank 1 at step 1 only: its input agrees within tolerance and its output does
    not, so it is named there, whichever run is A; nothing after it is set aside as rounding."""
    a, b = _pair(runs, "silu1", "bf16", fsdp_is_a)
    res = CliRunner().invoke(main, ["compare", str(a), str(b)])
    assert res.exit_code == 2, res.output
    assert "first error: step 1 forward op aten.silu.default.0.forward [model.layers.0.mlp.act_fn]" in res.output, \
        res.output
    assert "grew from rounding" not in res.output, res.output


@pytest.mark.fsdp2
@pytest.mark.parametrize("fsdp_is_a", BOTH_ORDERS)
def test_a_loss_scalers_found_inf_all_reduce_is_no_tensor_parallelism(runs, fsdp_is_a):
    """FSDP2 with a GradScaler: the found-inf flag's all-reduce (MAX, one element) outside the
    backward leaves the run a plain data-parallel one, compared as such against one process."""
    a, b = _pair(runs, "scaler", "scaler", fsdp_is_a)
    res = CliRunner().invoke(main, ["compare", str(a), str(b)])
    assert "tensor-parallel group" not in res.output, res.output
    assert "first error" not in res.output, res.output
    assert res.exit_code in (0, 1), res.output
    # GradScaler.scale(loss) multiplies the mean by a tensor holding the scale, alike in both runs: the
    # loss is that mean scaled, so it and the values computed from its gradient pair (once 'the loss is
    # not a mean over each share of the batch: the scale of its gradients across the runs is unknown')
    table, verdict = compare(a, b)
    assert not any("scale of its gradients" in u for u in verdict.unpaired), verdict.unpaired
    loss = table[table["what"] == "loss"]
    assert sorted(loss["step"]) == [0, 1] and (loss["status"] == "pass").all(), loss[["name", "status", "reason"]]
    backward = table[(table["what"] == "backward") & (table["step"] == 0)]
    assert "aten.nll_loss_backward.default.0.backward" in set(backward["name"]), backward


def _collective(stage: str, shape: list, reduce_op: str, ranks=(0, 1)) -> dict:
    group = {"type": "process_group", "name": "0", "ranks": list(ranks), "group_rank": 0}
    return {"kind": "op", "op": "_c10d_functional.all_reduce.default", "stage": stage,
            "inputs": [{"type": "tensor", "shape": shape, "dtype": "float32"}, group],
            "collective": {"kind": "all_reduce", "group": "0", "seq": 0, "reduce_op": reduce_op}}


@pytest.mark.parametrize("shape, reduce_op", [([], "MAX"), ([1], "MAX"), ([], "SUM"), ([], "AVG"), ([8, 16], "MAX")])
def test_a_flag_or_a_number_reduced_outside_the_backward_is_no_tensor_parallelism(shape, reduce_op):
    """A found-inf flag (MAX), a loss averaged for logging, a gradient norm's square summed for
    clipping: no tensor-parallel group, and the group stays data-parallel where the backward
    reduces gradients over it."""
    backward = {**_collective("backward", [64], "AVG"), "op": "c10d._reduce_scatter_base_.default"}
    backward["collective"] = {**backward["collective"], "kind": "reduce_scatter"}
    backward["inputs"] = [{"type": "tensor", "shape": [32]}, {"type": "tensor", "shape": [64]}, backward["inputs"][1]]
    records = [_collective("forward", shape, reduce_op), backward]
    assert tensor_parallel_groups(records) == set()
    assert data_parallel_groups(records) == {frozenset({0, 1})}


def test_a_sum_of_activations_in_the_forward_is_tensor_parallelism():
    records = [_collective("forward", [8, 16], "SUM")]
    assert tensor_parallel_groups(records) == {frozenset({0, 1})}
