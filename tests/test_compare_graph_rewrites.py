"""A compiled graph's rewrite (an inductor pattern pass; inductor 2.14 rewrites ``(x / c).softmax``
so) adds nodes traced from no line of the program: their records have no eager counterpart.  The
probe marks them (``compiled.rewrite``) and compare says so in unmatched.csv's ``explained`` column
and in its warning, instead of guessing 'different models or options?', whichever run is A.  The
rewrite is planted here by a post-grad pass of the test's own, so the same records arise on every
torch.  An op a user's hook adds in one run only is still unexplained and named, and so is a wrong
kernel."""

from __future__ import annotations

import csv

import pytest
import torch
from click.testing import CliRunner
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

from dispatchprobe import DispatchProbe
from dispatchprobe.cli import main
from dispatchprobe.offline.compare.pairing import REWRITTEN
from dispatchprobe.torch.compile import probe_backend

from compare_helpers import FusedQKVAttention, planted_kernel

pytestmark = pytest.mark.probe_backend


class Attention(FusedQKVAttention):
    """The model under its own name: record scopes start with it."""


class ScaleRewrite(CustomGraphPass):
    """A rewrite as inductor's pattern passes make one: the attention scores' ``/ 4.0`` reads a
    ``* 1.0`` of them (exact) inserted without autograd's sequence number or a source line."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in graph.nodes:
            if node.target is torch.ops.aten.div.Tensor and node.args[1] == 4.0 \
                    and getattr(node.args[0], "target", None) is torch.ops.aten.bmm.default:
                scores = node.args[0]
                with graph.inserting_before(node):
                    same = graph.call_function(torch.ops.aten.mul.Tensor, (scores, 1.0))
                same.meta["val"] = scores.meta["val"]
                node.replace_input_with(scores, same)

    def uuid(self) -> str:
        return "dispatchprobe-test-scale-rewrite"


def _wrong_softmax(x, dim, half_to_float):
    """softmax, 0.1% too large."""
    e = torch.exp(x - x.amax(dim, keepdim=True))
    return e / e.sum(dim, keepdim=True) * 1.001


def _record(path, compiled: bool, hook: bool = False, wrong_softmax: bool = False):
    torch.manual_seed(0)
    model = Attention()
    if hook:     # x1.001 on the head's output, an op in this run only
        model.head.register_forward_hook(lambda m, args, out: out * 1.001)
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))
    if compiled:
        backend = probe_backend(task="tensor", dump_path=str(path))
        with inductor_config.patch(post_grad_custom_pre_pass=ScaleRewrite()):
            torch.compile(model, backend=backend)(x).backward()
        backend.step()
        backend.close()
        torch._dynamo.reset()
    else:
        probe = DispatchProbe(task="tensor", dump_path=str(path))
        with planted_kernel("_softmax" if wrong_softmax else None, _wrong_softmax), probe:
            model(x).backward()
        probe.step()
        probe.close()
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rewrites")
    return {"eager": _record(root / "eager", False), "compiled": _record(root / "compiled", True),
            "hook": _record(root / "hook", False, hook=True),
            "wrong softmax": _record(root / "wrong", False, wrong_softmax=True)}


def _compare(runs, order, out):
    got = CliRunner().invoke(main, ["compare", str(runs[order[0]]), str(runs[order[1]]), "-o", str(out)])
    with open(out / "unmatched.csv") as f:
        return got, list(csv.DictReader(f))


@pytest.mark.parametrize("order", [("eager", "compiled"), ("compiled", "eager")])
def test_records_a_graph_rewrite_adds_are_explained(runs, order, tmp_path):
    got, unmatched = _compare(runs, order, tmp_path)
    assert got.exit_code == 0, got.output
    side = "a" if order[0] == "compiled" else "b"
    planted = [r for r in unmatched if r["op"] == "aten.mul.Tensor" and r["stage"] == "forward"]
    assert planted and all(r["side"] == side and r["explained"] == REWRITTEN for r in planted), unmatched
    assert f"of run {side.upper()} have no counterpart: its compiled graph's rewrites" in got.output, got.output
    assert "different models or options?" not in got.output, got.output


@pytest.mark.parametrize("order", [("hook", "compiled"), ("compiled", "hook")])
def test_an_op_a_hook_adds_is_still_unexplained_and_named(runs, order, tmp_path):
    got, unmatched = _compare(runs, order, tmp_path)
    assert got.exit_code == 2, got.output
    side = "A" if order[0] == "hook" else "B"
    assert "first forward divergence: aten.mul.Tensor [Attention.head]" in got.output, got.output
    assert f"present only in run {side}" in got.output, got.output
    hooked = [r for r in unmatched if r["op"] == "aten.mul.Tensor" and r["scope"] == "Attention.head"]
    assert hooked and all(r["side"] == side.lower() and r["explained"] == "" for r in hooked), unmatched
    assert all(r["explained"] == REWRITTEN for r in unmatched if r["side"] != side.lower()
               and r["op"] == "aten.mul.Tensor" and r["scope"] == "Attention"), unmatched


@pytest.mark.parametrize("order", [("wrong softmax", "compiled"), ("compiled", "wrong softmax")])
def test_a_wrong_kernel_beside_a_rewrite_is_still_named(runs, order, tmp_path):
    got, _ = _compare(runs, order, tmp_path)
    assert got.exit_code == 2, got.output
    assert "first forward divergence: aten._softmax.default [Attention]" in got.output, got.output
