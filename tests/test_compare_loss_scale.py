"""A run that scales its loss (torch.amp.GradScaler, fp16 AMP's recipe; the scale as backward's seed;
a Python-number scale as DeepSpeed's and Megatron's loss scalers apply it) against one that does
not, or scales it differently: every gradient differs by the scale, exactly, and no kernel is wrong.
compare judges the forward as usual and the backward unscaled (no error row, no op named, the rows
saying so); a wrong backward kernel in the scaled run is still named; runs scaled alike compare as
before; the scaler's own ops (recorded with the optimizer inside the probe) are explained; a scale
that is no power of two leaves the backward not judged.  Both orders, statistics and tensor tasks."""

from __future__ import annotations

import pytest
import torch
from compare_helpers import SiluMLP, planted_kernel, wrong_silu_backward
from torch.nn import functional as F

from dispatchprobe import DispatchProbe
from dispatchprobe.offline.compare import compare, loss_scale
from dispatchprobe.offline.compare.parallel import optimizer_step
from dispatchprobe.records.reader import load

NOTE = "compared unscaled: run {}'s loss scale {}"


def _record(path, task: str, scale: float | None = None, plant: bool = False, inside: bool = False,
            lr: float = 1e-3):
    """Two AdamW steps of the MLP; ``scale``: a GradScaler's initial scale (None: no scaler);
    ``inside``: the scaler's step and update (or the optimizer's step) inside ``with probe:``."""
    torch.manual_seed(0)
    model = SiluMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale) if scale else None

    def optimizer_step():
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()

    def backward(loss):
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if inside:
            optimizer_step()
    return _two_steps(path, model, task, plant, backward, (lambda: None) if inside else optimizer_step)


def _two_steps(path, model, task: str, plant: bool, backward, after, mean: bool = False):
    """Two seeded steps of ``model`` recorded into ``path``: ``backward(loss)`` inside ``with probe:``,
    ``after()`` outside it; ``plant``: a wrong silu_backward kernel; ``mean``: the loss a mean of
    squares (backward's seed read through an expand no record shows), not ``mse_loss``."""
    with planted_kernel("silu_backward" if plant else None, wrong_silu_backward):
        probe = DispatchProbe(task=task, dump_path=str(path))
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 16, 32, generator=g), torch.randn(8, 16, 4, generator=g)
            with probe:
                backward((model(x) - y).pow(2).mean() if mean else F.mse_loss(model(x), y))
            after()
            probe.step()
        probe.close()
    return path


RUNS = {"fp32": {}, "scaled": {"scale": 2.0 ** 16}, "scaled_small": {"scale": 2.0 ** 8},
        "scaled_wrong": {"scale": 2.0 ** 16, "plant": True},
        "fp32_inside": {"inside": True}, "scaled_inside": {"scale": 2.0 ** 16, "inside": True},
        "scaled_inside_again": {"scale": 2.0 ** 16, "inside": True}, "scaled_faster": {"scale": 2.0 ** 16, "lr": 2e-3},
        "scaled_small_inside": {"scale": 2.0 ** 8, "inside": True}}


@pytest.fixture(scope="module", params=["statistics", "tensor"])
def runs(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"loss_scale_{request.param}")
    return {name: _record(root / name, request.param, **kw) for name, kw in RUNS.items()}


def _both_orders(runs, x, y):
    for order in ((x, y), (y, x)):
        table, v = compare(runs[order[0]], runs[order[1]])
        yield order, table, v


def _said(order, scaled_name: str, scale: int) -> str:
    return NOTE.format("A" if order[0] == scaled_name else "B", scale)


@pytest.mark.parametrize("other", ["scaled", "scaled_small"])
def test_a_scaled_loss_is_no_divergence(runs, other):
    for order, table, v in _both_orders(runs, "fp32", other):
        assert v.passed and v.forward is None and v.backward is None, (order, str(v))
        assert not (table["status"] == "error").any(), order
        scale = int(RUNS[other]["scale"])
        unscaled = table["reason"].str.contains(_said(order, other, scale), regex=False)
        # the scaled loss the seed reads (forward) and every gradient value of the backward
        assert unscaled[table["stage"] == "backward"].mean() > 0.5, order
        assert (unscaled & (table["op_a"] == "aten.ones_like.default")).any(), order
        # forward values the backward reads (saved tensors) carry no scale and are not divided
        saved = (table["stage"] == "backward") & (table["op_a"] == "aten.silu_backward.default") \
            & (table["arg"] == "input.1")
        assert saved.any() and not unscaled[saved].any(), order


@pytest.mark.parametrize("pair", [("scaled", "scaled_small"), ("scaled_inside", "scaled_small_inside")])
def test_runs_scaled_differently_compare_at_the_ratio(runs, pair):
    for order, table, v in _both_orders(runs, *pair):
        assert v.passed and v.forward is None and v.backward is None, (order, str(v))
        big, small = ("A", "B") if order[0] == pair[0] else ("B", "A")
        scales = {big: 65536, small: 256}
        said = f"run A's loss scale {scales['A']}, run B's loss scale {scales['B']}"
        reasons = table["reason"].fillna("")
        assert reasons.str.startswith(f"compared unscaled: {said}").any(), order
        # the scaler's state (the scale the multiplies read, its reciprocal) differs by choice: not judged
        state = table["status"] == "not judged"
        assert state.any() and reasons[state].str.startswith(f"loss scaling: the scaler's state ({said})").all(), order
        assert "values the runs' loss scales leave undecided" in str(v).splitlines()[0], order


def test_a_wrong_backward_kernel_in_the_scaled_run_is_named(runs):
    for order, _, v in _both_orders(runs, "fp32", "scaled_wrong"):
        assert v.backward is not None and v.backward.cause == "op", (order, str(v))
        assert (v.backward.op, v.backward.scope) == ("aten.silu_backward.default", "SiluMLP"), (order, str(v))


def test_runs_scaled_alike_are_compared_as_they_are(runs):
    for order, table, v in _both_orders(runs, "scaled_inside", "scaled_inside_again"):
        assert v.passed and v.forward is None and v.backward is None, (order, str(v))
        assert not table["reason"].fillna("").str.contains("unscaled").any(), order
        assert v.unmatched.empty or (v.unmatched["explained"] != "").all(), order


def test_the_scalers_ops_inside_the_probe_are_explained(runs):
    for order, table, v in _both_orders(runs, "fp32_inside", "scaled_inside"):
        assert v.passed and v.forward is None and v.backward is None, (order, str(v))
        assert not (table["status"] == "error").any(), order
        scaled = "a" if order[0] == "scaled_inside" else "b"
        mine = v.unmatched[v.unmatched["side"] == scaled]
        assert {"aten._amp_foreach_non_finite_check_and_unscale_.default",
                "aten._amp_update_scale_.default"} <= set(mine["op"]), order
        assert mine["explained"].str.startswith("loss scaling: ").all(), (order, mine)
        # the optimizer reads the gradients after the scaler unscaled them: compared as they are
        adam = table[table["op_a"].str.contains("_foreach_|lerp|addcdiv", regex=True)]
        assert len(adam) and not adam["reason"].fillna("").str.contains("unscaled").any(), order


def test_parameter_gradients_recorded_before_unscaling_are_compared_unscaled(runs):
    """The optimizer outside the probe: the parameter records hold the gradients as backward left
    them (scaled).  A faster learning rate moves the parameters apart while the gradients agree."""
    for order in (("fp32", "scaled_faster"), ("scaled_faster", "fp32")):
        got = optimizer_step(load(str(runs[order[0]])), load(str(runs[order[1]])), 0, 0)
        assert got.said and got.gradient_agrees is True, (order, got)


def test_a_seed_not_scaled_by_the_multiply_leaves_the_backward_not_judged(runs):
    """Where a backward op other than the multiply by the scale reads the scaled run's seed, which
    values carry the scale cannot be told: the backward is not judged, the forward still is."""
    plain, scaled = (load(str(runs[k])).parts[0, 0].records for k in ("fp32", "scaled"))
    seed = next(i for i, r in enumerate(scaled) if r["op"] == "aten.ones_like.default")
    twin = next(i for i, r in enumerate(scaled) if r["stage"] == "backward")
    assert scaled[twin]["op"] == "aten.mul.Tensor" and scaled[seed]["stage"] == "forward"
    changed = scaled[:twin] + [{**scaled[twin], "op": "aten.div.Tensor"}] + scaled[twin + 1:]
    for order in ((plain, changed), (changed, plain)):
        *_, found = loss_scale.unscaled(*order)
        side = "A" if order[0] is changed else "B"
        assert found.whole_backward.startswith(f"backward: not judged: run {side} multiplies its loss by 65536 "), \
            found.whole_backward
        assert not found.unscaled     # nothing divided


# ---- the scale in the forms other stacks give it ----------------------------------------------------
SCALE_MADE_OUTSIDE = torch.tensor(1024.0)      # a user's tensor: no record makes it


def _scaled_backward(loss, form: str, scale: float) -> None:
    """``loss``'s backward, scaled by ``scale`` as ``form`` says (``plain``: not scaled)."""
    if form == "plain":
        loss.backward()
    elif form == "seed":                                  # the scale as backward's seed
        loss.backward(torch.tensor(scale))
    elif form == "grad_tensors":
        torch.autograd.backward(loss, grad_tensors=torch.tensor(scale))
    elif form == "full_seed":                             # a seed made inside the probe (aten.full)
        loss.backward(torch.full((), scale))
    elif form == "number":                                # DeepSpeed / Megatron: (loss.float() * scale).backward()
        (loss.float() * scale).backward()
    elif form == "mul_scalar":
        torch.ops.aten.mul.Scalar(loss, scale).backward()
    elif form == "tensor_made_outside":
        (loss * SCALE_MADE_OUTSIDE).backward()
    else:
        raise ValueError(form)


def _record_form(path, form: str, task: str = "statistics", scale: float = 1024.0, plant: bool = False,
                 mean: bool = False):
    """Two steps of the MLP's forward and backward, its loss scaled as ``form`` says; ``mean``: the
    loss a mean of squares (backward's seed read through an expand no record shows), not ``mse_loss``."""
    torch.manual_seed(0)
    model = SiluMLP()
    return _two_steps(path, model, task, plant, lambda loss: _scaled_backward(loss, form, scale), model.zero_grad,
                      mean)


FORMS = ("seed", "grad_tensors", "full_seed", "number", "mul_scalar", "tensor_made_outside")


@pytest.fixture(scope="module")
def forms(tmp_path_factory):
    root = tmp_path_factory.mktemp("loss_scale_forms")
    runs = {"plain": _record_form(root / "plain", "plain"), "plain_mean": _record_form(root / "pm", "plain", mean=True),
            "seed_mean": _record_form(root / "sm", "seed", mean=True),
            "plain_tensor": _record_form(root / "pt", "plain", task="tensor"),
            "seed_tensor": _record_form(root / "st", "seed", task="tensor")}
    for form in FORMS:
        runs[form] = _record_form(root / form, form)
        runs[form + "_wrong"] = _record_form(root / f"{form}_wrong", form, plant=True)
    for form in ("seed", "number"):
        runs[form + "_1000"] = _record_form(root / f"{form}_1000", form, scale=1000.0)
        runs[form + "_1000_wrong"] = _record_form(root / f"{form}_1000_wrong", form, scale=1000.0, plant=True)
    return runs


@pytest.mark.parametrize("pair", [("plain", f) for f in FORMS] + [("plain_mean", "seed_mean"),
                                                                  ("plain_tensor", "seed_tensor")])
def test_each_form_of_the_scale_is_compared_unscaled(forms, pair):
    for order, table, v in _both_orders(forms, *pair):
        assert v.passed and v.forward is None and v.backward is None, (order, str(v))
        assert not (table["status"] == "error").any(), order
        unscaled = table["reason"].str.contains(_said(order, pair[1], 1024), regex=False)
        assert unscaled[table["stage"] == "backward"].mean() > 0.5, order
        # the seed each run makes or is given, and the scaler's multiplies: explained, never a suspect
        assert v.unmatched.empty or (v.unmatched["explained"].str.startswith("loss scaling: ")).all(), \
            (order, v.unmatched)


@pytest.mark.parametrize("form", FORMS)
def test_a_wrong_backward_kernel_is_named_whatever_the_form(forms, form):
    for order, _, v in _both_orders(forms, "plain", form + "_wrong"):
        assert v.backward is not None and v.backward.cause == "op", (order, str(v))
        assert (v.backward.op, v.backward.scope) == ("aten.silu_backward.default", "SiluMLP"), (order, str(v))


@pytest.mark.parametrize("form", ["seed", "number"])
@pytest.mark.parametrize("wrong", [False, True])
def test_a_scale_no_power_of_two_leaves_the_backward_not_judged(forms, form, wrong):
    """Divided by 1000 the gradients round: the backward is not judged, and no op is named, not even
    a wrong kernel's (which the runs cannot show apart from the scale)."""
    run = f"{form}_1000" + ("_wrong" if wrong else "")
    for order, table, v in _both_orders(forms, "plain", run):
        assert v.forward is None and v.backward is None, (order, str(v))
        side = "A" if order[0] == run else "B"
        assert f"backward: not judged: run {side} multiplies its loss by 1000 and" in str(v), (order, str(v))
        backward = table[table["stage"] == "backward"]
        assert (backward["status"] == "not judged").all(), order
        assert backward["reason"].str.contains("no power of two", regex=False).all(), order
        assert not (table["status"] == "error").any(), order
