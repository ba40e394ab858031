"""A verdict line names the paired record's call and place in both runs where they differ.

Runs that make one op's calls in other numbers (an eager run against a compiled graph, which folds or
adds calls) pair records whose call index and place in their stage differ: a line naming run A's alone
('call 0' one way round, 'call 1' the other) changed with the runs' order.  Here run B makes one more
``addmm`` than run A before the model (unused), and a wrong ``addmm`` kernel in run B is named at the
first layer, whose call is 0 in run A and 1 in run B: both are named, the same pair either way round."""

from __future__ import annotations

import torch

from compare_helpers import planted_kernel
from dispatchprobe import DispatchProbe
from dispatchprobe.offline.compare import compare


def _wrong_addmm(bias, x, w, beta=1, alpha=1):
    """addmm 1% too large."""
    return (bias * beta + alpha * (x @ w)) * 1.01


def _record(path, extra_call: bool, wrong: bool):
    """One step of a two-layer MLP; ``extra_call``: an unused ``addmm`` before the model (top level);
    ``wrong``: every ``addmm`` 1% too large."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    probe = DispatchProbe(task="statistics", dump_path=str(path))
    with planted_kernel("addmm" if wrong else None, _wrong_addmm):
        with probe:
            if extra_call:
                torch.addmm(torch.zeros(3), torch.ones(2, 5), torch.ones(5, 3))
            model(x).pow(2).mean().backward()
        probe.step()
    probe.close()
    return path


def test_a_line_names_both_runs_calls_where_they_differ(tmp_path):
    clean, planted = _record(tmp_path / "clean", False, False), _record(tmp_path / "planted", True, True)
    # run B's layer is its fifth record of the forward (after zeros, ones, ones and the extra addmm)
    for a, b, calls, seqs in ((clean, planted, "call A 0, B 1", "(A #0, B #4 in forward, step 0 rank 0)"),
                              (planted, clean, "call A 1, B 0", "(A #4, B #0 in forward, step 0 rank 0)")):
        d = compare(a, b).verdict.forward
        assert d is not None and (d.cause, d.op, d.scope) == ("op", "aten.addmm.default", "Sequential.0"), str(d)
        line = d.describe()
        assert f"[Sequential.0] {calls} {seqs}" in line, line
