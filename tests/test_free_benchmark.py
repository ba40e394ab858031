"""task="free_benchmark": perturbed re-runs, sound thresholds, transparency, planted bad ops."""

from __future__ import annotations

import csv
import warnings

import pytest
import torch
from torch import nn

from dispatchprobe import DispatchProbe
from dispatchprobe.models import TinyTransformer, lm_batch, lm_loss
from conftest import train

CSV_HEAD = ["rank", "pert_mode", "stage", "step", "api_name", "max_rel", "dtype", "shape", "output_index"]


def fb_rows(path):
    out = []
    for p in sorted(path.glob("step*/rank*/free_benchmark.csv")):
        with open(p) as f:
            reader = csv.DictReader(f)
            assert reader.fieldnames[:9] == CSV_HEAD
            out += list(reader)
    return out


def probe(path, mode="improve_precision", **kw):
    return DispatchProbe(task="free_benchmark", dump_path=str(path), pert_mode=mode,
                         fuzz_device="cpu" if mode == "to_cpu" else "same", **kw)


@pytest.mark.parametrize("mode,stage", [("improve_precision", "forward"), ("add_noise", "forward"),
                                        ("bit_noise", "backward")])
def test_check_mode_is_bit_identical(tmp_path, mode, stage):
    off = train(None, steps=2, dropout=0.1)
    on = train(probe(tmp_path, mode, fuzz_stage=stage, widen_float32=True), steps=2, dropout=0.1)
    for a, b in zip(off[0], on[0]):
        assert torch.equal(a, b)
    for n in off[1]:
        assert torch.equal(off[1][n], on[1][n]) and torch.equal(off[2][n], on[2][n]), n
    assert torch.equal(off[3], on[3]), "global RNG consumed"


def one_step(path, dtype, mode, model=None, defer=False, **kw):
    torch.manual_seed(0)
    model = model or TinyTransformer()
    model = model.to(dtype)
    tokens, targets = lm_batch()
    p = probe(path, mode, model=model, **kw)
    p.handlers[0].defer = defer
    with p:
        lm_loss(model, tokens, targets).backward()
    handler = p.handlers[0]
    p.close()
    return handler, fb_rows(path)


@pytest.mark.parametrize("stage", ["forward", "backward"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["add_noise", "bit_noise", "change_value", "no_change", "to_cpu"])
def test_no_false_positives_on_clean_step(tmp_path, dtype, mode, stage):
    """fuzz_stage="backward" flagged 13 of 13 change_value checks (gradients taken with respect to the
    swapped copies, so permuted) and float32 GEMMs under the noise modes (the gradients were computed
    in bfloat16: autocast's CPU keys were live inside the handler's autograd)."""
    handler, rows = one_step(tmp_path, dtype, mode, fuzz_stage=stage)
    assert handler.checked > (12 if stage == "backward" and mode == "change_value" else 40)
    assert handler.skipped == 0
    assert rows == [], [(r["api_name"], r["max_rel"]) for r in rows]


def test_improve_precision_clean_fp32_against_float64(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")              # ops were checked: no "nothing re-run" warning
        handler, rows = one_step(tmp_path, torch.float32, "improve_precision", widen_float32=True)
    assert handler.checked > 100 and handler.not_widened == 0 and rows == []


def test_improve_precision_leaves_float32_ops_alone_by_default(tmp_path):
    """msprobe's improve_precision widens float16/bfloat16 only; a float32-only region then
    checks nothing, and says so instead of leaving an empty CSV that reads as "all clean"."""
    with pytest.warns(UserWarning, match=r"re-ran none of \d+ op calls.*widen_float32=true"):
        handler, rows = one_step(tmp_path, torch.float32, "improve_precision")
    assert handler.checked == 0 and handler.not_widened > 100 and rows == []
    # a bf16 model under the default: every op with a 16-bit input is checked, float32 ops
    # (the loss's float32 upcast) are not
    handler, _ = one_step(tmp_path / "bf16", torch.bfloat16, "improve_precision")
    assert handler.checked > 100 and handler.not_widened > 0


@pytest.mark.parametrize("mode", ["improve_precision", "to_cpu"])
def test_device_path_flags_what_the_cpu_path_flags(tmp_path, mode, monkeypatch):
    """The accelerator path (pairs kept, measured per window as segments, one read-back),
    forced on CPU with small windows, against the per-op path on a bf16 step: the same ops
    flagged with the same measures (bf16 improve_precision flags layer-norm and embedding
    backward), and the same ops checked: the kept outputs are copies, so autograd still
    steals the gradients nobody else holds (holding them made it copy: 9 extra ops)."""
    monkeypatch.setattr("dispatchprobe.core.free_benchmark._WINDOW_OPS", 7)
    now, rows_now = one_step(tmp_path / "now", torch.bfloat16, mode)
    later, rows_later = one_step(tmp_path / "later", torch.bfloat16, mode, defer=True)
    assert now.checked == later.checked > 40
    key = lambda r: (r["op"], r["scope"], r["output_index"])                  # noqa: E731
    assert sorted(map(key, rows_now)) == sorted(map(key, rows_later))
    for a, b in zip(sorted(rows_now, key=key), sorted(rows_later, key=key)):
        assert float(a["max_rel"]) == pytest.approx(float(b["max_rel"]), rel=1e-9)
    if mode == "improve_precision":
        assert rows_now and {r["op"] for r in rows_now} <= {"aten.native_layer_norm_backward.default",
                                                            "aten.embedding_dense_backward.default"}


class Cancel(nn.Module):
    """Catastrophic cancellation: (x + c) - c in bf16 keeps only the digits c leaves."""

    def forward(self, x):
        return (x + 256.0) - 256.0


class NaiveSoftmax(nn.Module):
    """Softmax without max subtraction: exp of large logits."""

    def forward(self, x):
        e = torch.exp(x * 8.0 + 40.0)
        return e / e.sum(-1, keepdim=True)


class Planted(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.cancel = Cancel()
        self.softmax = NaiveSoftmax()

    def forward(self, x):
        return self.softmax(self.cancel(self.fc(x)))


@pytest.mark.parametrize("mode,defer", [("add_noise", False), ("bit_noise", False), ("add_noise", True)])
def test_planted_ill_conditioned_ops_found(tmp_path, mode, defer, monkeypatch):
    """``defer``: the accelerator path (pairs kept, measured together per window, read back
    once) forced on CPU, with windows of a few ops -- it must find the same ops."""
    monkeypatch.setattr("dispatchprobe.core.free_benchmark._WINDOW_OPS", 3)
    torch.manual_seed(0)
    model = Planted().to(torch.bfloat16)
    x = torch.randn(8, 16).to(torch.bfloat16)
    p = probe(tmp_path, mode, model=model)
    p.handlers[0].defer = defer
    with p:
        model(x).float().sum().backward()
    p.close()
    rows = fb_rows(tmp_path)
    flagged = {(r["op"], r["scope"]) for r in rows if r["stage"] == "forward"}
    assert ("aten.sub.Tensor", "Planted.cancel") in flagged
    assert ("aten.exp.default", "Planted.softmax") in flagged
    assert not any(r["scope"] == "Planted.fc" for r in rows), "the well-conditioned linear is flagged"
    sub = next(r for r in rows if r["op"] == "aten.sub.Tensor")
    assert float(sub["max_rel"]) > 0.1


@pytest.mark.parametrize("defer", [False, True])
def test_inputs_overwritten_before_read_back_are_not_saved(tmp_path, defer):
    """On the deferred path a flagged op is reported when its window is read back; if one of
    its inputs was written in place in between, saving it would store values the op never
    saw.  The record then says so, keeps no tensors, and run-ut skips it with the reason."""
    import json
    from dispatchprobe.torch.replay import Skip, check_replayable

    def cancel_then_overwrite(x):
        h = x + 256.0
        y = h - 256.0                 # catastrophic cancellation: flagged by add_noise
        h.zero_()                     # its input, overwritten before the window is read
        return y

    p = probe(tmp_path, "add_noise")
    p.handlers[0].defer = defer
    with p:
        cancel_then_overwrite(torch.randn(8, 16, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16))
    p.close()
    assert [r["op"] for r in fb_rows(tmp_path)] == ["aten.sub.Tensor"]
    rec = next(json.loads(line) for line in open(tmp_path / "step0" / "rank0" / "ops.jsonl"))
    if defer:
        assert rec["inputs_overwritten"] is True and "data" not in rec["inputs"][0]
        with pytest.raises(Skip, match="written in place"):
            check_replayable(rec, random=True)
    else:
        assert "inputs_overwritten" not in rec and rec["inputs"][0]["data"]


def test_measure_floors_near_zero_and_counts_sign_flips():
    from dispatchprobe.standards.metrics import perturbation_change
    e = [1.0, -1.0, 1e-5, 2.0]
    near_zero = perturbation_change([1.0, -1.0, 3e-5, 2.0], e, "float32")   # tiny element moved 3x
    assert near_zero["max_rel"] < 2e-4 and near_zero["sign_flips"] == 0
    flipped = perturbation_change([1.0, 1.0, 1e-5, 2.0], e, "float32")
    assert flipped["sign_flips"] == 1 and flipped["max_rel"] > 1
    assert perturbation_change([1.0, float("inf")], [1.0, 2.0], "float32")["max_rel"] == float("inf")


def test_measure_of_many_pairs_at_once_equals_one_by_one():
    """The accelerator path measures a window of outputs as segments of one concatenation; each
    segment must get exactly the numpy measure of its pair (inf/nan patterns, sign flips)."""
    from dispatchprobe.torch import perturb
    from dispatchprobe.standards.metrics import perturbation_change
    gen = torch.Generator().manual_seed(0)
    pairs = []
    for n in (5, 1, 1000, 7, 3):
        e = torch.randn(n, generator=gen)
        pairs.append(((e * (1 + 1e-2 * torch.randn(n, generator=gen))).bfloat16(), e))
    pairs[0][1][2] = float("inf")                        # pattern differs -> inf
    pairs[4][0][1], pairs[4][1][1] = float("nan"), float("nan")   # same pattern: measured
    pairs[3][0][1] = -5 * pairs[3][1][1]                 # a sign flip
    rows = perturb.changes([a for a, _ in pairs], [e for _, e in pairs], 1e-3).tolist()
    for (a, e), (max_rel, flips) in zip(pairs, rows):
        want = perturbation_change(a.float().numpy(), e.numpy(), "bfloat16")
        assert max_rel == pytest.approx(want["max_rel"], rel=1e-12) and flips == want["sign_flips"]
    assert rows[0][0] == float("inf") and rows[3][1] == 1 and rows[4][0] < 1


def test_fix_replaces_outputs_with_higher_precision(tmp_path):
    # bf16 layer_norm backward loses digits inside the kernel: fix substitutes the fp32 result
    off = train(None, steps=1, dropout=0.0)
    torch.manual_seed(0)
    model = TinyTransformer().to(torch.bfloat16)
    tokens, targets = lm_batch()
    grads = {}
    for label, p in (("off", None), ("fix", probe(tmp_path, handler_type="fix", list=["native_layer_norm_backward"]))):
        model.zero_grad()
        ctx = p if p is not None else torch.no_grad()
        if p is None:
            lm_loss(model, tokens, targets).backward()
        else:
            with p:
                lm_loss(model, tokens, targets).backward()
            p.close()
        grads[label] = {n: q.grad.clone() for n, q in model.named_parameters()}
    assert any(not torch.equal(grads["off"][n], grads["fix"][n]) for n in grads["off"])
    assert {r["op"] for r in fb_rows(tmp_path)} == {"aten.native_layer_norm_backward.default"}
    assert off  # the fp32 run is unaffected by construction


def test_backward_stage_compares_input_grads(tmp_path):
    handler, rows = one_step(tmp_path, torch.bfloat16, "improve_precision", fuzz_stage="backward",
                             list=["native_layer_norm"])
    assert handler.checked >= 5
    assert rows and {r["stage"] for r in rows} == {"backward"}
    assert all(r["op"] == "aten.native_layer_norm.default" for r in rows)


def test_preheat_samples_then_follows_suspects(tmp_path):
    p = probe(tmp_path, "improve_precision", if_preheat=True, preheat_step=1, max_sample=2)
    torch.manual_seed(0)
    model = TinyTransformer().to(torch.bfloat16)
    tokens, targets = lm_batch()
    checked = []
    for _ in range(2):
        with p:
            lm_loss(model, tokens, targets).backward()
        checked.append(p.handlers[0].checked)
        p.step()
    p.close()
    handler = p.handlers[0]
    assert checked[0] < 60                       # at most 2 calls per op in the preheat step
    suspects = handler._suspects
    assert suspects and suspects <= {"aten.native_layer_norm_backward.default", "aten.embedding_dense_backward.default"}
    assert checked[1] - checked[0] <= 8          # afterwards: only the suspects


def test_rerun_escapes_enclosing_autocast_and_is_plain_without_it():
    """A re-run inside a bf16 autocast region must not be cast back down (the float32
    reference would silently be the bf16 result again); outside autocast the fast path runs."""
    from dispatchprobe.torch import perturb
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    mm = torch.ops.aten.mm.default
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert mm(a, b).dtype == torch.bfloat16            # what autocast would do to the re-run
        assert perturb.run(mm, (a, b), {}).dtype == torch.float32
    assert torch.equal(perturb.run(mm, (a, b), {}), a @ b)


def test_gradient_reruns_keep_their_dtypes():
    """Inside ``__torch_dispatch__`` torch excludes the autocast keys; ``autograd_on`` used to
    re-include them, so a float32 ``mm`` differentiated by the backward-stage check ran in
    bfloat16 (autocast's CPU default) although no autocast region was open."""
    from dispatchprobe.torch.internals.dispatch import autograd_on
    a = torch.randn(8, 8, requires_grad=True)
    with autograd_on():
        out = torch.mm(a, a)
    assert out.dtype == torch.float32
    (grad,) = torch.autograd.grad(out, a, torch.ones_like(out))
    assert torch.allclose(grad, torch.ones(8, 8) @ a.detach().T + a.detach().T @ torch.ones(8, 8), rtol=1e-6)


class MaskedAttention(nn.Module):
    """Attention with an additive float mask (as transformers passes it), which autograd refuses
    to differentiate through the CPU flash kernel."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        mask = torch.zeros(2, 1, 8, 8).masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_backward_stage_differentiates_what_training_differentiates(tmp_path):
    """The backward-stage check takes gradients only of the inputs the training differentiates:
    with the mask made a leaf too, every attention call raised and went uncounted into ``skipped``."""
    torch.manual_seed(0)
    model = MaskedAttention()
    p = probe(tmp_path, "no_change", model=model, fuzz_stage="backward")
    with p:
        model(torch.randn(2, 8, 16)).sum().backward()
    p.close()
    summary = p.handlers[0].summary()
    assert summary["skipped"] == 0 and summary["checked"] >= 2 and fb_rows(tmp_path) == []


class ExpertCounts(nn.Module):
    """Tokens per expert as Mixtral counts them: ``histc`` of the chosen experts' indices as floats."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(16, 4)

    def forward(self, x):
        chosen = self.router(x).topk(2, dim=-1).indices
        counts = torch.histc(chosen.float(), bins=4, min=0, max=3)
        return (self.router(x).softmax(-1) * counts).sum()


@pytest.mark.parametrize("mode", ["add_noise", "bit_noise"])
def test_step_functions_are_not_judged_under_noise(tmp_path, mode):
    """An index 3.0 nudged to 3.0000002 leaves ``histc``'s range: a whole count moves (max_rel
    0.06-1.0 on Mixtral) though nothing lost precision.  Such ops are counted, not judged."""
    torch.manual_seed(0)
    model = ExpertCounts()
    p = probe(tmp_path, mode, model=model)
    with p:
        model(torch.randn(64, 16)).backward()
    p.close()
    summary = p.handlers[0].summary()
    assert summary["not_judged"] == 1 and summary["checked"] > 5
    assert fb_rows(tmp_path) == []


class ExtendedMask(nn.Module):
    """T5's and BERT's additive attention mask: (1 - mask) * finfo(dtype).min added to the scores."""

    def forward(self, x):
        keep = torch.ones(x.shape[0], x.shape[0], dtype=x.dtype).tril()
        scores = x @ x.T + (1.0 - keep) * torch.finfo(x.dtype).min
        return scores.softmax(-1) @ x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_noise_never_pushes_a_finite_mask_to_inf(tmp_path, dtype):
    """finfo.min times 1 + eps is -inf: every op reading the mask (T5: the add, clone and where of
    each attention layer, 19 flags on a clean fp32 step) was flagged with max_rel inf."""
    torch.manual_seed(0)
    model = ExtendedMask()
    p = probe(tmp_path, "add_noise", model=model)
    with p:
        model(torch.randn(16, 8).to(dtype)).float().sum()
    p.close()
    assert p.handlers[0].checked >= 4 and fb_rows(tmp_path) == []
    from dispatchprobe.torch import perturb
    mask = torch.full((4096,), torch.finfo(dtype).min, dtype=dtype)
    mask[::2] = float("-inf")                      # inf stays inf, finfo.min stays finite
    noisy = perturb.noise_source(0).apply(mask)
    assert torch.equal(torch.isinf(noisy), torch.isinf(mask))


def test_tf32_only_for_cuda_reruns_of_all_16bit_ops(tmp_path):
    """The float32 re-run of an op whose float inputs are all 16-bit may use TF32 on CUDA (the
    inputs are exact in TF32); the user's matmul setting is back afterwards, CPU re-runs and
    ops with a float32 operand (it would be rounded to TF32) never get it."""
    from dispatchprobe.torch import perturb
    m = torch.backends.cuda.matmul
    name = "fp32_precision" if hasattr(m, "fp32_precision") else "allow_tf32"
    before = getattr(m, name)
    seen = lambda: getattr(m, name)                                               # noqa: E731
    assert perturb.run(seen, (), {}, "cuda", tf32=True) in ("tf32", True)
    assert getattr(m, name) == before
    assert perturb.run(seen, (), {}, "cpu", tf32=True) == before
    assert perturb.run(seen, (), {}, "cuda", tf32=False) == before
    with torch.autocast("cpu", dtype=torch.bfloat16):                             # both contexts
        assert perturb.run(seen, (), {}, "cuda", tf32=True) in ("tf32", True)
    assert getattr(m, name) == before

    handler = probe(tmp_path, "improve_precision").handlers[0]
    half, single = torch.ones(2, dtype=torch.bfloat16), torch.ones(2, dtype=torch.float16)
    assert handler._tf32_ok([half, single])
    assert not handler._tf32_ok([half, torch.ones(2)])                            # a float32 operand
    assert not probe(tmp_path / "n", "add_noise").handlers[0]._tf32_ok([half])


def test_screen_clears_only_what_the_measure_passes():
    """``surely_within`` is a shortcut, never a second opinion: whenever it clears a pair, the
    measure is within the limit -- float32 against a float64 reference (rounded once), masks of
    -inf, a float64 value beyond float32's range that float32 turned into inf, nan."""
    from dispatchprobe.torch import perturb
    from dispatchprobe.standards.metrics import perturbation_change
    gen = torch.Generator().manual_seed(1)
    cases = []
    for scale in (1e-3, 1e-6, 1e-9):
        e = torch.randn(500, generator=gen, dtype=torch.float64)
        cases.append(((e * (1 + scale * torch.randn(500, generator=gen, dtype=torch.float64))).float(), e))
    masked = torch.randn(500, generator=gen, dtype=torch.float64)
    masked[::7] = float("-inf")
    cases.append((masked.float(), masked))                              # exact op with a -inf mask
    beyond = masked.clone()
    beyond[3] = 1e39
    cases.append((beyond.float(), beyond))                              # inf in float32 only
    with_nan = masked.clone()
    with_nan[5] = float("nan")
    cases.append((with_nan.float(), with_nan))
    cleared = []
    for a, e in cases:
        ok = perturb.surely_within(a, e, 2e-4, 1e-6, perturb.Scratch())
        measure = perturbation_change(a.double().numpy(), e.numpy(), "float32")["max_rel"]
        assert not ok or measure <= 2e-4, (ok, measure)
        cleared.append(ok)
    assert cleared == [False, True, True, True, False, False]


@pytest.mark.parametrize("numel", [500, 100_000])          # fresh temporaries / scratch blocks
def test_elementwise_screen_clears_16bit_rounding_and_nothing_over_the_limit(numel):
    """bf16 outputs against their float32 reference: one rounding of an element far above the
    rms exceeds ``limit * floor``, so the screen's second stage (the measure's elementwise bound,
    in float32) decides.  It clears plain rounding and never an element whose error relative to
    max(|e|, floor) is over the limit -- including errors within 0.1% of it."""
    from dispatchprobe.torch import perturb
    from dispatchprobe.standards.metrics import perturbation_change
    gen = torch.Generator().manual_seed(2)
    e = torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen).pow(8) * 50   # heavy tail
    limit, small = 0.004, 1e-3
    rounded = e.bfloat16().float()
    floor = float(e.pow(2).mean().sqrt())
    assert float((rounded - e).abs().max()) > limit * floor           # the first stage cannot clear it
    assert perturb.surely_within(rounded, e, limit, small, perturb.Scratch())
    big = int(e.abs().argmax())
    for rel in (1.02, 1.0005, 0.98):                                  # that element's error / limit
        a = rounded.clone()
        a[big] = e[big] * (1 + rel * limit)
        ok = perturb.surely_within(a, e, limit, small, perturb.Scratch())
        measure = perturbation_change(a.double().numpy(), e.double().numpy(), "bfloat16")["max_rel"]
        assert not ok or measure <= limit, (rel, measure)
        assert ok == (rel < 1), rel


def test_window_screen_clears_only_what_the_measure_passes():
    """The accelerator window's float32 screen (per segment, nothing read back): True only
    where the float64 measure is within the pair's limit; inf/nan, float32-overflowing
    squares (values of 1e20: the floor would be inf and every ratio 0) and near-limit errors
    go to the measure."""
    from dispatchprobe.torch import perturb
    from dispatchprobe.standards.metrics import perturbation_change
    gen = torch.Generator().manual_seed(3)
    e = [torch.randn(n, generator=gen) * torch.rand(n, generator=gen).pow(6) * 30 for n in (700, 1, 64, 3000)]
    acts = [t.bfloat16().float() for t in e]                       # plain bf16 rounding: clears
    e += [e[0].clone(), e[2].clone(), e[3] * 1e20, e[2].clone(), e[2].clone()]
    acts += [e[0].clone(), e[2].clone(), e[3] * 1e20, e[2].clone(), e[2].clone()]
    big = int(e[5].abs().argmax())
    acts[4][3] = float("nan")                                      # nan in one side
    acts[5][big] = e[5][big] * (1 + 1.0005 * 0.004)                # just over the limit
    acts[7][big] = e[7][big] * (1 + 0.98 * 0.004)                  # just under
    e[8][0] = float("inf")
    acts[8][0] = float("inf")                                      # same inf both sides: measure decides
    limits = [0.004] * len(e)
    got = perturb.within_limits(acts, e, limits, 1e-3).tolist()
    for ok, a, x, lim in zip(got, acts, e, limits):
        measure = perturbation_change(a.double().numpy(), x.double().numpy(), "bfloat16")["max_rel"]
        assert not ok or measure <= lim, (ok, measure)
    assert got == [True, True, True, True, False, False, False, True, False]
    # float64 sides are rounded to float32 and the rounding is taken off the limit: a float32
    # result against its float64 reference clears at the float32 limit, never at a float64 one
    wide = torch.randn(1000, generator=gen, dtype=torch.float64)
    assert perturb.within_limits([wide.float()], [wide], [2e-4], 1e-6).tolist() == [True]
    assert perturb.within_limits([wide * (1 + 1e-15)], [wide], [1e-14], 1e-6).tolist() == [False]


def test_scratch_blocks_never_overlap_and_stay_bounded(monkeypatch):
    """Blocks of one op's check are disjoint (also across a growth), memory is reused after
    ``reset``, and the kept buffer never exceeds MAX_BYTES (larger needs get fresh memory)."""
    from dispatchprobe.torch.perturb import Scratch
    monkeypatch.setattr(Scratch, "MIN_NUMEL", 4)
    monkeypatch.setattr(Scratch, "MAX_BYTES", 4096)
    s = Scratch()
    blocks = [s.take((100,), torch.float32), s.take((50,), torch.float64), s.take((200,), torch.float32)]
    for i, b in enumerate(blocks):
        b.fill_(i)
    assert [int(b.min()) for b in blocks] == [0, 1, 2] and [int(b.max()) for b in blocks] == [0, 1, 2]
    s.reset()
    again = s.take((100,), torch.float32)
    assert again.data_ptr() == s._buf.data_ptr()                    # reused from the start
    big = s.take((2000,), torch.float32)                            # 8000 bytes > MAX_BYTES
    assert s._buf.numel() <= 4096 and big.untyped_storage().data_ptr() != s._buf.data_ptr()
