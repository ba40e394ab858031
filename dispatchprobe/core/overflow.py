"""``task="overflow"``: find the op that first produced inf/nan, forward and backward.

Each checked op's floating outputs are reduced to their squared L2 norm accumulated in float32
(finite exactly when the tensor is, barring overflow of the squares, which is re-checked); input
norms mostly come from a cache of earlier outputs.  On an accelerator the norms stay on the
device and are read back every ``_WINDOW`` ops or at the end of the region (no sync per op).

Classes (msprobe's): ``critical`` (finite inputs, inf/nan output: recorded with its tensors and
replayed on CPU in float64, ``inherent`` or ``precision``), ``propagated`` (inf/nan in and out;
a non-finite Python scalar input gives a summary row, no record) and ``suspicious growth``
(output norm > ``_GROWTH`` x the largest input norm).  The ``overflow_nums``-th critical op
raises :class:`OverflowDetected` (-1: never).  ``overflow.csv`` / ``overflow.json`` of the part
summarise the step.  See docs/inline-checks.md.

Dynamic loss scaling (``GradScaler``) lets backward passes overflow on purpose and skips those
optimizer steps.  While a loss scale is in use (a 0-dim scale multiplied into a 0-dim loss outside
any module, or the scaler's own ops seen), a backward critical op is *held* until the step shows
what became of it (:class:`LossScaleWatch`): ``expected`` when the step was skipped (the scaler's
``found_inf`` was set, or its scale backed off), else critical (``not caught``: the optimizer
stepped, or nothing skipped the step).  ``_SKIPS_IN_A_ROW`` skipped steps in a row are a
``scale collapse`` row, counted like a critical op.

An inf/nan is an overflow only where the program uses it: T5's relative-position buckets take
``log(0)`` on purpose and cast the ``-inf`` to integers that ``torch.where`` then replaces.  An
op autograd differentiates (a floating input requires grad) computes the training's own values:
one that makes or carries an inf/nan reports it at once.  Any other critical op is first
*held* (:class:`HeldOverflow`) while the memories carrying its inf/nan (its outputs, and the
outputs of ops that kept them) are followed by address (:class:`Carriers`); an op autograd
differentiates that reads them puts it in use at once.  At each check point (the end of the ``with`` block, an optimizer or the loss scaler about to read the
gradients) a held overflow whose carriers still live is in use: reported at the op that made it,
as critical.  One whose carriers were all freed after an op masked, clamped, compared or cast
them to integers is counted ``discarded`` and listed in ``overflow.json``, never raised; one
freed unread is reported (``.item()`` reads a value with no op the probe is given).  Only with
``check_mode="both"``, where every op that can read the value is checked.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os

from . import op_traits
from .events import Handler, OpEvent, has_nonfinite_scalar
from ..records.writer import atomic_write_text

_GROWTH = 100.0        # output/input norm ratio above which a finite op is "suspicious growth"
_WINDOW = 256          # accelerator: ops between host reads of the finiteness flags
_MAX_LIGHT = 100       # propagated / growth records kept per step (the rest are only counted)
_SKIPS_IN_A_ROW = 20   # steps skipped by the loss scaler in a row: the scale keeps collapsing
_READERS_NOTED = 4     # ops named per discarded overflow as having read its values

_TO_FLOAT64 = {"float16": "float64", "bfloat16": "float64", "float32": "float64"}
CSV_COLUMNS = ("step", "rank", "id", "class", "stage", "op", "name", "scope", "grad_fn", "call", "dtype",
               "nan", "inf", "growth", "replay", "float64_max_abs", "dtype_max", "exceeds_dtype_range", "loss_scale",
               "stack")


class OverflowDetected(RuntimeError):
    """Raised when ``overflow_nums`` overflows were found; the message names the op."""


class OverflowHandler(Handler):
    def __init__(self, session, recorder):
        self.session = session
        self.recorder = recorder
        cfg = session.config.overflow
        self.stages = {"forward", "backward"} if cfg.check_mode == "both" else {cfg.check_mode}
        self.limit = cfg.overflow_nums
        self.replay = cfg.replay
        self.found = 0                       # critical overflows so far (whole run)
        self.rows: list[dict] = []
        self.counts = {"critical": 0, "propagated": 0, "suspicious growth": 0, "expected": 0,
                       "scale collapse": 0, "discarded": 0}   # this step's (overflow.json)
        self.totals = dict(self.counts)      # the whole run's, for summary()
        self._cache: dict = {}               # identity -> (memory ref, squared norm tensor)
        self._pending: list = []             # accelerator: (event, outs, ins, norms on device)
        self._stop: OverflowDetected | None = None
        self._dirty = False                  # rows not yet in overflow.csv (written at flush)
        self.backend = session.backend
        self.checked = 0                     # ops checked (whole run)
        self.defer = False                   # read back in windows (accelerators always; tests on CPU)
        self.loss_scale = LossScaleWatch(self.backend)
        self.skips_in_a_row = _SKIPS_IN_A_ROW
        self._held: list = []                # backward critical ops waiting for the step's loss-scale verdict
        self.hold_unused = self.stages == {"forward", "backward"}   # every reader of a value is checked
        self._unused: list[HeldOverflow] = []   # critical ops not yet seen in use, in the order they ran
        self._carriers = Carriers(self.backend)
        self._passed_on_held = 0             # propagated rows waiting with them (at most _MAX_LIGHT)
        self.discarded: list[dict] = []      # this part's discarded overflows (overflow.json)

    # ---- per op ---------------------------------------------------------------------------------
    def on_op(self, event: OpEvent):
        if event.kind == "op" and self.loss_scale.sees(event):
            self._resolve()          # ops still on the device are judged (and held) before the verdict
            self._decide_unused()    # the scaler reads the gradients: what they carry is in use
            self._settle()
            self._raise_if_stopped()
            return None
        if event.stage not in self.stages or event.kind != "op":
            return None
        b = self.backend
        outs = b.float_outputs(event.outputs)
        if not outs:
            if self.hold_unused:
                self._reader_seen(event)
            return None
        ins = b.float_tensors((event.args, event.kwargs))
        norms = self._norms(outs, ins)
        self.checked += 1
        if b.on_host(outs[0][1]) and not self.defer:
            self._judge(event, outs, ins, b.read(norms))
        else:
            event.stack = event.stack or (b.user_stack() if event.stage == "forward" else None)
            # detached aliases, not the outputs themselves: autograd steals a gradient only when
            # nothing else holds that tensor object (else it copies: extra ops and memory)
            alias = {id(t): b.detach(t) for _, t in outs}
            kept = event.with_outputs(b.swap_tensors(event.outputs, alias))
            outs = [(i, alias[id(t)]) for i, t in outs]
            self._pending.append((kept, outs, ins, norms, b.versions(ins)))
            if len(self._pending) >= _WINDOW:
                self._resolve()
        if self._stop is not None:
            exc, self._stop = self._stop, None
            self.session.flush()
            raise exc
        return None

    def _raise_if_stopped(self) -> None:
        if self._stop is not None:
            exc, self._stop = self._stop, None
            raise exc

    # ---- loss scaling: the step's verdict on held backward overflows -------------------------------
    def optimizer_stepping(self) -> None:
        """An optimizer is about to step (the framework's global pre-hook): a step the loss scaler
        skipped never gets here, so what is still held was not caught."""
        self._resolve()
        self._decide_unused()
        self.loss_scale.stepped = True
        self._settle()
        if self._dirty:
            self._write_summary()
        self._raise_if_stopped()

    def loss_scale_seen(self, scale, found_inf) -> None:
        """The adapter recognised the framework's loss scaler: its scale (the watch is active from
        now: backward overflows are held) or its check's verdict (held overflows are decided)."""
        if scale is not None:
            self.loss_scale.use_scale(scale)
        if found_inf is not None:
            self._resolve()
            self._decide_unused()
            self.loss_scale.checked(found_inf)
            self._settle()
            if self._dirty:
                self._write_summary()
            self._raise_if_stopped()

    def boundary(self) -> None:
        """The user's code ran outside the probe (the next region starts, or the part closes):
        decide what is still held from the loss scale's state, then start the next step's watch."""
        self._decide_unused()
        self._settle(final=True)
        self.loss_scale.next_step()
        if self._dirty:
            self._write_summary()
        self._raise_if_stopped()

    def _settle(self, final: bool = False) -> None:
        """Once the step's verdict is known, the held backward overflows become ``expected`` (the
        step was skipped) or critical; the step that makes ``skips_in_a_row`` skips in a row adds
        a ``scale collapse`` row."""
        got = self.loss_scale.decide(final)
        if got is None:
            return
        (skipped, why), new = got
        held, self._held = self._held, []
        for rec, row, info in held:
            info["loss_scale"] = row["loss_scale"] = why
            if skipped:
                info["class"] = row["class"] = "expected"
            self._emit(rec, row, info["class"], info)
        if new and skipped and self.loss_scale.skips == self.skips_in_a_row:
            self._collapse()

    def _collapse(self) -> None:
        n, scale = self.loss_scale.skips, self.loss_scale.value
        row = {c: "" for c in CSV_COLUMNS}
        row.update({"step": self.session.step_no, "rank": self.session.rank, "class": "scale collapse",
                    "stage": "backward", "op": "loss scale",
                    "loss_scale": f"{n} steps in a row skipped for inf/nan gradients"
                                  + (f" (scale now {scale:g})" if scale is not None else "")})
        self._emit(None, row, "scale collapse", None)

    def flush(self) -> None:
        """End of a region: resolve what is pending on the device (may raise), write the summary."""
        try:
            self._resolve()
            self._decide_unused()
        finally:
            if self._dirty:
                self._write_summary()
        if self._stop is not None:
            exc, self._stop = self._stop, None
            raise exc

    def _resolve(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        # one stack (not one per op: a kernel launch each) and the one host sync of the window
        values = self.backend.read([n for p in pending for n in p[3]])
        pos = 0
        for event, outs, ins, norms, seen in pending:
            if outs is None:      # a reader with no floating output (_reader_seen): ``event`` names it
                self._note_readers(event, ins)
                continue
            n = len(norms)
            self._judge(event, outs, ins, values[pos:pos + n], stale=self.backend.versions(ins) != seen)
            pos += n

    def _norms(self, outs, ins) -> list:
        norms = [self.backend.sq_norm(t) for _, t in outs]
        norms += [self._input_norm(t) for t in ins]
        for (_, t), n in zip(outs, norms):
            self._remember(t, n)
        return norms

    def _key(self, t):
        """Cache key: shared by every reshape/transpose of the same memory (same elements, same
        norm), so the views that feed most ops (weight.t(), q/k/v splits) are not re-read."""
        key = self.backend.dense_key(t)
        return key if key is not None else self.backend.identity(t)

    def _input_norm(self, t):
        key = self._key(t)
        hit = self._cache.get(key) if key is not None else None
        if hit is not None and self.backend.memory_alive(hit[0]):
            return hit[1]
        n = self.backend.sq_norm(t)
        self._remember(t, n, key)
        return n

    def _remember(self, t, n, key=None) -> None:
        key = self._key(t) if key is None else key
        if key is None:
            return
        if len(self._cache) > 4096:
            self._cache.clear()
        self._cache[key] = (self.backend.memory_ref(t), n)

    # ---- classification -----------------------------------------------------------------------------
    def _judge(self, event, outs, ins, sq_norms, stale: bool = False) -> None:
        """Classify from the squared norms taken when the op ran.  ``stale``: an input was
        written in place before they were read back (accelerator windows), so the op is not
        replayed and its inputs are not saved: they are no longer what it saw."""
        k = len(outs)
        out_sq, in_sq = sq_norms[:k], sq_norms[k:]
        finite = self.backend.all_finite
        out_bad = [not math.isfinite(v) and not finite(t) for (_, t), v in zip(outs, out_sq)]
        if any(out_bad) or self._unused:
            bad_ins = [t for t, v in zip(ins, in_sq) if not math.isfinite(v) and (stale or not finite(t))]
        if any(out_bad):
            self._judge_nonfinite(event, outs, ins, out_bad, bad_ins, stale)
            return
        if self._unused and bad_ins:
            self._note_readers(self._reader_name(event), bad_ins)
        if in_sq and out_sq:
            out_n = math.sqrt(max(min(v, 1e300) for v in out_sq))
            in_n = math.sqrt(max(min(v, 1e300) for v in in_sq))
            if in_n > 0 and out_n > _GROWTH * in_n and math.isfinite(out_n):
                self._flag(event, outs, "suspicious growth", growth=out_n / in_n, stale=stale)

    def _judge_nonfinite(self, event, outs, ins, out_bad, bad_ins, stale: bool) -> None:
        """An op whose outputs hold inf/nan: it made them (critical), carried a held overflow's on
        (its row waits with it), or propagated others' (a non-finite input or Python scalar)."""
        carried = [t for (_, t), bad in zip(outs, out_bad) if bad]
        held, untracked = self._carriers.held_by(bad_ins)
        if held and self._differentiated(event, ins):
            self._use_now(held)                    # into the training's own values: in use
            held = []
        if held:
            self._carriers.add(carried, held)      # the inf/nan goes on: its carriers with it
        # a non-finite Python scalar argument (masked_fill(mask, -inf), full(inf)) is a
        # deliberate inf given to the op, not one it created
        scalar = has_nonfinite_scalar((event.args, event.kwargs))
        if bad_ins and held and not untracked and not scalar:
            self._pass_on(event, outs, held[0], stale)
        elif bad_ins:
            self._flag(event, outs, "propagated", stale=stale)
        elif scalar:
            self._flag(event, outs, "propagated", record=False)
        else:
            self._flag(event, outs, "critical", stale=stale, carried=carried, ins=ins)

    def _flag(self, event: OpEvent, outs, klass: str, growth: float | None = None, record: bool = True,
              stale: bool = False, carried=(), ins=()) -> None:
        """One summary row and, unless ``record`` is False, one op record for a flagged op.
        ``record=False``: the only non-finite input is a Python scalar (``masked_fill(mask, -inf)``
        in every attention layer): its record's statistics would cost more than the check.
        A critical op may be held until its inf/nan (in ``carried``, its non-finite outputs) is in use."""
        critical = klass == "critical"
        # critical ops count when emitted (held ones may turn out expected or discarded)
        if not critical and not self._count_light(klass):
            return
        flagged = self._flagged(event, outs, klass, growth, record, stale)
        if critical and self._holdable(event, ins):
            held = HeldOverflow(flagged, event.stage)
            if self._carriers.add(carried, [held]):      # else nothing to follow: reported now
                self._unused.append(held)
                return
        if critical:
            self._route(flagged, event.stage)
        else:
            self._emit(*flagged[:2], klass, flagged[2])

    def _count_light(self, klass: str) -> bool:
        """Count a propagated or growth op; False past ``_MAX_LIGHT`` a step (counted, not listed)."""
        self.counts[klass] += 1
        self.totals[klass] += 1
        self._dirty = True
        return self.counts[klass] <= _MAX_LIGHT

    def _flagged(self, event: OpEvent, outs, klass: str, growth, record: bool, stale: bool) -> tuple:
        """``(record or None, summary row, verdict)`` of a flagged op, built now: its inputs may be
        overwritten before it is reported."""
        critical = klass == "critical"
        if critical and event.stack is None and event.stage == "forward":
            event.stack = self.backend.user_stack()
        nan = inf = 0
        for _, t in outs:
            a, b = self.backend.nonfinite_counts(t)
            nan, inf = nan + a, inf + b
        info = {"class": klass, "nan": nan, "inf": inf}
        if growth is not None:
            info["growth"] = growth
        if critical:
            if op_traits.is_cast(event.op):
                info["cast"] = True
            if stale:
                info["replay"] = "not replayed (inputs written in place before the check was read)"
            elif self.replay:
                info.update(self._replay(event, outs))
        rec = None
        if record:
            rec = self.recorder.encode(event, save=critical and not stale)
            if stale:
                rec["inputs_overwritten"] = True
            rec["overflow"] = info
        out_dtype = self.backend.dtype_of(outs[0][1])
        row = {
            "step": self.session.step_no, "rank": self.session.rank, "id": "",
            "class": klass, "stage": event.stage, "op": event.op, "name": event.name, "scope": event.scope,
            "grad_fn": event.grad_fn or "", "call": event.call, "dtype": out_dtype, "nan": nan, "inf": inf,
            "growth": info.get("growth", ""), "replay": info.get("replay", ""),
            "float64_max_abs": info.get("float64_max_abs", ""), "dtype_max": info.get("dtype_max", ""),
            "exceeds_dtype_range": info.get("exceeds_dtype_range", ""), "loss_scale": "",
            "stack": " <- ".join(reversed(event.stack[-3:])) if event.stack else ""}
        return rec, row, info

    def _route(self, flagged: tuple, stage: str) -> None:
        """A critical op in use: reported, or held for the step's loss-scale verdict (backward)."""
        if stage == "backward" and self.loss_scale.active():
            self._held.append(flagged)
        else:
            self._emit(flagged[0], flagged[1], "critical", flagged[2])

    # ---- inf/nan not yet seen in use ---------------------------------------------------------------
    def _holdable(self, event: OpEvent, ins) -> bool:
        """Whether a critical op may wait to be seen in use: not where every reader of its values
        cannot be checked (one stage only), not in the training's differentiated values, and not
        in a compiled graph's eager re-run (its values are copies: their lifetime says nothing)."""
        if not self.hold_unused or (event.extra or {}).get("compiled", {}).get("rerun"):
            return False
        return not self._differentiated(event, ins)

    def _differentiated(self, event: OpEvent, ins) -> bool:
        """A forward op autograd differentiates (a floating input requires grad): its values are
        the training's own, which backward reads or differentiates through."""
        meta = self.backend.tensor_meta
        return event.stage == "forward" and any(meta(t).get("requires_grad") for t in ins)

    def _use_now(self, held: list) -> None:
        """Held overflows whose values an op just put in use: reported before that op's own row."""
        for h in held:
            self._unused.remove(h)
            self._use(h)

    def _pass_on(self, event: OpEvent, outs, held: HeldOverflow, stale: bool) -> None:
        """An op that only carried a held overflow's inf/nan on: its propagated row waits with it
        (no more rows wait than a step lists)."""
        if self._passed_on_held >= _MAX_LIGHT:
            held.passed_on_beyond += 1
            return
        self._passed_on_held += 1
        held.passed_on.append(self._flagged(event, outs, "propagated", None, True, stale))

    def _reader_seen(self, event: OpEvent) -> None:
        """An op with no floating output (a cast to integers, a compare) may read a held overflow's
        values, which end there.  Noted in op order: after the ops still pending on the device."""
        if not self._pending and not self._unused:
            return
        ins = self.backend.float_tensors((event.args, event.kwargs))
        if not ins:
            return
        if self._pending:
            self._pending.append((self._reader_name(event), None, ins, [], None))
        else:
            self._note_readers(self._reader_name(event), ins)

    def _reader_name(self, event: OpEvent) -> str:
        """The op and the dtype it made of the values: ``aten._to_copy.default -> int64``."""
        out = event.outputs[0] if isinstance(event.outputs, (tuple, list)) and event.outputs else event.outputs
        return f"{event.op} -> {self.backend.dtype_of(out)}" if self.backend.is_tensor(out) else event.op

    def _note_readers(self, how: str, tensors) -> None:
        """``how`` read a held overflow's values in ``tensors`` and kept no inf/nan (masked, cast,
        compared): the overflow may be discarded, and is named so if it is."""
        held, _ = self._carriers.held_by(tensors)
        for h in held:
            h.read = True
            if how not in h.readers and len(h.readers) < _READERS_NOTED:
                h.readers.append(how)

    def _decide_unused(self) -> None:
        """A check point: the program's own code, an optimizer or the loss scaler reads what the
        step made.  A held overflow whose carriers live is in use; one whose carriers were all
        freed after an op masked, clamped, compared or cast them to integers was discarded.  One
        freed with no such reader is reported: it may have been read where no op shows it
        (``.item()`` is no op the probe is given)."""
        if not self._unused:
            return
        unused, self._unused = self._unused, []
        alive = self._carriers.holders_alive()
        self._carriers.clear()
        self._passed_on_held = 0
        for held in unused:
            if id(held) in alive or not held.read:
                self._use(held)
            else:
                self._discard(held)

    def _use(self, held: HeldOverflow) -> None:
        """Report a held overflow at the op that made it, then the ops that carried it on."""
        held.state = "used"
        self._route(held.flagged, held.stage)
        for rec, row, info in held.passed_on:
            if self._count_light("propagated"):
                self._emit(rec, row, "propagated", info)
        for _ in range(held.passed_on_beyond):
            self._count_light("propagated")

    def _discard(self, held: HeldOverflow) -> None:
        """Count a held overflow whose values were never used; overflow.json lists it."""
        held.state = "discarded"
        self.counts["discarded"] += 1
        self.totals["discarded"] += 1
        self._dirty = True
        if len(self.discarded) < _MAX_LIGHT:
            row = held.flagged[1]
            self.discarded.append({k: row[k] for k in ("step", "rank", "stage", "op", "name", "scope", "call",
                                                       "dtype", "nan", "inf")}
                                  | {"read_by": list(held.readers)})

    def _emit(self, rec: dict | None, row: dict, klass: str, info: dict | None) -> None:
        """Write a flagged op's record and summary row; critical ones count toward ``overflow_nums``."""
        if klass in ("critical", "expected", "scale collapse"):
            self.counts[klass] += 1
            self.totals[klass] += 1
        if rec is not None:
            self.recorder.write(rec)
            row["id"] = rec["id"]
        self.rows.append(row)
        self._dirty = True
        if klass in ("critical", "scale collapse"):
            self._write_summary()
            self.found += 1
            if self.limit != -1 and self.found >= self.limit and self._stop is None:
                where = f"scope {row['scope']!r}, " if row["scope"] else ""
                what = (f"loss scale collapsing: {row['loss_scale']}" if klass == "scale collapse" else
                        f"overflow in {row['op']} ({row['stage']}, {where}call {row['call']}"
                        f"{', ' + row['grad_fn'] if row['grad_fn'] else ''}): {row['inf']} inf, {row['nan']} nan "
                        f"from finite inputs{'; float64 replay: ' + info['replay'] if info and 'replay' in info else ''}"
                        f"{'; ' + row['loss_scale'] if row['loss_scale'] else ''}")
                # the op as a standalone bug report (offline/repro.py; its inputs are saved unless overwritten)
                repro = (f"; a standalone repro: dispatchprobe repro {self.session.run_dir} {rec['name']} -o repro"
                         if rec is not None and not rec.get("inputs_overwritten") and klass == "critical" else "")
                self._stop = OverflowDetected(f"dispatchprobe: {what}; see "
                                              f"{os.path.join(self.session.part_dir, 'overflow.csv')}{repro}")

    def _replay(self, event: OpEvent, outs) -> dict:
        """Run the op again on CPU in float64: does the overflow belong to the maths or the dtype?"""
        b = self.backend
        if event.func is None:          # measured elsewhere (a compiled graph's kernel): nothing to call
            return {"replay": "not replayed (no callable op: a compiled graph's kernel)"}
        if b.is_random(event.func):
            return {"replay": "not replayed (random op)"}
        try:
            args, kwargs = b.cast_args(event.args, event.kwargs, _TO_FLOAT64, device="cpu")
            result = b.run(event.func, args, kwargs)
        except Exception as exc:  # an op without a float64 CPU kernel
            return {"replay": f"replay failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
        results = [r for _, r in b.float_outputs(result)]
        bad = not all(b.all_finite(r) for r in results)
        max_abs = max((b.max_abs_finite(r) for r in results), default=0.0)
        dtype_max = b.dtype_max(b.dtype_of(outs[0][1]))
        return {"replay": "inherent" if bad else "precision", "float64_max_abs": max_abs,
                "dtype_max": dtype_max, "exceeds_dtype_range": max_abs > dtype_max}

    # ---- summary files ---------------------------------------------------------------------------------
    def start_part(self) -> None:
        self.rows = []
        self.discarded = []
        self.counts = {k: 0 for k in self.counts}
        self._cache.clear()

    def _write_summary(self) -> None:
        self._dirty = False
        folder = self.session.part_dir
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\n")
        w.writeheader()
        w.writerows(self.rows)
        atomic_write_text(os.path.join(folder, "overflow.csv"), buf.getvalue())
        summary = {"step": self.session.step_no, "rank": self.session.rank, "counts": self.counts,
                   "first_critical": next((r for r in self.rows if r["class"] == "critical"), None),
                   "rows": self.rows, "discarded": self.discarded}
        atomic_write_text(os.path.join(folder, "overflow.json"), json.dumps(summary, indent=1, default=str))

    def summary(self) -> dict:
        return {"checked": self.checked, "flagged": self.found, **self.totals}

    def close(self) -> None:
        self._pending = []
        self._held = []
        self._unused = []
        self._carriers.clear()
        self._passed_on_held = 0


class HeldOverflow:
    """A critical op not yet seen in use: its record, row and verdict (built when it ran), the
    propagated ops that carried its inf/nan on (reported with it), and the ops that read its
    values and kept none (named if it turns out discarded)."""

    __slots__ = ("flagged", "stage", "passed_on", "passed_on_beyond", "read", "readers", "state")

    def __init__(self, flagged: tuple, stage: str):
        self.flagged, self.stage = flagged, stage
        self.passed_on: list = []
        self.passed_on_beyond = 0          # passed-on ops past the cap: counted, not listed
        self.read = False                  # an op read its values and kept no inf/nan
        self.readers: list[str] = []       # the first few such ops, named
        self.state = "held"                # then "used" or "discarded"


class Carriers:
    """The memories that hold a held overflow's inf/nan, by address (shared by every view of a
    memory, so a slice or reshape of a carrier is found too).  Weak references only: following
    a value neither copies it nor keeps it alive, so its death says the program let it go."""

    def __init__(self, backend):
        self.backend = backend
        self._by_address: dict = {}        # address -> (memory ref, [HeldOverflow])

    def add(self, tensors, held: list) -> bool:
        """``tensors`` carry ``held`` from now on; False where none of them can be followed."""
        b, followed = self.backend, False
        for t in tensors:
            ref = b.memory_ref(t)
            if ref is None:
                continue
            address = b.memory_address(ref)
            entry = self._by_address.get(address)
            if entry is not None and b.memory_alive(entry[0]):
                entry[1].extend(h for h in held if h not in entry[1])
            else:
                self._by_address[address] = (ref, list(held))
            followed = True
        return followed

    def held_by(self, tensors) -> tuple[list, bool]:
        """The still-held overflows whose inf/nan ``tensors`` hold, and whether any of those tensors
        holds inf/nan from elsewhere (no held overflow's carrier)."""
        if not self._by_address:
            return [], bool(tensors)
        b, found, untracked = self.backend, [], False
        for t in tensors:
            ref = b.memory_ref(t)
            entry = self._by_address.get(b.memory_address(ref)) if ref is not None else None
            live = [h for h in entry[1] if h.state == "held"] if entry and b.memory_alive(entry[0]) else []
            untracked = untracked or not live
            found.extend(h for h in live if h not in found)
        return found, untracked

    def holders_alive(self) -> set:
        """``id`` of every overflow some living memory still carries."""
        alive = self.backend.memory_alive
        return {id(h) for ref, held in self._by_address.values() if alive(ref) for h in held}

    def clear(self) -> None:
        self._by_address.clear()


class LossScaleWatch:
    """What a step's dynamic loss scaling did, from the ops it runs: the scale (a 0-dim tensor
    multiplied into a 0-dim loss outside any module, as ``GradScaler.scale`` does), and, when the
    scaler runs inside the probe, its check (``found_inf``) and update.  Outside the probe its
    ops are not seen: then the scale's value at the step's end says whether it backed off."""

    def __init__(self, backend):
        self.backend = backend
        self.scaler_ops = False      # the scaler's ops were seen (this run)
        self.scale = None            # this step's scale tensor, and its value when multiplied in
        self.value = None
        self.found_inf = None        # the update's found_inf this step (True/False), if seen
        self.stepped = False         # an optimizer stepped this step
        self._verdict = None         # this step's (skipped, why), once known
        self.skips = 0               # steps skipped in a row

    def active(self) -> bool:
        return self.scale is not None or self.scaler_ops

    def sees(self, event) -> bool:
        """Note what ``event`` says about loss scaling; True for the scaler's own ops (not checked)."""
        base = op_traits.base_name(event.op)
        if base == op_traits.LOSS_SCALE_CHECK:
            self.scaler_ops = True
            return True
        if base == op_traits.LOSS_SCALE_UPDATE:
            self.scaler_ops = True
            b = self.backend
            found = event.args[2] if len(event.args) > 2 else event.kwargs.get("found_inf")
            if b.is_tensor(found):
                self.found_inf = b.max_abs_finite(found) > 0 or not b.all_finite(found)
            out = event.outputs[0] if isinstance(event.outputs, (tuple, list)) else event.outputs
            if b.is_tensor(out):
                self.value = b.max_abs_finite(out)
            return True
        if base == "mul" and event.stage == "forward" and not event.scope and self.scale is None:
            self._maybe_scale(event.args)
        return False

    def use_scale(self, scale) -> None:
        """``scale`` (a 0-dim tensor) is this step's loss scale, as the adapter recognised it."""
        if self.scale is None:
            self.scale, self.value = scale, self.backend.max_abs_finite(scale)

    def checked(self, found_inf: bool) -> None:
        """The scaler's check of this step's gradients found inf/nan (its update backs off)."""
        self.scaler_ops = True
        self.found_inf = bool(found_inf)

    def _maybe_scale(self, args) -> None:
        b = self.backend
        ts = [a for a in args if b.is_tensor(a)]
        if len(ts) != 2 or any(b.numel(t) != 1 or b.shape(t) != [] for t in ts):
            return
        grads = [b.tensor_meta(t).get("requires_grad") for t in ts]
        if grads.count(True) != 1 or b.dtype_of(ts[grads.index(False)]) != "float32":
            return
        scale = ts[grads.index(False)]
        value = b.max_abs_finite(scale)
        if value > 1:
            self.scale, self.value = scale, value

    def decide(self, final: bool = False):
        """``((skipped, why), new)`` once the step's fate is known (``new``: decided by this call),
        else None.  ``final``: the step is over."""
        if self._verdict is not None:
            return self._verdict, False
        if not self.active():
            return None
        if self.stepped:
            verdict = False, "not caught: the optimizer stepped with it"
        elif self.found_inf is not None:
            verdict = (True, "step skipped by the loss scaler (found_inf set)") if self.found_inf else \
                (False, "not caught: the loss scaler found no inf/nan")
        elif not final:
            return None
        else:
            verdict = False, "not caught: no loss scaler skipped the step"
            if self.scale is not None:
                now = self.backend.max_abs_finite(self.scale)
                if now < self.value:
                    verdict = True, f"step skipped by the loss scaler (scale {self.value:g} -> {now:g})"
        self._verdict = verdict
        self.skips = self.skips + 1 if verdict[0] else 0
        return verdict, True

    def next_step(self) -> None:
        self.scale, self.found_inf, self.stepped, self._verdict = None, None, False, None
