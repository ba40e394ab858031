"""Cost of recording a MindSpore training step: unrecorded vs an empty dispatch mode vs
dispatchprobe_ms statistics vs tensor, all in one run (PyNative, blocking mode); and the same
net as a GRAPH_MODE ``TrainOneStepCell``, unrecorded vs the statistics task, recording every step
or a step filter that selects none of them (the cost of a step the config leaves out), and one
cell's records (``scope``) with MindSpore's dump narrowed to it or not, each in its own process:
MindSpore reads the dump config the probe sets once per process.

    python benchmarks/mindspore_overhead.py [--steps 20] [--width 16] [--graph-only]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
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


def graph_step_times(task: str, steps: int, width: int, dump_path: str, unselected: bool = False,
                     scope: list[str] = (), dump_filter: bool = True) -> list[float]:
    """GRAPH_MODE steps of the demo net (TrainOneStepCell), unrecorded (``task`` "") or recorded
    (``unselected``: the probe's ``step`` filter selects none of them; ``scope``: one cell's
    records, MindSpore's dump narrowed to it or, without ``dump_filter``, not); the probe is made
    before the first compile, as it must be."""
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_seed(0)
    demo.DIMS = (16 * width, 32 * width, 8)
    net = demo.TinyNet()
    filters = {"step": [steps + 2]} if unselected else {}          # a step the loop never reaches
    if scope:
        filters.update(scope=list(scope), dump_filter=dump_filter)
    probe = DispatchProbe(task=task, dump_path=dump_path, model=net, **filters) if task else None
    train = ms.nn.TrainOneStepCell(ms.nn.WithLossCell(net, ms.nn.MSELoss()),
                                   ms.nn.SGD(net.trainable_params(), learning_rate=0.1))
    times = []
    for step in range(steps + 2):                      # two warm-up steps (the first compiles)
        x, y = demo.batch(step, n=64)
        t0 = time.perf_counter()
        with probe if probe is not None else _nothing():
            loss = train(x, y)
        loss.asnumpy()
        if probe is not None:
            probe.step()                               # the step's records are written here
        times.append(time.perf_counter() - t0)
    if probe is not None:
        probe.close()
    return times[2:]


def graph_results(steps: int, width: int, root: str) -> dict:
    """{mode: median step} of GRAPH_MODE, each mode in a process of its own."""
    out = {}
    for name, task in (("GRAPH_MODE unrecorded", ""), ("GRAPH_MODE statistics", "statistics"),
                       ("GRAPH_MODE statistics, step not selected", "unselected"),
                       ("GRAPH_MODE statistics, scope act", "scope"),
                       ("GRAPH_MODE statistics, scope act, dump not narrowed", "scope-unfiltered")):
        res = subprocess.run([sys.executable, __file__, "--graph-run", task or "-", "--steps", str(steps),
                              "--width", str(width), "--dump", os.path.join(root, name.replace(" ", "_"))],
                             capture_output=True, text=True, check=True)
        out[name] = json.loads(res.stdout.strip().splitlines()[-1])["median"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--width", type=int, default=16, help="layer width multiplier of the demo net")
    ap.add_argument("--graph-only", action="store_true", help="only the GRAPH_MODE rows")
    ap.add_argument("--graph-run", help=argparse.SUPPRESS)    # one GRAPH_MODE mode, in this process
    ap.add_argument("--dump", help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.graph_run:
        import warnings
        warnings.simplefilter("ignore", RuntimeWarning)
        task = {"-": "", "unselected": "statistics", "scope": "statistics",
                "scope-unfiltered": "statistics"}.get(opts.graph_run, opts.graph_run)
        scope = ["act"] if opts.graph_run.startswith("scope") else []
        times = graph_step_times(task, opts.steps, opts.width, opts.dump, unselected=opts.graph_run == "unselected",
                                 scope=scope, dump_filter=opts.graph_run != "scope-unfiltered")
        print(json.dumps({"median": statistics.median(times)}))
        return
    root = tempfile.mkdtemp(prefix="ms_overhead_")
    if opts.graph_only:
        results = graph_results(opts.steps, opts.width, root)
        base = results["GRAPH_MODE unrecorded"]
        print(f"MindSpore {ms.__version__}, demo net x{opts.width} (batch 64), median of {opts.steps} steps")
        print("| mode | step (ms) | ratio |\n| --- | --- | --- |")
        for name, t in results.items():
            print(f"| {name} | {t * 1e3:.2f} | {t / base:.2f}x |")
        shutil.rmtree(root, ignore_errors=True)
        return
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
    graph = graph_results(opts.steps, opts.width, root)
    print(f"MindSpore {ms.__version__}, demo net x{opts.width} (batch 64), median of {opts.steps} steps")
    print("| mode | step (ms) | ratio |\n| --- | --- | --- |")
    for name, t in results.items():
        print(f"| {name} | {t * 1e3:.2f} | {t / base:.2f}x |")
    for name, t in graph.items():                     # against the unprobed GRAPH_MODE step
        print(f"| {name} | {t * 1e3:.2f} | {t / graph['GRAPH_MODE unrecorded']:.2f}x |")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
