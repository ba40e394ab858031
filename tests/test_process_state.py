"""The torch adapter's process state lives in one object: probes fill it while they record,
leave nothing held once closed or collected (torch's global optimizer step hooks included), and
``reset`` empties it (refusing while a probe records)."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from dispatchprobe import DispatchProbe
from dispatchprobe.torch.process_state import STATE


@pytest.fixture(autouse=True)
def earlier_probes_closed():
    """These tests read process-wide state: probes that earlier tests in the process left open
    are closed first (a probe backend stays until exit, whose ``atexit`` closes it; a probe in a
    reference cycle until a collection), so that what is held is what these tests' probes hold."""
    from dispatchprobe.torch import hooks
    from dispatchprobe.torch.session import TorchSession
    gc.collect()
    # type(), not isinstance(): the heap holds weak proxies, and isinstance on a dead one raises
    for session in [o for o in gc.get_objects() if issubclass(type(o), TorchSession)]:
        try:
            session.close()
        except Exception:       # noqa: BLE001 - what it raises belongs to the test that left it open
            pass
    hooks.remove_collected()
    assert STATE.held() == {}


def _step(model, opt):
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_a_closed_probe_leaves_nothing_held(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = DispatchProbe(task="statistics", dump_path=str(tmp_path), model=model)
    with probe:
        _step(model, opt)
        held = STATE.held()
        assert held.get("active_probes") == 1 and held.get("module_scopes") == 1, held
        assert held.get("module_hook_users") == 1, held
        assert held.get("optimizer_hooks") == 3, held       # parameter records (2), steps followed
        with pytest.raises(RuntimeError, match="while a probe records"):
            STATE.reset()
    assert STATE.held().get("module_hook_users") == 1      # between entries the probe keeps its hooks
    probe.close()
    assert STATE.held() == {}


def test_an_unclosed_probe_collected_leaves_nothing_held(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = DispatchProbe(task="statistics", dump_path=str(tmp_path), model=model)
    with probe:
        _step(model, opt)
    del probe
    gc.collect()
    _step(model, opt)       # queued hook removals run where torch loops over no hook dictionary
    assert STATE.held() == {}


def test_reset_empties_every_container(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with DispatchProbe(task="statistics", dump_path=str(tmp_path), model=model) as probe:
        _step(model, opt)
    probe.close()
    STATE.unseen_writes[0] = 1           # a write counted, as a collective's would be
    STATE.reset()
    assert all(not len(v) for v in vars(STATE).values())


def _ops(folder) -> list[str]:
    import glob
    import json
    import os
    return [json.loads(line)["name"] for f in sorted(glob.glob(os.path.join(folder, "step*", "rank*", "ops.jsonl")))
            for line in open(f)]


def test_a_probes_own_work_is_not_recorded_by_another(tmp_path, monkeypatch):
    """Probes left open beside a recording one (one that never saw a model reads every optimizer's
    parameters, a grad probe reads its model's gradients) do their own work with torch's operations
    (the Python statistics path here): the recording probe's mode passes that work through, so it
    records the same ops as when it records alone."""
    from dispatchprobe.torch import fused_stats
    monkeypatch.setattr(fused_stats, "tree_rows", None)

    def train(folder, model):
        torch.manual_seed(0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        probe = DispatchProbe(task="statistics", dump_path=str(folder))
        with probe:
            _step(model, opt)
        probe.close()
        return _ops(folder)

    torch.manual_seed(0)
    alone = train(tmp_path / "alone", torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)))
    left_open = DispatchProbe(task="statistics", dump_path=str(tmp_path / "left_open"))
    with left_open:                      # entered once, never saw a model: it reads any optimizer's parameters
        torch.ones(2).add(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    grads = DispatchProbe(task="grad_probe", dump_path=str(tmp_path / "grads"), model=model)
    beside = train(tmp_path / "beside", model)
    assert any(name.startswith("aten.") for name in alone)
    assert beside == alone
    left_open.close()
    grads.close()
    assert _ops(tmp_path / "left_open") and (tmp_path / "grads").exists()


def _optimizer_hooks() -> tuple[int, int]:
    """How many global optimizer step hooks torch holds (pre, post)."""
    from torch.optim import optimizer
    return len(optimizer._global_optimizer_pre_hooks), len(optimizer._global_optimizer_post_hooks)


def _probe(kind: str, folder, model):
    """A probe of ``kind`` on ``model``, its session made, and what enters it around a step."""
    if kind == "probe_backend":
        from dispatchprobe.torch.compile import probe_backend
        backend = probe_backend(task="statistics", dump_path=str(folder), model=model)
        backend.session       # made by the first graph call: its hooks are registered then
        return backend, contextlib.nullcontext()
    if kind == "grad_probe":
        probe = DispatchProbe(task="grad_probe", dump_path=str(folder), model=model)
        return probe, contextlib.nullcontext()
    probe = DispatchProbe(task="statistics", dump_path=str(folder), model=model)
    return probe, probe


@pytest.mark.parametrize("kind, ending", [("statistics", "closed"), ("statistics", "collected"),
                                          ("grad_probe", "closed"), ("grad_probe", "collected"),
                                          ("probe_backend", "closed")])
def test_every_probe_kind_leaves_no_optimizer_hook(tmp_path, kind, ending):
    """torch's global optimizer step hooks, which every probe kind registers, are all removed when
    the probe is closed, or collected unclosed, and counted in ``STATE.held()`` until then (a
    probe backend is closed at exit, which keeps it until then)."""
    from dispatchprobe.torch.compile import requires
    before = _optimizer_hooks()
    model = torch.nn.Sequential(torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if kind == "probe_backend" and requires.release(requires.installed_torch()) < requires.MIN_TORCH:
        # refused in one line below the torch it needs: and it leaves no hook behind
        with pytest.raises(RuntimeError, match="probe_backend needs torch"):
            _probe(kind, tmp_path, model)
        assert "optimizer_hooks" not in STATE.held() and _optimizer_hooks() == before
        return
    probe, around = _probe(kind, tmp_path, model)
    registered = STATE.held()["optimizer_hooks"]
    assert sum(_optimizer_hooks()) - sum(before) == registered >= 2
    with around:
        _step(model, opt)
    if ending == "closed":
        probe.close()
    else:
        del probe, around
        gc.collect()
        _step(model, opt)       # queued removals run where torch loops over no hook dictionary
    assert "optimizer_hooks" not in STATE.held() and _optimizer_hooks() == before


def _params(folder) -> set[str]:
    import glob
    import json
    import os
    return {json.loads(line)["name"] for f in glob.glob(os.path.join(folder, "step*", "rank*", "params.jsonl"))
            for line in open(f)}


def test_a_probe_left_open_records_nothing_of_a_later_training(tmp_path, monkeypatch):
    """A probe left open (never stepped nor closed, not collected yet) after its model is gone, as
    a test or a notebook cell leaves one: a later probe's training is recorded by that probe as when
    it records alone (the Python statistics path: measuring runs torch's operations, which the
    later probe's mode would record as the user's), and the probe left open writes nothing of it
    (its model's parameters once gone, a later model's may have their addresses)."""
    from dispatchprobe.torch import fused_stats
    monkeypatch.setattr(fused_stats, "tree_rows", None)

    def train(folder):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        probe = DispatchProbe(task="statistics", dump_path=str(folder))
        for _ in range(2):
            with probe:
                _step(model, opt)
            probe.step()
        probe.close()
        return _ops(folder), _params(folder)

    alone = train(tmp_path / "alone")
    left_open = DispatchProbe(task="statistics", dump_path=str(tmp_path / "left_open"))
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with left_open:
        _step(model, opt)
    own = {f"{name}.{what}.0" for name in ("weight", "bias") for what in ("grad", "value")}
    del model, opt
    later = train(tmp_path / "later")
    assert any(name.startswith("aten.") for name in alone[0]) and alone[1]
    assert later == alone
    left_open.close()
    assert _params(tmp_path / "left_open") == own
