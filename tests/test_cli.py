"""The ``dispatchprobe`` command line: show, demo, one-line errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from dispatchprobe.cli import main


def test_show_summary(tiny_run):
    result = CliRunner().invoke(main, ["show", str(tiny_run)])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "steps      0-1" in out and "ranks 0" in out
    assert "forward" in out and "backward" in out
    assert "aten.addmm.default" in out
    assert "nan/inf" in out


def test_show_op_lists_matching_records(tiny_run):
    result = CliRunner().invoke(main, ["show", str(tiny_run), "--op", "gelu", "--stage", "backward"])
    assert result.exit_code == 0, result.output
    lines = [l for l in result.output.splitlines() if "gelu" in l]
    assert lines and all("gelu_backward" in l for l in lines)
    assert "TinyTransformer.layers.0.mlp" in result.output


def test_errors_are_one_line(tmp_path, tiny_run):
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(main, ["show", str(tmp_path / "empty")])
    assert result.exit_code == 1
    assert result.output.strip().count("\n") == 0 and result.output.startswith("error: ")
    assert "Traceback" not in result.output
    (tiny_run / "manifest.json").write_text("{broken")
    result = CliRunner().invoke(main, ["show", str(tiny_run)])
    assert result.exit_code == 1 and "corrupt manifest" in result.output
    result = CliRunner().invoke(main, ["--debug", "show", str(tiny_run)])
    assert result.exit_code == 1 and result.exception is not None   # --debug lets it propagate


def test_demo_end_to_end(tmp_path):
    out = subprocess.run([sys.executable, "-m", "dispatchprobe.cli", "demo", "-o", str(tmp_path / "demo"),
                          "--steps", "1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "records written to" in out.stdout and "aten.mm.default" in out.stdout
    assert (tmp_path / "demo" / "step0" / "rank0" / "ops.jsonl").exists()


@pytest.mark.parametrize("task,expect", [("overflow", "1 flagged"), ("free_benchmark", "native_layer_norm_backward")])
def test_demo_inline_checks(tmp_path, task, expect):
    """Inline checks write records only for what they flag: the demo reports its counts and
    never ends in "no op records found" (it did when the model was clean).  The free-benchmark
    demo trains in bf16, where improve_precision finds the bf16 CPU layer-norm backward."""
    result = CliRunner().invoke(main, ["demo", "--task", task, "-o", str(tmp_path / task), "--steps", "1"])
    assert result.exit_code == 0, result.output
    assert "op calls checked" in result.output and expect in result.output
