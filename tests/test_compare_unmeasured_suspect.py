"""An op present in one run only whose output no row compares is not named where a measured input
already explains the difference.  A tiny Falcon compiled by inductor computes its tied embedding's
two gradients in one fused kernel: the eager run's ``mm`` for the LM head's share is in that run
only, and the compiled gradient-accumulation ``add`` is a decomposed call with no traced inputs, so
neither input of the paired ``add`` has a row.  Its other input (the embedding's gradient) carries
a difference from a wrong kernel much later in the backward, yet compare named the eager ``mm`` as
"first backward divergence ... present only in run A (prime suspect)": the earliest record of any
source, measured or not.

The runs here are two eager runs of a tied-weight model, one with a ``gelu_backward`` 1% off; the
second is given the compiled run's shape (its LM head ``mm`` gone, its accumulation ``add`` a
decomposed call without traced inputs, as probe_backend records it)."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

from dispatchprobe import DispatchProbe
from dispatchprobe.offline.compare.driver import compare_parts
from dispatchprobe.records.reader import load

V, D = 32, 16


class _TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.down(F.gelu(self.up(h)))
        return F.linear(h, self.emb.weight)       # the LM head shares the embedding


def _record(path, wrong_gelu_backward: bool):
    torch.manual_seed(0)
    model = _TiedLM()
    ids = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(1))
    lib = torch.library.Library("aten", "IMPL")
    if wrong_gelu_backward:
        def gelu_backward(grad, x, approximate="none"):
            cdf = 0.5 * (1 + torch.erf(x * 0.7071067811865476))
            pdf = torch.exp(-0.5 * x * x) * 0.3989422804014327
            return grad * (cdf + x * pdf) * 1.01
        lib.impl("gelu_backward", gelu_backward, "CPU")
    try:
        probe = DispatchProbe(task="tensor", dump_path=str(path))
        with probe:
            F.cross_entropy(model(ids).reshape(-1, V), ids.reshape(-1)).backward()
        probe.close()
    finally:
        lib._destroy()
    return load(path).part(0, 0)


def _as_compiled(part):
    """The part with the tied weight's two gradients made as a fused kernel makes them: the LM head's
    weight-gradient ``mm`` not recorded, the accumulating ``add`` a decomposed call, inputs untraced."""
    part = copy.copy(part)
    recs = [dict(r) for r in part.records]
    head = next(i for i, r in enumerate(recs) if r["stage"] == "backward" and r["op"] == "aten.mm.default"
                and r["outputs"][0]["shape"] == [V, D])
    key = recs[head]["outputs"][0]["data"]
    add = next(i for i, r in enumerate(recs) if r["stage"] == "backward" and r["op"] == "aten.add.Tensor"
               and any(x.get("data") == key for x in r["inputs"]))
    recs[add] = {**recs[add], "inputs": [], "kwargs": {}, "compiled": {"graph": 1, "nodes": ["add"], "decomposed": True,
                                                                        "call": False, "kernels": []}}
    del recs[head]
    part.__dict__["records"] = recs
    return part


def test_unmeasured_one_run_only_op_is_no_suspect_where_a_measured_input_explains(tmp_path):
    clean, wrong = _record(tmp_path / "clean", False), _as_compiled(_record(tmp_path / "wrong", True))
    for a, b, side in ((clean, wrong, "b"), (wrong, clean, "a")):
        found = {d.stage: d for d in compare_parts(a, b).divergences}
        d = found.get("backward")
        assert d is not None and (d.cause, d.op, d.scope) == ("op", "aten.gelu_backward.default", "_TiedLM"), found
