"""The grad probe's MindSpore twin: the gradients MindSpore passes to its optimizer, the same
records as torch's, and a cross-framework compare against the PyTorch twin of the same net.
Runs where mindspore is installed, in blocking mode."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytestmark = pytest.mark.mindspore      # run in MindSpore's own environment (ci/matrix.py)
os.environ.setdefault("MS_DEV_LAUNCH_BLOCKING", "1")
ms = pytest.importorskip("mindspore")
torch = pytest.importorskip("torch")

from mindspore import nn  # noqa: E402

import dispatchprobe  # noqa: E402
from dispatchprobe.core.config import ConfigError  # noqa: E402
from dispatchprobe.core.grad_probe import read_signs  # noqa: E402
from dispatchprobe_ms import DispatchProbe  # noqa: E402
from dispatchprobe_ms.demo import DIMS, TinyNet, batch  # noqa: E402

ms.set_context(mode=ms.PYNATIVE_MODE)
STEPS = 3


def train_ms(path=None, level="L2"):
    ms.set_seed(0)
    net = TinyNet()
    start = {n: p.asnumpy().copy() for n, p in net.parameters_and_names()}
    grad_fn = ms.value_and_grad(lambda x, y: ((net(x) - y) ** 2).mean(), None, net.trainable_params())
    opt = nn.SGD(net.trainable_params(), learning_rate=0.5)
    probe = DispatchProbe(task="grad_probe", dump_path=str(path), grad_level=level, optimizer=opt) if path else None
    seen = []
    for step in range(STEPS):
        _, grads = grad_fn(*batch(step))
        seen.append([g.asnumpy().copy() for g in grads])
        opt(grads)
    if probe is not None:
        probe.close()
    return start, seen, {p.name: p.asnumpy().copy() for p in net.trainable_params()}


def train_torch(path, weights):
    class TinyNet(torch.nn.Module):         # the PyTorch twin: torch's names (norm.weight for norm.gamma)
        def __init__(self):
            super().__init__()
            self.fc1, self.act = torch.nn.Linear(DIMS[0], DIMS[1]), torch.nn.GELU()
            self.norm, self.fc2 = torch.nn.LayerNorm(DIMS[1], eps=1e-7), torch.nn.Linear(DIMS[1], DIMS[2])

        def forward(self, x):
            return torch.softmax(self.fc2(self.norm(self.act(self.fc1(x)))), dim=-1)
    net, names = TinyNet(), {"norm.weight": "norm.gamma", "norm.bias": "norm.beta"}
    with torch.no_grad():
        for n, p in net.named_parameters():
            p.copy_(torch.from_numpy(weights[names.get(n, n)]))
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    probe = dispatchprobe.DispatchProbe(task="grad_probe", dump_path=str(path), grad_level="L2", model=net)
    for step in range(STEPS):
        x, y = (torch.from_numpy(t.asnumpy()) for t in batch(step))
        ((net(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    probe.close()


def test_mindspore_records_the_gradients_its_optimizer_receives(tmp_path):
    _, seen, params = train_ms(tmp_path / "ms")
    _, _, plain = train_ms()
    assert all(np.array_equal(params[n], plain[n]) for n in plain)        # transparent
    run = dispatchprobe.load(tmp_path / "ms")
    assert run.manifest["framework"] == "mindspore" and sorted(run.parts) == [(s, 0) for s in range(STEPS)]
    for step, grads in enumerate(seen):
        part = run.part(step, 0)
        assert [r["param"] for r in part.grads] == ["fc1.weight", "fc1.bias", "norm.gamma", "norm.beta",
                                                    "fc2.weight", "fc2.bias"]
        for r, g in zip(part.grads, grads):
            assert r["stats"]["max"] == float(g.max()) and r["stats"]["min"] == float(g.min())
            assert r["stats"]["norm"] == pytest.approx(np.linalg.norm(g.astype(np.float64)), rel=1e-6)
            assert np.array_equal(read_signs(part, r), g > 0)
            want = [float(((g > lo) & (g <= hi)).mean()) for lo, hi in zip([-np.inf, -1, 0, 1], [-1, 0, 1, np.inf])]
            assert r["distribution"]["shares"] == pytest.approx(want) and r["distribution"]["zero"] == float((g == 0).mean())
    with pytest.raises(ConfigError, match="needs optimizer="):
        DispatchProbe(task="grad_probe", dump_path=str(tmp_path / "x"))


def test_mindspore_and_torch_gradients_compare(tmp_path):
    start, _, _ = train_ms(tmp_path / "ms")
    train_torch(tmp_path / "torch", start)
    for a, b in (("ms", "torch"), ("torch", "ms")):
        table, verdict = dispatchprobe.compare(tmp_path / a, tmp_path / b)
        assert verdict.passed, str(verdict)
        assert table["similarity"].min() > 0.99 and table["param"].nunique() == 7       # 6 and the summary
        # names differ only where the frameworks name differently: paired by order and shape
        renamed = dict(zip(table["param"], table["param_b"]))
        assert renamed.get("norm.gamma" if a == "ms" else "norm.weight") == ("norm.weight" if a == "ms" else "norm.gamma")


def test_mindspore_l0_checksums_are_torchs_for_the_same_bytes(tmp_path):
    from dispatchprobe.core.grad_probe import checksum_hex
    from dispatchprobe.torch.grad_probe import checksum_on_device
    _, seen, _ = train_ms(tmp_path / "l0", level="L0")
    run = dispatchprobe.load(tmp_path / "l0")
    for step, grads in enumerate(seen):
        for r, g in zip(run.part(step, 0).grads, grads):
            assert "md5" not in r and r["checksum"]["kind"] == "wsum64"
            assert r["checksum"]["value"] == checksum_hex(*(int(v) for v in checksum_on_device(torch.from_numpy(g))))
