"""The records reader parses a file's bytes in slices of whole lines: whatever the slice size, it
reads what parsing the whole file's text at once reads (NaN, integers beyond 64 bits, bytes that
are not UTF-8, a torn last line, a corrupt or blank line), and says the same problems."""

from __future__ import annotations

import json

import pytest

from dispatchprobe.records import reader


def _expected(raw: bytes, path: str) -> tuple[list, list]:
    """The file's text parsed at once (orjson, else the standard library), else line by line."""
    text = raw.decode("utf-8", errors="replace")
    lines = text.split("\n")
    problems = []
    if lines.pop() != "":
        problems.append(f"{path}: last line is incomplete (the process ended while writing it); ignored")
    try:
        return reader._loads_array("[" + ",".join(lines) + "]"), problems
    except ValueError:
        pass
    records, bad = [], []
    for i, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except ValueError:
            bad.append(i)
    if bad:
        problems.append(f"{path}: {len(bad)} corrupt line(s) ignored (first: line {bad[0]})")
    return records, problems


_GOOD = [{"id": i, "op": "aten.add.Tensor", "stats": {"mean": i * 0.1, "norm": 1.0 / (i + 1)}, "name": "ü" * (i % 3)}
         for i in range(40)]
_CASES = {
    "plain": b"".join(json.dumps(r).encode() + b"\n" for r in _GOOD),
    "torn tail": b"".join(json.dumps(r).encode() + b"\n" for r in _GOOD) + b'{"id": 40, "op": "aten.m',
    "NaN and a huge integer": b"".join(json.dumps(r).encode() + b"\n" for r in _GOOD[:20])
    + b'{"id": 20, "stats": {"mean": NaN, "norm": Infinity}}\n{"id": 21, "big": 123456789012345678901234567890}\n'
    + b"".join(json.dumps(r).encode() + b"\n" for r in _GOOD[20:]),
    "not UTF-8": b"".join(json.dumps(r).encode() + b"\n" for r in _GOOD[:30]) + b'{"id": 30, "name": "a\xff\xfeb"}\n'
    + b"".join(json.dumps(r).encode() + b"\n" for r in _GOOD[30:]),
    "corrupt line": b"".join(json.dumps(r).encode() + b"\n" for r in _GOOD[:25]) + b'{"id": 25, "op": \n'
    + b"".join(json.dumps(r).encode() + b"\n" for r in _GOOD[25:]),
    "blank line": b"".join(json.dumps(r).encode() + b"\n" for r in _GOOD[:5]) + b"\n"
    + b"".join(json.dumps(r).encode() + b"\n" for r in _GOOD[5:]),
    "empty": b"",
    "only a torn line": b'{"id": 0, "op"',
}


@pytest.mark.parametrize("case", sorted(_CASES))
@pytest.mark.parametrize("size", [1, 50, 333, 1 << 20])
def test_sliced_parse_reads_what_each_line_reads(tmp_path, monkeypatch, case, size):
    path = tmp_path / "ops.jsonl"
    path.write_bytes(_CASES[case])
    monkeypatch.setattr(reader, "_SLICE", size)
    got, problems = reader._read_jsonl(str(path))
    want, want_problems = _expected(_CASES[case], str(path))
    assert json.dumps(got) == json.dumps(want)
    assert problems == want_problems
