"""Cost of the inline checks on a transformer training step (forward + backward).

uninstrumented vs ``task="overflow"`` vs ``task="free_benchmark"`` with each ``pert_mode`` on
every op (check handler, fuzz_stage forward), all timed in the same run, interleaved step by
step.  Prints median seconds per step and the ratio to uninstrumented.

    python benchmarks/inline_checks.py [--steps 5] [--quick] [--dtype float32|bfloat16] [--threads N]
        [--modes overflow,add_noise,...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
from record_overhead import _Null, interleaved  # noqa: E402

from dispatchprobe import DispatchProbe  # noqa: E402
from dispatchprobe.models import TinyTransformer, lm_batch, lm_loss  # noqa: E402

MODES = ("improve_precision", "improve_precision+fp64", "bit_noise", "add_noise", "change_value", "no_change",
         "to_cpu")       # +fp64: widen_float32=True (float32 ops re-run in float64; not in msprobe)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--modes", default="", help="comma-separated subset: overflow and/or pert_modes")
    opts = ap.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    chosen = set(filter(None, opts.modes.split(","))) or {"overflow", *MODES}
    kw = dict(vocab=512, dim=128, heads=4, layers=2, seq=64) if opts.quick else \
        dict(vocab=1024, dim=256, heads=8, layers=4, seq=128)
    torch.manual_seed(0)
    model = TinyTransformer(**kw).to(getattr(torch, opts.dtype))
    tokens, targets = lm_batch(batch=8, seq=kw["seq"], vocab=kw["vocab"])

    def step():
        lm_loss(model, tokens, targets).backward()

    tmp = tempfile.mkdtemp(prefix="inline-checks-")
    wraps = {"uninstrumented": lambda i: (_Null(), lambda: None)}
    probes = {}
    if "overflow" in chosen:
        probes["overflow"] = DispatchProbe(task="overflow", dump_path=os.path.join(tmp, "overflow"), model=model)
    for mode in (m for m in MODES if m in chosen):
        pert_mode, _, fp64 = mode.partition("+")
        probes[f"free_benchmark {mode}"] = DispatchProbe(
            task="free_benchmark", dump_path=os.path.join(tmp, mode), model=model, pert_mode=pert_mode,
            fuzz_device="cpu" if mode == "to_cpu" else "same", widen_float32=bool(fp64))
    for label, probe in probes.items():
        wraps[label] = lambda i, probe=probe: (probe, probe.step)
    times = interleaved(model, step, opts.steps, wraps)
    base = statistics.median(times["uninstrumented"])
    print(f"transformer step {kw}, {opts.dtype}, {torch.get_num_threads()} threads, {opts.steps} steps")
    print(f"{'mode':40s} {'median s':>9s} {'ratio':>7s} {'flagged/checked':>16s}")
    for label, ts in times.items():
        med = statistics.median(ts)
        extra = ""
        if label in probes:
            h = probes[label].handlers[0]
            if hasattr(h, "flagged"):
                extra = f"{h.flagged}/{h.checked}"
                if getattr(h, "not_widened", 0):
                    extra += f" ({h.not_widened} fp32 left)"
            else:
                extra = f"{h.found} critical"
            probes[label].close()
        print(f"{label:40s} {med:9.4f} {med / base:6.2f}x {extra:>16s}")


if __name__ == "__main__":
    main()
