"""Higher-order ops reach the probe's dispatch mode like any op: a compiled graph's rng wrapper
(``run_and_save_rng_state``, around the random ops of an activation-checkpointed region:
``scaled_dot_product_attention`` counts as one) made training under ``with DispatchProbe`` raise
NotImplementedError.  The mode runs them, unrecorded: inside compiled code ``probe_backend``
records the graph; one run outside compiled code is noted in the manifest and said by ``show``."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from dispatchprobe import DispatchProbe, probe_backend
from dispatchprobe.cli import main


class CheckpointedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 64), nn.Linear(32, 16)

    def forward(self, x):
        return checkpoint(self._attend, x, use_reentrant=False)

    def _attend(self, x):
        q = self.qkv(x).view(4, 2, 8, 4)
        a = F.scaled_dot_product_attention(q, q, q, dropout_p=0.0)
        return self.out(a.reshape(4, 64)[:, :32])


def _losses(model, backend, probe=None) -> list[float]:
    fn = torch.compile(model, backend=backend)
    x, losses = torch.randn(4, 16, generator=torch.Generator().manual_seed(0)), []
    for _ in range(2):
        with probe if probe is not None else torch.enable_grad():
            loss = fn(x).square().mean()
            loss.backward()
        losses.append(loss.item())
        if probe is not None:
            probe.step()
    if probe is not None:
        probe.close()
    torch._dynamo.reset()
    return losses


@pytest.mark.parametrize("with_backend", [False, True])
def test_a_compiled_checkpointed_region_trains_under_the_probe(tmp_path, with_backend):
    torch.manual_seed(0)
    plain = _losses(CheckpointedAttention(), "inductor")
    torch.manual_seed(0)
    backend = probe_backend(task="statistics", dump_path=str(tmp_path)) if with_backend else "inductor"
    probed = _losses(CheckpointedAttention(), backend, DispatchProbe(task="statistics", dump_path=str(tmp_path)))
    assert probed == plain
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert "higher_order_ops_unrecorded" not in manifest, manifest     # all of them inside compiled code
    records = [json.loads(line) for line in open(tmp_path / "step0" / "rank0" / "ops.jsonl")]
    assert records and not any(r["op"].startswith("higher_order") for r in records)


def test_a_higher_order_op_outside_compiled_code_is_noted(tmp_path):
    from torch._prims.rng_prims import run_and_save_rng_state
    probe = DispatchProbe(task="statistics", dump_path=str(tmp_path))
    x = torch.randn(8)
    with probe:
        _, drawn = run_and_save_rng_state(torch.ops.aten.rand.default, [8], device=torch.device("cpu"))
        (x * 2).sum()
    probe.close()
    assert drawn.shape == (8,)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["higher_order_ops_unrecorded"] == ["run_and_save_rng_state"], manifest
    shown = CliRunner().invoke(main, ["show", str(tmp_path)])
    assert "higher-order ops ran outside compiled code (run_and_save_rng_state)" in shown.output, shown.output
