"""Activation checkpointing re-runs forward ops inside backward.  Their records are marked
``recompute`` with the scope of the module re-run (not the autograd node whose saved tensor
triggered it), and compare never judges a re-run one run has alone: a checkpointed run against a
plain one gives the plain comparison's verdicts, in both orders.  HF's gradient checkpointing
(non-reentrant), ``torch.utils.checkpoint(use_reentrant=True)`` on a plain module, statistics and
tensor tasks; a ``torch.autograd.grad`` inside a forward (gradient penalty) is no re-run."""

from __future__ import annotations

import json

import pytest
import torch
from compare_helpers import planted_kernel, tiny_llama, wrong_silu_backward
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from dispatchprobe import DispatchProbe
from dispatchprobe.offline.compare import compare

transformers = pytest.importorskip("transformers")

PLANTS = {   # slightly wrong CPU kernels, overriding aten's
    "silu": lambda x: x * torch.sigmoid(x) * (1 + 1e-3 * torch.sign(x)),
    "silu_backward": wrong_silu_backward,
}


def _record(path, model, step_fn, task: str = "statistics", plant: str | None = None):
    with planted_kernel(plant, PLANTS.get(plant)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        probe = DispatchProbe(task=task, dump_path=str(path))
        with probe:
            step_fn(model).backward()
        opt.step()
        probe.step()
        probe.close()
    return path


def _llama_loss(model):
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    return model(input_ids=x, labels=x, use_cache=False).loss


class Block(nn.Module):
    def __init__(self, dim: int = 32):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(dim, 4 * dim), nn.SiLU(), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(self.act(self.up(x)))


class Net(nn.Module):
    """Two blocks, each checkpointed with the reentrant variant when ``checkpointed``."""

    def __init__(self, checkpointed: bool):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.blocks, self.head = nn.Linear(16, 32), nn.ModuleList([Block(), Block()]), nn.Linear(32, 4)
        self.checkpointed = checkpointed

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=True) if self.checkpointed else block(h)
        return self.head(h)


def _net_loss(model):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    return F.mse_loss(model(x), y)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama_ac")
    runs = {"plain": (False, None), "gc": (True, None), "silu": (False, "silu"), "gc_silu": (True, "silu"),
            "gc_silu_backward": (True, "silu_backward"), "silu_backward": (False, "silu_backward")}
    return {k: _record(root / k, tiny_llama(gc), _llama_loss, plant=plant) for k, (gc, plant) in runs.items()}


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    root = tmp_path_factory.mktemp("net_ac")
    out = {}
    for task in ("statistics", "tensor"):
        for name, (ac, plant) in {"plain": (False, None), "ac": (True, None), "ac_silu_backward": (True, "silu_backward"),
                                  "silu_backward": (False, "silu_backward")}.items():
            out[task, name] = _record(root / f"{task}_{name}", Net(ac), _net_loss, task=task, plant=plant)
    return out


def _records(path) -> list:
    return [json.loads(line) for f in sorted(path.glob("step*/rank*/ops.jsonl")) for line in f.open()]


def _both(a, b):
    return [compare(a, b)[1], compare(b, a)[1]]


def _names_no_rerun(v) -> None:
    for d in (v.forward, v.backward, *v.departures):
        assert d is None or not d.recomputed, str(v)


def test_recomputed_ops_are_marked_with_the_module_they_re_run(llama):
    recs = _records(llama["gc"])
    rerun = [r for r in recs if r.get("recompute")]
    assert rerun and all(r["stage"] == "backward" and r["grad_fn"] is None for r in rerun)
    silu = [r["scope"] for r in rerun if r["op"] == "aten.silu.default"]
    assert silu == ["LlamaForCausalLM.model.layers.1.mlp.act_fn", "LlamaForCausalLM.model.layers.0.mlp.act_fn"]
    assert not any(r.get("recompute") for r in _records(llama["plain"]))


def test_a_checkpointed_run_agrees_with_a_plain_one(llama):
    for v in _both(llama["plain"], llama["gc"]):
        assert v.passed and v.forward is None and v.backward is None, str(v)
        _names_no_rerun(v)
        assert "recomputed by activation checkpointing in run" in str(v), str(v)


def test_backward_follows_from_forward_values_as_without_checkpointing(llama):
    plain = compare(llama["silu"], llama["plain"])[1]
    assert plain.backward is not None and plain.backward.cause == "inherited", str(plain)
    for v in _both(llama["silu"], llama["gc"]):
        assert (v.forward.op, v.forward.scope) == ("aten.silu.default", "LlamaForCausalLM.model.layers.0.mlp.act_fn")
        assert v.backward is not None and v.backward.cause == plain.backward.cause, str(v)
        _names_no_rerun(v)


def test_both_checkpointed_a_re_run_op_is_named_with_its_forward_scope(llama):
    for v in _both(llama["gc"], llama["gc_silu"]):
        assert (v.forward.op, v.forward.scope) == ("aten.silu.default", "LlamaForCausalLM.model.layers.0.mlp.act_fn")
        b = v.backward
        assert b is not None and (b.cause == "inherited" or (
            b.op == "aten.silu.default" and b.scope.endswith("mlp.act_fn") and b.recomputed)), str(v)


@pytest.mark.parametrize("pair", [("gc_silu_backward", "plain"), ("gc", "silu_backward")])
def test_a_wrong_backward_kernel_is_named_against_a_plain_run(llama, pair):
    for v in _both(*(llama[k] for k in pair)):
        assert v.backward is not None and v.backward.cause == "op", str(v)
        assert (v.backward.op, v.backward.scope) == ("aten.silu_backward.default",
                                                     "LlamaForCausalLM.model.layers.1.mlp.act_fn"), str(v)


@pytest.mark.parametrize("task", ["statistics", "tensor"])
def test_reentrant_checkpoint_of_a_plain_module(net, task):
    rerun = [r for r in _records(net[task, "ac"]) if r.get("recompute")]
    assert {r["scope"] for r in rerun} == {"Net.blocks.0", "Net.blocks.0.up", "Net.blocks.0.act", "Net.blocks.0.down",
                                           "Net.blocks.1", "Net.blocks.1.up", "Net.blocks.1.act", "Net.blocks.1.down"}
    for v in _both(net[task, "plain"], net[task, "ac"]):
        assert v.passed and v.forward is None and v.backward is None, str(v)
        _names_no_rerun(v)
    for pair in (("ac_silu_backward", "plain"), ("ac", "silu_backward")):
        for v in _both(*(net[task, k] for k in pair)):
            assert v.backward is not None and v.backward.cause == "op", str(v)
            assert (v.backward.op, v.backward.scope) == ("aten.silu_backward.default", "Net.blocks.1.act"), str(v)


class Penalised(nn.Module):
    """A gradient penalty: ``torch.autograd.grad(create_graph=True)`` inside a module's forward."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x):
        x = x.requires_grad_()
        out = self.inner(x)
        (grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        return out.mean() + grad.pow(2).mean()


def test_a_backward_inside_a_forward_is_no_recompute(tmp_path):
    torch.manual_seed(0)
    path = _record(tmp_path / "penalty", Penalised(), lambda m: m(torch.randn(4, 8)))
    recs = _records(path)
    assert any(r["stage"] == "backward" for r in recs)
    assert not any(r.get("recompute") for r in recs)
