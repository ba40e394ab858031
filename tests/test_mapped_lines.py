"""ops.jsonl written through a memory mapping (``writer.MappedLines``): the same bytes as one
``write`` per line, a killed writer's records readable up to its last, the zero bytes mapped
ahead of the data never read as records (reader, live follower, part summary)."""

from __future__ import annotations

import errno
import json
import mmap
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from dispatchprobe import load
from dispatchprobe.offline.run_ut_live import _tail
from dispatchprobe.records import part_summary
from dispatchprobe.records.format import written_lines
from dispatchprobe.records.reader import _read_jsonl
from dispatchprobe.records.writer import JsonLines, MappedLines

pytestmark = pytest.mark.skipif(not hasattr(os, "posix_fallocate"), reason="no posix_fallocate: lines are written")

RECORDS = [{"id": i, "name": f"aten.op{i}.default.0.forward", "pad": "x" * (i * 37 % 3000), "v": [i / 7, None]}
           for i in range(400)]


def _write(cls, path, records):
    lines = cls(str(path))
    for r in records:
        lines.append(r)
    return lines


def test_mapped_lines_are_the_written_lines_across_windows(tmp_path, monkeypatch):
    # windows of one allocation unit: most lines cross from one window into the next
    monkeypatch.setattr(MappedLines, "FIRST", mmap.ALLOCATIONGRANULARITY)
    monkeypatch.setattr(MappedLines, "WINDOW", 2 * mmap.ALLOCATIONGRANULARITY)
    _write(JsonLines, tmp_path / "plain.jsonl", RECORDS).close()
    mapped = _write(MappedLines, tmp_path / "mapped.jsonl", RECORDS[:250])
    assert mapped._reserved and mapped._mapped
    data = (tmp_path / "mapped.jsonl").read_bytes()
    assert data.endswith(b"\0") and _read_jsonl(str(tmp_path / "mapped.jsonl")) == (RECORDS[:250], [])
    mapped.close()
    again = _write(MappedLines, tmp_path / "mapped.jsonl", RECORDS[250:])    # a part opened again goes on
    again.close()
    assert (tmp_path / "mapped.jsonl").read_bytes() == (tmp_path / "plain.jsonl").read_bytes()


def test_no_reserved_blocks_writes_each_line(tmp_path, monkeypatch):
    def refuse(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "not supported")
    monkeypatch.setattr(os, "posix_fallocate", refuse)
    lines = _write(MappedLines, tmp_path / "ops.jsonl", RECORDS[:20])
    assert not lines._mapped and lines._map is None
    lines.close()
    assert (tmp_path / "ops.jsonl").read_bytes() == b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n"
                                                             for r in RECORDS[:20])


def test_a_full_disk_is_a_write_failure(tmp_path, monkeypatch):
    from dispatchprobe.records.writer import WriteFailed

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(WriteFailed, match="No space left"):
        _write(MappedLines, tmp_path / "ops.jsonl", RECORDS[:1])


def test_readers_end_the_data_at_the_zero_bytes(tmp_path):
    whole = b"".join(json.dumps(r).encode() + b"\n" for r in RECORDS[:5])
    cases = {
        "open": (whole + b"\0" * 5000, 5, False),
        "torn": (whole + b'{"id": 5, "na' + b"\0" * 100, 5, True),
        "hole": (whole + b'{"id": 5' + b"\0" * 8 + b'": 1}\n' + b"\0" * 100, 5, True),   # a copy killed midway
        "closed": (whole, 5, False),
    }
    for name, (data, n, torn) in cases.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_bytes(data)
        records, problems = _read_jsonl(str(path))
        assert [r["id"] for r in records] == list(range(n)), name
        assert bool(problems) == torn, (name, problems)
        rows, offset = _tail(str(path), 0)
        assert [r["id"] for r in rows] == list(range(n)) and offset == len(whole), name
        assert written_lines(data)[0] == len(whole)
    # the follower picks up where it stopped once the line is complete
    path = tmp_path / "live.jsonl"
    path.write_bytes(whole + b'{"id": 5' + b"\0" * 64)
    rows, offset = _tail(str(path), 0)
    path.write_bytes(whole + b'{"id": 5}\n' + b"\0" * 55)
    rows, offset = _tail(str(path), offset)
    assert [r["id"] for r in rows] == [5] and offset == len(whole) + 10


KILLED = textwrap.dedent("""
    import sys, torch
    from dispatchprobe import DispatchProbe
    from dispatchprobe.models import TinyTransformer, lm_batch, lm_loss
    torch.set_num_threads(1)
    model = TinyTransformer(dim=32, heads=2, layers=1, seq=16)
    probe = DispatchProbe(task="statistics", dump_path=sys.argv[1])
    step = 0
    while True:
        with probe:
            lm_loss(model, *lm_batch(batch=2, seq=16, seed=step)).backward()
            if step == 2:
                print("recording", flush=True)
                while True:                     # records until it is killed
                    lm_loss(model, *lm_batch(batch=2, seq=16, seed=step)).backward()
        probe.step()
        step += 1
""")


def test_sigkill_mid_step_leaves_every_record_before(tmp_path):
    path = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("recording")
        ops = path / "step2" / "rank0" / "ops.jsonl"
        start = len(_read_jsonl(str(ops))[0])
        while len(_read_jsonl(str(ops))[0]) < start + 300:    # records while it is being written
            pass
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    data = ops.read_bytes()
    assert data.endswith(b"\0")                 # the window mapped ahead, never cut: the process died
    run = load(path)
    closed = run.part(1, 0).records        # a whole step, as the killed one began
    killed = run.part(2, 0)
    assert not run.part(0, 0).truncated and not run.part(1, 0).truncated
    assert len(killed.records) >= start + 300
    assert [r["id"] for r in killed.records] == list(range(len(killed.records)))
    assert [r["name"] for r in killed.records[:len(closed)]] == [r["name"] for r in closed]
    assert killed.truncated == (written_lines(data)[1] > written_lines(data)[0])
    assert part_summary.read(str(ops.parent)) is None          # no summary: the part was not closed
