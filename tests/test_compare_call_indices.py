"""A verdict line names the paired record's call and place in both runs where they differ.

Runs that make one op's calls in other numbers (an eager run against a compiled graph, which folds or
adds calls) pair records whose call index and place in their stage differ: a line naming run A's alone
('call 0' one way round, 'call 1' the other) changed with the runs' order.  Here run B makes one more
``addmm`` than run A before the model (unused), and a wrong ``addmm`` kernel in run B is named at the
first layer, whose call is 0 in run A and 1 in run B: both are named, the same pair either way round."""

from __future__ import annotations

import re

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


def _swapped(words: str) -> str:
    """``words`` as the other order of the runs says them: ``A x, B y`` -> ``A y, B x``."""
    return re.sub(r"A (#?\d+), B (#?\d+)", r"A \2, B \1", words)


def _suspicious_rows(page: str) -> list:
    """The page's suspicious-ops table, each row a dict by column."""
    table = page.split('id="suspicious"')[1].split("</table>")[0]
    head = re.findall(r"<th[^>]*>(.*?)</th>", table)
    return [dict(zip(head, re.findall(r"<td>(.*?)</td>", row))) for row in re.findall(r"<tr [^>]*data-op[^>]*>(.*?)</tr>", table)]


def test_the_page_names_both_runs_calls_and_places(tmp_path):
    """compare.html's op cards, chart points and suspicious rows name a pair as the verdict's lines do:
    both runs' call and place where they differ, so the page of ``compare B A`` says what the page of
    ``compare A B`` says with A and B swapped."""
    from html_check import page_data

    clean, planted = _record(tmp_path / "clean", False, False), _record(tmp_path / "planted", True, True)
    pages = []
    for a, b, named in ((clean, planted, "call A 0, B 1 (A #0, B #4 in forward, step 0 rank 0)"),
                        (planted, clean, "call A 1, B 0 (A #4, B #0 in forward, step 0 rank 0)")):
        out = tmp_path / f"{a.name}-{b.name}"
        compare(a, b, out=str(out))
        data = page_data((out / "compare.html").read_text())
        cards = {(o["op_a"], o["k"][2], o["named"]) for o in data["ops"]}
        assert ("aten.addmm.default", "forward", named) in cards, sorted(cards)
        points = [w for stage in data["series"]["0/0"].values() for w in stage["named"]]
        assert f"aten.addmm.default [Sequential.0] {named}" in points, points
        suspicious = _suspicious_rows((out / "compare.html").read_text())
        first = next(r for r in suspicious if (r["op_a"], r["stage"]) == ("aten.addmm.default", "forward"))
        assert (first["seq"], first["seq_b"], first["call_a"], first["call_b"]) == \
            (("0", "4", "0", "1") if a is clean else ("4", "0", "1", "0")), suspicious
        pages.append((cards, sorted(points), data["divs"]))
    (cards_ab, points_ab, divs_ab), (cards_ba, points_ba, divs_ba) = pages
    assert {(op, stage, _swapped(w)) for op, stage, w in cards_ab} == cards_ba
    assert sorted(map(_swapped, points_ab)) == points_ba
    assert {s: _swapped(d["text"]) for s, d in divs_ab.items()} == {s: d["text"] for s, d in divs_ba.items()}
