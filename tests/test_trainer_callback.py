"""``transformers.Trainer`` with ``callbacks=[DispatchProbeCallback(...)]``: a tiny Llama trained 3
optimizer steps of 2 gradient-accumulation micro-steps (tests/trainer_train.py) ends with the
parameters of the same training without the callback, bit for bit; each optimizer step is one
step of records holding the forward and backward of both micro-steps; two such runs compare clean
and a planted x1.001 in one layer is named; the grad probe and 2 gloo ranks under torchrun too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dispatchprobe import ConfigError
from dispatchprobe.cli import main
from dispatchprobe import DispatchProbeCallback

sys.path.insert(0, str(Path(__file__).parent))
from trainer_train import BATCH, MICRO_STEPS, STEPS, train  # noqa: E402

SCRIPT = Path(__file__).with_name("trainer_train.py")


def identical(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def records(run: Path, step: int, rank: int = 0) -> list[dict]:
    return [json.loads(line) for line in (run / f"step{step}" / f"rank{rank}" / "ops.jsonl").read_text().splitlines()]


def compare(a: Path, b: Path):
    return CliRunner().invoke(main, ["compare", str(a), str(b), "-o", str(a.parent / f"cmp_{a.name}_{b.name}")])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The unprobed training's parameters and one recorded run of it."""
    out = tmp_path_factory.mktemp("trainer")
    reference = train(str(out / "trainer"))
    probed = train(str(out / "trainer"), [DispatchProbeCallback(task="statistics", dump_path=str(out / "a"))])
    return out, reference, probed


def test_training_is_bit_identical_and_each_optimizer_step_is_a_step(trained):
    out, reference, probed = trained
    assert identical(probed, reference)
    assert sorted(p.name for p in (out / "a").glob("step*")) == [f"step{i}" for i in range(STEPS)]
    for step in range(STEPS):
        ops = records(out / "a", step)
        # every micro-step's forward and backward: one embedding lookup and one gradient each
        assert sum(r["op"] == "aten.embedding.default" for r in ops) == MICRO_STEPS
        assert sum(r["op"] == "aten.embedding_dense_backward.default" for r in ops) == MICRO_STEPS
        names = {r["op"] for r in ops}
        assert "aten._foreach_norm.Scalar" in names        # gradient clipping is in the step's records
        assert not any("lerp" in op or "addcdiv" in op for op in names)     # AdamW's update is not,
        assert (out / "a" / f"step{step}" / "rank0" / "params.jsonl").exists()      # its parameter records are


def test_two_trainer_runs_compare_clean_and_a_planted_change_is_named(trained):
    out, reference, _ = trained
    train(str(out / "trainer"), [DispatchProbeCallback(task="statistics", dump_path=str(out / "b"))])
    res = compare(out / "a", out / "b")
    assert res.exit_code == 0 and "unmatched" not in res.output, res.output

    def plant(model):      # a hook x1.001 on one layer: the bug to find
        model.model.layers[1].mlp.down_proj.register_forward_hook(lambda mod, args, output: output * 1.001)

    planted = train(str(out / "trainer"), [DispatchProbeCallback(task="statistics", dump_path=str(out / "c"))], plant)
    assert not identical(planted, reference)
    res = compare(out / "c", out / "a")
    assert res.exit_code == 2, res.output
    first = next(line for line in res.output.splitlines() if line.startswith("first forward divergence"))
    assert "LlamaForCausalLM.model.layers.1.mlp.down_proj" in first and "aten.mul" in first, res.output


def test_grad_probe_records_each_optimizer_step(tmp_path, trained):
    _, reference, _ = trained
    probed = train(str(tmp_path / "trainer"), [DispatchProbeCallback(task="grad_probe", dump_path=str(tmp_path / "g"))])
    assert identical(probed, reference)
    for step in range(STEPS):
        rows = [json.loads(line) for line in (tmp_path / "g" / f"step{step}" / "rank0" / "grads.jsonl").read_text()
                .splitlines()]
        assert any("layers.1.mlp.down_proj.weight" in json.dumps(r) for r in rows), rows[:2]
    assert not (tmp_path / "g" / f"step{STEPS}").exists()


def test_step_selects_optimizer_steps(tmp_path, trained):
    _, reference, _ = trained
    probed = train(str(tmp_path / "trainer"), [DispatchProbeCallback(task="statistics", step=[1],
                                                                     dump_path=str(tmp_path / "s"))])
    assert identical(probed, reference)
    assert sorted(p.name for p in (tmp_path / "s").glob("step*")) == ["step1"]
    assert sum(r["op"] == "aten.embedding.default" for r in records(tmp_path / "s", 1)) == MICRO_STEPS


def test_a_run_stopped_by_an_exception_is_ended_by_closing_the_probe(tmp_path):
    """Trainer tells callbacks nothing when training raises: the probe is still recording until
    callback.probe.close(), and what was written is readable."""
    from dispatchprobe import load

    def plant(model):      # the second optimizer step's first forward raises
        calls = []

        def fail(mod, args):
            calls.append(1)
            if len(calls) > MICRO_STEPS:
                raise RuntimeError("planted failure")
        model.model.layers[0].register_forward_pre_hook(fail)

    callback = DispatchProbeCallback(task="statistics", dump_path=str(tmp_path / "x"))
    with pytest.raises(RuntimeError, match="planted failure"):
        train(str(tmp_path / "trainer"), [callback], plant)
    assert callback.probe.active
    callback.probe.close()
    assert not callback.probe.active
    assert sorted(load(tmp_path / "x").parts)[0][0] == 0 and records(tmp_path / "x", 0)


def test_a_bad_key_fails_when_the_callback_is_made():
    with pytest.raises(ConfigError, match="unknown key 'taks'"):
        DispatchProbeCallback(taks="statistics")


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_torchrun_two_gloo_ranks(tmp_path):
    """Trainer's DDP on 2 gloo ranks: one folder per rank, bit-identical training on both, two
    runs compare clean, the ranks agree (`dispatchprobe ranks`), the grad probe per rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"result{rank}.json").read_text())
        assert result == {run: {"identical": True} for run in ("a", "b", "grad")}, result
        for step in range(STEPS):
            ops = records(tmp_path / "a", step, rank)
            assert sum(r["op"] == "aten.embedding.default" for r in ops) == MICRO_STEPS
            assert any(r["op"].startswith("c10d.allreduce") for r in ops)       # DDP's gradient reduction
            assert (tmp_path / "grad" / f"step{step}" / f"rank{rank}" / "grads.jsonl").exists()
    res = compare(tmp_path / "a", tmp_path / "b")
    assert res.exit_code == 0 and "unmatched" not in res.output, res.output
    res = CliRunner().invoke(main, ["ranks", str(tmp_path / "a")])
    assert res.exit_code == 0 and "the ranks agree" in res.output, res.output
    # one process of the same global batch: transformers multiplies a data-parallel loss by the world
    # size (2 against 1 here), so the loss's 0-dim gradients differ by design (not paired, never an
    # error) and the rest agrees, in both orders; a planted x1.001 in one layer parts the runs there
    one = tmp_path / "one"
    train(str(one / "trainer"), [DispatchProbeCallback(task="statistics", dump_path=str(one / "a"))],
          batch=2 * BATCH)
    for a, b in ((one / "a", tmp_path / "a"), (tmp_path / "a", one / "a")):
        res = compare(a, b)
        assert res.exit_code == 0 and res.output.splitlines()[1].startswith("the runs agree"), res.output
        assert "aten.mul.Tensor.0.backward [<root>]: the loss is not a mean" in res.output, res.output

    def plant(model):
        model.model.layers[1].mlp.down_proj.register_forward_hook(lambda mod, args, output: output * 1.001)

    train(str(one / "trainer"), [DispatchProbeCallback(task="statistics", dump_path=str(one / "c"))], plant,
          batch=2 * BATCH)
    res = compare(one / "c", tmp_path / "a")
    assert res.exit_code == 2 and "model.layers.1.mlp." in res.output.splitlines()[1], res.output
