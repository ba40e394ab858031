"""The recorder: turns op events into the records of ``docs/record-format.md`` and writes them
into the open step/rank part.  It talks to tensors only through the backend
(:class:`dispatchprobe.core.tensor_backend.TensorBackend`).  Every task's records go through it: the
statistics and tensor tasks use it as their handler, the inline checks call :meth:`Recorder.encode`
and :meth:`Recorder.write` for the ops they flag.
"""

from __future__ import annotations

import math
from typing import Any

from ..records.writer import PIECES, finite_numbers_piece, json_line, json_piece
from .events import Handler, OpEvent, record_name

def encode_plain(value, backend) -> dict:
    """A non-tensor, non-sequence argument as JSON: builtins here, framework objects (dtypes,
    devices, ...) by the backend, as replay rebuilds them."""
    if value is None:
        return {"type": "none"}
    if isinstance(value, bool):
        return {"type": "bool", "value": value}
    if isinstance(value, int):
        return {"type": "int", "value": value}
    if isinstance(value, float):
        return {"type": "float", "value": value if math.isfinite(value) else str(value)}
    if isinstance(value, str):
        return {"type": "str", "value": value}
    if isinstance(value, complex):
        return {"type": "complex", "value": [value.real, value.imag]}
    return backend.encode_other(value)


PIECES_KEPT = 8192  # JSON pieces of looks, plain values and op fields kept per kind before starting over
DEFER_BATCH = 512   # accelerator tensors queued between two looks for arrived statistics
DEFER_HELD = 8      # batches queued and not arrived before the recorder waits for the device


class Measured:
    """A tensor's record entry taken just before an op overwrote it (:meth:`Recorder.measured_now`):
    encoded as it is, where the op's argument was."""

    __slots__ = ("spec",)

    def __init__(self, spec: dict):
        self.spec = spec


class Recorder(Handler):
    """Writes every event it is given as one JSON line; saves tensors when asked.

    Statistics and saved copies are cached per live tensor value (memory, view, version; the
    memory checked through a weak reference), so an op's output that is the next op's input is
    measured once and stored once."""

    def __init__(self, backend, *, save_tensors: bool, checksum: bool, io_filter=None):
        self.backend = backend
        self.part = None               # the open PartWriter (start_part)
        self._next_id = 0
        self.save_tensors = save_tensors
        self.checksum = checksum
        self.io_filter = io_filter or (lambda io: True)
        self._inputs, self._outputs = self.io_filter("input"), self.io_filter("output")
        self._is_tensor, self._describe = backend.is_tensor, backend.describe
        # the backend's loop over a sequence of arguments (plain tensors without a call each), else ours
        self._values = getattr(backend, "encode_values", None)
        self._cache: dict = {}         # identity -> (memory ref, entry)
        self._spans: dict = {}
        self._dense: dict = {}         # dense key -> the (memory ref, entry) of a value measured
        self._lines = None          # the part's ops.jsonl, where records need only statistics
        self._next_key = 0
        # accelerator statistics still on the device, and the records waiting for them: those
        # arrived on the host are read every DEFER_BATCH tensors, the rest at flush (or once
        # DEFER_HELD batches wait), never one host sync per op
        self._rows: list = []
        self._row_stats: list = []
        self._read_rows = 0            # rows read since the recorder began
        self._looked_at = 0            # len(self._rows) after the last look
        self._waiting: list[dict] = []
        self._need: list[int] = []     # per waiting record: the rows read before it is complete
        self._unfilled: set[int] = set()     # ids of records reserved (reserve) and not yet filled
        # records joined from JSON pieces (record_line): the backend's facts of a plain tensor, and
        # the pieces of each tensor look, plain value, keyword and op's fields, made once
        self._line_facts = getattr(backend, "line_facts", None)
        self._line_types = frozenset(getattr(backend, "LINE_TYPES", ()))     # the classes line_facts takes
        self._line_entry = getattr(backend, "line_entry", None)
        self._constants = getattr(backend, "CONSTANT_TYPES", ())
        self._copied_from = getattr(backend, "copied_from", None)
        self._line_ready = False
        self._looks: dict = {}
        self._plain: dict = {}
        self._heads: dict = {}

    # -- encoding --------------------------------------------------------------------------
    def _encode_value(self, found: list, value):
        """One argument as JSON; tensors get their metadata now and are collected in ``found``
        with their cache keys.  A method, not a closure: a recursive closure's reference cycle
        would keep the op's tensors alive and make autograd copy gradients it would steal (the
        probe would change the ops)."""
        if self._is_tensor(value):
            described = self._describe(value)
            found.append((value, *described))
            return described[0]
        if isinstance(value, (list, tuple)):
            return {"type": type(value).__name__, "value": [self._encode_value(found, v) for v in value]}
        if type(value) is Measured:
            return value.spec
        return encode_plain(value, self.backend)

    def encode(self, event: OpEvent, save: bool | None = None, defer: bool = False) -> dict:
        """The record of ``event``, built in one dict.  ``defer``: statistics of accelerator
        tensors are reduced on the device and filled in later (:meth:`emit` then holds the record
        until they are)."""
        save = self.save_tensors if save is None else save
        return self._record(event.kind, event.op, event.stage, event.scope, event.call, event.args, event.kwargs,
                            event.outputs, event.grad_fn, event.stack, event.undefined, event.extra,
                            event if save and event.func is not None else None, save, defer)

    def record_op(self, op: str, stage: str, scope: str, call: int, args, kwargs, outputs, *, func, grad_fn,
                  stack, undefined, extra) -> None:
        """:meth:`on_op` of an op call given by its fields: a session whose one handler is the
        recorder (the recording tasks) makes no :class:`OpEvent` per op."""
        save = self.save_tensors
        same_of = OpEvent("op", op, stage, scope, call, args, kwargs, outputs, func=func) \
            if save and func is not None else None
        self.emit(self._record("op", op, stage, scope, call, args, kwargs, outputs, grad_fn, stack, undefined, extra,
                               same_of, save, True))

    def _record(self, kind, op, stage, scope, call, args, kwargs, out, grad_fn, stack, undefined, extra,
                same_of, save: bool, defer: bool) -> dict:
        """:meth:`encode`, from the event's fields; ``same_of``: the event whose outputs may hold an
        input's values (:meth:`TensorBackend.same_values`), where tensors are saved."""
        found: list[tuple] = []
        # record_name's op form inline (a call fewer per op)
        name = f"{op}.{call}.{stage}" if kind == "op" else record_name(kind, op, scope, stage, call)
        record = {"id": None, "kind": kind, "name": name, "op": op,
                  "stage": stage, "scope": scope, "call": call, "grad_fn": grad_fn,
                  "stack": self.part.stack_id(stack) if stack else None}
        values, enc = self._values or self._own_values, self._encode_value
        if self._inputs:
            record["inputs"] = values(found, args, enc)
            record["kwargs"] = {k: enc(found, v) for k, v in kwargs.items()} if kwargs else {}
        if self._outputs:
            if isinstance(out, (tuple, list)):
                record["output_type"] = "tuple" if isinstance(out, tuple) else "list"
                record["outputs"] = values(found, out, enc)
            else:
                record["output_type"] = "single"
                record["outputs"] = values(found, (out,), enc)
        if found:
            if undefined:
                for t, spec, *_ in found:
                    if id(t) in undefined:
                        spec["undefined"] = True
            same = self.backend.same_values(same_of) if same_of is not None else None
            self._fill_tensors(found, save, same, defer and not self.checksum)
        if extra:
            record.update(extra)
        return record

    def record_line(self, op, stage, scope, call, grad_fn, args, kwargs, out, func=None) -> bool:
        """:meth:`record_op` without stack, extra fields or uninitialised memory, where records need
        only statistics: the record joined from JSON pieces made once (each tensor look's
        description, plain values, the op's fields) around each tensor's statistics, the bytes
        :func:`json_line` writes of :meth:`_record`'s dict, without building it (an output
        copying an input's values bit for bit in its layout takes the input's statistics,
        ``backend.copied_from``).  Runs no framework operation (the native statistics of finite
        host values only).  False, with nothing written, where a value is not such a piece (a
        tensor the backend describes otherwise, a non-finite number, one the native statistics
        do not read): then :meth:`record_op` writes it."""
        if not self._line_ready or self._waiting or self._row_stats:
            return False
        head = self._heads.get((op, stage, scope, grad_fn))
        if head is None:
            head = self._head(op, stage, scope, grad_fn)
        if head is False:
            return False
        number = b"%d" % call
        parts = [b'{"id":', b"", head[0], number, head[1], number, head[2]]
        found: list = []      # (tensor, identity, dense key, where its statistics go in parts)
        add = self._line_value
        if not self._line_values(parts, found, args, b'],"kwargs":{'):
            return False
        if kwargs:
            keys = self._plain
            for k, v in kwargs.items():
                key = keys.get((dict, k))
                if key is None:
                    key = json_piece(k)
                    if key is None:
                        return False
                    key = keys[(dict, k)] = key + b":"
                parts.append(key)
                if not add(parts, found, v):
                    return False
                parts.append(b",")
            parts.pop()
        if isinstance(out, (tuple, list)):
            parts.append(b'},"output_type":"tuple","outputs":[' if isinstance(out, tuple)
                         else b'},"output_type":"list","outputs":[')
            if not self._line_values(parts, found, out, b"]}\n"):
                return False
        else:
            parts.append(b'},"output_type":"single","outputs":[')
            if not add(parts, found, out):
                return False
            parts.append(b"]}\n")
        if found and not self._line_stats(found, parts, func, args, out):
            return False
        parts[1] = b"%d" % self._next_id
        self._lines.append_line(b"".join(parts))
        self._next_id += 1
        return True

    def _line_values(self, parts: list, found: list, values, closing: bytes) -> bool:
        """Append the pieces of a sequence of values (:meth:`_line_value`), each followed by a
        comma, the last comma replaced by ``closing``, the bracket ending the list; False where one
        takes the general path."""
        opened = len(parts)
        add = self._line_value
        for v in values:
            if not add(parts, found, v):
                return False
            parts.append(b",")
        if len(parts) > opened:
            parts[-1] = closing
        else:
            parts.append(closing)
        return True

    def _line_stats(self, found: list, parts: list, func, args, out) -> bool:
        """The statistics' JSON of the tensors :meth:`_line_value` collected, put in their places
        in ``parts``: :meth:`_fill_tensors`' cache, dense-key and measuring steps, each value's JSON
        kept in its cache entry (``"json"``) so that a value's later records reuse it.  False where
        one is not a :func:`json_piece` (no values, non-finite ones) or the native statistics do
        not read one."""
        cache, dense_cache, alive = self._cache, self._dense, self.backend.memory_alive
        missing = []
        for item in found:
            t, ident, dense, at = item
            hit = cache.get(ident)
            if hit is not None and alive(hit[0]) and "stats" in hit[1]:
                entry = hit[1]
            else:
                hit = dense_cache.get(dense) if dense is not None else None
                if hit is None or not alive(hit[0]):
                    missing.append(item)
                    continue
                # a reshape/transpose of measured memory has the same max/min/mean/norm
                entry = {"stats": hit[1]["stats"]}
                if "json" in hit[1]:
                    entry["json"] = hit[1]["json"]
                self._remember(t, entry, ident)
            piece = entry.get("json")
            if piece is None:
                piece = json_piece(entry["stats"])
                if piece is None:
                    return False
                entry["json"] = piece
            parts[at] = piece
        entry_of = self._line_entry
        if missing and func is not None and self._copied_from is not None and missing[-1][0] is out:
            src = self._copied_from(func, args, out)
            copied = next((f for f in found if f[0] is src), None) if src is not None else None
            hit = cache.get(copied[1]) if copied is not None else None
            if hit is not None and "json" in hit[1] and alive(hit[0]):     # read by the loop above
                pair = None
                for t, ident, dense, at in missing:
                    if t is out:            # the output, and an in-place op's written argument
                        parts[at] = hit[1]["json"]
                        if pair is None:
                            pair = entry_of(t, hit[1]["stats"], hit[1]["json"])
                        cache[ident] = pair
                        if dense is not None:
                            dense_cache[dense] = pair
                missing = [m for m in missing if m[0] is not out]
        if missing:
            stats = self.backend.line_stats([m[1] for m in missing])
            if stats is None:
                return False
            for (t, ident, dense, at), st in zip(missing, stats):
                piece = finite_numbers_piece(st)
                parts[at] = piece
                pair = entry_of(t, st, piece)
                cache[ident] = pair
                if dense is not None:
                    dense_cache[dense] = pair
        return True

    def _head(self, op, stage, scope, grad_fn):
        """The JSON of a record's fields from ``"kind"`` to ``"inputs":[``, in three pieces around
        the call index (written twice: in the name and as ``call``), or False where one is not a
        :func:`json_piece`."""
        pieces = [json_piece(x) for x in (op, stage, scope)]
        fn = b"null" if grad_fn is None else json_piece(grad_fn)
        if None in pieces or fn is None:
            head = False
        else:
            o, st, sc = pieces
            head = (b',"kind":"op","name":' + o[:-1] + b".",
                    b"." + st[1:] + b',"op":' + o + b',"stage":' + st + b',"scope":' + sc + b',"call":',
                    b',"grad_fn":' + fn + b',"stack":null,"inputs":[')
        self._heads[(op, stage, scope, grad_fn)] = head
        return head

    def _line_value(self, parts: list, found: list, v) -> bool:
        """Append ``v``'s JSON pieces to ``parts`` (a tensor's statistics left as a place, filled by
        :meth:`_line_stats`, the tensor collected in ``found``); False where ``v`` takes the
        general path."""
        cls = type(v)
        facts = self._line_facts(v) if cls in self._line_types else None
        if facts is not None:
            ident, dense, look = facts
            piece = self._looks.get(look)
            if piece is None:
                piece = json_piece(self.backend.meta_of(look))
                if piece is None:
                    return False
                piece = self._looks[look] = piece[:-1] + b',"stats":'
            parts.append(piece)
            found.append((v, ident, dense, len(parts)))
            parts.append(None)
            parts.append(b"}")
            return True
        # values whose piece is cached: hashable, their JSON a function of type and value (floats
        # but zeros, whose signs are equal keys, and nan, never equal to a key)
        if cls is int or cls is str or cls is bool or v is None or cls in self._constants \
                or cls is float and v and v == v:
            piece = self._plain.get((cls, v))
            if piece is None:
                piece = json_piece(encode_plain(v, self.backend))
                if piece is None:
                    return False
                if len(self._plain) < PIECES_KEPT:     # many distinct values in one step: not all kept
                    self._plain[(cls, v)] = piece
            parts.append(piece)
            return True
        if isinstance(v, (list, tuple)):
            piece = self._plain.get((type, cls))
            if piece is None:
                piece = json_piece(cls.__name__)
                if piece is None:
                    return False
                piece = self._plain[(type, cls)] = b'{"type":' + piece + b',"value":['
            parts.append(piece)
            return self._line_values(parts, found, v, b"]}")
        if cls is Measured:
            piece = json_piece(v.spec)
        elif cls is float or cls is complex:      # zeros, nan
            piece = json_piece(encode_plain(v, self.backend))
        else:       # tensors the backend describes otherwise, objects whose entry may run code (repr)
            return False
        if piece is None:
            return False
        parts.append(piece)
        return True

    def _fill_found(self, found: list, undefined: set | None, save: bool, same: dict | None, defer: bool) -> None:
        """Statistics (and saved data) of the tensors :meth:`_encode_value` collected; those in
        ``undefined`` (ids of uninitialised memory) are marked instead."""
        if undefined:
            for t, spec, *_ in found:
                if id(t) in undefined:
                    spec["undefined"] = True
        if found:
            self._fill_tensors(found, save, same, defer)

    def _own_values(self, found: list, values, enc) -> list:
        """A sequence of arguments as JSON (``enc``: :meth:`_encode_value`), their tensors described
        and collected in ``found`` for :meth:`_fill_tensors`; plain tensors (most arguments) without
        a call per value.  Where the backend has its own loop (``encode_values``), that one runs."""
        is_tensor, describe = self._is_tensor, self._describe
        out = []
        for v in values:
            if is_tensor(v):
                described = describe(v)
                found.append((v, *described))
                out.append(described[0])
            else:
                out.append(enc(found, v))
        return out

    @property
    def measures_only(self) -> bool:
        """Whether a record needs nothing of a tensor but its description and statistics."""
        return not self.save_tensors and not self.checksum

    def measured_now(self, t, undefined: bool = False) -> Measured:
        """``t``'s record entry as its values are now, for an op about to overwrite them, in place
        of a copy (:attr:`measures_only`): from the cache, keyed by the version before the write,
        or read now (accelerator tensors: queued on the device before the op, read later)."""
        found: list[tuple] = []
        unwritten = {id(t)} if undefined else None
        spec = self._encode_value(found, t)
        self._fill_found(found, unwritten, False, None, True)
        return Measured(spec)

    @staticmethod
    def skeleton(kind: str, op: str, stage: str, scope: str, call: int, *, grad_fn=None, stack=None) -> dict:
        """The fields every record starts with, whichever capture path measured the call."""
        return {"id": None, "kind": kind, "name": record_name(kind, op, scope, stage, call), "op": op,
                "stage": stage, "scope": scope, "call": call, "grad_fn": grad_fn, "stack": stack}

    def _fill_tensors(self, found, save: bool, same: dict | None = None, defer: bool = False) -> None:
        """Statistics (and, when ``save``, saved data) of the ``(tensor, spec, identity, dense
        key)`` entries :meth:`_encode_value` collected: from the cache where the value was
        measured before, else measured now (or queued on the device, ``defer``)."""
        backend = self.backend
        cache, dense_cache, alive, checksum = self._cache, self._dense, backend.memory_alive, self.checksum
        missing = []
        for item in found:
            t, spec, ident, dense = item
            if "undefined" in spec or "no_values" in spec:   # uninitialised memory, or none to read
                continue
            hit = cache.get(ident) if ident is not None else None
            if hit is not None and alive(hit[0]):
                entry = hit[1]
                if "stats" in entry:
                    spec["stats"] = entry["stats"]
                    if "checksum" in entry:
                        spec["checksum"] = entry["checksum"]
                    continue
            # a reshape/transpose of measured memory has the same max/min/mean/norm
            hit = dense_cache.get(dense) if dense is not None else None
            if hit is not None and alive(hit[0]):
                spec["stats"] = stats = hit[1]["stats"]
                entry = {"stats": stats}
                if checksum:
                    entry["checksum"] = spec["checksum"] = backend.checksum(t)
                self._remember(t, entry, ident)
            else:
                missing.append(item)
        if defer and missing:
            now = []
            for item in missing:
                t, spec, ident, dense = item
                if not backend.stats_on_device(t):
                    now.append(item)
                    continue
                st = spec["stats"] = {}          # filled by _resolve, before the record is written
                self._rows.append(backend.device_stats_row(t))
                self._row_stats.append((st, backend.numel(t)))
                self._measured(t, {"stats": st}, ident, dense)
            missing = now
        if missing:
            stats = backend.tensor_stats([m[0] for m in missing], [m[2] for m in missing])
            measured = self._measured
            for (t, spec, ident, dense), st in zip(missing, stats):
                spec["stats"] = st
                entry = {"stats": st}
                if checksum:
                    entry["checksum"] = spec["checksum"] = backend.checksum(t)
                measured(t, entry, ident, dense)
        if save:
            for t, spec, ident, _ in found:
                # metadata only (the backend said why), or uninitialised memory: its bytes mean
                # nothing (replay takes zeros), and a write the version counter does not see (a
                # collective filling it) would leave a cached key pointing at them
                if "no_values" not in spec and "undefined" not in spec:
                    spec["data"] = self.save(t, like=same.get(id(t)) if same else None, ident=ident)

    def _measured(self, t, entry: dict, ident, dense) -> None:
        """Cache freshly measured statistics under the tensor's identity and its dense key: one
        ``(weak reference to its memory, entry)`` pair for both (the dense key's readers take
        only the entry's ``stats``), made once."""
        if ident is None and dense is None:
            return
        backend = self.backend
        ref = backend.memory_ref(t)
        if ref is None:
            return
        pair = backend.cache_entry(ref, entry)
        if ident is not None:
            self._cache[ident] = pair
        if dense is not None:
            self._dense[dense] = pair

    def measured_elsewhere(self, t, stats: dict) -> None:
        """``t``'s statistics as another reader took them of its current values (a compiled graph's
        window), cached as if measured here: a record of ``t`` takes them without a second read."""
        _, ident, dense = self._describe(t)
        self._measured(t, {"stats": stats}, ident, dense)

    def carry_over(self, ident, new_ident, dense, new_dense) -> None:
        """What was measured of a value under its keys ``ident``/``dense`` also stands under
        ``new_ident``/``new_dense``: the adapter knows the value is unchanged (a version counter
        moved by the framework after the write that was measured)."""
        hit = self._cache.get(ident)
        if hit is not None and self.backend.memory_alive(hit[0]):
            self._cache[new_ident] = hit
        if dense is not None and new_dense is not None:
            hit = self._dense.get(dense)
            if hit is not None and self.backend.memory_alive(hit[0]):
                self._dense[new_dense] = hit

    def save(self, t, like=None, ident=None) -> str:
        """Queue a tensor for the shard writer (once per live tensor value); returns its key.
        ``like``: an already saved tensor with the same values and shape (a ``clone``'s input),
        whose key is reused instead of storing a copy; ``ident``: ``t``'s identity, if known."""
        ident = self.backend.identity(t) if ident is None else ident
        hit = self._cache.get(ident) if ident is not None else None
        if hit is not None and self.backend.memory_alive(hit[0]):
            ref, entry = hit        # the memory's reference serves the saved span too
            if "data" in entry:
                return entry["data"]
        else:
            ref = entry = None
        source = self._lookup(like) if like is not None else None
        key = source["data"] if source is not None and "data" in source else self._save_by_storage(t, ref)
        if entry is None:
            entry = {}
            self._remember(t, entry, ident)
        entry["data"] = key
        return key

    def _new_key(self) -> str:
        key = f"t{self._next_key}"
        self._next_key += 1
        return key

    def _save_by_storage(self, t, ref=None) -> str:
        """Save the memory under ``t`` once: a transpose, reshape or slice of saved memory (same
        in-place version) is written as (base key, offset, shape, stride), not a second copy.
        ``ref``: the weak reference to ``t``'s memory, where the caller has it."""
        writer = self.part.tensors
        span = self.backend.storage_span(t)
        if span is None:
            key = self._new_key()
            writer.put(key, self.backend.snapshot(t))
            return key
        span_key, start, length, offset, stride, plain = span
        shape = self.backend.shape(t)
        hit = self._spans.get(span_key)
        if hit is not None and self.backend.memory_alive(hit[0]):
            base, base_shape = hit[1], hit[2]
        else:
            base = self._new_key()
            # a plain tensor is saved in its own shape; the bytes are the same 1-D span
            base_shape = shape if plain else [length]
            writer.put(base, self.backend.snapshot(t) if plain else self.backend.span_snapshot(t, start, length))
            self._spans[span_key] = (ref if ref is not None else self.backend.memory_ref(t), base, base_shape)
        if plain and base_shape == shape:
            return base
        key = self._new_key()
        writer.put_view(key, base, offset, shape, stride)
        return key

    # -- the per-tensor cache ----------------------------------------------------------------
    def _lookup(self, t, key=None):
        """The cache entry of this live tensor value, if any (``key``: its identity, if known)."""
        key = self.backend.identity(t) if key is None else key
        if key is None:
            return None
        hit = self._cache.get(key)
        # the key holds the memory address: trusted only while that memory is alive (a freed
        # block may be reused); tensors sharing it (an activation unpacked in backward) hit too
        if hit is None or not self.backend.memory_alive(hit[0]):
            return None
        return hit[1]

    def _remember(self, t, entry: dict, key=None) -> None:
        """Cache ``entry`` for ``t``.  Dead entries are never trusted and go at the next step."""
        key = self.backend.identity(t) if key is None else key
        if key is None:
            return
        ref = self.backend.memory_ref(t)
        if ref is not None:
            self._cache[key] = self.backend.cache_entry(ref, entry)

    def start_part(self, part=None) -> None:
        """A new step/rank part (its ``PartWriter``): ids, tensor keys and cache start over."""
        if part is not None:
            self.part = part
        # a compiled graph's records are joined from JSON kept per graph (a writer with a descriptor)
        self._lines = self.part.ops if self.measures_only and self.part and hasattr(self.part.ops, "fd") else None
        self._next_id = 0
        self._line_ready = PIECES and self._lines is not None and self._line_facts is not None \
            and self._line_entry is not None and self._inputs and self._outputs
        for pieces in (self._looks, self._plain, self._heads):     # kept from step to step, bounded
            if len(pieces) > PIECES_KEPT:
                pieces.clear()
        self._cache.clear()
        self._spans.clear()
        self._dense.clear()
        self._next_key = 0

    # -- handler ------------------------------------------------------------------------------
    def on_op(self, event: OpEvent):
        self.emit(self.encode(event, defer=True))
        return None

    def write_joined(self, head: dict, rest: bytes) -> bool:
        """Append the record whose first fields are ``head`` (:meth:`skeleton`, given its id here)
        and whose other fields are ``rest``, their JSON (:func:`json_line` pieces, without the
        braces): a compiled graph's records, made from JSON kept per graph.  False, with nothing
        written, where records go through :meth:`emit` (they wait for device statistics, or the
        part's writer takes records, not lines)."""
        if self._lines is None or self._waiting or self._row_stats:
            return False
        head["id"] = self._next_id
        self._lines.append_line(b"".join((json_line(head)[:-2], b",", rest, b"}\n")))
        self._next_id += 1
        return True

    def write(self, record: dict) -> None:
        """Append one record to the part's ``ops.jsonl`` (flushed at once), giving it its id."""
        record["id"] = self._next_id
        self._next_id += 1
        self.part.ops.append(record)

    def module(self, scope: str, type_name: str) -> None:
        """Note a module of the part's module tree (``modules.jsonl``, each scope once)."""
        self.part.module(scope, type_name)

    def defer_stats(self, spec: dict, row, numel: int) -> None:
        """Give ``spec`` the statistics of a device row computed elsewhere (inside a compiled
        graph; :meth:`TensorBackend.device_stats_row`'s layout), read with the other pending rows."""
        st = spec["stats"] = {}
        self._rows.append(row)
        self._row_stats.append((st, numel))

    def emit(self, record: dict) -> None:
        """Write ``record`` now, or after the device statistics queued before it are read."""
        if not self._waiting and not self._row_stats:      # write(record), one call fewer per op
            record["id"] = self._next_id
            self._next_id += 1
            self.part.ops.append(record)
            return
        self._waiting.append(record)
        self._need.append(self._read_rows + len(self._rows))
        if len(self._rows) - self._looked_at >= DEFER_BATCH:
            self._read_arrived()

    def _read_arrived(self) -> None:
        """Read the queued device statistics that have arrived on the host (all of them, waiting,
        when DEFER_HELD batches have not) and write the records complete up to the first that
        is not."""
        rows = self._rows
        n = self.backend.stats_ready(rows)
        if len(rows) - n >= DEFER_HELD * DEFER_BATCH:
            n = len(rows)
        self._read(n)
        self._looked_at = len(self._rows)
        self._write_waiting()

    def _read(self, n: int) -> None:
        """Fill the statistics of the first ``n`` queued rows."""
        if not n:
            return
        stats = self._row_stats
        values = self.backend.read_stats_rows(self._rows[:n], [k for _, k in stats[:n]])
        for (st, _), v in zip(stats, values):
            st.update(v)
        del self._rows[:n], stats[:n]
        self._read_rows += n

    def reserve(self) -> dict:
        """A record's place in the part's order, for a record made later (a collective whose
        outputs hold their values only once its work completes): the records emitted after it
        wait behind it until :meth:`fill`, so the part keeps call order."""
        slot: dict = {}
        self._waiting.append(slot)
        self._need.append(self._read_rows + len(self._rows))
        self._unfilled.add(id(slot))
        return slot

    def fill(self, slot: dict, record: dict | None) -> None:
        """The record made for ``slot`` (None: nothing is recorded there); the records waiting
        only for it are written (those waiting for device statistics wait until they are read)."""
        self._unfilled.discard(id(slot))
        if record is None:
            at = next(i for i, r in enumerate(self._waiting) if r is slot)
            del self._waiting[at], self._need[at]
        else:
            slot.update(record)
        self._write_waiting()

    def flush(self) -> None:
        """Read the pending device statistics (one sync per device) and write waiting records
        (up to the first place still reserved)."""
        self._read(len(self._rows))
        self._looked_at = 0
        self._write_waiting()

    def _write_waiting(self) -> None:
        """Write the waiting records in order up to the first whose statistics are not read yet or
        whose place is still reserved."""
        waiting, unfilled, read = self._waiting, self._unfilled, self._read_rows
        n = 0
        for record, need in zip(waiting, self._need):
            if need > read or id(record) in unfilled:
                break
            self.write(record)
            n += 1
        del waiting[:n], self._need[:n]
