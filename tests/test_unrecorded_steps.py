"""A step whose compiled-graph kernels were left unrecorded (MindSpore's dump could not be matched to
the graph's kernels: a file given to the wrong kernel must not be its record) is named by the run's
manifest, and `show` and compare say which steps and why rather than leaving them silently out."""

import json

import torch

from dispatchprobe import DispatchProbe, compare, load
from dispatchprobe.offline.summary import summarize
from dispatchprobe.records.format import UNRECORDED_GRAPH_STEPS

WHY = "MindSpore's dump could not be matched to the graph's kernels (6 of 79 kernels' files disagree)"


def _two_steps(path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    probe = DispatchProbe(task="statistics", dump_path=str(path))
    for step in range(2):
        with probe:
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).square().mean().backward()
        probe.step()
    probe.close()
    return path


def test_a_step_left_unrecorded_is_said_by_show_and_compare(tmp_path):
    a, b = _two_steps(tmp_path / "a"), _two_steps(tmp_path / "b")
    manifest = json.loads((a / "manifest.json").read_text())
    (a / "manifest.json").write_text(json.dumps({**manifest, UNRECORDED_GRAPH_STEPS: {"1": WHY}}))
    for part in (a / "step1").iterdir():           # what such a step leaves: its folder, closed, no records
        (part / "ops.jsonl").unlink()
    said = f"the graph kernels of step 1 were not recorded: {WHY}"
    assert said in summarize(load(str(a)))
    _, verdict = compare(str(a), str(b))
    assert f"run A: {said}" in verdict.problems, verdict.problems
    _, verdict = compare(str(b), str(a))
    assert f"run B: {said}" in verdict.problems, verdict.problems
