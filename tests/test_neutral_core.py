"""the neutral packages (records, standards, core with its task logic, online run-ut's wire,
offline) import and work with no framework importable."""

from __future__ import annotations

import subprocess
import sys
import textwrap

NEUTRAL = ("records", "standards", "core", "offline", "online")


def run_without_frameworks(code: str) -> subprocess.CompletedProcess:
    prelude = "import sys\nfor name in ('torch', 'mindspore', 'torch_npu'):\n    sys.modules[name] = None\n"
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True)


def test_every_neutral_module_imports_without_torch():
    out = run_without_frameworks(f"""
        import importlib, pkgutil
        import dispatchprobe
        names = []
        for pkg in {NEUTRAL!r}:
            mod = importlib.import_module("dispatchprobe." + pkg)
            for info in pkgutil.walk_packages(mod.__path__, mod.__name__ + "."):
                importlib.import_module(info.name)
                names.append(info.name)
        import dispatchprobe.cli
        print(len(names), sorted(names))
    """)
    assert out.returncode == 0, out.stderr
    count = int(out.stdout.split()[0])
    assert count >= 20, out.stdout
    for module in ("dispatchprobe.core.overflow", "dispatchprobe.core.free_benchmark", "dispatchprobe.core.session",
                   "dispatchprobe.offline.run_ut", "dispatchprobe.offline.compare", "dispatchprobe.standards.metrics"):
        assert module in out.stdout


def test_config_and_task_registries_work_without_torch(tmp_path):
    out = run_without_frameworks(f"""
        from dispatchprobe import Config
        from dispatchprobe.core.session import ProbeSession
        cfg = Config.load(task="overflow_check", dump_path={str(tmp_path)!r})
        print(cfg.task, ProbeSession.backend)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["overflow", "None"]
