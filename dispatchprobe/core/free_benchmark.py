"""``task="free_benchmark"``: re-run each selected op on perturbed inputs, no reference run.

The handler gets every op after it ran (the probe's mode is popped and ``no_grad`` is on, so
nothing it does is recorded), re-runs ``event.func`` on what the perturbation of ``pert_mode``
(:mod:`.perturbations`, msprobe's names) makes of the inputs, and measures the change with
:func:`dispatchprobe.standards.metrics.perturbation_terms` on the tensors' device.

An output is flagged when its change exceeds msprobe's threshold for its dtype
(``data/standards.yaml``); for the noise modes also ``NOISE_GAIN`` eps of the input dtype (a
well-conditioned op moves about as much as its inputs: only amplification is a finding); for
modes whose two results are both rounded to the output dtype also 2 eps of that dtype.  With
``fuzz_stage="backward"`` forward ops are re-run with autograd on and the input gradients for
one seeded random output gradient are compared.

Random ops (dropout, bernoulli, anything with a ``generator``) are never re-run.  In ``check``
mode the training run's values are never touched: perturbations are copies.  See docs/inline-checks.md.
"""

from __future__ import annotations

import csv
import functools
import itertools
import os
import warnings
from collections import defaultdict

from ..standards.loader import per_dtype
from . import op_traits
from .events import Handler, OpEvent
from .perturbations import PERTURBATIONS

NOISE_GAIN = 16.0
_WINDOW_BYTES = 64 << 20    # accelerator: tensor bytes kept before they are measured together
_WINDOW_OPS = 512           # ... and checked ops
CSV_COLUMNS = ("rank", "pert_mode", "stage", "step", "api_name", "max_rel", "dtype", "shape", "output_index",
               "threshold", "sign_flips", "scope", "op", "id")
_WIDER = {"float16": "float32", "bfloat16": "float32"}
_WIDER_FLOAT32 = {**_WIDER, "float32": "float64"}


class FreeBenchmarkHandler(Handler):
    def __init__(self, session, recorder):
        self.session = session
        self.recorder = recorder
        self.backend = b = session.backend
        self.cfg = cfg = session.config.free_benchmark
        self.mode = cfg.pert_mode
        self.perturbation = PERTURBATIONS[cfg.pert_mode]
        self.fix = cfg.handler_type == "fix"
        self.gen = b.generator(cfg.seed)
        self.noise = b.noise_source(cfg.seed)
        self._csv = None
        self._sampled: dict = defaultdict(int)       # op -> calls checked in this step (preheat)
        self._suspects: set[str] = set()             # ops flagged during preheat
        self.checked = self.flagged = self.skipped = 0
        self.not_widened = 0                         # improve_precision: float32-only ops left alone
        self.not_judged = 0                          # calls whose change under this perturbation measures nothing
        self._told_float32 = False
        self._limits: dict = {}                      # (output dtype, input dtypes) -> limit
        self.wider = _WIDER_FLOAT32 if cfg.widen_float32 else _WIDER
        self.scratch = b.scratch()                   # CPU temporaries of one op's check
        self._pending: list = []                     # accelerator: (event, stage, slots, inputs, versions)
        self._pairs: dict = {}                       # small value -> ([re-run/original], [reference], [limit])
        self._pending_bytes = 0
        self.defer = False                           # read back in windows (accelerators always; tests on CPU)

    def _sample(self, event: OpEvent) -> bool:
        if not self.cfg.if_preheat:
            return True
        if self.session.step_no < self.cfg.preheat_step:
            n = self._sampled[event.op]
            self._sampled[event.op] = n + 1
            return n < self.cfg.max_sample
        return event.op in self._suspects

    def on_op(self, event: OpEvent):
        func = event.func
        b = self.backend
        if event.kind != "op" or func is None or b.is_random(func):
            return None
        if self.cfg.fuzz_stage == "backward" and event.stage != "forward":
            return None
        outs = b.float_outputs(event.outputs)
        if not outs:
            return None
        ins = b.float_tensors((event.args, event.kwargs))
        if not ins or not self._sample(event):
            return None
        if self.perturbation.noise and op_traits.steps(event.op):
            self.not_judged += 1        # nudged inputs move a step function's output by whole steps
            return None
        self.scratch.reset()
        try:
            if self.cfg.fuzz_stage == "backward":
                self._check_backward(event, outs, ins)
                return None
            return self._check_forward(event, outs, ins)
        except Exception:      # an op that cannot take the perturbation (dtype/device support)
            self.skipped += 1
            return None

    def _check_forward(self, event: OpEvent, outs, ins):
        b = self.backend
        plan = self.perturbation.fn(self, event, ins)
        if plan is None:
            return None
        args, kwargs, fixup = plan
        args, kwargs = b.protect_written(event.func, args, kwargs, event.args, event.kwargs)
        result = b.run(event.func, args, kwargs, b.device_type(outs[0][1]), tf32=self._tf32_ok(ins))
        if fixup is not None:
            result = fixup(result)
        new = dict(b.float_outputs(result))
        self.checked += 1
        pairs = []
        for index, orig in outs:
            other = new.get(index)
            if other is not None and b.shape(other) == b.shape(orig):
                a, e = (orig, other) if self.perturbation.rerun_is_reference else (other, orig)
                pairs.append((index, a, e, self._limit(ins, orig)))
        self._judge(event, event.stage, pairs, outs, ins)
        if self.fix and not b.returns_alias(event.func):
            return b.replacement(event.outputs, result)
        return None

    def _tf32_ok(self, ins) -> bool:
        """improve_precision with only 16-bit float inputs: the float32 re-run may use TF32 on
        CUDA without loss (products of 16-bit values are exact in TF32)."""
        return self.mode == "improve_precision" and all(self.backend.dtype_of(t) in _WIDER for t in ins)

    def _limit(self, ins, out) -> float:
        dtype = self.backend.dtype_of
        key = (dtype(out), *{dtype(t) for t in ins}) if self.perturbation.noise else dtype(out)
        limit = self._limits.get(key)
        if limit is None:
            b = self.backend
            limit = per_dtype("free_benchmark_threshold", dtype(out))
            if self.mode != "improve_precision":
                # both sides rounded to the output dtype: one rounding step apart is not a finding
                # (msprobe's bfloat16 threshold 0.004 is below bfloat16's own eps, 0.0078)
                limit = max(limit, 2 * b.eps(dtype(out)))
            if self.perturbation.noise:
                limit = max(limit, NOISE_GAIN * max(b.eps(dtype(t)) for t in ins))
            self._limits[key] = limit
        return limit

    def _check_backward(self, event: OpEvent, outs, ins) -> None:
        b = self.backend
        plan = self.perturbation.fn(self, event, ins)
        if plan is None:
            return
        p_args, p_kwargs, fixup = plan
        device = b.device_type(outs[0][1])
        base = b.input_grads(event.func, event.args, event.kwargs, None, self.gen, device)
        if base is None:
            return
        grads, grad_outs = base
        if self.perturbation.reorders:      # perturbed inside the differentiated call (see the flag)
            other = b.input_grads(event.func, event.args, event.kwargs, grad_outs, self.gen, device,
                                  perturb=lambda a, k: self.perturbation.fn(self, event.with_call(a, k), ins))
        else:                               # the same inputs differentiated as in the base call
            other = b.input_grads(event.func, p_args, p_kwargs, grad_outs, self.gen, device, fixup,
                                  training_call=(event.args, event.kwargs))
        if other is None:
            return
        self.checked += 1
        pairs = []
        for index, (g0, g1) in enumerate(zip(grads, other[0])):
            if g0 is not None and g1 is not None and b.shape(g0) == b.shape(g1):
                a, e = (g0, g1) if self.perturbation.rerun_is_reference else (g1, g0)
                pairs.append((index, a, e, self._limit(ins, g0)))
        self._judge(event, "backward", pairs, outs, ins)

    def _judge(self, event: OpEvent, stage: str, pairs, outs, ins) -> None:
        """Measure each (output index, re-run/original, reference, limit) of the op's float
        outputs ``outs`` (``backend.float_outputs``) and report the worst output over its
        limit.  On CPU at once, after the cheap ``backend.surely_within`` screen.  On an
        accelerator the pairs are kept until ``_WINDOW_BYTES`` or ``_WINDOW_OPS`` ops have
        gathered or the region ends, then screened and measured together on the device
        (:meth:`_resolve`): two host syncs per window, none per op."""
        if not pairs:
            return
        b = self.backend
        if b.on_host(pairs[0][1]) and not self.defer:
            measured = []
            for index, a, e, limit in pairs:
                small = _small(b.dtype_of(a))
                if not b.surely_within(a, e, limit, small, self.scratch):
                    a, e = self._at_range_edge(a, e)
                    measured.append((index, limit, *b.read(b.changes([a], [e], small))[0]))
            self._report_worst(event, stage, measured)
            return
        # Measured training outputs are copied (they may be written in place before the window
        # is read), the others kept as detached aliases; never the output objects: autograd
        # steals a gradient into .grad only when nobody else holds it.  Re-run results are kept
        # as they are unless they alias the perturbed inputs (CPU scratch, reused by the next op).
        measured_ids = {id(t) for _, a, e, _ in pairs for t in (a, e)}
        copies = {id(t): b.clone(t) if id(t) in measured_ids else b.detach(t)
                  for _, t in outs}
        kept = event.with_outputs(b.swap_tensors(event.outputs, copies))
        alias = b.returns_alias(event.func)
        slots = []
        for index, a, e, limit in pairs:
            small = _small(b.dtype_of(a))
            a, e = (copies[id(t)] if id(t) in copies else b.clone(t) if alias else t for t in (a, e))
            e = b.to_device_of(e, a)         # to_cpu: the CPU reference joins the device's window
            group = self._pairs.setdefault(small, ([], [], []))
            group[0].append(a)
            group[1].append(e)
            group[2].append(limit)
            slots.append((index, limit, small, len(group[0]) - 1))
            self._pending_bytes += b.nbytes(a) + b.nbytes(e)
        self._pending.append((kept, stage, slots, ins, b.versions(ins)))
        if self._pending_bytes >= _WINDOW_BYTES or len(self._pending) >= _WINDOW_OPS:
            self._resolve()

    def _resolve(self) -> None:
        pending, pairs = self._pending, self._pairs
        self._pending, self._pairs, self._pending_bytes = [], {}, 0
        if not pending:
            return
        # Two read-backs per window: which pairs a float32 screen clears, then the float64
        # measure of the others (what is reported is always the float64 measure).
        b = self.backend
        smalls = list(pairs)
        cleared = iter(b.read(b.concat([b.within_limits(*pairs[small], small) for small in smalls])))
        todo = {small: [k for k in range(len(pairs[small][0])) if not next(cleared)] for small in smalls}
        edged = {s: [self._at_range_edge(pairs[s][0][k], pairs[s][1][k]) for k in todo[s]] for s in smalls}
        parts = [b.changes([a for a, _ in edged[s]], [e for _, e in edged[s]], s) for s in smalls if todo[s]]
        measured = iter(b.read(b.concat(parts)) if parts else [])
        values: list = []
        for small in smalls:
            row = [(0.0, 0.0)] * len(pairs[small][0])          # cleared: within the limit
            for k in todo[small]:
                row[k] = next(measured)
            values += row
        base = dict(zip(smalls, itertools.accumulate([0] + [len(pairs[s][0]) for s in smalls])))
        for event, stage, slots, ins, seen in pending:
            self._report_worst(event, stage, [(index, limit, *values[base[small] + k])
                                              for index, limit, small, k in slots],
                               stale=b.versions(ins) != seen)

    def _at_range_edge(self, a, e):
        """The pair to measure.  Under the noise modes both sides saturated at the dtype's finite
        range: an output within an eps of the range's edge (a mask constant ``finfo.min`` scaled or
        shifted) goes to inf when its inputs are nudged, which is no amplification of the nudge,
        while an output far from the edge that overflows still measures huge."""
        if not self.perturbation.noise:
            return a, e
        return self.backend.saturated(a), self.backend.saturated(e)

    def _report_worst(self, event: OpEvent, stage: str, measured, stale: bool = False) -> None:
        over = [m for m in measured if m[2] > m[1]]
        if over:
            index, limit, max_rel, flips = max(over, key=lambda m: m[2])
            self._report(event, stage, index, {"max_rel": max_rel, "sign_flips": int(flips)}, limit, stale)

    def flush(self) -> None:
        self._resolve()
        if self.checked == 0 and self.not_widened and not self._told_float32:
            self._told_float32 = True       # an empty free_benchmark.csv must not read as "all clean"
            warnings.warn(f"free_benchmark: improve_precision re-ran none of {self.not_widened} op calls: none had "
                          "a float16/bfloat16 input; set free_benchmark.widen_float32=true to check float32 ops "
                          "against float64", stacklevel=2)

    def _report(self, event: OpEvent, stage: str, index: int, change: dict, limit: float,
                stale: bool = False) -> None:
        """One CSV row and one op record.  ``stale``: an input was written in place between
        the op and the read-back of its window -- its values are no longer the op's, so no
        tensors are saved and the record says so (run-ut skips it with that reason)."""
        self.flagged += 1
        if self.cfg.if_preheat and self.session.step_no < self.cfg.preheat_step:
            self._suspects.add(event.op)
        b = self.backend
        first = b.float_tensors((event.args, event.kwargs))[0]
        multi = (stage == "backward" and event.stage == "forward") or isinstance(event.outputs, (tuple, list))
        record = self.recorder.encode(event, save=not stale)
        if stale:
            record["inputs_overwritten"] = True
        record["free_benchmark"] = {"pert_mode": self.mode, "stage": stage, "max_rel": change["max_rel"],
                                    "threshold": limit, "sign_flips": change["sign_flips"],
                                    "output_index": index, "handler_type": self.cfg.handler_type}
        self.recorder.write(record)
        row = {"rank": self.session.rank, "pert_mode": self.mode, "stage": stage, "step": self.session.step_no,
               "api_name": event.name, "max_rel": change["max_rel"], "dtype": b.dtype_of(first),
               "shape": str(tuple(b.shape(first))), "output_index": index if multi else "",
               "threshold": limit, "sign_flips": change["sign_flips"], "scope": event.scope, "op": event.op,
               "id": record["id"]}
        if self._csv is None:
            path = os.path.join(self.session.part_dir, "free_benchmark.csv")
            new = not os.path.exists(path)
            self._csv = open(path, "a", newline="", encoding="utf-8")
            self._writer = csv.DictWriter(self._csv, fieldnames=CSV_COLUMNS, lineterminator="\n")
            if new:
                self._writer.writeheader()
        self._writer.writerow(row)
        self._csv.flush()

    def start_part(self) -> None:
        self._sampled.clear()
        if self._csv is not None:
            self._csv.close()
            self._csv = None

    def summary(self) -> dict:
        return {"checked": self.checked, "flagged": self.flagged, "skipped": self.skipped,
                "not_widened": self.not_widened, "not_judged": self.not_judged}

    def close(self) -> None:
        self._pending, self._pairs, self._pending_bytes = [], {}, 0
        if self._csv is not None:
            self._csv.close()
            self._csv = None


@functools.lru_cache(maxsize=None)
def _small(dtype: str) -> float:
    return per_dtype("small_value", dtype)
