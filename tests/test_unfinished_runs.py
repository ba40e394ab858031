"""A run whose program ended inside a step (crashed, killed): its probe never closed that step, so
what would have followed was never recorded.  compare says so and does not call the runs agreeing
outright (exit code 1, a warning naming the run, steps and ranks), in both orders; a difference
in what was recorded is still an error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from dispatchprobe.cli import main

SCRIPT = """
import os, sys, torch
sys.path.insert(0, {tests!r})
from compare_helpers import TinyTransformer, lm_batch, lm_loss, planted_softmax
from dispatchprobe import DispatchProbe
import contextlib
out, crash, plant = sys.argv[1], sys.argv[2] == "crash", sys.argv[3] == "plant"
torch.manual_seed(0)
model = TinyTransformer(dropout=0.0)
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
probe = DispatchProbe(task="statistics", dump_path=out)
with planted_softmax(model) if plant else contextlib.nullcontext():
    for step in range(2):
        tokens, targets = lm_batch(batch=4, seq=32, vocab=128, seed=step)
        with probe:
            loss = lm_loss(model, tokens, targets)
            if crash and step == 1:
                os._exit(3)          # the process dies inside step 1, as a crash or a kill leaves it
            loss.backward()
        opt.step()
        opt.zero_grad()
        probe.step()
probe.close()
"""


def _record(out: Path, crash: bool, plant: bool = False) -> Path:
    script = SCRIPT.format(tests=str(Path(__file__).parent))
    proc = subprocess.run([sys.executable, "-c", script, str(out), "crash" if crash else "-", "plant" if plant else "-"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == (3 if crash else 0), proc.stderr[-3000:]
    return out


def test_a_run_that_ended_inside_a_step_agrees_only_on_what_was_recorded(tmp_path):
    whole, crashed = _record(tmp_path / "whole", False), _record(tmp_path / "crashed", True)
    assert not (crashed / "step1" / "rank0" / "closed").exists() and (crashed / "step0" / "rank0" / "closed").exists()
    for a, b, side in ((whole, crashed, "B"), (crashed, whole, "A")):
        res = CliRunner().invoke(main, ["compare", str(a), str(b)])
        assert res.exit_code == 1, res.output
        lines = res.output.splitlines()
        assert "the runs agree on what was recorded (a run holds steps it never closed" in res.output, res.output
        assert "the runs agree\n" not in res.output + "\n" and not any(x == "the runs agree" for x in lines), lines
        assert any(x.startswith(f"warning: unfinished: run {side}: step 1 x rank 0: 1 step/rank part(s) never closed")
                   for x in lines), lines
    planted = _record(tmp_path / "planted", True, plant=True)
    res = CliRunner().invoke(main, ["compare", str(whole), str(planted)])
    assert res.exit_code == 2 and "unfinished: run B: step 1 x rank 0" in res.output, res.output
