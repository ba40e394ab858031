"""The MindSpore twin: same tasks, same records, bit-identical training, planted faults found.

Runs where mindspore is installed (``pip install -e ".[mindspore]"``), in blocking mode
(``MS_DEV_LAUNCH_BLOCKING=1``, set before mindspore is imported)."""

from __future__ import annotations

import contextlib
import json
import os

import numpy as np
import pandas as pd
import pytest

pytestmark = pytest.mark.mindspore      # run in MindSpore's own environment (ci/matrix.py)
os.environ.setdefault("MS_DEV_LAUNCH_BLOCKING", "1")
ms = pytest.importorskip("mindspore")

from mindspore import mint, nn  # noqa: E402

from dispatchprobe import load  # noqa: E402
from dispatchprobe.core.config import ConfigError  # noqa: E402
from dispatchprobe_ms import DispatchProbe  # noqa: E402
from dispatchprobe_ms.demo import TinyNet, batch, train  # noqa: E402

ms.set_context(mode=ms.PYNATIVE_MODE)
DTYPES = {"fp32": ms.float32, "fp16": ms.float16}


def ops_of(path, step=0):
    return [json.loads(line) for line in open(os.path.join(path, f"step{step}", "rank0", "ops.jsonl"))]


@pytest.fixture(scope="module")
def plain():
    return {k: train(dtype=dt) for k, dt in DTYPES.items()}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("task", ["statistics", "tensor", "overflow", "free_benchmark"])
def test_bit_identical_training(tmp_path, plain, task, dtype):
    losses, params = train(DispatchProbe(task=task, dump_path=str(tmp_path)), dtype=DTYPES[dtype])
    ref_losses, ref_params = plain[dtype]
    assert all(np.array_equal(a, b) for a, b in zip(losses, ref_losses))
    assert params.keys() == ref_params.keys()
    assert all(np.array_equal(params[k], ref_params[k]) for k in params)


def test_records_forward_backward_scopes_and_unobserved_kernels(tmp_path):
    probe = DispatchProbe(task="tensor", dump_path=str(tmp_path), level="mix")
    with pytest.warns(RuntimeWarning, match=r"TinyNet\.norm \(LayerNormGrad"):
        train(probe, steps=2)
    recs = ops_of(tmp_path)
    ops = [r for r in recs if r["kind"] == "op"]
    fwd = {(r["op"], r["scope"]) for r in ops if r["stage"] == "forward"}
    assert {("MatMul", "TinyNet.fc1"), ("BiasAdd", "TinyNet.fc1"), ("GeLU", "TinyNet.act"),
            ("LayerNorm", "TinyNet.norm"), ("MatMul", "TinyNet.fc2")} <= fwd
    bwd = {(r["op"], r["scope"]) for r in ops if r["stage"] == "backward"}
    assert ("GeLUGrad", "TinyNet.act") in bwd and ("MatMul", "TinyNet.fc1") in bwd
    assert not any(r["op"] in ("View", "typeof") and r["scope"] for r in ops)   # hook machinery left out
    modules = {(r["scope"], r["stage"]) for r in recs if r["kind"] == "module"}
    assert ("TinyNet.fc1", "forward") in modules and ("TinyNet.act", "backward") in modules
    # the unobservable backward kernels are said, per cell, in the part's checks
    checks = json.loads((tmp_path / "step0" / "rank0" / "checks.json").read_text())
    assert "LayerNormGrad" in checks["backward_not_observable"]["TinyNet.norm"]
    assert "BiasAddGrad" in checks["backward_not_observable"]["TinyNet.fc1"]
    # statistics are the tensors' own, and the saved tensors read back
    run = load(tmp_path)
    mm = next(r for r in ops if r["op"] == "MatMul" and r["stage"] == "forward")
    x = run.part(0, 0).tensor(mm["inputs"][0]["data"])
    assert np.allclose(mm["inputs"][0]["stats"]["max"], np.asarray(x).max())
    assert mm["inputs"][0]["dtype"] == "float32" and mm["inputs"][2] == {"type": "bool", "value": False}
    assert {r["framework"] for r in [run.manifest]} == {"mindspore"}


def test_dtype_arguments_are_recorded_as_dtypes(tmp_path):
    x = ms.Tensor(np.ones((2, 3), np.float32))
    with DispatchProbe(task="statistics", dump_path=str(tmp_path)) as probe:
        mint.sum(x, dim=1, dtype=ms.float64)
        x.astype(ms.float16)
    probe.close()
    recs = {r["op"]: r for r in ops_of(tmp_path)}
    assert recs["SumExt"]["inputs"][3] == {"type": "dtype", "value": "float64"}
    assert recs["Cast"]["inputs"][1] == {"type": "dtype", "value": "float16"}
    assert recs["SumExt"]["outputs"][0]["dtype"] == "float64"


class Blow(nn.Cell):
    def construct(self, x):
        return mint.exp(x * 40)


class ExpNet(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc = nn.Dense(4, 4, dtype=ms.float16)
        self.blow = Blow()
        self.head = nn.Dense(4, 4, dtype=ms.float16)

    def construct(self, x):
        return self.head(self.blow(self.fc(x)))


def test_planted_fp16_overflow_localized_to_primitive_and_cell(tmp_path):
    from dispatchprobe.core.overflow import OverflowDetected
    ms.set_seed(0)
    net = ExpNet()
    probe = DispatchProbe(task="overflow", dump_path=str(tmp_path), model=net)
    x = ms.Tensor(np.full((2, 4), 2.0, np.float16))
    with pytest.raises(OverflowDetected, match=r"Exp \(forward"):
        with probe:
            net(x)
    probe.close()
    summary = json.loads((tmp_path / "step0" / "rank0" / "overflow.json").read_text())
    first = summary["first_critical"]
    assert (first["op"], first["stage"], first["scope"]) == ("Exp", "forward", "ExpNet.blow")
    assert first["replay"] == "precision"          # float64 holds it: the fp16 range is the problem


class Cancel(nn.Cell):
    """(x + 1000) - 1000 in fp16: a difference of nearly equal numbers amplifies any input noise."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Dense(16, 16, dtype=ms.float16)

    def construct(self, x):
        y = self.fc(x)
        return (y + 1000.0) - 1000.0


def test_free_benchmark_flags_the_ill_conditioned_op(tmp_path):
    ms.set_seed(0)
    net = Cancel()
    probe = DispatchProbe(task="free_benchmark", dump_path=str(tmp_path), model=net,
                          free_benchmark={"pert_mode": "add_noise"})
    x, _ = batch(0, ms.float16)
    with probe:
        net(x)
    probe.close()
    import pandas as pd
    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f.startswith("free_benchmark") and f.endswith(".csv")]
    rows = pd.concat([pd.read_csv(f) for f in files])
    flagged = set(rows["op"])
    assert "SubExt" in flagged or "Sub" in flagged or "Subs" in flagged, rows
    assert not (rows["scope"] == "Cancel.fc").any(), "the well-conditioned Dense is flagged"


def test_backward_fuzzing_refused_with_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="fuzz_stage 'backward' is not available for MindSpore"):
        DispatchProbe(task="free_benchmark", dump_path=str(tmp_path), free_benchmark={"fuzz_stage": "backward"})
    with pytest.raises(ConfigError, match="model must be a mindspore.nn.Cell"):
        DispatchProbe(task="statistics", dump_path=str(tmp_path), model=object())


@pytest.fixture(scope="module")
def ms_records(tmp_path_factory):
    root = tmp_path_factory.mktemp("ms_records")
    for name, dt in DTYPES.items():
        train(DispatchProbe(task="tensor", dump_path=str(root / name)), steps=1, dtype=dt)
    return root


def status(results):
    fwd, bwd = results["Forward Test Success"], results["Backward Test Success"]
    return fwd.where(fwd != "", bwd)


@pytest.mark.parametrize("dtype", DTYPES)
def test_run_ut_replays_with_mindspore_against_float64(ms_records, tmp_path, dtype):
    from dispatchprobe.offline.run_ut import run_ut
    r = run_ut(str(ms_records / dtype), tmp_path / "ut").results
    st = status(r)
    assert len(r) >= 20 and not (st == "error").any(), r[st == "error"]
    assert {"MatMul", "BiasAdd", "GeLU", "LayerNorm", "Softmax", "GeLUGrad"} <= set(r[st != "SKIP"]["Op"])
    if dtype == "fp32":
        assert set(st) == {"pass"}
    details = pd.read_csv(next((tmp_path / "ut").glob("accuracy_checking_details_*.csv")))
    assert set(details["Bench Dtype"].dropna()) >= {"float64"}
    # msprobe's MindSpore rule beside the full verdict: cosine > 0.99 and max abs error < 1e-4
    rule = (details["Cosine"] > 0.99) & (details["Max Abs Err"] < 1e-4)
    judged = details["Status"] != "SKIP"
    assert (details.loc[judged, "MindSpore Rule"] == rule[judged].map({True: "pass", False: "error"})).all()


def test_run_ut_flags_a_planted_wrong_kernel(ms_records, tmp_path, monkeypatch):
    """A GeLU kernel 1% off in float32 (right in float64, the benchmark) is the only error."""
    from mindspore import _c_expression
    from dispatchprobe.offline.run_ut import run_ut
    right = _c_expression.pyboost_gelu

    def wrong(prim, args):
        out = right(prim, args)
        return out * 1.01 if out.dtype == ms.float32 else out
    monkeypatch.setattr(_c_expression, "pyboost_gelu", wrong)
    r = run_ut(str(ms_records / "fp32"), tmp_path / "ut").results
    st = status(r)
    assert set(r[st == "error"]["Op"]) == {"GeLU"}
    assert set(st[r["Op"] != "GeLU"]) == {"pass"}


# ---- MindSpore against PyTorch: the same net, the same weights ------------------------------------
def torch_twin(ms_net):
    """The PyTorch TinyNet (same class and attribute names: same scopes) with ``ms_net``'s weights."""
    import torch
    from dispatchprobe_ms.demo import DIMS

    class TinyNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.act = torch.nn.Linear(DIMS[0], DIMS[1]), torch.nn.GELU()
            self.norm, self.fc2 = torch.nn.LayerNorm(DIMS[1], eps=1e-7), torch.nn.Linear(DIMS[1], DIMS[2])

        def forward(self, x):
            return torch.softmax(self.fc2(self.norm(self.act(self.fc1(x)))), dim=-1)

    net, names = TinyNet(), {"norm.weight": "norm.gamma", "norm.bias": "norm.beta"}
    weights = {n: p.asnumpy() for n, p in ms_net.parameters_and_names()}      # names relative to ms_net
    with torch.no_grad():
        for n, p in net.named_parameters():
            p.copy_(torch.from_numpy(weights[names.get(n, n)]))
    return net


def record_torch(net, path, planted: bool = False):
    import torch
    from dispatchprobe import DispatchProbe as TorchProbe
    x, y = (torch.from_numpy(t.asnumpy()) for t in batch(0))
    lib = None
    if planted:                                     # a gelu kernel 1% off
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("gelu", lambda t, approximate="none": 0.5 * t * (1 + torch.erf(t / 2 ** 0.5)) * 1.01, "CPU")
    try:
        with TorchProbe(task="tensor", dump_path=str(path), model=net) as probe:
            ((net(x) - y) ** 2).mean().backward()
        probe.close()
    finally:
        if lib is not None:
            lib._destroy()      # at once: a dropped Library lives until collected, its kernels with it


@pytest.fixture(scope="module")
def twin_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("twin")
    ms.set_seed(0)
    ms_net = TinyNet()
    net, planted = torch_twin(ms_net), torch_twin(ms_net)     # before the MindSpore step moves the weights
    with pytest.warns(RuntimeWarning, match="not .fully. recorded"):
        train(DispatchProbe(task="tensor", dump_path=str(root / "ms"), model=ms_net), steps=1, net=ms_net)
    record_torch(net, root / "torch")
    record_torch(planted, root / "torch_planted", planted=True)
    ms.set_seed(0)
    wrong = TinyNet()
    wrong.act = WrongGELU()                                   # the MindSpore side's planted layer
    with pytest.warns(RuntimeWarning, match="not .fully. recorded"):
        train(DispatchProbe(task="tensor", dump_path=str(root / "ms_planted"), model=wrong), steps=1, net=wrong)
    return root


class WrongGELU(nn.GELU):
    def construct(self, x):
        return super().construct(x) * 1.01


@pytest.mark.parametrize("order", ["ms-torch", "torch-ms"])
def test_mindspore_and_pytorch_runs_align_and_agree(twin_runs, order):
    from dispatchprobe import compare
    a, b = ("ms", "torch") if order == "ms-torch" else ("torch", "ms")
    table, verdict = compare(str(twin_runs / a), str(twin_runs / b))
    assert verdict.passed and verdict.forward is None and verdict.backward is None, str(verdict)
    assert (table["status"] == "pass").all()
    paired = set(zip(table["stage"], table["scope"].fillna(""), table["op_b" if a == "ms" else "op_a"]))
    assert {("forward", "TinyNet.fc1", "aten.addmm.default"), ("forward", "TinyNet.norm", "aten.native_layer_norm.default"),
            ("forward", "TinyNet", "aten._softmax.default"), ("backward", "TinyNet.act", "aten.gelu_backward.default"),
            ("backward", "TinyNet.fc2", "aten.mm.default")} <= paired
    # what is left unpaired is exactly the backward kernels MindSpore runs unobserved, and said so
    um = verdict.unmatched
    assert len(um) and um["explained"].str.startswith("not observable").all()
    assert any("not observable" in p for p in verdict.problems)


@pytest.mark.parametrize("planted, reference", [("torch_planted", "ms"), ("ms_planted", "torch")])
def test_planted_difference_is_the_first_divergence_with_its_scope(twin_runs, planted, reference):
    from dispatchprobe import compare
    _, verdict = compare(str(twin_runs / planted), str(twin_runs / reference))
    first = verdict.forward
    assert first is not None and first.scope == "TinyNet.act" and first.cause != "inputs", str(verdict)


def test_equal_ops_in_swapped_order_pair_by_statistics():
    """Two frameworks may run equal ops (same op, scope, shapes) in the other order: within such a
    run, records pair by their closest output statistics, not by position."""
    from dispatchprobe.offline.align import pair_runs_by_stats

    def rec(mean):
        return {"kind": "op", "stage": "backward", "scope": "Net.fc", "op": "aten.mul.Tensor",
                "outputs": [{"type": "tensor", "shape": [4], "stats": {"mean": mean, "norm": abs(mean) * 2}}]}
    a, b = [rec(1.0), rec(-5.0), rec(3.0)], [rec(-5.0), rec(1.0), rec(3.0)]
    pairs = pair_runs_by_stats([(0, 0, "op"), (1, 1, "op"), (2, 2, "op")], a, b)
    assert [(i, j) for i, j, _ in pairs] == [(0, 1), (1, 0), (2, 2)]


def test_loss_decomposed_differently_is_compared_at_its_boundary(tmp_path):
    """MindSpore's CrossEntropyLoss runs ~30 primitives where aten runs two: with module records
    (level mix) the loss cell is compared at its boundary, its inner ops are listed as such."""
    import torch
    from dispatchprobe import DispatchProbe as TorchProbe, compare

    class Train(nn.Cell):
        def __init__(self, net):
            super().__init__()
            self.net, self.loss = net, nn.CrossEntropyLoss()

        def construct(self, x, y):
            return self.loss(self.net(x), y)

    class TorchTrain(torch.nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net, self.loss = net, torch.nn.CrossEntropyLoss()

        def forward(self, x, y):
            return self.loss(self.net(x), y)
    TorchTrain.__name__ = "Train"                      # the same scopes on both sides

    ms.set_seed(0)
    ms_model = Train(TinyNet())
    torch_model = TorchTrain(torch_twin(ms_model.net))
    x, _ = batch(0)
    y = np.arange(8) % 8
    grad_fn = ms.value_and_grad(ms_model, None, ms_model.trainable_params())
    with DispatchProbe(task="statistics", dump_path=str(tmp_path / "ms"), model=ms_model, level="mix") as probe:
        grad_fn(x, ms.Tensor(y.astype(np.int32)))
    with pytest.warns(RuntimeWarning):
        probe.close()
    with TorchProbe(task="statistics", dump_path=str(tmp_path / "torch"), model=torch_model, level="mix") as probe:
        torch_model(torch.from_numpy(x.asnumpy()), torch.from_numpy(y).long()).backward()
    probe.close()
    table, verdict = compare(str(tmp_path / "ms"), str(tmp_path / "torch"))
    assert verdict.passed and verdict.forward is None and verdict.backward is None, str(verdict)
    loss = table[(table["kind"] == "module") & (table["scope"] == "Train.loss") & (table["stage"] == "forward")]
    assert set(loss["arg"]) >= {"input.0", "output.0"} and (loss["status"] == "pass").all()
    assert any("compared at their boundary" in p and "Train.loss (forward)" in p for p in verdict.problems)
    um = verdict.unmatched
    assert (um["explained"] != "").all(), um[um["explained"] == ""]
    assert (um[um["scope"] == "Train.loss"]["explained"].str.startswith("decomposed differently")).all()


def test_fix_mode_replaces_fp16_outputs_with_the_float32_results(tmp_path):
    """free_benchmark ``fix`` (improve_precision): fp16 outputs are the float32 re-run's, cast back:
    training goes on in fp16 and its values move (within fp16 rounding) from the unprobed run."""
    plain_losses, plain_params = train(dtype=ms.float16)
    probe = DispatchProbe(task="free_benchmark", dump_path=str(tmp_path), free_benchmark={"handler_type": "fix"})
    losses, params = train(probe, dtype=ms.float16)
    assert probe.summary()["checked"] > 0
    assert all(loss.dtype == np.float16 and np.isfinite(loss) for loss in losses)
    assert not all(np.array_equal(a, b) for a, b in zip(losses, plain_losses))
    assert all(np.allclose(a, b, rtol=1e-2) for a, b in zip(losses, plain_losses))
    assert all(params[k].dtype == np.float16 for k in params)


def test_demo_command_runs_the_mindspore_twin(tmp_path):
    from click.testing import CliRunner
    from dispatchprobe.cli import main
    res = CliRunner().invoke(main, ["demo", "--framework", "mindspore", "-o", str(tmp_path / "demo")])
    assert res.exit_code == 0, res.output
    assert "framework  mindspore" in res.output and "MatMul" in res.output
    assert "unseen     backward of TinyNet.norm: LayerNormGrad" in res.output
    shown = CliRunner().invoke(main, ["show", str(tmp_path / "demo")])
    assert shown.exit_code == 0 and "unseen     backward of TinyNet.norm" in shown.output


def test_run_ut_falls_back_to_the_mapped_torch_op_in_float64(ms_records, tmp_path, monkeypatch):
    """A primitive without a float64 kernel (planted: GeLU refuses float64) is judged against the
    torch op the translation maps it to, run in float64, and the row says so."""
    from mindspore import _c_expression
    from dispatchprobe.offline.run_ut import run_ut
    right = _c_expression.pyboost_gelu

    def no_float64(prim, args):
        if args[0].dtype == ms.float64:
            raise RuntimeError("Unsupported op [GeLU] on CPU, input dtype Float64")
        return right(prim, args)
    monkeypatch.setattr(_c_expression, "pyboost_gelu", no_float64)
    r = run_ut(str(ms_records / "fp32"), tmp_path / "ut").results
    gelu = r[r["Op"] == "GeLU"]
    assert len(gelu) == 1 and (status(gelu) == "pass").all()
    assert gelu["Message"].str.contains("the mapped torch op in float64").all()
    assert set(status(r)) == {"pass"}


def test_scope_and_list_filters_select_primitives(tmp_path):
    train(DispatchProbe(task="statistics", dump_path=str(tmp_path / "s"), scope=["TinyNet.fc1"]), steps=1)
    train(DispatchProbe(task="statistics", dump_path=str(tmp_path / "l"), list=["^GeLU"]), steps=1)
    assert {r["scope"] for r in ops_of(tmp_path / "s")} == {"TinyNet.fc1"}
    assert {r["op"] for r in ops_of(tmp_path / "l")} == {"GeLU", "GeLUGrad"}


def _bn_step(probe=None):
    """A training-mode BatchNorm1d (moving statistics updated in place) and an ``AssignAdd``."""
    ms.set_seed(0)
    net = nn.SequentialCell([nn.Dense(4, 3), nn.BatchNorm1d(3)])
    net.set_train(True)
    acc = ms.Parameter(ms.Tensor(np.full(3, 2.0, np.float32)), name="acc")
    x = ms.Tensor(np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32))
    if probe is not None:
        probe.scopes.model = net
    with probe if probe is not None else contextlib.nullcontext():
        y = net(x)
        ms.ops.AssignAdd()(acc, ms.Tensor(np.ones(3, np.float32)))
    if probe is not None:
        probe.close()
    bn = net[1]
    return y.asnumpy(), bn.moving_mean.asnumpy().copy(), bn.moving_variance.asnumpy().copy(), acc.asnumpy().copy()


@pytest.mark.parametrize("task", ["tensor", "free_benchmark"])
def test_written_inputs_are_recorded_as_the_primitive_received_them(tmp_path, task):
    """BatchNorm's moving statistics and AssignAdd's variable: recorded before the write, training
    unchanged (a free-benchmark re-run never writes them), replayed by run-ut from those values."""
    from dispatchprobe.offline.run_ut import run_ut
    got = _bn_step(DispatchProbe(task=task, dump_path=str(tmp_path / "r")))
    for a, b in zip(got, _bn_step()):
        assert np.array_equal(a, b)
    if task != "tensor":
        return
    run = load(tmp_path / "r")
    part = run.part(0, 0)
    bn = next(r for r in part.records if r["op"] == "BatchNorm")
    assert bn["scope"] == "SequentialCell.1"
    np.testing.assert_array_equal(np.asarray(part.tensor(bn["inputs"][3]["data"])), np.zeros(3))
    np.testing.assert_array_equal(np.asarray(part.tensor(bn["inputs"][4]["data"])), np.ones(3))
    add = next(r for r in part.records if r["op"] == "AssignAdd")
    np.testing.assert_array_equal(np.asarray(part.tensor(add["inputs"][0]["data"])), np.full(3, 2.0))
    r = run_ut(str(tmp_path / "r"), tmp_path / "ut").results
    st = status(r)
    assert "AssignAdd" in set(r[st == "pass"]["Op"]), r[["Op", "Message"]]
    # MindSpore 2.10's CPU has no float64 BatchNorm for the benchmark: said, not silently absent
    why = r[r["Op"] == "BatchNorm"]["Message"].iloc[0]
    assert st[r["Op"] == "BatchNorm"].iloc[0] == "SKIP" and "no float64 BatchNorm kernel" in why


class _DropoutNet(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc, self.drop, self.head = mint.nn.Linear(8, 16), nn.Dropout(p=0.5), mint.nn.Linear(16, 1)

    def construct(self, x):
        return self.head(self.drop(mint.tanh(self.fc(x)))).mean()


def _dropout_run(path, seed: int):
    """One recorded step of a net whose Dropout primitive draws its mask from ``seed`` (the seed its
    op is made with), the weights the same in every run."""
    ms.set_seed(seed)
    net = _DropoutNet()
    net.set_train()
    rng = np.random.default_rng(0)
    for p in net.trainable_params():
        p.set_data(ms.Tensor((rng.standard_normal(p.shape) * 0.3).astype(np.float32)))
    x = ms.Tensor(rng.standard_normal((4, 8)).astype(np.float32))
    grad_fn = ms.value_and_grad(net, None, net.trainable_params())
    probe = DispatchProbe(task="statistics", dump_path=str(path))
    with probe:
        grad_fn(x)
    probe.step()
    probe.close()
    return path


def test_a_dropout_drawing_other_masks_is_a_random_op_not_a_divergence(tmp_path):
    """MindSpore's random primitives are random ops to compare: two runs whose Dropout draws other
    masks first differ at a random op (no precision verdict, exit 1), whichever run is A; the
    backward is not judged."""
    from click.testing import CliRunner
    from dispatchprobe.cli import main
    a, b = _dropout_run(tmp_path / "a", 0), _dropout_run(tmp_path / "b", 1)
    for x, y in ((a, b), (b, a)):
        got = CliRunner().invoke(main, ["compare", str(x), str(y)])
        assert got.exit_code == 1, got.output
        assert "first forward difference, at a random op: Dropout" in got.output, got.output
        assert "first forward divergence" not in got.output and "backward: not judged" in got.output, got.output
