"""Compiled graphs (GRAPH_MODE cells, ``@ms.jit`` functions) recorded from MindSpore's own dump.

At the end of each recorded region the kernels the graphs ran (:mod:`dispatchprobe_ms.graph_dump`)
go through the session's ``on_op`` in their execution order, as PyNative's primitives do: the
same filters, call indices, statistics (the backend's, on the dumped values), saved tensors and
inline checks.  A kernel's inputs and outputs are its dumped arrays as MindSpore tensors; what the
graph passes as a scalar (an attribute such as ``epsilon``) becomes a Python number, as PyNative
passes it.
"""

from __future__ import annotations

import os
import warnings

import mindspore as ms
import numpy as np

from dispatchprobe.core.recorder import Measured
from dispatchprobe.records.format import UNRECORDED_GRAPH_STEPS

from . import tensor_backend as ms_backend
from . import graph_dump, graph_ir, graph_pairing, ops
from .graph_scopes import GraphScopes, dump_kernels, stage_of

_NUMPY = {"Int64": np.int64, "Int32": np.int32, "Int8": np.int8, "UInt8": np.uint8, "Bool": np.bool_,
          "Float16": np.float16, "Float32": np.float32, "Float64": np.float64}


class GraphCapture:
    def __init__(self, session, model, keep: str | None = None, dump_filter: bool = True):
        self.session = session
        self.scopes = GraphScopes(model)
        self.keep = keep
        config = session.config
        # MindSpore's dump narrowed to what scope/list could select (a superset: the read filter is exact)
        stages = [s for s in ("forward", "backward") if config.stage_enabled(s)]
        kernels = dump_kernels(model, config.scope, config.list, session.selector.in_scope, stages) \
            if dump_filter else []
        self.folder, self.why_not = graph_dump.enable(kernels)
        self.left_out: set[str] = set()    # kernels the dump filter kept out that the read filter selects
        self.kernels = 0                   # kernels read from the dump (whole run)
        self.unmatched = 0                 # kernels whose files disagreed with the graph's IR (not recorded)
        self.unrecorded_steps: dict = {}   # step -> why its graph kernels were not recorded (the manifest says it)
        # a kernel of the model's own computation came from a graph (the manifest says so): one in
        # a cell of the model or in backward, not an optimizer update PyNative runs as a graph
        self.recorded = False

    @property
    def filtered(self) -> bool:
        """Whether MindSpore dumps only the kernels a filter selects (this probe's or, read at
        the process's first compile, an earlier one's)."""
        return self.folder is not None and bool(self.folder.kernels)

    def start(self) -> None:
        """A recorded region begins: MindSpore dumps from now on (what graphs ran outside a
        region, where it cannot be switched off, is dropped)."""
        if self.folder is not None:
            self.folder.discard()
            self.folder.switch(True)

    def finish(self) -> None:
        """A recorded region ends: MindSpore stops dumping; the kernels its graphs ran, recorded
        in order."""
        if self.folder is None:
            return
        self.folder.sync()
        self.folder.switch(False)
        kernels = self.folder.take()
        self.kernels += len(kernels)
        session = self.session
        unmatched = [k for k in kernels if k.unpaired or not graph_pairing.files_agree(k, k.node)]
        if unmatched:           # the files cannot be told apart reliably: nothing recorded rather than wrong records
            self.folder.release(os.path.join(self.keep, f"step{session.step_no}") if self.keep else None)
            self.unmatched += len(unmatched)
            first = next((k for k in unmatched if k.unpaired), unmatched[0])
            why = f"MindSpore's dump could not be matched to the graph's kernels ({len(unmatched)} of {len(kernels)} " + \
                (f"kernels' files not told apart, first {first.scope}: {first.unpaired})" if first.unpaired else
                 f"kernels' files disagree with the graph's dtypes or shapes, first {first.scope})")
            self.unrecorded_steps[str(session.step_no)] = why
            session.note_in_manifest(UNRECORDED_GRAPH_STEPS, dict(self.unrecorded_steps))
            warnings.warn(f"dispatchprobe_ms: step {session.step_no}: {why}: the step's graph kernels are not "
                          "recorded", RuntimeWarning, stacklevel=4)
            return
        if self.filtered:
            self._check_left_out()
        stages = _stages(kernels)
        for k, stage in zip(kernels, stages):
            if k.type in graph_ir.BOOKKEEPING:
                continue
            node = k.node
            _, scope = self.scopes.kernel(k.scope, node)
            if not session.would_record(stage, scope, k.type):
                continue
            shapes = (node.inputs, node.outputs) if node is not None else ([], [])
            written = ops.written_positions(k.type)
            args = node.args if node is not None else []
            inputs = tuple(_constant(args[i]) if i not in k.inputs else
                           _written(_load(k.inputs, i, shapes[0])) if i in written else
                           _value(_load(k.inputs, i, shapes[0]), _scalar(shapes[0], i))
                           for i in range(_count(k.inputs, args)))
            attrs = ops.constructor_attrs(k.type, node.attrs) if node is not None else {}
            outs = [_value(_load(k.outputs, i, shapes[1]), False) for i in range(_count(k.outputs))]
            outputs = outs[0] if len(outs) == 1 else tuple(outs)
            undefined = _undefined(k.type, node, inputs, outs, ms_backend.accelerator())
            if not self.recorded and (scope or stage == "backward"):
                self.recorded = True
                session.graph_kernels_recorded()
            session.on_op(k.type, stage, scope, inputs, attrs, outputs, undefined=undefined,
                          extra={"graph_kernel": k.scope})
        self.folder.release(os.path.join(self.keep, f"step{session.step_no}") if self.keep else None)

    def _check_left_out(self) -> None:
        """Say, once per kernel, when a kernel MindSpore's filtered dump left out is one the read
        filter selects (the dump filter is meant as a superset; this is its check where a graph
        ran in the region)."""
        session = self.session
        for name, node, stage in self.folder.missing:
            if name in self.left_out:
                continue
            last = name.rsplit("/", 1)[-1]
            kind = node.op if node is not None and node.op else graph_dump._OP_NUMBER.sub("", last)
            if kind in graph_ir.BOOKKEEPING:
                continue
            stage = stage or "forward"
            _, scope = self.scopes.kernel(name, node)
            if session.config.stage_enabled(stage) and session.selector.in_scope(scope) \
                    and session.selector.op_selected(kind):
                self.left_out.add(name)
                warnings.warn(f"dispatchprobe_ms: MindSpore's dump filter left out {name} ({kind}, scope "
                              f"{scope!r}), which scope/list select: it is not recorded; "
                              "DispatchProbe(..., dump_filter=False) dumps every kernel", RuntimeWarning, stacklevel=4)

    def warn_if_unavailable(self, pynative: bool) -> None:
        """One line when compiled graphs cannot be recorded (in PyNative the dispatched primitives
        still are: ``graphs=False`` says that is all the user wants)."""
        if self.why_not:
            also = " (PyNative primitives are recorded; graphs=False records only them, without this warning)" \
                if pynative else ""
            warnings.warn(f"dispatchprobe_ms: {self.why_not}{also}", RuntimeWarning, stacklevel=3)


def _undefined(kind: str, node, inputs: tuple, outputs: list, device: str) -> set | None:
    """Ids of a kernel's values holding memory no kernel wrote: its own outputs it leaves unwritten
    on ``device``, and the inputs the graph's IR says are such an output of another kernel
    (BatchNormGrad's input 5, BatchNorm's output 2 on the CPU).  Recorded as ``undefined``, never
    judged as values: the dump holds whatever the memory held."""
    unwritten = ops.unwritten_outputs(kind, device)
    ids = {id(o) for i, o in enumerate(outputs) if i in unwritten and o is not None}
    for i, source in enumerate(node.sources if node is not None else ()):
        if source is not None and i < len(inputs) and source[1] in ops.unwritten_outputs(source[0], device):
            ids.add(id(inputs[i]))
    return ids or None


def _stages(kernels: list) -> list[str]:
    """Each kernel's stage: the one its graph's execution order gives it (graph_dump), else:
    ``Gradients/`` kernels are backward; a kernel MindSpore expanded from another
    (``Expand/_PowTensorScalar/Pow-op0``) has no stage in its name and takes the stage of the next
    kernel that has one (the gradient it is part of)."""
    out, pending = [], 0
    for k in kernels:
        stage = k.stage or (None if k.scope.startswith("Expand/") else stage_of(k.scope))
        if stage is None:
            pending += 1
            out.append(None)
            continue
        out[len(out) - pending:] = [stage] * pending
        pending = 0
        out.append(stage)
    return [s or "forward" for s in out]


def _count(by_position: dict, args: list = ()) -> int:
    """How many inputs a kernel has: those dumped, and the constants the IR gives after them
    (``Reshape``'s shape; not the monads that order side effects)."""
    n = max(by_position) + 1 if by_position else 0
    while n < len(args) and graph_ir.constant(args[n]) is not None:
        n += 1
    return n


def _constant(text: str):
    """An argument the graph passes as a constant (not dumped), as PyNative passes it: a tuple, a
    number, or a MindSpore tensor for a constant tensor; None when the IR gives no value."""
    value = graph_ir.constant(text)
    if isinstance(value, tuple) and len(value) == 3 and value[0] == "tensor":
        return ms.Tensor(np.array(value[2], dtype=_NUMPY.get(value[1], np.float32)))
    return value


def _load(files: dict, i: int, shapes: list):
    """Value ``i`` of a kernel, in the shape the graph gives it (a no-op reshape before the kernel
    leaves the dumped memory in the shape before it), or None when it was not dumped."""
    if i not in files:
        return None
    array = np.load(files[i])
    shape = shapes[i] if i < len(shapes) else None
    if shape is not None and tuple(array.shape) != shape and array.size == int(np.prod(shape)):
        array = array.reshape(shape)
    return array


def _written(array):
    """An input the kernel writes in place: MindSpore dumps inputs after the kernel ran, so the
    values are the written ones, not those the kernel received: described, not measured."""
    if array is None:
        return None
    spec = ms_backend.tensor_meta(ms.Tensor(array))
    spec["no_values"] = "written by the kernel before MindSpore's dump read it (the dump holds the new values)"
    return Measured(spec)


def _scalar(shapes: list, i: int) -> bool | None:
    """Whether input ``i`` is a scalar in the graph (``<Float32, NoShape>``, not a tensor); None
    where the IR does not say."""
    return shapes[i] is None if i < len(shapes) else None


def _value(array, scalar: bool | None):
    """A dumped value as the probe records it: a MindSpore tensor, or a Python number for what
    the graph passes as a scalar (where the IR does not say: a 0-dim integer or boolean)."""
    if array is None:
        return None
    if array.ndim == 0 and (scalar or scalar is None and array.dtype.kind in "biu"):
        return array.item()
    return ms.Tensor(array)
