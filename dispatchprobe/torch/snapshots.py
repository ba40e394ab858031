"""Snapshots of tensors to save, and the safetensors shards written from them.

A snapshot is a private contiguous CPU copy taken on the op's thread (a later in-place op must
not change what is saved), copied into recycled arena memory (no page faults per copy) and
described by a :class:`Snapshot` (address, size, dtype, shape), not a tensor; the shard writer
writes the bytes in place and gives the arenas back.
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


class Snapshot:
    """A saved value's private bytes: where they lie, what they are, and what keeps them (an
    arena, or the value's own copy).  Not a tensor: a torch view of arena memory per saved value
    (slicing, two ``view`` calls, an attribute naming its arena) costs more Python than the
    ``memmove`` of a small value, and the shard writer needs only the address and the facts."""

    __slots__ = ("address", "nbytes", "dtype", "shape", "owner")

    def __init__(self, address: int, nbytes: int, dtype, shape, owner):
        self.address, self.nbytes, self.dtype, self.shape, self.owner = address, nbytes, dtype, shape, owner


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
        self._base = 0            # the current arena's address
        self._used = 0
        self._live: dict[int, int] = {}   # arena id -> snapshots not yet released

    def take(self, nbytes: int):
        """(the address of ``nbytes`` of arena memory, its arena), or None if too big."""
        if nbytes > self.SIZE // 4:
            return None
        nbytes = (nbytes + 63) & ~63
        with self._lock:
            if self._current is None or self._used + nbytes > self.SIZE:
                if self._current is not None and self._live.get(id(self._current)) == 0:
                    self._recycle(self._current)      # retired with nothing left unwritten in it
                self._current = self._free.pop() if self._free else torch.empty(self.SIZE, dtype=torch.uint8)
                self._base = self._current.data_ptr()
                self._used = 0
                self._live[id(self._current)] = 0
            at = self._base + self._used
            self._used += nbytes
            self._live[id(self._current)] += 1
            return at, self._current

    def release(self, snapshots) -> None:
        """The writer is done with these snapshots: their arenas may be reused."""
        with self._lock:
            live, current = self._live, self._current
            for s in snapshots:
                base = s.owner if type(s) is Snapshot else None
                key = id(base)
                if key not in live:        # a copy of its own (a large value), or not a snapshot
                    continue
                live[key] -= 1
                if live[key] == 0 and base is not current:
                    self._recycle(base)

    def _recycle(self, arena: torch.Tensor) -> None:
        del self._live[id(arena)]
        if len(self._free) < self.KEEP:
            self._free.append(arena)


ARENAS = Arenas()
_memmove = ctypes.memmove   # a foreign call: releases the GIL while it copies
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _movable(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes in memory order are its values: a plain contiguous CPU tensor (no
    conjugate or negative bit, which a copy would resolve)."""
    return type(t) in _PLAIN and t.is_cpu and t.layout == torch.strided and t.is_contiguous() \
        and not t.is_conj() and not t.is_neg()


def _copy_bytes(address: int, nbytes: int, dtype, shape) -> Snapshot:
    """A snapshot of ``nbytes`` contiguous bytes at ``address``, by one ``memmove`` on this thread
    (the GIL released), not by ``copy_``: torch splits a copy over its intra-op threads, and each
    such copy then waits for every one of them, which stalls whenever another core is busy (the
    shard writer)."""
    taken = ARENAS.take(nbytes)
    if taken is None:                      # large: a copy of its own
        out = torch.empty(nbytes, dtype=torch.uint8)
        at, owner = out.data_ptr(), out
    else:
        at, owner = taken
    if nbytes:
        _memmove(at, address, nbytes)
    return Snapshot(at, nbytes, dtype, shape, owner)


def _copy_out(src: torch.Tensor) -> Snapshot:
    """A contiguous CPU copy of ``src``'s values (in arena memory unless it is large)."""
    nbytes = src.numel() * src.element_size()
    if _movable(src):
        return _copy_bytes(src.data_ptr(), nbytes, src.dtype, tuple(src.shape))
    taken = ARENAS.take(nbytes) if src.is_cpu else None
    if taken is None:
        out = src.to("cpu", copy=True, memory_format=torch.contiguous_format) if not src.is_cpu \
            else src.clone(memory_format=torch.contiguous_format)
        if not out.is_contiguous():         # a dense non-contiguous source keeps its strides
            out = out.contiguous()
        return Snapshot(out.data_ptr(), nbytes, src.dtype, tuple(src.shape), out)
    at, arena = taken
    start = at - arena.data_ptr()
    arena[start:start + nbytes].view(src.dtype).view(src.shape).copy_(src)
    return Snapshot(at, nbytes, src.dtype, tuple(src.shape), arena)


def span_snapshot(t: torch.Tensor, start: int, length: int) -> Snapshot:
    """A private copy of ``length`` elements of ``t``'s storage from ``start``, as 1-D."""
    size = t.element_size()
    if type(t) in _PLAIN and t.is_cpu and t.layout == torch.strided and not t.is_conj() and not t.is_neg():
        # the span is contiguous storage whatever ``t``'s strides: copied from its address
        return _copy_bytes(t.data_ptr() + (start - t.storage_offset()) * size, length * size, t.dtype, (length,))
    with torch.no_grad():
        return _copy_out(t.detach().as_strided((length,), (1,), start))


def snapshot(t: torch.Tensor) -> Snapshot:
    """A private contiguous copy to save, taken now on the op's thread: a later in-place op
    must not change what is saved.  Of the values :mod:`.tensor_kinds` allows (the recorder saves
    nothing for a tensor whose record says ``no_values``)."""
    if _movable(t) and tensor_kinds.readable(t):
        return _copy_bytes(t.data_ptr(), t.numel() * t.element_size(), t.dtype, tuple(t.shape))
    with torch.no_grad(), no_functorch():
        return _copy_out(tensor_kinds.values(t).detach())


def nbytes(t) -> int:
    """The bytes a queued snapshot (or tensor) holds."""
    return t.nbytes if type(t) is Snapshot else t.numel() * t.element_size()


_ST_CODES = safetensors_codes()
_PAIRS = {torch.complex128: ("F64", torch.float64), torch.complex32: ("F16", torch.float16)}


def _bytes_of(t) -> memoryview:
    """The bytes of a snapshot (or of a tensor), read in place.  No torch call for a snapshot:
    the shard writer thread runs this per value, and each torch call would give the GIL away to
    the op thread and wait up to a switch interval (5 ms) to get it back."""
    if type(t) is not Snapshot:
        t = t.detach().to("cpu").contiguous()
        return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
    n = t.nbytes
    return memoryview((ctypes.c_ubyte * n).from_address(t.address)) if n else memoryview(b"")


def save_shard(tensors: dict, path) -> None:
    """Write a safetensors file straight from the snapshots' memory, then free their arenas.

    Bytes are never converted: a dtype safetensors has no code for is stored as its (re, im)
    pairs (complex128, complex32) or as raw bytes, with its dtype and shape in the file's
    metadata (``records.reader.read_safetensors`` restores them)."""
    entries, renamed = {}, {}
    codes = _ST_CODES
    for key, t in tensors.items():
        code, shape = codes.get(t.dtype), list(t.shape)
        if code is None:
            renamed[key] = json.dumps({"dtype": dtype_name(t.dtype), "shape": shape})
            if t.dtype in _PAIRS:
                code, shape = _PAIRS[t.dtype][0], shape + [2]
            else:
                code, shape = "U8", [nbytes(t)]
        entries[key] = (code, shape, _bytes_of(t))
    write_safetensors(entries, path, metadata=renamed)
    ARENAS.release(tensors.values())
