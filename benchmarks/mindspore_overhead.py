"""Cost of recording a MindSpore training step: unrecorded vs an empty dispatch mode vs
dispatchprobe_ms statistics vs tensor, all in one run (PyNative, blocking mode).

    python benchmarks/mindspore_overhead.py [--steps 20] [--width 16]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("MS_DEV_LAUNCH_BLOCKING", "1")

import mindspore as ms  # noqa: E402
from mindspore.utils import MsDispatchMode  # noqa: E402

from dispatchprobe_ms import DispatchProbe  # noqa: E402
from dispatchprobe_ms import demo  # noqa: E402


class EmptyMode(MsDispatchMode):
    """The dispatch mode's own cost: every primitive passes through Python, nothing else."""

    def __ms_dispatch__(self, func, args, kwargs=None):
        return func(*args)


def step_times(make_ctx, steps: int, width: int) -> list[float]:
    ms.set_seed(0)
    demo.DIMS = (16 * width, 32 * width, 8)
    net = demo.TinyNet()
    grad_fn = ms.value_and_grad(lambda x, y: ((net(x) - y) ** 2).mean(), None, net.trainable_params())
    opt = ms.nn.SGD(net.trainable_params(), learning_rate=0.1)
    ctx = make_ctx(net)
    times = []
    for step in range(steps + 2):                      # two warm-up steps
        x, y = demo.batch(step, n=64)
        t0 = time.perf_counter()
        with ctx if ctx is not None else _nothing():
            loss, grads = grad_fn(x, y)
        opt(grads)
        loss.asnumpy()
        times.append(time.perf_counter() - t0)
        if isinstance(ctx, DispatchProbe):
            ctx.step()
    if isinstance(ctx, DispatchProbe):
        ctx.close()
    return times[2:]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--width", type=int, default=16, help="layer width multiplier of the demo net")
    opts = ap.parse_args()
    root = tempfile.mkdtemp(prefix="ms_overhead_")
    modes = {
        "unrecorded": lambda net: None,
        "empty dispatch mode": lambda net: EmptyMode(),
        "statistics": lambda net: DispatchProbe(task="statistics", dump_path=os.path.join(root, "stats"), model=net),
        "tensor": lambda net: DispatchProbe(task="tensor", dump_path=os.path.join(root, "tensor"), model=net),
        "unrecorded, again": lambda net: None,         # order effects (warm-up, caches) show as a gap
    }
    import warnings
    warnings.simplefilter("ignore", RuntimeWarning)     # the unobservable-kernel note, once per probe
    results = {name: statistics.median(step_times(make, opts.steps, opts.width)) for name, make in modes.items()}
    base = results["unrecorded"]
    print(f"MindSpore {ms.__version__}, demo net x{opts.width} (batch 64), median of {opts.steps} steps")
    print("| mode | step (ms) | ratio |\n| --- | --- | --- |")
    for name, t in results.items():
        print(f"| {name} | {t * 1e3:.2f} | {t / base:.2f}x |")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
