"""MindSpore against PyTorch on a conv net of the common layers (Conv2d, BatchNorm2d, MaxPool,
GELU, Linear), same weights: compared op by op in aten's vocabulary, not only at module
boundaries.  Runs where mindspore is installed, in blocking mode."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.mindspore      # run in MindSpore's own environment (ci/matrix.py)
os.environ.setdefault("MS_DEV_LAUNCH_BLOCKING", "1")
ms = pytest.importorskip("mindspore")
torch = pytest.importorskip("torch")

from mindspore import nn  # noqa: E402

from dispatchprobe import DispatchProbe as TorchProbe, compare, load  # noqa: E402
from dispatchprobe_ms import DispatchProbe  # noqa: E402

ms.set_context(mode=ms.PYNATIVE_MODE)


class ConvNet(nn.Cell):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, pad_mode="pad", padding=1, has_bias=True)
        self.bn = nn.BatchNorm2d(8, momentum=0.9)          # MindSpore's momentum is torch's 1 - momentum
        self.pool = nn.MaxPool2d(2, 2)
        self.act = nn.GELU()
        self.fc = nn.Dense(8 * 4 * 4, 5)

    def construct(self, x):
        h = self.act(self.pool(self.bn(self.conv(x))))
        return self.fc(h.reshape(h.shape[0], -1))


class WrongGELU(nn.GELU):
    def construct(self, x):
        return super().construct(x) * 1.001


def torch_twin(ms_net):
    class ConvNet(torch.nn.Module):          # the same class and attribute names: the same scopes
        def __init__(self):
            super().__init__()
            self.conv, self.bn = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
            self.pool, self.act, self.fc = torch.nn.MaxPool2d(2, 2), torch.nn.GELU(), torch.nn.Linear(8 * 4 * 4, 5)

        def forward(self, x):
            h = self.act(self.pool(self.bn(self.conv(x))))
            return self.fc(h.reshape(h.shape[0], -1))
    net = ConvNet()
    names = {"bn.weight": "bn.gamma", "bn.bias": "bn.beta", "bn.running_mean": "bn.moving_mean",
             "bn.running_var": "bn.moving_variance"}
    weights = {n: p.asnumpy().copy() for n, p in ms_net.parameters_and_names()}
    with torch.no_grad():
        for n, p in list(net.named_parameters()) + list(net.named_buffers()):
            if names.get(n, n) in weights:
                p.copy_(torch.from_numpy(weights[names.get(n, n)]))
    return net


def _data():
    rng = np.random.RandomState(0)
    return rng.randn(4, 3, 8, 8).astype(np.float32), rng.randn(4, 5).astype(np.float32)


def record_ms(net, path, level="op"):
    x, y = _data()
    net.set_train(True)
    grad_fn = ms.value_and_grad(lambda x, y: ((net(x) - y) ** 2).mean(), None, net.trainable_params())
    with DispatchProbe(task="tensor", dump_path=str(path), model=net, level=level) as probe:
        grad_fn(ms.Tensor(x), ms.Tensor(y))
    with pytest.warns(RuntimeWarning, match="not .fully. recorded"):
        probe.close()


def record_torch(net, path, level="op"):
    x, y = (torch.from_numpy(t) for t in _data())
    with TorchProbe(task="tensor", dump_path=str(path), model=net, level=level) as probe:
        ((net(x) - y) ** 2).mean().backward()
    probe.close()


@pytest.fixture(scope="module")
def conv_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("conv_twin")
    ms.set_seed(0)
    net = ConvNet()
    twins = [torch_twin(net) for _ in range(2)]       # before the MindSpore step moves the statistics
    record_ms(net, root / "ms")
    record_torch(twins[0], root / "torch")
    ms.set_seed(0)
    net = ConvNet()
    record_ms(net, root / "ms_mix", level="mix")
    record_torch(twins[1], root / "torch_mix", level="mix")
    ms.set_seed(0)
    wrong = ConvNet()
    wrong.act = WrongGELU()
    record_ms(wrong, root / "ms_planted")
    return root


@pytest.mark.parametrize("order", ["ms-torch", "torch-ms"])
def test_conv_twin_compares_clean_op_by_op(conv_runs, order):
    a, b = ("ms", "torch") if order == "ms-torch" else ("torch", "ms")
    table, verdict = compare(str(conv_runs / a), str(conv_runs / b))
    assert verdict.passed and verdict.forward is None and verdict.backward is None, str(verdict)
    assert (table["status"] == "pass").all()
    ms_side = "a" if a == "ms" else "b"
    share = verdict.pairing.share(ms_side)             # what compare prints: measured 1.0 (16 of 16)
    assert share >= 0.9, str(verdict)
    line = next(x for x in str(verdict).splitlines() if x.startswith("forward records paired op by op"))
    assert f"{ms_side.upper()} (mindspore) 9/9" in line, line
    aten = table[f"op_{'b' if ms_side == 'a' else 'a'}"]
    paired = set(zip(table["stage"], table["scope"], aten, table["arg"]))
    assert {("forward", "ConvNet.conv", "aten.convolution.default", "input.2"),        # the bias, in the region
            ("forward", "ConvNet.bn", "aten.native_batch_norm.default", "output.1"),   # the batch mean
            ("forward", "ConvNet.bn", "aten.native_batch_norm.default", "input.3"),    # the running mean
            ("forward", "ConvNet.pool", "aten.max_pool2d_with_indices.default", "output.0"),
            ("forward", "ConvNet.fc", "aten.addmm.default", "output.0"),
            ("backward", "ConvNet.act", "aten.gelu_backward.default", "output.0"),
            ("backward", "ConvNet.fc", "aten.mm.default", "output.0")} <= paired
    # the rest is said: kernels MindSpore runs unobserved, and BatchNorm's step counter
    um = verdict.unmatched
    assert (um["explained"] != "").all(), um[um["explained"] == ""]
    counter = um[um["op"] == "aten.add_.Tensor"]
    assert len(counter) == 1 and counter["explained"].str.contains("num_batches_tracked").all()


def test_conv_twin_at_level_mix_keeps_every_layer_op_by_op(conv_runs):
    """With module records, no layer of the twin counts as "decomposed differently" (torch's
    ``num_batches_tracked`` counter and unobserved backward kernels are not decompositions)."""
    table, verdict = compare(str(conv_runs / "ms_mix"), str(conv_runs / "torch_mix"))
    assert verdict.passed, str(verdict)
    assert not any("compared at their boundary" in p for p in verdict.problems), verdict.problems
    assert verdict.pairing.share("a") >= 0.9, str(verdict)


def test_planted_change_in_one_layer_is_named(conv_runs):
    _, verdict = compare(str(conv_runs / "ms_planted"), str(conv_runs / "torch"))
    first = verdict.forward
    assert not verdict.passed and first is not None, str(verdict)
    assert first.scope == "ConvNet.act" and first.cause != "inputs", str(verdict)


class Layers(nn.Cell):
    """More of the common layers: Conv1d, BatchNorm1d, ReLU, AvgPool2d, AdaptiveAvgPool2d, LayerNorm,
    SiLU, Tanh, Sigmoid, Dense."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv1d(3, 8, 3, pad_mode="pad", padding=1, has_bias=True), \
            nn.BatchNorm1d(8, momentum=0.9), nn.ReLU()
        self.pool, self.apool = nn.AvgPool2d(2, 2), nn.AdaptiveAvgPool2d((2, 2))
        self.norm, self.silu, self.tanh, self.sig = nn.LayerNorm((8,)), nn.SiLU(), nn.Tanh(), nn.Sigmoid()
        self.fc = nn.Dense(32, 5)

    def construct(self, x):
        h = self.act(self.bn(self.conv(x))).reshape(x.shape[0], 8, 4, 4)
        h = (self.pool(h) + self.apool(h)).transpose(0, 2, 3, 1)
        return self.fc(self.sig(self.tanh(self.silu(self.norm(h)))).reshape(x.shape[0], -1))


def torch_layers(ms_net):
    class Layers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.act = torch.nn.Conv1d(3, 8, 3, padding=1), torch.nn.BatchNorm1d(8), torch.nn.ReLU()
            self.pool, self.apool = torch.nn.AvgPool2d(2, 2), torch.nn.AdaptiveAvgPool2d((2, 2))
            self.norm = torch.nn.LayerNorm(8, eps=1e-7)        # MindSpore's default epsilon
            self.silu, self.tanh, self.sig, self.fc = torch.nn.SiLU(), torch.nn.Tanh(), torch.nn.Sigmoid(), \
                torch.nn.Linear(32, 5)

        def forward(self, x):
            h = self.act(self.bn(self.conv(x))).reshape(x.shape[0], 8, 4, 4)
            h = (self.pool(h) + self.apool(h)).permute(0, 2, 3, 1)
            return self.fc(self.sig(self.tanh(self.silu(self.norm(h)))).reshape(x.shape[0], -1))
    net = Layers()
    names = {"bn.weight": "bn.gamma", "bn.bias": "bn.beta", "bn.running_mean": "bn.moving_mean",
             "bn.running_var": "bn.moving_variance", "norm.weight": "norm.gamma", "norm.bias": "norm.beta"}
    weights = {n: p.asnumpy() for n, p in ms_net.parameters_and_names()}
    with torch.no_grad():
        for n, p in list(net.named_parameters()) + list(net.named_buffers()):
            if names.get(n, n) in weights:
                p.copy_(torch.from_numpy(weights[names.get(n, n)].copy()).reshape(p.shape))
    return net


def test_more_layers_pair_op_by_op(tmp_path):
    ms.set_seed(0)
    net = Layers()
    twin = torch_layers(net)
    x = np.random.RandomState(3).randn(4, 3, 16).astype(np.float32)
    net.set_train(True)
    grad_fn = ms.value_and_grad(lambda x: (net(x) ** 2).mean(), None, net.trainable_params())
    with DispatchProbe(task="tensor", dump_path=str(tmp_path / "ms"), model=net) as probe:
        grad_fn(ms.Tensor(x))
    with pytest.warns(RuntimeWarning, match="not .fully. recorded"):
        probe.close()
    with TorchProbe(task="tensor", dump_path=str(tmp_path / "torch"), model=twin) as probe:
        (twin(torch.from_numpy(x)) ** 2).mean().backward()
    probe.close()
    table, verdict = compare(str(tmp_path / "ms"), str(tmp_path / "torch"))
    assert verdict.passed and verdict.forward is None and verdict.backward is None, str(verdict)
    assert verdict.pairing.share("a") == 1.0, str(verdict)
    assert {"aten.convolution.default", "aten.native_batch_norm.default", "aten.relu.default", "aten.avg_pool2d.default",
            "aten._adaptive_avg_pool2d.default", "aten.native_layer_norm.default", "aten.silu.default",
            "aten.tanh.default", "aten.sigmoid.default", "aten.addmm.default"} <= set(table["op_b"])
    um = verdict.unmatched
    assert (um["explained"] != "").all(), um[um["explained"] == ""]       # unobservable kernels, the BN counter


# ---- a loss as a Cell (MindSpore) against a loss as a function at top level (PyTorch) -----------
class LossNet(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Dense(16, 32), nn.GELU(), nn.Dense(32, 8)
        self.loss = nn.CrossEntropyLoss()

    def construct(self, x, y):
        return self.loss(self.fc2(self.act(self.fc1(x))), y)


def torch_loss_twin(ms_net):
    class LossNet(torch.nn.Module):          # no loss module: F.cross_entropy at top level
        def __init__(self):
            super().__init__()
            self.fc1, self.act, self.fc2 = torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)

        def forward(self, x):
            return self.fc2(self.act(self.fc1(x)))
    net, weights = LossNet(), {n: p.asnumpy().copy() for n, p in ms_net.parameters_and_names()}
    with torch.no_grad():
        for n, p in net.named_parameters():
            p.copy_(torch.from_numpy(weights[n]))
    return net


@pytest.fixture(scope="module")
def loss_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("loss_twin")
    x = np.random.RandomState(1).randn(8, 16).astype(np.float32)
    y = np.arange(8) % 8
    for name, planted in (("ms", None), ("ms_planted", "act"), ("ms_smoothed", "loss")):
        ms.set_seed(0)
        net = LossNet()
        if planted == "act":
            net.act = WrongGELU()
        elif planted == "loss":     # inside the loss region: label smoothing the other run lacks
            net.loss = nn.CrossEntropyLoss(label_smoothing=0.2)
        else:
            twin = torch_loss_twin(net)
        grad_fn = ms.value_and_grad(net, None, net.trainable_params())
        with DispatchProbe(task="tensor", dump_path=str(root / name), model=net) as probe:
            grad_fn(ms.Tensor(x), ms.Tensor(y.astype(np.int32)))
        with pytest.warns(RuntimeWarning, match="not .fully. recorded"):
            probe.close()
    with TorchProbe(task="tensor", dump_path=str(root / "torch"), model=twin) as probe:
        torch.nn.functional.cross_entropy(twin(torch.from_numpy(x)), torch.from_numpy(y).long()).backward()
    probe.close()
    return root


@pytest.mark.parametrize("order", ["ms-torch", "torch-ms"])
def test_loss_cell_against_loss_function_compares_at_the_region_boundary(loss_runs, order):
    a, b = ("ms", "torch") if order == "ms-torch" else ("torch", "ms")
    table, verdict = compare(str(loss_runs / a), str(loss_runs / b))
    assert verdict.passed and verdict.forward is None and verdict.backward is None, str(verdict)
    region = table[table["match"] == "region boundary"]
    aten = " ".join(set(region["op_b" if a == "ms" else "op_a"]))     # region(2 ops: first .. last)
    # the loss value and the logits' gradient: MindSpore's CrossEntropyLoss cell against aten's ops
    assert "aten.nll_loss_forward.default" in aten and "aten._log_softmax_backward_data.default" in aten, aten
    assert (region["status"] == "pass").all() and set(region["scope"]) == ({"LossNet.loss"} if a == "ms" else {""})
    fwd = region[region["stage"] == "forward"].set_index("arg")          # the loss's inputs too: logits, labels
    assert fwd.loc["input.0", "shape_a"] == (8, 8) and fwd.loc["input.1", "dtype_a"].startswith("int"), fwd
    um = verdict.unmatched
    assert (um["explained"] != "").all(), um[um["explained"] == ""]
    assert um["explained"].str.contains(r"inside a region compared at its boundary \(LossNet.loss\)").sum() > 20
    share = verdict.pairing.frame().set_index(["framework", "stage"])     # what compare prints
    assert share.loc[("mindspore", "forward"), "at_boundary"] > 20, str(verdict)
    assert share.loc[("torch", "forward"), "at_boundary"] >= 1 and share["unpaired"].sum() == share["unpaired_explained"].sum()


def test_planted_change_is_named_beside_a_loss_compared_at_its_boundary(loss_runs):
    _, verdict = compare(str(loss_runs / "ms_planted"), str(loss_runs / "torch"))
    first = verdict.forward
    assert not verdict.passed and first is not None and first.scope == "LossNet.act", str(verdict)


# ---- an attention block: MindSpore's matmuls and softmax against torch's, and against SDPA --------
D, HEADS = 16, 2


CAUSAL = np.triu(np.full((4, 4), -1e9, np.float32), 1)      # an additive mask (sequence length 4)


class Attention(nn.Cell):
    def __init__(self, masked=False):
        super().__init__()
        self.q, self.k, self.v, self.o = nn.Dense(D, D), nn.Dense(D, D), nn.Dense(D, D), nn.Dense(D, D)
        self.act = nn.GELU(approximate=False)          # Sqrt/Div/Erf/... primitives: aten.gelu as a region
        self.mask = ms.Tensor(CAUSAL) if masked else None

    def construct(self, x):
        b, s, d = x.shape
        q, k, v = (m(x).reshape(b, s, HEADS, D // HEADS).transpose(0, 2, 1, 3) for m in (self.q, self.k, self.v))
        scores = ms.ops.matmul(q, k.transpose(0, 1, 3, 2)) * (D // HEADS) ** -0.5
        p = ms.ops.softmax(scores if self.mask is None else scores + self.mask, axis=-1)
        return self.act(self.o(ms.ops.matmul(p, v).transpose(0, 2, 1, 3).reshape(b, s, d)))


class WrongDense(nn.Dense):
    def construct(self, x):
        return super().construct(x) * 1.001


def torch_attention(ms_net, sdpa, masked=False):
    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (torch.nn.Linear(D, D) for _ in range(4))
            self.act = torch.nn.GELU()

        def forward(self, x):
            b, n, d = x.shape
            q, k, v = (m(x).view(b, n, HEADS, D // HEADS).transpose(1, 2) for m in (self.q, self.k, self.v))
            if sdpa:
                mask = torch.from_numpy(CAUSAL) if masked else None
                o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            else:
                o = torch.softmax(q @ k.transpose(-2, -1) * (D // HEADS) ** -0.5, dim=-1) @ v
            return self.act(self.o(o.transpose(1, 2).reshape(b, n, d)))
    net, weights = Attention(), {n: p.asnumpy().copy() for n, p in ms_net.parameters_and_names()}
    with torch.no_grad():
        for n, p in net.named_parameters():
            p.copy_(torch.from_numpy(weights[n]))
    return net


@pytest.fixture(scope="module")
def attention_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("attention_twin")
    x = np.random.RandomState(2).randn(2, 4, D).astype(np.float32)
    for name, planted in (("ms", False), ("ms_planted", True), ("ms_masked", False)):
        ms.set_seed(0)
        net = Attention(masked=name == "ms_masked")
        if name == "ms_masked":
            twins.append(torch_attention(net, sdpa=True, masked=True))
        elif planted:     # the same weights, the v projection's output x 1.001
            wrong = WrongDense(D, D)
            wrong.weight.set_data(ms.Tensor(net.v.weight.asnumpy().copy()))
            wrong.bias.set_data(ms.Tensor(net.v.bias.asnumpy().copy()))
            net.v = wrong
        else:
            twins = [torch_attention(net, sdpa) for sdpa in (False, True, False)]
        grad_fn = ms.value_and_grad(lambda x, net=net: (net(x) ** 2).mean(), None, net.trainable_params())
        with DispatchProbe(task="tensor", dump_path=str(root / name), model=net) as probe:
            grad_fn(ms.Tensor(x))
        with pytest.warns(RuntimeWarning, match="not .fully. recorded"):     # SoftmaxBackward, BiasAddGrad
            probe.close()
    twins[2].k.register_forward_hook(lambda m, i, out: out * 1.001)     # planted in the PyTorch run
    for name, twin in zip(("torch", "torch_sdpa", "torch_planted", "torch_sdpa_masked"), twins):
        with TorchProbe(task="tensor", dump_path=str(root / name), model=twin) as probe:
            (twin(torch.from_numpy(x)) ** 2).mean().backward()
        probe.close()
    return root


@pytest.mark.parametrize("order", ["ms-torch", "torch-ms"])
def test_attention_twin_compares_clean_op_by_op(attention_runs, order):
    a, b = ("ms", "torch") if order == "ms-torch" else ("torch", "ms")
    table, verdict = compare(str(attention_runs / a), str(attention_runs / b))
    assert verdict.passed and verdict.forward is None and verdict.backward is None, str(verdict)
    ms_side = "a" if a == "ms" else "b"
    assert verdict.pairing.share(ms_side) == 1.0, str(verdict)     # every MindSpore record, op by op
    aten = table[f"op_{'b' if ms_side == 'a' else 'a'}"]
    paired = set(zip(table["stage"], table["scope"], aten, table["arg"]))
    assert {("forward", "Attention", "aten.bmm.default", "input.1"),           # k transposed, both runs
            ("forward", "Attention", "aten._softmax.default", "output.0"),
            ("forward", "Attention.act", "aten.gelu.default", "output.0"),     # the exact GELU's region
            ("backward", "Attention.act", "aten.gelu_backward.default", "input.0"),
            ("backward", "Attention.act", "aten.gelu_backward.default", "output.0")} <= paired
    assert (table.loc[aten == "aten.bmm.default", "stage"] == "backward").sum() == 4 * 3   # 4 matmuls' grads
    um = verdict.unmatched
    assert (um["explained"] != "").all(), um[um["explained"] == ""]


def test_attention_against_sdpa_compares_at_the_kernel_boundary(attention_runs):
    table, verdict = compare(str(attention_runs / "ms"), str(attention_runs / "torch_sdpa"))
    assert verdict.passed and verdict.forward is None and verdict.backward is None, str(verdict)
    sdpa = table[table["op_b"].str.startswith("aten._scaled_dot_product_flash_attention_for_cpu")]
    assert set(zip(sdpa["stage"], sdpa["arg"])) == {
        ("forward", "input.0"), ("forward", "input.2"), ("forward", "output.0"),          # q, v, the output
        ("backward", "input.0"), ("backward", "input.2"), ("backward", "output.0"), ("backward", "output.2")}
    assert (sdpa["status"] == "pass").all()
    share = verdict.pairing.frame().set_index(["framework", "stage"])
    assert share.loc[("mindspore", "forward"), "at_boundary"] == 4                 # bmm, mul, softmax, bmm
    assert share.loc[("torch", "forward"), "at_boundary"] == 1
    assert share.loc[("mindspore", "forward"), "op_by_op"] == 8                   # the projections, GELU, loss
    assert "only at a region/module boundary: A 4, B 1" in str(verdict)
    # the values SDPA reads are transposed views of the projections' outputs: still traced to them
    assert verdict.departure is None or verdict.departure.cause != "inputs", str(verdict)


def test_masked_attention_against_sdpa_with_a_mask(attention_runs):
    """An additive mask (``scores + mask`` against SDPA's ``attn_mask``): the region has one op more."""
    _, verdict = compare(str(attention_runs / "ms_masked"), str(attention_runs / "torch_sdpa_masked"))
    assert verdict.passed and verdict.forward is None and verdict.backward is None, str(verdict)
    share = verdict.pairing.frame().set_index(["framework", "stage"])
    assert share.loc[("mindspore", "forward"), "at_boundary"] == 5 and share["unpaired"].sum() == \
        share["unpaired_explained"].sum(), str(verdict)


@pytest.mark.parametrize("planted", ["ms_planted", "torch_planted"])
def test_planted_change_in_a_projection_is_named_there(attention_runs, planted):
    other = "torch" if planted == "ms_planted" else "ms"
    _, verdict = compare(str(attention_runs / planted), str(attention_runs / other))
    where = f"Attention.{'v' if planted == 'ms_planted' else 'k'}"
    assert verdict.forward is not None and verdict.forward.scope == where, str(verdict)
    # backward: the planted scaling's gradient where the gradients it scales still pass (k); where they
    # already fail by more than it adds (v, after the attention's backward), the errors follow from the
    # forward's.  Either way, not the matmul whose transposed operands the translation does not compare
    d = verdict.backward
    if planted == "torch_planted":
        assert d is not None and (d.scope, d.cause) == (where, "unmatched"), str(verdict)
    else:
        assert d is not None and d.cause == "inherited", str(verdict)


def test_change_inside_a_loss_region_is_named_at_the_region(loss_runs):
    """The region's inputs (logits, labels) agree and its result does not: the loss region itself."""
    table, verdict = compare(str(loss_runs / "ms_smoothed"), str(loss_runs / "torch"))
    first = verdict.forward
    assert first is not None and first.scope == "LossNet.loss" and first.cause == "op", str(verdict)
    entering = table[(table["match"] == "region boundary") & (table["stage"] == "forward") & (table["io"] == "input")]
    assert len(entering) == 2 and (entering["status"] == "pass").all()


# ---- a loss outside every module: MindSpore's loss cell outside `model=`, F.cross_entropy at top level --
class SmallNet(nn.Cell):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, pad_mode="pad", padding=1, has_bias=True)
        self.act, self.fc = nn.ReLU(), nn.Dense(4 * 4 * 4, 5)

    def construct(self, x):
        h = self.act(self.conv(x))
        return self.fc(h.reshape(h.shape[0], -1))


def torch_small(ms_net):
    return torch_small_from({n: p.asnumpy().copy() for n, p in ms_net.parameters_and_names()})


def torch_small_from(weights: dict):
    """The PyTorch twin of :class:`SmallNet` (the same class and attribute names) with MindSpore's
    ``weights`` ({parameter name: array})."""
    class SmallNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.act, self.fc = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Linear(64, 5)

        def forward(self, x):
            h = self.act(self.conv(x))
            return self.fc(h.reshape(h.shape[0], -1))
    net = SmallNet()
    with torch.no_grad():
        for n, p in net.named_parameters():
            p.copy_(torch.from_numpy(weights[n]))
    return net


@pytest.fixture(scope="module")
def outside_runs(tmp_path_factory):
    """One step each; the loss is no module of the probed model in either run (its ops have no scope).
    Plants (x1.01): MindSpore's conv or dense layer's output (a forward hook; the conv's also with
    module records, level "mix"), and the logits inside each run's loss function."""
    root = tmp_path_factory.mktemp("outside_loss")
    rng = np.random.RandomState(0)
    x, y = rng.randn(4, 3, 4, 4).astype(np.float32), np.arange(4) % 5
    for name in ("ms", "ms_conv", "ms_fc", "ms_loss", "ms_conv_mix"):
        ms.set_seed(0)
        net = SmallNet()
        if name == "ms":
            twin = torch_small(net)
        if name.startswith(("ms_conv", "ms_fc")):      # the last layer's output: beside the loss region
            getattr(net, name.split("_")[1]).register_forward_hook(lambda cell, inputs, out: out * 1.01)
        ce = nn.CrossEntropyLoss()          # called outside `model=`: not probed as a cell
        loss = (lambda logits, labels: ce(logits * 1.01, labels)) if name == "ms_loss" else ce
        grad_fn = ms.value_and_grad(lambda x, y: loss(net(x), y), None, net.trainable_params())
        level = "mix" if name.endswith("_mix") else "op"
        with DispatchProbe(task="tensor", dump_path=str(root / name), model=net, level=level) as probe:
            grad_fn(ms.Tensor(x), ms.Tensor(y.astype(np.int32)))
        with pytest.warns(RuntimeWarning, match="not .fully. recorded"):
            probe.close()
    for name in ("torch", "torch_loss", "torch_mix"):
        level = "mix" if name.endswith("_mix") else "op"
        with TorchProbe(task="tensor", dump_path=str(root / name), model=twin, level=level) as probe:
            logits = twin(torch.from_numpy(x))
            torch.nn.functional.cross_entropy(logits * 1.01 if name == "torch_loss" else logits,
                                              torch.from_numpy(y).long()).backward()
        probe.close()
        twin.zero_grad()
    return root


@pytest.mark.parametrize("order", ["ms-torch", "torch-ms"])
def test_loss_outside_every_module_compares_as_a_region(outside_runs, order):
    """~30 MindSpore primitives at top level against _log_softmax + nll_loss_forward at top level:
    one region each way, compared by the values entering it and leaving it (was: a subtraction
    paired with the log-softmax by shape, 'first forward divergence: aten.sub.Tensor', exit 2)."""
    a, b = ("ms", "torch") if order == "ms-torch" else ("torch", "ms")
    table, verdict = compare(str(outside_runs / a), str(outside_runs / b))
    assert verdict.passed and verdict.forward is None and verdict.backward is None, str(verdict)
    region = table[table["match"] == "region boundary"]
    torch_op = region["op_a" if a == "torch" else "op_b"]
    assert set(region["stage"]) == {"forward", "backward"} and (region["status"] == "pass").all(), region
    assert torch_op.str.contains("nll_loss_forward").any() and torch_op.str.contains("_log_softmax_backward").any()
    fwd = region[region["stage"] == "forward"].set_index("arg")    # the logits and labels entering, the loss leaving
    assert fwd.loc["input.0", "shape_a"] == (4, 5) and fwd.loc["input.1", "dtype_a"].startswith("int"), fwd
    assert fwd.loc["output.0", "shape_a"] == (), fwd
    um = verdict.unmatched
    assert (um["explained"] != "").all(), um[um["explained"] == ""]
    assert um["explained"].str.contains(r"inside a region compared at its boundary \(<top>\)").sum() > 20
    share = verdict.pairing.frame().set_index(["framework", "stage"])
    assert share["unpaired"].sum() == share["unpaired_explained"].sum(), str(verdict)
    assert share.loc[("mindspore", "forward"), "at_boundary"] > 20, str(verdict)


@pytest.mark.parametrize("planted", ["ms_loss", "torch_loss"])
@pytest.mark.parametrize("planted_is_a", [True, False])
def test_change_inside_a_loss_outside_every_module_is_named_at_its_region(outside_runs, planted, planted_is_a):
    """The logits scaled inside one run's loss: the values entering the region agree, the loss
    leaving it does not (by 6e-4, a departure within tolerance; the gradients then fail)."""
    other = "torch" if planted.startswith("ms") else "ms"
    a, b = (planted, other) if planted_is_a else (other, planted)
    _, verdict = compare(str(outside_runs / a), str(outside_runs / b))
    first = verdict.forward or next((d for d in verdict.departures if d.stage == "forward"), None)
    assert first is not None and first.cause == "op" and first.op.startswith("region(") and first.scope == "", \
        str(verdict)
    assert ("nll_loss_forward" in first.op) == a.startswith("torch"), str(verdict)     # run A's region
    assert verdict.backward is not None and verdict.backward.cause in ("op", "inherited"), str(verdict)
    assert verdict.backward.cause == "inherited" or verdict.backward.op.startswith("region("), str(verdict)


@pytest.mark.parametrize("layer", ["conv", "fc", "conv_mix"])
@pytest.mark.parametrize("planted_is_a", [True, False])
def test_change_on_a_layer_output_beside_a_loss_region_is_named_at_the_layer(outside_runs, layer, planted_is_a):
    """A forward hook's x1.01 on MindSpore's conv output (was: the loss's ops unpaired, the backward
    named at one of them; with module records the conv counted as 'decomposed differently' and the
    runs as 'differing already at their inputs' at the relu), and on the dense layer's, right before
    the loss region: the hook's mul stays with its layer, not inside the region."""
    clean = "torch_mix" if layer.endswith("_mix") else "torch"
    a, b = (f"ms_{layer}", clean) if planted_is_a else (clean, f"ms_{layer}")
    _, verdict = compare(str(outside_runs / a), str(outside_runs / b))
    first = verdict.forward
    where = f"SmallNet.{layer.split('_')[0]}"
    assert first is not None and (first.scope, first.op, first.cause) == (where, "aten.mul.Tensor", "unmatched"), \
        str(verdict)
    assert first.side == ("a" if planted_is_a else "b"), str(verdict)
    assert verdict.backward is None or verdict.backward.cause == "inherited", str(verdict)


@pytest.mark.parametrize("run", ["ms", "ms_loss", "ms_fc"])
def test_regions_are_the_same_whichever_run_is_a(outside_runs, run):
    """Aligning B with A forms A-with-B's pairs, regions and unpaired records, mirrored."""
    from dispatchprobe.offline.align import align
    from dispatchprobe.offline.translate import Translation
    shipped = Translation.shipped("mindspore")
    recs_ms = shipped.records(next(iter(load(str(outside_runs / run)).parts.values())).records)
    recs_t = shipped.aten_side(next(iter(load(str(outside_runs / "torch")).parts.values())).records)
    one, other = align(recs_ms, recs_t, by_stats=True), align(recs_t, recs_ms, by_stats=True)
    assert sorted(one.pairs) == sorted((i, j, how) for j, i, how in other.pairs)
    assert {k: r["op"] for k, r in one.regions.items()} == \
        {({"a": "b", "b": "a"}[s], i): r["op"] for (s, i), r in other.regions.items()}
    assert (one.only_a, one.only_b) == (other.only_b, other.only_a)
    assert sum(how == "region boundary" for *_, how in one.pairs) == 2      # the loss, forward and backward


# ---- training steps with the optimizer inside the probe: MindSpore's Adam primitive per parameter
# against PyTorch's Adam ops, both at top level after the backward, the loss before it --------------
def adam_batches() -> list:
    rng = np.random.RandomState(0)
    return [(rng.randn(4, 3, 4, 4).astype(np.float32), rng.randint(0, 5, 4)) for _ in range(2)]


def record_adam_steps(root: str) -> None:
    """The MindSpore runs of :func:`optimizer_runs` under ``root`` (``ms``, ``ms_fc``) and the initial
    weights (``initial.npz``): run in a process of its own, as MindSpore records ``nn.Adam``'s update
    graph only where the dump config was set before the process's first compile."""
    for name in ("ms", "ms_fc"):
        ms.set_seed(0)
        net = SmallNet()
        if name == "ms":
            np.savez(os.path.join(root, "initial.npz"), **{n: p.asnumpy() for n, p in net.parameters_and_names()})
        else:
            net.fc.register_forward_hook(lambda cell, inputs, out: out * 1.01)
        ce, opt = nn.CrossEntropyLoss(), nn.Adam(net.trainable_params(), learning_rate=1e-2)
        grad_fn = ms.value_and_grad(lambda x, y: ce(net(x), y), None, net.trainable_params())
        probe = DispatchProbe(task="statistics", dump_path=os.path.join(root, name), model=net)
        for x, y in adam_batches():
            with probe:
                _, grads = grad_fn(ms.Tensor(x), ms.Tensor(y.astype(np.int32)))
                opt(grads)
            probe.step()
        probe.close()


@pytest.fixture(scope="module")
def optimizer_runs(tmp_path_factory):
    """Two Adam steps of :class:`SmallNet` each, the loss outside the model, ``opt.step()`` inside
    ``with probe:`` (statistics task).  Planted: MindSpore's dense output x1.01 (a forward hook).
    MindSpore's runs are made in a fresh process: in this one an earlier test may have compiled a
    graph (an optimizer step) before any probe set the dump config, which MindSpore reads once."""
    root = tmp_path_factory.mktemp("optimizer_inside")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MINDSPORE_DUMP_CONFIG", None)        # this process's probes' dump config, not the child's
    script = "import sys; from tests.test_cross_framework import record_adam_steps; record_adam_steps(sys.argv[1])"
    res = subprocess.run([sys.executable, "-c", script, str(root)], capture_output=True, text=True, env=env,
                         cwd=repo, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "not (fully) recorded" in res.stderr and "are not recorded in this process" not in res.stderr, res.stderr
    twin = torch_small_from(dict(np.load(root / "initial.npz")))
    opt = torch.optim.Adam(twin.parameters(), lr=1e-2, foreach=False)
    probe = TorchProbe(task="statistics", dump_path=str(root / "torch"), model=twin)
    for x, y in adam_batches():
        with probe:
            torch.nn.functional.cross_entropy(twin(torch.from_numpy(x)), torch.from_numpy(y).long()).backward()
            opt.step()
            opt.zero_grad()
        probe.step()
    probe.close()
    return root


@pytest.mark.parametrize("order", ["ms-torch", "torch-ms"])
def test_optimizer_inside_the_probe_is_a_region_of_its_own(optimizer_runs, order):
    """The loss (before the backward) and the optimizer step (after it) are two regions, never one,
    and the step's scalars pair with none (was: one region swallowing the loss, 'the runs do not
    align', exit 1; then MindSpore's beta power 0.999 paired with a PyTorch step count 1.0 and named
    as the first forward divergence)."""
    a, b = ("ms", "torch") if order == "ms-torch" else ("torch", "ms")
    table, verdict = compare(str(optimizer_runs / a), str(optimizer_runs / b))
    assert verdict.passed and verdict.forward is None and verdict.backward is None, str(verdict)
    region = table[(table["match"] == "region boundary") & (table["stage"] == "forward")]
    torch_op, ms_op = (region["op_a"], region["op_b"]) if a == "torch" else (region["op_b"], region["op_a"])
    assert torch_op.str.contains("nll_loss_forward").any(), region[["step", "op_a", "op_b"]]
    optimizer = region[ms_op.str.endswith("Adam)")]
    assert set(optimizer["step"]) == {0, 1} and (optimizer["status"] == "pass").all(), optimizer
    assert (optimizer["shape_a"] != ()).all()      # the parameters and gradients, no state scalar


@pytest.mark.parametrize("planted_is_a", [True, False])
def test_change_beside_an_optimizer_inside_the_probe_is_named(optimizer_runs, planted_is_a):
    a, b = ("ms_fc", "torch") if planted_is_a else ("torch", "ms_fc")
    _, verdict = compare(str(optimizer_runs / a), str(optimizer_runs / b))
    first = verdict.forward
    assert first is not None and (first.scope, first.op, first.cause) == ("SmallNet.fc", "aten.mul.Tensor", "unmatched"), \
        str(verdict)
    assert first.side == ("a" if planted_is_a else "b") and first.step == 0, str(verdict)


# ---- dropout: MindSpore's Dropout primitive against PyTorch's bernoulli_ + div + mul ------------------
@pytest.fixture(scope="module")
def dropout_runs(tmp_path_factory):
    """One step of :class:`SmallNet` with dropout (p 0.1) on the flattened activations in each run."""
    root = tmp_path_factory.mktemp("dropout")
    rng = np.random.RandomState(0)
    x, y = rng.randn(4, 3, 4, 4).astype(np.float32), np.arange(4) % 5
    ms.set_seed(0)
    net = SmallNet()
    twin = torch_small(net)
    ce = nn.CrossEntropyLoss()

    def ms_forward(x, y):
        h = net.act(net.conv(x))
        return ce(net.fc(ms.ops.dropout(h.reshape(h.shape[0], -1), p=0.1, training=True)), y)
    grad_fn = ms.value_and_grad(ms_forward, None, net.trainable_params())
    with DispatchProbe(task="statistics", dump_path=str(root / "ms"), model=net) as probe:
        grad_fn(ms.Tensor(x), ms.Tensor(y.astype(np.int32)))
    with pytest.warns(RuntimeWarning, match="not .fully. recorded"):
        probe.close()
    with TorchProbe(task="statistics", dump_path=str(root / "torch"), model=twin) as probe:
        h = twin.act(twin.conv(torch.from_numpy(x)))
        logits = twin.fc(torch.nn.functional.dropout(h.reshape(h.shape[0], -1), p=0.1, training=True))
        torch.nn.functional.cross_entropy(logits, torch.from_numpy(y).long()).backward()
    probe.close()
    return root


def test_dropout_drawn_by_either_framework_is_not_judged_in_either_order(dropout_runs):
    """The two generators draw other masks: the dropout region and what follows from it are not judged,
    the same rows whichever run is A (was: with MindSpore as A, region(Dropout) and 30 rows after it
    stayed errors, while PyTorch as A gave none)."""
    results = [compare(str(dropout_runs / a), str(dropout_runs / b)) for a, b in (("ms", "torch"), ("torch", "ms"))]
    for table, verdict in results:
        assert verdict.forward is not None and verdict.forward.cause == "random", str(verdict)
        assert not (table["status"] == "error").any(), table[table["status"] == "error"][["op_a", "arg"]]
    (one, v1), (other, v2) = results
    assert v1.counts == v2.counts and v1.after_random == v2.after_random > 0
