"""Running a repro script as a user would: in a fresh interpreter that cannot import dispatchprobe
(tests/test_repro.py, tests/test_repro_mindspore.py)."""

from __future__ import annotations

import os
import subprocess
import sys

# runs a script as __main__ in a process where importing dispatchprobe fails
NO_DISPATCHPROBE = '''
import importlib.abc, runpy, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("dispatchprobe", "dispatchprobe_ms"):
            raise ImportError(f"{name} may not be imported by a repro")
sys.meta_path.insert(0, Refuse())
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    assert not [m for m in sys.modules if m.startswith("dispatchprobe")]
'''


def fresh(script, *args, cwd=None):
    """``python script args`` in a fresh interpreter that refuses to import dispatchprobe."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", NO_DISPATCHPROBE, str(script), *args], capture_output=True,
                          text=True, timeout=300, env=env, cwd=cwd)
