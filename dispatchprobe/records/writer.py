"""Writes records to disk: append-only JSON lines, tensors in safetensors shards.

Why this shape (see docs/record-format.md):
* ``ops.jsonl`` gets one line per op, written and flushed as the op finishes, so a process that
  is killed leaves every record up to the op it died in.  No fsync per op: a killed process
  loses nothing the OS already has; a power cut is out of scope.
* Tensors are copied on the op's thread (the value must be snapshotted before a later in-place
  op changes it) and written by one background thread into shards of ~64 MB.  A shard becomes
  visible only by an atomic rename, and only then is it listed in ``tensors/index.jsonl``: a
  reader never sees half a shard.
* The manifest is written whole (temp + rename) once a run starts.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import socket
import threading
import time
from operator import countOf as _count_of
from typing import Any, Callable

import numpy as np

from . import part_summary
from .format import CLOSED_MARKER, FORMAT_NAME, FORMAT_VERSION

try:  # serialises a record ~9x faster than the stdlib; every line still reads as the stdlib writes it
    import orjson as _orjson
    _ORJSON_OPTIONS = (_orjson.OPT_APPEND_NEWLINE | _orjson.OPT_PASSTHROUGH_SUBCLASS
                       | _orjson.OPT_PASSTHROUGH_DATACLASS | _orjson.OPT_PASSTHROUGH_DATETIME)
    _PIECE_OPTIONS = _ORJSON_OPTIONS & ~_orjson.OPT_APPEND_NEWLINE
except ImportError:  # pragma: no cover - a broken install: the stdlib still works
    _orjson = None

SHARD_BYTES = 64 << 20
SHARD_SECONDS = 2.0


def atomic_write_text(path: str, text: str) -> None:
    """Write a whole file so that readers see the old file or the new one, never a mix."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_manifest(run_dir: str, *, framework: str, framework_version: str, device: str,
                   config: dict, extra: dict | None = None) -> None:
    os.makedirs(run_dir, exist_ok=True)
    manifest = make_manifest(framework=framework, framework_version=framework_version, device=device, config=config,
                             extra=extra)
    atomic_write_text(os.path.join(run_dir, "manifest.json"), json.dumps(manifest, indent=1, default=str))


def make_manifest(*, framework: str, framework_version: str, device: str, config: dict,
                  extra: dict | None = None) -> dict:
    """A run's manifest (docs/record-format.md); online run-ut sends it as a stream's first frame."""
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "framework": framework,
        "framework_version": framework_version,
        "device": device,
        "config": config,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "marks_closed_parts": True,     # each closed step/rank folder holds CLOSED_MARKER
        "marks_ended_ranks": True,      # a closed probe leaves ended_marker(rank) in the run directory
        "world_size": launcher_world_size(),
        **(extra or {}),
    }


def launcher_world_size() -> int:
    """The launcher's world size (torchrun's WORLD_SIZE, MindSpore's RANK_SIZE), else 1."""
    for var in ("WORLD_SIZE", "RANK_SIZE"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


def write_csv(path: str, header, rows) -> None:
    """A whole CSV file, atomically (temp + rename): readers never see half a table."""
    import csv
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    os.replace(tmp, path)


def write_safetensors(entries: dict, path: str, metadata: dict | None = None) -> None:
    """Write ``{key: (dtype_code, shape, buffer)}`` as a safetensors file, without copying;
    ``metadata`` ({key: dtype name}) names the real dtype of entries stored in another form.

    Not the library's ``save_file``: it copies every tensor into a bytes object first and
    refuses tensors that share memory (our snapshots share recycled arenas).  Files are read by
    ``reader.read_safetensors`` and by the library."""
    header: dict = {"__metadata__": {k: str(v) for k, v in metadata.items()}} if metadata else {}
    offset = 0
    for key, (code, shape, buf) in entries.items():
        size = buf.nbytes
        header[key] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    parts = [len(head).to_bytes(8, "little") + head, *(buf for _, _, buf in entries.values())]
    if not isinstance(path, (str, os.PathLike)):  # a binary file object (online run-ut encodes into memory)
        for part in parts:
            path.write(part)
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        _write_all(fd, parts)
    finally:
        os.close(fd)


def _write_all(fd: int, parts: list) -> None:
    """Write every buffer of ``parts`` with as few ``writev`` calls as the OS allows: the shard
    writer thread then takes the GIL back once per call, not once per tensor."""
    parts = [p if isinstance(p, memoryview) else memoryview(p) for p in parts]
    parts = [p.cast("B") if p.format != "B" or p.ndim != 1 else p for p in parts if p.nbytes]
    i = 0
    while i < len(parts):
        done = os.writev(fd, parts[i:i + _IOV_MAX]) if _HAS_WRITEV else os.write(fd, parts[i])
        while i < len(parts) and done >= parts[i].nbytes:   # a write may end mid-buffer
            done -= parts[i].nbytes
            i += 1
        if done:
            parts[i] = parts[i][done:]


def _iov_max() -> int:
    try:
        n = os.sysconf("SC_IOV_MAX")       # -1: no stated limit
    except (AttributeError, ValueError, OSError):
        n = -1
    return min(n, 1024) if n > 0 else 16


_HAS_WRITEV = hasattr(os, "writev")      # not on Windows: one write per buffer there
_IOV_MAX = _iov_max()


_NUMPY_CODES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64", "int8": "I8",
                "int16": "I16", "int32": "I32", "int64": "I64", "uint8": "U8", "bool": "BOOL"}


def save_numpy_shard(arrays: dict, path: str) -> None:
    """A shard of numpy snapshots (adapters whose tensors are saved as host arrays); complex
    values as (re, im) float pairs, their dtype in the metadata as ``save_shard`` does."""
    entries, renamed = {}, {}
    for key, a in arrays.items():
        kind, shape = str(a.dtype), list(a.shape)
        if kind.startswith("complex"):
            renamed[key] = json.dumps({"dtype": kind, "shape": shape})
            a, kind, shape = a.view(np.float32 if kind == "complex64" else np.float64), \
                "float32" if kind == "complex64" else "float64", shape + [2]
        entries[key] = (_NUMPY_CODES[kind], shape, memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8)))
    write_safetensors(entries, path, metadata=renamed)


class WriteFailed(OSError):
    """Records could not be written (disk full, quota, file size limit): the probe stops
    recording and training goes on; what was written before stays readable."""


def _refuse(obj):
    raise TypeError(type(obj).__name__)


def json_line(obj: dict) -> bytes:
    """``obj`` as one JSON line (UTF-8, ending in a newline) that reads back exactly as the stdlib's
    ``json.dumps(obj, default=str)`` would: non-finite floats as ``NaN``/``Infinity``.

    orjson writes most records; it writes a non-finite float as ``null``, so a line whose nulls
    are not all accounted for by the record's top-level ``None`` values is parsed back and kept
    only if it equals ``obj``.  Anything orjson would write differently (non-finite floats, big
    integers, subclasses, tuples and other non-JSON types) goes to the stdlib."""
    if _orjson is not None:
        try:
            line = _orjson.dumps(obj, default=_refuse, option=_ORJSON_OPTIONS)
        except TypeError:           # orjson.JSONEncodeError: a type or an integer it does not write
            pass
        else:
            nulls = line.count(b"null")
            if not nulls or nulls == _count_of(obj.values(), None) or _orjson.loads(line) == obj:
                return line
    return (json.dumps(obj, separators=(",", ":"), default=str) + "\n").encode()


def json_piece(obj) -> bytes | None:
    """``obj``'s JSON for a line joined from pieces (no newline), or None where the joined line
    might not be what :func:`json_line` writes of the whole record: orjson's bytes holding no
    ``null``.  A line whose only nulls are its top-level ``None`` fields is written by
    :func:`json_line` as orjson's bytes of the whole, which are its pieces' bytes joined."""
    if _orjson is None:
        return None
    try:
        piece = _orjson.dumps(obj, default=_refuse, option=_PIECE_OPTIONS)
    except TypeError:
        return None
    return None if b"null" in piece else piece


def finite_numbers_piece(numbers: dict) -> bytes:
    """:func:`json_piece` of a dict of finite numbers (a statistics record of finite values),
    without the checks such a dict never needs."""
    return _orjson.dumps(numbers)


PIECES = _orjson is not None      # whether lines may be joined from pieces


_APPEND = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)


def _make_folder(folder: str) -> None:
    """``os.makedirs(folder, exist_ok=True)`` for a step's rank folder, in a system call per
    level (each call a step makes slows the op after it)."""
    parent = os.path.dirname(folder)
    for path in (parent, folder):
        try:
            os.mkdir(path)
        except FileExistsError:
            pass
        except FileNotFoundError:
            os.makedirs(folder, exist_ok=True)
            return


class JsonLines:
    """An append-only JSON-lines file: each line is one ``write`` call as it is appended (no
    buffer to flush), so a killed process leaves every line appended before."""

    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None

    def append(self, obj: dict) -> None:
        self._write(json_line(obj))

    def append_line(self, line: bytes) -> None:
        """One line its caller made (a record joined from pieces of :func:`json_line`)."""
        self._write(line)

    def extend(self, objs) -> None:
        """Several lines in one ``write`` call (a killed process may leave the last one torn)."""
        self._write(b"".join(json_line(o) for o in objs))

    def fd(self) -> int:
        """The file's descriptor, opened on first use: a caller writing its own lines (one
        ``write`` each, as :meth:`append` does) reports a failure with :meth:`failed`."""
        if self._fd is None:
            try:
                self._fd = os.open(self.path, _APPEND, 0o644)
            except OSError as exc:
                raise self.failed(exc) from None
        return self._fd

    def failed(self, exc: OSError) -> WriteFailed:
        return WriteFailed(f"{exc.strerror or exc} writing {self.path}")

    def _write(self, line: bytes) -> None:
        fd = self._fd if self._fd is not None else self.fd()
        try:
            written = os.write(fd, line)
            while written < len(line):      # a write may be partial
                line = line[written:]
                written = os.write(fd, line)
        except OSError as exc:
            raise self.failed(exc) from None

    def flush(self) -> None:
        """Lines are flushed as they are appended."""

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class TensorShardWriter:
    """Background writer of safetensors shards.  ``save_fn(dict_of_tensors, path)`` serialises
    (the backend's ``save_shard``); ``nbytes_fn`` sizes a queued tensor.

    The op thread fills the open shard and closes it once it holds ``SHARD_BYTES``; only then is
    the writer thread woken, once per shard: a shard's header comes first in its file and lists
    every tensor in it, so nothing of a shard can be written before it is closed, and each
    wake-up of the thread takes the GIL from the op thread.  The writer's own tick closes a shard
    ``SHARD_SECONDS`` old, so a hung or killed process leaves its tensors up to then.  A flush
    closes the open shard and writes the closed ones the writer has not taken on the calling
    thread, beside the shard the writer may be finishing (another file): the step end neither
    waits for the writer thread to be woken nor writes after it.  Shards are numbered as they
    close and listed in ``index.jsonl`` in that order, whichever thread wrote them."""

    def __init__(self, folder: str, save_fn: Callable[[dict, str], None], nbytes_fn: Callable[[Any], int]):
        self.folder = folder
        self._save = save_fn
        self._nbytes = nbytes_fn
        self._open_lock = threading.Lock()   # the open shard: filled by put, closed by put, flush or the tick
        self._pending: dict = {}            # the open shard
        self._size = 0
        self._since = time.monotonic()
        self._closed: collections.deque = collections.deque()   # (order, file number, shard), oldest first
        self._order = 0                     # shards closed
        self._numbered = 0                  # shard files named (closed shards holding a tensor)
        self._listed = threading.Condition()    # index lines are appended in closing order
        self._indexed = 0                   # closed shards done with (listed, or failed)
        self._wake = threading.Event()
        self._closing = False
        self._index = JsonLines(os.path.join(folder, "index.jsonl"))
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="dispatchprobe-writer", daemon=True)
        self._started = False

    def put(self, key: str, tensor) -> None:
        if self._error is not None:
            raise WriteFailed(self._error)
        if not self._started:
            os.makedirs(self.folder, exist_ok=True)
            self._thread.start()
            self._started = True
        with self._open_lock:
            self._pending[key] = tensor
            if type(tensor) is not _View:
                self._size += self._nbytes(tensor)
                if self._size >= SHARD_BYTES:
                    self._close_open()
                    self._wake.set()

    def put_view(self, key: str, base: str, offset: int, shape, stride) -> None:
        """Record ``key`` as a strided view of the saved 1-D tensor ``base`` (stored once)."""
        self.put(key, _View(base, offset, list(shape), list(stride)))

    def flush(self) -> None:
        """Write everything queued so far (the rest as one shard), on this thread and the
        writer's; return once every shard closed until now is listed."""
        if self._started:
            with self._open_lock:
                self._close_open()
                closed = self._order
            self._write_closed()
            with self._listed:
                while self._indexed < closed:
                    self._listed.wait()
        if self._error is not None:
            raise WriteFailed(self._error)

    def close(self) -> None:
        if self._started:
            self.flush()
            self._closing = True
            self._wake.set()
            self._thread.join()
            self._started = False
        self._index.close()

    def _run(self) -> None:
        while not self._closing:
            self._wake.wait(timeout=SHARD_SECONDS)
            self._wake.clear()              # before writing: a later close's wake-up is not lost
            if time.monotonic() - self._since >= SHARD_SECONDS:
                with self._open_lock:
                    if time.monotonic() - self._since >= SHARD_SECONDS:
                        self._close_open()
            self._write_closed()

    def _close_open(self) -> None:
        """Close the open shard, if it holds anything.  Called with ``_open_lock`` held."""
        pending = self._pending
        if pending:
            number = None
            if self._size or any(type(v) is not _View for v in pending.values()):
                number, self._numbered = self._numbered, self._numbered + 1
            self._closed.append((self._order, number, pending))
            self._order += 1
            self._pending, self._size = {}, 0
        self._since = time.monotonic()

    def _write_closed(self) -> None:
        """Write closed shards, oldest first, until none is left; each is listed in the index
        once those closed before it are (another thread may be writing one of them)."""
        closed = self._closed
        while True:
            try:
                order, number, pending = closed.popleft()
            except IndexError:
                return
            line = None
            if self._error is None:        # after a failure nothing more is written
                try:
                    line = self._write_shard(number, pending)
                except BaseException as exc:  # reported on the next put/flush, on the op thread
                    self._fail(exc)
            with self._listed:
                while self._indexed != order:
                    self._listed.wait()
                if line is not None and self._error is None:
                    try:
                        self._index.append(line)
                    except BaseException as exc:  # noqa: BLE001 - as a shard's failure
                        self._fail(exc)
                self._indexed += 1
                self._listed.notify_all()

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = str(exc) if isinstance(exc, WriteFailed) else f"{type(exc).__name__}: {exc}"

    def _write_shard(self, number: int | None, pending: dict) -> dict:
        """Write one closed shard's file (if it holds tensors); its index line."""
        views = {k: v.fields() for k, v in pending.items() if type(v) is _View}
        tensors = {k: v for k, v in pending.items() if type(v) is not _View} if views else pending
        line: dict = {"shard": None, "keys": []}
        if tensors:
            name = f"shard_{number:05d}.safetensors"
            path = os.path.join(self.folder, name)
            tmp = path + ".tmp"
            try:
                self._save(tensors, tmp)
                os.replace(tmp, path)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    os.remove(tmp)
                raise WriteFailed(f"{exc.strerror or exc} writing {path}") from None
            line = {"shard": name, "keys": list(tensors)}
        if views:
            line["views"] = views
        return line


class _View(tuple):
    """A saved tensor that is a strided view of another saved (1-D) tensor: (base, offset,
    shape, stride)."""

    __slots__ = ()

    def __new__(cls, base: str, offset: int, shape: list, stride: list):
        return tuple.__new__(cls, (base, offset, shape, stride))

    def fields(self) -> dict:
        base, offset, shape, stride = self
        return {"base": base, "offset": offset, "shape": shape, "stride": stride}


class PartIndex:
    """What a part keeps once however it is delivered (written here, or streamed by online
    run-ut): each distinct stack and each module scope listed once, in its ``stacks`` and
    ``modules`` lines."""

    def __init__(self):
        self._stack_ids: dict[tuple, int] = {}
        self._modules_seen: set[str] = set()

    def stack_id(self, frames: tuple) -> int:
        """Deduplicated stacks: each distinct stack is written once and referred to by id."""
        sid = self._stack_ids.get(frames)
        if sid is None:
            sid = self._stack_ids[frames] = len(self._stack_ids)
            self.stacks.append({"id": sid, "frames": list(frames)})
        return sid

    def module(self, scope: str, type_name: str) -> None:
        if scope not in self._modules_seen:
            self._modules_seen.add(scope)
            parent = scope.rpartition(".")[0] if "." in scope else None
            self.modules.append({"scope": scope, "type": type_name, "parent": parent})


class PartWriter(PartIndex):
    """The records of one step and rank: ``{run}/step{S}/rank{R}/``."""

    def __init__(self, folder: str, save_fn=None, nbytes_fn=None):
        self.folder = folder
        _make_folder(folder)
        self.ops = JsonLines(os.path.join(folder, "ops.jsonl"))
        self.stacks = JsonLines(os.path.join(folder, "stacks.jsonl"))
        self.modules = JsonLines(os.path.join(folder, "modules.jsonl"))
        self.params = JsonLines(os.path.join(folder, "params.jsonl"))   # opened at the first parameter record
        self.tensors = TensorShardWriter(os.path.join(folder, "tensors"), save_fn, nbytes_fn) if save_fn else None
        super().__init__()

    def close(self) -> None:
        if self.tensors is not None:
            self.tensors.close()
        for f in (self.ops, self.stacks, self.modules, self.params):
            f.close()
        try:    # what `show` prints of the step, so that it need not read every record
            part_summary.write(self.folder)
        except Exception:   # noqa: BLE001 - never the training's problem: a part without one is read from its records
            pass
        try:    # readers tell a finished step from one its process left mid-way
            os.close(os.open(os.path.join(self.folder, CLOSED_MARKER), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
        except OSError:
            pass
