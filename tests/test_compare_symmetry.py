"""compare's verdict does not depend on which run is A: on every kind of tiny ``transformers`` model the
compare tests build (a Llama, GPT-2, BERT, Phi, Phi-3 with its partial rotary, two mixtures of
experts, a multi-head-latent-attention model, a ViT, encoder-decoder speech and text models, a
ConvNeXt), with a x1.001 planted by a forward hook on one block's output (an op in the planted run
only), 2 AdamW steps, statistics and tensor records: ``compare A B`` and ``compare B A`` name the
same origin, with mirrored labels, and nothing at a later step outranks the step where the
difference starts."""

from __future__ import annotations

import os
import sys

import pytest

from dispatchprobe import compare
from dispatchprobe.offline.align import align
from dispatchprobe.records.reader import load

pytest.importorskip("transformers")
sys.path.insert(0, os.path.dirname(__file__))
from compare_helpers import ARCHS, record_tiny, tiny_model  # noqa: E402

TASKS = ("statistics", "tensor")


@pytest.fixture(scope="module", params=ARCHS)
def arch_runs(request, tmp_path_factory):
    """Per task, the planted and the clean run of architecture ``request.param``, and the planted scope."""
    root = tmp_path_factory.mktemp(request.param)
    model, block, inputs = tiny_model(request.param)
    runs = {(task, plant): record_tiny(model, block, inputs, root / f"{task}-{plant or 'clean'}", plant=plant,
                                       task=task)
            for task in TASKS for plant in ("hook", None)}
    return runs, f"{type(model).__name__}.{block}"


def _named(verdict, stage: str):
    """What the verdict names for ``stage``: its divergence, else its first departure within tolerance."""
    return getattr(verdict, stage) or next((d for d in verdict.departures if d.stage == stage), None)


def _run_of(d, planted_is: str):
    """The run (planted or clean) holding an op present in one run only."""
    return ("planted" if d.side == planted_is else "clean") if d.cause == "unmatched" else None


@pytest.mark.parametrize("task", TASKS)
def test_swapped_runs_name_the_same_origin(arch_runs, task):
    runs, scope = arch_runs
    planted, clean = runs[task, "hook"], runs[task, None]
    verdicts = {"a": compare(planted, clean).verdict, "b": compare(clean, planted).verdict}   # where the plant is
    assert verdicts["a"].passed == verdicts["b"].passed
    for stage in ("forward", "backward"):
        named = {side: _named(v, stage) for side, v in verdicts.items()}
        assert all(d is not None for d in named.values()), {s: str(v) for s, v in verdicts.items()}
        seen = {side: (d.step, d.cause, d.op, d.scope, _run_of(d, side)) for side, d in named.items()}
        assert seen["a"] == seen["b"], (stage, seen, str(verdicts["a"]), str(verdicts["b"]))
        # the difference starts at step 0: no later step's difference outranks it
        assert seen["a"][0] == 0, (stage, str(verdicts["a"]), str(verdicts["b"]))
    # the pairing under it: the same pairs, mirrored, and the same records left over
    for key, part in load(planted).parts.items():
        recs_p, recs_c = part.records, load(clean).parts[key].records
        one, other = align(recs_p, recs_c), align(recs_c, recs_p)
        assert {(i, j) for i, j, _ in one.pairs} == {(i, j) for j, i, _ in other.pairs}, key
        assert (one.only_a, one.only_b) == (other.only_b, other.only_a) and len(one.only_a) == 2, key
    # the origin: the planted op at its block, in the run that holds it, said in mirrored words
    for side, v in verdicts.items():
        d = _named(v, "forward")
        assert (d.cause, d.op, d.scope, d.side) == ("unmatched", "aten.mul.Tensor", scope, side), str(v)
        line = next(ln for ln in str(v).splitlines() if ln.startswith(("first forward", "no forward divergence;")))
        assert f"aten.mul.Tensor [{scope}]" in line and f"present only in run {side.upper()}" in line, str(v)
        assert f"no counterpart in run {'B' if side == 'a' else 'A'}" in line, str(v)


def test_a_planted_change_inside_a_block_is_named_alike_both_ways_with_float64_reruns(tmp_path):
    """One RMSNorm's eps changed (no op added: the values of one ``add`` differ) in a tiny Mistral, tensor
    records: each op's own share is measured by float64 re-runs, whose tolerance is scaled by both runs'
    values (not run B's alone, which made the backward's verdict depend on the order)."""
    import copy

    import torch
    from transformers import MistralConfig, MistralForCausalLM

    from dispatchprobe import DispatchProbe
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                             intermediate_size=64, vocab_size=100, num_key_value_heads=2,
                                             max_position_embeddings=64))
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    runs = {}
    for name in ("planted", "clean"):
        m = copy.deepcopy(model)
        if name == "planted":
            m.model.layers[1].post_attention_layernorm.variance_epsilon = 1e-2
        probe = DispatchProbe(task="tensor", dump_path=str(tmp_path / name))
        with probe:
            m(input_ids=ids, labels=ids).loss.backward()
        probe.close()
        runs[name] = tmp_path / name
    one, other = compare(runs["planted"], runs["clean"]).verdict, compare(runs["clean"], runs["planted"]).verdict
    for stage in ("forward", "backward"):
        a, b = _named(one, stage), _named(other, stage)
        assert (a.cause, a.op, a.scope, a.seq) == (b.cause, b.op, b.scope, b.seq), (stage, str(one), str(other))
    f = one.forward
    assert (f.cause, f.op, f.scope) == ("op", "aten.add.Tensor", "MistralForCausalLM.model.layers.1.post_attention_layernorm"), str(one)
    assert one.backward.cause == "inherited", str(one)
