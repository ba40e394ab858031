"""The summary of one step/rank part (``summary.json``): what ``dispatchprobe show`` prints of a
run, reduced per part, so that ``show`` of a long run reads one small file per step instead of
every record (docs/record-format.md, "summary.json").

The writer makes it when the part closes (:func:`write`, from the part's finished ``ops.jsonl``,
off the per-op path); ``show`` takes it only while it still describes that file (:func:`read`:
same format version, ``ops.jsonl`` of the size it summarised) and otherwise reduces the part's
records with the same :func:`reduce`, so both ways print the same.
"""

from __future__ import annotations

import gc
import json
import os
import re

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

# a tensor statistic counting some nan or inf: a part without one has no tensor to walk, and only
# its records' first fields are read
_NONFINITE = re.compile(rb'"(?:nan|inf)"\s*:\s*[1-9]')


def reduce(records: list[dict], ops_bytes: int | None, nonfinite: bool = True) -> dict:
    """One part's summary from its records: per stage, the records, the op calls per op (in the
    order ops first appear), module records and scopes, and the tensors holding nan/inf (counted
    by origin, the first few listed); eager re-runs of compiled overflow records are counted
    apart (they repeat a record).  ``ops_bytes``: the size of the ``ops.jsonl`` summarised (None:
    read from records, not a file); ``nonfinite=False``: no tensor holds nan/inf (not walked)."""
    tally = _Tally()
    with_ops = any(r.get("kind") == "op" for r in records)
    bad_pos = 0
    for r in records:
        if (r.get("compiled") or {}).get("rerun"):
            tally.reruns += 1
            continue
        st = tally.add(r["kind"], r["op"], r["stage"], r["scope"])
        if not nonfinite:
            continue
        bad = [(io, arg, t) for io, arg, t in walk(r) if _count(t, "nan") > 0 or _count(t, "inf") > 0]
        if not bad:
            continue
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
                    made_here = origins.origin(r, with_ops)
                origin = made_here
            else:
                origin = origins.CARRIED
            row = {"pos": bad_pos, "name": r["name"], "arg": arg, "scope": r["scope"],
                   "nan": int(_count(t, "nan")), "inf": int(_count(t, "inf")), "origin": origin,
                   "expected": expected}
            bad_pos += 1
            nf["tensors"] += 1
            if origin == origins.MADE:
                nf["made"] += 1
                if len(nf["first_made"]) < FIRST_ROWS:
                    nf["first_made"].append(row)
            elif origin == origins.CONSTANT:
                nf["constant"] += 1
            if len(nf["first"]) < FIRST_ROWS:
                nf["first"].append(row)
    return tally.summary(ops_bytes)


class _Tally:
    """The counts of :func:`reduce`, per stage in the order stages first appear."""

    def __init__(self):
        self.stages: dict[str, dict] = {}
        self.order: dict[str, None] = {}
        self.reruns = 0

    def add(self, kind: str, op: str, stage: str, scope) -> dict:
        st = self.stages.get(stage)
        if st is None:
            st = self.stages[stage] = {"records": 0, "ops": {}, "modules": 0, "module_scopes": {},
                                       "nonfinite": None}
        st["records"] += 1
        if kind == "op":
            ops = st["ops"]
            ops[op] = ops.get(op, 0) + 1
            self.order[op] = None
        elif kind == "module":
            st["modules"] += 1
            st["module_scopes"][scope] = None
        return st

    def summary(self, ops_bytes: int | None) -> dict:
        stages = {name: {**st, "module_scopes": list(st["module_scopes"])} for name, st in self.stages.items()}
        return {"format": NAME, "version": VERSION, "ops_bytes": ops_bytes, "reruns": self.reruns,
                "op_order": list(self.order), "stages": stages}


def _count(spec: dict, key: str):
    return (spec.get("stats") or {}).get(key) or 0


def write(folder: str) -> bool:
    """Summarise the closed part in ``folder`` from its ``ops.jsonl`` into ``summary.json`` (no
    fsync, as the records themselves).  Nothing is written where the file has a torn or corrupt
    line (the reader then reads the records and reports it).  Returns whether it wrote one."""
    try:
        with open(os.path.join(folder, "ops.jsonl"), "rb") as f:
            data = f.read()
    except FileNotFoundError:       # no record (a grad-probe part, a check that flagged nothing)
        return False
    nonfinite = _NONFINITE.search(data) is not None
    records = _heads(data)
    if records is not None and (nonfinite or b'"rerun"' in data):
        records = _with_whole(records, data)
    if records is None:
        records = _parse(data)
        if records is None:
            return False
    summary = reduce(records, len(data), nonfinite=nonfinite)
    # written in place: a reader of a summary cut short (the process killed meanwhile) finds no
    # valid JSON in it and reads the records
    with open(os.path.join(folder, FILE), "wb") as f:
        f.write(json.dumps(summary, separators=(",", ":")).encode())
    return True


_HEAD_KEYS = ["id", "kind", "name", "op", "stage", "scope"]     # Recorder.skeleton's first fields


def _heads(data: bytes) -> list[dict] | None:
    """The first fields of each record (up to ``call``), where every line is a whole record that
    starts with them: all :func:`reduce` needs of records holding no nan/inf and no re-run,
    parsed in a quarter of the time of whole records.  None where any line is otherwise."""
    if not data.endswith(b"\n"):
        return None
    lines = data[:-1].split(b"\n")
    ends = [line.find(b',"call":') for line in lines]    # a key: quotes inside strings are escaped
    if -1 in ends or data.count(b"}\n") != len(lines):
        return None
    heads = _parse(b"}\n".join(line[:end] for line, end in zip(lines, ends)) + b"}\n")
    if heads is None or any(list(h) != _HEAD_KEYS for h in heads):
        return None
    return heads


def _with_whole(heads: list[dict], data: bytes) -> list[dict] | None:
    """``heads`` with the records :func:`reduce` reads whole parsed whole: those holding a tensor
    with nan/inf, and compiled re-runs (the causal mask of every attention holds -inf: a step's
    few such lines, not all of them).  None where one of those lines is corrupt."""
    lines = data[:-1].split(b"\n")
    whole = [i for i, line in enumerate(lines) if b'"rerun"' in line or _NONFINITE.search(line)]
    parsed = _parse(b"\n".join(lines[i] for i in whole) + b"\n") if whole else []
    if parsed is None:
        return None
    for i, record in zip(whole, parsed):
        heads[i] = record
    return heads


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
