"""Records joined from JSON pieces (``Recorder.record_line``: each tensor look's description,
plain values and the op's fields made once, each value's statistics kept with its cache entry) are
the lines ``records.writer.json_line`` writes of the record's dict, byte for byte: on PyTorch's
OpInfo samples, on a transformers Llama trained with AdamW (in-place updates, parameter records),
and on the values whose line the pieces cannot make (non-finite numbers, empty tensors, names and
strings holding ``null``, subclasses of ``int``), which take the dict's path."""

from __future__ import annotations

import enum
import glob
import os

import torch
from dispatchprobe import DispatchProbe
from dispatchprobe.core.recorder import Recorder

from test_value_encoder import run_opinfo_samples, train_llama


def _lines(path) -> list[bytes]:
    return [line for f in sorted(glob.glob(os.path.join(path, "step*", "rank*", "ops.jsonl")))
            for line in open(f, "rb").read().splitlines()]


def _same_lines(tmp_path, monkeypatch, run, **config) -> tuple[int, int]:
    """Run ``run(probe)`` with the pieces and with the dict's path only; the lines must be equal.
    Returns (records written from pieces, records)."""
    joined = []
    write_line = Recorder.record_line

    def counted(self, *args):
        done = write_line(self, *args)
        joined.append(done)
        return done

    out = []
    for pieces in (True, False):
        with monkeypatch.context() as m:
            m.setattr(Recorder, "record_line", counted if pieces else (lambda self, *args: False))
            probe = DispatchProbe(task="statistics", dump_path=str(tmp_path / f"pieces{pieces}"), **config)
            run(probe)
            probe.close()
        out.append(_lines(tmp_path / f"pieces{pieces}"))
    assert out[0] == out[1]
    return sum(joined), len(out[0])


def test_opinfo_lines(tmp_path, monkeypatch):
    def run(probe):
        run_opinfo_samples(probe, dtypes=(torch.float32, torch.bfloat16, torch.int64, torch.complex64))

    joined, records = _same_lines(tmp_path, monkeypatch, run)
    assert records > 1000 and joined > 0.6 * records


def test_training_lines(tmp_path, monkeypatch):
    joined, records = _same_lines(tmp_path, monkeypatch, train_llama)
    assert records > 500 and joined > 0.9 * records


class _Count(enum.IntEnum):
    THREE = 3


def test_values_the_pieces_leave_to_the_dict(tmp_path, monkeypatch):
    """Each op below has a value whose JSON is not a piece: its line is the dict's, and the ops
    around it still join theirs."""

    class Nullable(torch.nn.Module):        # "null" in a scope: the name's piece holds it
        def __init__(self):
            super().__init__()
            self.null_gate = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.null_gate(x)

    def run(probe):
        torch.manual_seed(0)
        model = Nullable()
        with probe:
            x = torch.randn(3, 4)
            model(x).relu()
            torch.tensor([1.0, float("nan"), float("inf")]).mul(-0.0)    # non-finite statistics
            x.add(float("inf"))                       # a non-finite scalar argument
            torch.empty(0).sum()                      # no values: statistics null
            torch.zeros(_Count.THREE)                 # an int subclass
            torch.div(x, 2.0, rounding_mode="floor")  # a string keyword
            x.mul(-0.0).add(0.0)                      # signed zeros among the plain values
            torch.cat([x, x.t().t()], dim=0).sum()
        probe.step()

    joined, records = _same_lines(tmp_path, monkeypatch, run, level="mix")
    assert 0 < joined < records


def test_copies_take_their_sources_statistics(tmp_path, monkeypatch):
    """``clone``, ``copy_`` and a same-dtype ``_to_copy`` whose output lies in memory as its source
    does hold its values bit for bit: the output takes the source's statistics without a read
    (the sums run in memory order); a copy into another layout is read.  Lines as the dict's."""
    from dispatchprobe.torch import tensor_backend as backend
    reads = []
    line = backend.line_stats
    monkeypatch.setattr(backend, "line_stats", lambda keys: reads.extend(k[1] for k in keys) or line(keys))

    def run(probe):
        torch.manual_seed(0)
        with probe:
            torch.zeros(3).add_(1)          # an in-place op first (the versions' form is settled)
            y = torch.randn(64, 64) * 2
            y.clone()
            y.t().clone()                   # a transposed copy, transposed too
            torch.zeros(64, 64).copy_(y)
            torch.zeros(64, 64).t().copy_(y.t())
            y.to(torch.float32, copy=True)
            y[::2].clone()                  # every other row, copied contiguously: read
        probe.step()

    joined, records = _same_lines(tmp_path, monkeypatch, run)
    assert joined == records
    # randn, mul, the two zeros; the slice and its copy
    assert reads.count((64, 64)) == 4 and reads.count((32, 64)) == 2, reads
