"""ci/matrix.py's pip step: a failed install is tried again, and the table says pip's own error."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _matrix():
    spec = importlib.util.spec_from_file_location("ci_matrix", ROOT / "ci" / "matrix.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["ci_matrix"] = module
    spec.loader.exec_module(module)
    return module


def _flaky_pip(tmp_path: Path, fails: int) -> list[str]:
    """A stand-in for ``pip install`` that fails its first ``fails`` calls with pip's kind of error."""
    counter = tmp_path / "calls"
    script = (f"import pathlib, sys; p = pathlib.Path({str(counter)!r}); n = int(p.read_text()) if p.exists() else 0; "
              f"p.write_text(str(n + 1)); print('ERROR: Could not install packages due to an OSError: [Errno 28] "
              f"No space left on device') if n < {fails} else None; sys.exit(1 if n < {fails} else 0)")
    return [sys.executable, "-c", script]


def test_a_failed_install_is_tried_again(tmp_path, monkeypatch):
    matrix = _matrix()
    monkeypatch.setattr(matrix, "PIP_WAIT_S", 0)
    log_path = tmp_path / "newest-prepare.log"
    with open(log_path, "w") as log:
        assert matrix.install(_flaky_pip(tmp_path, fails=2), matrix.LEGS[0], log) == 0
    assert (tmp_path / "calls").read_text() == "3"
    assert log_path.read_text().count("# pip exited 1; try") == 2


def test_an_install_failing_every_try_says_pips_error(tmp_path, monkeypatch):
    matrix = _matrix()
    monkeypatch.setattr(matrix, "PIP_WAIT_S", 0)
    log_path = tmp_path / "minimum-prepare.log"
    with open(log_path, "w") as log:
        assert matrix.install(_flaky_pip(tmp_path, fails=5), matrix.LEGS[0], log) == 1
    assert (tmp_path / "calls").read_text() == str(matrix.PIP_TRIES)
    assert matrix.pip_error(log_path) == ("ERROR: Could not install packages due to an OSError: [Errno 28] "
                                          "No space left on device")
    log_path.write_text("no error line here\n")
    assert matrix.pip_error(log_path) == f"see {log_path}"
