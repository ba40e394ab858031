"""A gradient hook in one run's backward (``p.register_hook(lambda g: g * 1.5)``) makes the gradient
the optimizer applies and nothing else: no backward record reads it.  compare names the hook's op
as where the difference enters, whichever run is A, with the optimizer inside ``with probe:`` (its
forward-staged ops read the gradient: the backward line names the hook, it said 'no backward
divergence') and outside it (the parameter records say which record made the gradient applied:
named before step 0's differences within tolerance of eager against compiled kernels, which it
was not)."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from dispatchprobe.cli import main
from compare_helpers import FusedQKVAttention, train_attention_steps


class Attention(FusedQKVAttention):
    """The model under its own name: record scopes start with it."""


def _record(path, task: str, inside: bool, hook: str = "", compiled: bool = False):
    """Two SGD steps; ``hook``: "tensor" scales head.weight's gradient x1.5, "module" the head's input
    gradient (a module backward hook); ``inside``: ``opt.step()`` inside ``with probe:``."""
    torch.manual_seed(0)
    model = Attention()
    if hook == "tensor":
        model.head.weight.register_hook(lambda g: g * 1.5)
    elif hook == "module":
        model.head.register_full_backward_hook(lambda m, grad_in, grad_out: (grad_in[0] * 1.5,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return train_attention_steps(model, opt, path, task=task, compiled=compiled, steps=2, optimizer_inside=inside)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hooks")
    made: dict = {}

    def get(task, inside, hook="", compiled=False):
        key = (task, inside, hook, compiled)
        if key not in made:
            made[key] = _record(root / "-".join(map(str, key)), task, inside, hook, compiled)
        return made[key]
    return get


def _both_orders(hooked, clean):
    """The compare output with the hooked run as A, then as B."""
    return [("A", CliRunner().invoke(main, ["compare", str(hooked), str(clean)])),
            ("B", CliRunner().invoke(main, ["compare", str(clean), str(hooked)]))]


@pytest.mark.parametrize("task", ["tensor", "statistics"])
@pytest.mark.parametrize("hook", ["tensor", "module"])
def test_a_hook_inside_the_probe_is_named_in_the_backward(runs, task, hook):
    """Optimizer inside the probe: the forward's error rows follow from backward values, and the
    backward line names the hook's mul as where they enter (present in the hooked run only)."""
    for side, got in _both_orders(runs(task, True, hook), runs(task, True)):
        assert got.exit_code == 2, got.output
        line = next(x for x in got.output.splitlines() if x.startswith(("first backward", "no backward", "backward")))
        assert line.startswith("first backward divergence: aten.mul.Tensor [Attention.head]"), got.output
        assert f"present only in run {side} (prime suspect)" in line, got.output


@pytest.mark.probe_backend
@pytest.mark.parametrize("task", ["tensor", "statistics"])
def test_a_hook_outside_the_probe_is_named_before_rounding_departures(runs, task):
    """Optimizer outside the probe, the hooked eager run against a compiled one: step 1's parameters
    differ; the parameter records say the hook's mul made head.weight's gradient as applied, and that
    is named, not step 0's softmax departure within tolerance (it was, both orders)."""
    for side, got in _both_orders(runs(task, False, "tensor"), runs(task, False, compiled=True)):
        assert got.exit_code == 2, got.output
        assert "they come from step 0: aten.mul.Tensor [Attention.head] call 1 (#7 in backward), present only in " \
               f"run {side}, which made the gradient applied; parameter head.weight differs after it" in got.output, \
            got.output
        assert "first forward divergence: aten._softmax" not in got.output, got.output
