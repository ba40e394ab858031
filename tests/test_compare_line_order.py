"""The verdict's first line names what is wrong: a wrong kernel from the second step on, after a
departure within tolerance in the first step, is named before that departure.

A tiny ``transformers`` GPT-2 (fp32, two AdamW steps) where one run's first step computes the fused
CPU attention by another formula (float64 inside: its outputs differ from the fused kernel's by
rounding, a departure within tolerance) and its second step has ``tanh_backward`` 1% too large
(GPT-2's gelu): the lines said ``no forward divergence; first forward departure (within
tolerance): ..._scaled_dot_product_flash_attention_for_cpu ... step 0`` first and the wrong
``tanh_backward`` of step 1 after it; the page opened on the departure."""

from __future__ import annotations

import math

import pytest
import torch

from compare_helpers import planted_kernel, tiny_gpt2
from dispatchprobe import DispatchProbe, compare

pytest.importorskip("transformers")


def _attention_in_float64(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """The fused CPU attention's (output, logsumexp), computed in float64 and rounded to the inputs'
    dtype: the fused kernel's values up to rounding."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q.double() @ k.double().transpose(-2, -1)) * scale
    if is_causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    out = (torch.softmax(scores, -1) @ v.double()).to(q.dtype)
    # the fused kernel's output layout: (batch, heads, tokens, dim) viewed over (batch, tokens, heads, dim)
    return out.transpose(1, 2).contiguous().transpose(1, 2), torch.logsumexp(scores, -1).to(q.dtype)


def _wrong_tanh_backward(grad, y):
    return grad * (1 - y * y) * 1.01


def _record(path, planted: bool):
    """Two AdamW steps; ``planted``: step 0's attention by :func:`_attention_in_float64`, step 1's
    ``tanh_backward`` 1% too large."""
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    probe = DispatchProbe(task="statistics", dump_path=str(path))
    kernels = [("_scaled_dot_product_flash_attention_for_cpu", _attention_in_float64),
               ("tanh_backward", _wrong_tanh_backward)]
    for step, kernel in enumerate(kernels):
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(step))
        with planted_kernel(*(kernel if planted else (None,))), probe:
            model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        probe.step()
    probe.close()
    return path


def test_a_later_steps_wrong_kernel_leads_an_earlier_departure(tmp_path):
    from html_check import page_data

    planted, clean = _record(tmp_path / "planted", True), _record(tmp_path / "clean", False)
    for a, b in ((planted, clean), (clean, planted)):
        out = tmp_path / f"{a.name}-{b.name}"
        verdict = compare(a, b, out=str(out)).verdict
        lines = str(verdict).splitlines()
        assert verdict.backward is not None and (verdict.backward.op, verdict.backward.step) == \
            ("aten.tanh_backward.default", 1), str(verdict)
        assert lines[1].startswith("first backward divergence: aten.tanh_backward.default "), lines
        assert lines[2].startswith("no forward divergence; first forward departure (within tolerance): "
                                   "aten._scaled_dot_product_flash_attention_for_cpu.default ") and \
            "step 0 rank 0" in lines[2], lines
        data = page_data((out / "compare.html").read_text())
        assert data["first"] == "backward" and list(data["divs"]) == ["backward", "forward"], data["divs"]
        assert data["shown_part"] == "1/0", data["shown_part"]
