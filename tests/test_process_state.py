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
