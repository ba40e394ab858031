"""The accelerator statistics path in windows (``torch/device_batch.py``): values copied at their
op's time, reduced many at once, read back without waiting per op. Run here on CPU tensors with
``device_batch.HOST_AS_DEVICE`` (the accelerator path on the host, a real configuration of it):
the records are the CPU path's and the per-value device path's, byte for byte, in the same order,
on real models; values overwritten after their op keep the op's numbers; nothing is lost at close,
and a killed process leaves a prefix of the records."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from dispatchprobe import DispatchProbe
from dispatchprobe.core import recorder
from dispatchprobe.models import TinyTransformer, lm_batch, lm_loss
from dispatchprobe.torch import device_batch, tensor_backend as backend
from test_fused_stats import _device_cases, _same
from test_value_encoder import train_llama

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _small_windows(m) -> None:
    """Windows that fill by count and by bytes, values reduced at their op, looks every 16 values."""
    m.setattr(device_batch, "HOST_AS_DEVICE", True)
    m.setattr(device_batch, "WINDOW_VALUES", 7)
    m.setattr(device_batch, "WINDOW_BYTES", 1 << 16)
    m.setattr(device_batch, "DIRECT_BYTES", 1 << 14)
    m.setattr(recorder, "DEFER_BATCH", 16)


def _values():
    for x in _device_cases():
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            yield x.to(dtype)
        whole = x.nan_to_num(0.0, 0.0, 0.0) * 100
        yield whole.to(torch.int64)
        yield whole.to(torch.int32)
        yield whole > 0
        yield torch.complex(x, -x)
    yield torch.tensor(2.5)                                        # no dimensions
    yield torch.randn(3, 4, 5).permute(2, 0, 1)                    # dense, permuted
    yield torch.randn(6, 9)[::2, 1:7]                              # gaps between rows


@pytest.mark.parametrize("window", [True, False])
def test_each_value_gets_the_cpu_record(monkeypatch, window):
    """Every dtype (integers and bool converted in the copy, complex reduced at its op), values
    across chunk and window limits, non-finite values, strided and expanded views."""
    _small_windows(monkeypatch)
    monkeypatch.setattr(device_batch, "WINDOW", window)
    values = list(_values())
    rows = [backend.device_stats_row(x) for x in values]
    if window:
        assert {type(r) for r in rows} == {device_batch.Pending}
        assert len({id(r.window) for r in rows}) >= len(values) // 7
        full = [torch.randn(3000) for _ in range(3)]          # 12 KB each: two fill a 32 KB buffer
        monkeypatch.setattr(device_batch, "WINDOW_BYTES", 1 << 15)
        queued = [backend.device_stats_row(x) for x in full]
        assert queued[0].window is queued[1].window is not queued[2].window
        values += full
        rows += queued
    got = backend.read_stats_rows(rows, [x.numel() for x in values])
    wrong = [(tuple(x.shape), x.dtype) for x, g in zip(values, got) if not _same(g, backend._cpu_stats(x))]
    assert wrong == []


def test_values_overwritten_after_their_op_keep_its_numbers(monkeypatch):
    """A value queued, then written in place (through itself and through a view of its memory)
    before its window is reduced: the record holds the values the op gave."""
    _small_windows(monkeypatch)
    monkeypatch.setattr(device_batch, "WINDOW_VALUES", 1000)
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    rows = [backend.device_stats_row(x), backend.device_stats_row(x.t())]
    before = backend._cpu_stats(x.clone())
    x.mul_(-3)
    x.view(-1)[5] = float("nan")
    assert all(not r.ready() for r in rows)        # still in the open window
    assert [_same(s, before) for s in backend.read_stats_rows(rows, [12, 12])] == [True, True]


def _lines(path) -> list[bytes]:
    return [line for f in sorted(glob.glob(os.path.join(path, "step*", "rank*", "ops.jsonl")))
            for line in open(f, "rb").read().splitlines()]


def _llama(probe):
    """The tests' tiny transformers Llama, its second sequence padded (an attention mask)."""
    train_llama(probe, padded=True)


def _transformer_bf16(probe):
    torch.manual_seed(0)
    model = TinyTransformer(dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        tokens, targets = lm_batch(batch=4, seq=16, vocab=128, seed=step)
        with probe:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = lm_loss(model, tokens, targets)
            loss.backward()
            opt.step()            # in-place updates of values measured earlier in the step
            opt.zero_grad()
        probe.step()


def _half_values(probe):
    """float16 values, in-place ops and views written after the op that made them."""
    torch.manual_seed(0)
    x = torch.randn(64, 33).half()
    with probe:
        y = x * 2
        v = y[:, 1:5]
        z = v.exp()
        y.add_(1)             # y and its view v change after the ops that recorded them
        v.zero_()
        w = (y[:, 1:5].float() + z.float()).sum(0)
        w.clamp_(-1, 1)
    probe.close()


@pytest.mark.parametrize("run", [_llama, _transformer_bf16, _half_values])
def test_records_are_the_cpu_and_per_value_paths_byte_for_byte(tmp_path, monkeypatch, run):
    """The same run recorded by the CPU path, the per-value device path and the windows: the same
    ops.jsonl bytes (ids, order, every statistic); the windows read back without a wait per op."""
    if run is _llama:
        pytest.importorskip("transformers")
    reads = []
    out = {}
    for name in ("cpu", "per_value", "windows"):
        with monkeypatch.context() as m:
            if name != "cpu":
                _small_windows(m)
                m.setattr(device_batch, "WINDOW", name == "windows")
                m.setattr(backend, "read_stats_rows",
                          lambda rows, numels, k=backend.read_stats_rows: reads.append(len(rows)) or k(rows, numels))
            probe = DispatchProbe(task="statistics", dump_path=str(tmp_path / name))
            run(probe)
            probe.close()
        out[name] = _lines(tmp_path / name)
    assert len(out["cpu"]) > 5
    assert out["windows"] == out["cpu"]
    assert out["per_value"] == out["cpu"]
    assert len(reads) < len(out["cpu"]) / 2 and max(reads) > 1       # read in batches, never per op


_KILLED = """
import os, sys, torch
from dispatchprobe import DispatchProbe
from dispatchprobe.core import recorder
from dispatchprobe.torch import device_batch
device_batch.HOST_AS_DEVICE = {host}
recorder.DEFER_BATCH = 16
device_batch.WINDOW_VALUES = 7
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(12)])
probe = DispatchProbe(task="statistics", dump_path=sys.argv[1])
with probe:
    for i in range(3):
        model(torch.randn(4, 16)).sum().backward()
    if {kill}:
        os._exit(0)              # killed mid-step: nothing closes, nothing flushes
probe.close()
"""


def test_a_killed_process_leaves_a_prefix_of_the_records(tmp_path):
    """Records wait in memory only until their statistics have arrived; a process killed mid-step
    leaves every record before the first whose values were on their way, in order, none torn."""
    lines = {}
    for name, host, kill in (("whole", "False", "False"), ("killed", "True", "True")):
        script = textwrap.dedent(_KILLED).format(host=host, kill=kill)
        done = subprocess.run([sys.executable, "-c", script, str(tmp_path / name)], cwd=ROOT, capture_output=True,
                              text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
        assert done.returncode == 0, done.stderr[-2000:]
        lines[name] = _lines(tmp_path / name)
    whole, killed = lines["whole"], lines["killed"]
    assert killed == whole[:len(killed)]
    # behind the last look: at most DEFER_BATCH values queued since, and the window holding them
    assert len(whole) - len(killed) <= 16 + 7 and len(killed) > len(whole) / 2


_TRITON_TABLE = """
import torch
from dispatchprobe.torch import device_batch, tensor_backend as backend
from tests.test_fused_stats import _device_cases, _same
device_batch.HOST_AS_DEVICE = True
device_batch.WINDOW_VALUES = 7
assert device_batch.uses_triton(torch.device("cpu"))
values = [x.to(dtype) for x in _device_cases() for dtype in (torch.float32, torch.bfloat16, torch.float64)]
values += [(x.nan_to_num(0.0, 0.0, 0.0) * 100).to(torch.int64) for x in _device_cases()]
rows = [backend.device_stats_row(x) for x in values]
got = backend.read_stats_rows(rows, [x.numel() for x in values])
wrong = [(tuple(x.shape), str(x.dtype)) for x, g in zip(values, got) if not _same(g, backend._cpu_stats(x))]
print("checked", len(values), "wrong", wrong)
"""


def test_the_triton_table_kernel_gives_the_cpu_records():
    """The one launch per window and dtype (``device_stats_kernels.reduce_table``), run by Triton's
    interpreter on the CPU in a process of its own: the CPU records, bit for bit. Where Triton is
    missing or older than the release checked, windows are reduced by torch's operations."""
    from dispatchprobe.torch import device_stats
    release = device_stats.triton_release()
    if release is None or release < device_stats.MIN_TRITON:
        assert not device_batch.uses_triton(torch.device("cpu"))
        return
    done = subprocess.run([sys.executable, "-c", _TRITON_TABLE], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[:2] == ["checked", "72"] and done.stdout.rstrip().endswith("wrong []"), done.stdout
