"""The alignment's substituted-kernel pass pairs two ops of one scope by their output shapes where
neither has a counterpart (``addmm`` in one run for ``mm`` in the other, in any float dtype), but only
ops computing the same kind of value: an ``eq``'s boolean mask never pairs with an ``arange``'s
integer positions of the same shape (an eager run's causal mask beside a compiled graph's, which
compare then judged as the first forward divergence, 'error 1 (bool)')."""

from __future__ import annotations

from dispatchprobe.offline.align import Mapping, align_ops


def _rec(op: str, dtype: str, shape: list) -> dict:
    out = {"type": "tensor", "dtype": dtype, "shape": shape, "stride": [1] * len(shape), "stats": {}}
    return {"kind": "op", "op": op, "scope": "Model", "stage": "forward", "call": 0, "name": op,
            "inputs": [], "outputs": [out]}


def _pairs(recs_a: list, recs_b: list) -> set:
    al = align_ops(recs_a, recs_b, list(range(len(recs_a))), list(range(len(recs_b))), Mapping())
    return {(i, j) for i, j, _ in al.pairs}


def test_a_mask_never_pairs_with_positions_of_its_shape():
    around = _rec("aten.mm.default", "float32", [4, 4]), _rec("aten.add.Tensor", "float32", [4, 4])
    recs_a = [around[0], _rec("aten.eq.Scalar", "bool", [16]), around[1]]
    recs_b = [around[0], _rec("aten.arange.default", "int64", [16]), around[1]]
    for a, b in ((recs_a, recs_b), (recs_b, recs_a)):
        assert _pairs(a, b) == {(0, 0), (2, 2)}


def test_a_float_kernel_still_stands_in_for_another_in_another_float_dtype():
    around = _rec("aten.relu.default", "float32", [4, 8]), _rec("aten.add.Tensor", "float32", [4, 8])
    recs_a = [around[0], _rec("aten.addmm.default", "float32", [4, 8]), around[1]]
    recs_b = [around[0], _rec("aten.mm.default", "bfloat16", [4, 8]), around[1]]
    for a, b in ((recs_a, recs_b), (recs_b, recs_a)):
        assert _pairs(a, b) == {(0, 0), (1, 1), (2, 2)}
