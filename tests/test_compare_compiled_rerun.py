"""A float64 re-run measures a ``probe_backend`` graph's records too.  The re-run placing an origin
(:mod:`dispatchprobe.offline.compare.rerun`) read only the replay's device outputs, which a compiled
graph's record has none of (its kernel's outputs are the recorded ones), so every eager-vs-compiled
tensor compare fell back to the recorded errors ("origin approximate").  The benchmark comes with
the recorded outputs: the paired records of an eager run and a probe_backend run are measured, a
kernel planted 1% off in the eager run as its own difference, a clean pair as none, both orders."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dispatchprobe import DispatchProbe
from dispatchprobe.offline.compare.rerun import float64_rerun
from dispatchprobe.records.reader import load
from dispatchprobe.torch.compile import probe_backend

pytestmark = pytest.mark.probe_backend


def _silu_off(x):
    return x * torch.sigmoid(x) * 1.01


def _record(path, compiled: bool, wrong: bool = False):
    """One forward and backward of a two-layer MLP, tensors saved; ``wrong``: aten's CPU silu 1% off."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
    x = torch.randn(8, 16)
    backend = probe_backend(task="tensor", dump_path=str(path), inner="aot_eager") if compiled else None
    step = torch.compile(model, backend=backend) if compiled else model
    lib = torch.library.Library("aten", "IMPL")
    if wrong:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lib.impl("silu", _silu_off, "CPU")
    try:
        probe = DispatchProbe(task="tensor", dump_path=str(path))
        with probe:
            step(x).square().mean().backward()
        probe.close()
    finally:
        lib._destroy()
        if compiled:
            backend.close()
            torch._dynamo.reset()
    return load(path).part(0, 0)


def _forward(part, op: str) -> dict:
    return next(r for r in part.records if r["kind"] == "op" and r["stage"] == "forward" and r["op"] == op)


def _own(part_a, part_b, op: str):
    """The re-run's answer for the first forward ``op`` of each part: whether its output differs by
    more than its inputs carry through it."""
    rec_a, rec_b = _forward(part_a, op), _forward(part_b, op)
    outputs = [("output.0", rec_a["outputs"][0]["data"], rec_b["outputs"][0]["data"], "float32")]
    return float64_rerun("torch", part_a, part_b).own(rec_a, rec_b, outputs)


def test_a_compiled_record_is_measured(tmp_path):
    wrong = _record(tmp_path / "eager", compiled=False, wrong=True)
    graph = _record(tmp_path / "graph", compiled=True)
    assert any(r.get("compiled") for r in graph.records if r["kind"] == "op")
    for a, b in ((wrong, graph), (graph, wrong)):
        assert _own(a, b, "aten.silu.default") is True
        assert _own(a, b, "aten.addmm.default") is False
