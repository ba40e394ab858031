"""compare of a loop that never calls ``probe.step()`` against one that does, where no ``torch.optim``
optimizer ends the steps (parameters updated by hand): the first run records its 3 steps as one part.

Its part's first step pairs with the other run's step 0 and the rest of it with nothing, the other
run's steps 1 and 2 with nothing either: a learning rate changed in the first run (its step 0 the
same, the later ones not) once gave "the runs agree" (exit 0).  Now that is "the runs do not align"
(exit 1) naming the run that records several steps as one; a wrong kernel, which runs in the first
step too, is still named."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from compare_helpers import planted
from dispatchprobe import DispatchProbe
from dispatchprobe.cli import main
from dispatchprobe.offline.compare import compare
from dispatchprobe.offline.compare.verdict import RunsDoNotAlign

STEPS = 3


def _record(path, *, steps_called: bool, lr: float = 0.05):
    """``STEPS`` steps of a silu MLP, its parameters updated by hand (no optimizer the probe follows);
    ``steps_called``: the loop calls ``probe.step()`` after each."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.SiLU(), nn.Linear(32, 4))
    probe = DispatchProbe(task="statistics", dump_path=str(path))
    for step in range(STEPS):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
        with probe:
            model(x).pow(2).mean().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
                p.grad = None
        if steps_called:
            probe.step()
    probe.close()
    return path


def _wrong_silu(x):
    return x * torch.sigmoid(x) * 1.01


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("steps_in_one_part")
    out = {"stepped": _record(root / "stepped", steps_called=True),
           "one_part_lr": _record(root / "one_part_lr", steps_called=False, lr=0.055)}
    with planted({"silu": _wrong_silu}):
        out["one_part_silu"] = _record(root / "one_part_silu", steps_called=False)
    return out


@pytest.mark.parametrize("a, b", [("stepped", "one_part_lr"), ("one_part_lr", "stepped")])
def test_steps_recorded_as_one_part_are_not_said_to_agree(runs, a, b):
    assert sorted(p.name for p in runs["one_part_lr"].glob("step*")) == ["step0"]
    with pytest.raises(RunsDoNotAlign, match="runs backward 3 times") as got:
        compare(runs[a], runs[b])
    assert "one_part_lr's step 0 rank 0" in str(got.value) and "steps 1, 2 are not in" in str(got.value)
    res = CliRunner().invoke(main, ["compare", str(runs[a]), str(runs[b])])
    assert res.exit_code == 1 and "the runs agree" not in res.output, res.output


@pytest.mark.parametrize("a, b", [("stepped", "one_part_silu"), ("one_part_silu", "stepped")])
def test_a_wrong_kernel_is_still_named(runs, a, b):
    res = CliRunner().invoke(main, ["compare", str(runs[a]), str(runs[b])])
    assert res.exit_code == 2, res.output
    assert "first forward divergence: aten.silu.default" in res.output, res.output
    assert "records several training steps as one" in res.output, res.output
