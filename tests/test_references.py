"""float64 references for ops without a float64 kernel: the experts of a real mixture-of-experts
model (``aten._grouped_mm``, bf16 only) are judged by run-ut, and a wrong kernel is caught."""

from __future__ import annotations

import pytest
import torch

from dispatchprobe import DispatchProbe
from dispatchprobe.offline.run_ut import run_ut
from dispatchprobe.torch.references import REFERENCES, TERMS, grouped_mm, grouped_mm_written, register_reference

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """One bf16 training step of a tiny Qwen2-MoE (its experts run through ``_grouped_mm``)."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
        initializer_range=0.5)     # values large enough that a 5 % error exceeds 0.001 absolute
    model = transformers.Qwen2MoeForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.randint(0, 64, (2, 8))
    path = str(tmp_path_factory.mktemp("moe") / "run")
    probe = DispatchProbe(task="tensor", dump_path=path, list=["_grouped_mm", "^aten\\.mm\\."])
    with probe:
        model(input_ids=ids, labels=ids).loss.backward()
    probe.step()
    probe.close()
    return path


def grouped(results):
    experts = results[results["Op"] == "aten._grouped_mm.default"]
    fwd, bwd = experts["Forward Test Success"], experts["Backward Test Success"]
    return experts.assign(Status=fwd.where(fwd != "", bwd))


def test_grouped_mm_experts_are_judged(moe_run, tmp_path):
    r = run_ut(moe_run, tmp_path / "ut").results
    experts = grouped(r)
    assert len(experts) >= 6                 # forward, and both gradients of each expert product
    # judged, never skipped; the CPU's bf16 kernel is within the bf16 standard (pass or warning)
    assert experts["Status"].isin({"pass", "warning"}).all(), experts[["Op", "Status", "Message"]]


def test_wrong_grouped_mm_kernel_is_an_error(moe_run, tmp_path):
    def wrong(mat_a, mat_b, offs=None, bias=None, out_dtype=None):      # 5 % off, the right shapes
        out = grouped_mm(mat_a.float(), mat_b.float(), offs)
        return (out * 1.05).to(out_dtype or mat_a.dtype)

    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_grouped_mm", wrong, "CPU")
    try:
        r = run_ut(moe_run, tmp_path / "ut").results
    finally:
        lib._destroy()
    experts = grouped(r)
    forward = experts["Stage"] == "forward"
    assert (experts[forward]["Status"] == "error").all(), experts[["Status", "Message"]]
    # a gradient whose values are all below the absolute-error floor passes even 5 % off
    assert (experts["Status"] == "error").sum() >= len(experts) - 2, experts[["Status", "Message"]]
    assert not (r[r["Op"] == "aten.mm.default"][["Forward Test Success", "Backward Test Success"]] == "error").any().any()


def unwritten_rows_kernel(scale):
    """A CPU ``_grouped_mm`` that computes its groups ``scale`` x the right value and leaves what
    lies outside every group as uninitialised memory may hold it (1e30): within its contract."""
    def kernel(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
        out = grouped_mm(mat_a.double(), mat_b.double(), offs) * scale
        written = grouped_mm_written(mat_a, mat_b, offs).get("output.0")
        if written is not None:
            out[~written] = 1e30
        return out.to(out_dtype or mat_a.dtype)
    return kernel


@pytest.fixture
def kernel_of(request):
    """Installs ``unwritten_rows_kernel(scale)`` as aten's CPU ``_grouped_mm`` for the test."""
    libs = []

    def install(scale):
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("_grouped_mm", unwritten_rows_kernel(scale), "CPU")
        libs.append(lib)
    yield install
    for lib in libs:
        lib._destroy()


def record_experts(path, task):
    """Experts whose tokens end before the last row (offsets 2, 5, 7 of 10 rows)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(10, 8, generator=g), torch.randn(3, 8, 12, generator=g)
    probe = DispatchProbe(task=task, dump_path=str(path), list=["_grouped_mm"])
    with probe:
        torch.ops.aten._grouped_mm(a, b, torch.tensor([2, 5, 7], dtype=torch.int32))
    probe.step()
    probe.close()
    return str(path)


@pytest.mark.parametrize("task, random", [("tensor", False), ("statistics", True)])
def test_rows_outside_every_group_are_not_judged(kernel_of, tmp_path, task, random):
    """Rows past the last offset are uninitialised memory: a right kernel passes on the rows it
    wrote (with --random too, whose offsets are drawn unsorted); one 5 % off there is an error."""
    kernel_of(1.0)
    run = record_experts(tmp_path / "run", task)
    r = run_ut(run, tmp_path / "ut", random=random).results
    row = grouped(r).iloc[0]
    assert row["Status"] == "pass", row["Message"]
    if not random:
        assert "output.0: 36 of 120 elements not judged: outside every group of offs" in row["Message"]
    kernel_of(1.05)
    row = grouped(run_ut(run, tmp_path / "ut_wrong", random=random).results).iloc[0]
    assert row["Status"] == "error", row["Message"]


@pytest.mark.parametrize("a_shape, b_shape, offs", [
    ((10, 8), (3, 8, 12), [2, 7, 10]),      # experts: rows of a split, one weight each
    ((2, 12, 8), (8, 16), [4, 16]),         # columns of b split
    ((8, 12), (12, 4), [4, 12]),            # the shared dimension split: a weight gradient
    ((3, 4, 8), (3, 8, 4), None),           # batched (the kernel wants 16-byte strides)
])
def test_grouped_mm_reference_matches_the_kernel(a_shape, b_shape, offs):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(a_shape, generator=g), torch.randn(b_shape, generator=g)
    offs = torch.tensor(offs, dtype=torch.int32) if offs is not None else None
    want = torch.ops.aten._grouped_mm(a, b, offs)
    got = grouped_mm(a.double(), b.double(), offs)
    assert got.dtype == torch.float64 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, rtol=1e-5, atol=1e-5)


def test_registry_refuses_duplicates_and_bad_names():
    assert "aten._grouped_mm.default" in REFERENCES
    with pytest.raises(ValueError, match="already has a float64 reference"):
        register_reference("aten._grouped_mm.default")(lambda *a: None)
    with pytest.raises(ValueError, match="not a 'namespace.name.overload'"):
        register_reference("grouped_mm")


def record_layer_norm(path, row_mean):
    """One bf16 layer norm forward and backward, rows offset by ``row_mean`` standard deviations,
    gradients O(1) (errors above msprobe's absolute 0.001 shortcut)."""
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(256).to(torch.bfloat16)
    x = (torch.randn(64, 256) + row_mean * torch.randn(64, 1)).bfloat16().requires_grad_()
    weight = torch.randn(64, 256)
    probe = DispatchProbe(task="tensor", dump_path=str(path), list=["native_layer_norm"])
    with probe:
        (norm(x).float() * weight).sum().backward()
    probe.step()
    probe.close()
    return str(path)


@pytest.mark.parametrize("row_mean", [0.0, 3.0])
def test_bf16_layer_norm_gradients_judged_against_their_terms(tmp_path, row_mean):
    """torch's CPU kernel forms the weight and bias gradients' terms in bf16: errors of a few
    eps(bf16) of sum |g| |x_hat| are rounding, whatever the rows' mean (the op run on |inputs|
    would give (|x| - |mean|) * rstd, too small a bound)."""
    res = run_ut(record_layer_norm(tmp_path / "run", row_mean), tmp_path / "ut")
    rows = res.results[res.results["Op"] == "aten.native_layer_norm_backward.default"]
    assert len(rows) == 1 and (rows["Backward Test Success"] != "error").all(), rows["Message"].tolist()


def test_layer_norm_terms_are_the_magnitudes_summed():
    g, x = torch.randn(4, 3, 8, dtype=torch.float64), torch.randn(4, 3, 8, dtype=torch.float64) + 5
    mean, rstd = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True).rsqrt()
    _, w_terms, b_terms = TERMS["aten.native_layer_norm_backward.default"](g, x, [8], mean, rstd, None, None, None)
    assert torch.allclose(w_terms, (g * (x - mean) * rstd).abs().sum((0, 1)))
    assert torch.allclose(b_terms, g.abs().sum((0, 1)))
