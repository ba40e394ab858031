"""Where a recorded step's time goes: the statistics task's cost split into its parts, beside the
floor torch puts under every dispatch-mode tool (an empty ``TorchDispatchMode``) and DebugMode.

    python benchmarks/record_breakdown.py [--steps 8] [--quick] [--device cuda] [--cpu-time]

``--cpu-time``: one intra-op thread, and every time is the CPU time of the thread running the
steps (``time.thread_time``): much less sensitive to other work on a shared machine.

Two measurements per model (a small transformer, an MLP, a transformers Llama; random init):

1. Timed steps, nothing wrapped, the modes one step at a time in rounds: median step time
   uninstrumented, under an empty ``TorchDispatchMode`` (its ``__torch_dispatch__`` only calls the
   op: what torch itself costs a mode per op), under that mode reading each new value once with
   the probe's kernel (the floor of any statistics recorder: no records), under ``DebugMode`` and
   under ``DispatchProbe(task="statistics")``.
2. Separate steps with the probe's parts wrapped in timers (exclusive time: a part's time leaves
   out the parts it calls), per step: module scopes (the forward hooks), the compiled value
   encoder's calls (describing, cache and kernel for the tensors it takes, and the record's JSON
   line and its write where it makes the whole record), then, for the tensors it hands back and the in-place
   stand-ins, describing tensors, looking values up in the cache,
   the statistics kernel (one pass over each new value) and the Python around it, building the record, writing it (one JSON line, one ``write`` call), and the
   per-op bookkeeping (filters, scope, call index, the event), which is the probe's added time
   (1.) less the floor and the other parts.  Each timer costs about half a microsecond, left out
   by scaling the parts to the added time measured in 1.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import record_overhead as overhead
from dispatchprobe import DispatchProbe
from dispatchprobe.core import recorder
from dispatchprobe.torch import tensor_backend as backend, fused_stats, module_scopes, ops

def parts(probe) -> list:
    """(label, owner, attribute) of the probe's parts; "statistics kernel" wraps the native call
    itself (and the accelerator kernel's launch)."""
    return [
        ("module scopes", module_scopes, "_module_entered"),
        ("module scopes", module_scopes, "_module_left_globally"),
        ("module scopes", module_scopes, "_module_left"),
        ("describing tensors", probe.recorder, "_describe"),
        ("value cache", recorder.Recorder, "_fill_tensors"),
        ("value cache", recorder.Recorder, "_measured"),
        ("statistics (Python)", backend, "tensor_stats"),
        ("statistics kernel", fused_stats, "tree_rows"),
        ("statistics kernel", fused_stats, "described_rows"),
        ("statistics kernel", backend, "device_stats_row"),
        ("building the record", recorder.Recorder, "_record"),
        ("writing", recorder.Recorder, "emit"),
    ]


clock = time.perf_counter

ORDER = ["torch's dispatch floor", "module scopes", "describing tensors", "value cache", "statistics kernel",
         "statistics (Python)", "building the record", "writing", "per-op bookkeeping"]


class EmptyMode(TorchDispatchMode):
    """A dispatch mode that only runs the op: the floor under every dispatch-mode tool."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class ReadingFloor(TorchDispatchMode):
    """An empty mode that also reads each value an op writes (the outputs of every op but views)
    once, with the probe's one-pass kernel: the least a statistics recorder does (no record, no
    cache, no scopes), so what it costs over the empty mode is the reading itself."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not ops.is_alias(func):
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                    one_pass = fused_stats.stats4 is not None and t.is_cpu \
                        and t.dtype in (torch.float32, torch.bfloat16)
                    fused_stats.stats4(t) if one_pass else torch.aminmax(t)
        return out


class Timers:
    """Exclusive wall time per label of the wrapped functions (a stack of running timers)."""

    def __init__(self):
        self.spent: dict[str, float] = {}
        self._stack: list[list] = []
        self._undo: list = []

    def wrap(self, label: str, owner, attr: str) -> None:
        original = getattr(owner, attr)
        if original is None:                 # the kernel was not built here
            return
        stack, spent = self._stack, self.spent

        @functools.wraps(original)
        def timed(*args, **kwargs):
            frame = [label, 0.0]             # label, time of the wrapped parts it called
            stack.append(frame)
            start = clock()
            try:
                return original(*args, **kwargs)
            finally:
                took = clock() - start
                stack.pop()
                spent[label] = spent.get(label, 0.0) + took - frame[1]
                if stack:
                    stack[-1][1] += took

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, original))

    def unwrap(self) -> None:
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)
        self._undo.clear()


def breakdown(case, steps: int, tmp: str) -> dict:
    name, model, step = case
    probe = DispatchProbe(task="statistics", dump_path=f"{tmp}/{name}", model=model)
    from torch.utils._debug_mode import DebugMode
    wraps = {"uninstrumented": lambda i: (overhead._Null(), lambda: None),
             "empty dispatch mode": lambda i: (EmptyMode(), lambda: None),
             "empty mode + one read of each new value": lambda i: (ReadingFloor(), lambda: None),
             "torch DebugMode": lambda i: (DebugMode(), lambda: None),
             "dispatchprobe statistics": lambda i: (probe, probe.step)}
    times = {k: statistics.median(v) for k, v in overhead.interleaved(model, step, steps, wraps).items()}
    timers = Timers()
    for label, owner, attr in parts(probe):
        timers.wrap(label, owner, attr)
    try:
        with probe:                 # one untimed step first: a one-off cost lands in no part
            step()
        probe.step()
        model.zero_grad(set_to_none=True)
        timers.spent.clear()
        total = 0.0
        for _ in range(steps):
            overhead.sync()
            start = clock()
            with probe:
                step()
            probe.step()
            overhead.sync()
            total += clock() - start
            model.zero_grad(set_to_none=True)
    finally:
        timers.unwrap()
        probe.close()
    spent = {label: v / steps for label, v in timers.spent.items()}
    floor = times["empty dispatch mode"] - times["uninstrumented"]
    added = times["dispatchprobe statistics"] - times["uninstrumented"]
    # the wrapped steps took longer by the timers' own cost: the parts are scaled to the added time
    instrumented = total / steps - times["uninstrumented"]
    scale = added / instrumented if instrumented > 0 else 1.0
    spent = {label: v * scale for label, v in spent.items()}
    spent["torch's dispatch floor"] = floor
    spent["per-op bookkeeping"] = added - sum(spent.values())
    return {"name": name, "times": times, "parts": spent, "added": added}


def print_result(res: dict) -> None:
    times, base = res["times"], res["times"]["uninstrumented"]
    print(f"{res['name']}:")
    for label, t in times.items():
        print(f"  {label:28s} {t * 1e3:9.2f} ms {t / base:6.2f}x")
    print(f"  what the probe adds ({res['added'] * 1e3:.1f} ms per step):")
    for label in ORDER:
        v = res["parts"].get(label, 0.0)
        print(f"    {label:26s} {v * 1e3:8.2f} ms {v / res['added'] * 100 if res['added'] > 0 else 0:5.1f} %")
    print()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="smaller models (for smoke runs)")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, ...: where the steps run")
    parser.add_argument("--cpu-time", action="store_true", help="one thread, CPU time of the stepping thread")
    args = parser.parse_args()
    overhead.DEVICE = args.device
    global clock
    if args.cpu_time:
        torch.set_num_threads(1)
        clock = overhead.clock = time.thread_time
    fused_stats.build_native()
    torch.manual_seed(0)
    print(f"device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.steps} timed steps per mode\n")
    with tempfile.TemporaryDirectory(prefix="dp-breakdown-") as tmp:
        for make in (overhead.transformer_case, overhead.mlp_case, overhead.llama_case):
            print_result(breakdown(make(args.quick), args.steps, tmp))


if __name__ == "__main__":
    main()
