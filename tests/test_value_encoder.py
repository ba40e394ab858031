"""The statistics task's compiled value encoder (``backend.value_encoder``) writes the records the
Python path writes, byte for byte: on PyTorch's OpInfo samples (every dtype, layout and argument
kind they hold), on a transformers Llama trained with AdamW (in-place updates, parameter records),
and on the values it hands back to Python (non-finite values, subclasses, uninitialised memory)."""

from __future__ import annotations

import glob
import os

import pytest
import torch
from dispatchprobe import DispatchProbe
from dispatchprobe.torch import backend, fused_stats


@pytest.fixture(autouse=True, scope="module")
def kernels():
    assert fused_stats.build(wait=True) is not None, f"the kernels did not build: {fused_stats.error}"


def _records(path) -> list[str]:
    return [line for f in sorted(glob.glob(os.path.join(path, "step*", "rank*", "ops.jsonl")))
            for line in open(f).read().splitlines()]


def _both(tmp_path, monkeypatch, run) -> tuple[list[str], list[str], int]:
    """The lines ``run(probe)`` records with the encoder and without it, and how many values the
    encoder measured itself."""
    measured = []
    stats4 = fused_stats.stats4
    out = []
    for fast in (True, False):
        with monkeypatch.context() as m:
            if not fast:
                m.setattr(backend, "value_encoder", lambda *a: None)
            probe = DispatchProbe(task="statistics", dump_path=str(tmp_path / f"fast{fast}"))
            run(probe)
            probe.close()
            if fast:
                measured.append(probe.recorder._encoder is not None)
        out.append(_records(tmp_path / f"fast{fast}"))
    assert fused_stats.stats4 is stats4
    assert measured == [True], "the encoder was not used"
    return out[0], out[1], len(out[0])


# ops leaving part of an output unwritten (its bytes differ from run to run)
UNWRITTEN_OUTPUTS = {"nn.functional.ctc_loss", "nn.functional.embedding_bag"}


def _op_db() -> list:
    """PyTorch's OpInfo list.  Importing its module freezes ``torch.backends``' global flags for
    the rest of the process (torch's own test suite wants that); other tests set them: undone."""
    frozen = torch.backends.flags_frozen()
    from torch.testing._internal.common_methods_invocations import op_db
    if not frozen:      # the flag lives in the module's namespace, which its functions hold
        torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
    return op_db


def _opinfo_samples(dtypes=(torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64)):
    torch.manual_seed(0)
    for info in _op_db()[::3]:
        if info.name in UNWRITTEN_OUTPUTS:
            continue
        for dtype in dtypes:
            if dtype not in info.supported_dtypes("cpu"):
                continue
            try:
                samples = list(info.sample_inputs("cpu", dtype, requires_grad=False))[:2]
            except Exception:       # noqa: BLE001 - a sample generator that needs what this CPU lacks
                continue
            for s in samples:
                yield info, s


def test_opinfo_records_are_the_python_paths(tmp_path, monkeypatch):
    counted = []

    def run(probe):
        samples = list(_opinfo_samples())    # anew for each run: some ops write their inputs
        counted.append(len(samples))
        with probe:
            for info, s in samples:
                try:
                    info.op(s.input, *s.args, **s.kwargs)
                except Exception:   # noqa: BLE001 - samples meant to raise; both runs see the same
                    pass
        probe.step()

    fast, slow, n = _both(tmp_path, monkeypatch, run)
    assert counted[0] == counted[1] > 500 and n > 1000
    assert fast == slow


def test_training_records_are_the_python_paths(tmp_path, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    def run(probe):
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
        model = LlamaForCausalLM(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, 64, (2, 16))
        for _ in range(2):
            with probe:
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
            probe.step()

    fast, slow, n = _both(tmp_path, monkeypatch, run)
    assert n > 500
    assert fast == slow


def test_values_it_hands_back(tmp_path, monkeypatch):
    """Non-finite values, empty and expanded tensors, parameters and their views, uninitialised
    memory, a subclass, non-finite floats and framework objects among the arguments."""
    class Sub(torch.Tensor):
        pass

    def run(probe):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(4, 3))
        x = torch.tensor([1.0, float("inf"), float("nan"), -2.0])
        with probe:
            torch.exp(x)
            torch.add(torch.randn(0, 3), 1.0)
            torch.mul(torch.randn(3).expand(4, 3), p[1:].sum())
            torch.mm(p.t(), torch.randn(4, 2))
            torch.empty(3).add_(1.0)
            torch.clamp(torch.randn(5, dtype=torch.bfloat16), min=-float("inf"), max=0.5)
            torch.ones(2, dtype=torch.float16, device="cpu") * 2
            torch.randn(3).as_subclass(Sub).mul(2.0)
            torch.cat([torch.randn(2), torch.arange(3.0)], dim=0)
            torch.zeros(2, 2, dtype=torch.float64).add_(torch.full((2, 2), 1e300, dtype=torch.float64))
        probe.step()

    fast, slow, n = _both(tmp_path, monkeypatch, run)
    assert n >= 10
    assert fast == slow
    assert any('"undefined":true' in line for line in fast)
    assert any('"nan":1' in line for line in fast)
