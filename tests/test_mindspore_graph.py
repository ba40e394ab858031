"""MindSpore's compiled graphs (GRAPH_MODE cells, ``@ms.jit`` train steps) recorded from
MindSpore's own dump: the probe never breaks the user's compile, training stays bit-identical,
records hold both stages with the ``model=`` cell scopes.

Each training runs in its own process (``tests/mindspore_graph_train.py``): MindSpore reads its
dump config once per process, at the first graph compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.mindspore      # run in MindSpore's own environment (ci/matrix.py)
pytest.importorskip("mindspore")

SCRIPT = os.path.join(os.path.dirname(__file__), "mindspore_graph_train.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train(out, mode, *flags):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MINDSPORE_DUMP_CONFIG", None)
    res = subprocess.run([sys.executable, SCRIPT, mode, str(out), *flags], capture_output=True, text=True,
                         env=env, cwd=str(out.parent), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def records(run, step=0):
    return [json.loads(line) for line in open(os.path.join(run, f"step{step}", "rank0", "ops.jsonl"))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ms_graph")
    return {"graph": train(root / "graph", "graph", "--task", "statistics", "--unprobed"),
            "jit": train(root / "jit", "jit", "--task", "tensor", "--unprobed")}


@pytest.mark.parametrize("mode", ["graph", "jit"])
def test_training_is_bit_identical_with_the_probe(runs, mode):
    result = np.load(runs[mode] / "result.npz")
    probed = [k for k in result.files if not k.startswith("plain_")]
    assert any(k.startswith("param:") for k in probed) and "loss1" in probed
    for k in probed:
        assert np.array_equal(result[k], result["plain_" + k]), k


@pytest.mark.parametrize("mode", ["graph", "jit"])
def test_graph_kernels_are_recorded_in_both_stages_with_cell_scopes(runs, mode):
    for step in (0, 1):
        recs = records(runs[mode] / "run", step)
        fwd = {(r["op"], r["scope"]) for r in recs if r["stage"] == "forward"}
        bwd = {(r["op"], r["scope"]) for r in recs if r["stage"] == "backward"}
        assert {("Conv2D", "ConvNet.conv"), ("BatchNorm", "ConvNet.bn"), ("GeLU", "ConvNet.act"),
                ("MatMul", "ConvNet.fc"), ("BiasAdd", "ConvNet.fc")} <= fwd, fwd
        assert {("GeLUGrad", "ConvNet.act"), ("BatchNormGrad", "ConvNet.bn"), ("MatMul", "ConvNet.fc"),
                ("BiasAddGrad", "ConvNet.conv")} <= bwd, bwd
        # a kernel after a no-op reshape has the graph's shape, not the dumped memory's
        mm = next(r for r in recs if r["op"] == "MatMul" and r["stage"] == "forward")
        assert mm["inputs"][0]["shape"] == [2, 64] and mm["inputs"][2] == {"type": "bool", "value": False}
        assert all(r["graph_kernel"] for r in recs)
    gelu = next(r for r in records(runs[mode] / "run") if r["op"] == "GeLU")
    stats = gelu["outputs"][0]["stats"]
    assert stats["max"] > stats["min"] and np.isfinite(stats["norm"])


def test_tensor_task_saves_the_dumped_values(runs):
    from dispatchprobe import load
    run = load(str(runs["jit"] / "run"))
    recs = records(runs["jit"] / "run")
    conv = next(r for r in recs if r["op"] == "Conv2D")
    x = np.asarray(run.part(0, 0).tensor(conv["inputs"][0]["data"]))
    assert x.shape == (2, 3, 4, 4) and np.isclose(x.max(), conv["inputs"][0]["stats"]["max"])
    assert not os.path.exists(runs["jit"] / "run" / "mindspore_dump")      # the raw dump is not kept
