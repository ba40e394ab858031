"""Module scopes: what a module's own hooks run belongs to that module, a backward op belongs to
the module whose forward made its autograd node (also where no gradient flows into a module's
inputs), compiled runs file backward ops where eager does, and a probe entered at every step
leaves a compiled model compiled."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
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


class Gate(nn.Module):
    """Mixtral's router: logits (returned, unused), softmax, top 2 normalised in place."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 16) * 0.3)

    def forward(self, h):
        logits = F.linear(h, self.weight)
        top, idx = logits.float().softmax(-1).topk(2, dim=-1)
        top /= top.sum(-1, keepdim=True)
        return logits, top, idx


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 16, 16) * 0.3)

    def forward(self, h, idx, top):
        out = 0
        for k in range(2):
            out = out + torch.einsum("nd,nde->ne", h, self.w[idx[:, k]]) * top[:, k:k + 1]
        return out


class Moe(nn.Module):
    """The gate's input is the experts' too: its gradient is done only after the gate's backward."""

    def __init__(self, detach: bool):
        super().__init__()
        self.gate, self.experts, self.detach = Gate(), Experts(), detach

    def forward(self, h):
        _, top, idx = self.gate(h.detach() if self.detach else h)
        return self.experts(h, idx, top)


class MoeModel(nn.Module):
    def __init__(self, detach: bool):
        super().__init__()
        self.inp, self.mlp, self.head = nn.Linear(16, 16), Moe(detach), nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.mlp(self.inp(x))).square().mean()


class Router(nn.Module):
    """Two children whose input (the batch) needs no gradient, the routing ops in the parent."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(16, 4, bias=False)
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        top, _ = self.gate(x).softmax(-1).topk(2, dim=-1)
        top /= top.sum(-1, keepdim=True)
        return (self.proj(x) * top[..., :1]).square().mean()


def _backward_scopes(model, path, backend=None) -> dict:
    """{op: the set of scopes its backward calls are filed under} of one step."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    if backend is None:
        probe = DispatchProbe(task="statistics", dump_path=str(path))
        with probe:
            model(x).backward()
        probe.close()
    else:
        from dispatchprobe.torch.compile import probe_backend
        torch._dynamo.reset()
        probe = probe_backend(task="statistics", dump_path=str(path), inner="aot_eager")
        torch.compile(model, backend=probe)(x).backward()
        probe.close()
        torch._dynamo.reset()
    found: dict = {}
    for r in load(path).part(0, 0).records:
        if r["kind"] == "op" and r["stage"] == "backward":
            found.setdefault(r["op"], set()).add(r["scope"])
    return found


def test_backward_ops_of_a_parent_after_a_child_whose_input_needs_no_grad(tmp_path):
    # proj's and gate's input needs no gradient: no hook sees them leave backward; the parent's
    # div (the in-place normalisation) runs after proj's backward and is still the parent's
    torch.manual_seed(0)
    ops = _backward_scopes(Router(), tmp_path)
    assert ops["aten.div.Tensor"] == ops["aten.neg.default"] == {"Router"}
    assert ops["aten._softmax_backward_data.default"] == ops["aten.scatter.src"] == {"Router"}
    assert ops["aten.mm.default"] == {"Router.proj", "Router.gate"}
    assert ops["aten.sum.dim_IntList"] == {"Router", "Router.proj"}      # proj's bias gradient is its own


@pytest.mark.parametrize("detach", [False, True])
def test_a_routers_backward_is_the_routers_while_the_experts_wait(tmp_path, detach):
    # the experts' input gradient is done only after the gate's backward (or, detached, the gate's
    # input needs none): the routing ops' backward is still the gate's, as in its forward
    torch.manual_seed(0)
    ops = _backward_scopes(MoeModel(detach), tmp_path)
    for op in ("aten.div.Tensor", "aten.neg.default", "aten._softmax_backward_data.default", "aten.scatter.src"):
        assert ops[op] == {"MoeModel.mlp.gate"}, (op, ops[op])
    assert ops["aten.index_put.default"] == {"MoeModel.mlp.experts"}
    assert ops["aten.pow.Tensor_Scalar"] == {"MoeModel"}


@pytest.mark.probe_backend
@pytest.mark.parametrize("detach", [False, True])
def test_compiled_backward_ops_are_filed_where_eager_files_them(tmp_path, detach):
    # the in-place div's autograd node has no forward node of its number in the joint graph:
    # its scope comes from the forward nodes numbered around it (the gate's), not the model
    torch.manual_seed(0)
    model = MoeModel(detach)
    eager = _backward_scopes(model, tmp_path / "eager")
    compiled = _backward_scopes(model, tmp_path / "compiled", backend="probe_backend")
    assert compiled["aten.div.Tensor"] == compiled["aten.neg.default"] == {"MoeModel.mlp.gate"}
    shared = set(eager) & set(compiled)
    assert {"aten.div.Tensor", "aten._softmax_backward_data.default", "aten.index_put.default",
            "aten.mm.default"} <= shared
    assert {op: compiled[op] for op in shared} == {op: eager[op] for op in shared}
