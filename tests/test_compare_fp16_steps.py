"""compare of fp16 autocast training (with ``torch.amp.GradScaler``, as fp16 is trained) against fp32
and against bf16 autocast, over AdamW steps: a tiny Llama, statistics.

At step 0 the runs part by fp16's rounding only (a departure within tolerance); AdamW's first update,
close to the sign of each gradient element, carries it into step 1's parameters, where a few values
part past fp16's error line.  Once that departure was named as the stage's "first divergence"
(``aten.mm`` of ``lm_head``'s backward, a cast in the forward against bf16: exit 2 naming a kernel)
for two clean runs; a departure of rounding size where the runs compute in other precisions is what
their error rows grew from, as bf16 against fp32 says, and no op is named.  A wrong kernel is."""

from __future__ import annotations

import contextlib

import pytest
import torch

from compare_helpers import planted_kernel, tiny_llama, wrong_silu_backward
from dispatchprobe import DispatchProbe
from dispatchprobe.offline.compare import compare

pytest.importorskip("transformers")


def _record(path, precision: str, kernel: str | None = None, steps: int = 2, init_scale: float = 2.0 ** 16):
    """``steps`` AdamW steps of the tiny Llama (batch ``k`` from seed ``k``) under ``precision``:
    ``fp16`` (autocast, the loss scaled by a GradScaler starting at ``init_scale``), ``bf16``
    (autocast) or ``fp32``."""
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale) if precision == "fp16" else None
    probe = DispatchProbe(task="statistics", dump_path=str(path))
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    with planted_kernel(kernel, wrong_silu_backward if kernel else None):
        for step in range(steps):
            x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(step))
            with probe:
                with torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext():
                    loss = model(input_ids=x, labels=x).loss
                (scaler.scale(loss) if scaler else loss).backward()
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
            probe.step()
    probe.close()
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp16_steps")
    runs = {name: _record(root / name, precision, kernel) for name, precision, kernel in
            (("fp16", "fp16", None), ("fp32", "fp32", None), ("bf16", "bf16", None),
             ("fp16_wrong", "fp16", "silu_backward"))}
    runs["fp16_overflow"] = _record(root / "fp16_overflow", "fp16", init_scale=2.0 ** 19)
    return runs


@pytest.mark.parametrize("a, b", [("fp16", "fp32"), ("fp32", "fp16"), ("fp16", "bf16"), ("bf16", "fp16")])
def test_clean_runs_of_other_precisions_name_no_op(runs, a, b):
    """Both orders: every stage with error rows says they grew from rounding (or follow from the other
    stage's values), none names an op, and the place it names is the same whichever run is A (op,
    scope and call: its position counts the ops of the run holding it, the scaler's among them)."""
    _, v = compare(runs[a], runs[b])
    stages = [d for d in (v.forward, v.backward) if d is not None]
    assert stages and all(d.cause in ("rounding", "inherited") for d in stages), str(v)
    grown = [d for d in stages if d.cause == "rounding"]
    assert grown and all("first at " in str(v) and d.came_from.startswith("the runs part first at step 0")
                         for d in grown), str(v)
    assert "divergence:" not in str(v), str(v)
    _, swapped = compare(runs[b], runs[a])
    assert [(d.stage, d.cause, d.follows.split(" (")[0]) for d in grown] == \
        [(d.stage, d.cause, d.follows.split(" (")[0]) for d in (swapped.forward, swapped.backward)
         if d is not None and d.cause == "rounding"], (str(v), str(swapped))


@pytest.mark.parametrize("a, b", [("fp16_wrong", "fp32"), ("fp32", "fp16_wrong")])
def test_a_wrong_backward_kernel_under_fp16_is_named(runs, a, b):
    """silu's backward 30% too large in the fp16 run: named at step 0, whichever run is A."""
    _, v = compare(runs[a], runs[b])
    assert v.backward is not None and v.backward.cause == "op", str(v)
    assert (v.backward.op, v.backward.step) == ("aten.silu_backward.default", 0), str(v)


@pytest.mark.parametrize("a, b", [("fp16_overflow", "bf16"), ("bf16", "fp16_overflow"),
                                  ("fp16_overflow", "fp16"), ("fp16", "fp16_overflow")])
def test_a_loss_scale_overflowing_float16_names_no_kernel(runs, a, b):
    """A GradScaler starting at 2**19: step 0's scaled gradients overflow float16 (the scaler skips
    that update).  The inf is the scale's, not a kernel's: no op is named for it (it named lm_head's
    backward mm, "nan/inf counts differ"), its values are not judged, and a warning says the scaler
    skipped the update, whichever run is A.  Step 1's error rows are computed from parameters that
    differ by that skipped update, and its line says so (it said they grew from differences of
    rounding size, or that step 0's records agree and the optimizer step parted them)."""
    table, v = compare(runs[a], runs[b])
    stages = [d for d in (v.forward, v.backward) if d is not None]
    assert all(d.cause != "op" for d in stages), str(v)
    assert "divergence:" not in str(v), str(v)
    skipped = "fp16_overflow"
    side = "A" if a == skipped else "B"
    assert any(f"run {side}'s loss scale overflows in this step's backward" in p for p in v.problems), v.problems
    later = [d for d in stages if d.step > 0 and d.cause not in ("inherited",)]
    assert later and all(d.cause == "skipped" and f"run {side}'s loss scaler skipped step 0's update" in d.describe()
                         for d in later), str(v)
    assert "rounding size" not in str(v) and "optimizer step or other code" not in str(v), str(v)
    step0 = table[(table["step"] == 0) & (table["stage"] == "backward")]
    assert (step0["reason"].str.contains("loss scale overflowing") & (step0["status"] == "not judged")).any()
