"""Values read through views no record shows: compare follows them to the op that made their base.

A probe records no view op, so Falcon's attention reads its key through ``expand`` (the heads it
shares: a stride of 0, the norm times the root of the repeats), its query through a slice of the
fused ``query_key_value`` output, and GPT-NeoX its rotary pass-through part through a slice that
autocast then upcasts (a cast in one run only).  Found by statistics alone these values had no
producer: fp32 against bf16 autocast said "the runs differ already at their inputs/parameters"
(Falcon) or named the exact upcast as the prime suspect (GPT-NeoX), though parameters and batch are
the same and the difference is autocast's rounding inside the model.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from dispatchprobe import DispatchProbe
from dispatchprobe.core import op_traits
from dispatchprobe.offline.compare import compare
from dispatchprobe.offline.compare.pairing import data_flow

transformers = pytest.importorskip("transformers")


def _tiny(family: str):
    """A tiny random-init causal LM of ``family`` (sdpa attention, no dropout), seed 0."""
    torch.manual_seed(0)
    small = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_hidden_layers=1)
    if family == "falcon":      # multi-query attention: one key head expanded to four; fused qkv sliced
        cfg = transformers.FalconConfig(**small, new_decoder_architecture=False, multi_query=True,
                                        attention_dropout=0.0, hidden_dropout=0.0)
        cfg._attn_implementation = "sdpa"
        return transformers.FalconForCausalLM(cfg)
    cfg = transformers.GPTNeoXConfig(**small, intermediate_size=64, rotary_pct=0.5, attention_dropout=0.0,
                                     hidden_dropout=0.0, max_position_embeddings=16)
    cfg._attn_implementation = "sdpa"
    return transformers.GPTNeoXForCausalLM(cfg)


def _record(family: str, path, autocast: bool, plant: str = ""):
    """One training step (forward and backward) of ``family`` recorded as statistics, the forward
    under bf16 autocast or not; the same weights and batch either way.  ``plant``: a module whose
    output a forward hook scales by 1.001 (an op of this run only)."""
    model = _tiny(family).train()
    if plant:
        model.get_submodule(plant).register_forward_hook(lambda mod, args, out: out * 1.001)
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    probe = DispatchProbe(task="statistics", dump_path=str(path))
    with probe:
        amp = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with amp:
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
    probe.step()
    probe.close()
    return path


_RUNS: dict = {}


def _pair(family: str, tmp_path_factory):
    """(fp32 run, autocast run) of ``family``, recorded once per module."""
    if family not in _RUNS:
        root = tmp_path_factory.mktemp(family)
        _RUNS[family] = _record(family, root / "fp32", False), _record(family, root / "autocast", True)
    return _RUNS[family]


@pytest.mark.parametrize("family", ["falcon", "gpt_neox"])
def test_autocast_rounding_is_no_input_difference_nor_a_cast(family, tmp_path_factory):
    """fp32 against bf16 autocast, both orders: the forward's differences enter inside the model (no
    "inputs differ"), at no cast, and the verdict names the same op either way round."""
    pair = _pair(family, tmp_path_factory)
    named = []
    for x, y in (pair, pair[::-1]):
        _, v = compare(x, y)
        div = v.forward or next((d for d in v.departures if d.stage == "forward"), None)
        assert div is not None, str(v)
        assert div.cause not in ("inputs", "unmatched"), str(v)
        assert not op_traits.is_cast(div.op), str(v)
        named.append((div.op, div.scope, div.call, div.cause))
    assert named[0] == named[1], named


def test_an_expanded_key_is_read_from_the_op_that_made_it(tmp_path_factory):
    """The data flow finds the producer of the fp32 Falcon run's expanded key (stride 0, its norm the
    base's times the root of the repeats): an output with the same maximum and minimum."""
    fp32 = _pair("falcon", tmp_path_factory)[0]
    recs = [json.loads(line) for line in (fp32 / "step0" / "rank0" / "ops.jsonl").read_text().splitlines()]
    flow = data_flow(recs)
    repeated = [(i, spec) for i, walk in enumerate(flow.walks) for io, _, spec in walk
                if io == "input" and 0 in (spec.get("stride") or ()) and recs[i]["stage"] == "forward"]
    assert repeated, "Falcon's attention reads its shared key through expand"
    for i, spec in repeated:
        src = flow.src.get(id(spec))
        assert src is not None and id(spec) in flow.viewed, recs[i]["op"]
        base = recs[src[0]]["outputs"][int(src[1].split(".")[1])]
        assert base["stats"]["max"] == spec["stats"]["max"] and base["stats"]["min"] == spec["stats"]["min"]


def test_a_difference_planted_before_the_views_is_still_named(tmp_path_factory):
    """A hook scaling Falcon's fused query_key_value output, which the attention reads only through
    slices and an expand: the hook's op is named, whichever run is A (view links do not move it)."""
    fp32 = _pair("falcon", tmp_path_factory)[0]
    planted = _record("falcon", tmp_path_factory.mktemp("planted") / "run",
                      False, plant="transformer.h.0.self_attention.query_key_value")
    for x, y, side in ((fp32, planted, "b"), (planted, fp32, "a")):
        _, v = compare(x, y)
        assert v.forward is not None and v.forward.cause == "unmatched", str(v)
        assert (v.forward.op, v.forward.side) == ("aten.mul.Tensor", side), str(v)
        assert v.forward.scope.endswith("self_attention.query_key_value"), str(v)


def test_a_mean_backward_reads_the_loss_gradient_expanded_from_0_dim(tmp_path):
    """``loss / 2`` (gradient accumulation's division): the mean's backward reads the division's
    0-dim gradient expanded to the batch's shape (stride 0, no record).  A 0-dim value is one element
    in memory, so the data flow finds it as the expand's base: the mean's backward is computed from
    the loss's gradient (where it was not, compare across parallelism compared it unscaled: 2 ranks
    each averaging half the batch against one process, a "difference" of a factor 2)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    probe = DispatchProbe(task="statistics", dump_path=str(tmp_path / "run"))
    with probe:
        (model(torch.randn(4, 8)).pow(2).mean() / 2).backward()
    probe.step()
    probe.close()
    recs = [json.loads(line) for line in (tmp_path / "run" / "step0" / "rank0" / "ops.jsonl").read_text().splitlines()]
    backward = [i for i, r in enumerate(recs) if r.get("stage") == "backward" and r.get("kind") == "op"]
    divided, mean_backward = backward[0], backward[1]
    assert recs[divided]["op"] == "aten.div.Tensor" and recs[mean_backward]["op"] == "aten.div.Scalar", \
        [recs[i]["op"] for i in backward]
    flow = data_flow(recs)
    expanded = flow.walks[mean_backward][0][2]
    assert expanded["shape"] == [4, 4] and set(expanded["stride"]) == {0}
    assert flow.src.get(id(expanded)) == (divided, "output.0") and id(expanded) in flow.viewed
