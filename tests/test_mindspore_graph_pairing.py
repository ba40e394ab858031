"""dispatchprobe_ms/graph_pairing.py on dump files written here: a family of expanded kernels whose file names
MindSpore numbered apart from the graph's IR is paired again by shapes and by its neighbours' values, and only
where the evidence forces it; a file set left with a choice is never guessed (its step goes unrecorded)."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.mindspore      # dispatchprobe_ms imports MindSpore (ci/matrix.py's mindspore leg)
pytest.importorskip("mindspore")

from dispatchprobe_ms import graph_pairing
from dispatchprobe_ms.graph_dump import Kernel
from dispatchprobe_ms.graph_ir import Node

SUM = "Expand/_SumExt/ReduceSum"
X = np.arange(12, dtype=np.float32).reshape(4, 3)       # what Exp-op0 made
Y = -X - 1                                                # what Neg-op0 made: the same shape, other values
Z = np.arange(6, dtype=np.float32)


def _node(ref, op, args, inputs, outputs):
    return Node(inputs=inputs, outputs=[o.shape for o in outputs], input_dtypes=["Float32" if s else None for s in inputs],
                output_dtypes=["Float32"] * len(outputs), args=args, op=op, ref=ref)


def _graph():
    """Exp and Neg each feed a row sum of the same shapes (ReduceSum-op0, -op1); a third sums a vector (-op2)."""
    nodes = {"Default/Exp-op0": _node("%0", "Exp", ["%p"], [(4, 3)], [X]),
             "Default/Neg-op0": _node("%1", "Neg", ["%p"], [(4, 3)], [Y]),
             f"{SUM}-op0": _node("%2", "ReduceSum", ["%0", "(I64(1))", "Bool(0)"], [(4, 3), None, None], [X.sum(1)]),
             f"{SUM}-op1": _node("%3", "ReduceSum", ["%1", "(I64(1))", "Bool(0)"], [(4, 3), None, None], [Y.sum(1)]),
             f"{SUM}-op2": _node("%4", "ReduceSum", ["%q", "()", "Bool(0)"], [(6,), None, None], [Z.sum()])}
    order = {name.replace("/", "_"): (i, name) for i, name in enumerate(nodes)}
    return nodes, order, ["forward"] * len(nodes)


_DTYPE = {"f": "Float32", "b": "Bool", "i": "Int64"}


def _files(tmp_path, name, inputs: dict, outputs: dict) -> Kernel:
    """A kernel's dump files named after ``name`` (as MindSpore names them): {position: array} of each side."""
    flat = name.replace("/", "_")
    k = Kernel(name.rsplit("/", 1)[-1].split("-op")[0], name)
    for io, arrays, slots in (("input", inputs, k.inputs), ("output", outputs, k.outputs)):
        for i, a in arrays.items():
            path = tmp_path / f"{k.type}.{flat}.0.0.{1000 + i}.{io}.{i}.DefaultFormat.{_DTYPE[a.dtype.kind]}.npy"
            np.save(path, a)
            slots[i] = str(path)
    return k


# each row sum's dumped inputs ({position: array}: a constant axis () is not dumped) and output
_VALUES = {f"{SUM}-op0": ({0: X, 1: np.array([1]), 2: np.array(False)}, {0: X.sum(1)}),
           f"{SUM}-op1": ({0: Y, 1: np.array([1]), 2: np.array(False)}, {0: Y.sum(1)}),
           f"{SUM}-op2": ({0: Z, 2: np.array(False)}, {0: np.array(Z.sum())})}


def _sums(tmp_path, nodes, named):
    """The three row sums' files: those named ``-op{n}`` hold IR kernel ``named[n]``'s values."""
    out = []
    for n, truth in enumerate(named):
        k = _files(tmp_path, f"{SUM}-op{n}", *_VALUES[truth])
        k.node = nodes[k.scope]
        out.append(k)
    return out


def _repair_with_producers(tmp_path, named) -> dict:
    """The row sums' files (``_sums``) and those of the two producers, paired: {kernel name: kernel}."""
    nodes, order, stages = _graph()
    producers = [_files(tmp_path, "Default/Exp-op0", {0: X}, {0: X}), _files(tmp_path, "Default/Neg-op0", {0: Y}, {0: Y})]
    for k in producers:
        k.node = nodes[k.scope]
    return {k.scope: k for k in graph_pairing.repair(producers + _sums(tmp_path, nodes, named), nodes, order, stages)}


def _holds(kernel) -> np.ndarray:
    return np.load(kernel.inputs[0])


def test_files_numbered_apart_are_paired_by_shape_and_by_their_producers_values(tmp_path):
    """The file named -op0 holds -op2's vector sum (told by its shape); -op1's and -op2's files hold the two
    row sums, alike in shape, told apart by the values of their producers (Exp, Neg: alone in their families)."""
    got = _repair_with_producers(tmp_path, [f"{SUM}-op2", f"{SUM}-op0", f"{SUM}-op1"])
    assert np.array_equal(_holds(got[f"{SUM}-op0"]), X) and np.array_equal(_holds(got[f"{SUM}-op1"]), Y)
    assert np.array_equal(_holds(got[f"{SUM}-op2"]), Z)
    assert not any(k.unpaired for k in got.values())
    assert all(graph_pairing.files_agree(k, k.node) for k in got.values())


def test_files_alike_with_no_evidence_are_never_guessed(tmp_path):
    """Without the producers' files the two row sums cannot be told apart: the vector sum is still paired (its
    shape is its own), the two others keep ``unpaired`` (why), so their step is not recorded."""
    nodes, order, stages = _graph()
    got = graph_pairing.repair(_sums(tmp_path, nodes, [f"{SUM}-op2", f"{SUM}-op0", f"{SUM}-op1"]), nodes, order, stages)
    paired = [k for k in got if not k.unpaired]
    assert [k.scope for k in paired] == [f"{SUM}-op2"] and np.array_equal(_holds(paired[0]), Z)
    left = [k for k in got if k.unpaired]
    assert len(left) == 2 and all("fit 2 kernels" in k.unpaired and "do not say which" in k.unpaired for k in left)


def test_a_file_set_no_kernel_fits_leaves_its_family_unpaired(tmp_path):
    """A file set whose shapes no kernel of its family has: the family's names cannot be trusted, none is paired."""
    nodes, order, stages = _graph()
    kernels = _sums(tmp_path, nodes, [f"{SUM}-op2", f"{SUM}-op0", f"{SUM}-op1"])
    odd = np.arange(7, dtype=np.float32)
    np.save(kernels[0].inputs[0], odd)
    np.save(kernels[0].outputs[0], np.array(odd.sum()))
    got = graph_pairing.repair(kernels, nodes, order, stages)
    assert all(k.unpaired for k in got) and "fit no kernel" in kernels[0].unpaired


def test_a_run_whose_files_agree_is_left_as_it_is(tmp_path):
    """Files that agree with the IR everywhere: nothing is read again, nothing renamed."""
    nodes, order, stages = _graph()
    kernels = _sums(tmp_path, nodes, [f"{SUM}-op0", f"{SUM}-op1", f"{SUM}-op2"])
    assert graph_pairing.repair(kernels, nodes, order, stages) is kernels
