"""Training step time of the tiny transformer: eager, eager + DispatchProbe(statistics), inductor,
inductor + probe_backend(statistics), and its floor (the probe's graphs, values kept for windows
that read nothing), in one run; and the first step (the compile) of the two
compiled ones, cold (a new process, an empty torch cache dir) and warm (another new process on
the same cache dir: what a rerun of a training script pays).

    python benchmarks/compile_overhead.py            # 4 layers, dim 256, seq 128, batch 8
    python benchmarks/compile_overhead.py --quick    # 2 layers, dim 64, seq 32, batch 4
    python benchmarks/compile_overhead.py --host-split   # thread CPU per step, one thread: inductor,
                                                         # probe_backend, and the probe's host side
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
from dispatchprobe.torch.compile import runtime
from dispatchprobe.torch.compile.compiler import ProbeBackend
from dispatchprobe.models import TinyTransformer, lm_batch, lm_loss

GRAPH = "inductor + probe, graph stats"    # DISPATCHPROBE_COMPILED_CPU_STATS=graph (docs/compile.md)
# the probe's graphs with their windows given every recorded value, which they neither read nor
# record: what keeping the values in memory for the windows costs, the floor of reading them there
FLOOR = "  windows only (floor)"
NAMES = ["eager", "eager + DispatchProbe", "inductor", "inductor + probe_backend", FLOOR, GRAPH]
COMPILED = ["inductor", "inductor + probe_backend", GRAPH]
QUICK = dict(layers=2, dim=64, seq=32, batch=4, vocab=128)
FULL = dict(layers=4, dim=256, seq=128, batch=8, vocab=128)


_PROBE = runtime._host_rows, runtime.GraphRecords.emit
_FLOOR = (lambda values, roles: [[0.0] * runtime.STAT_FIELDS for _ in values]), (lambda self, *args, **kwargs: None)


def _model(cfg):
    torch.manual_seed(0)
    return TinyTransformer(vocab=cfg["vocab"], dim=cfg["dim"], heads=4, layers=cfg["layers"], seq=cfg["seq"])


def _setup(name, cfg, tmp):
    """The model, step function and closer of one variant (the floor: the probe's graphs, whose
    windows take the values and return empty rows, and no records)."""
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
    torch.set_num_threads(1)
    host = {"windows": 0.0, "records": 0.0, "step close": 0.0}

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
    ap.add_argument("--first-step", help=argparse.SUPPRESS)      # child process: one variant's first step
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.first_step:
        return _first_step(args.first_step, json.loads(args.config))
    cfg = QUICK if args.quick else FULL
    steps = args.steps or (5 if args.quick else 10)
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
