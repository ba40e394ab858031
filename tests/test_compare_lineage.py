"""compare names where a difference enters, by lineage, even below the threshold: a 0.1% change
planted in one block of a transformers model is named at that block (not at the next op that
amplifies it); a compiled division that skips a rounding is the first departure of runs that agree
within tolerance; inputs that differ at step 1 are traced to the step-0 backward op they came from."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from click.testing import CliRunner
from torch import nn
from torch.nn import functional as F

from dispatchprobe import DispatchProbe, compare
from dispatchprobe.cli import main

pytest.importorskip("transformers")
sys.path.insert(0, os.path.dirname(__file__))
from compare_helpers import record_tiny, tiny_model  # noqa: E402


# ---- a x1.001 planted in one block -------------------------------------------------------------------
@pytest.mark.parametrize("arch, task", [("llama", "tensor")] + [pytest.param(a, t, marks=pytest.mark.slow) for a, t in
                                                               (("gpt2", "tensor"), ("bert", "tensor"), ("phi", "tensor"),
                                                                ("llama", "statistics"))])
def test_planted_scale_named_at_its_block(arch, task, tmp_path):
    """One SGD step of a tiny ``arch`` (tests/compare_helpers.py): "hook" scales the block's output by
    1.001 in a forward hook (an op in this run only), "inside" multiplies it by 1.001 in its forward
    where the other run ("inside0") multiplies by 1.0 (the same op)."""
    model, block, inputs = tiny_model(arch)
    scope = f"{type(model).__name__}.{block}"
    runs = {p: record_tiny(model, block, inputs, tmp_path / str(p), plant=p, task=task, steps=1, optimizer="sgd")
            / "step0" / "rank0" for p in (None, "hook", "inside", "inside0")}
    for planted, clean in (("hook", None), ("inside", "inside0")):
        for a, b in ((planted, clean), (clean, planted)):
            _, v = compare(runs[a], runs[b])
            named = v.forward or v.departures[0]
            assert named.stage == "forward" and named.scope == scope and named.op == "aten.mul.Tensor", (a, b, str(v))
            assert named.cause == ("unmatched" if planted == "hook" else "op"), (a, b, str(v))
            # placed on statistics, an op's own difference is approximate (equal statistics, not equal values)
            assert named.approximate == (task == "statistics" and planted == "inside"), str(v)
            if planted == "hook":
                assert named.side == ("a" if a == "hook" else "b"), str(v)
            # where it is named, the terminal says so
            line = next(ln for ln in str(v).splitlines() if "aten.mul.Tensor" in ln)
            assert scope in line and ("divergence" in line or "departure" in line), str(v)


# ---- eager vs inductor: the division whose divisor is not rounded (pytorch#141436) -----------------
class _Scale(nn.Module):
    def forward(self, y_bf16, x):
        return y_bf16 / (x * 3.0).to(torch.bfloat16)


class _DivNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = _Scale()

    def forward(self, y_bf16, x):
        return self.scale(y_bf16, x) * 2


@pytest.mark.probe_backend
def test_compiled_division_is_a_departure_within_tolerance(tmp_path):
    """Inductor divides by the float32 divisor where eager rounds it to bfloat16 first: the div's
    recorded inputs agree, its output differs on about a quarter of its elements, no row errors."""
    from dispatchprobe.torch.compile import probe_backend
    g = torch.Generator().manual_seed(0)
    y, x = torch.randn(64, 64, generator=g).to(torch.bfloat16), torch.randn(64, 64, generator=g)
    model = _DivNet()
    with DispatchProbe(task="tensor", dump_path=str(tmp_path / "eager"), level="mix") as probe:
        eager = model(y, x)
    probe.close()
    torch._dynamo.reset()
    backend = probe_backend(task="tensor", dump_path=str(tmp_path / "compiled"), level="mix")
    compiled = torch.compile(model, backend=backend)(y, x)
    backend.close()
    torch._dynamo.reset()
    if torch.equal(eager, compiled):
        pytest.skip("this torch's inductor rounds the divisor like eager (pytorch#141436 fixed)")
    for a, b in (("compiled", "eager"), ("eager", "compiled")):
        table, v = compare(tmp_path / a, tmp_path / b)
        assert v.passed and v.forward is None, str(v)
        d = v.departure
        assert (d.op, d.scope, d.cause, d.stage) == ("aten.div.Tensor", "_DivNet.scale", "op", "forward"), str(v)
        div = table[(table.op_a == "aten.div.Tensor") & (table.kind == "op")]
        assert (div[div.io == "input"].error == 0).all() and (div[div.io == "output"].error > 0).all()
        res = CliRunner().invoke(main, ["compare", str(tmp_path / a), str(tmp_path / b)])
        assert res.exit_code == 0, res.output
        assert "the runs agree within tolerance; first departure: aten.div.Tensor [_DivNet.scale]" in res.output
        assert "\nthe runs agree\n" not in res.output


# ---- step 1's inputs differ: from which step-0 op -------------------------------------------------
class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _two_steps(path, grad_scale: float | None, lr: float = 0.5, optimizer_inside: bool = False):
    """Two SGD steps; ``grad_scale``: fc1's weight gradient scaled in step 0's backward only;
    ``optimizer_inside``: the optimizer steps inside ``with probe:`` (its ops recorded)."""
    torch.manual_seed(0)
    model = _Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    probe = DispatchProbe(task="tensor", dump_path=str(path))
    for step in range(2):
        hook = model.fc1.weight.register_hook(lambda g: g * grad_scale) if grad_scale and step == 0 else None
        g = torch.Generator().manual_seed(step)
        with probe:
            F.mse_loss(model(torch.randn(8, 16, generator=g)), torch.randn(8, 4, generator=g)).backward()
            if optimizer_inside:
                opt.step()
        if hook:
            hook.remove()
        if not optimizer_inside:
            opt.step()
        opt.zero_grad()
        probe.step()
    probe.close()
    return path


@pytest.mark.parametrize("scale", [1.001, 1.5])
def test_later_inputs_traced_to_the_step0_backward_op(tmp_path, scale):
    a, b = _two_steps(tmp_path / "planted", scale), _two_steps(tmp_path / "clean", None)
    _, v = compare(a, b)
    fwd = v.forward or next(d for d in v.departures if d.stage == "forward")
    assert fwd.step == 1 and fwd.cause == "inputs", str(v)
    assert fwd.came_from.startswith("they come from step 0") and "aten.mul.Tensor [_Mlp.fc1]" in fwd.came_from \
        and "backward" in fwd.came_from and "present only in run A" in fwd.came_from, str(v)
    # named as the source where the parameter records show the gradient it made differ as applied,
    # else as a suspect beside the optimizer step (a one-run-only op may be a decomposition)
    if scale == 1.5:
        assert fwd.came_from.startswith("they come from step 0: aten.mul.Tensor") \
            and "which made the gradient applied" in fwd.came_from \
            and "its gradient as the optimizer applied it differs too" in fwd.came_from, str(v)
    else:
        assert "or from its optimizer step" in fwd.came_from, str(v)
    assert fwd.came_from in str(v)
    # the step-0 forward agrees bit for bit
    table, _ = compare(a / "step0" / "rank0", b / "step0" / "rank0")
    assert (table[table.stage == "forward"].error == 0).all()



def test_an_optimizer_inside_the_probe_follows_the_gradients(tmp_path):
    """The optimizer inside the probe: its forward-staged ops read gradients the backward made
    (here scaled by a gradient hook in one run), so their errors follow from backward values, not
    from forward ones (the line said 'differing forward values'), either run as A."""
    a = _two_steps(tmp_path / "planted", 1.5, optimizer_inside=True)
    b = _two_steps(tmp_path / "clean", None, optimizer_inside=True)
    for x, y in ((a, b), (b, a)):
        _, v = compare(x, y)
        assert v.forward is not None and v.forward.step == 0 and v.forward.cause == "inherited", str(v)
        line = str(v).splitlines()[1]
        assert line.startswith("forward: no forward op diverges by itself; its ") and \
            "error rows follow from differing backward values (first at " in line, line


def test_later_inputs_traced_to_the_optimizer_step(tmp_path):
    """Step 0's records agree bit for bit (the optimizer runs outside the probe, here with another
    learning rate): step 1's differing parameters come from the optimizer step."""
    a, b = _two_steps(tmp_path / "lr", None, lr=0.25), _two_steps(tmp_path / "clean", None)
    _, v = compare(a, b)
    fwd = v.forward or next(d for d in v.departures if d.stage == "forward")
    assert fwd.step == 1 and fwd.cause == "inputs", str(v)
    # the parameter records name the parameter the optimizer step moved apart
    assert fwd.came_from.startswith("step 0's op records agree; they come from its optimizer step: parameter "
                                    "fc1.weight differs after it"), str(v)
    assert fwd.came_from.endswith("while its gradient as the optimizer applied it agrees"), str(v)


# ---- the float64 re-run tells an amplified difference from one an op adds ------------------------
class _Cancel(nn.Module):
    def __init__(self):
        super().__init__()
        self.act = nn.Tanh()

    def forward(self, x):
        return (self.act(x) + 1000.0) - 1000.0    # the sub cancels: relative differences grow ~1000-fold


def _record_cancel(path, plant: bool):
    """``plant``: aten::tanh on CPU computed by another formula (differs by a rounding or two)."""
    x = torch.rand(64, 64, generator=torch.Generator().manual_seed(0)) + 0.5
    lib = torch.library.Library("aten", "IMPL") if plant else None
    if plant:
        lib.impl("tanh", lambda t: 1 - 2 / (torch.exp(2 * t) + 1), "CPU")
    try:
        with DispatchProbe(task="tensor", dump_path=str(path)) as probe:
            _Cancel()(x)
        probe.close()
    finally:
        if lib is not None:
            lib._destroy()
    return path


def test_float64_rerun_clears_an_op_that_only_amplifies(tmp_path, monkeypatch):
    """The sub's output differs 1000-fold more than its input (an origin by the recorded errors
    alone), but re-run in float64 on each run's inputs it adds nothing: the difference enters at tanh."""
    a, b = _record_cancel(tmp_path / "a", True), _record_cancel(tmp_path / "b", False)
    table, v = compare(a, b)
    d = v.departure
    assert (d.op, d.scope, d.cause, d.approximate) == ("aten.tanh.default", "_Cancel.act", "op", False), str(v)
    assert list(table[table.origin].op_a) == ["aten.tanh.default"]
    # without the re-run (the framework not importable) the recorded errors decide: approximate
    from dispatchprobe.offline.compare import driver
    monkeypatch.setattr(driver, "float64_rerun", lambda *args: None)
    _, v = compare(a, b)
    d = v.departure
    assert (d.op, d.approximate) == ("aten.sub.Tensor", True), str(v)
    assert "origin approximate" in str(v)
