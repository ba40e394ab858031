"""Recording helpers for the compare tests and benchmark: clean runs and runs with a planted bad softmax,
a small MLP-and-encoder net, and tiny ``transformers`` models of each kind the compare tests build."""

from __future__ import annotations

import contextlib
import copy
import warnings

import torch
from torch import nn
from torch.nn import functional as F

from dispatchprobe import DispatchProbe
from dispatchprobe.models import TinyTransformer, lm_batch, lm_loss

FWD_ERR = 2e-3   # relative error of the planted forward softmax (fails fp32's dual-thousandth)
BWD_ERR = 5e-2   # relative error of the planted softmax backward


@contextlib.contextmanager
def planted_softmax(model: TinyTransformer, layer: int = 1):
    """Override aten::_softmax and aten::_softmax_backward_data on CPU with Python kernels that are
    slightly wrong, only inside ``model.layers[layer].attn``; unregistered on exit."""
    state = {"on": False, "ptrs": set()}
    lib = torch.library.Library("aten", "IMPL")

    def pattern(y, err):
        sign = torch.where(torch.arange(y.shape[-1]) % 2 == 0, 1.0, -1.0).to(y.dtype)
        return y * (1 + err * sign)

    def softmax(x, dim, half_to_float):
        y = torch.exp(x - x.amax(dim, keepdim=True))
        y = y / y.sum(dim, keepdim=True)
        if state["on"]:
            y = pattern(y, FWD_ERR)
            state["ptrs"].add(y.data_ptr())
        return y

    def softmax_backward(grad, output, dim, input_dtype):
        gx = output * (grad - (grad * output).sum(dim, keepdim=True))
        if output.data_ptr() in state["ptrs"]:
            gx = pattern(gx, BWD_ERR)
        return gx

    lib.impl("_softmax", softmax, "CPU")
    lib.impl("_softmax_backward_data", softmax_backward, "CPU")
    attn = model.layers[layer].attn
    hooks = [attn.register_forward_pre_hook(lambda m, i: state.__setitem__("on", True)),
             attn.register_forward_hook(lambda m, i, o: state.__setitem__("on", False))]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        lib._destroy()      # at once: a dropped Library lives until collected, its kernels with it


def record(path, *, plant: bool = False, autocast: bool = False, steps: int = 1, task: str = "tensor",
           model_kw: dict | None = None, level: str = "mix", stack: bool = False, batch: int = 4, **probe_kw):
    """Record ``steps`` training steps of the tiny transformer (dropout 0, fixed seed) to ``path``."""
    torch.manual_seed(0)
    model_kw = dict(model_kw or {})
    model = TinyTransformer(dropout=0.0, **model_kw)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    probe = DispatchProbe(task=task, dump_path=str(path), level=level, stack=stack, **probe_kw)
    ctx = planted_softmax(model) if plant else contextlib.nullcontext()
    with ctx:
        for step in range(steps):
            tokens, targets = lm_batch(batch=batch, seq=model_kw.get("seq", 32), vocab=model_kw.get("vocab", 128),
                                       seed=step)
            with probe:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    loss = lm_loss(model, tokens, targets)
                loss.backward()
            opt.step()
            opt.zero_grad()
            probe.step()
    probe.close()
    return path


# ---- a second small model for the verdict tests ---------------------------------------------------
class Net(nn.Module):
    """A 2-layer MLP feeding a 2-layer ``nn.TransformerEncoder`` and a linear head."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        layer = nn.TransformerEncoderLayer(dim, 2, 2 * dim, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 4)

    def forward(self, x):
        return self.head(self.enc(self.mlp(x)))


@contextlib.contextmanager
def planted(kernels: dict):
    """aten ops on CPU replaced by the given kernels (op name -> function) while the block runs."""
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # overriding a kernel that already has one for CPU
        for name, fn in kernels.items():
            lib.impl(name, fn, "CPU")
    try:
        yield
    finally:
        lib._destroy()      # at once: a dropped Library lives until collected, its kernels with it


def scaled_gelu(err: float):
    """aten::gelu on CPU replaced by a kernel whose output is ``1 + err`` times too large."""
    return planted({"gelu": lambda x, approximate="none": 0.5 * x * (1 + torch.erf(x * 0.7071067811865476)) * (1 + err)})


def in_bfloat16(module: nn.Module) -> None:
    """Compute ``module`` in bfloat16 (weights and input), handing float32 on."""
    module.to(torch.bfloat16)
    module.register_forward_pre_hook(lambda m, args: tuple(a.to(torch.bfloat16) for a in args))
    module.register_forward_hook(lambda m, args, out: out.float())


def record_net(path, *, task: str = "tensor", steps: int = 1, seed: int = 0, setup=None, level: str = "mix",
               **probe_kw):
    """Record ``steps`` SGD steps of :class:`Net` (weights from ``seed``; batch ``k`` from seed ``k``).
    ``setup(model)`` may change the model and return a context manager to record inside."""
    torch.manual_seed(seed)
    model = Net()
    ctx = (setup(model) if setup else None) or contextlib.nullcontext()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    probe = DispatchProbe(task=task, dump_path=str(path), level=level, **probe_kw)
    with ctx:
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(4, 8, 16, generator=g), torch.randn(4, 8, 4, generator=g)
            with probe:
                F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            probe.step()
    probe.close()
    return path


# ---- tiny transformers models, one of each kind the compare tests build -------------------------------
def _tokens(step: int) -> dict:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


def _images(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"pixel_values": torch.randn(2, 3, 8, 8, generator=g), "labels": torch.randint(0, 4, (2,), generator=g)}


def _speech(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"input_features": torch.randn(2, 8, 8, generator=g), "labels": torch.randint(3, 64, (2, 6), generator=g)}


def _text_pairs(step: int) -> dict:
    ids = torch.randint(2, 64, (2, 8), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids[:, :6].contiguous()}


def _build(name: str):
    import transformers as T
    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2)
    if name == "llama":
        m = T.LlamaForCausalLM(T.LlamaConfig(**small, num_hidden_layers=1, num_key_value_heads=2))
        return m, m.model.layers[0].mlp, _tokens
    if name == "gpt2":
        m = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=16, resid_pdrop=0.0,
                                           embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
        return m, m.transformer.h[0].mlp, _tokens
    if name == "bert":
        m = T.BertForMaskedLM(T.BertConfig(**small, num_hidden_layers=1, hidden_dropout_prob=0.0,
                                           attention_probs_dropout_prob=0.0))
        return m, m.bert.encoder.layer[0].intermediate, _tokens
    if name == "phi":
        m = T.PhiForCausalLM(T.PhiConfig(**small, num_hidden_layers=1, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attention_dropout=0.0))
        return m, m.model.layers[0].mlp, _tokens
    if name == "mixtral":      # mixture of experts
        m = T.MixtralForCausalLM(T.MixtralConfig(**small, num_hidden_layers=1, num_key_value_heads=1,
                                                 num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16))
        return m, m.model.layers[0].mlp, _tokens
    if name == "qwen2_moe":    # mixture of experts with a shared expert
        m = T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(**small, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                                   num_hidden_layers=1, num_key_value_heads=1, num_experts=4,
                                                   num_experts_per_tok=2, max_position_embeddings=16))
        return m, m.model.layers[0].mlp, _tokens
    if name == "deepseek_v3":  # multi-head latent attention, experts
        m = T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
            **small, moe_intermediate_size=16, num_hidden_layers=1, num_key_value_heads=2, n_routed_experts=4,
            num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=0,
            kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
            max_position_embeddings=16))
        return m, m.model.layers[0].mlp, _tokens
    if name == "vit":
        m = T.ViTForImageClassification(T.ViTConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                                    num_hidden_layers=1, image_size=8, patch_size=4, num_labels=4,
                                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
        return m, m.vit.layers[0].mlp, _images
    if name == "whisper":      # encoder-decoder speech
        m = T.WhisperForConditionalGeneration(T.WhisperConfig(
            vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=4,
            max_target_positions=8, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, decoder_start_token_id=1))
        return m, m.model.encoder.layers[0].fc1, _speech
    if name == "phi3":         # partial rotary: each head's pass-through part is empty
        m = T.Phi3ForCausalLM(T.Phi3Config(**small, num_hidden_layers=1, num_key_value_heads=2, resid_pdrop=0.0,
                                           embd_pdrop=0.0, attention_dropout=0.0, pad_token_id=0,
                                           max_position_embeddings=16, original_max_position_embeddings=16))
        return m, m.model.layers[0].mlp, _tokens
    if name == "t5":           # encoder-decoder text, relative position bias
        m = T.T5ForConditionalGeneration(T.T5Config(vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=1,
                                                    num_decoder_layers=1, num_heads=2, dropout_rate=0.0,
                                                    decoder_start_token_id=0, pad_token_id=0))
        return m, m.encoder.block[0].layer[1].DenseReluDense, _text_pairs
    if name == "convnext":     # convolutions, no attention
        m = T.ConvNextForImageClassification(T.ConvNextConfig(num_channels=3, hidden_sizes=[8, 16], depths=[1, 1],
                                                              num_stages=2, patch_size=2, image_size=8, num_labels=4,
                                                              drop_path_rate=0.0))
        return m, m.convnext.encoder.stages[0].layers[0], _images
    raise KeyError(name)


ARCHS = ("llama", "gpt2", "bert", "phi", "mixtral", "qwen2_moe", "deepseek_v3", "vit", "whisper", "phi3", "t5",
         "convnext")


def tiny_model(name: str, seed: int = 0):
    """(model, the name of one block of it, inputs(step) -> the model's keyword arguments) of a tiny
    ``transformers`` model of kind ``name`` (random init from ``seed``, no dropout, no download)."""
    torch.manual_seed(seed)
    model, block, inputs = _build(name)
    return model, next(n for n, m in model.named_modules() if m is block), inputs


def record_tiny(model, block: str, inputs, path, *, plant: str | None = None, task: str = "tensor", steps: int = 2,
                optimizer: str = "adamw"):
    """Record ``steps`` training steps of a copy of a :func:`tiny_model` to ``path``.  ``plant``: "hook"
    scales block ``block``'s output by 1.001 in a forward hook (an op in this run only), "inside"
    multiplies it by 1.001 in its forward where the other run ("inside0") multiplies by 1.0 (the same op)."""
    model = copy.deepcopy(model)
    mod = model.get_submodule(block)
    if plant == "hook":
        mod.register_forward_hook(lambda m, args, out: out * 1.001)
    elif plant in ("inside", "inside0"):
        factor, forward = (1.001 if plant == "inside" else 1.0), mod.forward
        mod.forward = lambda *a, **k: forward(*a, **k) * factor
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3) if optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=1e-2))
    probe = DispatchProbe(task=task, dump_path=str(path))
    for step in range(steps):
        with probe:
            model(**inputs(step)).loss.backward()
        opt.step()
        opt.zero_grad()
        probe.step()
    probe.close()
    return path


class FusedQKVAttention(nn.Module):
    """One attention layer with a fused query/key/value projection (as GPT-NeoX's): the key third of
    its bias has a gradient that cancels, the rest real gradients; then a head.  Eager and inductor
    round its softmax apart."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        w = (q @ k.transpose(-1, -2) / 4.0).softmax(-1)
        return self.head(w @ v).square().mean()


def train_attention_steps(model, opt, path, *, task: str, compiled: bool, steps: int, optimizer_inside: bool = True,
                          shape: tuple = (2, 8, 16), eager_probe: bool = True, parameters: bool = True):
    """``steps`` steps of a scalar-loss ``model`` on inputs of ``shape``, seeded per step, recorded into
    ``path``: eager, or compiled with ``probe_backend`` into the same run (``eager_probe=False``: the
    backend alone records a compiled run whose optimizer steps outside); ``optimizer_inside``:
    ``opt.step()`` inside ``with probe:`` (the optimizer's ops are records too); ``parameters``:
    whether the parameter records are written."""
    from dispatchprobe import probe_backend
    backend = probe_backend(task=task, dump_path=str(path), parameters=parameters) if compiled else None
    fn = torch.compile(model, backend=backend) if compiled else model
    probe = DispatchProbe(task=task, dump_path=str(path), parameters=parameters) \
        if eager_probe or optimizer_inside or not compiled else backend
    for step in range(steps):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(step))
        with contextlib.nullcontext() if probe is backend else probe:
            fn(x).backward()
            if optimizer_inside:
                opt.step()
                opt.zero_grad()
        if not optimizer_inside:
            opt.step()
            opt.zero_grad()
        probe.step()
    probe.close()
    if backend is not None and backend is not probe:
        backend.close()
    torch._dynamo.reset()
    return path


@contextlib.contextmanager
def planted_kernel(op: str | None, kernel=None):
    """``kernel`` as aten ``op``'s CPU kernel while the block runs (``op`` None: nothing planted):
    a wrong kernel compare must name.  torch warns that a CPU kernel is overridden: that is the point."""
    if op is None:
        yield
        return
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lib.impl(op, kernel, "CPU")
    try:
        yield
    finally:
        lib._destroy()      # at once: a dropped Library lives until collected, its kernels with it


def wrong_silu_backward(grad, x):
    """silu's gradient, 30% too large."""
    s = torch.sigmoid(x)
    return grad * s * (1 + x * (1 - s)) * 1.3


class SiluMLP(nn.Module):
    """A residual silu MLP and a head (the silu's gradient is what a planted kernel changes)."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.up, self.down, self.head = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim), nn.Linear(dim, 4)

    def forward(self, x):
        return self.head(x + self.down(F.silu(self.up(x))))


def tiny_llama(checkpointed: bool = False) -> nn.Module:
    """A tiny random-init ``transformers`` Llama (2 layers, hidden 64, vocab 128, sdpa attention) in
    training mode, seeded alike every call; ``checkpointed``: HF's gradient checkpointing (non-reentrant)."""
    import transformers as T
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    model = T.LlamaForCausalLM(cfg).train()
    if checkpointed:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def tiny_gpt2() -> nn.Module:
    """A tiny random-init ``transformers`` GPT-2 (2 layers, width 64, vocab 128, sdpa attention, no
    dropout) in training mode, seeded alike every call."""
    import transformers as T
    torch.manual_seed(0)
    cfg = T.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, attn_pdrop=0.0,
                       resid_pdrop=0.0, embd_pdrop=0.0)
    cfg._attn_implementation = "sdpa"
    return T.GPT2LMHeadModel(cfg).train()


def record_adamw_steps(path, model: nn.Module, loss_fn, *, steps: int = 2, autocast: bool = False,
                       plant: str | None = None, kernel=None, task: str = "statistics"):
    """``steps`` AdamW steps (lr 1e-3, stepped outside ``with probe:``) of ``loss_fn(model)``, recorded
    with ``task`` into ``path``; ``autocast``: bfloat16 CPU autocast around the step;
    ``plant``/``kernel``: a wrong aten kernel (:func:`planted_kernel`) for the whole run."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    probe = DispatchProbe(task=task, dump_path=str(path))
    with planted_kernel(plant, kernel):
        for _ in range(steps):
            with probe, (torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()):
                loss_fn(model).backward()
            opt.step()
            opt.zero_grad()
            probe.step()
    probe.close()
    return path


def record_mse_step(path, model: nn.Module, dtype, *, batch: tuple = (8, 16), width: int = 32,
                    plant: str | None = None, kernel=None):
    """One step of ``model`` in ``dtype`` recorded with the statistics task into ``path``: a seeded batch
    of shape ``batch`` x ``width``, a float32 mean squared error against 4 targets, optionally with a
    wrong aten kernel (:func:`planted_kernel`)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(*batch, width, generator=g), torch.randn(*batch, 4, generator=g)
    with planted_kernel(plant, kernel):
        probe = DispatchProbe(task="statistics", dump_path=str(path))
        with probe:
            F.mse_loss(model(x.to(dtype)).float(), y).backward()
        probe.step()
        probe.close()
    return path


def as_other_torch_version(path, version: str = "2.5.1+emulated"):
    """Marks recorded run ``path`` as made by another torch ``version`` (its manifest's
    ``framework_version``): compare then treats the two runs as other kernels, as two installed
    torch versions are, which a test emulates with another attention backend or a planted kernel."""
    import json
    manifest = path / "manifest.json"
    data = json.loads(manifest.read_text())
    data["framework_version"] = version
    manifest.write_text(json.dumps(data))
    return path
