"""Two implementations of one optimizer inside ``with probe:`` (AdamW's foreach ops against its fused
kernel, or against its one-tensor-at-a-time loop) make the same update with other ops.  compare pairs
calls of one op only where they compute alike: an op that returns nothing (an in-place foreach
update) is keyed on the tensors it is given, and calls of one op whose tensors differ in number or
rank never pair.  So AdamW's step-count increment (on scalars) is not paired with the other
implementation's epsilon add (on the parameters' shapes) and named as a divergence: where the
updates agree within rounding the runs agree, whichever run is A."""

from __future__ import annotations

import csv

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from dispatchprobe.cli import main
from compare_helpers import train_attention_steps


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))).square().mean()


def _record(path, task: str, implementation: str):
    torch.manual_seed(0)
    model = TwoLayers()
    kwargs = {"foreach": dict(foreach=True), "fused": dict(fused=True), "loop": dict(foreach=False)}[implementation]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **kwargs)
    return train_attention_steps(model, opt, path, task=task, compiled=False, steps=2, optimizer_inside=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("optimizers")
    made: dict = {}

    def get(task, implementation):
        key = (task, implementation)
        if key not in made:
            made[key] = _record(root / f"{task}-{implementation}", task, implementation)
        return made[key]
    return get


@pytest.mark.parametrize("task", ["statistics", "tensor"])
@pytest.mark.parametrize("other", ["fused", "loop"])
def test_updates_made_by_other_ops_agree(runs, tmp_path, task, other):
    for a, b in ((runs(task, "foreach"), runs(task, other)), (runs(task, other), runs(task, "foreach"))):
        out = tmp_path / f"{a.name}-vs-{b.name}"
        got = CliRunner().invoke(main, ["compare", str(a), str(b), "-o", str(out)])
        assert got.exit_code == 0, got.output
        assert "first forward" not in got.output and "first backward" not in got.output, got.output
        assert "prime suspect" not in got.output, got.output
        with open(out / "unmatched.csv", newline="") as f:
            unmatched = list(csv.DictReader(f))
        # every foreach call of run "foreach" has no counterpart in the other implementation's run
        side = "a" if a.name.endswith("foreach") else "b"
        foreach_side = [r["op"] for r in unmatched if r["side"] == side and r["op"].startswith("aten._foreach")]
        assert "aten._foreach_add_.Scalar" in foreach_side, unmatched
