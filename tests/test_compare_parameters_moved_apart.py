"""Two clean programs whose kernels round apart (torch 2.13's fused attention against torch 2.5.1's
decomposed one, bfloat16 autocast, AdamW): step 0 agrees within tolerance, but Adam's first update
(about ``lr * sign(g)``) moves parameters whose gradient elements lie near zero by up to twice the
learning rate where the runs' roundings differ, so step 1's parameters, and what is computed from
them, part beyond bfloat16's tolerance.  compare exited 2 on those step 1 rows; they are now not
judged, with a line saying the optimizer moved the parameters apart, and compare exits 1 (no
precision verdict past that point), in both orders.  A wrong kernel at step 1 still keeps the error (and is named), and so does a wrong kernel
at step 0.  The other torch version is emulated on this one: the math attention backend and a
manifest naming another version (kernels of two versions round apart at every op)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from compare_helpers import as_other_torch_version, tiny_gpt2
from torch.nn.attention import SDPBackend, sdpa_kernel

from dispatchprobe import DispatchProbe, compare

pytest.importorskip("transformers")


def _layer_norm_off(x, shape, weight, bias, eps):
    """aten::native_layer_norm, its output 1% too large."""
    dims = tuple(range(x.dim() - len(shape), x.dim()))
    mean = x.mean(dims, keepdim=True)
    rstd = (((x - mean) ** 2).mean(dims, keepdim=True) + eps).rsqrt()
    out = (x - mean) * rstd * weight + bias
    return out * 1.01, mean, rstd


def _record(path, *, fused: bool, wrong_from: int | None = None, steps: int = 2, inside: bool = False,
            lr: float = 1e-3):
    """``steps`` AdamW steps under bfloat16 autocast (the optimizer outside the probe; ``inside``: in
    it, so its ops are recorded); ``fused``: the fused CPU attention, else the math backend under a
    manifest of another torch version; ``wrong_from``: the layer norm kernel wrong from that step on."""
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    lib = None
    probe = DispatchProbe(task="statistics", dump_path=str(path))
    try:
        for step in range(steps):
            if step == wrong_from:
                lib = torch.library.Library("aten", "IMPL")
                lib.impl("native_layer_norm", _layer_norm_off, "CPU")
            with probe, torch.autocast("cpu", dtype=torch.bfloat16), \
                    (contextlib.nullcontext() if fused else sdpa_kernel(SDPBackend.MATH)):
                model(input_ids=x, labels=x).loss.backward()
                if inside:
                    opt.step()
                    opt.zero_grad()
            if not inside:
                opt.step()
                opt.zero_grad()
            probe.step()
    finally:
        probe.close()
        if lib is not None:
            lib._destroy()
    return path if fused else as_other_torch_version(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moved")
    return {"fused": _record(root / "fused", fused=True), "pieces": _record(root / "pieces", fused=False),
            "wrong1": _record(root / "wrong1", fused=True, wrong_from=1),
            "wrong0": _record(root / "wrong0", fused=True, wrong_from=0),
            "fused_in": _record(root / "fused_in", fused=True, inside=True),
            "pieces_in": _record(root / "pieces_in", fused=False, inside=True),
            "wrong1_in": _record(root / "wrong1_in", fused=True, wrong_from=1, inside=True),
            "lr_in": _record(root / "lr_in", fused=True, inside=True, lr=1.1e-3)}


def _both(runs, a, b):
    return [compare(runs[x], runs[y]).verdict for x, y in ((a, b), (b, a))]


def _moved_apart(runs, a: str, b: str, said: str) -> None:
    """Both orders: exit 1 (undecided), no divergence, step 1's rows not judged with the drift line
    (holding ``said``), the rest agreeing."""
    for v in _both(runs, a, b):
        text = str(v)
        assert v.passed and v.undecided and v.forward is None and v.backward is None, text
        assert v.drifted > 0 and v.counts.get("error", 0) == 0, text
        line = next(ln for ln in text.splitlines() if ln.startswith("step 1 rank 0: its error rows are computed"))
        assert said in line and "parameter " in line, text
        assert "the runs agree within tolerance where judged" in text, text


def test_clean_programs_moved_apart_by_the_optimizer_exit_0(runs):
    _moved_apart(runs, "fused", "pieces", "step 0's values agree within tolerance")


def test_wrong_kernel_at_step_1_still_fails(runs):
    """The layer norm reads embeddings that agree within rounding at step 1: its rows stay errors and
    the verdict names it."""
    for v in _both(runs, "wrong1", "pieces"):
        assert not v.passed and v.counts.get("error", 0) > 0, str(v)
        assert "aten.native_layer_norm.default [GPT2LMHeadModel.transformer.h.0.ln_1]" in str(v), str(v)


def test_wrong_kernel_at_step_0_is_named(runs):
    for v in _both(runs, "wrong0", "pieces"):
        assert v.forward is not None and v.forward.op == "aten.native_layer_norm.default" and v.forward.step == 0, str(v)


def test_the_optimizer_inside_the_probe_gets_the_same_verdict(runs):
    """``opt.step()`` inside ``with probe:``: step 0's records end with the optimizer's ops, whose
    updates part where the parameters do (compare had named its ``addcdiv_``, exit 2).  Those are
    the moving itself: not judged, and the verdict is the one with the optimizer outside."""
    _moved_apart(runs, "fused_in", "pieces_in", "the optimizer step of step 0 moved apart")
    # inside the probe, the learning rate is a number the optimizer's ops are given: another one is named
    for v in _both(runs, "lr_in", "pieces_in"):
        assert not v.passed and v.forward is not None and v.forward.op == "aten.addcdiv_.default", str(v)


def test_wrong_kernel_at_step_1_still_fails_with_the_optimizer_inside(runs):
    for v in _both(runs, "wrong1_in", "pieces_in"):
        assert not v.passed and v.counts.get("error", 0) > 0, str(v)
        assert "aten.native_layer_norm.default [GPT2LMHeadModel.transformer.h.0.ln_1]" in str(v), str(v)
