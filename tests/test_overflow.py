"""task="overflow": the first op that made inf/nan, forward and backward, localized and replayed."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from torch import nn

from dispatchprobe import DispatchProbe, load
from dispatchprobe.core.overflow import OverflowDetected
from dispatchprobe.torch.replay import Skip, check_replayable
from conftest import train


class Block(nn.Module):
    def __init__(self, dim, explode=False):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.explode = explode

    def forward(self, x):
        h = self.fc(x)
        return torch.exp(h * 50) if self.explode else torch.relu(h)   # exp of large logits


class ExpNet(nn.Module):
    """fp16 net whose second layer (layers.1) overflows in forward."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(16), Block(16, explode=True), Block(16)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Cube(nn.Module):
    def forward(self, h):
        return h.pow(3)


class CubeNet(nn.Module):
    """Finite forward (|h|^3 < 65504); the backward of pow (3 h^2 * 100) overflows in fp16."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.cube = Cube()

    def forward(self, x):
        return self.cube(self.fc(x))


def cube_net():
    torch.manual_seed(0)
    net = CubeNet()
    with torch.no_grad():
        net.fc.weight.copy_(torch.eye(8))
        net.fc.bias.zero_()
    return net.half(), torch.full((2, 8), 30.0).half()


def rows(path):
    with open(path / "step0" / "rank0" / "overflow.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("defer", [False, True])
def test_forward_overflow_localized_and_raised(tmp_path, defer):
    """``defer``: the accelerator path (norms kept, read back at the end of the region) on CPU."""
    torch.manual_seed(0)
    net, x = ExpNet().half(), torch.randn(4, 16).half()
    probe = DispatchProbe(task="overflow", dump_path=str(tmp_path), model=net)
    probe.handlers[0].defer = defer
    with pytest.raises(OverflowDetected, match=r"aten\.exp\.default \(forward, scope 'ExpNet\.layers\.1'"):
        with probe:
            net(x).float().sum().backward()
    probe.close()
    crit = [r for r in rows(tmp_path) if r["class"] == "critical"]
    assert len(crit) == 1
    r = crit[0]
    assert (r["op"], r["stage"], r["scope"]) == ("aten.exp.default", "forward", "ExpNet.layers.1")
    assert r["replay"] == "precision" and r["exceeds_dtype_range"] == "True"   # float64 is fine: fp16 range
    assert "test_overflow.py" in r["stack"]
    # the record keeps the inputs as tensors (run-ut can replay it) and carries the verdict
    run = load(tmp_path)
    recs = [json.loads(l) for l in open(tmp_path / "step0" / "rank0" / "ops.jsonl")]
    rec = next(x for x in recs if x.get("overflow", {}).get("class") == "critical")
    assert rec["inputs"][0]["data"] and rec["overflow"]["inf"] > 0
    assert "aten.exp.default" in set(run.ops["op"])
    summary = json.loads((tmp_path / "step0" / "rank0" / "overflow.json").read_text())
    assert summary["first_critical"]["op"] == "aten.exp.default"


@pytest.mark.parametrize("defer", [False, True])
def test_backward_only_overflow_keep_going(tmp_path, defer):
    net, x = cube_net()
    probe = DispatchProbe(task="overflow", dump_path=str(tmp_path), model=net, overflow_nums=-1)
    probe.handlers[0].defer = defer
    with probe:
        y = net(x)
        assert torch.isfinite(y).all()
        (y.float().sum() * 100).backward()
    probe.close()
    crit = [r for r in rows(tmp_path) if r["class"] == "critical"]
    assert crit, "backward overflow not found"
    first = crit[0]
    assert first["stage"] == "backward" and first["scope"] == "CubeNet.cube"
    assert first["grad_fn"] == "PowBackward0" and first["op"] == "aten.mul.Tensor"
    assert not any(r["stage"] == "forward" for r in crit)
    assert any(r["class"] == "propagated" for r in rows(tmp_path))   # later ops: inf in, inf out


def test_check_mode_forward_ignores_backward(tmp_path):
    net, x = cube_net()
    probe = DispatchProbe(task="overflow", dump_path=str(tmp_path), model=net, check_mode="forward")
    with probe:
        (net(x).float().sum() * 100).backward()
    probe.close()
    p = tmp_path / "step0" / "rank0" / "overflow.csv"
    assert not p.exists() or not [r for r in rows(tmp_path) if r["class"] == "critical"]


def test_cast_down_flagged_with_float64_verdict(tmp_path):
    probe = DispatchProbe(task="overflow", dump_path=str(tmp_path), overflow_nums=-1)
    x = torch.tensor([1.0, 7e4, -1e5])
    with probe:
        y = (x * 1.0).half()
    probe.close()
    assert torch.isinf(y).sum() == 2
    r = [r for r in rows(tmp_path) if r["class"] == "critical"][0]
    assert r["op"] == "aten._to_copy.default" and r["replay"] == "precision"
    assert float(r["float64_max_abs"]) == 1e5 and r["exceeds_dtype_range"] == "True"
    rec = [json.loads(l) for l in open(tmp_path / "step0" / "rank0" / "ops.jsonl")][0]
    assert rec["overflow"]["cast"] is True


def test_inherent_overflow_in_float64(tmp_path):
    probe = DispatchProbe(task="overflow", dump_path=str(tmp_path), overflow_nums=-1)
    with probe:
        torch.tensor([1.0, 0.0]) / torch.tensor([0.0, 0.0])
    probe.close()
    r = rows(tmp_path)[0]
    assert r["class"] == "critical" and r["replay"] == "inherent" and r["nan"] == "1" and r["inf"] == "1"


def test_transparent_and_quiet_on_clean_training(tmp_path):
    off = train(None, steps=2, dropout=0.1)
    on = train(DispatchProbe(task="overflow", dump_path=str(tmp_path)), steps=2, dropout=0.1)
    for a, b in zip(off[0], on[0]):
        assert torch.equal(a, b)
    for n in off[1]:
        assert torch.equal(off[1][n], on[1][n]) and torch.equal(off[2][n], on[2][n])
    assert torch.equal(off[3], on[3]), "global RNG consumed"
    for p in tmp_path.glob("step*/rank0/overflow.csv"):
        assert not [r for r in csv.DictReader(open(p)) if r["class"] == "critical"]


class Amplify(nn.Module):
    """Finite but blows up: the output norm is 1000x the input's (fp32, nowhere near overflow)."""

    def forward(self, h):
        return h * 1000.0


class GrowthNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.amp = Amplify()

    def forward(self, x):
        return torch.tanh(self.amp(torch.relu(self.fc(x))))


def test_suspicious_growth_classified(tmp_path):
    torch.manual_seed(0)
    net, x = GrowthNet(), torch.randn(4, 8)
    probe = DispatchProbe(task="overflow", dump_path=str(tmp_path), model=net, check_mode="forward")
    with probe:
        y = net(x)
    probe.close()
    assert torch.isfinite(y).all()
    found = rows(tmp_path)
    assert [r["class"] for r in found] == ["suspicious growth"], found     # only the amplifier
    r = found[0]
    assert r["op"] == "aten.mul.Tensor" and r["scope"] == "GrowthNet.amp" and r["stage"] == "forward"
    assert 999 < float(r["growth"]) < 1001      # |1000 h| / |h|
    summary = json.loads((tmp_path / "step0" / "rank0" / "overflow.json").read_text())
    assert summary["counts"] == {"critical": 0, "propagated": 0, "suspicious growth": 1, "expected": 0,
                                 "scale collapse": 0, "discarded": 0}
    assert summary["first_critical"] is None
    rec = [json.loads(l) for l in open(tmp_path / "step0" / "rank0" / "ops.jsonl")][0]
    assert rec["overflow"]["class"] == "suspicious growth"


def test_no_growth_flags_on_ordinary_ops(tmp_path):
    """A x10 scale, linear, relu, softmax, layer norm, a reduction: ratios below 100, no rows."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.LayerNorm(16), nn.Softmax(-1))
    x = torch.randn(8, 16)
    probe = DispatchProbe(task="overflow", dump_path=str(tmp_path), model=net)
    with probe:
        (net(x * 10.0).sum() * 2.0).backward()
    probe.close()
    assert not (tmp_path / "step0" / "rank0" / "overflow.csv").exists() or not rows(tmp_path)


def test_deferred_checks_leave_autograd_alone(tmp_path):
    """What the accelerator path keeps of an op until the read-back must not be the output
    objects: holding a gradient makes autograd copy it into ``.grad`` instead of stealing it
    (12 extra ops per step on this model before)."""
    from dispatchprobe.models import TinyTransformer, lm_batch, lm_loss
    checked = []
    for defer in (False, True):
        torch.manual_seed(0)
        model = TinyTransformer()
        tokens, targets = lm_batch()
        probe = DispatchProbe(task="overflow", dump_path=str(tmp_path / str(defer)), model=model,
                              overflow_nums=-1)
        probe.handlers[0].defer = defer
        with probe:
            lm_loss(model, tokens, targets).backward()
        checked.append(probe.handlers[0].checked)
        probe.close()
    assert checked[0] == checked[1] > 100


class ExpThenOverwrite(nn.Module):
    """exp overflows in fp16; then its input is zeroed in place, before a deferred check of
    the exp is read back (legal: exp saves its output, not its input)."""

    def forward(self, x):
        h = x * 40.0
        y = torch.exp(h)
        h.zero_()
        return y


@pytest.mark.parametrize("defer", [False, True])
def test_inputs_overwritten_before_read_back_are_not_replayed(tmp_path, defer):
    """A deferred check reads back after later ops ran: the flagged op's inputs may no longer
    hold what it saw.  Replaying zeros would call the overflow "precision"; the version
    counters show the write, so nothing stale is replayed or saved, and run-ut says why."""
    x = torch.full((4, 4), 3.0).half()
    probe = DispatchProbe(task="overflow", dump_path=str(tmp_path), overflow_nums=-1)
    probe.handlers[0].defer = defer
    with probe:
        ExpThenOverwrite()(x)
    probe.close()
    crit = [r for r in rows(tmp_path) if r["class"] == "critical"]
    assert [r["op"] for r in crit] == ["aten.exp.default"]
    rec = next(json.loads(l) for l in open(tmp_path / "step0" / "rank0" / "ops.jsonl")
               if json.loads(l).get("overflow", {}).get("class") == "critical")
    if defer:
        assert crit[0]["replay"].startswith("not replayed (inputs written in place")
        assert rec["inputs_overwritten"] is True and "data" not in rec["inputs"][0]
        with pytest.raises(Skip, match="written in place"):
            check_replayable(rec, random=True)
    else:            # checked while the op's inputs were still intact: exp(120) is finite in float64
        assert crit[0]["replay"] == "precision" and rec["inputs"][0]["data"]
        assert "inputs_overwritten" not in rec
