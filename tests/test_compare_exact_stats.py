"""Between runs that are otherwise bit-identical (same framework, version and device kind, same
dtypes, the same records up to the first difference), any statistics difference is a difference:
one weight element of ``fc1`` nudged by 1e-3 moves ``fc1``'s output statistics by 3e-7, below the
1e-6 floor that runs of other kernels need, and compare names ``fc1`` (not ``fc2``, where the
difference first passes the floor), both ways round.  An origin placed on statistics says it is
approximate.  Identical runs, and a run with the C++ statistics kernel against one on the Python
path, still agree outright."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from click.testing import CliRunner
from torch import nn
from torch.nn import functional as F

from dispatchprobe import DispatchProbe, compare
from dispatchprobe.cli import main
from dispatchprobe.offline.compare.origin import STATS_NOISE
from dispatchprobe.torch import fused_stats

NUDGED = 187    # an element of fc1's weight whose x1.001 moves fc1's output statistics by less than the floor
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Mlp(nn.Module):
    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.fc1, self.fc2, self.scale = nn.Linear(16, 32), nn.Linear(32, 4), scale

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x) * self.scale))


def record(path, nudge: int | None = None, scale: float = 1.0):
    """One forward and backward (statistics task); ``nudge``: fc1's weight element scaled by 1.001."""
    torch.manual_seed(0)
    model = Mlp(scale)
    if nudge is not None:
        with torch.no_grad():
            model.fc1.weight.view(-1)[nudge] *= 1.001
    probe = DispatchProbe(task="statistics", dump_path=str(path))
    g = torch.Generator().manual_seed(0)
    with probe:
        F.mse_loss(model(torch.randn(8, 16, generator=g)), torch.randn(8, 4, generator=g)).backward()
    probe.close()
    return path / "step0" / "rank0"


_FRESH = """
import pathlib, sys
from dispatchprobe.torch import fused_stats
from tests.test_compare_exact_stats import record
record(pathlib.Path(sys.argv[1]))
print("kernel", fused_stats.tree_rows is not None)
"""


def _named(v, stage="forward"):
    return getattr(v, stage) or next((d for d in v.departures if d.stage == stage), None)


def _exit(a, b) -> int:
    return CliRunner().invoke(main, ["compare", str(a), str(b)]).exit_code


def test_a_difference_below_the_floor_is_named_where_it_enters(tmp_path):
    clean, nudged = record(tmp_path / "clean"), record(tmp_path / "nudged", nudge=NUDGED)
    table, _ = compare(clean, nudged)
    fc1_out = table[(table.scope == "Mlp.fc1") & (table.stage == "forward") & (table.io == "output")].stats_err.iat[0]
    assert 0 < fc1_out < STATS_NOISE, fc1_out        # the case the floor hid (named at fc2 under it)
    for a, b in ((nudged, clean), (clean, nudged)):
        v = compare(a, b).verdict
        d = _named(v, "forward")
        assert (d.op, d.scope, d.cause, d.arg, d.step) == ("aten.addmm.default", "Mlp.fc1", "inputs", "input.2", 0), str(v)
        assert v.passed and "first seen at aten.addmm.default [Mlp.fc1] input.2" in str(v), str(v)
        assert _exit(a, b) == 0


def test_an_origin_placed_on_statistics_says_approximate(tmp_path):
    """fc1's output scaled by 1 + 2**-22 (2.4e-7, below the floor) in one run: the mul is the origin,
    placed on statistics (equal statistics do not prove equal values): approximate."""
    plain, scaled = record(tmp_path / "plain"), record(tmp_path / "scaled", scale=1 + 2 ** -22)
    for a, b in ((scaled, plain), (plain, scaled)):
        v = compare(a, b).verdict
        d = _named(v, "forward")
        assert (d.op, d.scope, d.cause, d.approximate) == ("aten.mul.Tensor", "Mlp", "op", True), str(v)
        assert "(origin approximate: " in next(ln for ln in str(v).splitlines() if "aten.mul.Tensor" in ln)


def test_other_kernels_keep_the_floor(tmp_path):
    """The same records, run B's manifest saying another torch version: its kernels may round
    differently at every op, so statistics below the floor count as equal again (no departure at fc1)."""
    clean, nudged = record(tmp_path / "clean"), record(tmp_path / "nudged", nudge=NUDGED)
    manifest = tmp_path / "nudged" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["framework_version"] = data["framework_version"] + ".other"
    manifest.write_text(json.dumps(data))
    for a, b in ((nudged, clean), (clean, nudged)):
        v = compare(a, b).verdict
        d = _named(v, "forward")
        assert d is not None and d.scope == "Mlp.fc2", str(v)


def test_identical_runs_and_either_statistics_path_agree(tmp_path):
    """Two runs in fresh processes, one with the native statistics, one with
    DISPATCHPROBE_FUSED_STATS=0, and a third run in this process: no departure anywhere, exit 0."""
    assert fused_stats.build_native() is None, f"the kernel did not build: {fused_stats.error}"
    for name, env, kernel in (("native", "1", True), ("python", "0", False)):
        done = subprocess.run([sys.executable, "-c", _FRESH, str(tmp_path / name)], cwd=ROOT, capture_output=True,
                              env={**os.environ, "DISPATCHPROBE_FUSED_STATS": env}, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split()[-2:] == ["kernel", str(kernel)], done.stdout
    runs = [tmp_path / "native" / "step0" / "rank0", tmp_path / "python" / "step0" / "rank0", record(tmp_path / "here")]
    for a, b in ((runs[0], runs[1]), (runs[1], runs[0]), (runs[0], runs[2])):
        v = compare(a, b).verdict
        assert v.passed and not v.departures and v.forward is None and v.backward is None, str(v)
        assert "the runs agree" in str(v).splitlines(), str(v)
        assert _exit(a, b) == 0
