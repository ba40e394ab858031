"""Module scopes: what a module's own hooks run belongs to that module, and a probe entered at
every step leaves a compiled model compiled."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dispatchprobe import DispatchProbe, load


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 8), nn.GELU())
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.mlp(x))


def _hooked():
    torch.manual_seed(0)
    model = Net()
    model.mlp[0].register_forward_hook(lambda m, args, out: out * 1.5)                 # e.g. an adapter's scale
    model.head.register_forward_pre_hook(lambda m, args: (args[0] - 0.25,))            # e.g. a quantiser's shift
    model.head.register_forward_hook(lambda m, args, kwargs, out: out.tanh(), with_kwargs=True, prepend=True)
    return model


def test_ops_of_a_modules_own_hooks_are_in_its_scope(tmp_path):
    model = _hooked()
    probe = DispatchProbe(task="statistics", dump_path=str(tmp_path), level="mix")
    with probe:
        model(torch.randn(4, 8)).sum().backward()
    probe.close()
    recs = load(tmp_path).part(0, 0).records
    ops = {(r["op"], r["stage"]): r["scope"] for r in recs if r["kind"] == "op"}
    assert ops[("aten.mul.Tensor", "forward")] == "Net.mlp.0"         # forward hook
    assert ops[("aten.sub.Tensor", "forward")] == "Net.head"          # pre-hook
    assert ops[("aten.tanh.default", "forward")] == "Net.head"        # a hook put first
    assert ops[("aten.gelu.default", "forward")] == "Net.mlp.1"
    # their backward too: the module's backward starts at the hooked output
    assert ops[("aten.tanh_backward.default", "backward")] == "Net.head"
    assert ops[("aten.mul.Tensor", "backward")] == "Net.mlp.0"
    # the module record holds the output its hooks made
    head = next(r for r in recs if r["kind"] == "module" and r["scope"] == "Net.head" and r["stage"] == "forward")
    assert -1 <= head["outputs"][0]["stats"]["min"] and head["outputs"][0]["stats"]["max"] <= 1


def test_backward_hooks_and_callbacks_of_a_modules_hooks_are_in_its_scope(tmp_path):
    # as FSDP does: a module's forward hook hooks its output's gradient (pre-backward work) and
    # that hook queues an end-of-backward callback (the root's post-backward reduce-scatter)
    torch.manual_seed(0)
    model = Net()

    def callback():
        torch.ones(3).cumsum(0)

    def pre_backward(grad):
        grad.cos()
        torch.autograd.Variable._execution_engine.queue_callback(callback)

    model.head.register_forward_hook(lambda m, args, out: out.register_hook(pre_backward) and None)
    probe = DispatchProbe(task="statistics", dump_path=str(tmp_path), level="mix")
    with probe:
        model(torch.randn(4, 8)).sum().backward()
    probe.close()
    recs = load(tmp_path).part(0, 0).records
    ops = {r["op"]: r for r in recs if r["kind"] == "op" and r["stage"] == "backward"}
    assert ops["aten.cos.default"]["scope"] == "Net.head"
    # the callback runs after the graph (no autograd node): the outermost module still in backward
    assert ops["aten.cumsum.default"]["scope"] == "Net" and ops["aten.cumsum.default"]["grad_fn"] is None
    assert {r["scope"] for r in recs if r["kind"] == "module" and r["stage"] == "backward"} >= {"Net", "Net.head"}


def test_scopes_survive_a_module_that_raises(tmp_path):
    model = _hooked()
    probe = DispatchProbe(task="statistics", dump_path=str(tmp_path))
    with probe:
        try:
            model(torch.randn(4, 3))           # wrong width: mlp.0 raises
        except RuntimeError:
            pass
        model(torch.randn(4, 8))
    probe.close()
    recs = load(tmp_path).part(0, 0).records
    assert {r["scope"] for r in recs if r["op"] == "aten.gelu.default"} == {"Net.mlp.1"}
    module = torch.nn.modules.module                                  # nothing left behind
    assert not any(getattr(module, name, None) for name in ("_global_backward_pre_hooks", "_global_backward_hooks",
                   "_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_always_called"))


@pytest.mark.parametrize("warm", [False, True])
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("probe_backend", marks=pytest.mark.probe_backend)])
def test_a_probe_entered_each_step_keeps_a_compiled_model_compiled(tmp_path, backend, warm):
    """The README's loop around a compiled model: 12 entries of ``with probe:``, at most two
    compilations (without the probe, with it), and every step holds what ran compiled."""
    from torch._dynamo.utils import counters
    from dispatchprobe.torch.compile import probe_backend
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Net()
    path = str(tmp_path / "run")
    if backend == "probe_backend":
        backend = probe_backend(task="statistics", dump_path=path, inner="aot_eager")
    compiled = torch.compile(model, backend=backend)
    if warm:
        compiled(torch.randn(4, 8))                                 # compiled once without the probe
    probe = DispatchProbe(task="statistics", dump_path=path, overwrite=True)
    for _ in range(12):
        with probe:
            compiled(torch.randn(4, 8)).sum().backward()
        probe.step()
    probe.close()
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    run = load(path)
    for step in range(12):
        recs = run.part(step, 0).records
        ops = {r["op"] for r in recs if not r.get("compiled")}
        assert "aten.sum.default" in ops and "aten.addmm.default" not in ops, (step, ops)   # the graph ran compiled
        if backend != "aot_eager":                                  # and probe_backend recorded it
            compiled_ops = {(r["op"], r["stage"]) for r in recs if r.get("compiled")}
            assert {("aten.addmm.default", "forward"), ("aten.mm.default", "backward")} <= compiled_ops, step
