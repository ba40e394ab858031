"""Tensors that are not plain dense memory (functorch levels, forward-AD zero tensors, storages
resized by their owner) under every task: results bit-identical, records present (or metadata
with the reason), no crash, and nothing the probe does changes how the owner manages memory or
reaches the user's code as a warning."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, hessian, jacrev, jvp, vmap
from torch.utils._pytree import tree_leaves

from dispatchprobe import DispatchProbe
from dispatchprobe.models import TinyTransformer, lm_batch

TASKS = {
    "statistics": {},
    "tensor": {},
    "overflow": {"overflow": {"overflow_nums": -1}},
    "free_benchmark": {"free_benchmark": {"pert_mode": "add_noise"}},
}


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _cases():
    model = _mlp()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y, w = torch.randn(5, 4), torch.randn(5, 1), torch.randn(4)

    def loss(p, x, y):
        return ((functional_call(model, p, (x,)) - y) ** 2).mean()

    def f(w):
        return (x @ w).sin().sum()

    return {
        "grad": lambda: grad(loss)(params, x, y),
        "vmap_grad": lambda: vmap(grad(loss), in_dims=(None, 0, 0))(params, x.unsqueeze(1), y.unsqueeze(1)),
        "jvp": lambda: jvp(f, (w,), (torch.ones(4),)),
        "jacrev": lambda: jacrev(f)(w),
        "hessian": lambda: hessian(f)(w),
        "functional_call": lambda: functional_call(model, params, (x,)),
    }


def _ops(path) -> list[dict]:
    return [json.loads(line) for f in sorted(path.glob("step*/rank*/ops.jsonl")) for line in f.read_text().splitlines()]


def _same(a, b) -> bool:
    la, lb = tree_leaves(a), tree_leaves(b)
    return len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb))


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("level", ["op", "mix"])
def test_torch_func_transforms(tmp_path, task, level):
    for name, fn in _cases().items():
        expected = fn()
        path = tmp_path / name
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)    # free_benchmark's end-of-run notes
            with DispatchProbe(task=task, dump_path=str(path), level=level, **TASKS[task]) as probe:
                got = fn()
            probe.close()
        assert _same(expected, got), (task, name)
        if task in ("statistics", "tensor"):
            assert _ops(path), name


def test_jvp_zero_tangent_is_recorded_without_reading_memory(tmp_path):
    """Forward AD creates zero tensors that have no memory (reading one crashed the overflow check)."""
    with DispatchProbe(task="tensor", dump_path=str(tmp_path)) as probe:
        _cases()["jvp"]()
    probe.close()
    zeros = [t for r in _ops(tmp_path) for t in r["outputs"] if t.get("zero")]
    assert zeros and all("no_values" in t and "stats" not in t and "data" not in t for t in zeros)


def test_functorch_levels_in_module_records(tmp_path):
    """Module records inside ``grad`` see functorch wrappers: recorded from the wrapped values,
    with the level; inside ``vmap`` batched tensors are metadata with the reason."""
    with DispatchProbe(task="statistics", dump_path=str(tmp_path / "g"), level="mix") as probe:
        _cases()["grad"]()
    probe.close()
    wrapped = [t for r in _ops(tmp_path / "g") if r["kind"] == "module" for t in r["inputs"] if "functorch" in t]
    assert wrapped and all("stats" in t and t["functorch"]["levels"] for t in wrapped)
    with DispatchProbe(task="statistics", dump_path=str(tmp_path / "v"), level="mix") as probe:
        _cases()["vmap_grad"]()
    probe.close()
    batched = [t for r in _ops(tmp_path / "v") if r["kind"] == "module" for t in r["inputs"] if "functorch" in t]
    assert batched and all(t["functorch"].get("batched") and "no_values" in t for t in batched)


def test_per_sample_gradients_of_a_transformer(tmp_path):
    """The torch.func recipe for per-sample gradients (vmap over grad of functional_call)."""
    torch.manual_seed(0)
    model = TinyTransformer(dropout=0.0)
    params = {k: v.detach() for k, v in model.named_parameters()}
    tokens, targets = lm_batch(seed=0)

    def loss(p, tok, tgt):
        logits = functional_call(model, p, (tok.unsqueeze(0),))
        return nn.functional.cross_entropy(logits.flatten(0, 1), tgt)

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))
    expected = per_sample(params, tokens, targets)
    for task, extra in TASKS.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            with DispatchProbe(task=task, dump_path=str(tmp_path / task), **extra) as probe:
                got = per_sample(params, tokens, targets)
            probe.close()
        assert _same(expected, got), task
    assert any(r["stage"] == "backward" for r in _ops(tmp_path / "statistics"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_probed_storage_stays_resizable(tmp_path, dtype, monkeypatch):
    """FSDP2 frees parameters by resizing their storage to 0; ``Tensor.numpy()`` would have made
    it non-resizable for good (small tensors' statistics are reduced by numpy)."""
    from dispatchprobe.torch import fused_stats
    monkeypatch.setattr(fused_stats, "tree_rows", None)    # the numpy path, whatever the native library
    w = torch.randn(16, 8, dtype=dtype)
    x = torch.randn(4, 8, dtype=dtype)
    for task, extra in TASKS.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            with DispatchProbe(task=task, dump_path=str(tmp_path / task), checksum=True, **extra) as probe:
                (x @ w.t()).sum()
            probe.close()
        w.untyped_storage().resize_(w.numel() * w.element_size())     # raises if not resizable


def test_storage_resized_to_zero_is_metadata_only(tmp_path):
    """A tensor whose storage its owner freed (FSDP2 between all-gathers) is described, never read."""
    from dispatchprobe.torch import tensor_backend as backend
    t = torch.randn(4, 4)
    t.untyped_storage().resize_(0)
    meta = backend.tensor_meta(t)
    assert "storage not allocated" in meta["no_values"]
    assert backend.tensor_stats([t]) == [None]
    assert backend.identity(t) is None and backend.memory_ref(t) is None and backend.float_tensors([t]) == []


def test_numeric_warnings_never_reach_user_code(tmp_path, monkeypatch):
    """A finfo.min attention mask overflows float32 squares, +inf and -inf sum to nan: the probe's
    reductions must stay silent under ``-W error``."""
    from dispatchprobe.torch import fused_stats
    monkeypatch.setattr(fused_stats, "tree_rows", None)
    mask = torch.full((8, 8), torch.finfo(torch.float32).min).triu(1)
    both = torch.tensor([1.0, float("inf"), -float("inf")])
    with warnings.catch_warnings(), np.errstate(all="warn"):
        warnings.simplefilter("error")
        with DispatchProbe(task="statistics", dump_path=str(tmp_path)) as probe:
            (mask + 1).sum()
            (both * 2).sum()
        probe.close()
    stats = [t["stats"] for r in _ops(tmp_path) for t in r["outputs"] if "stats" in t]
    assert any(s["inf"] == 2 for s in stats)


def test_hf_training_under_warnings_as_errors(tmp_path):
    """A transformers Llama trains under ``warnings.simplefilter("error")`` as it does unprobed."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   attn_implementation="eager")
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))

    def run(probe):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(2):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                if probe is not None:
                    probe.start()
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                if probe is not None:
                    probe.stop()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
            if probe is not None:
                probe.step()
        return losses, [p.detach().clone() for p in model.parameters()]

    expected = run(None)
    for task in ("statistics", "tensor", "overflow"):
        probe = DispatchProbe(task=task, dump_path=str(tmp_path / task), **TASKS[task])
        got = run(probe)
        probe.close()
        assert _same(expected, got), task


def test_free_benchmark_fix_under_torch_func(tmp_path):
    """fix replaces each op's output by its re-run's (here float64, cast back) under ``grad`` and
    ``vmap(grad)`` too: nothing crashes, dtypes stay, and the results move toward float64's."""
    torch.manual_seed(0)
    x, w = torch.randn(64, 256), torch.randn(256)

    def total(w, x):
        return (x @ w).sin().sum()

    cases = {
        "grad": lambda w, x: grad(total)(w, x),
        "vmap_grad": lambda w, x: vmap(grad(lambda w, xi: (xi @ w).sin()), in_dims=(None, 0))(w, x),
    }
    fix = {"handler_type": "fix", "pert_mode": "improve_precision", "widen_float32": True}
    for name, fn in cases.items():
        plain, exact = fn(w, x), fn(w.double(), x.double())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)    # free_benchmark's end-of-run notes
            with DispatchProbe(task="free_benchmark", dump_path=str(tmp_path / name), free_benchmark=fix) as probe:
                fixed = fn(w, x)
            summary = probe.summary()
            probe.close()
        assert fixed.dtype == plain.dtype and fixed.shape == plain.shape, name
        assert not torch.equal(fixed, plain), name                      # outputs were replaced
        assert (fixed.double() - exact).abs().sum() < (plain.double() - exact).abs().sum(), name
        assert summary["checked"] >= 4 and not summary["skipped"], (name, summary)


def test_a_memory_reference_lives_exactly_as_long_as_the_memory():
    """The value cache trusts an address only while its memory lives: the reference stays alive
    through any tensor on the memory (a saved activation unpacked in backward as a new tensor, a
    view) and dies with the last one; it holds nothing of the storage (on this torch a weak
    reference to the storage's Python object, which torch keeps exactly as long as the storage)."""
    import gc

    from dispatchprobe.torch import tensor_backend as backend
    assert backend._STORAGE_OBJECTS_KEPT
    x = torch.randn(4, 6, requires_grad=True)
    y = x.exp()
    ref = backend.memory_ref(y)
    backward = y.grad_fn                     # exp saves its output for backward
    del y
    gc.collect()
    assert backend.memory_alive(ref)         # held by the saved output only
    unpacked = backward._saved_result        # a new tensor on the same memory
    view = unpacked.t()
    del backward, unpacked
    gc.collect()
    assert backend.memory_alive(ref)         # held by the view only
    del view
    gc.collect()
    assert not backend.memory_alive(ref)
