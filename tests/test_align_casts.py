"""A layer run in bf16 in one run only (wrapped in a module that casts around it): compare pairs
its compute ops with the other run's and leaves the wrapper's casts as present in one run only,
never pairing a cast with a compute op by shape."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from dispatchprobe import DispatchProbe
from dispatchprobe.cli import main
from dispatchprobe.core.op_traits import is_cast


class BF16Linear(nn.Module):
    """Runs the wrapped linear layer in bfloat16: casts its input in and its output back."""

    def __init__(self, inner: nn.Linear):
        super().__init__()
        self.inner = inner.to(torch.bfloat16)

    def forward(self, x):
        return self.inner(x.to(torch.bfloat16)).to(x.dtype)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def record(path, bf16_fc2: bool):
    torch.manual_seed(0)
    model = MLP()
    if bf16_fc2:
        model.fc2 = BF16Linear(model.fc2)
    probe = DispatchProbe(task="tensor", dump_path=str(path), model=model)
    with probe:
        model(torch.randn(4, 16)).square().mean().backward()
    probe.step()
    probe.close()
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16wrap")
    return record(root / "fp32", False), record(root / "bf16", True)


@pytest.mark.parametrize("bf16_side", ["A", "B"])
def test_wrapped_bf16_layer_pairs_its_compute_ops_not_its_casts(runs, tmp_path, bf16_side):
    fp32, bf16 = runs
    a, b = (bf16, fp32) if bf16_side == "A" else (fp32, bf16)
    res = CliRunner().invoke(main, ["compare", str(a), str(b), "-o", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output          # the bf16 layer is within bf16's tolerance: no fake error
    table = pd.read_csv(tmp_path / "out" / "compare.csv", keep_default_na=False)
    unmatched = pd.read_csv(tmp_path / "out" / "unmatched.csv", keep_default_na=False)
    # no cast is ever paired with a compute op
    mixed = table[table["op_a"].map(is_cast) != table["op_b"].map(is_cast)]
    assert mixed.empty, mixed[["scope", "op_a", "op_b", "match"]]
    # fc2's addmm (forward) and its two mm (backward) pair with the bf16 run's, inside the wrapper
    fc2 = table[table["scope"].str.startswith("MLP.fc2")].drop_duplicates(["stage", "seq"])
    assert sorted(zip(fc2["stage"], fc2["op_a"], fc2["op_b"])) == [
        ("backward", "aten.mm.default", "aten.mm.default"), ("backward", "aten.mm.default", "aten.mm.default"),
        ("backward", "aten.sum.dim_IntList", "aten.sum.dim_IntList"),
        ("forward", "aten.addmm.default", "aten.addmm.default")]
    assert set(table.loc[table["scope"].str.startswith("MLP.fc2"), "status"]) == {"pass"}
    # what is left is the wrapper's four casts, all in the bf16 run: present in one run only
    assert len(unmatched) == 4 and unmatched["is_cast"].all() and set(unmatched["side"]) == {bf16_side.lower()}
    assert "0 compute ops" in res.output
