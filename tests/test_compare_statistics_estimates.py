"""On statistics alone an op whose inputs differ is named only on strong evidence.

A statistics difference is a lower bound of the values' difference, so an op reading values that
differ may look like it amplifies them when it adds nothing (origin.OwnShare.estimate).  Here a tiny
HF Llama with a padding mask trains two AdamW steps in float32 against bfloat16 autocast: a forward
silu planted 0.1% too large (below bfloat16's resolution, invisible) must not name a backward op,
while a silu backward planted 30% too large is still named; both orders alike."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from compare_helpers import record_adamw_steps, tiny_llama, wrong_silu_backward

from dispatchprobe.offline.compare import compare
from dispatchprobe.offline.compare.origin import NONE, STRONG, OwnShare

transformers = pytest.importorskip("transformers")


def silu_too_large(x):
    """silu 0.1% too large in magnitude: below bfloat16's resolution (0.4%)."""
    return x * torch.sigmoid(x) * (1 + 1e-3 * torch.sign(x))


def record_llama(path, *, autocast: bool, plant: str | None = None, kernel=None, steps: int = 2):
    """Record ``steps`` AdamW steps of a tiny Llama on a padded batch, statistics task."""
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 10:] = 0
    return record_adamw_steps(path, tiny_llama(), lambda m: m(input_ids=tokens, labels=tokens, attention_mask=mask).loss,
                              steps=steps, autocast=autocast, plant=plant, kernel=kernel)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("estimates")
    return {"fp32": record_llama(root / "fp32", autocast=False),
            "silu": record_llama(root / "silu", autocast=True, plant="silu", kernel=silu_too_large),
            "silu_backward": record_llama(root / "sb", autocast=True, plant="silu_backward",
                                          kernel=wrong_silu_backward)}


@pytest.mark.parametrize("swap", [False, True])
def test_forward_plant_below_resolution_names_no_backward_op(runs, swap):
    a, b = (runs["silu"], runs["fp32"]) if swap else (runs["fp32"], runs["silu"])
    verdict = compare(a, b, tensors=False).verdict
    backward = verdict.backward
    assert backward is not None and backward.errors > 0
    assert backward.cause == "inherited", str(verdict)


@pytest.mark.parametrize("swap", [False, True])
def test_planted_backward_kernel_still_named(runs, swap):
    a, b = (runs["silu_backward"], runs["fp32"]) if swap else (runs["fp32"], runs["silu_backward"])
    backward = compare(a, b, tensors=False).verdict.backward
    assert backward.cause == "op" and backward.op == "aten.silu_backward.default"
    assert backward.approximate and not backward.unjudged
    assert backward.metrics["stats_err"] > 0.2


def record_t5(path, *, autocast: bool, steps: int = 2):
    """Record ``steps`` AdamW steps of a tiny T5, statistics task."""
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                                num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(cfg).train()
    gen = torch.Generator().manual_seed(0)
    tokens, labels = torch.randint(1, 128, (2, 16), generator=gen), torch.randint(1, 128, (2, 8), generator=gen)
    return record_adamw_steps(path, model, lambda m: m(input_ids=tokens, labels=labels).loss, steps=steps,
                              autocast=autocast)


@pytest.fixture(scope="module")
def t5_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("t5")
    return record_t5(root / "fp32", autocast=False), record_t5(root / "ac", autocast=True)


@pytest.mark.parametrize("swap", [False, True])
def test_float32_op_on_bfloat16_values_not_named(t5_runs, swap):
    """T5's layer norm weight gradient (a float32 mul in both runs) reads gradients computed from
    bfloat16 matmuls: its statistics differ 16x more than its inputs' (an extreme element of a
    product), within what a bfloat16 rounding of those inputs explains.  No op computed in float32
    in both runs is named."""
    a, b = t5_runs[::-1] if swap else t5_runs
    table, verdict = compare(a, b)
    backward = verdict.backward
    assert backward is not None and backward.errors > 0
    rows = table[(table["stage"] == "backward") & (table["step"] == backward.step) & (table["seq"] == backward.seq)
                 & (table["io"] == "output")]
    computed_in = set(rows["dtype_a"]) | set(rows["dtype_b"])
    assert backward.cause != "op" or computed_in != {"float32"}, str(verdict)


def own_share(out_err: float, *, in_err: float = 1e-5, in_dtype: str = "float32", out_error_row: bool,
              stage_errors: bool = True, measured: bool = False):
    """(the OwnShare judgement of record 0: one input row, one output row; its ``unjudged`` notes).
    ``stage_errors``: another row of the stage is an error row; ``measured``: tensors, not statistics."""
    df = pd.DataFrame({"stage": ["backward"] * 3, "error": [in_err, out_err, 0.5],
                       "rel_l2_err": [in_err if measured else np.nan, np.nan, np.nan],
                       "dtype_a": ["float32"] * 3, "dtype_b": [in_dtype, "float32", "float32"]})
    share = OwnShare(df, [{"op": "aten.mul.Tensor", "stage": "backward"}], [], {}, None,
                     np.array([False, out_error_row, stage_errors]))
    return share(0, [1], [0]), share.unjudged


def test_estimate_below_the_error_line_is_no_source():
    assert own_share(5e-4, out_error_row=False) == (NONE, {"backward": 0})
    assert own_share(5e-4, out_error_row=True) == (STRONG, {})
    # a departure (no error rows in the stage) is placed as before; tensors measure element-wise differences
    assert own_share(5e-4, out_error_row=False, stage_errors=False) == (STRONG, {})
    assert own_share(5e-4, out_error_row=False, measured=True) == (STRONG, {})


def test_estimate_counts_a_rounding_of_the_inputs_precision():
    # inputs judged in bfloat16 (unit roundoff 2^-8): 10 x 0.0039 explains an output 0.025 off
    assert own_share(0.025, in_err=1.5e-3, in_dtype="bfloat16", out_error_row=True) == (NONE, {})
    assert own_share(0.3, in_err=1.5e-3, in_dtype="bfloat16", out_error_row=True) == (STRONG, {})
    assert own_share(0.025, in_err=1.5e-3, out_error_row=True) == (STRONG, {})


def test_the_verdict_says_which_op_was_not_named():
    from dispatchprobe.offline.compare import Divergence
    div = Divergence(stage="backward", step=0, rank=0, seq=1, scope="m", op="aten.mm.default", name="", call=0,
                     kind="op", failed="", cause="inherited", arg="input.1", errors=3,
                     unjudged="aten.mul.Tensor [m.norm] call 2 (#9 in backward) ... cannot be judged")
    assert div.describe().splitlines()[1] == "  not named: aten.mul.Tensor [m.norm] call 2 (#9 in backward) ... cannot be judged"
