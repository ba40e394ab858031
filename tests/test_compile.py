"""torch.compile: the eager probe keeps compiled code compiled; ``probe_backend`` records the
compiled graphs at eager granularity, through the same records, transparently."""

from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dispatchprobe import DispatchProbe, compare, load
from dispatchprobe.models import MLPNet, TinyTransformer, lm_batch, lm_loss
from dispatchprobe.torch.compile import probe_backend, requires

pytestmark = pytest.mark.probe_backend    # below the torch it needs, each test meets the one-line refusal


def _ops(path):
    return [json.loads(line) for line in open(path / "step0" / "rank0" / "ops.jsonl")]


def _aot_counting(runs: list):
    """An AOTAutograd backend whose compiled forward counts its calls (runs compiled or not?)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def fw(gm, example_inputs):
        def run(*args):
            runs.append(1)
            return gm(*args)
        return make_boxed_func(run)
    return aot_autograd(fw_compiler=fw, bw_compiler=lambda gm, ex: make_boxed_func(gm.forward))


class _Breaks(torch.nn.Module):
    """Two compiled regions around eager code (a function dynamo does not trace)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.b(_eager_part(torch.relu(self.a(x)))).sum()


@torch._dynamo.disable
def _eager_part(x):
    return torch.tanh(x)


def test_eager_probe_lets_compiled_code_run(tmp_path):
    torch.manual_seed(0)
    model = _Breaks()
    runs: list = []
    compiled = torch.compile(model, backend=_aot_counting(runs))
    x = torch.randn(4, 8)
    plain = compiled(x)
    plain.backward()
    plain_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    before = len(runs)
    with DispatchProbe(task="statistics", dump_path=str(tmp_path / "r")) as probe:
        probed = compiled(x)
        probed.backward()
    probe.close()
    assert torch.equal(probed, plain)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain_grads))
    ops = {(r["op"], r["stage"]) for r in _ops(tmp_path / "r")}
    if not hasattr(TorchDispatchMode, "ignore_compile_internals"):   # torch < 2.9 (docs/compile.md)
        assert len(runs) == before and ("aten.addmm.default", "forward") in ops      # it ran, recorded, eagerly
        return
    assert len(runs) == before + 2          # both compiled regions ran compiled under the probe
    assert ("aten.tanh.default", "forward") in ops          # the eager code between the graphs
    assert ("aten.tanh_backward.default", "backward") in ops
    assert not {op for op, _ in ops} & {"aten.addmm.default", "aten.relu.default", "aten.mm.default",
                                        "aten.threshold_backward.default"}   # inside the graphs


def _tiny():
    torch.manual_seed(0)
    return TinyTransformer(dim=32, layers=1, seq=16, vocab=64)


def _batch():
    return lm_batch(batch=2, seq=16, vocab=64)


def _plain_aot_eager(gm, example_inputs):
    """The uninstrumented reference of ``inner="aot_eager"``: inductor's decompositions and
    partitioner, graphs run eagerly."""
    from torch._inductor.compile_fx import compile_fx
    from dispatchprobe.torch.internals.inductor import eager_output

    with torch._functorch.config.patch(enable_autograd_cache=False):
        return compile_fx(gm, example_inputs, inner_compile=lambda g, ex, **kw: eager_output(g),
                          config_patches={"fx_graph_cache": False})


def test_probe_backend_records_forward_backward_and_aligns_with_eager(tmp_path):
    tokens, targets = _batch()
    model = _tiny()
    with DispatchProbe(task="statistics", dump_path=str(tmp_path / "eager")) as probe:
        lm_loss(model, tokens, targets).backward()
    probe.close()

    model = _tiny()
    backend = probe_backend(task="statistics", dump_path=str(tmp_path / "compiled"), inner="aot_eager")
    compiled = torch.compile(model, backend=backend)
    with DispatchProbe(task="statistics", dump_path=str(tmp_path / "compiled")) as probe:
        loss = lm_loss(compiled, tokens, targets)
        loss.backward()
    probe.close()
    backend.close()

    records = _ops(tmp_path / "compiled")
    kinds = [("C" if "compiled" in r else "E", r["stage"]) for r in records]
    # execution order: compiled forward graph, eager loss, eager loss backward, compiled backward graph
    first_eager = kinds.index(("E", "forward"))
    assert kinds[:first_eager] == [("C", "forward")] * first_eager and first_eager >= 20
    assert kinds.index(("E", "backward")) < kinds.index(("C", "backward"))
    by_op = {(r["op"], r["scope"], r["stage"]) for r in records if "compiled" in r}
    assert ("aten.addmm.default", "TinyTransformer.layers.0.mlp.up", "forward") in by_op
    assert ("aten.native_layer_norm.default", "TinyTransformer.layers.0.norm1", "forward") in by_op
    assert ("aten.mm.default", "TinyTransformer.layers.0.attn.qkv", "backward") in by_op
    assert ("aten.native_layer_norm_backward.default", "TinyTransformer.norm", "backward") in by_op
    assert all(set(o["stats"]) >= {"max", "min", "mean", "norm", "nan", "inf"}
               for r in records if "compiled" in r for o in r["outputs"] if o["type"] != "none")
    # a decomposed call is recorded as eager calls it: its traced arguments and its outputs by position
    norm = next(r for r in records if r["op"] == "aten.native_layer_norm.default" and "compiled" in r)
    assert norm["compiled"]["decomposed"] and norm["compiled"]["call"]
    x, shape, weight, bias, eps = norm["inputs"]
    assert [x["type"], weight["type"], bias["type"]] == ["tensor"] * 3 and x["stats"]["norm"] > 0
    assert shape == {"type": "list", "value": [{"type": "int", "value": 32}]} and eps["value"] == 1e-5
    assert [o["type"] for o in norm["outputs"]] == ["tensor"] * 3 and norm["outputs"][2]["shape"] == [2, 16, 1]

    table, verdict = compare(str(tmp_path / "compiled"), str(tmp_path / "eager"), out=str(tmp_path / "report"))
    assert verdict.forward is None and "no forward divergence" in str(verdict)
    paired = table[(table["op_a"] == "aten.native_layer_norm.default") & (table["scope"] == "TinyTransformer.layers.0.norm1")]
    assert set(paired["arg"]) == {"input.0", "input.2", "input.3", "output.0", "output.1", "output.2"}
    assert (paired["status"] == "pass").all()
    forward = table[table["stage"] == "forward"]
    assert len(forward) >= 30 and (forward["status"] != "error").all()
    # backward: every pair of the same op agrees; what differs is the decomposition dynamo traces
    # (``q, k, v = t`` is three selects, whose backward is select_backward + add, eager's is stack)
    backward = table[(table["stage"] == "backward") & (table["op_a"] == table["op_b"])]
    assert len(backward) >= 40 and (backward["status"] != "error").all()


@pytest.mark.parametrize("task", ["statistics", "tensor"])
def test_probe_backend_is_transparent_aot_eager(tmp_path, task):
    tokens, targets = _batch()
    results = []
    for backend in (_plain_aot_eager, probe_backend(task=task, dump_path=str(tmp_path / "c"), inner="aot_eager")):
        model = _tiny()
        compiled = torch.compile(model, backend=backend)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(2):
            loss = lm_loss(compiled, tokens, targets)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        results.append((losses, [p.detach().clone() for p in model.parameters()]))
    (la, pa), (lb, pb) = results
    assert all(torch.equal(a, b) for a, b in zip(la, lb))
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))


@pytest.mark.parametrize("cpu_stats", ["host", "graph"])
def test_probe_backend_inductor_transparent_and_recorded(tmp_path, monkeypatch, cpu_stats):
    """Inductor with the statistics read on the host, or computed in the graph: bit-identical
    outputs and gradients, two steps, no recompile."""
    monkeypatch.setenv("DISPATCHPROBE_COMPILED_CPU_STATS", cpu_stats)
    torch._dynamo.reset()          # plain inductor's graph compiled afresh for each parameter too
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    results = []
    backend = probe_backend(task="statistics", dump_path=str(tmp_path / "c"))
    from torch._dynamo.utils import counters
    for b in ("inductor", backend):
        torch.manual_seed(0)
        model = MLPNet(dim=32, depth=2, classes=4)
        compiled = torch.compile(model, backend=b)
        graphs = counters["stats"]["unique_graphs"]
        outs, grads = [], []
        for step in range(2):
            out = compiled(x)
            F.cross_entropy(out, torch.arange(16) % 4).backward()
            outs.append(out.detach())
            grads.append([p.grad.clone() for p in model.parameters()])
            model.zero_grad()
            if b is backend:
                backend.step()
        assert counters["stats"]["unique_graphs"] == graphs + 1     # compiled once for both steps
        results.append((outs, grads))
    backend.close()
    (oa, ga), (ob, gb) = results
    assert all(torch.equal(a, b) for a, b in zip(oa, ob))
    assert all(torch.equal(a, b) for sa, sb in zip(ga, gb) for a, b in zip(sa, sb))
    run = load(str(tmp_path / "c"))
    ops = run.ops
    for step in (0, 1):
        part = ops[ops["step"] == step]
        assert set(part["stage"]) == {"forward", "backward"}
        assert (part["op"] == "aten.addmm.default").sum() == 3
    eager = [r for r in _ops(tmp_path / "c") if r["op"] == "aten.addmm.default"][0]["outputs"][0]["stats"]
    with torch.no_grad():
        torch.manual_seed(0)
        ref = MLPNet(dim=32, depth=2, classes=4).body[0](x)
    assert eager["max"] == pytest.approx(ref.max().item(), rel=1e-6)
    assert eager["mean"] == pytest.approx(ref.mean().item(), rel=1e-4, abs=1e-6)
    assert eager["nan"] == 0 and eager["inf"] == 0
    # inductor provenance: each record names the generated kernels that computed it, and show lists them
    compiled = [r for r in _ops(tmp_path / "c")]
    assert all(r["compiled"]["kernels"] for r in compiled)
    assert all(k.startswith("extern_kernels.addmm:") for r in compiled if r["op"] == "aten.addmm.default"
               for k in r["compiled"]["kernels"])
    assert any(k.startswith("cpp_fused_") for r in compiled for k in r["compiled"]["kernels"])
    from dispatchprobe.offline.summary import matching_records
    rows = matching_records(run, "addmm")
    assert rows["kernels"].str.startswith("extern_kernels.addmm:").all()


# ---- a planted divergence: a custom op whose compiled decomposition differs from its eager kernel ----
@torch.library.custom_op("dptest::soft_act", mutates_args=())
def _soft_act(x: torch.Tensor) -> torch.Tensor:
    """Eager kernel: ``x * sigmoid(1.702 x)``."""
    return x * torch.sigmoid(1.702 * x)


@_soft_act.register_fake
def _(x):
    return torch.empty_like(x)


def _soft_act_backward(ctx, grad):
    x, = ctx.saved_tensors
    s = torch.sigmoid(1.702 * x)
    return grad * (s + 1.702 * x * s * (1 - s))


_soft_act.register_autograd(_soft_act_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]))


def _planted_decomposition(x):
    """What inductor computes instead: another slope (a wrong decomposition, planted)."""
    return x * torch.sigmoid(1.5 * x)


class _Act(torch.nn.Module):
    def forward(self, x):
        return torch.ops.dptest.soft_act(x)


class _Planted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.act = _Act()
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(self.act(self.a(x)))


def test_planted_divergence_named_with_scope(tmp_path, monkeypatch):
    """compare eager compiled names the custom op whose inductor decomposition differs, in its
    module, as the first forward divergence; backward differs only through it."""
    from torch._inductor import decomposition
    for table in (decomposition.decompositions, decomposition.fast_random_decomps()):   # the latter: a cached copy
        monkeypatch.setitem(table, torch.ops.dptest.soft_act.default, _planted_decomposition)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = _Planted()
    with DispatchProbe(task="statistics", dump_path=str(tmp_path / "eager")) as probe:
        model(x).sum().backward()
    probe.close()
    torch.manual_seed(0)
    model = _Planted()
    backend = probe_backend(task="statistics", dump_path=str(tmp_path / "compiled"))     # inductor
    compiled = torch.compile(model, backend=backend)
    with DispatchProbe(task="statistics", dump_path=str(tmp_path / "compiled")) as probe:
        compiled(x).sum().backward()
    probe.close()
    backend.close()
    act = [r for r in _ops(tmp_path / "compiled") if r["op"] == "dptest.soft_act.default"]
    assert len(act) == 1 and act[0]["compiled"]["decomposed"] and act[0]["scope"] == "_Planted.act"
    _, verdict = compare(str(tmp_path / "eager"), str(tmp_path / "compiled"))
    div = verdict.forward
    assert (div.op, div.scope, div.stage, div.cause) == ("dptest.soft_act.default", "_Planted.act", "forward", "op")
    assert verdict.backward is None or verdict.backward.cause == "inherited"


@pytest.mark.parametrize("inner", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_hf_llama_compiled_agrees_with_eager(tmp_path, inner):
    """A transformers Llama (tiny config, random init, its causal mask at finfo.min), eager vs the
    probe backend: every paired record agrees; what stays unpaired is what dynamo traces
    differently (mask and position arithmetic, gradient accumulation, reordered bmm).  With
    inductor the compared values are those its kernels computed (about 90 s, mostly compiling)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation="eager")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with DispatchProbe(task="statistics", dump_path=str(tmp_path / "eager")) as probe:
        model(input_ids=ids, labels=ids).loss.backward()
    probe.close()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    backend = probe_backend(task="statistics", dump_path=str(tmp_path / "compiled"), inner=inner)
    compiled = torch.compile(model, backend=backend)
    with DispatchProbe(task="statistics", dump_path=str(tmp_path / "compiled")) as probe:
        compiled(input_ids=ids, labels=ids).loss.backward()
    probe.close()
    backend.close()
    records = [r for r in _ops(tmp_path / "compiled") if "compiled" in r]
    scopes = {(r["op"], r["scope"], r["stage"]) for r in records}
    assert ("aten.mm.default", "LlamaForCausalLM.model.layers.1.mlp.down_proj", "forward") in scopes
    assert ("aten.mm.default", "LlamaForCausalLM.model.layers.0.self_attn.q_proj", "backward") in scopes
    # the mask's float32 sums overflow unless the in-graph statistics accumulate in float64
    mask = next(r for r in records if r["op"] == "aten.where.self")["outputs"][0]["stats"]
    assert mask["min"] == torch.finfo(torch.float32).min and mask["mean"] > -1e39 and mask["norm"] < 1e41
    table, verdict = compare(str(tmp_path / "eager"), str(tmp_path / "compiled"))
    assert verdict.forward is None and verdict.backward is None and "the runs agree" in str(verdict)
    assert len(table) > 500 and (table["status"] != "error").all()
    loose = verdict.unmatched
    forward = set(loose[loose["stage"] == "forward"]["op"])
    position = {"aten.arange.default", "aten.add.Tensor", "aten.cat.default"}
    if requires.release(requires.installed_torch()) >= (2, 14):     # its dynamo unpairs the rotary embedding's too
        position |= {"aten.mul.Tensor", "aten.sin.default", "aten.cos.default"}
    assert forward <= position, forward
    assert len(loose) < 0.2 * len(table)


def _planted_lowering(x):
    """Inductor's kernel for ``dptest::soft_act`` with another slope (a wrong lowering, planted)."""
    from torch._inductor.lowering import lowerings
    aten = torch.ops.aten
    return lowerings[aten.mul.Tensor](x, lowerings[aten.sigmoid.default](lowerings[aten.mul.Tensor](x, 1.5)))


def test_tensor_task_compiled_and_run_ut_judges_the_compiled_kernels(tmp_path, monkeypatch):
    """task tensor saves the values the inductor kernels computed; run-ut judges those against its
    float64 benchmark of the recorded inputs, so a wrong lowering is an error there; decomposed calls
    are replayed from their traced arguments."""
    from torch._inductor import lowering
    from dispatchprobe import run_ut
    from dispatchprobe.torch.replay import TensorSource

    monkeypatch.setitem(lowering.lowerings, torch.ops.dptest.soft_act.default, _planted_lowering)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = _Planted()
    backend = probe_backend(task="tensor", dump_path=str(tmp_path / "c"))
    torch.compile(model, backend=backend)(x).sum().backward()
    backend.close()
    records = _ops(tmp_path / "c")
    first = records[0]
    assert first["op"] == "aten.addmm.default" and all(s.get("data") for s in first["inputs"] + first["outputs"])
    source = TensorSource(load(str(tmp_path / "c")).parts[(0, 0)])
    torch.testing.assert_close(source.get(first["outputs"][0]["data"]), model.a(x).detach())
    torch.testing.assert_close(source.get(first["inputs"][1]["data"]), x)
    res = run_ut(str(tmp_path / "c"), str(tmp_path / "ut"), progress=False).results
    verdicts = res["Forward Test Success"] + res["Backward Test Success"]
    status = dict(zip(res["API Name"], verdicts))
    assert status["dptest.soft_act.default.0.forward"] == "error"
    assert status["aten.addmm.default.1.forward"] == "pass" and status["aten.mm.default.0.backward"] == "pass"
    assert status["aten.rsub.Scalar.0.backward"] == "pass"          # decomposed by inductor
    others = ~res["API Name"].str.startswith("dptest")
    assert (verdicts[others] == "pass").all() and others.sum() >= 10


class _Normed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(F.gelu(self.norm(self.a(x))))


def test_decomposed_calls_recorded_with_their_arguments_and_replayed(tmp_path):
    """Layer norm and gelu, decomposed by inductor's table: their records hold the traced call
    (tensors, normalized_shape, eps) and every output by position, so run-ut replays them; an
    argument the graph no longer reads (the backward uses the forward's saved values) is a SKIP
    saying so."""
    from dispatchprobe import run_ut
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = _Normed()
    backend = probe_backend(task="tensor", dump_path=str(tmp_path / "c"), inner="aot_eager")
    torch.compile(model, backend=backend)(x).sum().backward()
    backend.close()
    records = {r["name"]: r for r in _ops(tmp_path / "c")}
    norm = records["aten.native_layer_norm.default.0.forward"]
    assert norm["compiled"] == {**norm["compiled"], "decomposed": True, "call": True}
    assert [v["type"] for v in norm["inputs"]] == ["tensor", "list", "tensor", "tensor", "float"]
    assert all(v.get("data") for v in norm["outputs"]) and norm["output_type"] == "tuple"
    res = run_ut(str(tmp_path / "c"), str(tmp_path / "ut"), progress=False).results
    verdicts = res["Forward Test Success"] + res["Backward Test Success"]
    status = dict(zip(res["API Name"], verdicts))
    message = dict(zip(res["API Name"], res["Message"]))
    assert status["aten.native_layer_norm.default.0.forward"] == "pass"
    assert status["aten.gelu.default.0.forward"] == "pass" and status["aten.gelu_backward.default.0.backward"] == "pass"
    backward = "aten.native_layer_norm_backward.default.0.backward"
    assert status[backward] == "pass" or (status[backward] == "SKIP"
                                          and "is not in the compiled graph" in message[backward])
    assert (verdicts.isin(["pass", "SKIP"])).all() and (verdicts == "pass").sum() >= 8


class _Overflows(torch.nn.Module):
    """exp overflows float32 in forward (finite in float64); clamp hides it from what follows."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 1)

    def forward(self, x):
        h = self.a(x)
        return self.b(torch.exp(h * 40).clamp(max=1.0) + torch.tanh(h))


def test_overflow_task_compiled_finds_the_op_and_reruns_it_eagerly(tmp_path):
    """task overflow in an inductor graph: the first call making inf from finite values is found
    in the graph's statistics; the graph re-run eagerly names the node, saves its inputs, replays
    it in float64 (precision: float64 stays finite) and stops the run as the eager check does."""
    from dispatchprobe.core.overflow import OverflowDetected
    torch.manual_seed(0)
    model = _Overflows()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)) * 3
    backend = probe_backend(task="overflow", dump_path=str(tmp_path / "o"))
    with pytest.raises(OverflowDetected, match=r"overflow in aten\.exp\.default \(forward.*float64 replay: precision"):
        torch.compile(model, backend=backend)(x).sum().backward()
    backend.close()
    compiled, rerun = _ops(tmp_path / "o")
    assert compiled["op"] == rerun["op"] == "aten.exp.default"
    # one op identity: the eager re-run keeps the hit's call index and says which record it re-runs
    assert compiled["name"] == rerun["name"] == "aten.exp.default.0.forward"
    assert rerun["compiled"] == {"graph": compiled["compiled"]["graph"], "rerun_of": compiled["name"],
                                 "nodes": ["exp"], "rerun": True}
    from dispatchprobe.offline.summary import summarize
    text = summarize(load(str(tmp_path / "o")))
    assert "op calls   forward 1 " in text and "re-runs    1 " in text
    assert compiled["scope"] == rerun["scope"] == "_Overflows"
    assert compiled["compiled"]["nodes"] == ["exp"] and compiled["overflow"]["inf"] > 0
    assert compiled["inputs"][0]["stats"]["inf"] == 0
    assert rerun["overflow"]["class"] == "critical" and rerun["overflow"]["replay"] == "precision"
    saved = load(str(tmp_path / "o")).parts[(0, 0)]
    assert rerun["inputs"][0]["data"] and saved.has_tensor(rerun["inputs"][0]["data"])
    csv = (tmp_path / "o" / "step0" / "rank0" / "overflow.csv").read_text().splitlines()
    assert len(csv) == 2 and ",critical,forward,aten.exp.default," in csv[1]
    # compare counts the pair once: the run against itself pairs the hit, leaves nothing unmatched
    table, verdict = compare(str(tmp_path / "o"), str(tmp_path / "o"))
    assert len(verdict.unmatched) == 0 and set(table["name_a"]) == {"aten.exp.default.0.forward"}


def test_overflow_task_compiled_ignores_inf_given_to_ops(tmp_path):
    """masked_fill(mask, -inf) in every attention layer, and softmax over it, is no overflow: a
    step of the tiny transformer records nothing and runs as without the probe."""
    tokens, targets = _batch()
    model = _tiny()
    backend = probe_backend(task="overflow", dump_path=str(tmp_path / "o"), inner="aot_eager",
                            overflow={"overflow_nums": -1})
    loss = lm_loss(torch.compile(model, backend=backend), tokens, targets)
    loss.backward()
    backend.close()
    assert torch.isfinite(loss)
    ops_file = tmp_path / "o" / "step0" / "rank0" / "ops.jsonl"
    assert not ops_file.exists() or ops_file.read_text() == ""


class _Masked(torch.nn.Module):
    """A causal mask: scores holding -inf (with finite values), softmax over them."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        scores = self.proj(x) @ x.transpose(-1, -2)
        causal = torch.ones(6, 6, dtype=torch.bool).triu(1)
        return torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1).sum()


def _eager_and_compiled(tmp_path, model, x, inner, backward=False):
    """Statistics records of ``model(x)`` eagerly (``tmp_path/e``) and through the probe backend
    (``tmp_path/c``); ``backward``: of ``model(x).backward()``."""
    def run(m):
        out = m(x)
        if backward:
            out.backward()
    with DispatchProbe(task="statistics", dump_path=str(tmp_path / "e")) as probe:
        run(model)
    probe.close()
    backend = probe_backend(task="statistics", dump_path=str(tmp_path / "c"), inner=inner)
    run(torch.compile(model, backend=backend))
    backend.close()
    return tmp_path / "e", tmp_path / "c"


# where a CPU value's statistics are computed in compiled code: on the host (the default), or by
# reductions inside the graph (DISPATCHPROBE_COMPILED_CPU_STATS=graph); both must equal eager's
_INNER_AND_CPU_STATS = pytest.mark.parametrize("inner,cpu_stats", [("inductor", "host"), ("aot_eager", "host"),
                                                                   ("inductor", "graph")])


@_INNER_AND_CPU_STATS
def test_compiled_statistics_of_nonfinite_values_match_eager(tmp_path, monkeypatch, inner, cpu_stats):
    """Values holding -inf get finite_max/finite_min in compiled records too (computed in the
    graph), so the compiled record of a causal mask's output equals the eager one."""
    monkeypatch.setenv("DISPATCHPROBE_COMPILED_CPU_STATS", cpu_stats)
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    _eager_and_compiled(tmp_path, _Masked(), x, inner, backward=True)

    def masked(path):
        rec = next(r for r in _ops(path) if r["op"] == "aten.masked_fill.Scalar" and r["stage"] == "forward")
        return rec["outputs"][0]["stats"]
    eager, compiled = masked(tmp_path / "e"), masked(tmp_path / "c")
    assert eager["inf"] == 2 * 15 and "finite_max" in eager
    assert set(compiled) == set(eager)
    for key, value in eager.items():
        assert compiled[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    # finite values keep the plain row: no finite_max where eager has none
    finite = [o["stats"] for r in _ops(tmp_path / "c") for o in r["outputs"] if o["type"] == "tensor"]
    assert all(("finite_max" in s) == (s["inf"] + s["nan"] > 0) for s in finite)


def test_node_granularity_records_each_post_grad_node(tmp_path):
    """granularity="node": one record per post-grad node, named by the node's own op (layer
    norm's decomposition appears as its nodes, each saying the eager op it comes from)."""
    with pytest.raises(ValueError, match="granularity"):
        probe_backend(task="statistics", dump_path=str(tmp_path / "x"), granularity="kernel")
    tokens, targets = _batch()
    backend = probe_backend(task="statistics", dump_path=str(tmp_path / "n"), inner="aot_eager", granularity="node")
    lm_loss(torch.compile(_tiny(), backend=backend), tokens, targets).backward()
    backend.close()
    records = [r for r in _ops(tmp_path / "n") if "compiled" in r]
    # one node each (with the getitems of a multi-output node, such as var_mean's)
    assert all(not r["compiled"]["decomposed"] and all(n.startswith("getitem") for n in r["compiled"]["nodes"][1:])
               for r in records)
    assert len(records) >= 100
    ops_seen = {r["op"] for r in records}
    assert "aten.native_layer_norm.default" not in ops_seen and "aten.rsqrt.default" in ops_seen
    rsqrt = next(r for r in records if r["op"] == "aten.rsqrt.default" and r["stage"] == "forward")
    assert rsqrt["compiled"]["original_aten"] == "aten.native_layer_norm.default"
    assert rsqrt["scope"] == "TinyTransformer.layers.0.norm1" and rsqrt["inputs"][0]["type"] == "tensor"
    assert {r["stage"] for r in records} == {"forward", "backward"}


class _NonFinite(torch.nn.Module):
    """nan and -inf (log), +inf (reciprocal), inf - inf (add), a tensor of infinities only (exp)."""

    def forward(self, x):
        return torch.log(x) + torch.reciprocal(x) + torch.exp(x.abs() * 1e4 + 1e4).sum()


@_INNER_AND_CPU_STATS
def test_compiled_statistics_of_nan_and_inf_mixes_match_eager(tmp_path, monkeypatch, inner, cpu_stats):
    """inductor on a CPU counts nan/inf outside the graph, only for values whose sum of squares
    is not finite: the records equal eager's all the same."""
    monkeypatch.setenv("DISPATCHPROBE_COMPILED_CPU_STATS", cpu_stats)
    x = torch.tensor([[-1.0, 0.0, 2.0], [0.5, 3.0, 0.0]])
    _eager_and_compiled(tmp_path, _NonFinite(), x, inner)

    def outputs(path):
        return {r["op"]: r["outputs"][0]["stats"] for r in _ops(path) if r["outputs"][0]["type"] == "tensor"}
    eager, compiled = outputs(tmp_path / "e"), outputs(tmp_path / "c")
    checked = 0
    for op in ("aten.log.default", "aten.reciprocal.default", "aten.add.Tensor", "aten.exp.default"):
        if op not in eager or op not in compiled:
            continue
        assert set(compiled[op]) == set(eager[op]), op
        for key, value in eager[op].items():
            assert compiled[op][key] == pytest.approx(value, rel=1e-5, nan_ok=True), (op, key)
        checked += 1
    assert checked == 4 and eager["aten.exp.default"]["inf"] == 6 and "finite_max" not in eager["aten.exp.default"]


class _BigMask(torch.nn.Module):
    """A causal mask at finfo.min over 2 x 128 x 128 values: its float32 sums overflow."""

    def forward(self, x):
        causal = torch.ones(128, 128, dtype=torch.bool).triu(1)
        return torch.zeros_like(x).masked_fill(causal, torch.finfo(torch.float32).min) + x


@_INNER_AND_CPU_STATS
def test_overflowed_sums_of_finite_values_are_redone_in_float64(tmp_path, monkeypatch, inner, cpu_stats):
    """Finite values whose float32 sum or sum of squares overflows (a large mask at finfo.min) get
    a finite mean and norm, eager and compiled alike (the compiled CPU path redoes them from the
    tensor with the eager probe's code)."""
    monkeypatch.setenv("DISPATCHPROBE_COMPILED_CPU_STATS", cpu_stats)
    x = torch.randn(2, 128, 128, generator=torch.Generator().manual_seed(0))
    _eager_and_compiled(tmp_path, _BigMask(), x, inner)

    def mask(path):
        return next(r for r in _ops(path) if r["op"] == "aten.masked_fill.Scalar")["outputs"][0]["stats"]
    eager, compiled = mask(tmp_path / "e"), mask(tmp_path / "c")
    n_masked = 2 * 127 * 128 // 2
    assert eager["mean"] == pytest.approx(torch.finfo(torch.float32).min * n_masked / x.numel(), rel=1e-6)
    assert math.isfinite(eager["norm"]) and eager["nan"] == eager["inf"] == 0 and "finite_max" not in eager
    assert set(compiled) == set(eager)
    for key, value in eager.items():
        assert compiled[key] == pytest.approx(value, rel=1e-6), key


def test_dynamic_shapes_each_call_records_its_own_shapes(tmp_path):
    """dynamic=True: one graph serves two sequence lengths; each call's records carry that call's
    shapes (from the graph's symbolic sizes) and statistics over them, so the second step of the
    compiled run agrees with the second step of an eager one."""
    batches = [lm_batch(batch=2, seq=seq, vocab=64) for seq in (8, 12)]
    model = _tiny()
    probe = DispatchProbe(task="statistics", dump_path=str(tmp_path / "eager"))
    for tokens, targets in batches:
        with probe:
            lm_loss(model, tokens, targets).backward()
        probe.step()
    probe.close()
    model = _tiny()
    backend = probe_backend(task="statistics", dump_path=str(tmp_path / "compiled"))
    compiled = torch.compile(model, backend=backend, dynamic=True)
    for tokens, targets in batches:
        lm_loss(compiled, tokens, targets).backward()
        backend.step()
    backend.close()
    graphs = {r["compiled"]["graph"] for step in ("step0", "step1")
              for r in (json.loads(line) for line in open(tmp_path / "compiled" / step / "rank0" / "ops.jsonl"))
              if "compiled" in r}
    assert len(graphs) == 2           # one forward and one backward graph served both lengths
    later = [json.loads(line) for line in open(tmp_path / "compiled" / "step1" / "rank0" / "ops.jsonl")]
    up = next(r for r in later if r["op"] == "aten.addmm.default" and r["scope"] == "TinyTransformer.layers.0.mlp.up")
    assert up["outputs"][0]["shape"][0] == 2 * 12
    table, verdict = compare(str(tmp_path / "compiled" / "step1" / "rank0"), str(tmp_path / "eager" / "step1" / "rank0"))
    assert verdict.forward is None
    forward = table[table["stage"] == "forward"]
    assert len(forward) >= 30 and (forward["status"] != "error").all()
    # backward: pairs of the same op agree (test_probe_backend_records_forward_backward_and_aligns_with_eager)
    backward = table[(table["stage"] == "backward") & (table["op_a"] == table["op_b"])]
    assert len(backward) >= 40 and (backward["status"] != "error").all()


def test_node_granularity_tensor_task_saves_each_nodes_values_and_run_ut_replays_them(tmp_path):
    """granularity="node" with task tensor under inductor: each post-grad node's saved output is
    what its saved inputs give (rsqrt of layer norm's variance), and run-ut replays the node records."""
    from dispatchprobe import run_ut
    from dispatchprobe.torch.replay import TensorSource

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    backend = probe_backend(task="tensor", dump_path=str(tmp_path / "n"), granularity="node")
    torch.compile(_Normed(), backend=backend)(x).sum().backward()
    backend.close()
    records = [r for r in _ops(tmp_path / "n") if "compiled" in r]
    source = TensorSource(load(str(tmp_path / "n")).parts[(0, 0)])
    rsqrt = next(r for r in records if r["op"] == "aten.rsqrt.default" and r["stage"] == "forward")
    assert rsqrt["compiled"]["original_aten"] == "aten.native_layer_norm.default" and rsqrt["scope"] == "_Normed.norm"
    torch.testing.assert_close(source.get(rsqrt["outputs"][0]["data"]), torch.rsqrt(source.get(rsqrt["inputs"][0]["data"])))
    res = run_ut(str(tmp_path / "n"), str(tmp_path / "ut"), progress=False).results
    verdicts = res["Forward Test Success"] + res["Backward Test Success"]
    assert len(res) >= 10 and (verdicts == "pass").all()


def _llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _scopes(path, compiled: bool) -> set:
    return {(r["op"], r["scope"], r["stage"]) for r in _ops(path) if ("compiled" in r) == compiled}


@pytest.mark.parametrize("keywords", [True, False])
def test_probe_backend_alone_names_scopes_as_eager(tmp_path, keywords):
    """probe_backend without a DispatchProbe, on HF Llama (whose decorated ``forward`` puts
    ``self`` in ``args``: scopes must not follow the frame's shape), called with keyword or
    positional inputs: every compiled record's scope is one eager gives, and the runs compare."""
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    model = _llama()
    with DispatchProbe(task="statistics", dump_path=str(tmp_path / "eager")) as probe:
        model(input_ids=ids, labels=ids).loss.backward()
    probe.close()
    model = _llama()
    backend = probe_backend(task="statistics", dump_path=str(tmp_path / "compiled"), inner="aot_eager")
    compiled = torch.compile(model, backend=backend)
    out = compiled(input_ids=ids, labels=ids) if keywords else compiled(ids, None, None, None, None, ids)
    out.loss.backward()
    backend.close()
    eager = {scope for _, scope, _ in _scopes(tmp_path / "eager", False)}
    got = {scope for _, scope, _ in _scopes(tmp_path / "compiled", True)}
    assert "LlamaForCausalLM.model.layers.0.mlp.down_proj" in got and "LlamaForCausalLM" in got
    assert got <= eager, got - eager
    _, verdict = compare(str(tmp_path / "eager"), str(tmp_path / "compiled"))
    assert "the runs agree" in str(verdict)


class _BreaksInside(torch.nn.Module):
    """A graph break inside a submodule's forward: the code after it is a frame of that submodule."""

    def __init__(self):
        super().__init__()
        self.inner = _Breaks()
        self.head = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.head(x).relu().sum() + self.inner(x)


def test_probe_backend_alone_scopes_across_graph_breaks(tmp_path):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = _BreaksInside()
    with DispatchProbe(task="statistics", dump_path=str(tmp_path / "eager")) as probe:
        model(x).backward()
    probe.close()
    torch.manual_seed(0)
    model = _BreaksInside()
    backend = probe_backend(task="statistics", dump_path=str(tmp_path / "compiled"), inner="aot_eager")
    torch.compile(model, backend=backend)(x).backward()
    backend.close()
    eager, got = _scopes(tmp_path / "eager", False), _scopes(tmp_path / "compiled", True)
    assert ("aten.addmm.default", "_BreaksInside.inner.b", "forward") in got
    assert ("aten.addmm.default", "_BreaksInside.inner.a", "forward") in got
    assert ("aten.mm.default", "_BreaksInside.head", "backward") in got
    assert {s for _, s, _ in got} <= {s for _, s, _ in eager}
    _, verdict = compare(str(tmp_path / "eager"), str(tmp_path / "compiled"))
    assert "the runs agree" in str(verdict)


class _DataDependent(torch.nn.Module):
    """``nonzero`` inside a submodule: dynamo breaks the graph there and runs it eagerly, inside the
    submodule's call."""

    def __init__(self):
        super().__init__()
        self.lin, self.lin2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        rows = torch.nonzero(y[:, 0] > 0).squeeze(1)
        return self.lin2(y.index_add(0, rows, torch.ones(rows.numel(), 8))).tanh()


class _Wraps(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.pre, self.block, self.post = torch.nn.Linear(8, 8), _DataDependent(), torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.post(self.block(self.pre(x).relu()))


def test_an_op_a_graph_break_runs_is_scoped_as_eager_scopes_it(tmp_path):
    """The eager probe around a model compiled with probe_backend: the op a graph break runs
    eagerly is filed under the module it runs in (the hooks of modules dynamo runs do not say it),
    as the eager run files it, so the runs align and agree (both orders)."""
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    for name, compiled in (("eager", False), ("compiled", True)):
        torch.manual_seed(0)
        model = _Wraps()
        step = torch.compile(model, backend=probe_backend(task="statistics", dump_path=str(tmp_path / name),
                                                          inner="aot_eager")) if compiled else model
        probe = DispatchProbe(task="statistics", dump_path=str(tmp_path / name))
        for _ in range(2):
            with probe:
                step(x).square().mean().backward()
            probe.step()
        probe.close()
    eager, got = _scopes(tmp_path / "eager", False), _scopes(tmp_path / "compiled", False)
    assert ("aten.nonzero.default", "_Wraps.block", "forward") in got
    assert ("aten.nonzero.default", "_Wraps.block", "forward") in eager
    assert not any(scope.startswith("OptimizedModule") for _, scope, _ in got)
    for a, b in (("eager", "compiled"), ("compiled", "eager")):
        _, verdict = compare(str(tmp_path / a), str(tmp_path / b))
        assert verdict.passed and verdict.aligned > 0.9, str(verdict)


def test_steps_follow_the_optimizer_in_both_capture_paths(tmp_path):
    """Three training steps, no step() call anywhere: the eager probe and probe_backend alone
    each write step0..step2 (the optimizer's steps), and compare pairs every step."""
    ids = [torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(s)) for s in range(3)]

    def run(path, compiled: bool):
        model = _llama()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if compiled:
            probe = probe_backend(task="statistics", dump_path=str(path), inner="aot_eager")
            forward, around = torch.compile(model, backend=probe), contextlib.nullcontext()
        else:
            forward = model
            probe = around = DispatchProbe(task="statistics", dump_path=str(path))
        for batch in ids:
            with around:
                forward(input_ids=batch, labels=batch).loss.backward()
            opt.step()
            opt.zero_grad()
        probe.close()

    run(tmp_path / "eager", False)
    run(tmp_path / "compiled", True)
    for name in ("eager", "compiled"):
        assert sorted(load(tmp_path / name).parts) == [(0, 0), (1, 0), (2, 0)]
    table, verdict = compare(str(tmp_path / "eager"), str(tmp_path / "compiled"))
    assert verdict.parts == [(s, 0) for s in range(3)] and "the runs agree" in str(verdict)
    assert set(table["step"]) == {0, 1, 2}


# ---- probe_backend keeps inductor's decisions: real eager-vs-inductor differences stay visible ----
def _index_add_into_expand(src, idx):
    """pytorch#183986: inductor's reinplacing writes into the expanded zeros' one row."""
    return torch.zeros(1, 8).expand(4, -1).index_add(0, idx, src)


def _bf16_division(Y, y):
    """pytorch#141436: inductor keeps ``y.to(bf16)`` in float32 inside the fused division."""
    return Y / y.to(Y.dtype).unsqueeze(-1)


class _GatedChunks(torch.nn.Module):
    """pytorch#168186: a bf16 product whose chunks are added; inductor fuses without rounding it."""

    def __init__(self, dim=32):
        super().__init__()
        self.p_in = torch.nn.Linear(dim, 2 * dim, bias=False)
        self.g_in = torch.nn.Linear(dim, 2 * dim, bias=False)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a, b = torch.chunk(self.p_in(x) * self.g_in(x), 2, dim=-1)
            return a + b


def _repro(name):
    g = torch.Generator().manual_seed(0)
    if name == "index_add":
        return _index_add_into_expand, (torch.ones(3, 8), torch.tensor([0, 1, 0])), "aten.index_add.default"
    if name == "division":
        return _bf16_division, (torch.randn(1, 6, 32, 4, 32, generator=g).bfloat16(),
                                torch.randn(1, 6, 32, 4, generator=g)), "aten.div.Tensor"
    torch.manual_seed(0)
    return _GatedChunks(), (torch.randn(4, 16, 32, generator=g),), "aten.add.Tensor"


@pytest.mark.parametrize("name", ["index_add", "division", "chunks"])
def test_probe_backend_outputs_are_plain_inductors(tmp_path, name):
    """Real eager-vs-inductor differences from PyTorch's tracker: probe_backend's outputs equal
    plain inductor's bitwise under the statistics and tensor tasks (its reads must not block the
    reinplacing or change what inductor stores in bf16), both differ from eager, and compare
    names the op whose output differs, and only it (its inputs recorded as inductor stored them)."""
    fn, args, op = _repro(name)
    eager = fn(*args)
    torch._dynamo.reset()
    plain = torch.compile(fn, backend="inductor")(*args)
    fixed = torch.equal(plain, eager)       # a torch whose inductor has the fix (pytorch#183986: torch 2.14)
    with DispatchProbe(task="tensor", dump_path=str(tmp_path / "eager")) as probe:
        fn(*args)
    probe.close()
    for task in ("statistics", "tensor"):
        torch._dynamo.reset()
        backend = probe_backend(task=task, dump_path=str(tmp_path / task))
        probed = torch.compile(fn, backend=backend)(*args)
        backend.close()
        assert torch.equal(probed, plain), task
    torch._dynamo.reset()
    table, verdict = compare(str(tmp_path / "eager"), str(tmp_path / "tensor"))
    differ = table[table["status"] != "pass"]
    if fixed:                                # eager and compiled agree there, and compare says so
        assert differ.empty and verdict.forward is None, differ
        return
    assert set(differ["op_a"]) == {op} and set(differ["arg"]) == {"output.0"}, differ
    assert verdict.forward is None or verdict.forward.op == op


def _rotary(g, freq):
    """A rotary embedding's backward shape: ``g * sin`` stored only because the probe reads it,
    in the loop of the kernel that adds ``g * cos``."""
    g = g.transpose(1, 2)
    pos = torch.arange(g.shape[2], dtype=torch.float32)[:, None] * freq
    emb = torch.cat([pos, pos], -1)
    t = g * emb.sin()
    a, b = t[..., :8], t[..., 8:]
    return torch.cat([-b, a], -1) + g * emb.cos()


def test_values_stored_for_the_probe_leave_the_users_kernels_as_they_are(tmp_path):
    """A value inductor computes inline but the probe reads is stored by a kernel of its own: fused
    into the user's kernel, its store made inductor generate that loop without vectors, whose
    scalar ``cos`` differs from the vectorised one in the last bit (1.9e-6 here)."""
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(2, 8, 2, 16, generator=g) * 10, torch.rand(8, generator=g) * 3)
    torch._dynamo.reset()
    plain = torch.compile(_rotary, backend="inductor")(*args)
    for task in ("statistics", "tensor"):
        torch._dynamo.reset()
        backend = probe_backend(task=task, dump_path=str(tmp_path / task))
        probed = torch.compile(_rotary, backend=backend)(*args)
        backend.close()
        assert torch.equal(probed, plain), (task, (probed - plain).abs().max())
        assert any(r["op"] == "aten.sin.default" for r in _ops(tmp_path / task))
    torch._dynamo.reset()


def test_a_second_compile_in_one_process_records_as_the_first(tmp_path, monkeypatch):
    """A notebook: the README's compile cell (its DispatchProbe entered and never closed, its
    backend never closed), then docs/compile.md's cells in another folder, the same relative
    dump_path, a new model of the same class and a new backend, no ``torch._dynamo.reset()``.
    The second run records what the first did and aligns with an eager run; nothing of the first
    probe stays installed (module hooks, optimizer hooks, torch's global-hooks warning)."""
    import gc
    import warnings

    from torch.nn.modules import module as torch_module
    from torch.optim import optimizer as torch_optimizer

    tokens, targets = _batch()
    optimizer_hooks = (dict(torch_optimizer._global_optimizer_pre_hooks),
                       dict(torch_optimizer._global_optimizer_post_hooks))

    def readme_cell():
        model = torch.compile(_tiny(), backend=probe_backend(task="statistics", dump_path="runs/compiled",
                                                              inner="aot_eager"))
        with DispatchProbe(task="statistics", dump_path="runs/compiled"):
            lm_loss(model, tokens, targets).backward()

    (tmp_path / "a").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    readme_cell()
    gc.collect()
    assert not torch_module._global_forward_hooks and not torch_module._global_forward_pre_hooks
    assert (dict(torch_optimizer._global_optimizer_pre_hooks),
            dict(torch_optimizer._global_optimizer_post_hooks)) == optimizer_hooks

    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "b")
    with DispatchProbe(task="statistics", dump_path="runs/eager") as probe:
        lm_loss(_tiny(), tokens, targets).backward()
    probe.close()
    backend = probe_backend(task="statistics", dump_path="runs/compiled", inner="aot_eager")
    model = torch.compile(_tiny(), backend=backend)
    probe = DispatchProbe(task="statistics", dump_path="runs/compiled")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            with probe:
                lm_loss(model, tokens, targets).backward()
            probe.step()
    probe.close()
    backend.close()
    assert not [w for w in seen if "global hooks" in str(w.message)], [str(w.message) for w in seen]

    def calls(path, step=0):
        rows = [json.loads(line) for line in open(path / f"step{step}" / "rank0" / "ops.jsonl")]
        return [(r["op"], r["scope"], r["stage"], "compiled" in r) for r in rows]
    first = calls(tmp_path / "a" / "runs/compiled")
    assert sum(c[3] for c in first) >= 40
    assert calls(tmp_path / "b" / "runs/compiled") == first
    # step 1 adds eager gradient accumulation (no zero_grad); its compiled records are step 0's
    assert [c for c in calls(tmp_path / "b" / "runs/compiled", 1) if c[3]] == [c for c in first if c[3]]
    table, verdict = compare(str(tmp_path / "b" / "runs/compiled/step0"), str(tmp_path / "b" / "runs/eager/step0"))
    assert verdict.forward is None and "do not align" not in str(verdict), str(verdict)
    forward = table[table["stage"] == "forward"]
    assert len(forward) >= 30 and (forward["status"] != "error").all()


def _run_cached(script: str, tmp_path, name: str) -> tuple[dict, dict]:
    """``script`` in a new process writing to ``tmp_path/name``, on the torch cache dir
    ``tmp_path/cache``: (its inductor and AOTAutograd counters, {ops.jsonl path: text})."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / name)], env=env,
                          capture_output=True, text=True)
    refused = [line for line in done.stderr.splitlines() if line.startswith("RuntimeError: probe_backend needs torch")]
    if done.returncode and refused:           # the script's probe_backend refused this torch
        raise RuntimeError(refused[-1].removeprefix("RuntimeError: "))
    done.check_returncode()
    out = tmp_path / name
    return (json.loads(done.stdout.strip().splitlines()[-1]),
            {str(p.relative_to(out)): p.read_text() for p in sorted(out.rglob("ops.jsonl"))})


_CACHED_RUN = """
import json, sys, torch
from torch._dynamo.utils import counters
from dispatchprobe import probe_backend
from dispatchprobe.models import TinyTransformer, lm_batch, lm_loss
torch.manual_seed(0)
model = TinyTransformer(vocab=64, dim=32, heads=2, layers=1, seq=16)
tokens, targets = lm_batch(batch=2, seq=16, vocab=64)
backend = probe_backend(task="statistics", dump_path=sys.argv[1])
compiled = torch.compile(model, backend=backend)
for _ in range(2):
    lm_loss(compiled, tokens, targets).backward()
    backend.step()
backend.close()
print(json.dumps({**counters["inductor"], **counters["aot_autograd"]}))
"""


def _schedules(monkeypatch) -> list:
    """The schedules the probe's graphs are compiled with, as (the probe's?, ends the kernel?) per
    scheduled node, noted from the real placement as inductor compiles."""
    requires.require_torch()          # the inductor internals the placement reads need the torch probe_backend needs
    from dispatchprobe.torch.internals import inductor as internals
    noted: list = []
    placed = internals.placed_apart

    def noting(nodes, ours):
        out = placed(nodes, ours)
        if out is not None:
            noted.append([(bool(ours(n)), internals._ends_kernel(n)) for n in out])
        return out
    monkeypatch.setattr(internals, "placed_apart", noting)
    return noted


def test_probe_calls_run_where_the_users_kernels_end(tmp_path, monkeypatch):
    """The probe's windows and its own kernels run right after an extern call of the user's (a
    matrix product) or after the user's last node, never between two of the user's nodes that the
    C++ backend generates as one kernel: the user's kernels are generated as without the probe."""
    schedules = _schedules(monkeypatch)
    torch.manual_seed(0)
    model = TinyTransformer(vocab=64, dim=32, heads=2, layers=2, seq=16)
    tokens, targets = lm_batch(batch=2, seq=16, vocab=64)
    backend = probe_backend(task="statistics", dump_path=str(tmp_path / "c"))
    with torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(fx_graph_cache=False):
        lm_loss(torch.compile(model, backend=backend), tokens, targets).backward()
    backend.close()
    assert len(schedules) >= 2 and all(any(o for o, _ in s) for s in schedules)
    for schedule in schedules:        # (after the user's last node they split nothing)
        last = max(i for i, (ours, _) in enumerate(schedule) if not ours)
        for (ours_before, ends_before), (ours, _) in zip(schedule[:last], schedule[1:last]):
            assert not ours or ours_before or ends_before, schedule
    assert {r["stage"] for r in _ops(tmp_path / "c")} == {"forward", "backward"}


def test_probe_calls_wait_a_bounded_while_without_matrix_products(tmp_path, monkeypatch):
    """A graph without extern calls still reads its values as it goes (a window waits a bounded
    number of nodes for a kernel's end), and records what the same graph run eagerly records."""
    schedules = _schedules(monkeypatch)

    def f(x):
        for i in range(40):
            x = torch.sin(x * (1.0 + i / 64)) + x.mean(dim=0)
        return x

    x = torch.randn(64, 256)
    stats = []
    for inner in ("inductor", "aot_eager"):
        backend = probe_backend(task="statistics", dump_path=str(tmp_path / inner), inner=inner)
        with torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(fx_graph_cache=False):
            torch.compile(f, backend=backend)(x)
        backend.close()
        stats.append([(r["op"], r["outputs"][0]["stats"]["max"]) for r in _ops(tmp_path / inner) if r["op"] == "aten.sin.default"])
    assert len(stats[0]) == 40 and [op for op, _ in stats[0]] == [op for op, _ in stats[1]]
    assert all(a == pytest.approx(b, rel=1e-5) for (_, a), (_, b) in zip(*stats))
    schedule = schedules[-1]
    first_user = next(i for i, (o, _) in enumerate(schedule) if not o)
    last_user = max(i for i, (o, _) in enumerate(schedule) if not o)
    assert any(o for o, _ in schedule[first_user:last_user]), "every read waited for the end of the graph"


def test_probe_graphs_come_from_the_caches_and_record_the_same(tmp_path):
    """A rerun of a script (a new process, the same torch cache dir) gets the probe's forward and
    backward graphs from the AOTAutograd and FX graph caches, with their record templates (kept as
    JSON), and writes the same records, compiled facts (graph ids, nodes, kernels) included;
    damaged templates make them compile again."""
    def run(name):
        return _run_cached(_CACHED_RUN, tmp_path, name)
    cold, first = run("cold")
    warm, second = run("warm")
    assert cold.get("fxgraph_cache_miss") == 2 and not cold.get("fxgraph_cache_hit"), cold
    assert cold.get("autograd_cache_miss") == 1 and cold.get("autograd_cache_saved") == 1, cold
    assert warm.get("autograd_cache_hit") == 1 and not warm.get("fxgraph_cache_miss"), warm
    assert second == first
    kept = sorted((tmp_path / "cache" / "dispatchprobe").glob("*"))
    graphs = [json.loads(p.read_text()) for p in kept]                   # JSON, not pickle
    assert sorted(g["stage"] for g in graphs) == ["backward", "forward"] and all(g["templates"] for g in graphs)
    for p in kept:                  # damaged templates: the graphs are compiled again, same records
        p.write_text(p.read_text()[:100])
    damaged, third = run("damaged")
    assert damaged.get("autograd_cache_hit") == 1 and third == first, damaged
    records = [json.loads(line) for line in first["step0/rank0/ops.jsonl"].splitlines()]
    compiled = [r for r in records if "compiled" in r]
    assert len(compiled) >= 40 and {r["stage"] for r in compiled} == {"forward", "backward"}
    assert all(r["compiled"]["kernels"] for r in compiled if not r["compiled"]["decomposed"])


def test_probe_backend_alone_reads_cpu_values_with_the_one_pass_kernel(tmp_path, monkeypatch):
    """A probe_backend without any DispatchProbe loads the built one-pass kernel when it is made,
    and its windows use it: compiled records equal the eager statistics, bit for bit."""
    from dispatchprobe.torch import tensor_backend as torch_backend, fused_stats
    assert fused_stats.build_native() is None, f"the kernel did not build: {fused_stats.error}"
    monkeypatch.setattr(fused_stats, "_loaded", False)      # as in a fresh process
    monkeypatch.setattr(fused_stats, "stats4", None)
    monkeypatch.setattr(fused_stats, "row_lists", None)
    backend = probe_backend(task="statistics", dump_path=str(tmp_path / "c"))
    assert fused_stats.row_lists is not None
    calls = []
    kernel = fused_stats.row_lists
    monkeypatch.setattr(fused_stats, "row_lists", lambda values, row: calls.append(len(values)) or kernel(values, row))
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = MLPNet(dim=32, depth=2, classes=4)
    torch.compile(model, backend=backend)(x).sum().backward()
    backend.close()
    assert calls
    recorded = next(r for r in _ops(tmp_path / "c") if r["op"] == "aten.addmm.default")["outputs"][0]["stats"]
    with torch.no_grad():
        expected = torch_backend.tensor_stats([model.body[0](x)])[0]
    assert recorded == expected


def _stats_of(path) -> list:
    return [(r["op"], r["stage"], [s.get("stats") for s in r["inputs"] + r["outputs"] if isinstance(s, dict)])
            for r in _ops(path)]


def test_a_backward_graph_reads_no_saved_activation_again(tmp_path, monkeypatch):
    """The activations a forward graph returns for its backward are read once: the backward's
    windows take their rows from the forward's, and the records equal those of a run that reads
    every value in every graph."""
    requires.require_torch()          # the path's own modules need the torch probe_backend needs
    from dispatchprobe.torch.compile import runtime
    read = []
    rows = runtime.read_rows
    monkeypatch.setattr(runtime, "read_rows", lambda values: read.extend(values) or rows(values))
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    counts = []
    for name, shared in (("shared", True), ("each", False)):
        torch._dynamo.reset()
        monkeypatch.setattr(runtime, "GRAPH_INPUT", runtime.GRAPH_INPUT if shared else 0)   # 0: no lookups
        torch.manual_seed(0)
        model = MLPNet(dim=32, depth=2, classes=4)
        backend = probe_backend(task="statistics", dump_path=str(tmp_path / name))
        read.clear()
        torch.compile(model, backend=backend)(x).sum().backward()
        backend.close()
        counts.append(len(read))
    assert counts[0] < counts[1]
    assert _stats_of(tmp_path / "shared") == _stats_of(tmp_path / "each")


def test_a_value_written_between_two_graphs_is_read_again(tmp_path):
    """A value one graph returned and eager code then wrote in place is read again by the next
    graph that takes it."""
    backend = probe_backend(task="statistics", dump_path=str(tmp_path / "c"))
    double = torch.compile(lambda x: x * 2, backend=backend)
    sine = torch.compile(lambda y: y.sin(), backend=backend)
    y = double(torch.ones(8, 8))
    y.add_(1)
    sine(y)
    backend.close()
    records = {r["op"]: r for r in _ops(tmp_path / "c")}
    assert records["aten.mul.Tensor"]["outputs"][0]["stats"]["max"] == 2.0
    assert records["aten.sin.default"]["inputs"][0]["stats"]["max"] == 3.0


def test_views_of_a_value_share_its_read(tmp_path, monkeypatch):
    """A view showing all of a value's elements (a reshape, a transpose) takes the value's row:
    each value is read once per graph, and the records equal those of a run that reads every
    view on its own (up to the order of the sums)."""
    requires.require_torch()          # the path's own modules need the torch probe_backend needs
    from dispatchprobe.torch.compile import graph_pass, runtime
    read = []
    rows = runtime.read_rows
    monkeypatch.setattr(runtime, "read_rows", lambda values: read.extend(values) or rows(values))

    def f(x, w):
        h = (x.reshape(16, 64) @ w.t()).relu()
        return (h.t() @ h).view(-1).sum()
    x = torch.randn(4, 4, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    counts, records = [], []
    for name, shared in (("shared", True), ("each", False)):
        torch._dynamo.reset()
        if not shared:
            monkeypatch.setattr(graph_pass, "values_source", lambda n: n)
        backend = probe_backend(task="statistics", dump_path=str(tmp_path / name), inner="aot_eager")
        read.clear()
        torch.compile(f, backend=backend)(x, w).backward()
        backend.close()
        counts.append(len(read))
        records.append(_stats_of(tmp_path / name))
    assert counts[0] < counts[1]
    assert [(op, stage) for op, stage, _ in records[0]] == [(op, stage) for op, stage, _ in records[1]]
    for (_, _, shared), (_, _, each) in zip(*records):
        assert len(shared) == len(each)
        for a, b in zip(shared, each):
            assert (a is None) == (b is None)
            for key in a or ():
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    assert sum(s is not None for _, _, row in records[0] for s in row) > 8


@pytest.mark.parametrize("io", ["all", "input", "output"])
def test_records_joined_from_kept_json_equal_the_records_made_whole(tmp_path, monkeypatch, io):
    """A graph call's records joined from JSON kept per template (its statistics cut in) read
    back as the records the dict path makes: a -inf argument, statistics of values holding inf
    and nan, a module name JSON escapes, each io filter."""
    from dispatchprobe.core.recorder import Recorder

    class Odd(torch.nn.Module):
        def forward(self, x):
            y = x.masked_fill(x > 1.5, -math.inf)
            return (y.exp() * x.sqrt()).sum() + x.relu().sum()
    torch.manual_seed(1)        # a Linear whose output exceeds 1.5 somewhere: y holds -inf
    model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    model.add_module('na\u00efve "q" \\', Odd())
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0), requires_grad=True)
    joined = []
    write_joined = Recorder.write_joined
    lines = {}
    for name, allowed in (("joined", True), ("whole", False)):
        torch._dynamo.reset()
        monkeypatch.setattr(Recorder, "write_joined", lambda self, head, rest: allowed and (
            joined.append(1) or write_joined(self, head, rest)))
        backend = probe_backend(task="statistics", dump_path=str(tmp_path / name), inner="aot_eager",
                                data_mode=[io])
        torch.compile(model, backend=backend)(x).backward()
        backend.close()
        lines[name] = [json.loads(line, parse_constant=str)
                       for f in sorted((tmp_path / name).rglob("ops.jsonl")) for line in f.read_text().splitlines()]
    assert joined and len(lines["joined"]) > 10
    for records in lines.values():       # graph ids count the graphs made in the process
        graphs = sorted({r["compiled"]["graph"] for r in records})
        for r in records:
            r["compiled"]["graph"] = graphs.index(r["compiled"]["graph"])
    assert lines["joined"] == lines["whole"]
    text = json.dumps(lines["joined"])
    assert "NaN" in text and "na\\u00efve" in text
    assert io != "all" or "-Infinity" in text
    assert "no_values" not in text          # a graph's values are read, not the fake tensors tracing it


def test_gradients_a_backward_graph_returned_are_not_read_again_for_parameter_records(tmp_path, monkeypatch):
    """The parameter records of gradients a compiled backward returned (and its window read) take
    the window's rows: no gradient is read a second time, and the records equal those of reading
    each gradient again."""
    from dispatchprobe.torch import param_records
    lookup = param_records.returned_row
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    found = []
    grads = []
    planted = [12345.0, -1.0, 0.0, 1.0, 0, 0]        # a row no gradient has: the record shows it
    lookups = {"reuse": lambda t: found.append(lookup(t)) or found[-1], "read": lambda t: None,
               "planted": lambda t: planted if lookup(t) is not None else None}
    for name, lookup_of in lookups.items():
        torch._dynamo.reset()
        monkeypatch.setattr(param_records, "returned_row", lookup_of)
        torch.manual_seed(0)
        model = MLPNet(dim=32, depth=2, classes=4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        backend = probe_backend(task="statistics", dump_path=str(tmp_path / name))
        compiled = torch.compile(model, backend=backend)
        for _ in range(2):
            compiled(x).sum().backward()
            opt.step()
            opt.zero_grad()
            backend.step()
        backend.close()
        run = load(str(tmp_path / name))
        grads.append([(r["name"], r["outputs"][0]["stats"]) for s in (0, 1)
                      for r in run.part(s, 0).params if r["op"] == "param.grad"])
    assert len(grads[0]) == 2 * len(list(model.parameters())) and found and all(r is not None for r in found)
    assert grads[0] == grads[1]
    assert all(stats["max"] == 12345.0 for _, stats in grads[2]) and len(grads[2]) == len(grads[0])


_CACHED_BREAKS = """
import json, sys, torch
from torch._dynamo.utils import counters
from dispatchprobe import probe_backend
from dispatchprobe.models import MLPNet

class Broken(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = MLPNet(dim=16, depth=1, classes=16), MLPNet(dim=16, depth=1, classes=4)

    def forward(self, x):
        y = self.a(x)
        torch._dynamo.graph_break()
        return self.b(torch.relu(y))

torch.manual_seed(0)
model = Broken()
x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
one = probe_backend(task="statistics", dump_path=sys.argv[1] + "/one")
two = probe_backend(task="statistics", dump_path=sys.argv[1] + "/two")
compiled = torch.compile(model, backend=one)
for _ in range(2):
    compiled(x).sum().backward()
    one.step()
with torch.no_grad():
    compiled(x)
one.step()
torch._dynamo.reset()
compiled = torch.compile(model, backend=two)
compiled(x).sum().backward()
one.close()
two.close()
print(json.dumps({**counters["inductor"], **counters["aot_autograd"]}))
"""


def test_cached_graphs_across_graph_breaks_inference_and_two_backends_record_the_same(tmp_path):
    """A rerun whose graphs all come from the AOTAutograd cache (two frames split by a graph break,
    trained, then run under no_grad: inference graphs; a second backend compiling the same model
    after a reset: graphs of its own) writes the same records as the run that compiled them,
    graph ids (numbered at first call) included."""
    counts, runs = zip(*(_run_cached(_CACHED_BREAKS, tmp_path, name) for name in ("cold", "warm")))
    assert counts[0].get("autograd_cache_saved") == 6 and not counts[0].get("autograd_cache_hit"), counts[0]
    assert counts[1].get("autograd_cache_hit") == 6 and not counts[1].get("fxgraph_cache_miss"), counts[1]
    assert len(runs[0]) == 4 and runs[1] == runs[0]
    graphs = {r["compiled"]["graph"] for text in runs[0].values() for r in map(json.loads, text.splitlines())}
    assert len(graphs) == 10            # 2 frames x (forward, backward, inference), twice trained


def test_a_graph_recording_under_an_unknown_slot_says_what_to_do():
    """The recording op of a graph no backend in the process compiled fails with a message naming
    the cause and the way out, not a bare KeyError."""
    requires.require_torch()          # the path's own modules need the torch probe_backend needs
    from dispatchprobe.torch.compile import runtime
    with pytest.raises(RuntimeError, match="TORCHINDUCTOR_CACHE_DIR"):
        runtime._record([torch.zeros(1, runtime.STAT_FIELDS)], [], [], (1 << 30) + 12345, [])
