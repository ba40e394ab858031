"""The mean a normalisation saves (``native_layer_norm``'s output.1) of a value that is already
normalised is rounding noise around zero: two runs of other kernels (eager and inductor, a tiny Swin)
give means of 1e-8 that share no direction (cosine 0.17), which compare called the first forward
divergence.  The mean is a sum of its input's elements: it passes where the runs differ by no more
than the rounding its terms carry, also where one run's record does not hold the input (a compiled
graph that normalises another value equal to it: the input is "not read by the compiled graph").
Its difference counts relative to those terms in the lineage too: a change planted after it is
named where it is planted, not at the normalisation (as it was on the Swin)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from dispatchprobe import DispatchProbe
from dispatchprobe.offline.compare.driver import compare_parts
from dispatchprobe.records.reader import load
from dispatchprobe.standards import verdicts as V


class _TwoNorms(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.LayerNorm(64), nn.LayerNorm(64)
        self.proj = nn.Linear(64, 64)

    def forward(self, x):
        return self.proj(self.second(self.first(x))).square().sum()


def _record(path, nudge: bool, plant: bool = False):
    """One forward and backward; ``nudge``: the input moved by one rounding on every other element
    (what another kernel's rounding does to a value upstream); ``plant``: the projection's output
    scaled by 1.01 (an op in this run only)."""
    torch.manual_seed(0)
    model = _TwoNorms()
    if plant:
        model.proj.register_forward_hook(lambda m, args, out: out * 1.01)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    if nudge:
        x = torch.where(torch.arange(64) % 2 == 0, torch.nextafter(x, x + 1), x)
    probe = DispatchProbe(task="tensor", dump_path=str(path))
    with probe:
        model(x).backward()
    probe.close()
    return load(path).part(0, 0)


def _unread_input(part):
    """The part as a compiled graph records it when it normalises a value equal to the input."""
    part = copy.copy(part)
    recs = [dict(r) for r in part.records]
    k = next(i for i, r in enumerate(recs) if r["op"] == "aten.native_layer_norm.default"
             and r["scope"] == "_TwoNorms.second")
    spec = {key: v for key, v in recs[k]["inputs"][0].items() if key not in ("stats", "data")}
    recs[k] = {**recs[k], "inputs": [{"type": "other", "repr": "float32[8, 64] tensor, not read by the compiled graph",
                                      "unread": spec}, *recs[k]["inputs"][1:]]}
    part.__dict__["records"] = recs
    return part


def test_saved_mean_of_a_normalised_value_is_judged_by_its_terms(tmp_path):
    plain, nudged = _record(tmp_path / "plain", False), _record(tmp_path / "nudged", True)
    for a, b in ((plain, nudged), (nudged, plain), (plain, _unread_input(nudged)), (_unread_input(nudged), plain)):
        rows = compare_parts(a, b).rows
        mean = rows[(rows["scope"] == "_TwoNorms.second") & (rows["op_a"] == "aten.native_layer_norm.default")
                    & (rows["arg"] == "output.1")]
        assert len(mean) == 1, rows[["scope", "op_a", "arg"]]
        row = mean.iloc[0]
        assert row["cosine"] < 0.99, row[["cosine", "max_abs_err"]]     # noise: no direction in common
        assert row["status"] == V.PASS and "the values cancel" in row["reason"], (row["status"], row["reason"])


def test_change_after_a_normalised_mean_is_named_where_planted(tmp_path):
    plain, planted = _record(tmp_path / "plain", False), _record(tmp_path / "planted", True, plant=True)
    for a, b, side in ((plain, planted, "b"), (planted, plain, "a"), (plain, _unread_input(planted), "b"),
                       (_unread_input(planted), plain, "a")):
        found = {d.stage: d for d in compare_parts(a, b).divergences}
        d = found.get("forward")
        assert d is not None and (d.cause, d.op, d.scope, d.side) == ("unmatched", "aten.mul.Tensor", "_TwoNorms.proj",
                                                                      side), found
