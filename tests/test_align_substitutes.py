"""The alignment's substituted-kernel pass pairs two ops of one scope by their output shapes where
neither has a counterpart (``addmm`` in one run for ``mm`` in the other, in any float dtype), but only
ops computing the same kind of value: an ``eq``'s boolean mask never pairs with an ``arange``'s
integer positions of the same shape (an eager run's causal mask beside a compiled graph's, which
compare then judged as the first forward divergence, 'error 1 (bool)')."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from dispatchprobe import DispatchProbe
from dispatchprobe.cli import main
from dispatchprobe.models import TinyTransformer, lm_batch, lm_loss
from dispatchprobe.offline.align import Mapping, align_ops
from dispatchprobe.torch.compile import probe_backend


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


def _valued(op: str, shape: list, mean: float, norm: float) -> dict:
    rec = _rec(op, "float32", shape)
    rec["outputs"][0]["stats"] = {"max": 1.0, "min": -1.0, "mean": mean, "norm": norm, "nan": 0, "inf": 0}
    rec["stage"] = "backward"
    return rec


def test_one_kernel_standing_for_several_pieces_pairs_with_the_whole_value():
    """Eager's ``stack`` (the backward of ``unbind``) against a compiled graph's three ``select_backward``
    and the ``add`` of them, all of one output shape: ``stack`` pairs with the last ``add``, which holds
    its values, not with the first piece (a third of them), whichever run is A."""
    shape = [3, 2, 8]
    around = _valued("aten.bmm.default", [2, 8], 0.1, 2.0), _valued("aten.clone.default", shape, 0.05, 3.0)
    recs_a = [around[0], _valued("aten.stack.default", shape, 0.05, 3.0), around[1]]
    pieces = [_valued("aten.select_backward.default", shape, 0.02, 1.7),
              _valued("aten.select_backward.default", shape, 0.01, 1.8),
              _valued("aten.add.Tensor", shape, 0.03, 2.5),
              _valued("aten.select_backward.default", shape, 0.02, 1.7),
              _valued("aten.add.Tensor", shape, 0.05, 3.0)]
    recs_b = [around[0], *pieces, around[1]]
    assert _pairs(recs_a, recs_b) == {(0, 0), (1, 5), (2, 6)}
    assert _pairs(recs_b, recs_a) == {(0, 0), (5, 1), (6, 2)}



def _reading(rec: dict, *made: dict) -> dict:
    """``rec`` reading the outputs of records ``made`` (its inputs: their output specs)."""
    rec["inputs"] = [dict(m["outputs"][0]) for m in made]
    return rec


def _concatenating(rec: dict, *made: dict) -> dict:
    """``rec`` a ``cat`` of the outputs of records ``made``: one input, the list of them, as recorded."""
    rec["inputs"] = [{"type": "list", "value": [dict(m["outputs"][0]) for m in made]}, {"type": "int", "value": -2}]
    return rec


def test_one_kernel_pairs_with_the_end_of_the_chain_it_stands_for_not_a_nearer_piece():
    """autograd's one ``silu_backward`` against ``torch.func.grad``'s decomposition of it: ``g * sigmoid(x)``
    (a piece the next ``mul`` reads) and that ``mul``, the whole value.  A forward difference can leave the
    piece's statistics nearer the one kernel's; the kernel pairs with the whole value all the same,
    whichever run is A."""
    shape = [2, 16, 128]
    before, after = _valued("aten.mm.default", [32, 64], 0.1, 2.0), _valued("aten.mm.default", [128, 64], 0.2, 3.0)
    grad, factor = _valued("aten.mm.default", shape, 0.3, 4.0), _valued("aten.add.Scalar", shape, 0.99, 63.6)
    piece = _reading(_valued("aten.mul.Tensor", shape, 2.47e-6, 0.021927), grad)
    whole = _reading(_valued("aten.mul.Tensor", shape, 2.19e-6, 0.021943), piece, factor)
    recs_a = [before, grad, _reading(_valued("aten.silu_backward.default", shape, 2.19e-6, 0.021872), grad), after]
    recs_b = [before, grad, factor, piece, whole, after]
    assert _pairs(recs_a, recs_b) == {(0, 0), (1, 1), (2, 4), (3, 5)}
    assert _pairs(recs_b, recs_a) == {(0, 0), (1, 1), (4, 2), (5, 3)}


def test_a_value_one_run_copies_once_more_pairs_where_it_was_made():
    """An eager attention's ``cat`` of its rotated keys, then the ``cat`` of an empty cache with them (the
    same values), against a compiled graph's one ``cat`` of the keys: the one ``cat`` pairs with the one
    making the keys, not the copy, whose input is another (a whole tensor, not the two halves): paired
    with the copy, the keys' ``cat`` was named a one-run-only prime suspect in two clean runs."""
    halves = _valued("aten.mul.Tensor", [2, 1, 8, 4], 0.02, 0.9), _valued("aten.add.Tensor", [2, 1, 8, 4], 0.03, 1.0)
    made = _concatenating(_valued("aten.cat.default", [2, 1, 8, 8], 0.0104, 1.229), *halves)
    empty = _valued("aten.empty.memory_format", [0], 0.0, 0.0)
    copy = _concatenating(_valued("aten.cat.default", [2, 1, 8, 8], 0.0104, 1.229), empty, made)
    after = _concatenating(_valued("aten.cat.default", [2, 2, 8, 16], -0.003, 1.83), copy)
    recs_a = [*halves, made, empty, copy, after]
    recs_b = [*halves, dict(made), _concatenating(dict(after), made)]
    assert _pairs(recs_a, recs_b) == {(0, 0), (1, 1), (2, 2), (5, 3)}
    assert _pairs(recs_b, recs_a) == {(0, 0), (1, 1), (2, 2), (3, 5)}

@pytest.mark.probe_backend
def test_eager_and_compiled_unbind_attention_agree(tmp_path):
    """End to end: one AdamW step of the built-in tiny transformer (its attention unbinds q, k, v), eager
    against ``probe_backend``, statistics: the runs agree in either order (the eager ``stack`` used to
    pair with the graph's first ``select_backward``: 'first backward divergence', exit 2)."""
    tokens, targets = lm_batch()
    runs = []
    for name, compiled in (("eager", False), ("compiled", True)):
        torch.manual_seed(0)
        model = TinyTransformer(dropout=0.0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        backend = probe_backend(task="statistics", dump_path=str(tmp_path / name), inner="aot_eager") if compiled \
            else None
        probe = DispatchProbe(task="statistics", dump_path=str(tmp_path / name))
        step = torch.compile(model, backend=backend) if compiled else model
        with probe:
            lm_loss(step, tokens, targets).backward()
        opt.step()
        probe.close()
        if compiled:
            backend.close()
            torch._dynamo.reset()
        runs.append(tmp_path / name)
    eager, compiled = runs
    for a, b in ((eager, compiled), (compiled, eager)):
        result = CliRunner().invoke(main, ["compare", str(a), str(b)])
        assert result.exit_code == 0, result.output
        assert "stack" not in result.output.splitlines()[2]


def _one_step(path, compiled: bool, task: str, wrong_stack: bool):
    """One AdamW step of the built-in tiny transformer, eager or under ``probe_backend`` (aot_eager);
    ``wrong_stack``: aten::stack's CPU kernel 1% too large (eager's backward of ``unbind``)."""
    torch.manual_seed(0)
    model = TinyTransformer(dropout=0.0)
    tokens, targets = lm_batch()
    lib = torch.library.Library("aten", "IMPL")
    if wrong_stack:
        lib.impl("stack", lambda ts, dim=0: torch.cat([t.unsqueeze(dim) for t in ts], dim) * 1.01, "CPU")
    try:
        backend = probe_backend(task=task, dump_path=str(path), inner="aot_eager") if compiled else None
        probe = DispatchProbe(task=task, dump_path=str(path))
        step = torch.compile(model, backend=backend) if compiled else model
        with probe:
            lm_loss(step, tokens, targets).backward()
        probe.close()
        if compiled:
            backend.close()
            torch._dynamo.reset()
    finally:
        lib._destroy()
    return path


@pytest.mark.probe_backend
def test_a_wrong_stack_against_a_compiled_graphs_pieces_is_named_with_its_region(tmp_path):
    """Eager's ``stack`` planted 1% wrong against a compiled graph's three ``select_backward`` and two
    ``add`` of one value: the verdict used to name the graph's first ``select_backward`` (present only in
    the compiled run, reading gradients that agree) as the prime suspect.  Either run's ops there may hold
    the wrong kernel, and statistics do not tell which: both orders name the value's region, the stack and
    the compiled run's pieces with it, and no op of the compiled run as a suspect (the kinds of wrong
    kernel and tensor records: tests/test_compare_stand_in_region.py)."""
    eager = _one_step(tmp_path / "eager", False, "statistics", wrong_stack=True)
    compiled = _one_step(tmp_path / "compiled", True, "statistics", wrong_stack=False)
    for a, b in ((eager, compiled), (compiled, eager)):
        result = CliRunner().invoke(main, ["compare", str(a), str(b)])
        assert result.exit_code == 2, result.output
        line = next(x for x in result.output.splitlines() if x.startswith("first backward divergence"))
        assert "prime suspect" not in line and "aten.stack.default" in line, result.output
        # each run's ops under its own label (listed in an order of their own: the same words both ways)
        assert f"run {'A' if a == eager else 'B'}: aten.stack.default" in line, line
        assert "aten.select_backward.default x3, aten.add.Tensor x2" in line, line
