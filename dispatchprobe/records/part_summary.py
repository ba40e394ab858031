"""The summary of one step/rank part (``summary.json``): what ``dispatchprobe show`` prints of a
run, reduced per part, so that ``show`` of a long run reads one small file per step instead of
every record (docs/record-format.md, "summary.json").

The writer makes it when the part closes (:func:`write`, from the part's finished ``ops.jsonl``,
off the per-op path); ``show`` takes it only while it still describes that file (:func:`read`:
same format version, ``ops.jsonl`` of the size it summarised) and otherwise reduces the part's
records with the same :func:`reduce`, so both ways print the same.
"""

from __future__ import annotations

import bisect
import gc
import json
import os
import re
from collections import Counter

import numpy as np

from . import nonfinite as origins
from .format import walk

try:  # as the reader: orjson parses the part's lines faster; the stdlib where it refuses them
    import orjson as _orjson
except ImportError:  # pragma: no cover - a broken install: the stdlib still works
    _orjson = None

FILE = "summary.json"
NAME = "dispatchprobe-part-summary"
# what a reader of an older summary would misread or miss: a summary of another version is not read
VERSION = 1
FIRST_ROWS = 5          # the nan/inf tensors `show` lists, per stage (made, and any)

# a tensor statistic counting some nan or inf (a part without one has no tensor to walk, and only
# its records' first fields are read), or a compiled record's eager re-run: the lines read whole
_MARKED = re.compile(rb'"(?:nan|inf)"\s*:\s*[1-9]|"rerun"')
_STARTS = [int.from_bytes(w, "little") for w in (b'"nan', b'"inf', b'"rer')]    # how those begin


def reduce(records: list[dict], ops_bytes: int | None, nonfinite: bool = True) -> dict:
    """One part's summary from its records: per stage, the records, the op calls per op (in the
    order ops first appear), module records and scopes, and the tensors holding nan/inf (counted
    by origin, the first few listed); eager re-runs of compiled overflow records are counted
    apart (they repeat a record).  ``ops_bytes``: the size of the ``ops.jsonl`` summarised (None:
    read from records, not a file); ``nonfinite=False``: no tensor holds nan/inf (not walked)."""
    tally = _Tally(with_ops=any(r.get("kind") == "op" for r in records))
    for r in records:
        tally.record(r, nonfinite)
    return tally.summary(ops_bytes)


class _Tally:
    """The counts of :func:`reduce`, per stage in the order stages first appear."""

    def __init__(self, with_ops: bool):
        self.stages: dict[str, dict] = {}
        self.order: dict[str, None] = {}
        self.reruns = 0
        self.with_ops = with_ops        # the part records ops (an inf/nan of a module is then carried)
        self.bad_pos = 0

    def add(self, kind: str, op: str, stage: str, scope, n: int = 1) -> dict:
        """``n`` records of these first fields."""
        st = self.stages.get(stage)
        if st is None:
            st = self.stages[stage] = {"records": 0, "ops": {}, "modules": 0, "module_scopes": {},
                                       "nonfinite": None}
        st["records"] += n
        if kind == "op":
            ops = st["ops"]
            ops[op] = ops.get(op, 0) + n
            self.order[op] = None
        elif kind == "module":
            st["modules"] += n
            st["module_scopes"][scope] = None
        return st

    def record(self, r: dict, nonfinite: bool, counted: bool = False) -> None:
        """One whole record; ``nonfinite=False``: its tensors hold no nan/inf (not walked);
        ``counted``: its first fields are counted already (:meth:`add`)."""
        if (r.get("compiled") or {}).get("rerun"):
            self.reruns += 1
            return
        st = self.stages[r["stage"]] if counted else self.add(r["kind"], r["op"], r["stage"], r["scope"])
        if not nonfinite:
            return
        bad = [(io, arg, t) for io, arg, t in walk(r) if _count(t, "nan") > 0 or _count(t, "inf") > 0]
        if not bad:
            return
        nf = st["nonfinite"]
        if nf is None:
            nf = st["nonfinite"] = {"tensors": 0, "records": 0, "made": 0, "constant": 0, "first_made": [],
                                    "first": []}
        nf["records"] += 1
        expected = (r.get("overflow") or {}).get("class") == "expected"
        made_here = None
        for io, arg, t in bad:
            if io == "output":
                if made_here is None:
                    made_here = origins.origin(r, self.with_ops)
                origin = made_here
            else:
                origin = origins.CARRIED
            row = {"pos": self.bad_pos, "name": r["name"], "arg": arg, "scope": r["scope"],
                   "nan": int(_count(t, "nan")), "inf": int(_count(t, "inf")), "origin": origin,
                   "expected": expected}
            self.bad_pos += 1
            nf["tensors"] += 1
            if origin == origins.MADE:
                nf["made"] += 1
                if len(nf["first_made"]) < FIRST_ROWS:
                    nf["first_made"].append(row)
            elif origin == origins.CONSTANT:
                nf["constant"] += 1
            if len(nf["first"]) < FIRST_ROWS:
                nf["first"].append(row)

    def summary(self, ops_bytes: int | None) -> dict:
        stages = {name: {**st, "module_scopes": list(st["module_scopes"])} for name, st in self.stages.items()}
        return {"format": NAME, "version": VERSION, "ops_bytes": ops_bytes, "reruns": self.reruns,
                "op_order": list(self.order), "stages": stages}


def _count(spec: dict, key: str):
    return (spec.get("stats") or {}).get(key) or 0


def write(folder: str) -> bool:
    """Summarise the closed part in ``folder`` from its ``ops.jsonl`` into ``summary.json`` (no
    fsync, as the records themselves).  Nothing is written where the file has a torn or corrupt
    line (the reader then reads the records and reports it).  Returns whether it wrote one.
    A step's close waits for it, so the file is scanned rather than parsed: each line's first
    fields, and whole only the few lines :func:`_marks` points at."""
    try:
        with open(os.path.join(folder, "ops.jsonl"), "rb") as f:
            data = f.read()
    except FileNotFoundError:       # no record (a grad-probe part, a check that flagged nothing)
        return False
    marks = _marks(data)
    nonfinite = any(data[p + 1] != 0x72 for p in marks)        # not all of them "rerun"
    summary = _from_heads(data, marks, nonfinite)
    if summary is None:
        records = _parse(data)
        if records is None:
            return False
        summary = reduce(records, len(data), nonfinite=nonfinite)
    # written in place: a reader of a summary cut short (the process killed meanwhile) finds no
    # valid JSON in it and reads the records
    with open(os.path.join(folder, FILE), "wb") as f:
        f.write(json.dumps(summary, separators=(",", ":")).encode())
    return True


def _marks(data: bytes) -> list[int]:
    """Where :data:`_MARKED` matches in ``data`` (a nan/inf count that is not 0, or ``"rerun"``),
    in order: the places their first four bytes are, found as 4-byte words at each of the four
    offsets (vector compares: a regular expression's byte loop over the file costs three times
    more), the counts written ``:0`` left out, the rest matched exactly."""
    n = len(data)
    found = []
    for k in range(min(4, max(n - 3, 0))):
        words = np.frombuffer(data, "<u4", count=(n - k) // 4, offset=k)     # a view: no copy
        hit = np.flatnonzero((words == _STARTS[0]) | (words == _STARTS[1]) | (words == _STARTS[2]))
        found.append(hit * 4 + k)
    if not found:
        return []
    at = np.sort(np.concatenate(found))
    inside = at[at + 7 < n]
    b = np.frombuffer(data, np.uint8)
    zero = (b[inside + 4] == 0x22) & (b[inside + 5] == 0x3A) & (b[inside + 6] == 0x30)    # "nan":0
    at = np.concatenate([inside[~zero], at[at + 7 >= n]])
    match = _MARKED.match
    return [p for p in at.tolist() if match(data, p)]


# A line as Recorder.skeleton starts it: its first fields up to ``call`` in that order (the id,
# then JSON strings or null: no raw control character, escapes allowed).
_STRING = rb'(?:null|"[^"\\\x00-\x1f]*(?:\\.[^"\\\x00-\x1f]*)*")'
_HEAD = re.compile(rb'\{"id":-?\d+,"kind":(' + _STRING + rb'),"name":' + _STRING + rb',"op":(' + _STRING
                   + rb'),"stage":(' + _STRING + rb'),"scope":(' + _STRING + rb'),"call":')


def _from_heads(data: bytes, marks: list[int], nonfinite: bool) -> dict | None:
    """The summary from each line's first fields (:func:`_heads`), counted per distinct first
    fields in the order they first appear, and the whole records of the lines ``marks`` fall in;
    None where a line does not start so, or a line read whole is corrupt or says otherwise in its
    first fields (the caller then parses every record)."""
    lines = _heads(data)
    if lines is None:
        return None
    ends, heads = lines
    at = sorted({bisect.bisect_left(ends, p) for p in marks})        # the lines they are on
    whole = _parse(b"\n".join(data[0 if i == 0 else ends[i - 1] + 1:ends[i]] for i in at) + b"\n") if at else []
    if whole is None:
        return None
    reruns = {i for i, r in zip(at, whole) if (r.get("compiled") or {}).get("rerun")}
    counts = Counter(heads if not reruns else (h for i, h in enumerate(heads) if i not in reruns))
    text = _decoded(counts)
    if text is None:
        return None
    tally = _Tally(with_ops=any(t[0] == "op" for t in text.values())
                   or any(whole[k].get("kind") == "op" for k, i in enumerate(at) if i in reruns))
    for head, n in counts.items():
        tally.add(*text[head], n)
    for i, r in zip(at, whole):
        if i not in reruns and (r.get("kind"), r.get("op"), r.get("stage"), r.get("scope")) != text[heads[i]]:
            return None
        tally.record(r, nonfinite, counted=i not in reruns)
    return tally.summary(len(data))


def _heads(data: bytes) -> tuple | None:
    """(where each line ends, each line's first fields as the JSON bytes of kind, op, stage and
    scope): all :func:`reduce` needs of records holding no nan/inf and no re-run, without parsing
    them.  None where any line does not start with them or end in ``}`` (or is not whole)."""
    if not data.endswith(b"\n"):
        return None
    ends, find = [], data.find         # a find per line: at a step's close, with the caches cold,
    end = find(b"\n")                   # faster than vector compares over the file
    while end != -1:
        if data[end - 1] != 0x7D:
            return None
        ends.append(end)
        end = find(b"\n", end + 1)
    match = _HEAD.match
    found = [match(data, s) for s in [0, *(e + 1 for e in ends[:-1])]]
    if None in found:
        return None
    return ends, [m.groups() for m in found]


def _decoded(counts: Counter) -> dict | None:
    """{raw first fields: (kind, op, stage, scope) as text} of the distinct ``counts``; None where
    a string is not UTF-8 or holds an escape JSON has not."""
    text: dict = {b"null": None}
    out = {}
    for head in counts:
        for value in head:
            if value not in text:
                try:        # a string without escapes is its UTF-8 bytes; json reads the escapes
                    text[value] = value[1:-1].decode() if b"\\" not in value else json.loads(value)
                except ValueError:
                    return None
        out[head] = tuple(text[v] for v in head)
    return out


def _parse(data: bytes) -> list[dict] | None:
    """The records of a whole JSON-lines file, or None where a line is torn or corrupt."""
    if not data:
        return []
    if not data.endswith(b"\n"):
        return None
    text = b"[" + data[:-1].replace(b"\n", b",") + b"]"
    was = gc.isenabled()
    gc.disable()        # its passes over the growing heap would cost more than the parse
    try:
        if _orjson is not None:
            try:
                return _orjson.loads(text)
            except ValueError:      # NaN/Infinity, which only the stdlib reads, or a corrupt line
                pass
        try:
            return json.loads(text)
        except ValueError:
            return None
    finally:
        if was:
            gc.enable()


def read(folder: str) -> dict | None:
    """The part's summary, if it has one of this version that describes its ``ops.jsonl`` as it
    is now (the same size: nothing appended or cut since); else None (read the records)."""
    try:
        with open(os.path.join(folder, FILE), "rb") as f:
            summary = json.loads(f.read())
        size = os.path.getsize(os.path.join(folder, "ops.jsonl"))
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("format") != NAME or summary.get("version") != VERSION \
            or summary.get("ops_bytes") != size:
        return None
    return summary
