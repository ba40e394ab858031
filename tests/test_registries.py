"""Extension in one place (docs/architecture.md): a task and a perturbation each added by one
registration, seen by the config and the session; the torch backend fulfils the core's contract."""

from __future__ import annotations

import csv

import pytest
import torch

from dispatchprobe import Config, ConfigError, DispatchProbe
from dispatchprobe.core.tensor_backend import TensorBackend, missing_members
from dispatchprobe.core.events import Handler
from dispatchprobe.core.perturbations import PERTURBATIONS, register_perturbation
from dispatchprobe.core.tasks import TASKS, register_task


def _step(model, x):
    model(x).square().mean().backward()


@pytest.fixture
def registered():
    """Remove whatever a test registered, so the registries stay as shipped."""
    before_tasks, before_perts = dict(TASKS), dict(PERTURBATIONS)
    yield
    TASKS.clear(), TASKS.update(before_tasks)
    PERTURBATIONS.clear(), PERTURBATIONS.update(before_perts)


def test_a_task_is_one_registration(tmp_path, registered):
    class CountOps(Handler):
        def __init__(self, session, recorder):
            self.ops = []

        def on_op(self, event):
            self.ops.append((event.op, event.stage))

    @register_task("count_ops", checks_ops=True)
    def count_ops(session, recorder):
        return [CountOps(session, recorder)]

    with pytest.raises(ConfigError, match="level must be 'op' or 'mix'"):
        Config.load(task="count_ops", level="module")
    probe = DispatchProbe(task="count_ops", dump_path=str(tmp_path))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with probe:
        _step(model, torch.randn(2, 4))
    probe.close()
    seen = probe.handlers[0].ops
    assert ("aten.addmm.default", "forward") in seen and ("aten.mm.default", "backward") in seen
    assert (tmp_path / "manifest.json").exists()


def test_a_perturbation_is_one_registration(tmp_path, registered):
    @register_perturbation("double_inputs")
    def double_inputs(check, event, inputs):
        return (*check.backend.map_floats(lambda t: t * 2, event.args, event.kwargs), None)

    assert "double_inputs" in Config.load(task="free_benchmark", pert_mode="double_inputs").free_benchmark.pert_mode
    with pytest.raises(ConfigError, match="handler_type='fix' needs pert_mode"):
        Config.load(task="free_benchmark", pert_mode="double_inputs", handler_type="fix")
    probe = DispatchProbe(task="free_benchmark", pert_mode="double_inputs", dump_path=str(tmp_path))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with probe:
        model(torch.randn(2, 4))
    probe.close()
    rows = list(csv.DictReader(open(tmp_path / "step0" / "rank0" / "free_benchmark.csv")))
    linear = [r for r in rows if r["op"] == "aten.addmm.default"]
    assert linear and linear[0]["pert_mode"] == "double_inputs"
    assert float(linear[0]["max_rel"]) >= 1.0      # (2x)(2W) + 2b: the output moved by 100 % or more


def test_torch_backend_fulfils_the_contract():
    from dispatchprobe.torch import tensor_backend as backend
    assert missing_members(backend) == []
    assert isinstance(backend, TensorBackend)


def test_registries_refuse_a_second_entry_of_a_name():
    """As torch's flop_counter refuses a second formula: a name means one thing."""
    from dispatchprobe.standards.metrics import register_metric
    with pytest.raises(ValueError, match="already registered"):
        register_task("statistics")
    with pytest.raises(ValueError, match="already registered"):
        register_perturbation("improve_precision")
    with pytest.raises(ValueError, match="already registered"):
        register_metric("cosine")
