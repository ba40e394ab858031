"""Training step time of the tiny transformer: eager, eager + DispatchProbe(statistics), inductor,
inductor + probe_backend(statistics), in one run; and the compile time of the two compiled ones.

    python benchmarks/compile_overhead.py            # 4 layers, dim 256, seq 128, batch 8
    python benchmarks/compile_overhead.py --quick    # 2 layers, dim 64, seq 32, batch 4
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from dispatchprobe import DispatchProbe, probe_backend
from dispatchprobe.models import TinyTransformer, lm_batch, lm_loss


def _model(cfg):
    torch.manual_seed(0)
    return TinyTransformer(vocab=cfg["vocab"], dim=cfg["dim"], heads=4, layers=cfg["layers"], seq=cfg["seq"])


def _setup(name, cfg, tmp):
    """The model, step function and closer of one variant."""
    model = _model(cfg)
    probe = backend = None
    if name == "inductor":
        step_model = torch.compile(model)
    elif name == "inductor + probe_backend":
        backend = probe_backend(task="statistics", dump_path=f"{tmp}/compiled", overwrite=True)
        step_model = torch.compile(model, backend=backend)
    else:
        step_model = model
    if name == "eager + DispatchProbe":
        probe = DispatchProbe(task="statistics", dump_path=f"{tmp}/eager", overwrite=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens, targets = lm_batch(batch=cfg["batch"], seq=cfg["seq"], vocab=cfg["vocab"])

    def step():
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
        return time.perf_counter() - t0

    def close():
        for p in (probe, backend):
            if p is not None:
                p.close()
    return step, close


def _run_all(names, cfg, steps, tmp) -> dict:
    """(first step s, median step s) per variant: the first steps (compiles) one variant after the
    other, then the timed steps one of each in turn, so drift in machine speed hits all alike."""
    setups = {name: _setup(name, cfg, tmp) for name in names}
    first = {name: setups[name][0]() for name in names}
    times: dict = {name: [] for name in names}
    for _ in range(steps):
        for name in names:
            times[name].append(setups[name][0]())
    for _, close in setups.values():
        close()
    return {name: (first[name], statistics.median(times[name])) for name in names}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small model and few steps")
    ap.add_argument("--steps", type=int, default=None)
    args = ap.parse_args(argv)
    cfg = dict(layers=2, dim=64, seq=32, batch=4, vocab=128) if args.quick else \
        dict(layers=4, dim=256, seq=128, batch=8, vocab=128)
    steps = args.steps or (5 if args.quick else 10)
    names = ["eager", "eager + DispatchProbe", "inductor", "inductor + probe_backend"]
    with tempfile.TemporaryDirectory() as tmp:
        results = _run_all(names, cfg, steps, tmp)
    eager, inductor = results["eager"][1], results["inductor"][1]
    print(f"tiny transformer {cfg}, median of {steps} steps after the first (variants in turn), "
          f"{torch.get_num_threads()} threads")
    print(f"{'variant':26} {'step ms':>9} {'x eager':>8} {'x inductor':>11} {'first step s':>13}")
    for name in names:
        first, med = results[name]
        print(f"{name:26} {med * 1e3:9.2f} {med / eager:8.2f} {med / inductor:11.2f} {first:13.1f}")


if __name__ == "__main__":
    main()
