"""task="overflow" under dynamic loss scaling: fp16 autocast + ``torch.amp.GradScaler`` lets early
backward passes overflow and skips those steps; the check marks them expected and trains on, while
a forward overflow, an overflow no scaler catches and a collapsing scale are still reported."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from torch import nn

from dispatchprobe import DispatchProbe, load
from dispatchprobe.core.overflow import OverflowDetected
from dispatchprobe.offline.check_pages import overflow_rows, overflow_summary
from dispatchprobe.offline.summary import summarize

STEPS = 6


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(cfg)


def _train(probe=None, scaler_inside=False, plant=None):
    """fp16 autocast on CPU, GradScaler from 2**22 (the first steps' gradients overflow in fp16).
    ``scaler_inside``: scaler.step/update inside ``with probe:`` and no probe.step() (steps follow
    the optimizer); else the README's loop (the scaler runs outside the probe, probe.step())."""
    model = _llama()
    if plant is not None:
        plant(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 22)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    scales = []
    try:
        for _ in range(STEPS):
            if probe is not None:
                probe.start()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(input_ids=ids, labels=ids).loss
            scaler.scale(loss).backward()
            if probe is not None and not scaler_inside:
                probe.stop()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scales.append(scaler.get_scale())
            if probe is not None:
                probe.stop() if scaler_inside else probe.step()
    finally:
        if probe is not None:
            probe.close()
    return model, scales


def _rows(path):
    out = []
    for f in sorted(path.glob("step*/rank0/overflow.csv")):
        with open(f) as fh:
            out += list(csv.DictReader(fh))
    return out


@pytest.mark.parametrize("scaler_inside, defer", [(False, False), (True, False), (True, True)])
def test_loss_scale_overflows_are_expected_and_training_runs_on(tmp_path, scaler_inside, defer):
    """``defer``: the accelerator path (checks read back later) on CPU: the scaler's verdict waits
    for the ops still pending."""
    ref, ref_scales = _train()
    assert ref_scales[0] < 2.0 ** 22 and ref_scales[-1] == ref_scales[-2]    # skipped first, then stepped
    probe = DispatchProbe(task="overflow", dump_path=str(tmp_path))           # overflow_nums=1
    probe.handlers[0].defer = defer
    model, scales = _train(probe, scaler_inside)
    assert scales == ref_scales
    for a, b in zip(model.state_dict().values(), ref.state_dict().values()):
        assert torch.equal(a, b)                                              # bit-identical training
    rows = _rows(tmp_path)
    expected = [r for r in rows if r["class"] == "expected"]
    assert expected and not [r for r in rows if r["class"] in ("critical", "scale collapse")]
    assert all(r["stage"] == "backward" and r["loss_scale"].startswith("step skipped by the loss scaler")
               for r in expected)
    # found_inf when the scaler's ops run inside the probe, the scale backing off when they do not
    assert all(("found_inf" in r["loss_scale"]) == scaler_inside for r in expected)
    assert probe.summary()["flagged"] == 0 and probe.summary()["expected"] == len(expected)
    step0 = tmp_path / "step0" / "rank0"
    recs = [json.loads(line) for line in (step0 / "ops.jsonl").read_text().splitlines()]
    marked = [r for r in recs if (r.get("overflow") or {}).get("class") == "expected"]
    assert marked and marked[0]["overflow"]["loss_scale"] == expected[0]["loss_scale"]
    assert json.loads((step0 / "overflow.json").read_text())["counts"]["expected"] >= 1

    run = load(tmp_path)
    heading = overflow_summary(run, overflow_rows(run))
    assert "expected backward overflow(s) in steps the loss scaler skipped" in heading[1], heading
    assert "expected (backward overflows in steps the loss scaler skipped" in summarize(run)


def test_planted_forward_overflow_is_still_named(tmp_path):
    def plant(model):       # layer 1's MLP output blows past fp16's range
        model.model.layers[1].mlp.register_forward_hook(lambda mod, args, out: out * 1e9)
    probe = DispatchProbe(task="overflow", dump_path=str(tmp_path))
    with pytest.raises(OverflowDetected, match=r"\(forward, scope 'LlamaForCausalLM\.model\.layers\.1\.mlp'"):
        _train(probe, plant=plant)
    crit = [r for r in _rows(tmp_path) if r["class"] == "critical"]
    assert crit[0]["stage"] == "forward" and crit[0]["scope"] == "LlamaForCausalLM.model.layers.1.mlp"


class _InfGrad(torch.autograd.Function):
    """Identity forward; the backward makes inf from finite values (whatever the loss scale)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g.half() * 1e5


def _net():
    torch.manual_seed(0)
    return nn.Linear(4, 4)


def test_overflow_no_scaler_catches_is_critical(tmp_path):
    """A loss multiplied by a scale, but the optimizer steps with the inf gradient: not caught."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    probe = DispatchProbe(task="overflow", dump_path=str(tmp_path))
    with probe:
        loss = _InfGrad.apply(net(torch.ones(2, 4))).float().sum()
        (loss * torch.tensor(1024.0)).backward()
    with pytest.raises(OverflowDetected, match="not caught: the optimizer stepped"):
        opt.step()
    probe.close()
    crit = [r for r in _rows(tmp_path) if r["class"] == "critical"]
    assert crit and crit[0]["stage"] == "backward" and crit[0]["loss_scale"].startswith("not caught")


def test_collapsing_scale_is_reported(tmp_path):
    """Every step's backward overflows whatever the scale: skipped steps in a row are reported."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    probe = DispatchProbe(task="overflow", dump_path=str(tmp_path))
    probe.handlers[0].skips_in_a_row = 3
    with pytest.raises(OverflowDetected, match="loss scale collapsing: 3 steps in a row skipped"):
        for _ in range(5):
            with probe:
                loss = _InfGrad.apply(net(torch.ones(2, 4))).float().sum()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
            probe.step()
    probe.close()
    classes = [r["class"] for r in _rows(tmp_path)]
    assert classes.count("expected") >= 3 and "scale collapse" in classes
    run = load(tmp_path)
    assert any(line.startswith("loss scale collapsing") for line in overflow_summary(run, overflow_rows(run)))


def test_overflow_held_at_close_is_raised_there(tmp_path):
    """The run ends before anything skipped the step: close() reports it."""
    net = _net()
    probe = DispatchProbe(task="overflow", dump_path=str(tmp_path), model=net)
    with probe:
        loss = _InfGrad.apply(net(torch.ones(2, 4))).float().sum()
        (loss * torch.tensor(1024.0)).backward()
    with pytest.raises(OverflowDetected, match="not caught: no loss scaler skipped the step"):
        probe.close()
    assert [r["class"] for r in _rows(tmp_path)].count("critical") == 1
