"""The torch adapter's process state lives in one object: probes fill it while they record,
leave nothing held once closed, and ``reset`` empties it (refusing while a probe records)."""

from __future__ import annotations

import gc

import pytest
import torch

from dispatchprobe import DispatchProbe
from dispatchprobe.torch.process_state import STATE


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
