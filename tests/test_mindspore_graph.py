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
import warnings

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
    (out / "stderr.txt").write_text(res.stderr)
    return out


def records(run, step=0):
    return [json.loads(line) for line in open(os.path.join(run, f"step{step}", "rank0", "ops.jsonl"))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ms_graph")
    return {"graph": train(root / "graph", "graph", "--task", "tensor", "--unprobed"),
            "jit": train(root / "jit", "jit", "--task", "statistics", "--unprobed"),
            "pynative": train(root / "pynative", "pynative", "--task", "statistics"),
            "planted": train(root / "planted", "graph", "--task", "statistics", "--plant")}


@pytest.mark.parametrize("mode", ["graph", "jit"])
def test_training_is_bit_identical_with_the_probe(runs, mode):
    result = np.load(runs[mode] / "result.npz")
    probed = [k for k in result.files if k.startswith(("loss", "param:"))]
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
    run = load(str(runs["graph"] / "run"))
    recs = records(runs["graph"] / "run")
    conv = next(r for r in recs if r["op"] == "Conv2D")
    x = np.asarray(run.part(0, 0).tensor(conv["inputs"][0]["data"]))
    assert x.shape == (2, 3, 4, 4) and np.isclose(x.max(), conv["inputs"][0]["stats"]["max"])
    assert not os.path.exists(runs["graph"] / "run" / "mindspore_dump")      # the raw dump is not kept
    # what a kernel wrote before the dump read it has no values; BatchNorm's unwritten CPU outputs are undefined
    bn = next(r for r in recs if r["op"] == "BatchNorm")
    assert "no_values" in bn["inputs"][3] and "data" not in bn["inputs"][3]
    assert bn["outputs"][1].get("undefined") and "stats" in bn["outputs"][3]
    # a legacy primitive's attributes and the constants the graph passes are recorded for replay
    assert conv["kwargs"]["out_channel"] == {"type": "int", "value": 4}
    reshape = next(r for r in recs if r["op"] == "Reshape" and r["stage"] == "forward")
    assert reshape["inputs"][1] == {"type": "tuple", "value": [{"type": "int", "value": 2}, {"type": "int", "value": -1}]}   # as the net wrote it


def test_run_ut_replays_a_graph_mode_tensor_run(runs, tmp_path):
    from dispatchprobe.offline.run_ut import run_ut
    res = run_ut(str(runs["graph"] / "run"), out_dir=str(tmp_path / "ut"))
    r = res.results
    verdicts = r["Forward Test Success"].where(r["Stage"] == "forward", r["Backward Test Success"])
    assert (verdicts == "pass").sum() >= 30 and not (verdicts.isin(["error", "warning"])).any(), r.to_string()
    # the bias gradient of a conv before batch norm is mathematically zero: its rounding passes
    assert (verdicts[r["API Name"] == "BiasAddGrad.1.backward"] == "pass").all()
    # what cannot be replayed says why (a kernel that wrote its input before the dump read it)
    assert r.loc[r["API Name"] == "BatchNorm.0.forward", "Message"].str.contains("written by the kernel").all()


@pytest.mark.parametrize("mode", ["graph", "jit"])
@pytest.mark.parametrize("order", ["compiled-pynative", "pynative-compiled"])
def test_compiled_run_compares_clean_against_pynative(runs, mode, order):
    """Two vocabularies of one framework (graph kernels, PyNative primitives): compared in aten's,
    kernels PyNative cannot see explained, either order."""
    from dispatchprobe import compare
    a, b = (runs[mode], runs["pynative"]) if order == "compiled-pynative" else (runs["pynative"], runs[mode])
    table, verdict = compare(str(a / "run"), str(b / "run"))
    assert verdict.passed and verdict.forward is None and verdict.backward is None, str(verdict)
    assert (table["status"] == "pass").all()
    paired = set(zip(table["stage"], table["scope"], table["op_a"]))
    assert {("forward", "ConvNet.conv", "aten.convolution.default"), ("forward", "ConvNet.bn", "aten.native_batch_norm.default"),
            ("forward", "ConvNet.fc", "aten.addmm.default"), ("backward", "ConvNet.act", "aten.gelu_backward.default"),
            ("backward", "ConvNet.fc", "aten.mm.default")} <= paired
    # the backward kernels PyNative runs outside its dispatch mode are said, not counted unaligned
    um = verdict.unmatched
    unseen = um[um["explained"].str.contains("not observable", na=False)]
    assert {"aten.native_batch_norm_backward.default", "aten.convolution_backward.default"} <= set(unseen["op"])


def test_planted_change_in_one_cell_is_named_at_that_cell(runs):
    from dispatchprobe import compare
    _, verdict = compare(str(runs["planted"] / "run"), str(runs["pynative"] / "run"))
    assert not verdict.passed
    assert verdict.forward is not None and verdict.forward.scope == "ConvNet.act", str(verdict)


def torch_twin_run(graph_dir, out, gelu="tanh", wrong_gelu_backward=False):
    """The PyTorch twin (same class and attribute names, the graph run's initial weights and
    batches) trained 2 steps by SGD under the torch probe: F.mse_loss, optimizer outside the probe.
    ``gelu``: the graph run's GELU ("tanh" or "exact"); ``wrong_gelu_backward``: aten's
    ``gelu_backward`` replaced by one 1 % off while it trains."""
    torch = pytest.importorskip("torch")
    from dispatchprobe import DispatchProbe as TorchProbe

    class ConvNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4)
            # MindSpore's nn.GELU() is the tanh approximation
            self.act = torch.nn.GELU(approximate="tanh" if gelu == "tanh" else "none")
            self.fc = torch.nn.Linear(4 * 4 * 4, 5)

        def forward(self, x):
            h = self.act(self.bn(self.conv(x)))
            return self.fc(h.reshape(h.shape[0], -1))
    result = np.load(graph_dir / "result.npz")
    names = {"bn.weight": "bn.gamma", "bn.bias": "bn.beta", "bn.running_mean": "bn.moving_mean",
             "bn.running_var": "bn.moving_variance"}
    net = ConvNet()
    with torch.no_grad():
        for n, p in list(net.named_parameters()) + list(net.named_buffers()):
            key = "initial:" + names.get(n, n)
            if key in result.files:
                p.copy_(torch.from_numpy(result[key]))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    lib = wrong_gelu_backward_kernel(torch) if wrong_gelu_backward else None
    try:
        probe = TorchProbe(task="statistics", dump_path=str(out), model=net)
        for step in range(2):
            rng = np.random.RandomState(step)          # tests/mindspore_graph_train.py's batches
            x, y = (torch.from_numpy(rng.randn(*shape).astype(np.float32)) for shape in ((2, 3, 4, 4), (2, 5)))
            opt.zero_grad()
            with probe:
                loss = torch.nn.functional.mse_loss(net(x), y)
                loss.backward()
            opt.step()
            probe.step()
        probe.close()
    finally:
        if lib is not None:
            lib._destroy()      # at once: a dropped Library lives until collected, its kernels with it
    return out


def wrong_gelu_backward_kernel(torch):
    """aten::gelu_backward (exact GELU) on CPU 1 % off until the library returned is destroyed."""
    def wrong(grad, x, approximate="none"):
        exact = 0.5 * (1 + torch.erf(x / 2 ** 0.5)) + x * torch.exp(-x * x / 2) / (2 * np.pi) ** 0.5
        return grad * exact * 1.01
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():       # torch warns that a registered kernel is overridden: the point
        warnings.simplefilter("ignore", UserWarning)
        lib.impl("gelu_backward", wrong, "CPU")
    return lib


@pytest.mark.parametrize("order", ["graph-torch", "torch-graph"])
def test_graph_run_compares_clean_against_its_pytorch_twin(runs, tmp_path_factory, order):
    from dispatchprobe import compare
    twin = torch_twin_run(runs["graph"], tmp_path_factory.mktemp("twin") / "torch")
    a, b = (runs["graph"] / "run", twin) if order == "graph-torch" else (twin, runs["graph"] / "run")
    table, verdict = compare(str(a), str(b))
    assert verdict.passed and verdict.forward is None and verdict.backward is None, str(verdict)
    assert (table["status"] == "pass").all()
    ops = set(zip(table["stage"], table["scope"], table["op_a" if order == "torch-graph" else "op_b"]))
    assert {("forward", "ConvNet.conv", "aten.convolution.default"), ("forward", "ConvNet.bn", "aten.native_batch_norm.default"),
            ("forward", "ConvNet.fc", "aten.addmm.default"), ("backward", "ConvNet.act", "aten.gelu_backward.default"),
            ("backward", "ConvNet.bn", "aten.native_batch_norm_backward.default"),
            ("backward", "ConvNet.conv", "aten.convolution_backward.default")} <= ops, ops


@pytest.fixture(scope="module")
def exact_gelu_runs(tmp_path_factory):
    """The GRAPH_MODE step with the exact GELU, whose backward MindSpore computes in pieces summed by
    an ``AddN`` with no source trace, named after the batch norm that made the GELU's input; its
    PyTorch twin, clean and with a wrong ``gelu_backward``."""
    root = tmp_path_factory.mktemp("ms_exact_gelu")
    graph = train(root / "graph", "graph", "--task", "statistics", "--config", json.dumps({"gelu": "exact"}))
    return {"graph": graph / "run",
            "torch": torch_twin_run(graph, root / "torch", gelu="exact"),
            "wrong": torch_twin_run(graph, root / "wrong", gelu="exact", wrong_gelu_backward=True)}


@pytest.mark.parametrize("order", ["graph-torch", "torch-graph"])
def test_a_gradient_sum_with_no_trace_is_in_the_cell_its_terms_come_from(exact_gelu_runs, order):
    """The AddN summing the exact GELU's two gradient branches is ConvNet.act's, as aten's gelu_backward
    sums inside: the pair compares clean in either order (was: the region cut before the sum, one
    branch against the whole gradient, 2 errors at ConvNet.act), and a gelu_backward kernel 1 % off
    is named there."""
    from dispatchprobe import compare
    graph, clean, wrong = exact_gelu_runs["graph"], exact_gelu_runs["torch"], exact_gelu_runs["wrong"]
    a, b = (graph, clean) if order == "graph-torch" else (clean, graph)
    table, verdict = compare(str(a), str(b))
    assert verdict.passed and verdict.forward is None and verdict.backward is None, str(verdict)
    assert (table["status"] != "error").all(), table[table["status"] == "error"]
    a, b = (graph, wrong) if order == "graph-torch" else (wrong, graph)
    _, verdict = compare(str(a), str(b))
    first = verdict.backward       # step 1's forward follows from step 0's gradients (SGD outside the probe)
    assert first is not None and (first.scope, first.step) == ("ConvNet.act", 0), str(verdict)
    assert "gelu_backward" in first.op + first.other_op, str(verdict)


@pytest.fixture(scope="module")
def overflow_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ms_overflow")
    runs = {"scaled": train(root / "scaled", "pynative", "--loss-scale"),
            "scaled_planted": train(root / "scaled_planted", "pynative", "--loss-scale", "--plant-overflow"),
            "scaled_jit": train(root / "scaled_jit", "jit", "--loss-scale"),
            "graph_planted": train(root / "graph_planted", "graph", "--task", "overflow", "--plant-overflow")}
    return {k: (v, json.loads((v / "summary.json").read_text())) for k, v in runs.items()}


def test_deliberate_overflow_of_dynamic_loss_scaling_is_expected(overflow_runs):
    """amp.DynamicLossScaler from 2**20 on a float16 net: the first steps' backward overflows are
    the scaler's (it backs off and skips them): expected, training runs on, nothing critical."""
    _, got = overflow_runs["scaled"]
    assert not got["error"], got["error"]
    assert got["scales"][0] < 2.0 ** 20 and got["scales"][-1] == got["scales"][-2]     # backed off, then steady
    assert got["summary"]["expected"] >= 1 and got["summary"]["critical"] == 0, got["summary"]
    rows = [r for d in sorted((overflow_runs["scaled"][0] / "run").glob("step*/rank0/overflow.json"))
            for r in json.loads(d.read_text())["rows"] if r["class"] == "expected"]
    assert rows and all(r["stage"] == "backward" and "skipped by the loss scaler" in r["loss_scale"] for r in rows)


def test_planted_overflow_is_named_under_loss_scaling(overflow_runs):
    _, got = overflow_runs["scaled_planted"]
    assert "overflow in Muls (forward, scope 'HalfNet'" in got["error"], got
    assert got["summary"]["critical"] == 1


def test_graph_mode_overflow_is_named_at_its_cell(overflow_runs):
    run, got = overflow_runs["graph_planted"]
    assert "overflow in Mul (forward, scope 'ConvNet.act'" in got["error"], got
    rows = json.loads((run / "run" / "step0" / "rank0" / "overflow.json").read_text())["rows"]
    first = next(r for r in rows if r["class"] == "critical")
    assert first["scope"] == "ConvNet.act" and "compiled graph's kernel" in first["replay"]


def test_control_flow_graph_dump_is_refused_not_misrecorded(overflow_runs):
    """An @jit step with `if finite: opt(grads)` compiles to several kernel graphs whose dumped
    files MindSpore names ambiguously: the probe says so and records none of them."""
    run, got = overflow_runs["scaled_jit"]
    assert "could not be matched to the graph's kernels" in (run / "stderr.txt").read_text()
    assert not got["error"] and got["summary"]["critical"] == 0
    assert not any('"graph_kernel"' in p.read_text() for p in (run / "run").glob("step*/rank0/ops.jsonl"))


def test_step_scope_and_list_filters_select_graph_kernels(tmp_path):
    out = train(tmp_path / "filtered", "graph", "--task", "statistics",
                "--config", json.dumps({"step": [1], "scope": ["ConvNet.fc"], "list": ["MatMul"],
                                        "keep_dump": True, "steps": 3}))
    run = out / "run"
    assert not (run / "step0").exists() and not (run / "step2").exists()
    # MindSpore dumps the selected step only: steps 0 and 2 and a step after close() write no file
    assert list(np.load(out / "result.npz")["dumped"]) == [0, 0, 0, 0]
    kept = list((run / "mindspore_dump" / "step1").rglob("*.npy"))     # MindSpore's files, as asked
    # MindSpore's dump narrowed to what the filters could select: the MatMuls, not the conv's kernels
    assert any(p.name.startswith("MatMul.") for p in kept) and not any(p.name.startswith("Conv2D") for p in kept)
    recs = records(run, 1)
    assert recs and {(r["op"], r["scope"]) for r in recs} == {("MatMul", "ConvNet.fc")}
    assert {r["stage"] for r in recs} == {"forward", "backward"}


@pytest.mark.parametrize("mode,filters", [
    ("graph", {"scope": ["ConvNet.conv"]}),                 # its BiasAddGrad is named after the dense cell's
    ("graph", {"list": ["MatMul", "GeLU"]}),
    ("graph", {"scope": ["act"], "list": ["GeLU"]}),
    ("jit", {"scope": ["ConvNet.conv"]}),                   # a jit function's kernel names hold no cell
    ("graph", {"data_mode": ["forward"], "scope": ["ConvNet.conv"]}),
    ("jit", {"data_mode": ["backward"], "list": ["Mul", "BiasAddGrad"]}),   # an expanded Mul among them
])
def test_scope_and_list_narrow_mindspores_dump_without_changing_records(tmp_path, mode, filters):
    """The dump-side filter (MindSpore's ``kernels``) keeps MindSpore from writing kernels the
    filters drop: the same records as a dump of every kernel filtered when read, fewer files."""
    got = {}
    for narrowed in (True, False):
        out = train(tmp_path / f"narrowed{narrowed}", mode, "--task", "statistics", "--config",
                    json.dumps({**filters, "keep_dump": True, "dump_filter": narrowed}))
        assert "dump filter left out" not in (out / "stderr.txt").read_text()
        recs = [r for step in (0, 1) for r in records(out / "run", step)]
        files = sum(1 for _ in (out / "run" / "mindspore_dump").rglob("*.npy"))
        got[narrowed] = recs, files
    assert got[True][0] and got[True][0] == got[False][0]
    assert 0 < got[True][1] < got[False][1], (got[True][1], got[False][1])


def test_level_mix_records_a_graph_as_level_op_and_module_dumps_nothing(tmp_path):
    """No cell boundary is seen inside a graph: ``mix`` gives the kernels' records only, and
    ``module`` (L0) records nothing and leaves MindSpore's dump off (it warns)."""
    runs = {level: train(tmp_path / level, "graph", "--task", "statistics", "--config",
                         json.dumps({"level": level, "steps": 1, "keep_dump": True}))
            for level in ("op", "mix", "module")}
    ops = "run/step0/rank0/ops.jsonl"
    assert (runs["op"] / ops).read_text() == (runs["mix"] / ops).read_text()
    assert records(runs["mix"] / "run") and all(r["kind"] == "op" for r in records(runs["mix"] / "run"))
    assert "level='module' records cell boundaries" in (runs["module"] / "stderr.txt").read_text()
    assert not list((runs["module"] / "run").rglob("ops.jsonl"))
    assert not (runs["module"] / "run/mindspore_dump").exists()


def test_a_graph_run_twice_in_one_step_is_recorded_run_by_run(tmp_path):
    """Two micro-batches through the GRAPH_MODE train step inside one ``with probe:``: MindSpore
    writes both runs into one folder; each kernel is recorded twice, the first run's kernels
    (its optimizer update included) before the second's, each with its own batch."""
    sys.path.insert(0, os.path.dirname(SCRIPT))
    from mindspore_graph_train import data
    run = train(tmp_path / "twice", "graph", "--task", "statistics", "--config", json.dumps({"steps": 1, "calls": 2}))
    recs = records(run / "run")
    convs = [i for i, r in enumerate(recs) if r["op"] == "Conv2D"]
    sgd = [i for i, r in enumerate(recs) if r["op"] == "SGD"]
    half = len(sgd) // 2                  # one SGD kernel per parameter, in each run
    assert len(convs) == 2 and half and len(sgd) == 2 * half and convs[0] < sgd[0] and sgd[half - 1] < convs[1] < sgd[half]
    for call, i in enumerate(convs):
        assert np.isclose(recs[i]["inputs"][0]["stats"]["max"], data(call)[0].max())


TWO_PROBES = """
import sys, warnings
sys.path.insert(0, {tests!r})
import mindspore as ms
from mindspore import nn
from mindspore_graph_train import ConvNet, data
from dispatchprobe_ms import DispatchProbe

ms.set_context(mode=ms.GRAPH_MODE)
net = ConvNet()
step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), nn.SGD(net.trainable_params(), 0.1))
first = DispatchProbe(task="statistics", dump_path={out!r} + "/fc", model=net, scope=["ConvNet.fc"])
if {compile_between}:                     # MindSpore reads the first probe's dump filter at this compile
    with first:
        step(*(ms.Tensor(v) for v in data(0)))
first.close()
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    second = DispatchProbe(task="statistics", dump_path={out!r} + "/conv", model=net, scope=["ConvNet.conv"])
    with second:
        step(*(ms.Tensor(v) for v in data(1)))
    second.close()
print("\\n".join(str(w.message) for w in seen if "dump" in str(w.message)))
"""


@pytest.mark.parametrize("compile_between", [True, False])
def test_a_later_probe_with_other_filters_gets_its_kernels_or_is_told(tmp_path, compile_between):
    """MindSpore reads the dump filter once, at its first compile: a second probe made before it
    replaces the first one's filter; made after it, the kernels its filters select and the dump
    left out are named, not silently missing."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MINDSPORE_DUMP_CONFIG", None)
    script = tmp_path / "two_probes.py"
    script.write_text(TWO_PROBES.format(tests=os.path.dirname(SCRIPT), out=str(tmp_path),
                                        compile_between=compile_between))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    said = res.stdout.strip()
    conv = tmp_path / "conv" / "step0" / "rank0" / "ops.jsonl"
    recorded = {json.loads(line)["op"] for line in open(conv)} if conv.exists() else set()
    if compile_between:
        assert "filtered by an earlier probe's scope/list" in said, said
        assert "dump filter left out Default/network-WithLossCell/_backbone-ConvNet/conv-Conv2d/Conv2D-op0" in said
        assert "Conv2D" not in recorded
    else:
        assert not said, said
        assert {"Conv2D", "BiasAdd", "Conv2DBackpropFilter", "BiasAddGrad"} <= recorded, recorded


LATE_PROBE = """
import warnings
import mindspore as ms, numpy as np
from dispatchprobe_ms import DispatchProbe


@ms.jit
def double(x):
    return x * 2


if {compile_first}:
    double(ms.Tensor(np.ones(3, np.float32)))          # MindSpore's first compile, before the probe
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    probe = DispatchProbe(task="statistics", dump_path={out!r})
    with probe:
        double(ms.Tensor(np.ones(3, np.float32)))
    probe.close()
print("\\n".join(str(w.message) for w in seen if "compiled a graph" in str(w.message)))
"""


@pytest.mark.parametrize("compile_first", [True, False])
def test_a_pynative_probe_made_after_the_first_compile_says_graphs_go_unrecorded(tmp_path, compile_first):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MINDSPORE_DUMP_CONFIG", None)
    script = tmp_path / "late_probe.py"         # MindSpore compiles only functions it can read the source of
    script.write_text(LATE_PROBE.format(compile_first=compile_first, out=str(tmp_path / "run")))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    said = res.stdout.strip().splitlines()
    if compile_first:       # one line, saying where the probe must be made
        assert len(said) == 1 and "create the probe before the first GRAPH_MODE or @jit call" in said[0], said
    else:                   # made in time: the @jit call inside the probe is recorded, nothing said
        assert not said and '"graph_kernel"' in (tmp_path / "run" / "step0" / "rank0" / "ops.jsonl").read_text()


@pytest.fixture(scope="module")
def cross_entropy_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ms_ce")
    flags = ("--task", "statistics", "--config", json.dumps({"loss": "cross_entropy"}))
    return {mode: train(root / mode, mode, *flags) / "run" for mode in ("graph", "jit")}


@pytest.mark.parametrize("order", ["graph-jit", "jit-graph"])
def test_kernels_the_dump_numbers_apart_are_paired_by_evidence(cross_entropy_runs, order):
    """A cross-entropy loss in a GRAPH_MODE train step and in an @jit one: MindSpore's dump numbers the expanded
    SumExt/Muls kernels apart from the graph's IR (row sums of alike shapes among them).  They are paired again
    by shapes and their neighbours' values (dispatchprobe_ms/graph_pairing.py): every step is recorded, and the
    two compiled runs' loss kernels (named apart each its own way) agree, either order."""
    from dispatchprobe import compare
    for run in cross_entropy_runs.values():
        assert "graph_steps_unrecorded" not in json.loads((run / "manifest.json").read_text())
        kernels = [r.get("graph_kernel", "") for step in (0, 1) for r in records(run, step)]
        assert sum(k.startswith("Expand/_SumExt/ReduceSum-op") for k in kernels) == 16, kernels
    a, b = (cross_entropy_runs[m] for m in order.split("-"))
    table, verdict = compare(str(a), str(b))
    assert verdict.forward is None, str(verdict)
    loss = table[(table["scope"] == "") & table["op_a"].isin(["ReduceSum", "Mul", "Div", "Log", "Exp"])]
    assert len(loss) and (loss["status"] == "pass").all(), loss[["step", "stage", "op_a", "arg", "status"]]


@pytest.fixture(scope="module")
def cross_entropy_pynative(tmp_path_factory):
    flags = ("--task", "statistics", "--config", json.dumps({"loss": "cross_entropy"}))
    return train(tmp_path_factory.mktemp("ms_ce_pynative") / "pynative", "pynative", *flags) / "run"


@pytest.mark.parametrize("order", ["graph-pynative", "pynative-graph"])
def test_a_loss_the_graph_runs_in_another_order_compares_clean_against_pynative(
        cross_entropy_runs, cross_entropy_pynative, order):
    """The GRAPH_MODE step runs the cross-entropy's MaskedFill calls (on the int64 labels, on float
    values) in another order than PyNative, and the backward kernels that need no loss before the
    loss's last kernels: paired by dtype kind and by the data flow of the forward, every call meets
    its own, and the verdict is the same either order (it named a MaskedFill with the graph run as A,
    the fc's BiasAdd with it as B)."""
    from dispatchprobe import compare
    runs = {"graph": cross_entropy_runs["graph"], "pynative": cross_entropy_pynative}
    a, b = (runs[m] for m in order.split("-"))
    table, verdict = compare(str(a), str(b))
    assert verdict.passed and verdict.forward is None and verdict.backward is None, str(verdict)
    fills = table[(table["op_a"] == "MaskedFill") & (table["op_b"] == "MaskedFill")]
    assert len(fills) >= 2 * 2 * 4 and (fills["status"] == "pass").all(), fills[["step", "arg", "status"]]


@pytest.mark.parametrize("order", ["graph-jit", "jit-graph"])
def test_a_kernel_reading_an_output_the_cpu_leaves_unwritten_is_not_judged_on_it(cross_entropy_runs, order):
    """BatchNormGrad's input 5 is BatchNorm's output 2, which MindSpore's CPU kernel never writes
    (the graph's IR says which output each input is): recorded undefined, "not judged", never an
    error between the GRAPH_MODE and the @jit step (the memory held other values in each)."""
    from dispatchprobe import compare
    for run in cross_entropy_runs.values():
        grads = [r for step in (0, 1) for r in records(run, step) if r["op"] == "BatchNormGrad"]
        assert len(grads) == 2 and all(r["inputs"][5].get("undefined") for r in grads), grads
        assert not any(r["inputs"][n].get("undefined") for r in grads for n in (0, 1, 3, 4))
    a, b = (cross_entropy_runs[m] for m in order.split("-"))
    table, verdict = compare(str(a), str(b))
    assert verdict.passed and verdict.forward is None and verdict.backward is None, str(verdict)
    read = table[(table["op_a"] == "BatchNormGrad") & (table["arg"] == "input.5")]
    assert len(read) == 2 and (read["status"] == "not judged").all(), read
