"""Snapshots of tensors to save, and the safetensors shards written from them.

A snapshot is a private contiguous CPU copy taken on the op's thread (a later in-place op must
not change what is saved), copied into recycled arena memory (no page faults per copy); the
shard writer writes the bytes in place and gives the arenas back.
"""

from __future__ import annotations

import ctypes
import json
import threading

import torch

from . import tensor_kinds
from ..records.writer import write_safetensors
from .internals.dispatch import no_functorch
from .internals.tensors import safetensors_codes
from .ops import dtype_name


class Arenas:
    """Recycled, already-touched CPU memory for tensor snapshots: a fresh ``clone`` pays page
    faults on first touch, so snapshots are copied into 32 MB arenas that go back to a small
    free list once the shard writer has written everything in them."""

    SIZE = 32 << 20
    KEEP = 8                  # free arenas kept for reuse (256 MB at most)

    def __init__(self):
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self._current: torch.Tensor | None = None
        self._used = 0
        self._live: dict[int, int] = {}   # arena id -> snapshots not yet released

    def take(self, nbytes: int):
        """(``nbytes`` of arena memory as a uint8 tensor, its arena), or None if too big."""
        if nbytes > self.SIZE // 4:
            return None
        nbytes = (nbytes + 63) & ~63
        with self._lock:
            if self._current is None or self._used + nbytes > self.SIZE:
                if self._current is not None and self._live.get(id(self._current)) == 0:
                    self._recycle(self._current)      # retired with nothing left unwritten in it
                self._current = self._free.pop() if self._free else torch.empty(self.SIZE, dtype=torch.uint8)
                self._used = 0
                self._live[id(self._current)] = 0
            block = self._current[self._used:self._used + nbytes]
            self._used += nbytes
            self._live[id(self._current)] += 1
            return block, self._current

    def release(self, tensors) -> None:
        """The writer is done with these snapshots: their arenas may be reused."""
        with self._lock:
            for t in tensors:
                base = getattr(t, "_dp_arena", None)
                if base is None:
                    continue
                key = id(base)
                self._live[key] -= 1
                if self._live[key] == 0 and base is not self._current:
                    self._recycle(base)

    def _recycle(self, arena: torch.Tensor) -> None:
        del self._live[id(arena)]
        if len(self._free) < self.KEEP:
            self._free.append(arena)


ARENAS = Arenas()
_memmove = ctypes.memmove   # a foreign call: releases the GIL while it copies


def _copy_out(src: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of ``src`` in arena memory (or a plain copy when it is large).

    A contiguous CPU source is copied by one ``memmove`` on this thread (the GIL released), not
    by ``copy_``: torch splits a copy over its intra-op threads, and each such copy then waits
    for every one of them, which stalls whenever another core is busy (the shard writer)."""
    nbytes = src.numel() * src.element_size()
    taken = ARENAS.take(nbytes) if src.device.type == "cpu" else None
    if taken is None:
        return src.to("cpu", copy=True, memory_format=torch.contiguous_format) if src.device.type != "cpu" \
            else src.clone(memory_format=torch.contiguous_format)
    block, arena = taken
    out = block[:nbytes].view(src.dtype).view(src.shape)
    if type(src) is torch.Tensor and src.layout == torch.strided and src.is_contiguous() \
            and not src.is_conj() and not src.is_neg():
        _memmove(out.data_ptr(), src.data_ptr(), nbytes)
    else:
        out.copy_(src)
    out._dp_arena = arena
    return out


def span_snapshot(t: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """A private copy of ``length`` elements of ``t``'s storage from ``start``, as 1-D."""
    with torch.no_grad():
        return _copy_out(t.detach().as_strided((length,), (1,), start))


def snapshot(t: torch.Tensor) -> torch.Tensor:
    """A private contiguous copy to save, taken now on the op's thread: a later in-place op
    must not change what is saved.  Of the values :mod:`.tensor_kinds` allows (the recorder saves
    nothing for a tensor whose record says ``no_values``)."""
    with torch.no_grad(), no_functorch():
        return _copy_out(tensor_kinds.values(t).detach())


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_ST_CODES = safetensors_codes()
_PAIRS = {torch.complex128: ("F64", torch.float64), torch.complex32: ("F16", torch.float16)}


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU snapshot, read in place.  No torch call: the shard writer
    thread runs this per tensor, and each torch call would give the GIL away to the op thread and
    wait up to a switch interval (5 ms) to get it back."""
    if t.device.type != "cpu" or not t.is_contiguous():     # not a snapshot: never the case today
        return memoryview(t.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr()) if n else b"")


def save_shard(tensors: dict, path: str) -> None:
    """Write a safetensors file straight from the snapshots' memory, then free their arenas.

    Bytes are never converted: a dtype safetensors has no code for is stored as its (re, im)
    pairs (complex128, complex32) or as raw bytes, with its dtype and shape in the file's
    metadata (``records.reader.read_safetensors`` restores them)."""
    entries, renamed = {}, {}
    for key, t in tensors.items():
        code, shape = _ST_CODES.get(t.dtype), list(t.shape)
        if code is None:
            renamed[key] = json.dumps({"dtype": dtype_name(t.dtype), "shape": shape})
            if t.dtype in _PAIRS:
                code, shape = _PAIRS[t.dtype][0], shape + [2]
            else:
                code, shape = "U8", [nbytes(t)]
        entries[key] = (code, shape, _bytes_of(t))
    write_safetensors(entries, path, metadata=renamed)
    ARENAS.release(tensors.values())
