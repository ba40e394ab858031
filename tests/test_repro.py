"""``dispatchprobe repro``: one recorded op call as a folder a bug report can carry, whose script
re-runs it with only PyTorch -- in a fresh process that cannot import dispatchprobe -- and shows the
error run-ut found (docs/run-ut.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys

import pandas as pd
import pytest
import torch
from click.testing import CliRunner

import dispatchprobe
from dispatchprobe import DispatchProbe
from dispatchprobe.cli import main
from tests.repro_helpers import fresh as _fresh

# a custom kernel that is wrong below float64 (the float64 benchmark runs the same op)
KERNELS = '''"""A planted kernel: scale by 2, but by 2.5 in any dtype narrower than float64."""
import torch
lib = torch.library.Library("repro_planted", "DEF")
lib.define("scale(Tensor x) -> Tensor")
lib.impl("scale", lambda x: x * 2 if x.dtype == torch.float64 else x * 2.5, "CPU")
'''

@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A tensor run of the planted kernel and of gelu (a clean op), and run-ut's results on it."""
    tmp = tmp_path_factory.mktemp("repro")
    kernels = tmp / "planted_kernels.py"
    kernels.write_text(KERNELS)
    spec = importlib.util.spec_from_file_location("planted_kernels", kernels)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["planted_kernels"] = module      # run-ut --import planted_kernels: already imported
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    with DispatchProbe(task="tensor", dump_path=str(tmp / "run")) as probe:
        torch.ops.repro_planted.scale(x)
        torch.nn.functional.gelu(x)
        torch.mm(x.half(), x.t().half())          # judged by run-ut's ULP rule
    probe.close()
    res = dispatchprobe.run_ut(str(tmp / "run"), str(tmp / "ut"))
    return tmp, kernels, res


def _verdict(res, name):
    return res.results.set_index("API Name").loc[name, "Forward Test Success"]


def _number(text, label):
    return float(re.search(rf"{label} ([-+0-9.e]+|inf|nan)", text).group(1))


def test_repro_of_a_planted_kernel_shows_run_uts_error_without_dispatchprobe(planted):
    tmp, kernels, res = planted
    name = "repro_planted.scale.default.0.forward"
    assert _verdict(res, name) == "error"
    made = CliRunner().invoke(main, ["repro", str(tmp / "run"), name, "-o", str(tmp / "r_scale"),
                                     "--prelude", str(kernels)])
    assert made.exit_code == 0, made.output
    assert "note:" not in made.output      # the prelude defines the custom op
    assert sorted(os.listdir(tmp / "r_scale")) == ["inputs.safetensors", "outputs.safetensors", "planted_kernels.py",
                                                   "record.json", "repro.py"]
    out = _fresh(tmp / "r_scale" / "repro.py", cwd=tmp.parent)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "output.0 float32 [16, 8]: error:" in out.stdout and "differs from float64: error" in out.stdout
    assert "recorded output.0 float32 [16, 8]: error:" in out.stdout     # the training process ran it too
    detail = pd.read_csv(res.details_csv)
    row = detail[(detail["API Name"] == name) & (detail["Judged"] == "replay")].iloc[0]
    assert _number(out.stdout, "max abs error") == pytest.approx(row["Max Abs Err"], rel=1e-5)
    assert _number(out.stdout, "cosine") == pytest.approx(row["Cosine"], abs=1e-6)
    # the folder travels: copied elsewhere, it runs the same
    moved = tmp / "elsewhere"
    moved.mkdir()
    for f in os.listdir(tmp / "r_scale"):
        (moved / f).write_bytes((tmp / "r_scale" / f).read_bytes())
    again = _fresh(moved / "repro.py", cwd=moved)
    assert again.returncode == 2 and again.stdout == out.stdout, again.stdout + again.stderr


def test_repro_of_a_clean_op_reports_agreement(planted):
    tmp, _, res = planted
    name = "aten.gelu.default.0.forward"
    assert _verdict(res, name) == "pass"
    made = CliRunner().invoke(main, ["repro", str(tmp / "run"), name, "-o", str(tmp / "r_gelu")])
    assert made.exit_code == 0 and "note:" not in made.output, made.output
    out = _fresh(tmp / "r_gelu" / "repro.py")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("aten.gelu.default on cpu (float32) against float64 on the CPU")
    assert "output.0 float32 [16, 8]: pass:" in out.stdout and "agrees with float64" in out.stdout
    # the saved inputs are the recorded ones, byte for byte
    record = json.loads((tmp / "r_gelu" / "record.json").read_text())
    saved = dispatchprobe.load(tmp / "run").part(step=0, rank=0).tensor(record["inputs"][0]["data"])
    from dispatchprobe.records.reader import read_safetensors
    assert (read_safetensors(str(tmp / "r_gelu" / "inputs.safetensors"))["input.0"] == saved).all()


def test_the_script_judges_by_the_rule_run_ut_uses_for_the_op(planted):
    tmp, _, res = planted
    name = "aten.mm.default.0.forward"
    made = CliRunner().invoke(main, ["repro", str(tmp / "run"), name, "-o", str(tmp / "r_mm")])
    assert made.exit_code == 0, made.output
    out = _fresh(tmp / "r_mm" / "repro.py")
    verdict = _verdict(res, name)
    assert out.returncode == {"pass": 0, "warning": 0, "error": 2}[verdict], out.stdout + out.stderr
    assert f"output.0 float16 [16, 16]: {verdict}:" in out.stdout and "(run-ut's ulp rule for float16:" in out.stdout


def test_a_custom_op_without_its_prelude_is_said_not_misjudged(planted):
    tmp, _, _ = planted
    name = "repro_planted.scale.default.0.forward"
    made = CliRunner().invoke(main, ["repro", str(tmp / "run"), name, "-o", str(tmp / "r_bare")])
    assert made.exit_code == 0 and "--prelude FILE" in made.output, made.output
    out = _fresh(tmp / "r_bare" / "repro.py")
    assert out.returncode == 1 and "does not exist in this torch" in out.stdout, out.stdout + out.stderr
    assert "error" not in out.stdout.replace("does not exist", "")


def test_repro_of_a_real_cpu_kernel_error(tmp_path):
    """The OpInfo sweep's genuine finding (benchmarks/opinfo_sweep.py GENUINE): CPU bfloat16
    linalg_matrix_exp gives inf/nan where float64 is finite."""
    m = (torch.randn(8, 8, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    with DispatchProbe(task="tensor", dump_path=str(tmp_path / "run")) as probe:
        torch.linalg.matrix_exp(m)
    probe.close()
    name = "aten.linalg_matrix_exp.default.0.forward"
    res = dispatchprobe.run_ut(str(tmp_path / "run"), str(tmp_path / "ut"), api="matrix_exp")
    assert _verdict(res, name) == "error"
    mismatches = int(re.search(r"(\d+) inf/nan mismatches", res.results.iloc[0]["Message"]).group(1))
    made = CliRunner().invoke(main, ["repro", str(tmp_path / "run"), name, "-o", str(tmp_path / "r")])
    assert made.exit_code == 0, made.output
    out = _fresh(tmp_path / "r" / "repro.py")
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"output.0 bfloat16 [8, 8]: error:" in out.stdout and f"inf/nan mismatches {mismatches}," in out.stdout


def test_records_that_cannot_make_a_repro_say_why_in_one_line(tmp_path):
    with DispatchProbe(task="statistics", dump_path=str(tmp_path / "stats")) as probe:
        torch.ones(3) * 2
        torch.rand(3)
    probe.close()
    cases = [("aten.mul.Tensor.0.forward", "holds statistics only): record the run with task='tensor'"),
             ("aten.rand.default.0.forward", "is a random op (rand)"),
             ("aten.mul.Tensr.0.forward", "did you mean aten.mul.Tensor.0.forward")]
    for name, says in cases:
        res = CliRunner().invoke(main, ["repro", str(tmp_path / "stats"), name, "-o", str(tmp_path / "r")])
        assert res.exit_code == 1 and says in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert not (tmp_path / "r").exists()         # nothing written for a refused record


def test_run_ut_and_compare_print_the_repro_command_of_the_op_they_name(planted, tmp_path, monkeypatch):
    tmp, _, _ = planted
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["run-ut", str(tmp / "run"), "-o", "ut", "--import", "planted_kernels"])
    assert res.exit_code == 2, res.output
    name = "repro_planted.scale.default.0.forward"
    assert f"{name}: a standalone repro: dispatchprobe repro {tmp / 'run'} {name} -o repro/{name}\n" in res.output

    from tests.compare_helpers import record
    record(tmp_path / "a", plant=True)
    record(tmp_path / "b")
    res = CliRunner().invoke(main, ["compare", str(tmp_path / "a"), str(tmp_path / "b")])
    assert res.exit_code == 2, res.output
    named = re.search(r"^first forward divergence: (\S+) ", res.output, re.M).group(1)
    line = re.search(r"^(\S+): a standalone repro: (dispatchprobe repro .*)$", res.output, re.M)
    assert line and line.group(1).startswith(named), res.output
    made = CliRunner().invoke(main, line.group(2).split()[1:])
    assert made.exit_code == 0, made.output
    assert (tmp_path / "repro" / line.group(1) / "repro.py").is_file()
