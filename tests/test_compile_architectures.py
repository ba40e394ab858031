"""probe_backend on real architectures: tiny ``transformers`` models (one layer, random init, no
dropout, float32) of each kind the compile tests build (a Llama, a mixture of experts, multi-head
latent attention with experts, Gemma3 with a sliding and a full attention layer, Mamba2's
state-space scan) train 2 AdamW steps under ``probe_backend`` to the very parameters plain inductor
gives; ``compare`` of the eager run against the compiled one exits 0 either way round (the compiled
records pair with eager's where inductor folds, reorders or reuses values, or where the graph makes
a module's calls in another order: Gemma3's rotary embedding, called per attention kind over a
``set``, whose order in eager Python depends on the process's hash seed), and a x1.001 planted on
one block's output in the compiled run is named at that block, in that run, either way round."""

from __future__ import annotations

import copy
import json
import os
import sys

import pytest
import torch
from click.testing import CliRunner

from dispatchprobe import compare
from dispatchprobe.cli import main
from dispatchprobe.torch.compile import probe_backend

pytest.importorskip("transformers")
sys.path.insert(0, os.path.dirname(__file__))
from compare_helpers import record_tiny, tiny_model  # noqa: E402

pytestmark = pytest.mark.probe_backend    # below the torch it needs, each test meets the one-line refusal


def _tokens(step: int) -> dict:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


def compiled_model(name: str, seed: int = 0):
    """(model, the name of one block of it, inputs(step)) of a tiny model of kind ``name``."""
    import transformers as T
    if name in ("llama", "mixtral", "deepseek_v3"):
        return tiny_model(name, seed)
    torch.manual_seed(seed)
    if name == "gemma3":      # a sliding-window and a full attention layer (the smallest has both kinds)
        m = T.Gemma3ForCausalLM(T.Gemma3TextConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=4,
            max_position_embeddings=16, attention_dropout=0.0))
        block = m.model.layers[0].mlp
    elif name == "mamba2":    # the state-space scan, in transformers' PyTorch path on a CPU
        m = T.Mamba2ForCausalLM(T.Mamba2Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, state_size=8,
                                               expand=2, head_dim=16, num_heads=4, n_groups=1, chunk_size=8,
                                               conv_kernel=4))
        block = m.backbone.layers[0].mixer
    else:
        raise KeyError(name)
    return m, next(n for n, mod in m.named_modules() if mod is block), _tokens


def train_compiled(model, inputs, backend, steps: int = 2):
    """Train a copy of ``model`` ``steps`` AdamW steps under ``torch.compile(backend=backend)``:
    (losses, final parameters)."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend=backend)
    losses = []
    for step in range(steps):
        loss = compiled(**inputs(step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if not isinstance(backend, str):
            backend.step()
        losses.append(loss.detach())
    return losses, dict(model.named_parameters())


ARCHS = ("llama", "mixtral", "deepseek_v3", "gemma3", "mamba2")
# the two whose compiles take longest (two layers, or many small experts' kernels): about 3 minutes each
# on a loaded 2-core machine, against about 1.5 for the others
_SLOWEST = ("deepseek_v3", "gemma3")


_PARAMS = [pytest.param(a, marks=pytest.mark.slow) if a in _SLOWEST else a for a in ARCHS]


@pytest.mark.parametrize("arch", _PARAMS)
def test_probe_backend_trains_bitwise_as_plain_inductor(tmp_path, arch):
    model, _, inputs = compiled_model(arch)
    torch._dynamo.reset()
    plain_losses, plain = train_compiled(model, inputs, "inductor")
    torch._dynamo.reset()
    backend = probe_backend(task="statistics", dump_path=str(tmp_path / "compiled"))
    losses, probed = train_compiled(model, inputs, backend)
    backend.close()
    torch._dynamo.reset()
    differ = [n for n, p in plain.items() if not torch.equal(p, probed[n])]
    assert not differ, f"{len(differ)} of {len(plain)} parameters differ from plain inductor's: {differ}"
    assert all(torch.equal(a, b) for a, b in zip(plain_losses, losses)), (plain_losses, losses)
    # the probe did record the compiled graphs of both steps
    for step in (0, 1):
        records = [json.loads(line) for line in open(tmp_path / "compiled" / f"step{step}" / "rank0" / "ops.jsonl")]
        assert sum("compiled" in r for r in records) > 50, step


# ---- eager against compiled --------------------------------------------------------------------------
def _record_compiled(model, block: str, inputs, path, plant: bool):
    """2 AdamW steps of a copy of ``model`` under ``probe_backend`` (task tensor) recorded to ``path``;
    ``plant``: block ``block``'s output scaled by 1.001 in a forward hook (compiled into the graph)."""
    model = copy.deepcopy(model)
    if plant:
        model.get_submodule(block).register_forward_hook(lambda m, args, out: out * 1.001)
    torch._dynamo.reset()
    backend = probe_backend(task="tensor", dump_path=str(path))
    train_compiled(model, inputs, backend)
    backend.close()
    torch._dynamo.reset()
    return path


@pytest.fixture(scope="module", params=_PARAMS)
def eager_compiled(request, tmp_path_factory):
    """``run(name)``: the eager, compiled or planted run of one architecture, recorded on first use,
    inside the test (below the torch probe_backend needs, its refusal is the test's outcome); and
    the planted block's scope."""
    root = tmp_path_factory.mktemp(request.param)
    model, block, inputs = compiled_model(request.param)
    made: dict = {}

    def run(name: str):
        if name not in made:
            made[name] = record_tiny(model, block, inputs, root / name, task="tensor") if name == "eager" else \
                _record_compiled(model, block, inputs, root / name, plant=name == "planted")
        return made[name]
    return run, f"{type(model).__name__}.{block}"


def test_eager_and_compiled_runs_agree(eager_compiled):
    run, _ = eager_compiled
    for a, b in (("eager", "compiled"), ("compiled", "eager")):
        res = CliRunner().invoke(main, ["compare", str(run(a)), str(run(b))])
        assert res.exit_code == 0, (a, b, res.output)
        assert "no forward divergence" in res.output and "no backward divergence" in res.output, res.output


def test_change_planted_in_the_compiled_run_is_named_at_its_block(eager_compiled):
    run, scope = eager_compiled
    for a, b in (("eager", "planted"), ("planted", "eager")):
        verdict = compare(run(a), run(b)).verdict
        side = "a" if a == "planted" else "b"
        d = verdict.forward
        assert d is not None and (d.step, d.cause, d.op, d.scope, d.side) == (0, "unmatched", "aten.mul.Tensor", scope,
                                                                              side), str(verdict)
        # backward differs through the forward, or at the plant's own backward (the gradient x1.001): nothing
        # else, and nothing of the other run, is named
        bwd = verdict.backward
        assert bwd is None or bwd.cause == "inherited" or (bwd.cause, bwd.op, bwd.scope, bwd.side) == (
            "unmatched", "aten.mul.Tensor", scope, side), str(verdict)
