"""The framework-neutral middle of the pipeline: op events, task handlers and the recorder.

A framework adapter (torch eager, torch.compile, MindSpore) turns each intercepted call into
an :class:`OpEvent` and hands it to the session's handlers.  The recorder turns events into
the JSON lines of ``docs/record-format.md``; it talks to tensors only through a *backend*
module (``torch_backend``, ``dispatchprobe_ms.backend``) with the same small set of functions.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class OpEvent:
    """One intercepted call, in neutral terms."""

    kind: str                     # "op" (a kernel call) or "module" (a module boundary)
    op: str                       # e.g. "aten.addmm.default", or the module's type for kind="module"
    stage: str                    # "forward" or "backward"
    scope: str                    # module scope, e.g. "TinyTransformer.layers.1.mlp"
    call: int                     # n-th call of this op in this stage, step and rank
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    outputs: Any = None
    grad_fn: str | None = None    # backward ops: the autograd node that ran them
    stack: tuple | None = None    # Python frames ("file:line in func"), innermost last
    func: Callable | None = None  # the callable, so a handler can run it again

    def with_outputs(self, outputs) -> "OpEvent":
        """A shallow copy holding ``outputs`` instead: what a handler keeps of an op until a
        deferred check is read back (``dataclasses.replace`` re-runs ``__init__``: 5x slower)."""
        kept = object.__new__(OpEvent)
        kept.__dict__.update(self.__dict__)
        kept.outputs = outputs
        return kept

    @property
    def name(self) -> str:
        """Stable across runs and devices: op (or scope for modules), call index, stage."""
        if self.kind == "module":
            return f"{self.scope}.{self.stage}.{self.call}"
        return f"{self.op}.{self.call}.{self.stage}"


class Handler:
    """A task's reaction to each op.  ``on_op`` may return replacement outputs (``fix`` only)."""

    def on_op(self, event: OpEvent):  # pragma: no cover - interface
        return None

    def start_part(self) -> None:
        """A new step/rank part was opened: per-part state (caches, summary files) starts over."""

    def flush(self) -> None:
        """End of a capture region: finish deferred work (may write records, may raise)."""

    def close(self) -> None:
        pass


def flat_outputs(outputs) -> list:
    if isinstance(outputs, (tuple, list)):
        return list(outputs)
    return [outputs]


DEFER_BATCH = 512   # accelerator tensors measured per host sync


class Recorder(Handler):
    """Writes every event it is given as one JSON line; saves tensors when asked.

    Statistics and saved copies are cached per live tensor value (memory, view, version, checked
    with a weak reference to the memory), so an op's
    output that is the next op's input is measured once and stored once.
    """

    def __init__(self, backend, session, *, save_tensors: bool, checksum: bool, io_filter=None):
        self.backend = backend
        self.session = session
        self.save_tensors = save_tensors
        self.checksum = checksum
        self.io_filter = io_filter or (lambda io: True)
        self._cache: dict = {}
        self._spans: dict = {}
        self._dense: dict = {}
        self._next_key = 0
        # accelerator statistics still on the device, and the records waiting for them: read
        # back with one host sync every DEFER_BATCH tensors or at flush, not one per op
        self._rows: list = []
        self._row_stats: list = []
        self._waiting: list[dict] = []

    # -- encoding --------------------------------------------------------------------------
    def _encode_value(self, found: list, value):
        """One argument as JSON; tensors get their metadata now and are collected in ``found``.

        A method, not a closure: a recursive closure is a reference cycle that would keep the
        op's tensors alive until the garbage collector runs, and autograd's gradient
        accumulation copies instead of stealing a gradient that someone else still holds --
        the probe would change which ops run."""
        if self.backend.is_tensor(value):
            spec = self.backend.tensor_meta(value)
            found.append((value, spec))
            return spec
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
        if isinstance(value, (list, tuple)):
            return {"type": type(value).__name__, "value": [self._encode_value(found, v) for v in value]}
        return self.backend.encode_other(value)

    def encode(self, event: OpEvent, save: bool | None = None, defer: bool = False) -> dict:
        """The record of ``event``.  ``defer``: statistics of accelerator tensors are reduced on
        the device and filled in later (:meth:`emit` then holds the record until they are)."""
        save = self.save_tensors if save is None else save
        found: list[tuple[Any, dict]] = []
        enc = functools.partial(self._encode_value, found)
        record = {
            "id": None, "kind": event.kind, "name": event.name, "op": event.op, "stage": event.stage,
            "scope": event.scope, "call": event.call, "grad_fn": event.grad_fn,
            "stack": self.session.part.stack_id(event.stack) if event.stack else None,
        }
        if self.io_filter("input"):
            record["inputs"] = [enc(a) for a in event.args]
            record["kwargs"] = {k: enc(v) for k, v in event.kwargs.items()}
        if self.io_filter("output"):
            out = event.outputs
            record["output_type"] = "tuple" if isinstance(out, tuple) else "list" if isinstance(out, list) else "single"
            record["outputs"] = [enc(o) for o in flat_outputs(out)]
        same = self.backend.same_values(event) if save and event.func is not None else None
        self._fill_tensors(found, save, same, defer and not self.checksum)
        return record

    def _fill_tensors(self, found, save: bool, same: dict | None = None, defer: bool = False) -> None:
        backend = self.backend
        missing = []
        for t, spec in found:
            ident = backend.identity(t)
            entry = self._lookup(t, ident)
            if entry is not None and "stats" in entry:
                spec["stats"] = entry["stats"]
                if "checksum" in entry:
                    spec["checksum"] = entry["checksum"]
                continue
            # a reshape/transpose of measured memory has the same max/min/mean/norm
            dense = backend.dense_key(t)
            hit = self._dense.get(dense) if dense is not None else None
            if hit is not None and self.backend.memory_alive(hit[0]):
                spec["stats"] = hit[1]
                entry = {"stats": hit[1]}
                if self.checksum:
                    entry["checksum"] = spec["checksum"] = backend.checksum(t)
                self._remember(t, entry, ident)
            else:
                missing.append((t, spec, dense, ident))
        if defer and missing:
            now = []
            for item in missing:
                t, spec, dense, ident = item
                if not backend.stats_on_device(t):
                    now.append(item)
                    continue
                st = spec["stats"] = {}          # filled by _resolve, before the record is written
                self._rows.append(backend.device_stats_row(t))
                self._row_stats.append((st, t.numel()))
                self._remember(t, {"stats": st}, ident)
                if dense is not None:
                    self._dense[dense] = (backend.memory_ref(t), st)
            missing = now
        if missing:
            stats = backend.tensor_stats([m[0] for m in missing])
            for (t, spec, dense, ident), st in zip(missing, stats):
                spec["stats"] = st
                entry = {"stats": st}
                if self.checksum:
                    entry["checksum"] = spec["checksum"] = backend.checksum(t)
                self._remember(t, entry, ident)
                if dense is not None:
                    self._dense[dense] = (self.backend.memory_ref(t), st)
        if save:
            for t, spec in found:
                spec["data"] = self.save(t, like=same.get(id(t)) if same else None)

    def save(self, t, like=None) -> str:
        """Queue a tensor for the shard writer (once per live tensor value); returns its key.

        ``like``: an already saved tensor known to hold the same values in the same shape (the
        input of a ``clone``), whose key is reused instead of storing a copy.
        """
        entry = self._lookup(t)
        if entry is not None and "data" in entry:
            return entry["data"]
        source = self._lookup(like) if like is not None else None
        key = source["data"] if source is not None and "data" in source else self._save_by_storage(t)
        if entry is None:
            entry = {}
            self._remember(t, entry)
        entry["data"] = key
        return key

    def _new_key(self) -> str:
        key = f"t{self._next_key}"
        self._next_key += 1
        return key

    def _save_by_storage(self, t) -> str:
        """Save the memory under ``t`` once: views of saved memory become index entries.

        A transpose, reshape or slice of an already saved tensor (same memory, same in-place
        version) is written as (base key, offset, shape, stride) instead of a second copy.
        """
        writer = self.session.part.tensors
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
            self._spans[span_key] = (self.backend.memory_ref(t), base, base_shape)
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
        # the key holds the memory address: trust it only while that memory is still alive (a
        # freed block may be reused); tensors sharing it (a saved activation unpacked in
        # backward) then hit too.  Cleared at every step.
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
            self._cache[key] = (ref, entry)

    def start_part(self) -> None:
        """A new step/rank part: tensor keys and cache start over (the old part was flushed)."""
        self._cache.clear()
        self._spans.clear()
        self._dense.clear()
        self._next_key = 0

    # -- handler ------------------------------------------------------------------------------
    def on_op(self, event: OpEvent):
        self.emit(self.encode(event, defer=True))
        return None

    def emit(self, record: dict) -> None:
        """Write ``record`` now, or after the device statistics queued before it are read."""
        if not self._waiting and not self._row_stats:
            self.session.write(record)
            return
        self._waiting.append(record)
        if len(self._row_stats) >= DEFER_BATCH:
            self.flush()

    def flush(self) -> None:
        """Read the pending device statistics (one sync per device) and write waiting records."""
        if self._row_stats:
            values = self.backend.read_stats_rows(self._rows, [n for _, n in self._row_stats])
            for (st, _), v in zip(self._row_stats, values):
                st.update(v)
            self._rows, self._row_stats = [], []
        waiting, self._waiting = self._waiting, []
        for record in waiting:
            self.session.write(record)
