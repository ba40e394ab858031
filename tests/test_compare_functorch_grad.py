"""compare of a training step whose gradient ``torch.func.grad`` over ``functional_call`` computes
against the same step by autograd (``loss.backward()``): a tiny Llama, tensors saved, AdamW.

Under ``grad`` torch decomposes silu's backward (``sigmoid``, ``mul`` after ``mul``, ``add``), where
autograd runs one ``silu_backward`` kernel: the one kernel stands in for the pieces.  Paired by
closest statistics, it took the piece ``g * sigmoid(x)``, whose statistics a forward difference (a
wrong ``rsqrt`` in one run) left nearer than the whole value's: the backward then named
``silu_backward`` as a divergence of its own, comparing two different values.  A piece another
piece reads is not the whole value; the verdict follows the forward's difference, whichever run is A."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, grad

from compare_helpers import planted_kernel, tiny_llama, wrong_silu_backward
from dispatchprobe import DispatchProbe
from dispatchprobe.offline.compare import compare

pytest.importorskip("transformers")


def _wrong_rsqrt(x):
    """rsqrt 0.2 % too large."""
    return torch.sqrt(x).reciprocal() * 1.002


def _record(path, functorch: bool, op: str | None = None, kernel=None):
    """One AdamW step of the tiny Llama, its gradient by ``torch.func.grad`` (``functorch``) or by
    autograd, recorded with tensors; ``op``/``kernel``: a wrong aten kernel for the run."""
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))

    def loss(params):
        return functional_call(model, params, (), {"input_ids": x, "labels": x}).loss

    probe = DispatchProbe(task="tensor", dump_path=str(path))
    with planted_kernel(op, kernel):
        with probe:
            if functorch:
                grads = grad(loss)({k: v.detach() for k, v in model.named_parameters()})
                for name, p in model.named_parameters():
                    p.grad = grads[name]
            else:
                loss(dict(model.named_parameters())).backward()
        opt.step()
        probe.step()
    probe.close()
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("functorch")
    return {"autograd": _record(root / "autograd", False), "func": _record(root / "func", True),
            "func_rsqrt": _record(root / "func_rsqrt", True, "rsqrt", _wrong_rsqrt),
            "autograd_silu_backward": _record(root / "autograd_silu_backward", False, "silu_backward",
                                              wrong_silu_backward)}


@pytest.mark.parametrize("a, b", [("autograd", "func"), ("func", "autograd")])
def test_clean_grad_and_autograd_agree(runs, a, b):
    assert compare(runs[a], runs[b])[1].passed


@pytest.mark.parametrize("a, b", [("autograd", "func_rsqrt"), ("func_rsqrt", "autograd")])
def test_a_wrong_forward_kernel_names_no_backward_op(runs, a, b):
    """The forward names rsqrt; the backward's errors follow from it (silu's backward is compared with
    the decomposition's last ``mul``, the whole value, not a piece of it)."""
    v = compare(runs[a], runs[b])[1]
    assert v.forward is not None and v.forward.op == "aten.rsqrt.default", str(v)
    assert v.backward is not None and v.backward.cause == "inherited", str(v)


@pytest.mark.parametrize("a, b", [("autograd_silu_backward", "func"), ("func", "autograd_silu_backward")])
def test_a_wrong_backward_kernel_against_its_decomposition_is_named(runs, a, b):
    v = compare(runs[a], runs[b])[1]
    assert v.forward is None, str(v)
    assert v.backward is not None and "aten.silu_backward.default" in (v.backward.op, v.backward.other_op), str(v)
