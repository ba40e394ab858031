"""Eager against ``probe_backend`` in bfloat16: inductor's fused kernels read a value cast to bfloat16
unrounded (``emulate_precision_casts`` off, its default), while the cast's record holds it rounded.
A tiny ``transformers`` Llama in ``model.to(torch.bfloat16)``: the rotary ``mul`` reading
``cos.to(bfloat16)`` computes from float32 values in the compiled run, so its output differs by
rounding from eager's though both runs record equal inputs.  compare names no op for that, either
run as A: the stage's error rows grew from the rounding of precisions the runs differ in.  Eager's
key/value cache ``cat``, which the graph folds away, hands the backward what it was given and is no
suspect.  A kernel planted wrong in either run is still named."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from dispatchprobe import DispatchProbe, compare
from dispatchprobe.records.reader import load
from dispatchprobe.torch.compile import probe_backend

from compare_helpers import planted_kernel

pytest.importorskip("transformers")
pytestmark = pytest.mark.probe_backend    # below the torch it needs, the one-line refusal

NAMED = ("op", "unmatched", "region")


def _llama():
    import transformers as T
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    return T.LlamaForCausalLM(cfg).train().to(torch.bfloat16)


def _ids():
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def _mm_off(a, b, *, out):
    """The matrix product inductor calls (``extern_kernels.mm``), 1% too large."""
    out.copy_(torch.mm(a.float(), b.float()).mul(1.01).to(out.dtype))
    return out


def _record(model, path, compiled: bool, plant: str, kernel):
    """Two training steps of a copy of the bfloat16 ``model`` on one batch, eager or under
    ``probe_backend`` (statistics), no optimizer: step 0 clean, step 1 with aten ``plant`` computed by
    ``kernel`` (one compile serves both)."""
    model = copy.deepcopy(model)
    backend = probe_backend(task="statistics", dump_path=str(path)) if compiled else None
    probe = backend if compiled else DispatchProbe(task="statistics", dump_path=str(path))
    step = torch.compile(model, backend=backend) if compiled else model
    torch._dynamo.reset()
    batch = _ids()
    for wrong in (None, plant):
        with planted_kernel(wrong, kernel), contextlib.nullcontext() if compiled else probe:
            step(**batch).loss.backward()
        model.zero_grad(set_to_none=True)
        probe.step()
    probe.close()
    torch._dynamo.reset()
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(eager run, compiled run): step 0 of each clean, step 1 with a wrong kernel (eager's rsqrt,
    the compiled graph's library matrix product)."""
    model, root = _llama(), tmp_path_factory.mktemp("fused_casts")
    return (_record(model, root / "eager", False, "rsqrt", lambda x: torch.sqrt(x).reciprocal() * 1.01),
            _record(model, root / "compiled", True, "mm.out", _mm_off))


def _part(run, step: int):
    return run / f"step{step}" / "rank0"


def _named(verdict) -> list:
    return [(d.stage, d.cause, d.op, d.scope) for d in (verdict.forward, verdict.backward)
            if d is not None and d.cause in NAMED]


def test_a_cast_fused_into_its_reader_is_rounding_not_an_op(runs):
    eager, compiled = (_part(run, 0) for run in runs)
    for a, b in ((eager, compiled), (compiled, eager)):
        verdict = compare(a, b).verdict
        assert not _named(verdict), str(verdict)
        # both stages' error rows grew from the rounding where the precisions part: the rotary mul of the
        # attention, in float32 in the compiled run (eager's key cache cat, read by the backward, is no source)
        for d in (verdict.forward, verdict.backward):
            assert d is not None and d.errors and d.cause == "rounding", str(verdict)
            assert d.follows.startswith("aten.mul.Tensor [LlamaForCausalLM.model.layers.0.self_attn]"), d.follows
            assert ("and run B in float32" if a == eager else "run A computes in float32") in d.follows, d.follows
    # the record of the cast the rotary mul reads says its fused readers read it in float32
    casts = [r for r in load(runs[1]).part(0, 0).records
             if r["op"] == "aten._to_copy.default" and r["scope"].endswith("rotary_emb")
             and r["outputs"][0]["dtype"] == "bfloat16"]
    assert casts and all(r["compiled"].get("fused_precision") == "float32" for r in casts), casts


@pytest.mark.parametrize("wrong", ["eager", "compiled"])
def test_a_wrong_kernel_beside_the_fused_casts_is_named(runs, wrong):
    eager, compiled = runs
    planted, other = (_part(eager, 1), _part(compiled, 0)) if wrong == "eager" else \
        (_part(compiled, 1), _part(eager, 0))
    op, scope = {"eager": ("aten.rsqrt.default", "LlamaForCausalLM.model.layers.0.input_layernorm"),
                 "compiled": ("aten.mm.default", "LlamaForCausalLM.model.layers.0.self_attn.q_proj")}[wrong]
    for a, b in ((planted, other), (other, planted)):
        d = compare(a, b).verdict.forward
        assert d is not None and (d.cause, d.op, d.scope) == ("op", op, scope), str(d)
