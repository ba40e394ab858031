"""Capture, overflow and free-benchmark on an accelerator (cuda, npu, any torch.accelerator).

CI has no accelerator; this script is how the device paths are exercised and timed when one is
lent.  It prints one table of checks (bit-identical training under the probe with deterministic
kernels, overflow localisation on the device, free-benchmark flags) and one of step times.

    python benchmarks/accelerator_check.py [--steps 10] [--large] [--timings-only] [--windows-only]

``--windows-only``: just the statistics task's windows against its per-value path (same records,
synchronisations inside a step, step time beside DebugMode): what a short lent-device run checks.
``--large``: a transformer whose step is GPU-bound (dim 2048, 8 layers, seq 1024, batch 8),
where the cost of the re-runs themselves shows, not the Python per op.
"""

from __future__ import annotations

import argparse
import collections
import csv
import glob
import os
import statistics
import tempfile
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from dispatchprobe import DispatchProbe, load  # noqa: E402
from dispatchprobe.models import TinyTransformer, lm_batch, lm_loss  # noqa: E402


def device_name() -> str:
    acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    return str(acc.type) if acc is not None else "cpu"


def sync(dev):
    if dev != "cpu":
        torch.accelerator.synchronize()


def train(dev, probe=None, steps=3, dtype=None, size=None):
    torch.manual_seed(0)
    kw = size or {}
    model = TinyTransformer(dropout=0.1, **kw).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        tokens, targets = lm_batch(batch=8, seq=kw.get("seq", 32), vocab=kw.get("vocab", 128), seed=step)
        tokens, targets = tokens.to(dev), targets.to(dev)
        ctx = probe if probe is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        with ctx:
            with torch.autocast(dev, dtype=dtype, enabled=dtype is not None):
                loss = lm_loss(model, tokens, targets)
            loss.backward()
        opt.step()
        opt.zero_grad()
        if probe is not None:
            probe.step()
        losses.append(loss.detach().cpu())
    if probe is not None:
        probe.close()
    return losses, {n: p.detach().cpu() for n, p in model.named_parameters()}


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


class Exploding(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(3))

    def forward(self, x):
        x = torch.relu(self.layers[0](x))
        x = torch.exp(self.layers[1](x) * 50)      # overflows in fp16
        return self.layers[2](x)


def checks(dev, tmp) -> list[tuple[str, str]]:
    rows = []
    torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        for dtype in (None, torch.bfloat16):
            base = train(dev, dtype=dtype)
            for task in ("statistics", "tensor", "overflow"):
                kw = {"overflow_nums": -1} if task == "overflow" else {}
                probed = train(dev, DispatchProbe(task=task, dump_path=f"{tmp}/{task}-{dtype}", **kw), dtype=dtype)
                rows.append((f"bit-identical training, {task}, {dtype or 'fp32'}", str(same(base, probed))))
            probed = train(dev, DispatchProbe(task="free_benchmark", dump_path=f"{tmp}/fb-{dtype}",
                                              pert_mode="improve_precision", widen_float32=True), dtype=dtype)
            rows.append((f"bit-identical training, free_benchmark check, {dtype or 'fp32'}", str(same(base, probed))))
    finally:
        torch.use_deterministic_algorithms(False)
    run = load(f"{tmp}/tensor-None")
    devices = set(run.tensors["device"])
    rows.append(("recorded tensor devices", ",".join(sorted(devices))))
    part = run.part(0, 0)
    rec = next(r for r in part.records if r["op"] == "aten.addmm.default")
    arr = part.tensor(rec["outputs"][0]["data"])
    rows.append(("saved device tensor readable", f"{arr.shape}"))

    # overflow localisation on the device, fp16
    from dispatchprobe.core.overflow import OverflowDetected
    torch.manual_seed(0)
    net = Exploding().to(dev).half()
    probe = DispatchProbe(task="overflow", dump_path=f"{tmp}/ovf", model=net)
    where = "not detected"
    try:
        with probe:
            net(torch.randn(8, 64, device=dev, dtype=torch.half) * 4).float().sum().backward()
    except OverflowDetected as err:
        where = str(err)[:120]
    probe.close()
    rows.append(("overflow localised (fp16)", where))
    rows.extend(device_syncs(dev, tmp))
    rows.extend(fused_stats_rows(dev))
    rows.extend(window_rows(dev, tmp))
    return rows


def window_rows(dev, tmp, steps: int = 6) -> list[tuple[str, str]]:
    """The statistics task with its windows (``torch/device_batch.py``: values copied at their op,
    reduced many per launch, read back without waiting) against the per-value path
    (``device_batch.WINDOW = False``) on the small transformer's bf16 step: the same ops.jsonl
    bytes, the synchronisations ``torch.cuda.set_sync_debug_mode`` reports inside the probed
    forward and backward (the step's flush outside), and the host time per step beside
    torch's DebugMode, modes interleaved. On the CPU (a smoke run) the accelerator path runs on
    the host (``device_batch.HOST_AS_DEVICE``) and nothing counts synchronisations."""
    import warnings
    from dispatchprobe.torch import device_batch
    cuda = dev == "cuda"
    device_batch.HOST_AS_DEVICE = dev == "cpu"
    size, batch = SIZES["small"] if dev != "cpu" else (dict(vocab=128, dim=32, heads=4, layers=2, seq=16), 4)
    torch.manual_seed(0)
    model = TinyTransformer(**size).to(dev)
    tokens, targets = (t.to(dev) for t in lm_batch(batch=batch, seq=size["seq"], vocab=size["vocab"]))

    def step():
        with torch.autocast(dev, dtype=torch.bfloat16):
            loss = lm_loss(model, tokens, targets)
        loss.backward()

    probes = {on: DispatchProbe(task="statistics", dump_path=f"{tmp}/window-{on}", model=model) for on in (True, False)}
    try:
        from torch.utils._debug_mode import DebugMode
    except ImportError:
        DebugMode = None
    times = collections.defaultdict(list)
    syncs = collections.Counter()
    for i in range(steps + 2):
        for label in ("windows", "per value", "DebugMode", "unprobed"):
            on = label == "windows"
            if label in ("windows", "per value"):
                device_batch.WINDOW = on
                ctx = probes[on]
            elif label == "DebugMode" and DebugMode is not None:
                ctx = DebugMode()
            else:
                ctx = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
            sync(dev)
            t0 = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if cuda:
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    with ctx:
                        step()
                finally:
                    if cuda:
                        torch.cuda.set_sync_debug_mode("default")
            if label in ("windows", "per value"):
                probes[on].step()          # the step's flush: one wait, outside the count
            sync(dev)
            if i >= 2:
                times[label].append(time.perf_counter() - t0)
                syncs[label] += sum("synchroniz" in str(w.message) for w in caught)
            model.zero_grad(set_to_none=True)
    device_batch.WINDOW, device_batch.HOST_AS_DEVICE = True, False
    for p in probes.values():
        p.close()
    same = all(open(a, "rb").read() == open(b, "rb").read() for a, b in zip(
        sorted(glob.glob(f"{tmp}/window-True/step*/rank*/ops.jsonl")),
        sorted(glob.glob(f"{tmp}/window-False/step*/rank*/ops.jsonl"))))
    base = statistics.median(times["unprobed"])
    return [("statistics windows: ops.jsonl the per-value path's, byte for byte", str(same)),
            (f"synchronisations per probed step (sync debug mode, {steps} steps)",
             ", ".join(f"{k} {syncs[k] / steps:.1f}" for k in ("windows", "per value", "unprobed"))
             if cuda else "n/a (counted on cuda)"),
            ("step time vs unprobed (median, interleaved)",
             ", ".join(f"{k} {statistics.median(v) / base:.2f}x" for k, v in times.items() if k != "unprobed"))]


def fused_stats_rows(dev) -> list[tuple[str, str]]:
    """The one-launch statistics kernel against the CPU record of the same values, bit for bit
    (nan/inf, sizes across its one-chunk limit, non-contiguous), and its cost per tensor beside
    torch's operations."""
    import math
    import numpy as np
    from dispatchprobe.standards import statistics as st
    from dispatchprobe.torch import tensor_backend as backend, device_stats
    if not device_stats.available(torch.empty(1, device=dev)):
        return [("one-launch statistics kernel", "not available here (torch's reductions are used)")]
    torch.manual_seed(0)
    cases = [torch.randn(n, device=dev).to(dt) * 3 for dt in (torch.float32, torch.bfloat16, torch.float16,
                                                                 torch.float64)
             for n in (1, 7, 1024, 65536, 65537, 1_000_003)]
    x = torch.randn(3000, device=dev)
    x[5], x[7] = float("nan"), float("inf")
    y = torch.randn(200_000, device=dev)
    y[-1] = float("-inf")
    cases += [x, y, torch.tensor([float("inf"), float("-inf")], device=dev),
              torch.full((3,), float("nan"), device=dev), torch.full((80_000,), -3.4e38, device=dev),
              torch.randn(64, 48, device=dev).t()]
    bad, wrong_cases = [], 0
    for x in cases:
        before = len(bad)
        seq, repeat = backend._sequence(x)
        got = backend.read_stats_rows([device_stats.row(seq, repeat)], [x.numel()])[0]
        ref = backend._cpu_stats(x.cpu())          # the same values' record on the CPU: bit for bit
        for k, want in ref.items():
            have = got.get(k)
            if not (have == want or (math.isnan(have) and math.isnan(want))):
                bad.append(f"{x.dtype}/{x.numel()}/{k}: {have} vs {want}")
        if set(got) != set(ref):
            bad.append(f"{x.dtype}/{x.numel()}: keys {sorted(got)} vs {sorted(ref)}")
        wrong_cases += len(bad) > before
    t = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    cost = {}
    for label, fn in (("one launch", device_stats.row), ("torch's operations", backend.torch_stats_row)):
        for _ in range(50):
            fn(t)
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(2000):
            fn(t)
        sync(dev)
        cost[label] = (time.perf_counter() - t0) / 2000 * 1e6
    return [("one-launch statistics kernel vs the CPU record, bit for bit",
             f"{len(cases) - wrong_cases}/{len(cases)} agree"
             + (f"; {bad[:3]}" if bad else "")),
            ("statistics row per tensor (4096 bf16), host time",
             ", ".join(f"{k} {v:.1f} us" for k, v in cost.items()))]


SYNC_CALLS = ("Synchronize", "cudaMemcpy", "aclrtSynchronize", "aclrtMemcpy")   # blocking host<->device waits


def device_syncs(dev, tmp) -> list[tuple[str, str]]:
    """The statistics task must never wait for the device per op: count the runtime calls that
    block the host (stream/device synchronisations, memcpy to host) inside one probed forward and
    backward, beside the same step unprobed. The step's flush (``probe.step()``) is outside."""
    if dev != "cuda":
        return [("host-blocking device calls per step", "n/a (profiler count needs cuda)")]
    from torch.profiler import ProfilerActivity, profile
    torch.manual_seed(0)
    model = TinyTransformer().to(dev)
    tokens, targets = (t.to(dev) for t in lm_batch(batch=8, seq=32, vocab=128))
    rows = []
    for task in (None, "statistics", "overflow"):
        probe = DispatchProbe(task=task, dump_path=f"{tmp}/sync-{task}", model=model) if task else None
        for warm in (True, False):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                with probe if probe is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                    with torch.autocast(dev, dtype=torch.bfloat16):
                        loss = lm_loss(model, tokens, targets)
                    loss.backward()
            if probe is not None:
                probe.step()
            model.zero_grad(set_to_none=True)
        blocking = collections.Counter()
        for ev in prof.events():
            if any(k in ev.name for k in SYNC_CALLS) and "Async" not in ev.name:
                blocking[ev.name] += 1
        if probe is not None:
            probe.close()
        rows.append((f"host-blocking device calls in one step, {task or 'unprobed'}",
                     f"{sum(blocking.values())} {dict(blocking) if blocking else ''}"))
    return rows


SIZES = {"small": (dict(vocab=4096, dim=512, heads=8, layers=6, seq=256), 16),
         "large": (dict(vocab=8192, dim=2048, heads=16, layers=8, seq=1024), 8)}


def timings(dev, steps, tmp, size_name="small") -> list[tuple[str, float]]:
    size, batch = SIZES[size_name]
    torch.manual_seed(0)
    model = TinyTransformer(**size).to(dev)
    tokens, targets = lm_batch(batch=batch, seq=size["seq"], vocab=size["vocab"])
    tokens, targets = tokens.to(dev), targets.to(dev)

    def step():
        with torch.autocast(dev, dtype=torch.bfloat16):
            loss = lm_loss(model, tokens, targets)
        loss.backward()

    class Null:
        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    modes = {"uninstrumented": lambda: (Null(), None)}
    probes = {}
    for label, kw in {"statistics": dict(task="statistics"), "tensor": dict(task="tensor"),
                      "overflow": dict(task="overflow", overflow_nums=-1),
                      "free_benchmark improve_precision": dict(task="free_benchmark"),
                      "improve_precision, no TF32 re-runs": dict(task="free_benchmark"),
                      "free_benchmark add_noise": dict(task="free_benchmark", pert_mode="add_noise")}.items():
        probes[label] = DispatchProbe(dump_path=f"{tmp}/t-{label.replace(' ', '-')}", model=model, **kw)
        modes[label] = lambda p=probes[label]: (p, p.step)
    # the float32 re-runs of bf16 GEMMs in plain float32 (what TF32 saves; same flags expected)
    probes["improve_precision, no TF32 re-runs"].handlers[0]._tf32_ok = lambda ins: False
    try:
        from torch.utils._debug_mode import DebugMode
        modes["torch DebugMode"] = lambda: (DebugMode(), None)
    except ImportError:
        pass
    times = {k: [] for k in modes}
    for i in range(steps + 2):
        for label, make in modes.items():
            ctx, end = make()
            sync(dev)
            t0 = time.perf_counter()
            with ctx:
                step()
            if end:
                end()
            sync(dev)
            if i >= 2:
                times[label].append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
    for label, p in probes.items():
        h = p.handlers[0]
        p.close()
        if hasattr(h, "flagged"):
            flagged, worst = collections.Counter(), {}
            for path in glob.glob(f"{tmp}/t-{label.replace(' ', '-')}/step*/rank*/free_benchmark.csv"):
                with open(path, newline="") as f:
                    for r in csv.DictReader(f):
                        key = f"{r['op']} {r['scope']} ({r['dtype']})"
                        flagged[key] += 1
                        worst[key] = max(worst.get(key, (0, 0)), (float(r["max_rel"]), float(r["threshold"])))
            print(f"  {label}: {h.flagged} flagged / {h.checked} checked over {steps + 2} steps")
            for key, n in flagged.most_common(8):
                print(f"      {n} x {key}: max_rel up to {worst[key][0]:.3g} (limit {worst[key][1]:.3g})")
    return [(k, statistics.median(v)) for k, v in times.items()]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--large", action="store_true", help="a GPU-bound transformer for the timings")
    parser.add_argument("--timings-only", action="store_true", help="skip the table of checks")
    parser.add_argument("--windows-only", action="store_true",
                        help="only the statistics windows against the per-value path (records, syncs, step time)")
    args = parser.parse_args()
    size_name = "large" if args.large else "small"
    size, batch = SIZES[size_name]
    dev = device_name()
    name = torch.cuda.get_device_name() if dev == "cuda" else dev
    print(f"device {dev} ({name}), torch {torch.__version__}\n")
    with tempfile.TemporaryDirectory() as tmp:
        if args.windows_only:
            for label, value in window_rows(dev, tmp, args.steps):
                print(f"  {label:58s} {value}")
            return
        if not args.timings_only:
            for label, value in checks(dev, tmp):
                print(f"  {label:58s} {value}")
        print(f"\nstep time, bf16 autocast transformer ({size}, batch {batch}):")
        rows = timings(dev, args.steps, tmp, size_name)
        base = rows[0][1]
        for label, t in rows:
            print(f"  {label:36s} {t * 1e3:9.2f} ms  {t / base:6.2f}x")


if __name__ == "__main__":
    main()
