"""The torch each path needs: the eager probe from torch 2.5, ``probe_backend`` from 2.13 (the
inductor internals it plugs into), refused at the call in one line naming both versions, never an
ImportError or a failed compile deep inside; importing dispatchprobe needs neither."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

import dispatchprobe
from dispatchprobe import DispatchProbe
from dispatchprobe.records.reader import load
from dispatchprobe.torch.compile import requires


def test_probe_backend_on_an_older_torch_names_both_versions(monkeypatch, tmp_path):
    monkeypatch.setattr(requires, "installed_torch", lambda: "2.5.1+cu124")
    with pytest.raises(RuntimeError) as caught:
        dispatchprobe.probe_backend(task="statistics", dump_path=str(tmp_path / "compiled"))
    msg = str(caught.value)
    assert "probe_backend needs torch >= 2.13" in msg and "this is torch 2.5.1+cu124" in msg and "\n" not in msg
    assert not (tmp_path / "compiled").exists()
    probe = DispatchProbe(task="statistics", dump_path=str(tmp_path / "eager"))   # the eager path needs no gate
    with probe:
        torch.randn(4, 4).exp().sum()
    probe.close()
    assert {"aten.exp.default", "aten.sum.default"} <= set(load(str(tmp_path / "eager")).ops["op"])


@pytest.mark.parametrize("version,ok", [("2.13.0", True), ("2.13.0a0+git1234abc", True), ("2.14.1+cu130", True),
                                        ("2.12.0", False), ("2.6.0", False), ("2.5.1", False), ("1.13.1", False)])
def test_release_of_a_version(monkeypatch, version, ok):
    """A development build of a release is that release; 2.14 is newer than 2.13, 2.6 older."""
    monkeypatch.setattr(requires, "installed_torch", lambda: version)
    if ok:
        requires.require_torch()
    else:
        with pytest.raises(RuntimeError, match=f"this is torch {version}"):
            requires.require_torch()


def test_probe_backend_on_the_installed_torch(tmp_path):
    """Built where the torch is new enough, refused in one line where it is not (the torch 2.5 leg)."""
    have = requires.installed_torch()
    if requires.release(have) >= requires.MIN_TORCH:
        backend = dispatchprobe.probe_backend(task="statistics", dump_path=str(tmp_path / "c"))
        assert callable(backend)
        backend.close()
    else:
        with pytest.raises(RuntimeError, match=f"needs torch >= 2.13 .*; this is torch {re.escape(have)}"):
            dispatchprobe.probe_backend(task="statistics", dump_path=str(tmp_path / "c"))


def test_importing_the_compile_package_imports_no_inductor_module():
    """What needs torch >= 2.13 is imported on first use only: ``import dispatchprobe`` and
    ``from dispatchprobe.torch.compile import probe_backend`` work on torch 2.5."""
    code = ("import sys, dispatchprobe\n"
            "from dispatchprobe.torch.compile import probe_backend\n"
            "assert callable(dispatchprobe.probe_backend)\n"
            "late = [m for m in sys.modules if m.startswith(('dispatchprobe.torch.compile.', 'torch._inductor.custom'))]\n"
            "assert late == ['dispatchprobe.torch.compile.requires'], late\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
