"""On statistics alone, a backward op reading values a wrong forward kernel moved is not where the
difference enters.  Eager runs with a wrong forward kernel against a clean ``probe_backend`` run (its
graph's aten ops run by aot_eager, so their kernels round apart from eager's), one step, task
statistics; compare named a backward op in each, both orders:

- ViT, gelu 30% too large: ``native_layer_norm_backward`` of the last layer norm (its output 9% off,
  past the error line, but the forward values it reads moved by the gelu: a statistics difference is a
  lower bound of the values', so its own share cannot be told apart);
- Mixtral, silu 30% too large: eager's recomputed router ``div`` in backward (present in the eager run
  only) as the prime suspect, reading router weights the forward moved;
- Qwen2-MoE, silu 0.1% off: eager's ``_grouped_mm`` of the experts' backward (present in the eager run
  only: the graph runs transformers' own grouped-mm backward op there) as the prime suspect, reading
  gradients and activations the forward moved.  An op one run alone records has nothing in the other
  run to be measured against: given a difference made before it, it passes that difference's source on;
- Llama, silu 0.1% off: the LM head's backward ``mm`` "below the error line", its input (the logits'
  gradient) off by 5e-7, under the statistics floor, which the product handed on four times larger:
  judged as if its inputs agreed.  Inputs that differ below the floor now bound what it hands on.

Each backward line now says its errors follow from the forward values; a silu backward planted 30% off
in the eager run is still named."""

from __future__ import annotations

import pytest
import torch

from compare_helpers import planted_kernel, wrong_silu_backward
from dispatchprobe import DispatchProbe
from dispatchprobe.offline.compare import compare
from dispatchprobe.torch.compile import probe_backend

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.probe_backend


def _gelu_too_large(x, approximate="none"):
    return 0.5 * x * (1 + torch.erf(x / 2 ** 0.5)) * 1.3


def _silu_too_large(x):
    return x * torch.sigmoid(x) * 1.3


def _silu_slightly_off(x):
    return x * torch.sigmoid(x) * (1 + 1e-3 * torch.sign(x))


def _model(family: str):
    """A tiny random-init model of ``family`` (2 layers, hidden 64) and its batch, seeded alike."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    if family == "vit":
        cfg = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4, num_labels=10,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = transformers.ViTForImageClassification(cfg)
        return model, dict(pixel_values=torch.randn(2, 3, 32, 32, generator=gen), labels=torch.tensor([3, 7]))
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    if family == "mixtral":
        cfg = transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(cfg)
    elif family == "qwen2moe":
        cfg = transformers.Qwen2MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                          shared_expert_intermediate_size=64)
        model = transformers.Qwen2MoeForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    cfg._attn_implementation = "sdpa"
    tokens = torch.randint(0, 128, (2, 16), generator=gen)
    return model, dict(input_ids=tokens, labels=tokens)


def _record(path, family: str, compiled: bool, op: str | None = None, kernel=None):
    model, batch = _model(family)
    model.train()
    backend = probe_backend(task="statistics", dump_path=str(path), inner="aot_eager") if compiled else None
    probe = DispatchProbe(task="statistics", dump_path=str(path))
    step = torch.compile(model, backend=backend) if compiled else model
    with planted_kernel(op, kernel), probe:
        step(**batch).loss.backward()
    probe.close()
    if compiled:
        backend.close()
        torch._dynamo.reset()
    return path


def _verdicts(tmp_path, family: str, op: str, kernel) -> list:
    wrong = _record(tmp_path / "wrong", family, False, op, kernel)
    clean = _record(tmp_path / "clean", family, True)
    return [compare(a, b, tensors=False).verdict for a, b in ((wrong, clean), (clean, wrong))]


@pytest.mark.parametrize("family, op, kernel", [("vit", "gelu", _gelu_too_large), ("mixtral", "silu", _silu_too_large),
                                                 ("qwen2moe", "silu", _silu_slightly_off),
                                                 ("llama", "silu", _silu_slightly_off)])
def test_backward_errors_after_a_wrong_forward_kernel_follow_from_it(tmp_path, family, op, kernel):
    for verdict in _verdicts(tmp_path, family, op, kernel):
        assert (verdict.forward.cause, verdict.forward.op) == ("op", f"aten.{op}.default"), str(verdict)
        assert verdict.backward.cause == "inherited", str(verdict)


def test_a_wrong_backward_kernel_is_still_named(tmp_path):
    for verdict in _verdicts(tmp_path, "llama", "silu_backward", wrong_silu_backward):
        assert verdict.forward is None, str(verdict)
        assert (verdict.backward.cause, verdict.backward.op) == ("op", "aten.silu_backward.default"), str(verdict)
