"""compare of what is computed from uninitialised memory.

A pipeline-parallel stage runs its first (warm-up) micro-batch on receive buffers nothing it sees
wrote, the way ``torch.empty`` leaves them: the probe flags such an input ``undefined`` and compare
never judges it, but the values computed from it are garbage too, different in every run.  Once
they were judged: two clean pipeline runs said "first forward divergence: aten.addmm ... error
2.2e23".  Here the garbage is written behind the probe's back (through numpy, below dispatch), a
different garbage per run: what is computed from it is not judged, the real step still is, and a
wrong kernel in it is still named."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from compare_helpers import planted_kernel
from dispatchprobe import DispatchProbe
from dispatchprobe.offline.compare import compare


def _record(path, garbage_seed: int, kernel=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    probe = DispatchProbe(task="statistics", dump_path=str(path))
    with planted_kernel(kernel, lambda t: torch.clamp_min(t, 0) * 1.01 if kernel else None):
        with probe:
            buf = torch.empty(4, 16)                       # a receive buffer: flagged undefined
            buf.numpy()[:] = np.random.default_rng(garbage_seed).standard_normal((4, 16)) * 1e3
            model(buf).sum()                               # the warm-up on it
            model(x).square().mean().backward()            # the real step
    probe.close()
    return path


def test_values_computed_from_undefined_memory_are_not_judged(tmp_path):
    a, b = _record(tmp_path / "a", 1), _record(tmp_path / "b", 2)
    for x, y in ((a, b), (b, a)):
        table, v = compare(x, y)
        assert v.forward is None and v.backward is None, str(v)
        warm = table[table["status"] == "not judged"]
        assert {"aten.addmm.default", "aten.relu.default"} <= set(warm["op_a"]), table[["op_a", "status"]]
        assert (table["status"] == "pass").sum() > 10


def test_a_wrong_kernel_in_the_real_step_is_still_named(tmp_path):
    a, b = _record(tmp_path / "a", 1), _record(tmp_path / "b", 2, kernel="relu")
    for x, y in ((a, b), (b, a)):
        _, v = compare(x, y)
        assert v.forward is not None and v.forward.op == "aten.relu.default" and v.forward.cause == "op", str(v)
