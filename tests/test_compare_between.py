"""An op one run runs between an agreeing producer and a differing reader is named only where it can
have changed that value: it makes or writes in place a value of the value's dtype.  Two transformers
versions build an attention mask apart (one inverts it with ``logical_not`` and swaps ``where``'s
branches) while one of them also runs a rotary-table ``mul`` in between: compare named that float
``mul`` as the prime suspect for a boolean mask it never touched."""

from __future__ import annotations

import torch

from dispatchprobe import DispatchProbe
from dispatchprobe.offline.compare.driver import compare_parts
from dispatchprobe.records.reader import load


def _record(path, inverted: bool):
    torch.manual_seed(0)
    x, a, b = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)
    probe = DispatchProbe(task="statistics", dump_path=str(path))
    with probe:
        mask = x > 0
        if inverted:
            y = torch.where(mask.logical_not(), b, a)
        else:
            (a * 2.0).sum()          # a float value the other run does not compute, read by nothing after
            y = torch.where(mask, a, b)
        (y * 3.0).sum()
    probe.close()
    return load(path).part(0, 0)


def test_an_op_of_another_dtype_between_is_not_named(tmp_path):
    plain, inverted = _record(tmp_path / "plain", False), _record(tmp_path / "inverted", True)
    for a, b in ((plain, inverted), (inverted, plain)):
        divs = [d for d in compare_parts(a, b).divergences if d is not None]
        assert divs, "the where's mask differs between the runs"
        for d in divs:
            assert d.op != "aten.mul.Tensor", d.describe()
            assert d.op == "aten.logical_not.default", d.describe()
