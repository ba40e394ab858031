"""Regions, the spans two frameworks compute with other ops, on hand-made records: what a region
holds, where it sits and which boundary values pair (the MindSpore-against-PyTorch tests in
test_cross_framework.py run the same code on real runs)."""

from __future__ import annotations

from dispatchprobe.offline.regions import _leaving, _readers, _region_inputs, _region_record, by_phase


def spec(mean: float, shape=(4, 4), key=None) -> dict:
    s = {"type": "tensor", "dtype": "float32", "shape": list(shape),
         "stats": {"max": mean, "min": mean, "mean": mean, "norm": abs(mean) * (16 if shape else 1) ** 0.5}}
    return s | ({"data": key} if key else {})


def rec(op: str, stage: str = "forward", scope: str = "", inputs=(), outputs=()) -> dict:
    return {"kind": "op", "op": op, "name": f"{op}.0.{stage}", "stage": stage, "scope": scope,
            "inputs": list(inputs), "outputs": list(outputs)}


def test_the_loss_and_the_optimizer_step_split_at_the_backward():
    """One forward-stage gap holding a loss (before the backward) and an optimizer step (after it)
    becomes two, paired by phase; a phase one run alone has stays unpaired."""
    a = [rec("mm"), rec("log_softmax"), rec("mm", "backward"), rec("Adam"), rec("Adam")]
    b = [rec("mm"), rec("ReduceMax"), rec("Exp"), rec("mm", "backward"), rec("lerp_"), rec("addcdiv_")]
    assert by_phase(a, b, [([1, 3, 4], [1, 2, 4, 5])]) == [([1], [1, 2]), ([3, 4], [4, 5])]
    assert by_phase(a, b[:4], [([1, 3, 4], [1, 2])]) == [([1], [1, 2]), ([3, 4], [])]
    assert by_phase(a, b, [([1], [1, 2])]) == [([1], [1, 2])]          # nothing to split


def test_a_single_number_pairs_only_with_an_equal_one():
    """A tensor pairs with the closest of its size within 5%; a scalar only with an equal one (an
    Adam beta power 0.999 is no counterpart of a step count 1.0)."""
    grad_a, grad_b = spec(0.5), spec(0.5001)
    got = _region_inputs([spec(0.999, ()), grad_a], [spec(1.0, ()), grad_b])
    assert got == [(grad_a, grad_b)]
    one_a, one_b = spec(1.0, ()), spec(1.0, ())
    assert _region_inputs([one_a], [one_b]) == [(one_a, one_b)]


def test_a_cast_of_its_input_does_not_move_a_region_out_of_its_module():
    recs = [rec("_to_copy", scope=""), rec("embedding", scope="Net.emb"), rec("Gather", scope="Net.emb")]
    assert _region_record(recs, [0, 1], [], [])["scope"] == "Net.emb"
    assert _region_record(recs, [2], [], [])["scope"] == "Net.emb"
    assert _region_record([rec("_to_copy", scope="")], [0], [], [])["scope"] == ""


def test_the_result_is_not_a_constant_of_its_shape_after_it():
    """Autograd's ones_like seed after the loss (recorded in one run's forward) is read by the
    backward, but the region's result is the loss."""
    loss, seed = spec(2.5, (), "loss"), spec(1.0, (), "seed")
    recs = [rec("mse_loss", outputs=[loss]), rec("ones_like", inputs=[loss], outputs=[seed]),
            rec("mse_loss_backward", "backward", inputs=[seed])]
    leaving = _leaving(recs, [0, 1], _readers(recs))
    results = [s for s, _, n in leaving if n is not None]
    assert results == [loss]


def test_a_region_drawing_random_numbers_is_random_by_its_label():
    """One framework's dropout primitive is the other's bernoulli_ + div + mul: either run's region
    label says it draws, wherever the drawing op sits in it."""
    from dispatchprobe.core.op_traits import is_random, region_label
    assert is_random(region_label(["Dropout"]))
    assert is_random(region_label(["aten.bernoulli_.float", "aten.div_.Scalar", "aten.mul.Tensor"]))
    middle = region_label(["aten.empty_like.default", "aten.bernoulli_.float", "aten.mul.Tensor"])
    assert middle == "region(3 ops: aten.empty_like.default .. aten.bernoulli_.float .. aten.mul.Tensor)"
    assert is_random(middle)
    assert not is_random(region_label(["ReduceMax", "aten.sub.Tensor", "aten.exp.default"]))
    assert region_label(["ReduceMax", "aten.exp.default"]) == "region(2 ops: ReduceMax .. aten.exp.default)"
