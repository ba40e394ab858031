"""Constants the runs' programs make differently are no precision divergence.

An op that reads no tensor's values (``full``, ``zeros``, ``scalar_tensor``, ``arange``) makes its
output from the program's numbers: where two runs' outputs of it differ, the programs do (T5 and
Llama build their attention mask from ``torch.finfo(dtype).min``: -3.40e38 in float32, -3.39e38 in
bfloat16), not a kernel's rounding.  compare named such ops as where the runs part: fp32 against
bf16 autocast T5 said "first forward divergence: aten.scalar_tensor", and eager against sdpa attention
named the eager path's mask ``arange`` (present in one run only) as the first departure.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dispatchprobe import DispatchProbe
from dispatchprobe.offline.compare import compare

L, DIM = 8, 16


class MaskedAttention(torch.nn.Module):
    """One causal attention head.  ``mask_dtype``: the dtype whose lowest value fills the mask, as
    transformers' ``torch.finfo(dtype).min`` (the scores stay float32 either way); ``sdpa``: the
    causal mask left to ``scaled_dot_product_attention`` (no mask tensor); ``hook``: a factor on the
    values (an op of this run only: a real difference beside the constant)."""

    def __init__(self, mask_dtype=torch.float32, sdpa=False, hook=1.0):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.out = torch.nn.Linear(DIM, DIM)
        self.mask_dtype, self.sdpa, self.hook = mask_dtype, sdpa, hook

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if self.hook != 1.0:
            v = v * self.hook
        if self.sdpa:
            return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        mask = torch.full((L, L), torch.finfo(self.mask_dtype).min).triu(1)
        scores = q @ k.transpose(-1, -2) / DIM ** 0.5 + mask
        return self.out(scores.softmax(-1) @ v)


def _record(path, task: str = "statistics", **kw):
    """One forward and backward of :class:`MaskedAttention` (the same weights and batch every run)."""
    model = MaskedAttention(**kw)
    x = torch.randn(2, L, DIM, generator=torch.Generator().manual_seed(1))
    probe = DispatchProbe(task=task, dump_path=str(path))
    with probe:
        model(x).square().mean().backward()
    probe.step()
    probe.close()
    return path


def _both_orders(x, y):
    return [compare(x, y)[1], compare(y, x)[1]]


@pytest.mark.parametrize("task", ["statistics", "tensor"])
def test_a_mask_value_of_another_dtype_is_a_constant_not_a_divergence(task, tmp_path):
    """finfo(float32).min against finfo(bfloat16).min: the mask's ``full`` is named as a constant the
    programs make differently, never as a divergence; the masked softmax gives the same values, so
    nothing after it differs and the backward agrees.  The same line whichever run is A."""
    fp32 = _record(tmp_path / "fp32", task)
    bf16 = _record(tmp_path / "bf16", task, mask_dtype=torch.bfloat16)
    lines = []
    for v in _both_orders(fp32, bf16):
        div = v.forward
        assert div is not None and div.cause == "constant", str(v)
        assert div.op == "aten.full.default" and not div.departure, str(v)
        assert str(v).splitlines()[1].startswith("forward: no forward op diverges by itself"), str(v)
        assert "-3.40282e+38" in div.failed and "-3.38953e+38" in div.failed, div.failed
        assert v.backward is None, str(v)
        lines.append((div.op, div.call, div.seq, div.errors))
    assert lines[0] == lines[1], lines


def test_a_softmax_over_either_mask_value_agrees(tmp_path):
    """The masked softmax's outputs agree bit for bit: the mask value's difference stops there."""
    fp32 = _record(tmp_path / "fp32", "tensor")
    bf16 = _record(tmp_path / "bf16", "tensor", mask_dtype=torch.bfloat16)
    table, _ = compare(fp32, bf16)
    softmax = table[table["op_a"].str.contains("softmax") & (table["stage"] == "forward") & (table["io"] == "output")]
    assert len(softmax) and (softmax["status"] == "pass").all() and (softmax["max_abs_err"] == 0).all(), softmax
    after = table[(table["stage"] == "forward") & (table["seq"] > softmax["seq"].max())]
    assert (after["status"] == "pass").all(), after[after["status"] != "pass"]


def _llama(path, attention: str):
    """One training step of a tiny random-init transformers Llama with ``attention`` ("eager": the
    mask built from ``arange`` and ``finfo.min`` in this run only; "sdpa": a fused kernel), statistics."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    cfg._attn_implementation = attention
    model = transformers.LlamaForCausalLM(cfg).train()
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    probe = DispatchProbe(task="statistics", dump_path=str(path))
    with probe:
        model(input_ids=x, labels=x).loss.backward()
    probe.step()
    probe.close()
    return path


def test_a_mask_made_in_one_run_only_is_no_suspect(tmp_path):
    """Llama's eager attention against sdpa: the eager run's mask ops (``arange``, ``full``...) are
    of that run only, and no constant-making op is named: the first departure is an op that computes
    from the runs' values, the same whichever run is A."""
    sdpa, eager = _llama(tmp_path / "sdpa", "sdpa"), _llama(tmp_path / "eager", "eager")
    named = []
    for v, eager_side in zip(_both_orders(sdpa, eager), "ba"):
        div = v.forward or next((d for d in v.departures if d.stage == "forward"), None)
        assert div is not None, str(v)
        assert div.cause != "constant", str(v)
        assert div.op.split(".")[1] not in ("arange", "full", "zeros", "ones", "scalar_tensor"), str(v)
        named.append((div.op, div.scope, div.call, div.cause, div.side == eager_side))
    assert named[0] == named[1], named


def test_a_real_difference_beside_the_constant_is_named(tmp_path):
    """Another mask dtype and a factor of 1.001 on the values in run B: the factor's op is named, the
    constant ranks after it, both orders."""
    fp32 = _record(tmp_path / "fp32")
    both = _record(tmp_path / "both", mask_dtype=torch.bfloat16, hook=1.001)
    for v, side in zip(_both_orders(fp32, both), "ba"):
        div = v.forward or next((d for d in v.departures if d.stage == "forward"), None)
        assert div is not None and div.cause != "constant", str(v)
        assert div.op == "aten.mul.Tensor", str(v)


class PaddedAttention(torch.nn.Module):
    """One attention head over a padded batch, its additive mask made as transformers' older models
    make it: ``inverted.masked_fill(inverted.bool(), torch.finfo(dtype).min)`` of the run's own dtype
    (autocast's where it is on), so the fill differs between an fp32 and a bf16-autocast run while
    the tensors it fills agree.  ``fill``: another number in its place (a program's own constant)."""

    def __init__(self, fill=None):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.out = torch.nn.Linear(DIM, DIM)
        self.fill = fill

    def forward(self, x, keep):
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else x.dtype
        inverted = 1.0 - keep[:, None, :].float()
        mask = inverted.masked_fill(inverted.bool(), torch.finfo(dtype).min if self.fill is None else self.fill)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / DIM ** 0.5 + mask
        return self.out(scores.softmax(-1) @ v)


def _record_padded(path, task: str = "statistics", autocast: bool = False, fill=None):
    """One forward (under bf16 autocast or not) and backward of :class:`PaddedAttention`, the last three
    positions of each sequence padding."""
    model = PaddedAttention(fill)
    x = torch.randn(2, L, DIM, generator=torch.Generator().manual_seed(1))
    keep = torch.ones(2, L, dtype=torch.long)
    keep[:, -3:] = 0
    probe = DispatchProbe(task=task, dump_path=str(path))
    with probe:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x, keep)
        out.float().square().mean().backward()
    probe.step()
    probe.close()
    return path


def test_the_dtype_extremes_are_torchs():
    """The extremes compare knows without importing torch are torch.finfo's, each dtype's."""
    from dispatchprobe.offline.compare.origin import DTYPE_EXTREMES
    dtypes = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
    finfo = {float(getattr(torch.finfo(d), end)) for d in dtypes for end in ("min", "max")}
    assert set(DTYPE_EXTREMES) == finfo | {float("inf"), float("-inf")}


@pytest.mark.parametrize("task", ["statistics", "tensor"])
def test_a_dtype_extreme_given_to_an_op_is_a_constant(task, tmp_path):
    """fp32 against bf16 autocast: masked_fill is given finfo(float32).min in one run and
    finfo(bfloat16).min in the other, its tensor inputs agree, its output differs at the padding.
    That is the programs' constant, not a kernel: the forward names no divergence, whichever run is A."""
    fp32 = _record_padded(tmp_path / "fp32", task)
    bf16 = _record_padded(tmp_path / "bf16", task, autocast=True)
    lines = []
    for v in _both_orders(fp32, bf16):
        div = v.forward
        assert div is not None and div.cause == "constant", str(v)
        assert div.op == "aten.masked_fill.Scalar", str(v)
        assert str(v).splitlines()[1].startswith("forward: no forward op diverges by itself"), str(v)
        assert "-3.40282e+38" in div.failed and "-3.38953e+38" in div.failed, div.failed
        named = [d for d in (v.forward, v.backward, *v.departures) if d is not None]
        assert not any(d.op == "aten.masked_fill.Scalar" and d.cause == "op" for d in named), str(v)
        lines.append((div.op, div.call, div.seq, div.errors))
    assert lines[0] == lines[1], lines


@pytest.mark.parametrize("fills", [(1e-3, 2e-3), (torch.finfo(torch.float32).min, -1e4)])
def test_another_number_given_to_an_op_is_a_divergence(fills, tmp_path):
    """A fill of 1e-3 against 2e-3, or finfo.min against -1e4, is not each run's dtype extreme: the
    numbers are the programs' choice, and masked_fill is still named as where the runs part, both orders."""
    one = _record_padded(tmp_path / "one", fill=fills[0])
    other = _record_padded(tmp_path / "other", fill=fills[1])
    for v in _both_orders(one, other):
        div = v.forward
        assert div is not None and div.cause == "op" and not div.departure, str(v)
        assert div.op == "aten.masked_fill.Scalar", str(v)
