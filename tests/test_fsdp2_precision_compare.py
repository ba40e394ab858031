"""compare of 2-rank FSDP2 computing in bfloat16 (``MixedPrecisionPolicy``) against float32 FSDP2,
AdamW, 3 steps, statistics (``fsdp2_precision_train.py`` under ``torchrun``, gloo).

FSDP2 casts the parameters to bfloat16 (a ``_foreach_copy_`` into its all-gather buffer, in the
bfloat16 run only), so every later value differs by bfloat16's rounding, and AdamW's updates carry
it into the next steps: some optimizer states and losses part past tolerance while no op computes
wrongly.  The verdict once said the forward's errors 'follow from differing backward values' and
the backward's 'from differing forward values' (each the other's cause), or named a
``record_function`` mark or the all-gather's copy-in as the first divergence.  An activation 5 %
off in the bfloat16 run, within the 16 bfloat16 roundings the rule allows a stretch of ops, once
passed as that rounding against the float32 run; and the ``_foreach_copy_`` recorded no outputs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dispatchprobe import compare, load
from dispatchprobe.cli import main

pytestmark = [pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built"),
              pytest.mark.fsdp2]
SCRIPT = Path(__file__).with_name("fsdp2_precision_train.py")
ENV = {**os.environ, "DISPATCHPROBE_FUSED_STATS": "0", "OMP_NUM_THREADS": "1"}
ORDERS = [("bf16", "fp32"), ("fp32", "bf16")]
# bfloat16 runs with an activation 5 % off -> (its op, the rank it is named on: the first it is wrong on)
PLANTED = {"bf16kernel1": ("relu", 1), "bf16kernel": ("relu", 0), "bf16gelu1": ("gelu", 1), "bf16silu1": ("silu", 1)}


def _record(out: Path, *runs: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(SCRIPT), str(out), *runs], capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp2_precision")
    _record(out, "fp32", "bf16", *PLANTED)
    _record(out / "again", "fp32")
    return out


@pytest.mark.parametrize("a, b", ORDERS)
def test_bfloat16_against_float32_names_the_precision_and_the_step_they_part_at(runs, a, b):
    """Every error row grew from bfloat16's rounding: each stage with error rows says so, naming
    where the runs first compute in other precisions and the dtypes each run holds there; no op,
    no profiler mark, no stage pointing at the other; a later step's line names step 0, where the
    runs part."""
    res = CliRunner().invoke(main, ["compare", str(runs / a), str(runs / b)])
    assert res.exit_code == 2, res.output
    verdict = compare(runs / a, runs / b).verdict
    stages = [d for d in (verdict.forward, verdict.backward) if d is not None]
    assert stages, res.output
    held = f"where run A computes in {'bfloat16' if a == 'bf16' else 'float32'} and run B in " \
           f"{'float32' if a == 'bf16' else 'bfloat16'}"
    for d in stages:
        assert d.cause == "rounding" and held in d.follows, res.output
        assert d.step == 0 or d.came_from.startswith("the runs part first at step 0"), res.output
    assert "follow from differing" not in res.output and "divergence:" not in res.output, res.output
    assert "profiler." not in res.output, res.output


def test_the_two_orders_say_the_same(runs):
    """The same stages, steps, ranks and counts whichever run is A."""
    one, other = (compare(runs / a, runs / b).verdict for a, b in ORDERS)
    assert one.counts == other.counts
    for stage in ("forward", "backward"):
        x, y = getattr(one, stage), getattr(other, stage)
        assert (x is None) == (y is None), stage
        if x is not None:
            assert (x.cause, x.step, x.rank, x.op, x.arg, x.errors) == (y.cause, y.step, y.rank, y.op, y.arg, y.errors)


@pytest.mark.parametrize("a, b", [("bf16kernel1", "bf16"), ("bf16", "bf16kernel1")])
def test_a_wrong_kernel_on_one_rank_is_still_named_there(runs, a, b):
    """relu x1.05 on rank 1 of a bfloat16 run, against the bfloat16 run: the runs hold one dtype,
    so the relu's own difference is no precision's rounding; it is named on rank 1."""
    res = CliRunner().invoke(main, ["compare", str(runs / a), str(runs / b)])
    assert res.exit_code == 2, res.output
    forward = next(line for line in res.output.splitlines() if line.startswith("first forward divergence"))
    assert forward.startswith("first forward divergence: aten.relu.default [") and "step 0 rank 1)" in forward, \
        res.output
    assert "rounding size" not in res.output, res.output


@pytest.mark.parametrize("a, b", [("fp32", "again/fp32"), ("again/fp32", "fp32")])
def test_two_float32_runs_agree(runs, a, b):
    res = CliRunner().invoke(main, ["compare", str(runs / a), str(runs / b)])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("planted", PLANTED)
@pytest.mark.parametrize("planted_is_a", [True, False])
def test_a_wrong_activation_against_float32_is_named_on_its_rank(runs, planted, planted_is_a):
    """An activation 5 % off in the bfloat16 run (relu on rank 1 or on every rank, gelu or silu on
    rank 1), against the float32 run: 5 % is within the 16 bfloat16 roundings a stretch of ops may
    grow, which once passed it as rounding.  Measured at its extremes, the activation is named on
    the rank it is wrong on, in both orders; the backward follows from the forward's values, and no
    line says the errors grew from rounding."""
    op, rank = PLANTED[planted]
    a, b = (planted, "fp32") if planted_is_a else ("fp32", planted)
    res = CliRunner().invoke(main, ["compare", str(runs / a), str(runs / b)])
    assert res.exit_code == 2, res.output
    forward = next(line for line in res.output.splitlines() if line.startswith("first forward divergence"))
    assert forward.startswith(f"first forward divergence: aten.{op}.default [") and f"step 0 rank {rank})" in forward, \
        res.output
    # its own difference measured at its extremes, whatever its input holds: no "origin approximate"
    assert "origin approximate" not in forward, forward
    assert "rounding size" not in res.output, res.output
    verdict = compare(runs / a, runs / b).verdict
    assert (verdict.forward.cause, verdict.forward.step, verdict.forward.rank) == ("op", 0, rank)
    assert verdict.backward.cause == "inherited", res.output


def test_foreach_copy_records_the_parameters_it_cast(runs):
    """FSDP2's cast of the parameters into its all-gather buffer (``_foreach_copy_``, returning
    nothing) records what it wrote as its outputs: each bfloat16 copy, measured, one per parameter
    it was given."""
    for rank in (0, 1):
        copies = [r for r in load(runs / "bf16").part(0, rank).records if r["op"] == "aten._foreach_copy_.default"]
        assert copies
        for r in copies:
            given = r["inputs"][1]["value"]
            assert len(r["outputs"]) == len(given), r
            for out, src in zip(r["outputs"], given):
                assert out["dtype"] == "bfloat16" and src["dtype"] == "float32", r
                assert out["shape"] == src["shape"] and "stats" in out, r
                assert out["stats"]["max"] == pytest.approx(src["stats"]["max"], rel=2 ** -8), r
