"""``dispatchprobe repro`` of MindSpore records (PyNative and GRAPH_MODE): a folder whose script re-runs
the one primitive call with MindSpore alone -- in a fresh process that cannot import dispatchprobe --
and judges it as run-ut does (docs/run-ut.md); and the MindSpore overflow demo's real overflow."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

pytestmark = pytest.mark.mindspore      # run in MindSpore's own environment (ci/matrix.py)
os.environ.setdefault("MS_DEV_LAUNCH_BLOCKING", "1")
ms = pytest.importorskip("mindspore")

import dispatchprobe  # noqa: E402
from dispatchprobe.cli import main  # noqa: E402
from dispatchprobe.offline.repro import hint  # noqa: E402
from dispatchprobe_ms import DispatchProbe  # noqa: E402
from dispatchprobe_ms.demo import train  # noqa: E402
from tests.repro_helpers import fresh  # noqa: E402

# a GeLU kernel 1 % off in float32, right in float64 (the benchmark runs the same primitive): imported
# by the process that replays it and, as --prelude, by the repro's
PLANTED = '''"""A planted GeLU kernel: 1 % off in float32."""
import mindspore as ms
from mindspore import _c_expression
_right = _c_expression.pyboost_gelu
def _wrong(prim, args):
    out = _right(prim, args)
    return out * 1.01 if out.dtype == ms.float32 else out
_c_expression.pyboost_gelu = _wrong
'''
GELU = "GeLU.0.forward"


@pytest.fixture(scope="module")
def ms_run(tmp_path_factory):
    """A tensor run of one PyNative training step of the demo net (float32)."""
    tmp = tmp_path_factory.mktemp("ms_repro")
    train(DispatchProbe(task="tensor", dump_path=str(tmp / "run")), steps=1)
    return tmp


def _repro(run, name, out, *more):
    made = CliRunner().invoke(main, ["repro", str(run), name, "-o", str(out), *more])
    assert made.exit_code == 0 and "note:" not in made.output, made.output
    return out / "repro.py"


def _number(text, label):
    return float(re.search(rf"{label} ([-+0-9.e]+|inf|nan)", text).group(1))


def _replay_row(ut, name):
    detail = pd.read_csv(next(ut.glob("accuracy_checking_details_*.csv")))
    return detail[(detail["API Name"] == name) & (detail["Judged"] == "replay")].iloc[0]


def test_repro_of_a_clean_primitive_agrees_without_dispatchprobe(ms_run, tmp_path):
    res = CliRunner().invoke(main, ["run-ut", str(ms_run / "run"), "-o", str(tmp_path / "ut"), "--api", "GeLU"])
    assert res.exit_code == 0, res.output
    script = _repro(ms_run / "run", GELU, tmp_path / "r")
    assert sorted(os.listdir(tmp_path / "r")) == ["inputs.safetensors", "outputs.safetensors", "record.json",
                                                  "repro.py"]
    out = fresh(script, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith(f"GeLU on CPU (float32) against float64 on CPU, MindSpore {ms.__version__}")
    assert "  output.0 float32 [8, 32]: pass:" in out.stdout and "  recorded output.0 float32 [8, 32]: pass:" \
        in out.stdout and "agrees with float64 (run-ut's benchmark rule for float32" in out.stdout
    row = _replay_row(tmp_path / "ut", GELU)
    assert _number(out.stdout, "max abs error") == pytest.approx(row["Max Abs Err"], rel=1e-5)
    # the saved inputs are the recorded ones, byte for byte
    record = json.loads((tmp_path / "r" / "record.json").read_text())
    saved = dispatchprobe.load(ms_run / "run").part(step=0, rank=0).tensor(record["inputs"][0]["data"])
    from dispatchprobe.records.reader import read_safetensors
    assert (read_safetensors(str(tmp_path / "r" / "inputs.safetensors"))["input.0"] == saved).all()


def test_repro_of_a_planted_kernel_shows_run_uts_error(ms_run, tmp_path, monkeypatch):
    from mindspore import _c_expression
    kernels = tmp_path / "planted_gelu.py"
    kernels.write_text(PLANTED)
    monkeypatch.setattr(_c_expression, "pyboost_gelu", _c_expression.pyboost_gelu)    # restored after the test
    exec(compile(PLANTED, str(kernels), "exec"), {})
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["run-ut", str(ms_run / "run"), "-o", "ut"])
    assert res.exit_code == 2, res.output
    # run-ut names the op and the command of its repro
    assert f"{GELU}: a standalone repro: dispatchprobe repro {ms_run / 'run'} {GELU} -o repro/{GELU}\n" in res.output
    script = _repro(ms_run / "run", GELU, tmp_path / "r", "--prelude", str(kernels))
    out = fresh(script, cwd=ms_run)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "  output.0 float32 [8, 32]: error:" in out.stdout and "differs from float64: error" in out.stdout
    assert "  recorded output.0 float32 [8, 32]: pass:" in out.stdout      # the training process ran it right
    row = _replay_row(tmp_path / "ut", GELU)
    assert _number(out.stdout, "max abs error") == pytest.approx(row["Max Abs Err"], rel=1e-5)
    assert _number(out.stdout, "cosine") == pytest.approx(row["Cosine"], abs=1e-6)


def test_a_recorded_output_computed_wrong_is_named(ms_run, tmp_path):
    """The kernel was wrong where the op trained (its output 1 % off in the record): this machine's
    run agrees, the recorded output does not, and the script says which."""
    run = tmp_path / "run"
    shutil.copytree(ms_run / "run", run)
    part = dispatchprobe.load(run).part(step=0, rank=0)
    rec = next(r for r in part.records if r["name"] == GELU)
    key = rec["outputs"][0]["data"]
    shard = os.path.join(part.path, "tensors", part.shards[key])
    with open(shard, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        head = json.loads(f.read(size))
        begin, end = head[key]["data_offsets"]
        f.seek(8 + size + begin)
        values = np.frombuffer(f.read(end - begin), np.float32) * np.float32(1.01)
        f.seek(8 + size + begin)
        f.write(values.astype(np.float32).tobytes())
    out = fresh(_repro(run, GELU, tmp_path / "r"))
    assert out.returncode == 2, out.stdout + out.stderr
    assert "  output.0 float32 [8, 32]: pass:" in out.stdout
    assert "  recorded output.0 float32 [8, 32]: error:" in out.stdout
    assert "the recorded output differs from float64: error; this run agrees" in out.stdout


def test_a_bfloat16_record_is_judged_alike_by_run_ut_and_its_repro(tmp_path):
    """bfloat16 (numpy has none: the script reads it as float32, MindSpore hands it out as ml_dtypes'):
    run-ut and the repro give the same verdict and numbers."""
    from mindspore import mint
    x = ms.Tensor(np.random.RandomState(0).randn(4, 8).astype(np.float32)).astype(ms.bfloat16)
    with DispatchProbe(task="tensor", dump_path=str(tmp_path / "run")):
        mint.mul(x, x)
    res = CliRunner().invoke(main, ["run-ut", str(tmp_path / "run"), "-o", str(tmp_path / "ut")])
    row = _replay_row(tmp_path / "ut", "Mul.0.forward")
    assert row["Status"] == "warning", res.output          # the thousandth share of bfloat16's tiers is not met
    out = fresh(_repro(tmp_path / "run", "Mul.0.forward", tmp_path / "r"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "  output.0 bfloat16 [4, 8]: warning:" in out.stdout and "(a warning:" in out.stdout
    assert _number(out.stdout, "max abs error") == pytest.approx(row["Max Abs Err"], rel=1e-5)     # printed to 6 digits
    assert _number(out.stdout, "cosine") == pytest.approx(row["Cosine"], abs=1e-6)


def test_repro_of_a_graph_mode_record(tmp_path):
    """GRAPH_MODE kernels from MindSpore's dump: a generated primitive re-runs and agrees; a legacy
    one built from its recorded attributes (Conv2D) runs but has no float64 kernel: not judged (exit 1);
    one whose inputs the dump could not read before the kernel wrote them is refused in one line."""
    from tests.test_mindspore_graph import train as train_graph
    run = train_graph(tmp_path / "graph", "graph", "--task", "tensor") / "run"
    out = fresh(_repro(run, GELU, tmp_path / "gelu", "--step", "0"))
    assert out.returncode == 0 and "  output.0 float32 [2, 4, 4, 4]: pass:" in out.stdout, out.stdout + out.stderr
    out = fresh(_repro(run, "Conv2D.0.forward", tmp_path / "conv", "--step", "0"))
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stdout.startswith("Conv2D could not run in float64 on CPU (") and "not judged" in out.stdout
    res = CliRunner().invoke(main, ["repro", str(run), "BatchNorm.0.forward", "-o", str(tmp_path / "bn")])
    assert res.exit_code == 1 and "has no values to save (written by the kernel" in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1 and not (tmp_path / "bn").exists()


def test_records_that_cannot_make_a_repro_say_why_in_one_line(tmp_path):
    from mindspore import mint, ops
    x = ms.Tensor(np.ones((4, 4), np.float32))
    with DispatchProbe(task="statistics", dump_path=str(tmp_path / "stats")):
        mint.mul(x, 2.0)
    with DispatchProbe(task="tensor", dump_path=str(tmp_path / "tensor")):
        ops.Dropout(keep_prob=0.5)(x)
    stats = dispatchprobe.load(tmp_path / "stats").part(step=0, rank=0).records
    mul = next(r["name"] for r in stats if r.get("kind") == "op")
    drop = next(r for r in dispatchprobe.load(tmp_path / "tensor").part(step=0, rank=0).records
                if r.get("kind") == "op" and "ropout" in r["op"])
    cases = [(tmp_path / "stats", mul, "holds statistics only): record the run with task='tensor'"),
             (tmp_path / "tensor", drop["name"], f"is a random op ({drop['op']})"),
             (tmp_path / "stats", mul.replace(".0.", ".1."), f"did you mean {mul}")]
    for run, name, says in cases:
        res = CliRunner().invoke(main, ["repro", str(run), name, "-o", str(tmp_path / "r")])
        assert res.exit_code == 1 and says in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert not (tmp_path / "r").exists()         # nothing written for a refused record
    assert hint(tmp_path / "stats", mul) is None      # no command offered for a statistics-only record


def test_overflow_demo_finds_an_overflow_and_its_repro_shows_it(tmp_path):
    """The MindSpore overflow demo finds a real overflow (float16 matmul past 65504 from finite inputs,
    float64 finite), stops there, and names the repro, which shows it again with MindSpore alone."""
    out = tmp_path / "ovf"
    demo = CliRunner().invoke(main, ["demo", "--framework", "mindspore", "--task", "overflow", "-o", str(out)])
    assert demo.exit_code == 0, demo.output
    # MindSpore's op outputs carry no requires_grad, so the op is held to the end of the step (it
    # could have been discarded) and the step runs on: one flagged, the rest propagated from it
    assert re.search(r"overflow: \d+ op calls checked, 1 flagged", demo.output) and "none flagged" not in demo.output
    summary = json.loads((out / "step0" / "rank0" / "overflow.json").read_text())
    first = summary["first_critical"]
    assert (first["op"], first["scope"], first["dtype"], first["replay"]) == ("MatMul", "TinyNet.fc1", "float16",
                                                                            "precision")
    assert first["exceeds_dtype_range"] and first["float64_max_abs"] > 65504 and first["inf"] > 0
    record = dispatchprobe.load(out).tensors
    record = record[record["name"] == first["name"]]
    inputs = record[record["io"] == "input"]
    assert (inputs["inf"] == 0).all() and (inputs["nan"] == 0).all(), record
    command = f"dispatchprobe repro {out} {first['name']} -o repro"
    assert f"a standalone repro: {command}" in demo.output, demo.output
    again = fresh(_repro(out, first["name"], tmp_path / "repro"))
    assert again.returncode == 2 and "  output.0 float16 [8, 32]: error:" in again.stdout, again.stdout + again.stderr
    assert int(re.search(r"inf/nan mismatches (\d+)", again.stdout).group(1)) == first["inf"]
    assert glob.glob(str(out / "step*" / "rank*" / "overflow.csv"))
