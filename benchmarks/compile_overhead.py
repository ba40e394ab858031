"""Training step time of the tiny transformer: eager, eager + DispatchProbe(statistics), inductor,
inductor + probe_backend(statistics), and its floor (the probe's graphs, values kept for windows
that read nothing), in one run; and the first step (the compile) of the two
compiled ones, cold (a new process, an empty torch cache dir) and warm (another new process on
the same cache dir: what a rerun of a training script pays).

    python benchmarks/compile_overhead.py            # 4 layers, dim 256, seq 128, batch 8
    python benchmarks/compile_overhead.py --quick    # 2 layers, dim 64, seq 32, batch 4
    python benchmarks/compile_overhead.py --host-split   # thread CPU per step, one thread: inductor,
                                                         # probe_backend, and the probe's host side
    python benchmarks/compile_overhead.py --tree old=/tmp/old-checkout --tree new=. [--rounds 3]

``--tree`` (repeatable) times inductor and inductor + probe_backend of two or more source trees side
by side: each tree in its own child process (``PYTHONPATH`` set to the tree, so only the public
``probe_backend`` that every tree has is used), the trees alternating, ``--rounds`` times.  A child
runs at one intra-op thread, warms both variants (their compiles and ``--settle`` seconds, for trees
that load native code in the background), then alternates their steps; printed per tree: the range
over rounds of the median step's thread CPU time and wall time, and of probe_backend's ratio to
inductor within each child.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from dispatchprobe import DispatchProbe, probe_backend
from dispatchprobe.models import TinyTransformer, lm_batch, lm_loss

GRAPH = "inductor + probe, graph stats"    # DISPATCHPROBE_COMPILED_CPU_STATS=graph (docs/compile.md)
# the probe's graphs with their windows given every recorded value, which they neither read nor
# record: what keeping the values in memory for the windows costs, the floor of reading them there
FLOOR = "  windows only (floor)"
NAMES = ["eager", "eager + DispatchProbe", "inductor", "inductor + probe_backend", FLOOR, GRAPH]
COMPILED = ["inductor", "inductor + probe_backend", GRAPH]
QUICK = dict(layers=2, dim=64, seq=32, batch=4, vocab=128)
FULL = dict(layers=4, dim=256, seq=128, batch=8, vocab=128)


_PROBE = _FLOOR = None       # this tree's window rows and graph-record emit, and the floor's (_patches)


def _patches():
    """The compile runtime, its window rows and graph-record emit as the probe has them, and the
    floor's stand-ins: read from the tree's runtime only where the floor or the host split is
    measured (a ``--tree`` child uses the public API alone, which older trees have too)."""
    global _PROBE, _FLOOR
    from dispatchprobe.torch.compile import runtime
    if _PROBE is None:
        _PROBE = runtime._host_rows, runtime.GraphRecords.emit
        _FLOOR = (lambda values, roles: [[0.0] * runtime.STAT_FIELDS for _ in values]), (lambda self, *args, **kwargs: None)
    return runtime


def _model(cfg):
    torch.manual_seed(0)
    return TinyTransformer(vocab=cfg["vocab"], dim=cfg["dim"], heads=4, layers=cfg["layers"], seq=cfg["seq"])


def _setup(name, cfg, tmp, patch=True):
    """The model, step function and closer of one variant (the floor: the probe's graphs, whose
    windows take the values and return empty rows, and no records).  ``patch``: set the runtime's
    window and record functions each step (the floor's or the probe's), as the floor needs."""
    runtime = _patches() if patch else None
    model = _model(cfg)
    probe = backend = None
    if name == "inductor":
        step_model = torch.compile(model)
    elif name in ("inductor + probe_backend", FLOOR, GRAPH):
        backend = probe_backend(task="statistics", dump_path=f"{tmp}/{len(name)}", overwrite=True)
        step_model = torch.compile(model, backend=backend)
    else:
        step_model = model
    if name == "eager + DispatchProbe":
        probe = DispatchProbe(task="statistics", dump_path=f"{tmp}/eager", overwrite=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens, targets = lm_batch(batch=cfg["batch"], seq=cfg["seq"], vocab=cfg["vocab"])

    def step():
        if name == GRAPH:       # read while the graphs compile (the first step)
            os.environ["DISPATCHPROBE_COMPILED_CPU_STATS"] = "graph"
        if runtime is not None:
            runtime._host_rows, runtime.GraphRecords.emit = _FLOOR if name == FLOOR else _PROBE
        t0 = time.perf_counter()
        if probe is not None:
            probe.start()
        loss = lm_loss(step_model, tokens, targets)
        loss.backward()
        if probe is not None:
            probe.step()
        if backend is not None:
            backend.step()
        opt.step()
        opt.zero_grad()
        seconds = time.perf_counter() - t0
        if name == GRAPH:
            os.environ.pop("DISPATCHPROBE_COMPILED_CPU_STATS", None)
        return seconds

    def close():
        for p in (probe, backend):
            if p is not None:
                p.close()
    return step, close


def _run_all(names, cfg, steps, tmp) -> dict:
    """Median step s per variant: the first steps (compiles) one variant after the other, then the
    timed steps one of each in turn, so drift in machine speed hits all alike."""
    setups = {name: _setup(name, cfg, tmp) for name in names}
    for name in names:
        setups[name][0]()
    times: dict = {name: [] for name in names}
    for _ in range(steps):
        for name in names:
            times[name].append(setups[name][0]())
    for _, close in setups.values():
        close()
    return {name: statistics.median(times[name]) for name in names}


def _host_split(cfg, steps, tmp) -> None:
    """CPU time of the stepping thread per step (one intra-op thread, so that a loaded machine
    moves it little): inductor, probe_backend, and of the probe's step its host side: the windows
    (reading the values, making their rows), the records of each graph call, and the step's close
    (its part's files).  The rest of the difference is what the probe's graphs run."""
    from dispatchprobe.torch.compile.compiler import ProbeBackend
    torch.set_num_threads(1)
    host = {"windows": 0.0, "records": 0.0, "step close": 0.0}
    _patches()

    def timed(name, fn):
        def wrapped(*args, **kwargs):
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                host[name] += time.thread_time() - t0
        return wrapped
    global _PROBE
    _PROBE = timed("windows", _PROBE[0]), timed("records", _PROBE[1])
    ProbeBackend.step = timed("step close", ProbeBackend.step)
    names = ["inductor", "inductor + probe_backend"]
    setups = {name: _setup(name, cfg, tmp) for name in names}
    for name in names:
        for _ in range(3):
            setups[name][0]()
    cpu: dict = {name: [] for name in names}
    parts: list = []
    for _ in range(steps):
        for name in names:
            before = dict(host)
            t0 = time.thread_time()
            setups[name][0]()
            cpu[name].append(time.thread_time() - t0)
            if name != "inductor":
                parts.append({k: host[k] - before[k] for k in host})
    for _, close in setups.values():
        close()
    ind, probe = (statistics.median(cpu[n]) for n in names)
    print(f"thread CPU ms per step, one thread, median of {steps}: inductor {ind * 1e3:.1f}, "
          f"probe_backend {probe * 1e3:.1f} ({probe / ind:.3f}x)")
    for k in host:
        print(f"  probe's {k}: {statistics.median(p[k] for p in parts) * 1e3:.1f} ms")


TREE_VARIANTS = ["inductor", "inductor + probe_backend"]


def _tree_child(cfg, steps, settle) -> None:
    """Child process of ``--tree``: inductor and probe_backend of the tree on ``PYTHONPATH``, one
    intra-op thread, their steps alternating after a warm-up; the median step's thread CPU and wall
    seconds of each as a JSON line, with where dispatchprobe was imported from and whether its
    native statistics were loaded when timing began."""
    import dispatchprobe
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        setups = {name: _setup(name, cfg, tmp, patch=False) for name in TREE_VARIANTS}
        for name in TREE_VARIANTS:
            for _ in range(3):                 # the compiles, then first-use costs
                setups[name][0]()
        time.sleep(settle)                     # native code loading in the background (older trees)
        for name in TREE_VARIANTS:
            setups[name][0]()
        from dispatchprobe.torch import fused_stats
        native = getattr(fused_stats, "stats4", None) is not None
        cpu: dict = {name: [] for name in TREE_VARIANTS}
        wall: dict = {name: [] for name in TREE_VARIANTS}
        for _ in range(steps):
            for name in TREE_VARIANTS:
                t0, w0 = time.thread_time(), time.perf_counter()
                setups[name][0]()
                cpu[name].append(time.thread_time() - t0)
                wall[name].append(time.perf_counter() - w0)
        for _, close in setups.values():
            close()
    print(json.dumps({"package": os.path.dirname(dispatchprobe.__file__), "native": native,
                      "cpu": {n: statistics.median(v) for n, v in cpu.items()},
                      "wall": {n: statistics.median(v) for n, v in wall.items()}}))


def _trees(trees, cfg, steps, rounds, settle) -> None:
    """Each tree's children, the trees alternating ``rounds`` times; each tree keeps one torch cache
    dir over its rounds (the compiles are not timed)."""
    results: dict = {label: [] for label, _ in trees}
    caches = {label: tempfile.TemporaryDirectory(prefix=f"dp-compile-{label}-") for label, _ in trees}
    try:
        for _ in range(rounds):
            for label, path in trees:
                path = os.path.abspath(path)
                env = dict(os.environ, PYTHONPATH=path, TORCHINDUCTOR_CACHE_DIR=caches[label].name)
                done = subprocess.run([sys.executable, os.path.abspath(__file__), "--tree-child", "--steps", str(steps),
                                       "--settle", str(settle), "--config", json.dumps(cfg)],
                                      env=env, capture_output=True, text=True)
                if done.returncode != 0:
                    raise SystemExit(f"tree {label} ({path}) failed:\n{done.stderr[-3000:]}")
                row = json.loads(done.stdout.strip().splitlines()[-1])
                if not os.path.realpath(row["package"]).startswith(os.path.realpath(path) + os.sep):
                    raise SystemExit(f"tree {label}: dispatchprobe was imported from {row['package']}, not {path}")
                results[label].append(row)
    finally:
        for cache in caches.values():
            cache.cleanup()
    print(f"tiny transformer {cfg}, one intra-op thread; per child the median of {steps} steps, "
          f"variants alternating; {rounds} rounds, trees alternating: ranges over rounds")

    def span(values, fmt):
        values = sorted(values)
        return f"{fmt(values[0])}-{fmt(values[-1])} (median {fmt(statistics.median(values))})"
    ms = lambda v: f"{v * 1e3:.1f}"
    ratio = lambda v: f"{v:.3f}"
    for label, rows in results.items():
        native = sum(r["native"] for r in rows)
        print(f"{label}: native statistics loaded in {native} of {len(rows)} children")
        for clock in ("cpu", "wall"):
            ind = [r[clock]["inductor"] for r in rows]
            probe = [r[clock]["inductor + probe_backend"] for r in rows]
            print(f"  {'thread CPU' if clock == 'cpu' else 'wall':10} ms: inductor {span(ind, ms)}, "
                  f"probe_backend {span(probe, ms)}, ratio {span([p / i for p, i in zip(probe, ind)], ratio)}")


def _first_step(name: str, cfg: dict) -> None:
    """Child process: one variant's first step, with torch's cache counters, as a JSON line."""
    from torch._dynamo.utils import counters
    with tempfile.TemporaryDirectory() as tmp:
        step, close = _setup(name, cfg, tmp)
        seconds = step()
        close()
    hits = {k: dict(counters[k]) for k in ("inductor", "aot_autograd")}
    print(json.dumps({"seconds": seconds, "counters": hits}))


def _first_steps(names, cfg) -> dict:
    """{variant: (cold s, warm s, warm counters)}: each in a new process on its own cache dir."""
    out = {}
    for name in names:
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
            runs = []
            for _ in ("cold", "warm"):
                done = subprocess.run([sys.executable, __file__, "--first-step", name, "--config", json.dumps(cfg)],
                                      env=env, capture_output=True, text=True, check=True)
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        out[name] = (runs[0]["seconds"], runs[1]["seconds"], runs[1]["counters"])
    return out


def _hits(counters: dict) -> str:
    ind, aot = counters.get("inductor", {}), counters.get("aot_autograd", {})
    return (f"fx graph cache {ind.get('fxgraph_cache_hit', 0)} hit / {ind.get('fxgraph_cache_miss', 0)} miss / "
            f"{ind.get('fxgraph_cache_bypass', 0)} bypass; AOTAutograd cache {aot.get('autograd_cache_hit', 0)} hit / "
            f"{aot.get('autograd_cache_miss', 0)} miss / {aot.get('autograd_cache_bypass', 0)} bypass")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small model and few steps")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--host-split", action="store_true",
                    help="thread CPU per step (one thread): inductor, probe_backend and the probe's host side")
    ap.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH",
                    help="a source tree to time (repeatable): the trees side by side, alternating")
    ap.add_argument("--rounds", type=int, default=3, help="--tree: children per tree, the trees alternating")
    ap.add_argument("--settle", type=float, default=3.0,
                    help="--tree: seconds a child waits after warming, for native code loaded in the background")
    ap.add_argument("--tree-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--first-step", help=argparse.SUPPRESS)      # child process: one variant's first step
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.first_step:
        return _first_step(args.first_step, json.loads(args.config))
    if args.tree_child:
        return _tree_child(json.loads(args.config), args.steps, args.settle)
    cfg = QUICK if args.quick else FULL
    steps = args.steps or (5 if args.quick else 10)
    if args.tree:
        return _trees([t.split("=", 1) for t in args.tree], cfg, steps, args.rounds, args.settle)
    if args.host_split:
        with tempfile.TemporaryDirectory() as tmp:
            return _host_split(cfg, steps, tmp)
    first = _first_steps(COMPILED, cfg)
    with tempfile.TemporaryDirectory() as tmp:
        results = _run_all(NAMES, cfg, steps, tmp)
    eager, inductor = results["eager"], results["inductor"]
    print(f"tiny transformer {cfg}, median of {steps} steps after the first (variants in turn), "
          f"{torch.get_num_threads()} threads; first step in a new process, cold (empty torch cache dir) "
          f"and warm (a second process on that cache dir)")
    print(f"{'variant':30} {'step ms':>9} {'x eager':>8} {'x inductor':>11} {'first cold s':>13} {'first warm s':>13}")
    for name in NAMES:
        med = results[name]
        cold, warm = (f"{first[name][0]:13.1f}", f"{first[name][1]:13.1f}") if name in first else (f"{'-':>13}",) * 2
        print(f"{name:30} {med * 1e3:9.2f} {med / eager:8.2f} {med / inductor:11.2f} {cold} {warm}")
    for name in COMPILED:
        print(f"warm {name}: {_hits(first[name][2])}")


if __name__ == "__main__":
    main()
