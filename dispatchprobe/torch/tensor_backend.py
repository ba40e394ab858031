"""The torch :class:`~dispatchprobe.core.tensor_backend.TensorBackend`: what the framework-neutral recorder
asks of torch tensors (describe, statistics, identities and memory references, JSON encoding of
non-tensor arguments that ``replay`` turns back), with the snapshots and shards of
:mod:`.snapshots` and the inline-check primitives of :mod:`.perturb`.
"""

from __future__ import annotations

import ctypes
import gc
import math
import threading
import weakref
import zlib

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from . import collectives, device_batch, device_stats, fused_stats, tensor_kinds
from ..standards import statistics
from .internals.dispatch import no_functorch, set_grad_enabled
from .internals.tensors import MKLDNN, storage_expired, storage_from_weak, tensor_base, tensor_version
from .ops import dtype_name
from .process_state import STATE
from .snapshots import nbytes, save_shard, snapshot, span_snapshot  # noqa: F401 (the contract's members)

name = "torch"
version = torch.__version__

_MEMORY_FORMATS = {torch.contiguous_format: "contiguous_format", torch.channels_last: "channels_last",
                   torch.channels_last_3d: "channels_last_3d", torch.preserve_format: "preserve_format"}
_LAYOUTS = {torch.strided: "strided", torch.sparse_coo: "sparse_coo", MKLDNN: "mkldnn"}


def is_tensor(value) -> bool:
    return isinstance(value, torch.Tensor)


_PARAMETER = torch.nn.Parameter


def tensor_meta(t: torch.Tensor) -> dict:
    """The tensor as its op saw it; what :mod:`.tensor_kinds` adds for tensors that are not plain
    dense memory (a DTensor's placements, a functorch level, ``no_values`` and why)."""
    return describe(t)[0]


def traced_meta(t: torch.Tensor) -> dict:
    """The record's fields of a value a graph computes, from the fake tensor standing for it at
    trace time: those of the plain tensor it stands for (sizes may be symbolic)."""
    return _meta(t, type(t), t.dtype, t.shape, t.stride() if t.layout is _STRIDED else None, t.device, False)


def describe(t: torch.Tensor) -> tuple:
    """``(tensor_meta(t), identity(t), dense_key(t))`` in one pass over the tensor's attributes
    (the per-op path asks all three of every tensor): a plain tensor or parameter in allocated
    strided memory first, each attribute read once (:func:`_described_plain`)."""
    cls = type(t)
    if cls is _TENSOR or cls is _PARAMETER:
        described = _described_plain(t, cls)
        if described is not None:
            return described
    dtype, device, shape = t.dtype, t.device, t.shape
    readable = tensor_kinds.readable(t)
    stride = t.stride() if readable or t.layout is _STRIDED else None
    meta = _meta(t, cls, dtype, shape, stride, device, t.requires_grad)
    if not readable:
        meta.update(tensor_kinds.fields(t))
        return meta, None, None
    try:     # the data pointer is the storage's plus the view's offset
        ptr, version = t.data_ptr(), tensor_kinds.version(t)
    except (RuntimeError, NotImplementedError):  # inference tensors, wrapper subclasses
        return meta, None, None
    return (meta, *_key_pair(t, ptr, shape, stride, dtype, device, version))


def encode_values(found: list, values, other) -> list:
    """The record's entries of a sequence of an op's arguments (what the recorder's loop over
    them makes): plain tensors and parameters described here (:func:`_described_plain`, no call
    per tensor between), collected in ``found`` as ``(tensor, meta, identity, dense key)``; any
    other value by ``other(found, value)``."""
    out = []
    for v in values:
        cls = type(v)
        if cls is _TENSOR or cls is _PARAMETER:
            described = _described_plain(v, cls)
            if described is not None:
                meta, ident, dense = described
                found.append((v, meta, ident, dense))
                out.append(meta)
                continue
        out.append(other(found, v))
    return out


def _described_plain(t: torch.Tensor, cls) -> tuple | None:
    """:func:`describe` of a ``torch.Tensor`` or ``Parameter`` whose values are in allocated
    strided memory (what :func:`tensor_kinds.readable` accepts with a data pointer), or None
    for the general path (empty, no storage, other layouts, inference tensors)."""
    facts = _plain_facts(t, cls)
    if facts is None:
        return None
    ident, dense, look = facts
    return meta_of(look), ident, dense


def _plain_facts(t: torch.Tensor, cls) -> tuple | None:
    """``(identity, dense key, look)`` of a tensor :func:`_described_plain` takes, each attribute
    read once; ``look`` (sizes, strides, dtype, device, ``requires_grad``, whether a parameter or a
    view of one) is what its record entry shows besides statistics (:func:`meta_of`)."""
    try:
        ptr = t.data_ptr()
        # tensor_kinds.version, its common case inline (no write unseen by a version counter)
        version = tensor_kinds.version(t) if _unseen_writes else tensor_version(t)
    except (RuntimeError, NotImplementedError):
        return None
    if not ptr or t.layout is not _STRIDED or t.is_conj() or t.is_neg():   # bits: the general path
        return None
    dtype, device, shape, stride = t.dtype, t.device, tuple(t.shape), t.stride()
    # a parameter, or a view of one (_base: None)
    look = shape, stride, dtype, device, t.requires_grad, cls is _PARAMETER or type(tensor_base(t)) is _PARAMETER
    ident = ptr, shape, stride, dtype, device, version
    n = t.numel()
    if n and (t.is_contiguous() or _fills_block(shape, stride)):
        return ident, (ptr, n, dtype, device, version), look
    return ident, None, look


def line_facts(v) -> tuple | None:
    """:func:`_plain_facts` of ``v``, a plain tensor or parameter (:data:`LINE_TYPES`, which the
    recorder checks first), where it is in host memory (what the recorder writes from cached JSON
    pieces), else None."""
    facts = _plain_facts(v, type(v))
    if facts is None:
        return None
    device = facts[2][3]
    on_host = _ON_HOST.get(device)
    if on_host is None:
        on_host = _ON_HOST[device] = device.type == "cpu"
    return facts if on_host else None


def meta_of(look: tuple) -> dict:
    """The record's description of a tensor from its ``look`` (:func:`_plain_facts`)."""
    shape, stride, dtype, device, requires_grad, param = look
    meta = {"type": "tensor", "dtype": _DTYPE_NAMES.get(dtype) or dtype_name(dtype), "shape": list(shape),
            "stride": list(stride), "device": _DEVICE_NAMES.get(device) or _device_name(device),
            "requires_grad": requires_grad}
    if param:
        meta["param"] = True
    return meta


_TENSOR = torch.Tensor
LINE_TYPES = (_TENSOR, torch.nn.Parameter)      # the classes line_facts describes (not subclasses)
_unseen_writes = STATE.unseen_writes      # what tensor_kinds.version reads, read per tensor


def _meta(t, cls, dtype, shape, stride, device, requires_grad: bool) -> dict:
    """The record's description of a tensor (``stride`` None: a layout without strides)."""
    meta = {
        "type": "tensor",
        "dtype": _DTYPE_NAMES.get(dtype) or dtype_name(dtype),
        "shape": list(shape),
        "stride": list(stride) if stride is not None else None,
        "device": _DEVICE_NAMES.get(device) or _device_name(device),
        "requires_grad": requires_grad,
    }
    if cls is _PARAMETER or type(tensor_base(t)) is _PARAMETER:      # a model parameter, or a view of one
        meta["param"] = True
    return meta


_STRIDED = torch.strided
_ON_HOST: dict = {}          # device -> whether it is the host's
_DTYPE_NAMES = {d: dtype_name(d) for d in vars(torch).values() if isinstance(d, torch.dtype)}
_DEVICE_NAMES: dict = {}


def _device_name(device) -> str:
    name = _DEVICE_NAMES[device] = str(device)
    return name


def identity(t: torch.Tensor):
    """A key equal for two tensors only while they show the same bytes (same memory, same
    view, same in-place version).  The recorder pairs it with a weakref, so a key whose tensor
    died (and whose memory may be reused) is never trusted."""
    return _keys(t)[0]


def _keys(t: torch.Tensor) -> tuple:
    """(:func:`identity`, :func:`dense_key`) of ``t``."""
    if not tensor_kinds.readable(t):
        return None, None
    try:
        ptr, version, stride = t.data_ptr(), tensor_kinds.version(t), t.stride()
    except (RuntimeError, NotImplementedError):
        return None, None
    return _key_pair(t, ptr, t.shape, stride, t.dtype, t.device, version)


def _key_pair(t: torch.Tensor, ptr, shape, stride, dtype, device, version) -> tuple:
    """(identity, dense key) from the attributes already read: the dense key only where the
    view's elements fill one block of memory.  Plain tuples (not ``torch.Size``): CPython's first
    young collection stops tracking them, so the cache's keys are never walked again."""
    ident = _shown(t, ptr), tuple(shape), stride, dtype, device, version
    n = t.numel()
    if n and (t.is_contiguous() or _fills_block(shape, stride)):
        return ident, (ident[0], n, dtype, device, version)
    return ident, None


def _shown(t: torch.Tensor, ptr: int):
    """The memory's address, tagged where ``t`` shows it conjugated or negated (torch's lazy conj
    and neg bits): such a view shows other values than its base from the same bytes, so it must
    share neither the base's cache entry nor its saved copy (hfft2's c2r input was saved as the
    unconjugated c2c output, and run-ut judged its right output an error)."""
    conj, neg = t.is_conj(), t.is_neg()
    return (ptr, conj, neg) if conj or neg else ptr


def tensor_stats(tensors: list[torch.Tensor], keys: list | None = None) -> list[dict | None]:
    """The statistics records (:mod:`dispatchprobe.standards.statistics`) of each tensor: CPU
    tensors read back one by one, accelerator ones (:func:`device_stats_row`) in one host sync.
    Only the values :mod:`.tensor_kinds` allows (a DTensor's local shard; none for some kinds).
    ``keys``: each tensor's :func:`identity` where the caller has it (:func:`describe`), whose
    facts spare the per-op path reading the tensor's attributes again."""
    read = fused_stats.tree_rows
    if keys is not None and read is not None:
        records = _described_records(tensors, keys)
        if records is not None:
            return records
    native = [read is not None and t.dtype in _NATIVE_CODES and t.is_cpu and _in_memory(t) for t in tensors]
    out: list[dict | None] = [None] * len(tensors)
    taken = tensors if all(native) else [t for t, n in zip(tensors, native) if n]
    if taken:      # the values the library reads, in one call; finite values' records straight from its rows
        records = _native_records(taken, read(taken))
        if taken is tensors and None not in records:      # the common case: nothing left
            return records
        kept = iter(records)
        out = [next(kept) if n else None for n in native]
    declined = {i for i, n in enumerate(native) if n and out[i] is None}
    slow = [i for i, n in enumerate(native) if not n or i in declined]
    pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    with NoGrad(), no_functorch():    # unwrapped values stay unwrapped
        for i in slow:
            t = tensor_kinds.values(tensors[i])
            if t is None or t.numel() == 0:
                continue
            if stats_on_device(t):
                pending.append((i, t, device_stats_row(t)))
                continue
            out[i] = _cpu_stats(t, i in declined)
    if pending:
        rows = read_stats_rows([r for _, _, r in pending], [t.numel() for _, t, _ in pending])
        for (i, _, _), st in zip(pending, rows):
            out[i] = st
    return out


def line_stats(keys: list) -> list[dict] | None:
    """:func:`tensor_stats` of the host tensors :func:`line_facts` described, from their identity
    keys, where the native library reads them all and every value is finite, running no torch
    operation (the recorder calls it outside the probe's own-work marker); None otherwise, for
    the general path."""
    if fused_stats.tree_rows is None:
        return None
    if len(keys) == 1:          # most ops make one new value: its row without the lists
        one = _native_desc(keys[0])
        return None if one is None else _rows_records(fused_stats.described_rows(one[0], 1), [one[1]], None)
    read = _native_rows(keys)
    return None if read is None else _rows_records(*read, None)


def line_entry(t: torch.Tensor, stats: dict, piece: bytes) -> tuple:
    """The cache pair of a value :func:`line_facts` described, with its statistics and their JSON:
    :func:`cache_entry` of :func:`memory_ref` and ``{"stats", "json"}``, kept out of the garbage
    collector without asking (a reference without a callback, a dict of a dict of numbers and
    bytes: no cycle through any of them)."""
    ref = _storage_ref(t.untyped_storage())
    value = {"stats": stats, "json": piece}
    pair = (ref, value)
    if _untrack is not None and type(ref) is _MemoryRef:
        _untrack(id(ref))
        _untrack(id(value))
        _untrack(id(pair))
    return pair


# arguments whose record entry is a function of their value alone, made without running anything
CONSTANT_TYPES = (torch.dtype, torch.device, torch.layout, torch.memory_format)


def _described_records(tensors: list[torch.Tensor], keys: list) -> list[dict] | None:
    """:func:`tensor_stats` of readable CPU tensors the native library reads, from their identity
    keys (data pointer, sizes, strides, dtype, device: what :func:`fused_stats.rows` reads) in one
    call; None, with nothing measured, where one tensor is another case (the general path)."""
    read = _native_rows(keys)
    return None if read is None else _rows_records(*read, tensors)


def _rows_records(flat, numels: list, tensors: list | None) -> list[dict] | None:
    """The statistics records of :func:`_native_rows`' rows: finite values' from the row's numbers,
    the others from their tensors (:func:`_native_record`); None where the library declined one,
    or (``tensors`` None: no torch operation may run) where one holds a value not finite."""
    finite, sqrt = statistics.finite_record, math.sqrt
    out = []
    at = 0
    for i, n in enumerate(numels):
        if flat[at] == _FINITE:
            out.append(finite(flat[at + 1], flat[at + 2], flat[at + 3], sqrt(flat[at + 4]), n))
        elif tensors is None:
            return None
        else:
            record = _native_record(tensors[i], flat[at:at + _ROW].tolist())
            if record is None:        # declined (no dimension of stride 1, inexact integer sums)
                return None
            out.append(record)
        at += _ROW
    return out


def _native_rows(keys: list) -> tuple | None:
    """The library's rows of the tensors whose identity keys are ``keys`` (read in one call) and
    their element counts; None, with nothing read, where one is not a host tensor in memory of a
    dtype the library reads."""
    desc: list = []
    numels = []
    for key in keys:
        one = _native_desc(key) if key is not None else None
        if one is None:
            return None
        desc += one[0]
        numels.append(one[1])
    return fused_stats.described_rows(desc, len(keys)), numels


def _native_desc(key) -> tuple | None:
    """What the library reads of the tensor whose identity key is ``key`` (data pointer, dtype
    code, number of dimensions, sizes, strides) and its element count; None where it is not a
    host tensor in memory of a dtype the library reads."""
    ptr, shape, stride, dtype, device, _ = key
    if type(ptr) is not int:        # shown conjugated or negated (_shown): its bytes are not its values
        return None
    code = _NATIVE_CODES.get(dtype)
    n = math.prod(shape)
    on_host = _ON_HOST.get(device)
    if on_host is None:      # device.type builds a new string per call: asked once per device
        on_host = _ON_HOST[device] = device.type == "cpu"
    if code is None or not ptr or not n or not on_host:
        return None
    return (ptr, code, len(shape), *shape, *stride), n


def _native_records(tensors: list[torch.Tensor], flat) -> list[dict | None]:
    """The records of ``tensors`` from the library's rows ``flat``: finite values' straight from
    the row's numbers, the others by :func:`_native_record`; None where the library declined."""
    finite, sqrt = statistics.finite_record, math.sqrt
    out = []
    at = 0
    for t in tensors:
        if flat[at] == _FINITE:
            out.append(finite(flat[at + 1], flat[at + 2], flat[at + 3], sqrt(flat[at + 4]), t.numel()))
        else:
            out.append(_native_record(t, flat[at:at + _ROW].tolist()))
        at += _ROW
    return out


class NoGrad:
    """``torch.no_grad()`` for the per-op path, without its decorator machinery (a third of
    the cost); not re-entrant per instance, so one is made per use."""

    __slots__ = ("prev",)

    def __enter__(self):
        self.prev = torch.is_grad_enabled()
        set_grad_enabled(False)

    def __exit__(self, *exc):
        set_grad_enabled(self.prev)


def _sequence(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x``'s distinct elements as a 1-D tensor in the order they lie in memory (the order
    :func:`statistics.tree_sums` and the C++ kernel sum them; a copy only where they are not one
    run), and how many elements each stands for (the product of expanded dimensions)."""
    view, repeat = _memory_order(x)
    return view.reshape(-1), repeat


def _memory_order(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """:func:`_sequence` as a view, never a copy: ``x``'s distinct elements with its dimensions
    ordered by stride (``x`` itself where contiguous), and the repeat."""
    if x.is_contiguous():
        return x, 1
    dims = [(s, k) for s, k in zip(x.stride(), x.shape) if k != 1]
    repeat = math.prod(k for s, k in dims if s == 0)
    kept = sorted((s, k) for s, k in dims if s != 0)[::-1]
    return x.as_strided([k for _, k in kept], [s for s, _ in kept]), repeat


def _fills_block(shape, stride) -> bool:
    """Whether strided elements of these sizes and strides (already read off the tensor) fill one
    block of memory, without gap or overlap: a transposed weight's do, a slice's do not."""
    expected = 1
    for step, size in sorted(zip(stride, shape)):
        if size != 1:
            if step != expected:
                return False
            expected *= size
    return True


def _in_memory(t: torch.Tensor) -> bool:
    """Whether ``t`` has values in allocated strided memory to read (:func:`tensor_kinds.readable`
    and not empty), plain tensors and parameters first."""
    if type(t) is _TENSOR or type(t) is _PARAMETER:
        try:
            return t.data_ptr() != 0 and t.layout is _STRIDED and t.numel() != 0
        except (RuntimeError, NotImplementedError):
            return False
    return t.numel() != 0 and tensor_kinds.readable(t)


def _native_fits(x: torch.Tensor) -> bool:
    """Whether the native library (:mod:`.fused_stats`) is loaded and reads ``x``'s dtype (float32
    and bfloat16 in any layout with a dimension of stride 1, expanded or permuted too; integers
    and bools in any layout, where their sums are exact)."""
    return fused_stats.tree_rows is not None and x.dtype in _NATIVE_CODES


def _native_record(x: torch.Tensor, row, repeat: int = 1) -> dict | None:
    """The record of ``x`` from its native row (:data:`fused_stats.ROW`), each element standing for
    ``repeat``: made by ``standards/statistics`` from the row's numbers (values holding inf or nan
    from their counts and finite max and min).  None where the library declined ``x``."""
    kind, hi, lo, total, squares = row[0], row[1], row[2], row[3] * repeat, row[4] * repeat
    if kind == _FINITE:
        return statistics.finite_record(hi, lo, total, math.sqrt(squares), x.numel() * repeat)
    if kind == _NONFINITE:
        return statistics.nonfinite_record(total, squares, int(row[5]) * repeat, int(row[6]) * repeat, row[7], row[8],
                                           row[9], row[10], x.numel() * repeat)
    if kind == _OVERFLOWED:     # finite values whose float32 lanes overflowed: finish sums them in float64 lanes
        seq, inner = _sequence(x.detach())
        return statistics.finish(seq, [hi, lo, total, math.sqrt(squares)], torch, repeat * inner)
    return None


def _native_one(x: torch.Tensor, repeat: int = 1) -> dict | None:
    """:func:`_native_record` of one tensor (None: not loaded, another dtype, or declined)."""
    if not (_native_fits(x) and x.numel()):
        return None
    return _native_record(x, fused_stats.tree_rows([x]), repeat)


def _cpu_stats(t: torch.Tensor, native_declined: bool = False) -> dict:
    st = None if native_declined or not tensor_kinds.readable(t) else _native_one(t)
    if st is not None:
        return st
    seq, repeat = _sequence(t.detach())
    x = statistics.source(seq, torch)
    st = _native_one(x, repeat)
    if st is not None:
        return st
    if x.numel() <= _NUMPY_MAX and x.dtype in _NUMPY_DTYPES:
        flat = _numpy_copy(x)
        with np.errstate(all="ignore"):   # no numpy warning may reach the user's code (-W error)
            hi, lo = float(_max(flat)), float(_min(flat))
        total, squares = statistics.sums(flat, np)
    else:
        lo_, hi_ = torch.aminmax(x)
        hi, lo = hi_.item(), lo_.item()
        total, squares = statistics.sums(x, torch)
    return complete_stats(x, [hi, lo, total * repeat, math.sqrt(squares * repeat)], repeat)


def complete_stats(x: torch.Tensor, values: list, repeat: int = 1) -> dict:
    """The record of :func:`statistics.source` values ``x`` (1-D, in memory order, each standing
    for ``repeat`` elements) from their (max, min, sum, L2 norm), counting nan/inf and their
    finite max/min where those show any."""
    hi, lo = values[0], values[1]
    if math.isnan(hi) or math.isnan(lo) or math.isfinite(hi) and math.isfinite(lo):
        return statistics.finish(x, values, torch, repeat)
    return _with_infinities(x, values, repeat)


def _with_infinities(x: torch.Tensor, values: list, repeat: int = 1) -> dict:
    """:func:`statistics.finish` for values holding infinities but no nan (a causal mask's
    ``-inf``), the same record in far fewer passes: a count and a masked max/min per sign."""
    hi, lo, total, norm = values
    n = x.numel() * repeat
    stats = {"max": hi + 0.0, "min": lo + 0.0, "mean": total / n, "norm": norm, "nan": 0, "inf": 0}
    inf = 0
    finite_max, finite_min = hi, lo
    if hi == math.inf:
        pos = x == math.inf
        inf += int(pos.sum()) * repeat
        finite_max = float(x.masked_fill(pos, -math.inf).max())
    if lo == -math.inf:
        neg = x == -math.inf
        inf += int(neg.sum()) * repeat
        finite_min = float(x.masked_fill(neg, math.inf).min())
    stats["inf"] = inf
    if inf < n:
        stats["finite_max"], stats["finite_min"] = finite_max + 0.0, finite_min + 0.0
    return stats


def clone(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``'s values now, outside autograd (for a record of what an op overwrites)."""
    with NoGrad():
        return t.clone()


def stats_on_device(t: torch.Tensor) -> bool:
    """Whether ``t``'s statistics are best reduced on its (accelerator) device and read later
    (CPU values too where :data:`device_batch.HOST_AS_DEVICE` is set)."""
    return (not t.is_cpu or device_batch.HOST_AS_DEVICE) and t.numel() > 0 and tensor_kinds.values(t) is not None


def device_stats_row(t: torch.Tensor):
    """The statistics of ``t`` on its device, no host sync (:func:`read_stats_rows` reads many at
    once): its values copied now into its device's window (:mod:`.device_batch`), reduced with
    many others in one launch; or, with the window off, partial rows
    (:data:`statistics.PARTIAL_FIELDS`) of its values in memory order now (:func:`row_now`).
    Every path sums in :func:`statistics.tree_sums`' order: the record is the one the CPU gives."""
    with NoGrad():        # nothing here is differentiated: no detach, no decorator machinery
        view, repeat = _memory_order(tensor_kinds.values(t))
        if device_batch.WINDOW:
            return device_batch.add(view, repeat, row_now)
        return row_now(view.reshape(-1), repeat)


def row_now(seq: torch.Tensor, repeat: int = 1) -> torch.Tensor:
    """The partial rows of 1-D ``seq`` on its device now: one kernel launch where
    :mod:`.device_stats` can take them, else torch's operations."""
    fused = device_stats.row(seq, repeat)
    return fused if fused is not None else torch_stats_row(seq, repeat)


def torch_stats_row(seq: torch.Tensor, repeat: int = 1) -> torch.Tensor:
    """:func:`device_stats_row` with torch's operations (any device): one partial row of 1-D
    ``seq`` (values in memory order, each standing for ``repeat``)."""
    with torch.no_grad():
        x = statistics.source(seq, torch)     # floating point
        nan, inf = torch.isnan(x), torch.isinf(x)
        kept = x.masked_fill(nan, -math.inf), x.masked_fill(nan, math.inf)
        finite = x.masked_fill(nan | inf, -math.inf), x.masked_fill(nan | inf, math.inf)
        sums, wide = statistics.tree_sums(x, torch), statistics.tree_sums(x, torch, wide=True)
        one = [kept[0].max(), kept[1].min(), finite[0].max(), finite[1].min(), sums[0], sums[1], nan.sum(),
               inf.sum(), wide[0], wide[1], torch.full((), float(repeat), dtype=torch.float64, device=x.device)]
        return torch.stack([v.double() for v in one]).reshape(1, -1)


def stats_ready(rows: list) -> int:
    """How many of the leading ``rows`` (:func:`device_stats_row`'s) :func:`read_stats_rows` reads
    without waiting for the device: their window's rows have arrived on the host (rows reduced
    on the host are there already; a compiled graph's rows on a device are read at a flush)."""
    n = 0
    window = None
    for row in rows:
        if type(row) is _PENDING:
            if row.window is not window:
                if not row.window.arrived():
                    break
                window = row.window
        elif not row.is_cpu:
            break
        n += 1
    return n


_PENDING = device_batch.Pending


def read_stats_rows(rows: list, numels: list[int]) -> list[dict]:
    """Read many :func:`device_stats_row` results with one host sync per device (per window still
    on its way): partial rows, combined here, or rows of 6 (a compiled graph's)."""
    by_device: dict = {}
    values: list = [None] * len(rows)
    width = len(statistics.PARTIAL_FIELDS)
    if any(type(row) is _PENDING and row.window.host is None for row in rows):
        device_batch.launch_all()        # every window on its way before the first wait
    for i, row in enumerate(rows):
        if type(row) is _PENDING:
            flat = row.values()
            values[i] = statistics.row_from_partials([flat[j:j + width] for j in range(0, len(flat), width)])
        else:
            by_device.setdefault(row.device, []).append(i)
    for idx in by_device.values():
        flat = torch.cat([rows[i].reshape(-1) for i in idx]).tolist()
        at = 0
        for i in idx:
            r = rows[i]
            size = r.numel()
            values[i] = flat[at:at + size] if r.dim() == 1 else \
                statistics.row_from_partials([flat[j:j + width] for j in range(at, at + size, width)])
            at += size
    return [statistics.from_row(v, n) for v, n in zip(values, numels)]


_NATIVE_CODES = fused_stats.DTYPE_CODES       # the dtypes the native library reads
_ROW, _FINITE, _NONFINITE, _OVERFLOWED = fused_stats.ROW, fused_stats.FINITE, fused_stats.NONFINITE, fused_stats.OVERFLOWED

# Small CPU float tensors: numpy's reductions cost less dispatch than torch's.
_NUMPY_MAX = 16384
_NUMPY_DTYPES = (torch.float32, torch.float64)


_max, _min, _add = np.maximum.reduce, np.minimum.reduce, np.add.reduce
_host = threading.local()     # per thread: {dtype: (numpy buffer, the torch tensor sharing it)}


def _numpy_copy(x: torch.Tensor) -> np.ndarray:
    """``x``'s values in a private numpy buffer: ``x.numpy()`` would make the user's storage
    non-resizable for good (FSDP2 frees parameters by resizing their storage to 0)."""
    buffers = getattr(_host, "buffers", None)
    if buffers is None:
        buffers = _host.buffers = {}
    pair = buffers.get(x.dtype)
    if pair is None:
        arr = np.empty(_NUMPY_MAX, dtype=np.float64 if x.dtype == torch.float64 else np.float32)
        pair = buffers[x.dtype] = (arr, torch.from_numpy(arr))
    n = x.numel()
    pair[1][:n].copy_(x.view(-1))
    return pair[0][:n]


def checksum(t: torch.Tensor) -> str:
    """CRC32 of the tensor's bytes in C order (fast; equal bytes give equal sums), read from a
    private copy (see :func:`_numpy_copy`)."""
    with no_functorch():
        x = tensor_kinds.values(t).detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
    if x.dtype in (torch.bfloat16,) or x.dtype.is_floating_point and x.element_size() == 1:
        x = x.view(torch.uint16 if x.element_size() == 2 else torch.uint8)
    return f"crc32:{zlib.crc32(x.reshape(-1).numpy().tobytes()):08x}"


_aten = torch.ops.aten


def same_values(event) -> dict:
    """Outputs that hold exactly an input's values in the same shape and dtype (``clone``,
    ``contiguous``, a same-dtype ``_to_copy``, ``copy_``): {id(output): input}.  Lets the
    recorder store such an output as the input's saved data instead of a second copy."""
    packet = getattr(event.func, "overloadpacket", None)
    args, out = event.args, event.outputs
    if not isinstance(out, torch.Tensor) or not args:
        return {}
    if packet in (_aten.clone, _aten.contiguous, _aten._to_copy):
        src = args[0]
    elif packet is _aten.copy_ and len(args) > 1:
        src = args[1]
    else:
        return {}
    if isinstance(src, torch.Tensor) and src.dtype == out.dtype and src.shape == out.shape:
        return {id(out): src}
    return {}


def copied_from(func, args, out):
    """The argument whose values ``out``, a plain tensor, holds bit for bit, lying in memory as they
    do (``clone``, a same-dtype ``_to_copy``, ``copy_``, between equal dtypes, sizes, strides and
    devices, in memory not shared): its statistics are ``out``'s, the sums running in memory
    order.  None otherwise."""
    known = _COPY_SOURCE.get(id(func))
    if known is None:
        packet = getattr(func, "overloadpacket", None)
        known = _COPY_SOURCE[id(func)] = func, (1 if packet is _aten.copy_ else
                                                0 if packet in (_aten.clone, _aten._to_copy) else -1)
    at = known[1]
    if at < 0 or len(args) <= at:
        return None
    src = args[at]
    cls = type(src)
    if (cls is not _TENSOR and cls is not _PARAMETER) or type(out) is not _TENSOR and type(out) is not _PARAMETER:
        return None
    if src.dtype != out.dtype or src.shape != out.shape or src.stride() != out.stride() or src.device != out.device:
        return None
    if src.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
        return None
    return src


# id(overload) -> (the overload, held so that its id stays its own; the index of the argument it
# copies, or -1): keyed by id, as an overload's hash is a Python method
_COPY_SOURCE: dict = {}


def shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def memory_ref(t: torch.Tensor):
    """A weak reference to ``t``'s memory (None if it has none): while it is alive, no other
    tensor can be given the same address, so an address-based cache key stays truthful.  A weak
    reference neither keeps the memory nor stops its owner from resizing it (FSDP2), so it holds
    the address its storage had too: a storage resized to 0 (and perhaps back, elsewhere) lives
    on, but the memory it gave back may be another tensor's now (:func:`memory_alive`).

    torch keeps a storage's Python object for as long as the storage lives, so a Python weak
    reference to that object lives exactly as long as the memory, and the storage is freed as
    it would be unprobed.  (``StorageWeakRef``, used where torch does not, keeps each storage's
    C++ object until the reference goes: thousands a step, left among the freed activations, they
    make the C heap grow and shrink, with page faults, several times a step.)"""
    if not tensor_kinds.readable(t):
        return None
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return _storage_ref(storage)


def _storage_ref(storage):
    """:func:`memory_ref` of a storage."""
    if not _STORAGE_OBJECTS_KEPT:
        return _StorageRef(storage)
    ref = _MemoryRef(storage)       # its address set here: a Python __init__ would double the cost
    ref.ptr = storage.data_ptr()
    return ref


class _MemoryRef(weakref.ref):
    """A weak reference to a storage's Python object and (``ptr``) the address of its memory then."""

    __slots__ = ("ptr",)


class _StorageRef(StorageWeakRef):
    """:class:`_MemoryRef` where torch does not keep storages' Python objects."""

    __slots__ = ("ptr",)

    def __init__(self, storage):
        super().__init__(storage)
        self.ptr = storage.data_ptr()


def cache_entry(ref, value) -> tuple:
    """``(ref, value)`` for the recorder's cache, with Python's cyclic garbage collector told not to
    follow the pair, its weak reference and its entry where none can be part of a cycle (a
    reference without a callback, an entry holding only values the collector does not track: the
    statistics, which CPython leaves untracked as dictionaries of numbers): a step caches hundreds
    of values, which every collection would otherwise walk.  The pair needs its own call: CPython
    untracks a tuple by itself only where it holds no dict or weak reference."""
    pair = (ref, value)
    if _untrack is not None and type(ref) is _MemoryRef and type(value) is dict and ref.__callback__ is None \
            and not any(map(_tracked, value.values())):
        if _tracked(ref):           # one reference serves a value's entries under both its keys
            _untrack(id(ref))
        if _tracked(value):         # a statistics record is untracked already
            _untrack(id(value))
        _untrack(id(pair))
    return pair


def _untracker():
    """CPython's ``PyObject_GC_UnTrack`` (public C API), given an object's address (``id``; the
    caller holds the object), or None on another Python.  A prototype taking an address costs
    half a call through ``pythonapi`` with a ``py_object`` argument."""
    try:
        return ctypes.PYFUNCTYPE(None, ctypes.c_void_p)(("PyObject_GC_UnTrack", ctypes.pythonapi))
    except (AttributeError, ValueError):
        return None


_untrack = _untracker()
_tracked = gc.is_tracked


def memory_alive(ref) -> bool:
    """Whether the memory :func:`memory_ref` saw is still its storage's: the storage lives and
    holds the same address (FSDP2 frees its unsharded parameters' memory by resizing their
    storage to 0 and keeps the storage; a new tensor may be given that address meanwhile)."""
    if ref is None:
        return False
    if _STORAGE_OBJECTS_KEPT:
        storage = ref()
        return storage is not None and storage.data_ptr() == ref.ptr
    return not _expired(ref.cdata) and storage_from_weak(ref.cdata).data_ptr() == ref.ptr


def memory_address(ref) -> int:
    """The address of the memory :func:`memory_ref` saw (every view of one storage shares it)."""
    return ref.ptr


def _storage_objects_kept() -> bool:
    """Whether this torch keeps a storage's Python object alive exactly as long as the storage."""
    t = torch.empty(1)
    ref = _weak(t.untyped_storage())
    kept = ref() is not None and _weak(t.view(1).untyped_storage())() is ref()
    del t
    return kept and ref() is None


_weak = weakref.ref
_expired = storage_expired     # StorageWeakRef.expired, two calls fewer
_STORAGE_OBJECTS_KEPT = _storage_objects_kept()


def moved_keys(t: torch.Tensor, before) -> tuple | None:
    """(identity, dense key) of ``t`` at version ``before`` and now, where its in-place counter
    has moved exactly one on since (autograd's count of the write an op just made, nothing
    else); None otherwise."""
    now = tensor_kinds.version(t)
    if type(before) is tuple:
        if type(now) is not tuple or now[0] != before[0] + 1 or now[1] != before[1]:
            return None
    elif now != before + 1:
        return None
    ident, dense = _keys(t)
    if ident is None:
        return None
    return (ident[:-1] + (before,), ident, dense[:-1] + (before,) if dense is not None else None, dense)


def dense_key(t: torch.Tensor):
    """A key shared by all views that show exactly the same set of elements of one memory
    (a reshape or transpose of it): they have the same statistics.  None if not dense."""
    return _keys(t)[1]


def storage_span(t: torch.Tensor):
    """Where ``t`` lives in its storage, for saving shared memory once.

    Returns ``(span_key, start, length, offset, stride, plain)``: the 1-D span of storage to save
    (the whole storage when ``t`` covers most of it, so sibling views such as q/k/v share one
    copy) and ``t``'s offset and stride in it; ``plain``: ``t`` is exactly the span, contiguous.
    None when ``t`` touches a small part of a large storage (saved as its own compact copy)."""
    if t.numel() == 0 or not tensor_kinds.readable(t) or t.is_conj() or t.is_neg():
        return None         # its bytes are not its values (lazy conj/neg): a compact copy of its own
    try:
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):
        return None
    size, numel, stride = t.element_size(), t.numel(), t.stride()
    total = nbytes // size
    own_start = t.storage_offset()
    contiguous = t.is_contiguous()
    own_len = numel if contiguous else 1 + sum((n - 1) * s for n, s in zip(t.shape, stride))
    if total <= 4 * numel:
        start, length = 0, total
    elif own_len <= 2 * numel:
        start, length = own_start, own_len
    else:
        return None
    key = (ptr, start, length, t.dtype, t.device, tensor_kinds.version(t))
    plain = own_start == start and length == numel and contiguous
    return key, start, length, own_start - start, list(stride), plain


def encode_other(value) -> dict:
    """Non-tensor, non-builtin arguments, as JSON the replay can turn back into torch objects."""
    if isinstance(value, torch.dtype):
        return {"type": "dtype", "value": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"type": "device", "value": str(value)}
    if isinstance(value, torch.memory_format):
        return {"type": "memory_format", "value": _MEMORY_FORMATS.get(value, str(value))}
    if isinstance(value, torch.layout):
        return {"type": "layout", "value": _LAYOUTS.get(value, str(value))}
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return {"type": type(value).__name__[3:].lower(), "value": value.node.hint if hasattr(value, "node") else None}
    if isinstance(value, torch.Generator):
        return {"type": "generator", "device": str(value.device)}
    if isinstance(value, torch.ScriptObject):     # c10d's process groups and reduce ops, ...
        return collectives.encode_script_object(value)
    if isinstance(value, collectives.GroupName):
        return collectives.encode_group_name(value)
    return {"type": "other", "repr": repr(value)[:200]}


def accelerator() -> str:
    """The device a run is on, for the manifest: an accelerator this machine has (cuda, npu, any
    torch.accelerator), else cpu; a CUDA build on a machine without a GPU is cpu."""
    from .devices import default_device
    return default_device()


def dtype_of(t: torch.Tensor) -> str:
    return dtype_name(t.dtype)


def numel(t: torch.Tensor) -> int:
    return t.numel()


# ---- the rest of the contract: op traits and the inline-check primitives ------------------------
from .ops import is_random, returns_alias, user_stack  # noqa: E402,F401
from .perturb import (  # noqa: E402,F401
    all_finite, bit_noise, cast_args, change_value_plan, changes, clone, concat, detach, device_type,
    dtype_max, eps, float_outputs, float_tensors, generator, input_grads, map_floats, max_abs_finite,
    noise_source, nonfinite_counts, on_host, protect_written, read, replacement, run, saturated, scratch, sq_norm,
    surely_within, swap_tensors, to_device_of, versions, within_limits)
