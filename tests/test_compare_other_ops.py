"""Two runs of one framework that compute a stretch of the model with other ops: torch 2.13 runs
attention as one ``_scaled_dot_product_flash_attention_for_cpu`` where torch 2.5.1 (with a mask)
runs ``bmm``, ``_safe_softmax``, ``bmm``, ``clone``; each run's ops there have no counterpart.
Where the value leaving that stretch differs while what enters it agrees, the wrong kernel may be
either run's: compare named the last op of one run's stretch (a ``clone``, which copies) as the
prime suspect.  Now the line names the stretch with both runs' ops, in either order."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dispatchprobe import DispatchProbe
from dispatchprobe.offline.compare.driver import compare_parts
from dispatchprobe.records.reader import load

from compare_helpers import planted


class _Attention(nn.Module):
    def __init__(self, fused: bool):
        super().__init__()
        self.fused = fused
        self.qkv = nn.Linear(16, 48)
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
        if self.fused:
            o = F.scaled_dot_product_attention(q, k, v)
        else:
            o = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), -1) @ v
        return self.proj(o.transpose(1, 2).reshape(2, 8, 16))


def _wrong_softmax(x, dim, half_to_float):
    return torch.exp(x - x.amax(dim, keepdim=True)) / torch.exp(x - x.amax(dim, keepdim=True)).sum(dim, keepdim=True) * 1.01


def _record(path, fused: bool, wrong: bool = False):
    torch.manual_seed(0)
    model, x = _Attention(fused), torch.randn(2, 8, 16)
    with planted({"_softmax": _wrong_softmax} if wrong else {}):
        probe = DispatchProbe(task="statistics", dump_path=str(path))
        with probe:
            model(x).square().mean().backward()
        probe.close()
    return load(path).part(0, 0)


@pytest.mark.parametrize("wrong_in_pieces", [True, False])
def test_a_stretch_computed_with_other_ops_is_named_with_both_runs_ops(tmp_path, wrong_in_pieces):
    """The wrong ``_softmax`` sits in the run that computes attention with pieces; clean, the two
    implementations differ by rounding only."""
    fused = _record(tmp_path / "fused", fused=True)
    pieces = _record(tmp_path / "pieces", fused=False, wrong=wrong_in_pieces)
    for a, b in ((fused, pieces), (pieces, fused)):
        divs = {d.stage: d for d in compare_parts(a, b).divergences}
        d = divs.get("forward")
        if not wrong_in_pieces:
            assert d is None or d.departure, d.describe()
            if d is None:
                continue
        assert d is not None and not (wrong_in_pieces and d.departure), divs
        line = d.describe()
        assert d.cause == "region" and "prime suspect" not in line and "cannot tell which" in line, line
        assert any("scaled_dot_product" in op for op in d.region["a" if a is fused else "b"]), d.region
        assert "aten._softmax.default" in d.region["b" if a is fused else "a"], d.region
