"""Two torch versions training one model: torch 2.13 runs attention as one fused
``_scaled_dot_product_flash_attention_for_cpu`` (and its fused backward), torch 2.5.1 with
transformers 4.57 as ``bmm``, ``_safe_softmax``, ``bmm`` whose backward starts with a ``clone`` of
the gradient, and slices the logits' hidden states with a full slice whose backward records a
``slice_backward`` that torch 2.13 does not.  Emulated here on one torch: the math attention
backend, and autograd functions recording the ``clone`` and the ``slice_backward``.

A wrong ``silu`` in the fused run: its backward's differences follow from the forward values the
silu moved, so no backward op is named (compare had named the one-run-only ``slice_backward``,
which hands its gradient on unchanged, and then the other run's attention backward, given values
the silu had moved).  A wrong kernel in the decomposed attention backward is still named.

Both versions' fused kernels under bfloat16 autocast: their float32 ``logsumexp`` outputs, made
from bfloat16 inputs, differ by bfloat16's rounding; compare took that for a difference of the
kernel's own larger than rounding and named the attention where a wrong ``tanh`` after it made
the errors, and named the LM head's backward ``mm`` where the backward's errors follow from it.

Fused against decomposed under bfloat16 autocast (the decomposed one computing in float32): a
clean pair's errors grew from the precisions, no stretch is named; a softmax 1% off in the
decomposed run is."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from compare_helpers import (
    as_other_torch_version,
    record_adamw_steps,
    tiny_gpt2,
    tiny_llama,
)
from torch.nn.attention import SDPBackend, sdpa_kernel

from dispatchprobe import compare

pytest.importorskip("transformers")


class _CloneGradient(torch.autograd.Function):
    """Identity whose backward copies the gradient (torch 2.5.1's attention backward begins so)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.clone()


class _FullSlice(torch.autograd.Function):
    """``x[:, 0:]`` as torch 2.5.1 records it: a ``slice_backward`` that hands the gradient on."""

    @staticmethod
    def forward(ctx, x):
        ctx.shape = list(x.shape)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.ops.aten.slice_backward(grad, ctx.shape, 1, 0, ctx.shape[1], 1)


def _wrong_silu(x):
    return x * torch.sigmoid(x) * (1 + 1e-3 * torch.sign(x))


def _wrong_softmax_backward(grad, output, dim, input_dtype):
    return output * (grad - (grad * output).sum(dim, keepdim=True)) * 1.01


def _loss(model):
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    return model(input_ids=x, labels=x).loss


def _decomposed(model):
    """The model as the older torch runs it (see the module's docstring)."""
    model.lm_head.register_forward_pre_hook(lambda m, args: (_FullSlice.apply(args[0]),))
    for layer in model.model.layers:
        layer.self_attn.o_proj.register_forward_pre_hook(lambda m, args: (_CloneGradient.apply(args[0]),))
    return model


def _record(path, *, fused: bool, plant=None, kernel=None, autocast: bool = False):
    model = tiny_llama() if fused else _decomposed(tiny_llama())
    with contextlib.nullcontext() if fused else sdpa_kernel(SDPBackend.MATH):
        record_adamw_steps(path, model, _loss, steps=1, plant=plant, kernel=kernel, autocast=autocast)
    return path if fused else as_other_torch_version(path)


def _verdicts(a, b):
    """The verdicts of both orders (the fused run first)."""
    return compare(a, b).verdict, compare(b, a).verdict


def test_wrong_silu_in_fused_run_leaves_backward_inherited(tmp_path):
    fused = _record(tmp_path / "fused", fused=True, plant="silu", kernel=_wrong_silu)
    pieces = _record(tmp_path / "pieces", fused=False)
    for v in _verdicts(fused, pieces):
        assert v.forward is not None and v.forward.op == "aten.silu.default", str(v)
        assert v.backward is not None and v.backward.cause == "inherited", str(v)


def test_wrong_kernel_in_decomposed_attention_backward_is_named(tmp_path):
    fused = _record(tmp_path / "fused", fused=True)
    pieces = _record(tmp_path / "pieces", fused=False, plant="_softmax_backward_data", kernel=_wrong_softmax_backward)
    for v in _verdicts(fused, pieces):
        d = v.backward
        assert d is not None and d.cause == "region" and not d.departure, str(v)
        assert "aten._softmax_backward_data.default" in d.region["b" if d.side == "b" else "a"] + d.region.get("a", []) \
            + d.region.get("b", []), str(v)
        assert "self_attn" in d.scope and "cannot tell which" in d.describe(), str(v)


def _wrong_safe_softmax(x, dim, dtype=None):
    return torch.softmax(x, dim, dtype=dtype) * 1.01


def test_clean_bfloat16_attention_of_two_versions_names_no_stretch(tmp_path):
    """Under bfloat16 autocast the decomposed attention casts its bfloat16 query, key and value to
    float32 and computes in float32, the fused kernel reads them as they are: the value the two
    stretches hand on differs by a fraction of a bfloat16 rounding, and the MLP's product two layers
    on fails by two bfloat16 steps of its largest element.  That grew from the runs' precisions: no
    stretch or op is named (compare had named the attention)."""
    fused = _record(tmp_path / "fused", fused=True, autocast=True)
    pieces = _record(tmp_path / "pieces", fused=False, autocast=True)
    for v in _verdicts(fused, pieces):
        assert v.forward is not None and v.forward.cause == "rounding", str(v)
        assert v.forward.follows.startswith("a stretch each run computes with ops of its own [") and \
            "self_attn], before aten._to_copy.default" in v.forward.follows, str(v)
        assert "divergence:" not in str(v), str(v)


def test_wrong_softmax_in_decomposed_bfloat16_attention_is_named(tmp_path):
    """The decomposed attention's softmax 1% too large: within the 16 bfloat16 roundings a difference
    of rounding size may reach, but the value leaving the stretch fails, while what enters it agrees:
    the stretch is named, and the backward's errors follow from the forward values it moved."""
    fused = _record(tmp_path / "fused", fused=True, autocast=True)
    pieces = _record(tmp_path / "pieces", fused=False, autocast=True, plant="_safe_softmax", kernel=_wrong_safe_softmax)
    for v in _verdicts(fused, pieces):
        d = v.forward
        assert d is not None and d.cause == "region" and not d.departure, str(v)
        assert "aten._safe_softmax.default" in d.region["a"] + d.region["b"], str(v)
        assert v.backward is not None and v.backward.cause == "inherited", str(v)


def _fused_scores_in_bfloat16(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """The fused CPU attention as another version computes it: its scores rounded to the inputs'
    dtype before the float32 softmax (GPT-2's attention: no grouped heads, causal, no mask)."""
    s = scale if scale is not None else q.shape[-1] ** -0.5
    scores = ((q @ k.transpose(-1, -2)).float() * s)
    scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = (torch.exp(scores - lse[..., None]) @ v.float()).to(q.dtype)
    laid_out = torch.empty_like(q)
    laid_out.copy_(out)
    lse_out = torch.empty(lse.shape[0], lse.shape[2], lse.shape[1]).transpose(1, 2)
    lse_out.copy_(lse)
    return laid_out, lse_out


def _wrong_tanh(x):
    e = torch.exp(2 * x.float())
    return ((e - 1) / (e + 1) * 1.3).to(x.dtype)


def _record_gpt2(path, *, other_version: bool, plant=None, kernel=None):
    record_adamw_steps(path, tiny_gpt2(), _loss, steps=1, autocast=True, plant=plant, kernel=kernel)
    if other_version:
        manifest = path / "manifest.json"
        data = json.loads(manifest.read_text())
        data["framework_version"] = "2.5.1+emulated"
        manifest.write_text(json.dumps(data))
    return path


def test_fused_logsumexp_judged_at_the_precision_it_was_computed_in(tmp_path):
    wrong = _record_gpt2(tmp_path / "wrong", other_version=False, plant="tanh", kernel=_wrong_tanh)
    other = _record_gpt2(tmp_path / "other", other_version=True,
                         plant="_scaled_dot_product_flash_attention_for_cpu", kernel=_fused_scores_in_bfloat16)
    for v in _verdicts(wrong, other):
        assert v.forward is not None and v.forward.op == "aten.tanh.default", str(v)
        # the LM head's backward mm hands on, as a difference of rounding size, a logits' gradient the
        # tanh moved below the floor: the backward's errors follow from the forward values, not from it
        assert v.backward is not None and v.backward.cause == "inherited", str(v)
