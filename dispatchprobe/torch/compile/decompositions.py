"""Inductor's decompositions, each noting on the nodes it makes the call it decomposes (the op,
its arguments as traced, its outputs by position), so a decomposed call is recorded as eager
calls it."""

from __future__ import annotations

import functools
import itertools

import torch
import torch.fx

from .. import tensor_backend as torch_backend
from ..internals.dispatch import tree_map
from ..internals.inductor import select_decomp_table

CALL_KEY = "dispatchprobe_call"         # node.meta: the traced call (a Call) a decomposition's node comes from
OUTPUT_KEY = "dispatchprobe_output"     # node.meta: which output of that call the node is
VALUE_KEY = "dispatchprobe_value"       # node.meta: identity of a value a traced call reads
_value_ids = itertools.count()


class Value:
    """A tensor argument of a traced call: the id put on the node holding it, and its metadata
    (for an argument the post-grad graph no longer reads)."""

    __slots__ = ("id", "spec")

    def __init__(self, vid, spec: dict):
        self.id, self.spec = vid, spec


class Call:
    """A call that inductor's decompositions replace, as AOTAutograd traced it: the op, its
    arguments (tensors as :class:`Value`, symbolic sizes as their hints) and its output count.
    Plain data, shared by the nodes of its decomposition through their metadata (which survives
    the partitioner's and the passes' graph copies)."""

    __slots__ = ("op", "args", "kwargs", "outputs")

    def __init__(self, op, args, kwargs, outputs: int):
        self.op, self.args, self.kwargs, self.outputs = op, args, kwargs, outputs


_IDENTITIES = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def traced_decompositions() -> dict:
    """Inductor's decomposition table, each entry noting the call it decomposes on the nodes it
    makes, so a decomposed call can be recorded with its arguments and its outputs by position."""
    return {op: _traced(op, fn) for op, fn in select_decomp_table().items()}


def _traced(op, fn):
    @functools.wraps(fn)
    def decomposition(*args, **kwargs):
        from torch.fx.experimental import proxy_tensor
        mode = proxy_tensor.get_proxy_mode()
        # only the outermost call (the one named by original_aten), not the calls it decomposes into
        if mode is None or proxy_tensor.ORIGINAL_ATEN.get() is not op:
            return fn(*args, **kwargs)
        tracer = mode.tracer
        nodes = tracer.graph.nodes
        last = next(reversed(nodes), None)

        def value(x):
            if isinstance(x, torch.Tensor):
                slot = proxy_tensor.get_proxy_slot(x, tracer, None)
                spec = torch_backend.traced_meta(x)
                spec["shape"] = [hint(d) for d in spec["shape"]]
                spec["stride"] = [hint(d) for d in spec["stride"]] if spec["stride"] is not None else None
                spec["requires_grad"] = False
                vid = None
                if slot is not None:
                    node = slot.proxy.node
                    # autograd's saved values are detach()es of the value, which later passes drop
                    while node.target in _IDENTITIES and isinstance(node.args[0], torch.fx.Node):
                        node = node.args[0]
                    vid = node.meta.setdefault(VALUE_KEY, next(_value_ids))
                return Value(vid, spec)
            if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                return hint(x)
            return x

        call_args, call_kwargs = tree_map(value, (tuple(args), dict(kwargs)))
        out = fn(*args, **kwargs)
        if out is NotImplemented:
            return out
        flat = out if isinstance(out, (tuple, list)) else (out,)
        call = Call(op, call_args, call_kwargs, len(flat))
        node = last.next if last is not None else next(iter(nodes), None)
        while node is not None and node.op != "root":
            node.meta[CALL_KEY] = call
            node = node.next
        for i, t in enumerate(flat):
            if isinstance(t, torch.Tensor):
                slot = proxy_tensor.get_proxy_slot(t, tracer, None)
                if slot is not None and slot.proxy.node.meta.get(CALL_KEY) is call:
                    slot.proxy.node.meta.setdefault(OUTPUT_KEY, i)
        return out

    return decomposition


def hint(size):
    """A size (or symbolic scalar) as the plain value of its hint."""
    if isinstance(size, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        hint = size.node.hint
        if hint is None:
            return -1 if isinstance(size, torch.SymInt) else None
        return {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(size)](hint)
    return int(size)
