"""The statistics of many accelerator values in one launch: a *window* per device.

At an op's time each new value is copied, in memory order and in the dtype its statistics are
taken in (:func:`~dispatchprobe.standards.statistics.source_plan`), into the window's buffer for
that dtype: one copy launch, no kernel of its own, and the values are the op's even where a later
op overwrites them. When the window is full (:data:`WINDOW_VALUES` values, or a buffer's
:data:`WINDOW_BYTES`), its stream changes, or its rows are read, one launch per dtype reduces every
chunk of its values into partial rows (:data:`~dispatchprobe.standards.statistics.PARTIAL_FIELDS`:
the Triton table kernel of :mod:`.device_stats`, else torch's operations over all the chunks at
once), the rows are copied to pinned host memory without waiting, and an event marks them
arrived: :meth:`Pending.ready` asks the event, :meth:`Pending.values` waits for it (at a step's
end; the recorder reads arrived windows in between). Values above :data:`DIRECT_BYTES`, where a
launch costs little beside the values, and complex values are reduced at once by the per-value
path, and their rows are read back with the window's.

Both reductions sum in :func:`~dispatchprobe.standards.statistics.tree_sums`' order chunk by chunk,
so the records are the per-value path's and the CPU's, bit for bit.

Switches (module attributes, from the environment at import; tests and benchmarks set them):
:data:`WINDOW` (``DISPATCHPROBE_STATS_WINDOW=0``: each value reduced at its op, the per-value
path) and :data:`HOST_AS_DEVICE` (``DISPATCHPROBE_HOST_AS_DEVICE=1``: CPU values take the
accelerator path, so that it runs, and is tested, on a machine without an accelerator).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading

import numpy as np
import torch

from . import device_stats
from ..standards import statistics

WINDOW = os.environ.get("DISPATCHPROBE_STATS_WINDOW", "1").lower() not in ("0", "false", "no", "off")
HOST_AS_DEVICE = os.environ.get("DISPATCHPROBE_HOST_AS_DEVICE", "0").lower() in ("1", "true", "yes", "on")
WINDOW_VALUES = 256           # values per window
WINDOW_BYTES = 32 << 20       # one dtype's buffer
DIRECT_BYTES = 4 << 20        # values larger than this are reduced at their op

_FIELDS = len(statistics.PARTIAL_FIELDS)
_BLOCK = statistics.ROWS * statistics.LANES
_CHUNK = _BLOCK * statistics.CHUNK_BLOCKS
_LOCK = threading.Lock()
_OPEN: dict = {}              # device -> its open Window


class Pending:
    """One value's statistics: its partial rows, ``rows`` of them from ``at`` in its window's
    numbers once the window's rows are on the host."""

    __slots__ = ("window", "at", "rows")

    def __init__(self, window: "Window"):
        self.window = window
        self.at = self.rows = 0

    def ready(self) -> bool:
        """Whether :meth:`values` returns without waiting for the device."""
        return self.window.arrived()

    def values(self) -> list:
        """The value's partial rows, flat (launching its window if still open, waiting for it)."""
        flat = self.window.read()
        return flat[self.at:self.at + self.rows * _FIELDS]


class _Buffer:
    __slots__ = ("values", "used", "spans")

    def __init__(self, values: torch.Tensor):
        self.values = values
        self.used = 0
        self.spans: list = []       # (start, count, repeat, Pending)


class Window:
    """The values one device's ops gave since the last launch, on one stream."""

    def __init__(self, device: torch.device, stream):
        self.device, self.stream = device, stream
        self.buffers: dict = {}     # source dtype -> _Buffer
        self.direct: list = []      # (rows on the device, Pending) of values reduced at their op
        self.count = 0
        self.full = False
        self.host = None            # the rows, flat, on the host (pinned) once launched
        self.event = None
        self.flat: list | None = None

    def add(self, view: torch.Tensor, repeat: int, direct) -> Pending | None:
        """Take ``view`` (a tensor's distinct values, its dimensions in memory order, each standing
        for ``repeat`` elements); None, with nothing taken, when the window has no room for it."""
        plan = statistics.source_plan(view.dtype)
        pending = Pending(self)
        if plan == "abs" or view.numel() * view.element_size() > DIRECT_BYTES:
            self.direct.append((direct(view.reshape(-1), repeat), pending))
        else:
            dtype = view.dtype if plan == "keep" else getattr(torch, plan)
            buf = self.buffers.get(dtype)
            if buf is None:
                itemsize = torch.empty((), dtype=dtype).element_size()
                buf = self.buffers[dtype] = _Buffer(torch.empty(WINDOW_BYTES // itemsize, dtype=dtype,
                                                                device=self.device))
            n = view.numel()
            start = (buf.used + 15) & ~15        # each value's first element aligned
            if start + n > buf.values.shape[0]:
                self.full = True
                return None
            shape = view.shape
            strides, step = [], 1
            for k in reversed(shape):
                strides.append(step)
                step *= k
            buf.values.as_strided(shape, strides[::-1], start).copy_(view)
            buf.used = start + n
            buf.spans.append((start, n, repeat, pending))
        self.count += 1
        if self.count >= WINDOW_VALUES:
            self.full = True
        return pending

    def launch(self) -> None:
        """Reduce every value in the window and start copying the rows to the host."""
        parts, at = [], 0
        tables = []
        for dtype, buf in self.buffers.items():
            rows = []
            for start, n, repeat, pending in buf.spans:
                chunks = -(-n // _CHUNK)
                pending.at, pending.rows = at * _FIELDS, chunks
                for c in range(chunks):
                    rows.append((start + c * _CHUNK, min(_CHUNK, n - c * _CHUNK), repeat, at))
                    at += 1
            tables.append((buf, np.array(rows, dtype=np.int64).reshape(-1, 4)))
        with _on(self.stream):
            if at:
                out = torch.empty((at, _FIELDS), dtype=torch.float64, device=self.device)
                table = _to_device(np.concatenate([t for _, t in tables]), self.device) \
                    if uses_triton(self.device) else None
                first = 0
                for buf, t in tables:
                    if table is None or not _launched(buf.values, table[first:first + len(t)], out):
                        out[int(t[0, 3]):int(t[-1, 3]) + 1] = partial_rows(buf.values, t)
                    first += len(t)
                parts.append(out.reshape(-1))
            flat_at = at * _FIELDS
            for rows, pending in self.direct:
                pending.at, pending.rows = flat_at, rows.shape[0]
                flat_at += rows.numel()
                parts.append(rows.reshape(-1))
            flat = torch.cat(parts) if len(parts) > 1 else parts[0]
            if flat.is_cpu:
                self.host = flat
            else:
                self.host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
                self.host.copy_(flat, non_blocking=True)
                self.event = _event(self.device)
                self.event.record(self.stream)
        self.buffers, self.direct = {}, []       # the buffers go back to the allocator, on their stream

    def arrived(self) -> bool:
        return self.flat is not None or (self.host is not None and (self.event is None or self.event.query()))

    def read(self) -> list:
        if self.flat is None:
            if self.host is None:
                with _LOCK:
                    if _OPEN.get(self.device) is self:
                        del _OPEN[self.device]
                    if self.host is None:
                        self.launch()
            if self.event is not None:
                self.event.synchronize()
            self.flat = self.host.tolist()
        return self.flat


def add(view: torch.Tensor, repeat: int, direct) -> Pending:
    """Queue ``view``'s statistics in its device's window (:meth:`Window.add`); ``direct(seq,
    repeat)`` gives the partial rows on the device of a value reduced at once."""
    device = view.device
    stream = _stream(device)
    with _LOCK:
        window = _OPEN.get(device)
        if window is not None and window.stream != stream:
            del _OPEN[device]
            window.launch()
            window = None
        if window is None:
            window = _OPEN[device] = Window(device, stream)
        pending = window.add(view, repeat, direct)
        if pending is None:          # no room: launched, and the value goes to a new window
            window.launch()
            window = _OPEN[device] = Window(device, stream)
            pending = window.add(view, repeat, direct)
        if window.full:
            del _OPEN[device]
            window.launch()
    return pending


def launch_all() -> None:
    """Launch every open window (their rows then arrive on their own)."""
    with _LOCK:
        windows = list(_OPEN.values())
        _OPEN.clear()
        for window in windows:
            window.launch()


def partial_rows(values: torch.Tensor, table: np.ndarray) -> torch.Tensor:
    """What :func:`device_stats.launch_table` writes, with torch's operations over every chunk
    ``table`` lists at once (its rows: start in 1-D ``values``, values in the chunk, repeat, row):
    the chunks' ``(len(table), 11)`` float64 partial rows, sums in tree_sums' order."""
    device = values.device
    counts = table[:, 1]
    blocks = -(-counts // _BLOCK)
    chunk = np.repeat(np.arange(len(table)), blocks)
    pos = np.arange(chunk.shape[0]) - np.repeat(np.cumsum(blocks) - blocks, blocks)
    meta = np.stack([table[chunk, 0] + pos * _BLOCK, np.minimum(_BLOCK, counts[chunk] - pos * _BLOCK),
                     chunk * statistics.CHUNK_BLOCKS + pos])
    meta = _to_device(meta, device)
    first, count, slot = meta[0], meta[1], meta[2]
    lane = torch.arange(_BLOCK, device=device)
    inside = lane < count[:, None]
    raw = values[torch.where(inside, first[:, None] + lane, 0)]
    raw = torch.where(inside, raw, torch.zeros((), dtype=raw.dtype, device=device))   # a masked load's 0
    v = raw.double()
    nan, inf = v.isnan(), v.isinf()
    keep = inside & ~nan
    finite = keep & ~inf
    slots = len(table) * statistics.CHUNK_BLOCKS

    def per_chunk(per_block, fill, reduce):
        y = torch.full((slots,), fill, dtype=torch.float64, device=device).index_copy_(0, slot, per_block)
        return reduce(y.reshape(len(table), statistics.CHUNK_BLOCKS), 1)

    neg, pos_inf = -math.inf, math.inf
    cols = [per_chunk(torch.where(keep, v, neg).amax(1), neg, torch.amax),
            per_chunk(torch.where(keep, v, pos_inf).amin(1), pos_inf, torch.amin),
            per_chunk(torch.where(finite, v, neg).amax(1), neg, torch.amax),
            per_chunk(torch.where(finite, v, pos_inf).amin(1), pos_inf, torch.amin)]
    lanes = v if values.dtype == torch.float64 else raw.float()
    narrow = _chunk_sums(_fold(torch.stack([lanes, lanes * lanes])), slot, slots, len(table))
    wide = _chunk_sums(_fold(torch.stack([v, v * v])), slot, slots, len(table))
    counts = [per_chunk((inside & nan).sum(1).double(), 0.0, torch.sum),
              per_chunk((inside & inf).sum(1).double(), 0.0, torch.sum)]
    repeat = _to_device(table[:, 2].astype(np.float64), device)
    return torch.stack([*cols, narrow[0], narrow[1], *counts, wide[0], wide[1], repeat], dim=1)


def _fold(x: torch.Tensor) -> torch.Tensor:
    """Blocks of ROWS x LANES values (``(2, blocks, ROWS * LANES)``): rows added by halving, then
    lanes down to FOLDED_LANES, widened to float64 (tree_sums' block)."""
    x = statistics.halve(x.reshape(x.shape[0], x.shape[1], statistics.ROWS, statistics.LANES), 2, statistics.ROWS)
    while x.shape[-1] > statistics.FOLDED_LANES:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x.double()


def _chunk_sums(folded: torch.Tensor, slot: torch.Tensor, slots: int, chunks: int) -> torch.Tensor:
    """Each chunk's blocks (zeros where it has fewer) added by halving, then their lanes."""
    y = folded.new_zeros((2, slots, statistics.FOLDED_LANES)).index_copy_(1, slot, folded)
    y = statistics.halve(y.reshape(2, chunks, statistics.CHUNK_BLOCKS, statistics.FOLDED_LANES), 2,
                         statistics.CHUNK_BLOCKS)
    return statistics.halve(y, 2, statistics.FOLDED_LANES)


def uses_triton(device: torch.device) -> bool:
    """The Triton table kernel: on the devices Triton compiles for, and on the host where Triton's
    interpreter is on and the host stands for a device."""
    if not device_stats.kernels_loaded():
        return False
    return device.type in ("cuda", "xpu") or (device.type == "cpu" and HOST_AS_DEVICE
                                              and os.environ.get("TRITON_INTERPRET") == "1")


def _launched(values: torch.Tensor, table: torch.Tensor, out: torch.Tensor) -> bool:
    """Launch the Triton table kernel; False where it failed to compile or launch (the window is
    then reduced by torch's operations, which give the same rows)."""
    global triton_error
    if triton_error is not None:
        return False
    try:
        device_stats.launch_table(values, table, out)
        return True
    except Exception as err:       # noqa: BLE001 - a compiler or driver this kernel does not run on
        triton_error = err
        return False


triton_error: Exception | None = None    # why the table kernel is not used, once it failed


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` on ``device`` without waiting for it (from pinned memory)."""
    t = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _stream(device: torch.device):
    """The current stream of ``device`` (None on the host): a window's copies and launch share one."""
    if device.type == "cpu":
        return None
    if _CURRENT_STREAM is not None:
        return _CURRENT_STREAM(device)
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


# torch.accelerator's (torch >= 2.6); torch.cuda's before
_CURRENT_STREAM = getattr(getattr(torch, "accelerator", None), "current_stream", None)


def _on(stream):
    """``stream`` made current for a window's launch."""
    if stream is None:
        return contextlib.nullcontext()
    return stream if hasattr(stream, "__enter__") else torch.cuda.stream(stream)


def _event(device: torch.device):
    return torch.Event(device=device) if hasattr(torch, "Event") else torch.cuda.Event()
