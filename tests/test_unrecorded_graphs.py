"""A model compiled with ``torch.compile`` but not with ``probe_backend`` runs its graphs past the
eager probe, which records only the code around them: the run says so (its manifest, ``show``),
and compare against an eager run names that instead of guessing at different models."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dispatchprobe import DispatchProbe, load, probe_backend
from dispatchprobe.offline.compare import RunsDoNotAlign, compare
from dispatchprobe.offline.summary import summarize
from dispatchprobe.records.format import UNRECORDED_GRAPHS

pytestmark = pytest.mark.skipif(not hasattr(TorchDispatchMode, "ignore_compile_internals"),
                                reason="before torch 2.9 a model compiled inside a dispatch mode runs eagerly "
                                       "(recorded whole): there is nothing unrecorded to say")


def _train(path, compile_with=None, loss_inside: bool = False, steps: int = 2):
    """Two steps of a small model, eager or compiled (``loss_inside``: the loss inside the graph too)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 2))

    def loss_of(x):
        return model(x).square().mean()
    if compile_with is None:
        step_fn = loss_of
    else:
        step_fn = torch.compile(loss_of if loss_inside else model, backend=compile_with)
    x = torch.randn(4, 8)
    probe = DispatchProbe(task="statistics", dump_path=str(path))
    for _ in range(steps):
        with probe:
            (step_fn(x) if loss_inside or compile_with is None else step_fn(x).square().mean()).backward()
        probe.step()
    probe.close()
    return load(path)


def test_graphs_compiled_without_probe_backend_are_said_by_the_manifest_show_and_compare(tmp_path):
    eager = _train(tmp_path / "eager")
    compiled = _train(tmp_path / "compiled", "aot_eager")
    assert compiled.manifest[UNRECORDED_GRAPHS] is True
    assert UNRECORDED_GRAPHS not in eager.manifest
    assert "compiled   torch.compile'd graphs ran without probe_backend" in summarize(compiled)
    assert "compiled " not in summarize(eager)
    for a, b, side in ((eager, compiled, "B"), (compiled, eager, "A")):
        # only the loss outside the graph pairs: most of the eager run's records have no counterpart, so
        # the runs do not align (measured against the run that recorded its work), never "agree"
        with pytest.raises(RunsDoNotAlign) as err:
            compare(str(a.path), str(b.path))
        other = "A" if side == "B" else "B"
        said = str(err.value)
        assert f"compute records could not be aligned (run {side}: torch.compile'd graphs ran without probe_backend" in said
        assert f"of run {other}'s" in said
        verdict = str(err.value.result.verdict)
        assert f"warning: run {side}: torch.compile'd graphs ran without probe_backend: their ops are not " \
               "recorded" in verdict
        assert f"(run {side}'s compiled graphs were not recorded)" in verdict
        assert "different models or options" not in said + verdict


def test_a_small_compiled_region_is_compared_around(tmp_path):
    """Where the compiled code is a small part of the step, what the eager probe recorded around it
    pairs, is judged and the verdict passes, saying what was not recorded."""
    def train(path, compiled: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[m for _ in range(6) for m in (torch.nn.Linear(16, 16), torch.nn.Tanh())])
        head = torch.nn.Linear(16, 2)
        tail = torch.compile(head, backend="aot_eager") if compiled else head
        probe = DispatchProbe(task="statistics", dump_path=str(path))
        x = torch.randn(4, 16)
        for _ in range(2):
            with probe:
                tail(model(x)).square().mean().backward()
            probe.step()
        probe.close()
        return load(path)
    eager, compiled = train(tmp_path / "eager", False), train(tmp_path / "compiled", True)
    for a, b, side in ((eager, compiled, "B"), (compiled, eager, "A")):
        verdict = compare(str(a.path), str(b.path)).verdict
        assert verdict.passed and verdict.aligned >= 0.5
        assert f"warning: run {side}: torch.compile'd graphs ran without probe_backend" in str(verdict)


def test_runs_that_do_not_align_for_unrecorded_graphs_say_so_in_the_error(tmp_path):
    eager = _train(tmp_path / "eager")
    compiled = _train(tmp_path / "compiled", "aot_eager", loss_inside=True)
    for a, b, side in ((eager, compiled, "B"), (compiled, eager, "A")):
        with pytest.raises(RunsDoNotAlign) as err:
            compare(str(a.path), str(b.path))
        said = str(err.value)
        assert f"(run {side}: torch.compile'd graphs ran without probe_backend" in said
        assert "different models or options" not in said


def test_graphs_recorded_by_probe_backend_leave_no_note(tmp_path):
    path = tmp_path / "compiled"
    backend = probe_backend(task="statistics", dump_path=str(path), inner="aot_eager")
    run = _train(path, backend)
    backend.close()
    assert UNRECORDED_GRAPHS not in run.manifest
    assert any(r.get("compiled") for r in run.part(0, 0).records)
    assert "compiled " not in summarize(run)
