"""What the eager probe records: names, stages, scopes, arguments, statistics, levels, filters."""

from __future__ import annotations

import contextlib
import json
import os

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dispatchprobe import DispatchProbe, load
from dispatchprobe.models import TinyTransformer, lm_batch, lm_loss
from dispatchprobe.records.reader import tensor_rows
from conftest import train


def records(path, step=0):
    return load(path).part(step, 0).records


def test_forward_and_backward_records(tiny_run):
    run = load(tiny_run)
    recs = run.part(0, 0).records
    ops = [r for r in recs if r["kind"] == "op"]
    fwd = [r for r in ops if r["stage"] == "forward"]
    bwd = [r for r in ops if r["stage"] == "backward"]
    assert fwd and bwd
    assert all(r["grad_fn"] for r in bwd) and not any(r["grad_fn"] for r in fwd)
    # stable names: op, per-(op, stage) call index, stage
    assert fwd[0]["name"] == f"{fwd[0]['op']}.0.forward"
    calls = [r["call"] for r in fwd if r["op"] == "aten.addmm.default"]
    assert calls == list(range(len(calls)))
    # module scope in both stages
    gelu = next(r for r in fwd if r["op"] == "aten.gelu.default")
    assert gelu["scope"] == "TinyTransformer.layers.0.mlp"
    gelu_bwd = [r for r in bwd if r["op"] == "aten.gelu_backward.default"]
    assert {r["scope"] for r in gelu_bwd} == {"TinyTransformer.layers.0.mlp", "TinyTransformer.layers.1.mlp"}
    assert {r["grad_fn"] for r in gelu_bwd} == {"GeluBackward0"}
    # the first backward op belongs to the last module of forward (the loss is outside any module)
    head_mm = [r for r in bwd if r["op"] == "aten.mm.default" and r["scope"] == "TinyTransformer.head"]
    assert len(head_mm) == 2 and head_mm[0]["grad_fn"] == "AddmmBackward0"


def test_arguments_rebuildable(tiny_run):
    recs = records(tiny_run)
    ln = next(r for r in recs if r["op"] == "aten.native_layer_norm.default")
    assert ln["inputs"][1] == {"type": "list", "value": [{"type": "int", "value": 64}]}
    assert ln["inputs"][4] == {"type": "float", "value": 1e-05}
    assert ln["output_type"] == "tuple" and len(ln["outputs"]) == 3
    softmax = next(r for r in recs if r["op"] == "aten._softmax.default")
    assert softmax["inputs"][1:] == [{"type": "int", "value": -1}, {"type": "bool", "value": False}]
    ones = next(r for r in recs if r["op"] == "aten.ones.default")
    assert ones["kwargs"]["dtype"] == {"type": "dtype", "value": "bool"}
    assert ones["kwargs"]["device"] == {"type": "device", "value": "cpu"}
    # every tensor of a tensor run points at saved data that can be read back
    part = load(tiny_run).part(0, 0)
    keys = {spec["data"] for r in recs for _, _, spec in tensor_rows(r)}
    assert all(part.has_tensor(k) for k in keys)
    assert part.views, "views of saved memory are stored as index entries"


def test_statistics_match_the_saved_tensors(tiny_run):
    part = load(tiny_run).part(0, 0)
    checked = 0
    for r in part.records[:60]:
        for io, arg, spec in tensor_rows(r):
            data = part.tensor(spec["data"]).astype(np.float64)
            st = spec["stats"]
            assert list(data.shape) == spec["shape"]
            if data.size == 0 or spec["dtype"] == "bool":
                continue
            finite = data[np.isfinite(data)]
            if spec["dtype"].startswith("float") and not (st["inf"] or st["nan"]):
                assert st["max"] == pytest.approx(finite.max(), rel=1e-6, abs=1e-6)
                assert st["min"] == pytest.approx(finite.min(), rel=1e-6, abs=1e-6)
                assert st["mean"] == pytest.approx(data.mean(), rel=1e-4, abs=1e-6)
                assert st["norm"] == pytest.approx(np.linalg.norm(data), rel=1e-4)  # float32 accumulation
            checked += 1
    assert checked > 50


def test_integer_and_nonfinite_stats(tmp_path):
    probe = DispatchProbe(dump_path=str(tmp_path / "r"))
    idx = torch.tensor([3, 1, 2])
    x = torch.tensor([1.0, float("inf"), float("nan"), -2.0])
    src = torch.arange(10.0)
    with probe:
        torch.ops.aten.index_select(src, 0, idx)
        torch.ops.aten.mul(x, 2)
    probe.close()
    recs = records(tmp_path / "r")
    st = recs[0]["inputs"][2]["stats"]
    assert recs[0]["inputs"][2]["dtype"] == "int64"
    assert (st["max"], st["min"], st["mean"]) == (3, 1, 2)
    st = recs[1]["outputs"][0]["stats"]
    assert (st["nan"], st["inf"]) == (1, 1)
    assert (st["finite_max"], st["finite_min"]) == (2.0, -4.0)


def test_in_place_ops_record_inputs_before_the_write(tmp_path):
    probe = DispatchProbe(task="tensor", dump_path=str(tmp_path / "r"))
    x = torch.ones(4)
    with probe:
        x.add_(1.0)
    probe.close()
    part = load(tmp_path / "r").part()
    rec = part.records[0]
    assert rec["op"] == "aten.add_.Tensor" or rec["op"].startswith("aten.add_")
    np.testing.assert_array_equal(part.tensor(rec["inputs"][0]["data"]), np.ones(4))
    np.testing.assert_array_equal(part.tensor(rec["outputs"][0]["data"]), np.full(4, 2.0))


def test_views_skipped_unless_asked(tmp_path):
    def ops(include_views):
        path = str(tmp_path / f"v{include_views}")
        probe = DispatchProbe(dump_path=path, include_views=include_views)
        a = torch.randn(4, 4)
        with probe:
            a.t().reshape(16).expand(2, 16).detach().sum()
        probe.close()
        return [r["op"] for r in records(path)]

    assert ops(False) == ["aten.clone.default", "aten.sum.default"]
    with_views = ops(True)
    assert {"aten.t.default", "aten.expand.default", "aten.detach.default"} <= set(with_views)


def test_stacks_deduplicated_and_checksums(tiny_run):
    part = load(tiny_run).part(0, 0)
    fwd = [r for r in part.records if r["stage"] == "forward" and r["kind"] == "op"]
    assert all(r["stack"] is not None for r in fwd)
    assert len(part.stacks) < len(fwd)
    frames = part.stacks[fwd[0]["stack"]]
    assert any("conftest.py" in f or "models.py" in f for f in frames)
    specs = [spec for r in fwd for _, _, spec in tensor_rows(r)]
    assert all(str(s.get("checksum")).startswith("crc32:") for s in specs)


def test_tensors_stored_once(tiny_run):
    part = load(tiny_run).part(0, 0)
    keys = [spec["data"] for r in part.records for _, _, spec in tensor_rows(r)]
    params = {spec["data"] for r in part.params for _, _, spec in tensor_rows(r)} - set(keys)
    stored = set(part.shards) - params      # the parameter records' own values (after the step)
    assert len(stored) < 0.75 * len(set(keys)) and len(stored) < 0.5 * len(keys)
    # an op's output that is the next op's input is the same stored tensor
    recs = [r for r in part.records if r["kind"] == "op"]
    gelu = next(i for i, r in enumerate(recs) if r["op"] == "aten.gelu.default")
    def stored_as(key):
        return part.views[key]["base"] if key in part.views else key

    nxt = recs[gelu + 1]
    assert nxt["op"] == "aten.addmm.default"  # takes a 2-D view of gelu's output
    assert stored_as(recs[gelu]["outputs"][0]["data"]) in {stored_as(s["data"]) for _, _, s in tensor_rows(nxt)}


@pytest.mark.parametrize("level,kinds", [("op", {"op"}), ("module", {"module"}), ("mix", {"op", "module"})])
def test_levels(tmp_path, level, kinds):
    path = tmp_path / level
    train(DispatchProbe(dump_path=str(path), level=level), steps=1)
    recs = records(path)
    assert {r["kind"] for r in recs} == kinds
    if "module" in kinds:
        mods = [r for r in recs if r["kind"] == "module"]
        assert {r["stage"] for r in mods} == {"forward", "backward"}
        mlp = [r for r in mods if r["scope"] == "TinyTransformer.layers.1.mlp"]
        assert [r["stage"] for r in mlp] == ["forward", "backward"]
        assert mlp[1]["name"] == "TinyTransformer.layers.1.mlp.backward.0"
        assert mlp[0]["inputs"][0]["shape"] == [4, 32, 64]


def test_filters(tmp_path):
    train(DispatchProbe(dump_path=str(tmp_path / "list"), list=["^aten\\.(mm|addmm)\\."]), steps=1)
    assert {r["op"] for r in records(tmp_path / "list")} == {"aten.mm.default", "aten.addmm.default"}
    train(DispatchProbe(dump_path=str(tmp_path / "sub"), list=["gelu"]), steps=1)
    assert {r["op"] for r in records(tmp_path / "sub")} == {"aten.gelu.default", "aten.gelu_backward.default"}
    train(DispatchProbe(dump_path=str(tmp_path / "scope"), scope=["TinyTransformer.layers.1"]), steps=1)
    scopes = {r["scope"] for r in records(tmp_path / "scope")}
    assert scopes and all(s.startswith("TinyTransformer.layers.1") for s in scopes)
    train(DispatchProbe(dump_path=str(tmp_path / "step"), step=[1, 2]), steps=3)
    assert sorted(load(tmp_path / "step").parts) == [(1, 0), (2, 0)]
    train(DispatchProbe(dump_path=str(tmp_path / "fwd"), data_mode=["forward"]), steps=1)
    assert {r["stage"] for r in records(tmp_path / "fwd")} == {"forward"}
    train(DispatchProbe(dump_path=str(tmp_path / "out"), data_mode=["output"]), steps=1)
    assert all("inputs" not in r and r["outputs"] for r in records(tmp_path / "out"))


def test_rank_filter_and_detection(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    train(DispatchProbe(dump_path=str(tmp_path / "r1")), steps=1)
    assert list(load(tmp_path / "r1").parts) == [(0, 1)]
    train(DispatchProbe(dump_path=str(tmp_path / "r0"), rank=[0]), steps=1)
    assert not os.path.exists(tmp_path / "r0")


def test_manifest(tiny_run):
    with open(tiny_run / "manifest.json") as f:
        m = json.load(f)
    assert m["format"] == "dispatchprobe-records" and m["format_version"] == 1
    assert m["framework"] == "torch" and m["config"]["task"] == "tensor"


def test_clone_output_is_the_input_data(tmp_path):
    probe = DispatchProbe(task="tensor", dump_path=str(tmp_path / "c"))
    x = torch.randn(4, 6)
    with probe:
        y = x.t().contiguous()          # a clone: same values as its (transposed view) input
        torch.ops.aten.add(y, 1)
    probe.close()
    part = load(tmp_path / "c").part()
    clone = next(r for r in part.records if r["op"] == "aten.clone.default")
    assert clone["outputs"][0]["data"] == clone["inputs"][0]["data"]
    np.testing.assert_array_equal(part.tensor(clone["outputs"][0]["data"]), x.t().numpy())


def test_deferred_device_statistics_match(tmp_path, monkeypatch):
    """The accelerator path (stats reduced on the device, read back in batches) gives the same
    records, in the same order, as the immediate path; forced here on CPU tensors."""
    from dispatchprobe.core import recorder
    from dispatchprobe.torch import tensor_backend as torch_backend
    train(DispatchProbe(dump_path=str(tmp_path / "now"), level="mix"), steps=1)
    monkeypatch.setattr(torch_backend, "stats_on_device", lambda t: t.numel() > 0 and t.layout == torch.strided)
    monkeypatch.setattr(recorder, "DEFER_BATCH", 64)
    train(DispatchProbe(dump_path=str(tmp_path / "later"), level="mix"), steps=1)
    now, later = records(tmp_path / "now"), records(tmp_path / "later")
    assert [r["name"] for r in now] == [r["name"] for r in later]
    assert [r["id"] for r in later] == list(range(len(later)))
    for a, b in zip(now, later):
        for (_, arg, sa), (_, _, sb) in zip(tensor_rows(a), tensor_rows(b)):
            for key in ("max", "min", "mean", "norm", "nan", "inf"):
                va, vb = sa["stats"][key], sb["stats"][key]
                if isinstance(va, float) and not np.isfinite(va):
                    assert not np.isfinite(vb), (a["name"], arg, key)
                else:
                    assert vb == pytest.approx(va, rel=1e-4, abs=1e-6), (a["name"], arg, key)  # f32 sums


def test_identical_runs_record_identical_op_sequences(tmp_path):
    """The probe must not change which ops run: e.g. holding a gradient alive (a reference cycle
    in the probe) makes autograd copy it instead of stealing it -- an extra copy_ in one run."""
    names = []
    for i in range(3):
        train(DispatchProbe(dump_path=str(tmp_path / f"r{i}")), steps=2)
        names.append([r["name"] for step in (0, 1) for r in records(tmp_path / f"r{i}", step)])
    assert names[0] == names[1] == names[2]


class _IdentityNet(torch.nn.Module):
    def __init__(self, middle: torch.nn.Module):
        super().__init__()
        self.fc1, self.act, self.fc2 = torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8)
        self.middle, self.fc3 = middle, torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.fc3(self.middle(self.fc2(self.act(self.fc1(x)))))


def _backward_scopes(tmp_path, model, *inputs, name="run"):
    probe = DispatchProbe(task="statistics", dump_path=str(tmp_path / name), model=model)
    with probe:
        out = model(*inputs)
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()
    probe.close()
    return [(r["op"], r["scope"]) for r in load(tmp_path / name).parts[(0, 0)].records if r["stage"] == "backward"]


@pytest.mark.parametrize("middle", [torch.nn.Identity(), torch.nn.Dropout(p=0.0)])
def test_backward_scope_is_not_an_identity_like_module(tmp_path, middle):
    """A module whose output is its input (Identity, Dropout(p=0)) runs no backward op: the
    ops before it in backward belong to the layer that ran them."""
    torch.manual_seed(0)
    scopes = _backward_scopes(tmp_path, _IdentityNet(middle), torch.randn(3, 4))
    assert [s for _, s in scopes if s.endswith("middle")] == []
    assert [op for op, s in scopes if s == "_IdentityNet.fc2"] == ["aten.mm.default", "aten.mm.default",
                                                                  "aten.sum.dim_IntList"]


def test_backward_scopes_of_a_transformer_layer_without_dropout(tmp_path):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    scopes = _backward_scopes(tmp_path, layer, torch.randn(2, 5, 16))
    assert not [s for _, s in scopes if "dropout" in s], scopes
    assert any(s == "TransformerEncoderLayer.self_attn" for _, s in scopes)
    assert any(s == "TransformerEncoderLayer.norm2" and "layer_norm" in op for op, s in scopes)


def test_uninitialised_memory_is_recorded_undefined(tmp_path):
    """Values from the empty family differ run to run until written: recorded as undefined
    (no statistics, never judged); once an op has written the tensor, it is an ordinary value."""
    probe = DispatchProbe(task="tensor", dump_path=str(tmp_path / "run"))
    with probe:
        buf = torch.empty(6, dtype=torch.int64)
        buf.index_put_((torch.arange(6),), torch.arange(6) * 2)
        total = buf.sum()
    probe.close()
    assert int(total) == 30
    recs = {r["op"]: r for r in load(tmp_path / "run").parts[(0, 0)].records}
    before = recs["aten.index_put_.default"]["inputs"][0]
    assert before["undefined"] is True and "stats" not in before and "data" not in before   # replayed as zeros
    after = recs["aten.sum.default"]["inputs"][0]
    assert "undefined" not in after and after["stats"]["max"] == 10


@pytest.mark.parametrize("task", ["statistics", "tensor"])
def test_an_out_argument_into_uninitialised_memory_holds_the_result(tmp_path, task):
    """``torch.add(x, y, out=torch.empty(...))``: the destination's prior contents are undefined (not
    an input), the op's output, the same tensor, holds the sum and is judged (was: undefined too,
    so a wrong kernel writing there could never be named)."""
    probe = DispatchProbe(task=task, dump_path=str(tmp_path))
    with probe:
        buf = torch.empty(4)
        torch.add(torch.ones(4), torch.arange(4.0), out=buf)
    probe.close()
    rec = next(r for r in load(tmp_path).parts[(0, 0)].records if r["op"] == "aten.add.out")
    assert rec["kwargs"]["out"]["undefined"] is True
    out = rec["outputs"][0]
    assert "undefined" not in out and out["stats"]["max"] == 4 and out["stats"]["min"] == 1


def test_partly_written_memory_stays_undefined(tmp_path):
    """A write defines the bytes it wrote: the written half of a buffer has values, the whole
    buffer stays undefined until the other half is written too."""
    probe = DispatchProbe(task="statistics", dump_path=str(tmp_path))
    with probe:
        buf = torch.empty(4)
        buf[:2].fill_(1.0)
        buf.amax(), buf[:2].amin()
        buf[2:].fill_(3.0)
        buf.mean()
    probe.close()
    recs = load(tmp_path).parts[(0, 0)].records
    first = {r["op"]: r["inputs"][0] for r in recs}
    assert first["aten.amax.default"]["undefined"] is True
    assert "undefined" not in first["aten.amin.default"] and first["aten.amin.default"]["stats"]["min"] == 1
    assert "undefined" not in first["aten.mean.default"] and first["aten.mean.default"]["stats"]["mean"] == 2


@pytest.mark.parametrize("task", ["statistics", "tensor"])
def test_identical_mixture_of_experts_runs_agree(tmp_path, task):
    """Mixtral (transformers, tiny config, random init) fills an uninitialised int64 buffer with
    index_put_: its old contents differ run to run, are recorded undefined and never judged, so
    two identical runs agree (they once showed 4 error rows and exited 2)."""
    import transformers
    from dispatchprobe import compare
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)
    for name in ("a", "b"):
        torch.manual_seed(0)
        model = transformers.MixtralForCausalLM(cfg)
        ids = torch.randint(0, 64, (2, 8))
        probe = DispatchProbe(task=task, dump_path=str(tmp_path / name), model=model)
        with probe:
            model(input_ids=ids, labels=ids).loss.backward()
        probe.close()
    recs = load(tmp_path / "a").parts[(0, 0)].records
    if int(transformers.__version__.split(".")[0]) >= 5:    # its experts fill an uninitialised buffer (4.x: index_add_)
        assert any(s.get("undefined") for r in recs if r["op"] == "aten.index_put_.default" for s in r["inputs"])
    table, verdict = compare(tmp_path / "a", tmp_path / "b")
    assert verdict.passed and verdict.counts.get("error", 0) == 0, str(verdict)


def test_loss_module_backward_is_scoped_and_every_module_gets_its_backward_record(tmp_path):
    """The loss module's output is the root of backward, where torch's multi-grad hook never
    fires: its backward ops still carry its scope; modules whose inputs need no gradient (the
    first layer, the root) get their backward module record when backward ends."""
    import json

    class Loss(torch.nn.Module):
        def forward(self, x, y):
            return torch.nn.functional.cross_entropy(x, y)

    class Train(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.loss = torch.nn.Linear(4, 3), Loss()

        def forward(self, x, y):
            return self.loss(self.fc(x), y)

    model = Train()
    x, y = torch.randn(2, 4), torch.tensor([0, 1])
    with DispatchProbe(task="statistics", dump_path=str(tmp_path), model=model, level="mix") as probe:
        model(x, y).backward()
    probe.close()
    recs = [json.loads(line) for line in open(tmp_path / "step0" / "rank0" / "ops.jsonl")]
    scope = {r["op"]: r["scope"] for r in recs if r["kind"] == "op" and r["stage"] == "backward"}
    assert scope["aten.nll_loss_backward.default"] == "Train.loss"
    assert scope["aten._log_softmax_backward_data.default"] == "Train.loss"
    assert scope["aten.mm.default"] == "Train.fc"
    modules = [r["scope"] for r in recs if r["kind"] == "module" and r["stage"] == "backward"]
    assert modules == ["Train.loss", "Train.fc", "Train"]


@pytest.mark.parametrize("around", ["forward", "loop"])
def test_steps_follow_the_optimizer_without_step_calls(tmp_path, around):
    """A loop that never calls probe.step() gets one part per optimizer step, whether the probe is
    entered per step (the optimizer steps outside it) or around the whole loop (inside it: the
    optimizer's own ops stay in the step they end); a second optimizer does not count again."""
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    probe = DispatchProbe(dump_path=str(tmp_path / "r"))
    outer = probe if around == "loop" else contextlib.nullcontext()
    with outer:
        for step in range(3):
            with probe if around == "forward" else contextlib.nullcontext():
                lm_loss(model, *lm_batch(seed=step)).backward()
            opt.step()
            other.step()
            opt.zero_grad()
    probe.close()
    run = load(tmp_path / "r")
    assert sorted(run.parts) == [(0, 0), (1, 0), (2, 0)]
    for step in range(3):
        ops = [r["op"] for r in run.part(step, 0).records]
        assert ops.count("aten.embedding.default") == 1
        assert ("aten.addcdiv_.default" in ops) == (around == "loop")      # AdamW's update


def test_an_explicit_step_ends_following_the_optimizer(tmp_path):
    """step() after the optimizer's counts once (conftest's train calls both), and from then on
    only step() ends steps."""
    train(DispatchProbe(dump_path=str(tmp_path / "r")), steps=3)
    assert sorted(load(tmp_path / "r").parts) == [(0, 0), (1, 0), (2, 0)]


@pytest.mark.parametrize("path", ["eager", pytest.param("compiled, never closed", marks=pytest.mark.probe_backend)])
def test_an_optimizer_of_a_model_the_probe_never_saw_is_not_its_own(tmp_path, path):
    """A session records parameters of, and follows the steps of, only optimizers that update a
    model it has seen run: another model's optimizer stepping inside the probe, or after a
    probe_backend left unclosed (dynamo's cache keeps it), writes nothing into the run."""
    from dispatchprobe.models import MLPNet
    from dispatchprobe.torch.compile import probe_backend
    torch.manual_seed(0)
    probed, other = MLPNet(dim=8, depth=1, classes=2), MLPNet(dim=8, depth=1, classes=2)
    opt, other_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (probed, other))
    x = torch.randn(4, 8)
    names = {n for n, _ in probed.named_parameters()}
    torch._dynamo.reset()
    if path == "eager":
        probe = DispatchProbe(task="statistics", dump_path=str(tmp_path / "r"), model=probed)
        for _ in range(2):
            other(x).sum().backward()
            with probe:
                probed(x).sum().backward()
                other_opt.step()              # not the probe's: neither recorded nor a step
                opt.step()
    else:
        backend = probe_backend(task="statistics", dump_path=str(tmp_path / "r"))
        torch.compile(probed, backend=backend)(x).sum().backward()
        opt.step()
        for _ in range(2):                    # the backend's session stays open, following optimizers
            other(x).sum().backward()
            other_opt.step()
        backend.close()
    recorded = {r["scope"] for part in load(tmp_path / "r").parts.values() for r in part.params}
    assert recorded == names
    assert sorted(load(tmp_path / "r").parts) == ([(0, 0), (1, 0)] if path == "eager" else [(0, 0)])
    torch._dynamo.reset()


def test_an_optimizer_of_functional_parameters_is_followed(tmp_path):
    """torch.func training: the optimizer updates copies of the parameters that functional_call
    runs the model with, tensors no module holds; the probe that saw the model run follows it."""
    from torch.func import functional_call
    from dispatchprobe.models import MLPNet
    torch.manual_seed(0)
    model = MLPNet(dim=8, depth=1, classes=2)
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    opt = torch.optim.SGD(params.values(), lr=0.1)
    x = torch.randn(4, 8)
    probe = DispatchProbe(task="statistics", dump_path=str(tmp_path / "r"), model=model)
    with probe:
        for _ in range(2):
            functional_call(model, params, (x,)).sum().backward()
            opt.step()
            opt.zero_grad()
    probe.close()
    run = load(tmp_path / "r")
    assert sorted(run.parts) == [(0, 0), (1, 0)]
    assert all(len(run.part(s, 0).params) == 2 * len(params) for s in (0, 1))


def test_parameter_records_name_a_parameter_group_added_later(tmp_path):
    """The names of an optimizer's parameters, kept between its steps, follow a parameter group
    added to it: every record names its parameter by its place in the model."""
    from dispatchprobe.models import MLPNet
    torch.manual_seed(0)
    model = MLPNet(dim=8, depth=1, classes=2)
    params = list(model.named_parameters())
    opt = torch.optim.SGD([p for _, p in params[:2]], lr=0.1)
    x = torch.randn(4, 8)
    probe = DispatchProbe(task="statistics", dump_path=str(tmp_path / "r"), model=model)
    for step in range(2):
        with probe:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        probe.step()
        if step == 0:
            opt.add_param_group({"params": [p for _, p in params[2:]]})
    probe.close()
    run = load(tmp_path / "r")
    named = [{r["scope"] for r in run.part(s, 0).params} for s in (0, 1)]
    assert named == [{n for n, _ in params[:2]}, {n for n, _ in params}]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_submodule_inside_an_eager_model_is_left_to_its_graph(tmp_path, backend):
    """The eager probe records the eager modules' ops and none of a compiled submodule's: the
    compiled-code test finds AOTAutograd's frames below the compiled module's call, and stops
    its walk up the stack at the eager module call above them."""
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.compile(inner, backend=backend), torch.nn.Linear(8, 2))
    x = torch.randn(4, 8)
    model(x).sum().backward()            # compiled before the probe
    model.zero_grad(set_to_none=True)
    with DispatchProbe(task="statistics", dump_path=str(tmp_path / "r"), model=model) as probe:
        model(x).sum().backward()
    probe.close()
    records = [r for r in load(tmp_path / "r").part().records if r["kind"] == "op"]
    forward = [(r["op"], r["scope"]) for r in records if r["stage"] == "forward"]
    assert ("aten.addmm.default", "Sequential.0") in forward and ("aten.addmm.default", "Sequential.2") in forward
    if not hasattr(TorchDispatchMode, "ignore_compile_internals"):     # torch < 2.9: the submodule runs eagerly
        assert {("aten.addmm.default", "Sequential.1._orig_mod.0"), ("aten.tanh.default", "Sequential.1._orig_mod.1")} <= set(forward)
        return
    assert not [op for op, _ in forward if op.startswith("aten.tanh")]
    assert sum(op == "aten.addmm.default" for op, _ in forward) == 2


@pytest.mark.parametrize("where", ["optimizer step", "optimizer step, another thread", "module call"])
def test_a_probe_collected_inside_torchs_hook_loops_leaves_training_running(tmp_path, where):
    """A probe dropped unclosed (a notebook cell) and collected by a garbage collection that runs
    inside an optimizer step's global hooks (removing its hooks there stopped training with
    "OrderedDict mutated during iteration"), in another thread while the training thread is in
    those hooks (a writer thread's allocation), or inside a module's forward hooks (where the probe
    keeps its own exit hook last): the step completes, and nothing of the dropped probe stays
    installed once another probe starts."""
    import gc
    import threading

    def collect_in_a_thread(*args):
        thread = threading.Thread(target=gc.collect)
        thread.start()
        thread.join()

    from torch.optim import optimizer as torch_optimizer
    from torch.optim.optimizer import register_optimizer_step_post_hook

    before = (dict(torch_optimizer._global_optimizer_pre_hooks), dict(torch_optimizer._global_optimizer_post_hooks))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    collect = lambda *args: gc.collect() and None     # noqa: E731
    gc.disable()                     # the one collection: inside the loop
    try:
        handle = register_optimizer_step_post_hook(collect) if where == "optimizer step" \
            else register_optimizer_step_post_hook(collect_in_a_thread) if where.endswith("thread") \
            else model[0].register_forward_hook(collect)
        dropped = DispatchProbe(task="statistics", dump_path=str(tmp_path / "dropped"))
        with dropped:
            model(torch.randn(3, 4)).sum().backward()
        assert where != "module call" or len(model[0]._forward_hooks) == 2    # the user's, the probe's exit
        cycle = [dropped]
        cycle.append(cycle)          # reachable only through a cycle: freed by a collection
        del dropped, cycle
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        handle.remove()
    finally:
        gc.enable()
    live = DispatchProbe(task="statistics", dump_path=str(tmp_path / "live"))
    with live:
        model(torch.randn(3, 4)).sum().backward()
    live.close()
    assert (dict(torch_optimizer._global_optimizer_pre_hooks),
            dict(torch_optimizer._global_optimizer_post_hooks)) == before
    assert not model[0]._forward_hooks and not model[1]._forward_hooks


def test_dynamo_never_traces_the_probes_frames(tmp_path):
    """An op a compiled function runs outside its graphs (``.item()`` breaks the graph) reaches
    the probe while dynamo's frame callback is set: dynamo converts the same frames as without
    the probe (none of the probe's own), the result is the same, and the graphs' ops are recorded."""
    from torch._dynamo import convert_frame

    from dispatchprobe.torch import dispatch_mode
    from dispatchprobe.torch.internals import dynamo as dynamo_internals

    def f(x):
        y = x.sin()
        return y.cos() + y.sum().item()

    def converted(probe):
        torch._dynamo.reset()
        seen = []
        original = convert_frame.ConvertFrame.__call__

        def spy(self, frame, *args, **kwargs):
            seen.append(frame.f_code.co_filename)
            return original(self, frame, *args, **kwargs)
        convert_frame.ConvertFrame.__call__ = spy
        try:
            with probe or contextlib.nullcontext():
                out = torch.compile(f, backend="eager")(torch.ones(3))
        finally:
            convert_frame.ConvertFrame.__call__ = original
        return out, seen

    outside = dispatch_mode.call_outside_dynamo
    handed = []

    def counted(fn, *args):
        handed.append(args[0])
        return outside(fn, *args)
    if dynamo_internals.FRAMES is not None:      # this torch has the frame controls: the mode hands ops on itself
        dynamo_internals.never_compiled(counted.__code__)
    plain, frames = converted(None)
    probe = DispatchProbe(task="statistics", dump_path=str(tmp_path))
    dispatch_mode.call_outside_dynamo = counted
    try:
        probed, probed_frames = converted(probe)
    finally:
        dispatch_mode.call_outside_dynamo = outside
    probe.close()
    assert torch.equal(plain, probed)
    recorded = {r["op"] for r in records(tmp_path) if r["kind"] == "op"}
    if not hasattr(TorchDispatchMode, "ignore_compile_internals"):     # torch < 2.9 (docs/compile.md)
        assert {"aten.sin.default", "aten.cos.default", "aten.sum.default"} <= recorded    # f ran eagerly
        return
    if dynamo_internals.FRAMES is not None:
        assert torch.ops.aten._local_scalar_dense.default in handed     # reached the probe with dynamo's callback set
    else:                                # torch's own wrapper keeps dynamo out of the mode's frames
        assert dispatch_mode.ProbeMode._should_skip_dynamo() and not handed
    assert probed_frames == frames and all(name == __file__ for name in frames)
    assert {"aten.sin.default", "aten.sum.default"} <= recorded


def test_without_dynamos_frame_controls_the_mode_keeps_torchs_wrapper(monkeypatch):
    """A torch whose dynamo lacks the frame controls the mode uses (or has them in another shape)
    leaves the mode to torch's own wrapper: the check says so before the mode class is made."""
    import torch._C._dynamo.eval_frame as frames

    from dispatchprobe.torch import dispatch_mode
    from dispatchprobe.torch.internals import dynamo as dynamo_internals
    if not hasattr(frames, "set_code_exec_strategy"):     # an older torch (2.5, 2.6): torch's wrapper
        assert dynamo_internals.frame_controls() is None and dynamo_internals.frame_callback is None
        assert dispatch_mode.ProbeMode._should_skip_dynamo()
        return
    assert dynamo_internals.frame_controls() is frames and dynamo_internals.frame_callback is frames.get_eval_frame_callback
    assert not dispatch_mode.ProbeMode._should_skip_dynamo()

    def other_shape(*args):
        raise TypeError("takes no arguments")
    monkeypatch.setattr(frames, "_FrameExecStrategy", other_shape)
    assert dynamo_internals.frame_controls() is None
    monkeypatch.undo()
    monkeypatch.delattr(frames, "set_code_exec_strategy")
    assert dynamo_internals.frame_controls() is None
