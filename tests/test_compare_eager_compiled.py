"""compare pairs an eager run with a compiled one where the graph computes a value once that eager
computes twice: a router normalising its top-k weights in place (``top /= top.sum()``, as a
mixture of experts does) makes eager's ``div`` backward compute ``top / sum`` again, which the
compiled backward takes from the forward.  The compiled backward's one ``div`` pairs with the eager
``div`` of the same values (the closest statistics among the records of its kind), and the eager
``div_`` with the graph's functional ``div``, argument by argument: compare exits 0, either run as A.

And where the graph calls one module's independent calls in another order than eager (dynamo
iterates a ``set`` in insertion order, Python in hash order: Gemma3's rotary embedding, called once
per attention kind), each call pairs with the one computing the same values."""

from __future__ import annotations


import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from dispatchprobe import DispatchProbe, compare
from dispatchprobe.cli import main
from dispatchprobe.torch.compile import probe_backend

from compare_helpers import planted_kernel, train_attention_steps

pytestmark = pytest.mark.probe_backend    # below the torch it needs, the one-line refusal


class Router(nn.Module):
    """A gate's softmax, its top 2 weights normalised in place, scaling a projection."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(16, 4, bias=False)
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        top, _ = self.gate(x).softmax(-1).topk(2, dim=-1)
        top /= top.sum(-1, keepdim=True)
        return (self.proj(x) * top[..., :1]).square().mean()


def _record(path, compiled: bool, make=None, width: int = 16):
    """One forward and backward of ``make()`` (default the router) on an (8, width) input, eager or
    under ``probe_backend`` (task tensor)."""
    torch.manual_seed(0)
    model = (make or Router)()
    x = torch.randn(8, width, generator=torch.Generator().manual_seed(1))
    if compiled:     # the graph's aten ops run eagerly (fast to compile); the partitioner reuses the forward's div
        backend = probe_backend(task="tensor", dump_path=str(path), inner="aot_eager")
        torch.compile(model, backend=backend)(x).backward()
        backend.close()
        torch._dynamo.reset()
    else:
        probe = DispatchProbe(task="tensor", dump_path=str(path))
        with probe:
            model(x).backward()
        probe.close()
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``get()``: the eager and the compiled run, recorded on first use, inside the test (below the
    torch probe_backend needs, its refusal is the test's outcome)."""
    root = tmp_path_factory.mktemp("router")
    made: dict = {}

    def get():
        for name in ("eager", "compiled"):
            if name not in made:
                made[name] = _record(root / name, name == "compiled")
        return made["eager"], made["compiled"]
    return get


@pytest.mark.parametrize("eager_is", ["A", "B"])
def test_recomputed_div_pairs_with_the_same_values(runs, tmp_path, eager_is):
    eager, compiled = runs()
    a, b = (eager, compiled) if eager_is == "A" else (compiled, eager)
    res = CliRunner().invoke(main, ["compare", str(a), str(b), "-o", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    table = pd.read_csv(tmp_path / "out" / "compare.csv", keep_default_na=False)
    unmatched = pd.read_csv(tmp_path / "out" / "unmatched.csv", keep_default_na=False)
    # the backward's divs: the compiled run has one fewer (it reuses the forward's top / sum)
    divs = unmatched[(unmatched["op"] == "aten.div.Tensor") & (unmatched["stage"] == "backward")]
    assert list(divs["side"]) == ["a" if eager_is == "A" else "b"], unmatched
    paired = table[(table["stage"] == "backward") & (table["op_a"] == "aten.div.Tensor")]
    assert len(paired.drop_duplicates("seq")) == 2 and set(paired["status"]) == {"pass"}, paired
    assert (paired["rel_l2_err"].astype(float) < 1e-6).all(), paired[["seq", "arg", "rel_l2_err"]]
    # the in-place div_ and the graph's div: inputs compared too, not only the output
    inplace = table[(table["stage"] == "forward") & table["op_a"].isin(["aten.div_.Tensor", "aten.div.Tensor"])]
    assert sorted(inplace["arg"]) == ["input.0", "input.1", "output.0"], inplace[["op_a", "op_b", "arg"]]


# ---- a module's calls made in another order ----------------------------------------------------------
KINDS = ("local", "global")


class Tables(nn.Module):
    """cos and sin of positions times one of two frequency tables, chosen by name (a rotary
    embedding called once per attention kind)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("local_freq", 1.0 / 10.0 ** torch.arange(0, 1, 0.125))
        self.register_buffer("global_freq", 1.0 / 1000.0 ** torch.arange(0, 1, 0.125))

    def forward(self, pos, kind):
        angles = pos[:, None] * getattr(self, kind + "_freq")
        return angles.cos(), angles.sin()


class TwoKinds(nn.Module):
    """Both tables computed first, in reverse order when compiled (as a graph traced from a loop over
    a ``set`` may), then used in one fixed order."""

    def __init__(self):
        super().__init__()
        self.tables = Tables()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        kinds = KINDS[::-1] if torch.compiler.is_compiling() else KINDS
        pos = torch.arange(x.shape[0], dtype=x.dtype)
        emb = {k: self.tables(pos, k) for k in kinds}
        h = self.proj(x)
        for k in KINDS:
            cos, sin = emb[k]
            h = h * cos + h.roll(1, -1) * sin
        return h.square().mean()


def _record_kinds(path, compiled: bool):
    return _record(path, compiled, make=TwoKinds, width=8)


def _first_table_read(path) -> float:
    """The mean of the frequency table the run's first ``Tables`` call read."""
    import json
    for line in open(path / "step0" / "rank0" / "ops.jsonl"):
        r = json.loads(line)
        if r["kind"] == "op" and r["scope"] == "TwoKinds.tables" and r["op"] == "aten.mul.Tensor":
            return r["inputs"][1]["stats"]["mean"]
    raise AssertionError("no Tables call recorded")


def test_calls_made_in_another_order_pair_by_their_values(tmp_path):
    eager, compiled = _record_kinds(tmp_path / "eager", False), _record_kinds(tmp_path / "compiled", True)
    # the graph did call the tables the other way round
    assert _first_table_read(eager) != _first_table_read(compiled)
    for a, b in ((eager, compiled), (compiled, eager)):
        out = tmp_path / f"out_{a.name}"
        res = CliRunner().invoke(main, ["compare", str(a), str(b), "-o", str(out)])
        assert res.exit_code == 0, res.output
        assert "no forward divergence" in res.output and "no backward divergence" in res.output, res.output
        table = pd.read_csv(out / "compare.csv", keep_default_na=False)
        tables = table[table["scope"] == "TwoKinds.tables"]
        # each call's cos, sin and angles with the same values (the aten ops run as eager runs them)
        assert len(tables.drop_duplicates("seq")) == 6 and set(tables["status"]) == {"pass"}, tables
        assert (tables["max_abs_err"].astype(float) == 0).all(), tables[["seq", "op_a", "arg", "max_abs_err"]]


# ---- a module made in forward and registered nowhere ------------------------------------------------
class LossInForward(nn.Module):
    """A projection whose loss module is made in ``forward`` (``loss_fct = CrossEntropyLoss()``, as
    transformers' BERT, T5 and many more do): dynamo traces it without a module of its own."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 5)

    def forward(self, x):
        loss_fct = nn.CrossEntropyLoss()
        return loss_fct(self.proj(x), torch.arange(x.shape[0]) % 5)


def test_a_module_made_in_forward_records_in_its_callers_scope(tmp_path):
    """Its ops are the caller's in eager as in the compiled graph, so the two runs pair them op by op."""
    eager = _record(tmp_path / "eager", False, make=LossInForward)
    compiled = _record(tmp_path / "compiled", True, make=LossInForward)
    import json
    scopes = {r["op"]: r["scope"] for r in map(json.loads, open(eager / "step0" / "rank0" / "ops.jsonl"))
              if r["kind"] == "op" and r["stage"] == "forward"}
    assert scopes["aten._log_softmax.default"] == scopes["aten.nll_loss_forward.default"] == "LossInForward", scopes
    for a, b in ((eager, compiled), (compiled, eager)):
        out = tmp_path / f"out_{a.name}"
        res = CliRunner().invoke(main, ["compare", str(a), str(b), "-o", str(out)])
        assert res.exit_code == 0 and "no forward divergence" in res.output, res.output
        table = pd.read_csv(out / "compare.csv", keep_default_na=False)
        loss = table[table["op_a"].isin(["aten._log_softmax.default", "aten.nll_loss_forward.default"])]
        assert set(loss["scope"]) == {"LossInForward"} and set(loss["status"]) == {"pass"}, loss
        assert len(loss.drop_duplicates("seq")) == 2, loss


# ---- a parameter the optimizer moves apart from gradients at rounding level ------------------------------
class KeyBiasAttention(nn.Module):
    """Attention with a key bias, whose gradient is mathematically zero (softmax is shift-invariant):
    each run's is rounding noise of its own, which AdamW turns into updates of the full step size."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(32, 32) for _ in range(4))

    def forward(self, x):
        s = self.q(x) @ self.k(x).transpose(-1, -2) / 4
        return self.o(s.softmax(-1) @ self.v(x)).square().mean()


def _two_adamw_steps(path, compiled: bool, optimizer_inside: bool = False, lr: float = 0.1, parameters: bool = True):
    """Two AdamW steps of the key-bias attention, eager or under ``probe_backend``; with
    ``optimizer_inside`` the optimizer steps inside ``with probe:``, so its ops are recorded too;
    ``parameters``: whether the parameter records are written."""
    torch.manual_seed(0)
    model = KeyBiasAttention()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    return train_attention_steps(model, opt, path, task="statistics", compiled=compiled, steps=2,
                                 optimizer_inside=optimizer_inside, shape=(4, 16, 32), eager_probe=False,
                                 parameters=parameters)


def test_a_parameter_moved_apart_by_amplified_noise_is_explained_not_traced_to_a_decomposition(tmp_path):
    """Step 0's records agree; the key bias differs at step 1.  Its gradient, made by records that
    agree, is within their rounding bound in every element in both runs: the rows pass as noise the
    optimizer amplified, on statistics alone (it was 'first seen at aten.addmm.default
    [KeyBiasAttention.k] input.0 ... they come from its optimizer step', exit 2), and no op the
    compiled graph's decomposition runs in one run only (its scaling ``mul``) is named."""
    eager, compiled = _two_adamw_steps(tmp_path / "eager", False), _two_adamw_steps(tmp_path / "compiled", True)
    for a, b in ((eager, compiled), (compiled, eager)):
        res = CliRunner().invoke(main, ["compare", str(a), str(b)])
        assert res.exit_code == 0, res.output
        assert "parameter k.bias differs from step 1: its step 0 gradient is zero up to rounding (cancelled) in " \
            "all 32 of its elements" in res.output, res.output
        assert "present only in run" not in res.output.split("unmatched records")[0], res.output


@pytest.fixture(scope="module")
def optimizer_inside(tmp_path_factory):
    """The key-bias attention with the optimizer inside the probe: eager, compiled, and eager with
    another learning rate (a real difference in the optimizer's own ops); "... unrecorded": eager
    and compiled without parameter records."""
    root = tmp_path_factory.mktemp("optimizer_inside")
    made: dict = {}

    def get(name):
        if name not in made:
            made[name] = _two_adamw_steps(root / name.replace(" ", "_"), name.startswith("compiled"),
                                          optimizer_inside=True, lr=0.2 if name == "lr" else 0.1,
                                          parameters=not name.endswith("unrecorded"))
        return made[name]
    return get


@pytest.mark.parametrize("eager_is", ["A", "B"])
def test_the_optimizer_inside_the_probe_amplifies_noise_and_no_op_is_named(optimizer_inside, eager_is):
    """The key bias's gradient passes by the cancellation rule (zero up to rounding); AdamW's ops,
    recorded inside the probe, amplify it to errors of 0.5 relative.  Those errors are the noise
    amplified: the runs agree (it was exit 2, 'forward: no forward op diverges by itself; its N
    error rows follow from values that are zero up to rounding (first at aten.lerp_.Scalar ...)',
    and before that 'first forward divergence: aten.lerp_.Scalar'), either run as A."""
    eager, compiled = optimizer_inside("eager"), optimizer_inside("compiled")
    a, b = (eager, compiled) if eager_is == "A" else (compiled, eager)
    res = CliRunner().invoke(main, ["compare", str(a), str(b)])
    assert res.exit_code == 0, res.output
    assert "parameter k.bias differs from step 0: its step 0 gradient is zero up to rounding (cancelled) in " \
        "all 32 of its elements" in res.output, res.output
    assert "first forward divergence" not in res.output and "diverges by itself" not in res.output, res.output


@pytest.mark.parametrize("eager_is", ["A", "B"])
def test_without_parameter_records_the_amplified_noise_is_traced_to_values_zero_up_to_rounding(optimizer_inside,
                                                                                                eager_is):
    """Without parameter records the noise cannot be told a parameter's: AdamW's errors (0.5
    relative) follow from values that are zero up to rounding, and no optimizer op is named as where
    they enter (it was ``first forward divergence: aten.lerp_.Scalar``, the first op reading the
    noise), either run as A."""
    eager, compiled = optimizer_inside("eager unrecorded"), optimizer_inside("compiled unrecorded")
    a, b = (eager, compiled) if eager_is == "A" else (compiled, eager)
    res = CliRunner().invoke(main, ["compare", str(a), str(b)])
    forward = next(line for line in res.output.splitlines() if line.startswith(("forward", "first forward")))
    assert res.exit_code == 2, res.output
    assert forward.startswith("forward: no forward op diverges by itself; its ") and \
        "follow from values that are zero up to rounding (first at aten.lerp_.Scalar [<top>] input.1" in forward, \
        res.output
    assert "(aten.sum.dim_IntList output.0) differ by" in forward and "the values cancel" in forward, forward
    assert "first forward divergence" not in res.output, res.output


@pytest.mark.parametrize("order", [("lr", "compiled"), ("compiled", "lr")])
def test_a_changed_learning_rate_beside_the_noise_is_still_named(optimizer_inside, order):
    """The same noise, and another learning rate in one run: its first op (AdamW's weight decay
    ``mul_``, inputs agreeing) is named, whichever run is A; the noise hides nothing larger."""
    a, b = (optimizer_inside(name) for name in order)
    res = CliRunner().invoke(main, ["compare", str(a), str(b)])
    assert res.exit_code == 2, res.output
    assert "first forward divergence: aten.mul_.Tensor [<top>] call 0" in res.output, res.output


# ---- a compiled layer norm that returns no mean ----------------------------------------------------------
class EmbeddedNorm(nn.Module):
    """Token and position embeddings summed, then a layer norm (BERT's embeddings): the compiled graph's
    layer norm keeps no mean of its own (inductor fuses it into the kernel that uses it), so its record's
    second output is ``none`` where eager's is a tensor."""

    def __init__(self):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(64, 32), nn.Embedding(16, 32)
        self.norm, self.head = nn.LayerNorm(32), nn.Linear(32, 8)

    def forward(self, x):
        h = self.tokens(x) + self.positions(torch.arange(x.shape[-1]))
        return self.head(self.norm(h)).square().mean()


def _wrong_layer_norm(x, shape, weight, bias, eps):
    """native_layer_norm whose normalised output is 1% too large (its mean and rstd right)."""
    mean = x.mean(-1, keepdim=True)
    rstd = torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + eps)
    return ((x - mean) * rstd * weight + bias) * 1.01, mean, rstd


def _record_norm(path, compiled: bool, wrong: bool = False):
    """One forward and backward of :class:`EmbeddedNorm`, eager or under ``probe_backend`` with inductor
    (statistics); ``wrong``: a wrong ``native_layer_norm`` kernel (eager)."""
    torch.manual_seed(0)
    model = EmbeddedNorm()
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    if compiled:
        backend = probe_backend(task="statistics", dump_path=str(path))
        torch.compile(model, backend=backend)(x).backward()
        backend.close()
        torch._dynamo.reset()
        return path
    with planted_kernel("native_layer_norm" if wrong else None, _wrong_layer_norm):
        probe = DispatchProbe(task="statistics", dump_path=str(path))
        with probe:
            model(x).backward()
        probe.close()
    return path


def test_a_layer_norm_without_its_mean_pairs_by_the_outputs_both_have(tmp_path):
    """The two layer norms pair (by output and rstd, the mean left out): every forward record pairs,
    the clean runs agree, and a wrong eager layer norm kernel is named at it, either run as A."""
    import json
    eager, wrong, compiled = (_record_norm(tmp_path / "eager", False), _record_norm(tmp_path / "wrong", False, True),
                              _record_norm(tmp_path / "compiled", True))
    records = (compiled / "step0" / "rank0" / "ops.jsonl").read_text().splitlines()
    norms = [r for r in map(json.loads, records) if r["op"] == "aten.native_layer_norm.default"]
    assert [o["type"] for o in norms[0]["outputs"]] == ["tensor", "none", "tensor"], norms
    for a, b in ((eager, compiled), (compiled, eager)):
        res = CliRunner().invoke(main, ["compare", str(a), str(b), "-o", str(tmp_path / f"out_{a.name}")])
        assert res.exit_code == 0 and "no forward divergence" in res.output, res.output
        table = pd.read_csv(tmp_path / f"out_{a.name}" / "compare.csv", keep_default_na=False)
        norm = table[table["op_a"] == "aten.native_layer_norm.default"]
        # compared by its input, weight, bias, output and rstd; the mean only eager holds is left out
        assert set(norm["op_b"]) == {"aten.native_layer_norm.default"} and set(norm["arg"]) == {
            "input.0", "input.2", "input.3", "output.0", "output.2"} and set(norm["status"]) == {"pass"}, norm
    for a, b in ((wrong, compiled), (compiled, wrong)):
        d = compare(a, b).verdict.forward
        assert d is not None and (d.cause, d.op, d.scope) == ("op", "aten.native_layer_norm.default",
                                                              "EmbeddedNorm.norm"), str(d)
