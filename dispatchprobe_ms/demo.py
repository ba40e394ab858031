"""A small MindSpore net and training loop (no downloads): the tests', the benchmark's and the
README's demo.  The PyTorch twin with the same weights is in :mod:`dispatchprobe.models`."""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import mint, nn

DIMS = (16, 32, 8)
# the overflow demo's first-layer weights, grown this many times larger (as weights grow in a run that
# diverges): in float16 the first matmul passes 65504 from finite inputs (its float64 value does not fit)
FC1_GROWTH = 5e4


class TinyNet(nn.Cell):
    """Dense -> GELU -> LayerNorm -> Dense -> softmax (the loss takes log of it)."""

    def __init__(self, dtype=ms.float32):
        super().__init__()
        d_in, d_hidden, d_out = DIMS
        self.fc1 = nn.Dense(d_in, d_hidden, dtype=dtype)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm((d_hidden,), dtype=dtype)
        self.fc2 = nn.Dense(d_hidden, d_out, dtype=dtype)

    def construct(self, x):
        return mint.softmax(self.fc2(self.norm(self.act(self.fc1(x)))), dim=-1)


def batch(step: int, dtype=ms.float32, n: int = 8):
    rng = np.random.RandomState(step)
    x = rng.randn(n, DIMS[0]).astype(np.float32)
    y = np.eye(DIMS[2], dtype=np.float32)[rng.randint(0, DIMS[2], n)]
    return ms.Tensor(x).astype(dtype), ms.Tensor(y).astype(dtype)


def train(probe=None, steps: int = 3, dtype=ms.float32, seed: int = 0, net=None):
    """``steps`` of SGD on a squared-error loss of the softmax; returns (losses, parameters) as numpy."""
    ms.set_seed(seed)
    net = net or TinyNet(dtype)
    if probe is not None and probe.scopes.model is None:
        probe.scopes.model = net

    def loss_fn(x, y):
        return ((net(x) - y) ** 2).mean()

    grad_fn = ms.value_and_grad(loss_fn, None, net.trainable_params())
    opt = nn.SGD(net.trainable_params(), learning_rate=0.5)
    losses = []
    for step in range(steps):
        x, y = batch(step, dtype)
        if probe is not None:
            with probe:
                loss, grads = grad_fn(x, y)
        else:
            loss, grads = grad_fn(x, y)
        opt(grads)
        if probe is not None:
            probe.step()
        losses.append(loss.asnumpy().copy())
    if probe is not None:
        probe.close()
    return losses, {p.name: p.asnumpy().copy() for p in net.trainable_params()}


def overflow_net(seed: int = 0) -> TinyNet:
    """The demo net in float16 with its first layer's weights x :data:`FC1_GROWTH` (still finite)."""
    ms.set_seed(seed)
    net = TinyNet(ms.float16)
    w = net.fc1.weight
    w.set_data(ms.Tensor((w.asnumpy().astype(np.float32) * FC1_GROWTH).astype(np.float16)))
    return net


def run_demo(dump_path: str = "runs/ms_demo", task: str = "tensor", steps: int = 2) -> str:
    """``dispatchprobe demo --framework mindspore``: record ``steps`` of the demo net, summarise.  Each
    inline check's demo has something to find: the overflow demo a float16 matmul past 65504."""
    import warnings

    from dispatchprobe.core.overflow import OverflowDetected
    from dispatchprobe.offline.summary import demo_report

    from .capture import DispatchProbe
    probe = DispatchProbe(task=task, dump_path=dump_path, level="mix", overwrite=True)
    net = overflow_net() if task == "overflow" else None
    if net is not None:
        print(f"float16 training, the first layer's weights x{FC1_GROWTH:g}: its matmul overflows float16")
    with warnings.catch_warnings(record=True):
        try:
            losses, _ = train(probe, steps=steps, dtype=ms.float32 if task in ("tensor", "statistics") else ms.float16,
                              net=net)
        except OverflowDetected as exc:      # overflow_nums=1: training stops at the first critical op
            print(exc)
            print("training stopped there (overflow_nums=1; -1 would check on)")
            probe.close()
            losses = []
    for step, loss in enumerate(losses):
        print(f"step {step}: loss {float(loss):.4f}")
    counts = probe.summary() if task in ("overflow", "free_benchmark") else None
    print(demo_report(dump_path, task, counts))
    return dump_path
