"""Recording helpers for the compare tests and benchmark: clean runs and runs with a planted bad softmax."""

from __future__ import annotations

import contextlib

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
def scaled_gelu(err: float):
    """aten::gelu on CPU replaced by a kernel whose output is ``1 + err`` times too large."""
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("gelu", lambda x, approximate="none": 0.5 * x * (1 + torch.erf(x * 0.7071067811865476)) * (1 + err),
             "CPU")
    try:
        yield
    finally:
        lib._destroy()      # at once: a dropped Library lives until collected, its kernels with it


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
