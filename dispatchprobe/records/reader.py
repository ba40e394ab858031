"""Reads records back: op records as pandas DataFrames, tensors as numpy arrays on demand.

Imports neither torch nor MindSpore (docs/architecture.md: the offline side reads only records), so ``compare`` and ``show`` run on a
laptop with only numpy and pandas.  safetensors files are parsed here directly (an 8-byte
header length, a JSON header, raw little-endian bytes) because numpy has no bfloat16: bf16 is
widened to float32 exactly, by shifting its bits.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import json
import os
import re
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import pandas as pd

from .format import CLOSED_MARKER, FORMAT_NAME, FORMAT_VERSION, unrecorded_steps_note, walk


class RecordError(Exception):
    """A missing, corrupt or unreadable record; the message says what and where."""


class DamagedRecord(RecordError):
    """A saved file that is cut short or corrupt: a record problem, never a precision verdict."""


tensor_list = tensor_rows = walk   # the names compare and the tests read tensors by

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
              "I16": np.int16, "I8": np.int8, "U8": np.uint8, "U16": np.uint16, "U32": np.uint32,
              "U64": np.uint64, "BOOL": np.bool_, "C64": np.complex64}


def _float8_table(exp_bits: int, man_bits: int, bias: int, *, ieee: bool = False, fnuz: bool = False) -> np.ndarray:
    """The float32 value of each of the 256 bytes of an 8-bit float format (exact)."""
    out = np.empty(256, np.float32)
    top = (1 << exp_bits) - 1
    for b in range(256):
        sign = -1.0 if b >> 7 else 1.0
        exp, man = (b >> man_bits) & top, b & ((1 << man_bits) - 1)
        if (fnuz and b == 0x80) or (not ieee and not fnuz and exp == top and man == (1 << man_bits) - 1):
            out[b] = np.nan
        elif ieee and exp == top:
            out[b] = sign * np.inf if man == 0 else np.nan
        elif exp == 0:
            out[b] = sign * man / (1 << man_bits) * 2.0 ** (1 - bias)
        else:
            out[b] = sign * (1 + man / (1 << man_bits)) * 2.0 ** (exp - bias)
    return out


# 8-bit floats, widened exactly to float32 (numpy has none): by safetensors code or torch dtype name
_FLOAT8 = {"F8_E4M3": _float8_table(4, 3, 7), "F8_E5M2": _float8_table(5, 2, 15, ieee=True),
           "F8_E4M3FNUZ": _float8_table(4, 3, 8, fnuz=True), "F8_E5M2FNUZ": _float8_table(5, 2, 16, fnuz=True),
           "float8_e8m0fnu": np.array([2.0 ** (b - 127) for b in range(255)] + [np.nan], np.float32)}

TENSOR_COLUMNS = ["step", "rank", "id", "kind", "name", "op", "stage", "scope", "call", "grad_fn", "io", "arg",
                  "dtype", "shape", "device", "max", "min", "mean", "norm", "nan", "inf", "checksum", "data"]
GRAD_COLUMNS = ["step", "rank", "param", "dtype", "shape", "numel", "max", "min", "norm", "zero", "sign"]
OP_COLUMNS = ["step", "rank", "id", "kind", "name", "op", "stage", "scope", "call", "grad_fn", "stack",
              "n_inputs", "n_outputs"]


def read_safetensors(path: str, keys=None) -> dict[str, np.ndarray]:
    """Tensors of a safetensors file as numpy arrays (bf16 widened to float32).

    Arrays are read-only views of the memory-mapped file, not copies (compare widens them to
    float64 anyway); ``.copy()`` one to modify it."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise DamagedRecord(f"damaged record: {path}: not a safetensors file (too short)")
        n = int.from_bytes(raw, "little")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise DamagedRecord(f"damaged record: {path}: corrupt safetensors header") from None
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n) if os.path.getsize(path) > 8 + n else np.zeros(0, np.uint8)
    stored_as = header.get("__metadata__") or {}
    out = {}
    for key, info in header.items():
        if key == "__metadata__" or (keys is not None and key not in keys):
            continue
        start, end = info["data_offsets"]
        buf = data[start:end]
        dt, shape = info["dtype"], info["shape"]
        if len(buf) != end - start:
            raise DamagedRecord(f"damaged record: {path}: tensor {key} is cut short ({len(buf)} of {end - start} "
                                "bytes)")
        if dt == "BF16":
            arr = (np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif dt in _FLOAT8:
            arr = _FLOAT8[dt][np.frombuffer(buf, dtype=np.uint8)]
        elif dt in _ST_DTYPES:
            arr = np.frombuffer(buf, dtype=np.dtype(_ST_DTYPES[dt]).newbyteorder("<"))
        else:
            raise RecordError(f"{path}: tensor {key} has dtype {dt}, which numpy cannot hold; read it with torch")
        if key in stored_as:            # a dtype safetensors has no code for (see torch.snapshots.save_shard)
            real = json.loads(stored_as[key])
            arr, shape = _restore(arr, real["dtype"], path, key), real["shape"]
        out[key] = arr.reshape(shape)
    return out


def _restore(arr: np.ndarray, dtype: str, path: str, key: str) -> np.ndarray:
    """The values of a tensor stored as (re, im) pairs or raw bytes, as numpy can hold them."""
    if dtype == "complex128":
        return arr.view(np.complex128)
    if dtype == "complex32":
        return arr.astype(np.float32).view(np.complex64)
    if dtype in _FLOAT8:
        return _FLOAT8[dtype][arr]
    raise RecordError(f"{path}: tensor {key} has dtype {dtype}, which numpy cannot hold; read it with torch")


def as_view(base: np.ndarray, view: dict) -> np.ndarray:
    """Rebuild a strided view (offset, shape, stride in elements) of a saved 1-D array (read-only)."""
    flat = base.reshape(-1)[view["offset"]:]
    strides = tuple(s * flat.itemsize for s in view["stride"])
    return np.lib.stride_tricks.as_strided(flat, shape=tuple(view["shape"]), strides=strides, writeable=False)


try:  # orjson (a dependency) parses big op indexes faster than the stdlib; same values
    import orjson as _orjson
except ImportError:  # pragma: no cover - a broken install: the stdlib still works
    _orjson = None


@contextlib.contextmanager
def no_gc():
    """Pause the cyclic garbage collector while building millions of acyclic containers (parsed
    records, row lists): without this, its full passes over the growing heap dominate the time."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _loads_array(text: str):
    """``json.loads`` of a JSON array; orjson when importable (it rejects NaN/Infinity and huge ints,
    which the stdlib accepts: then the stdlib parses it)."""
    if _orjson is not None:
        try:
            return _orjson.loads(text)
        except ValueError:
            pass
    return json.loads(text)


def _read_jsonl(path: str) -> tuple[list[dict], list[str]]:
    """Records of a JSON-lines file, tolerating a torn last line (the writer was killed).  orjson
    parses the file's bytes in slices of whole lines (no text copy of the whole file: a
    100,000-op run's is ~100 MB); where it refuses a slice (NaN, bytes that are not UTF-8, a blank
    line) the whole file is read as text as before, so the values never depend on the slicing."""
    if not os.path.exists(path):
        return [], []
    with open(path, "rb") as f:
        data = f.read()
    problems: list[str] = []
    end = data.rfind(b"\n") + 1
    if end < len(data):  # a complete file ends with a newline
        problems.append(f"{path}: last line is incomplete (the process ended while writing it); ignored")
    with no_gc():
        records: list = []
        start, sliced = 0, _orjson is not None
        while sliced and start < end:
            stop = data.find(b"\n", min(start + _SLICE, end) - 1) + 1
            piece = data[start:stop - 1]
            try:
                if not piece:          # a blank line: not a record
                    raise ValueError
                records += _orjson.loads(b"[" + piece.replace(b"\n", b",") + b"]")
            except ValueError:
                sliced = False
            start = stop
        if sliced:
            return records, problems
        del records
        lines = data[:end].decode("utf-8", errors="replace").split("\n")[:-1]
        del data
        try:
            return _loads_array("[" + ",".join(lines) + "]"), problems
        except ValueError:
            pass
    records, bad = [], []
    for i, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except ValueError:
            bad.append(i)
    if bad and not records:
        raise RecordError(f"{path}: not a records file (none of its {len(lines)} lines is a JSON record)")
    if bad:
        problems.append(f"{path}: {len(bad)} corrupt line(s) ignored (first: line {bad[0]})")
    return records, problems


# bytes of records parsed at once (whole lines): the transient copies a parse makes stay this small
_SLICE = 8 << 20


@dataclass
class Part:
    """The records of one step and rank."""

    path: str
    step: int
    rank: int
    problems: list[str] = field(default_factory=list)
    marks_closed: bool = False     # the writer leaves CLOSED_MARKER in each part it closes

    @property
    def closed(self) -> bool | None:
        """Whether the step was closed (``probe.step()``/``close()``); None for runs written before
        parts were marked."""
        return os.path.isfile(os.path.join(self.path, CLOSED_MARKER)) if self.marks_closed else None

    @cached_property
    def records(self) -> list[dict]:
        records, problems = _read_jsonl(os.path.join(self.path, "ops.jsonl"))
        self.problems.extend(problems)
        return records

    @cached_property
    def grads(self) -> list[dict]:
        """The grad probe's records: one per parameter (docs/grad-probe.md)."""
        records, problems = _read_jsonl(os.path.join(self.path, "grads.jsonl"))
        self.problems.extend(problems)
        return records

    @cached_property
    def params(self) -> list[dict]:
        """The parameter records (``params.jsonl``: each parameter's gradient and value at the
        optimizer's steps); empty when none were recorded."""
        records, problems = _read_jsonl(os.path.join(self.path, "params.jsonl"))
        self.problems.extend(problems)
        return records

    @cached_property
    def checks(self) -> dict | None:
        """An inline check's counts for this part (``checked``, ``flagged``, ...), if it ran one."""
        try:
            with open(os.path.join(self.path, "checks.json"), encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except ValueError:
            self.problems.append(f"{self.path}/checks.json: corrupt, ignored")
            return None

    @property
    def truncated(self) -> bool:
        _ = self.records
        return self.files_end_early

    @property
    def files_end_early(self) -> bool:
        """A file read so far ends in a torn or corrupt line (``truncated`` reads the records first)."""
        return any("incomplete" in p or "corrupt" in p for p in self.problems)

    @cached_property
    def stacks(self) -> dict[int, list[str]]:
        rows, _ = _read_jsonl(os.path.join(self.path, "stacks.jsonl"))
        return {r["id"]: r["frames"] for r in rows}

    @cached_property
    def modules(self) -> list[dict]:
        return _read_jsonl(os.path.join(self.path, "modules.jsonl"))[0]

    @cached_property
    def _index(self) -> tuple[dict[str, str], dict[str, dict]]:
        rows, _ = _read_jsonl(os.path.join(self.path, "tensors", "index.jsonl"))
        shards = {key: row["shard"] for row in rows for key in row.get("keys", ())}
        views = {key: v for row in rows for key, v in (row.get("views") or {}).items()}
        return shards, views

    @property
    def shards(self) -> dict[str, str]:
        """stored tensor key -> shard file; only shards fully written (listed in the index) count."""
        return self._index[0]

    @property
    def views(self) -> dict[str, dict]:
        """tensor key -> {"base", "offset", "shape", "stride"} for tensors saved as views of others."""
        return self._index[1]

    def damaged_shards(self) -> list[str]:
        """One line per listed shard that is missing, cut short or unreadable (headers only)."""
        bad = []
        for shard in sorted(set(self.shards.values())):
            path = os.path.join(self.path, "tensors", shard)
            try:
                with open(path, "rb") as f:
                    n = int.from_bytes(f.read(8), "little")
                    header = json.loads(f.read(n))
                need = 8 + n + max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
                if os.path.getsize(path) < need:
                    bad.append(f"{path}: damaged shard, {os.path.getsize(path)} of {need} bytes")
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                bad.append(f"{path}: damaged shard ({type(exc).__name__}: {str(exc)[:80]})")
        return bad

    def has_tensor(self, key: str) -> bool:
        view = self.views.get(key)
        return (view["base"] if view else key) in self.shards

    def tensor(self, key: str) -> np.ndarray:
        """A saved tensor as a numpy array (bf16 as float32)."""
        return self.tensors_of([key])[key]

    def tensors_of(self, keys) -> dict[str, np.ndarray]:
        """Many saved tensors at once, one pass per shard; views are rebuilt from their base."""
        keys = list(keys)
        stored = {self.views[k]["base"] if k in self.views else k for k in keys}
        by_shard: dict[str, set] = {}
        for key in stored:
            shard = self.shards.get(key)
            if shard is None:
                raise RecordError(f"{self.path}: tensor {key} was not saved (not a 'tensor' run, or the process "
                                  f"ended before its shard was written)")
            by_shard.setdefault(shard, set()).add(key)
        arrays = {}
        for shard, wanted in by_shard.items():
            arrays.update(read_safetensors(os.path.join(self.path, "tensors", shard), keys=wanted))
        return {k: as_view(arrays[self.views[k]["base"]], self.views[k]) if k in self.views else arrays[k]
                for k in keys}

    @cached_property
    def ops(self) -> pd.DataFrame:
        rows = [(self.step, self.rank, r["id"], r["kind"], r["name"], r["op"], r["stage"], r["scope"], r["call"],
                 r.get("grad_fn"), r.get("stack"), len(r.get("inputs", ())), len(r.get("outputs", ())))
                for r in self.records]
        return pd.DataFrame(rows, columns=OP_COLUMNS)

    @cached_property
    def tensors(self) -> pd.DataFrame:
        rows = []
        for r in self.records:
            head = (self.step, self.rank, r["id"], r["kind"], r["name"], r["op"], r["stage"], r["scope"],
                    r["call"], r.get("grad_fn"))
            for io, arg, t in walk(r):
                st = t.get("stats") or {}
                rows.append(head + (io, arg, t["dtype"], tuple(t["shape"]), t.get("device"), st.get("max"),
                                    st.get("min"), st.get("mean"), st.get("norm"), st.get("nan"), st.get("inf"),
                                    t.get("checksum"), t.get("data")))
        return pd.DataFrame(rows, columns=TENSOR_COLUMNS)


_PART_DIR = re.compile(r"^step(\d+)$")
_RANK_DIR = re.compile(r"^rank(\d+)$")


@dataclass
class Run:
    """A run directory (or a single step/rank folder)."""

    path: str
    manifest: dict
    parts: dict[tuple[int, int], Part]

    @property
    def problems(self) -> list[str]:
        return [p for part in self.parts.values() for p in part.problems]

    def part(self, step: int = 0, rank: int = 0) -> Part:
        try:
            return self.parts[(step, rank)]
        except KeyError:
            raise RecordError(f"{self.path}: no records for step {step} rank {rank}; "
                              f"have {sorted(self.parts)}") from None

    @property
    def ops(self) -> pd.DataFrame:
        return pd.concat([p.ops for p in self.parts.values()], ignore_index=True) if self.parts else \
            pd.DataFrame(columns=OP_COLUMNS)

    @property
    def tensors(self) -> pd.DataFrame:
        return pd.concat([p.tensors for p in self.parts.values()], ignore_index=True) if self.parts else \
            pd.DataFrame(columns=TENSOR_COLUMNS)

    @property
    def grads(self) -> pd.DataFrame:
        """A grad-probe run's records, one row per step, rank and parameter (docs/grad-probe.md)."""
        rows = [(p.step, p.rank, r["param"], r["dtype"], tuple(r["shape"]), r["numel"], r["stats"]["max"],
                 r["stats"]["min"], r["stats"]["norm"], (r.get("distribution") or {}).get("zero"), r.get("sign"))
                for p in self.parts.values() for r in p.grads]
        return pd.DataFrame(rows, columns=GRAD_COLUMNS)


def find_manifest(path: str) -> tuple[str, dict]:
    """The manifest of a run dir, or of the run a step/rank dir belongs to."""
    for candidate in (path, os.path.dirname(path), os.path.dirname(os.path.dirname(path))):
        file = os.path.join(candidate, "manifest.json")
        if os.path.isfile(file):
            try:
                with open(file, encoding="utf-8") as f:
                    manifest = json.load(f)
            except ValueError:
                raise RecordError(f"{file}: corrupt manifest") from None
            if manifest.get("format") != FORMAT_NAME:
                raise RecordError(f"{file}: not a dispatchprobe manifest")
            if manifest.get("format_version", 0) > FORMAT_VERSION:
                raise RecordError(f"{file}: format version {manifest['format_version']} is newer than this "
                                  f"dispatchprobe reads ({FORMAT_VERSION}); upgrade dispatchprobe")
            return candidate, manifest
    return path, {}


def _is_part(folder: str) -> bool:
    """A step/rank folder: op records, gradient records, or the counts of an inline check that flagged nothing."""
    return any(os.path.isfile(os.path.join(folder, name)) for name in ("ops.jsonl", "checks.json", "grads.jsonl"))


def load(path: str | os.PathLike) -> Run:
    """Open a run directory or one ``step{S}/rank{R}`` folder of it."""
    path = os.path.normpath(os.fspath(path))
    if not os.path.isdir(path):
        raise RecordError(f"{path}: no such records directory")
    root, manifest = find_manifest(path)
    parts: dict[tuple[int, int], Part] = {}
    marks = bool(manifest.get("marks_closed_parts"))
    if _is_part(path):
        rank_m = _RANK_DIR.match(os.path.basename(path))
        step_m = _PART_DIR.match(os.path.basename(os.path.dirname(path)))
        key = (int(step_m.group(1)) if step_m else 0, int(rank_m.group(1)) if rank_m else 0)
        parts[key] = Part(path, *key, marks_closed=marks)
    else:
        # a run directory, or one step{S} folder of it (every rank of that step)
        steps = [os.path.basename(path)] if _PART_DIR.match(os.path.basename(path)) else sorted(os.listdir(path))
        base = os.path.dirname(path) if _PART_DIR.match(os.path.basename(path)) else path
        for step_name in steps:
            step_m = _PART_DIR.match(step_name)
            if not step_m:
                continue
            if not os.path.isdir(os.path.join(base, step_name)):
                continue
            for rank_name in sorted(os.listdir(os.path.join(base, step_name))):
                rank_m = _RANK_DIR.match(rank_name)
                folder = os.path.join(base, step_name, rank_name)
                if rank_m and _is_part(folder):
                    key = (int(step_m.group(1)), int(rank_m.group(1)))
                    parts[key] = Part(folder, *key, marks_closed=marks)
    if not parts:
        if manifest and (unrecorded := unrecorded_steps_note(manifest)):
            raise RecordError(f"{path}: no step holds records: {unrecorded}")
        if manifest and glob.glob(os.path.join(glob.escape(path), "step*", "rank*")):
            raise RecordError(f"{path}: the run started but its steps hold no records yet: an inline check that "
                              "flagged nothing writes its counts when the step closes (probe.step() or probe.close())")
        raise RecordError(f"{path}: no op records found (expected step*/rank*/ops.jsonl"
                          f"{'' if manifest else ' and a manifest.json'})")
    return Run(root if manifest else path, manifest, dict(sorted(parts.items())))
