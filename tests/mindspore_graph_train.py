"""A small conv net (conv, batch norm, GELU, dense, MSE loss) trained 2 steps by MindSpore as a
GRAPH_MODE ``TrainOneStepCell``, an ``@ms.jit`` train step, or PyNative ``value_and_grad``, with
or without the probe; run in its own process by ``tests/test_mindspore_graph.py`` (MindSpore
reads its dump config once per process, at the first graph compile).

``python tests/mindspore_graph_train.py MODE OUT [--task T] [--plant] [--plant-overflow] [--unprobed]``
writes the losses and parameters to ``OUT/result.npz`` and, with a task, records to ``OUT/run``;
``--loss-scale``: a float16 net trained under ``amp.DynamicLossScaler`` (its first steps overflow on
purpose and are skipped), the overflow task told of the scaler.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import numpy as np

os.environ.setdefault("MS_DEV_LAUNCH_BLOCKING", "1")
import mindspore as ms  # noqa: E402
from mindspore import nn  # noqa: E402

from dispatchprobe_ms import DispatchProbe  # noqa: E402


class ConvNet(nn.Cell):
    def __init__(self, dtype=ms.float32):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, pad_mode="pad", padding=1, has_bias=True, dtype=dtype)
        self.bn = nn.BatchNorm2d(4, momentum=0.9, dtype=dtype)
        self.act = nn.GELU()
        self.fc = nn.Dense(4 * 4 * 4, 5, dtype=dtype)

    def construct(self, x):
        h = self.act(self.bn(self.conv(x)))
        return self.fc(h.reshape(h.shape[0], -1))


class PlantedGELU(nn.GELU):
    """The GELU cell off by 1 %: the fault a compare must name at ``ConvNet.act``."""

    def construct(self, x):
        return super().construct(x) * 1.01


class PlantedOverflow(nn.GELU):
    """The GELU cell overflowing float32 in forward: the overflow the task must name at ``ConvNet.act``."""

    def construct(self, x):
        return super().construct(x) * 1e38 * 100.0


class HalfNet(nn.Cell):
    """float16 dense + GELU: the loss scale's first steps overflow in its backward."""

    def __init__(self, overflow: bool = False):
        super().__init__()
        self.fc = nn.Dense(8, 4, dtype=ms.float16)
        self.act = nn.GELU()
        self.overflow = overflow

    def construct(self, x):
        h = self.fc(x)
        return self.act(h * 1000.0 * 100.0 if self.overflow else h)     # planted: float16 overflows in forward


def train_loss_scaled(mode: str, dump_path: str, plant: bool, steps: int = 6) -> dict:
    """The MindSpore loss-scaling loop (scale, unscale, amp.all_finite, optimizer only when finite,
    adjust) on a float16 net, with the overflow task; {scales, summary, error}."""
    from mindspore import amp
    from dispatchprobe.core.overflow import OverflowDetected
    ms.set_seed(0)
    net = HalfNet(overflow=plant)
    opt = nn.SGD(net.trainable_params(), 0.01)
    scaler = amp.DynamicLossScaler(scale_value=2.0 ** 20, scale_factor=2, scale_window=1000)
    loss_fn = nn.MSELoss()
    probe = DispatchProbe(task="overflow", dump_path=dump_path, model=net, loss_scaler=scaler)

    def forward(x, y):
        return scaler.scale(loss_fn(net(x).astype(ms.float32), y))
    grad_fn = ms.value_and_grad(forward, None, opt.parameters)

    def step(x, y):
        loss, grads = grad_fn(x, y)
        loss, grads = scaler.unscale(loss), scaler.unscale(grads)
        finite = amp.all_finite(grads)
        if finite:
            opt(grads)
        scaler.adjust(finite)
        return loss
    step = ms.jit(step) if mode == "jit" else step
    scales, error = [], ""
    try:
        for i in range(steps):
            rng = np.random.RandomState(i)
            x, y = ms.Tensor(rng.randn(4, 8).astype(np.float16)), ms.Tensor(rng.randn(4, 4).astype(np.float32))
            with probe:
                step(x, y)
            probe.step()
            scales.append(float(scaler.scale_value.asnumpy()))
    except OverflowDetected as exc:
        error = str(exc)
    probe.close()
    return {"scales": scales, "summary": probe.summary(), "error": error}


class CrossEntropyOnArgmax(nn.Cell):
    """Cross entropy against the target's argmax: a loss whose graph kernels MindSpore's dump numbers
    apart from the graph's IR (its expanded ``SumExt``/``Muls``)."""

    def construct(self, logits, y):
        return ms.ops.cross_entropy(logits, y.argmax(-1))


def data(step: int, dtype=np.float32):
    rng = np.random.RandomState(step)
    return rng.randn(2, 3, 4, 4).astype(dtype), rng.randn(2, 5).astype(dtype)


def build(mode: str, net, loss_fn, opt):
    """The train step: (x, y) -> loss, the optimizer applied."""
    if mode == "graph":
        return nn.TrainOneStepCell(nn.WithLossCell(net, loss_fn), opt)

    def forward(x, y):
        return loss_fn(net(x), y)
    grad_fn = ms.value_and_grad(forward, None, opt.parameters)

    def step(x, y):
        loss, grads = grad_fn(x, y)
        opt(grads)
        return loss
    return ms.jit(step) if mode == "jit" else step


def dumped_files() -> int:
    """How many tensor files MindSpore's dump holds now in the probe's private folder (0 without
    one; the graphs' IR and execution order, written at compile, are not counted)."""
    from dispatchprobe_ms import graph_dump
    folder = graph_dump._folder
    return sum(f.endswith(".npy") for _, _, files in os.walk(folder.path) for f in files) if folder else 0


def train(mode: str, dump_path: str = "", task: str = "", plant: bool = False, steps: int = 2, calls: int = 1,
          loss: str = "mse", gelu: str = "tanh", **config):
    """``steps`` of training (``calls`` train steps on batches of their own in each recorded
    region; ``loss`` "mse" or "cross_entropy"; ``gelu`` "tanh" (``nn.GELU()``) or "exact", whose
    backward MindSpore computes in pieces summed by an untraced ``AddN``); with a ``task``,
    recorded to ``dump_path``: {losses, initial and final parameters, the probe's summary, the
    files MindSpore's dump held after each step and after a step run once the probe was closed}."""
    ms.set_seed(0)
    net = ConvNet()
    if gelu == "exact":
        net.act = nn.GELU(approximate=False)
    if plant:
        net.act = PlantedOverflow() if plant == "overflow" else PlantedGELU()
    net.set_train(True)                       # batch norm on batch statistics
    initial = {p.name: p.asnumpy().copy() for p in net.get_parameters()}
    # the probe is made before the step is first called (compiled): it switches MindSpore's dump on
    probe = DispatchProbe(task=task, dump_path=dump_path, model=net, **config) if task else None
    loss_fn = CrossEntropyOnArgmax() if loss == "cross_entropy" else nn.MSELoss()
    step = build(mode, net, loss_fn, nn.SGD(net.trainable_params(), learning_rate=0.1))
    losses, dumped = [], []
    for i in range(steps):
        batches = [[ms.Tensor(v) for v in data(i * calls + c)] for c in range(calls)]
        with probe if probe is not None else contextlib.nullcontext():
            for x, y in batches:
                loss = step(x, y)
        if probe is not None:
            probe.step()
        losses.append(loss.asnumpy().copy())
        dumped.append(dumped_files())
    summary = {}
    params = {p.name: p.asnumpy().copy() for p in net.get_parameters()}
    if probe is not None:
        probe.close()
        summary = probe.summary()
        x, y = (ms.Tensor(v) for v in data(steps))
        step(x, y).asnumpy()                  # after close(): MindSpore must not dump it
        dumped.append(dumped_files())
    return {"losses": losses, "initial": initial, "summary": summary, "dumped": dumped, "params": params}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["graph", "jit", "pynative"])
    ap.add_argument("out")
    ap.add_argument("--task", default="")
    ap.add_argument("--plant", action="store_true", help="the GELU cell off by 1 %%")
    ap.add_argument("--plant-overflow", action="store_true", help="the GELU cell overflowing in forward")
    ap.add_argument("--loss-scale", action="store_true")
    ap.add_argument("--config", default="{}", help="more probe settings, as JSON (step, scope, list, level; "
                    "loss: mse or cross_entropy; gelu: tanh or exact)")
    ap.add_argument("--unprobed", action="store_true", help="also train without the probe, after it")
    args = ap.parse_args(argv)
    ms.set_context(mode=ms.GRAPH_MODE if args.mode == "graph" else ms.PYNATIVE_MODE)
    os.makedirs(args.out, exist_ok=True)
    plant = "overflow" if args.plant_overflow else args.plant
    if args.loss_scale:
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(train_loss_scaled(args.mode, os.path.join(args.out, "run"), args.plant_overflow), f)
        return 0
    result = {}
    if args.task:
        try:
            out = train(args.mode, os.path.join(args.out, "run"), args.task, plant=plant, **json.loads(args.config))
        except Exception as exc:        # an overflow the task stops at: said in the summary
            with open(os.path.join(args.out, "summary.json"), "w") as f:
                json.dump({"error": f"{type(exc).__name__}: {exc}"}, f)
            return 0
        result.update({f"loss{i}": v for i, v in enumerate(out["losses"])})
        result.update({f"initial:{k}": v for k, v in out["initial"].items()})
        result.update({f"param:{k}": v for k, v in out["params"].items()})
        result["dumped"] = np.array(out["dumped"])
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(out["summary"], f)
    if args.unprobed:
        out = train(args.mode, plant=plant)
        result.update({f"plain_loss{i}": v for i, v in enumerate(out["losses"])})
        result.update({f"plain_param:{k}": v for k, v in out["params"].items()})
    np.savez(os.path.join(args.out, "result.npz"), **result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
