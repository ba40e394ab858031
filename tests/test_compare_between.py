"""An op one run runs between an agreeing producer and a differing reader is named only where it can
have changed that value: it makes or writes in place a value of the value's dtype.  Two transformers
versions build an attention mask apart (one inverts it with ``logical_not`` and swaps ``where``'s
branches) while one of them also runs a rotary-table ``mul`` in between: compare named that float
``mul`` as the prime suspect for a boolean mask it never touched, and then the ``logical_not``, for
runs that agree at ``where``'s output (see :mod:`dispatchprobe.offline.compare.rewired`)."""

from __future__ import annotations

import pandas as pd
import torch

from dispatchprobe import DispatchProbe
from dispatchprobe.offline.compare import NOT_JUDGED
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
    """Neither the float ``mul`` nor the ``logical_not`` is named: ``where``'s output agrees, and its
    input rows (the mask against its negation, the branches swapped) compare values the programs
    wire otherwise, so they are not judged and the runs agree, whichever run is A."""
    plain, inverted = _record(tmp_path / "plain", False), _record(tmp_path / "inverted", True)
    for a, b in ((plain, inverted), (inverted, plain)):
        result = compare_parts(a, b)
        divs = [d for d in result.divergences if d is not None]
        assert not divs, [d.describe() for d in divs]
        rows = pd.DataFrame(result.rows) if not isinstance(result.rows, pd.DataFrame) else result.rows
        where = rows[(rows["op_a"] == "aten.where.self") & (rows["io"] == "input")]
        assert len(where) == 3 and (where["status"] == NOT_JUDGED).all(), where[["arg", "status"]]
        assert (rows["status"] != "error").all()
