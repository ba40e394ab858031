"""The nodes that compute each recorded value's statistics inside the graph, and where they read it."""

from __future__ import annotations

import math
import os

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .. import ops
from ..internals.dispatch import OpOverload, op_schema
from ..internals.inductor import node_storage, reinplace_candidates
from .decompositions import hint
from .runtime import GRAPH_INPUT, GRAPH_OUTPUT  # (importing runtime registers dispatchprobe::stats_rows)

# values one stats_rows call completes at most, and their bytes: a window keeps its values alive
# until its call.  Windows of a few MB read values still in the last-level cache (at 64 MB they
# come from memory); fewer values per window split more of inductor's fusions, which lengthens
# the compile more than it shortens the step (docs/compile.md, Cost)
WINDOW_VALUES = 32
WINDOW_BYTES = 8 << 20


# where a CPU value's statistics are computed: "host", the default (the window computes them, with the
# eager probe's one-pass kernel, from the values it is given: a graph as small as inductor's, one
# read per value, as fast a step) or "graph" (four reductions inductor fuses into the kernels,
# completed by a window: a graph of five more nodes per value, which takes three times as long to compile)
def cpu_stats() -> str:
    return os.environ.get("DISPATCHPROBE_COMPILED_CPU_STATS", "host")


class Reductions:
    """A CPU value's in-graph reductions (none with :func:`cpu_stats` ``"host"``), completed into its
    row by a :func:`_stats_rows` window placed after ``at``."""

    def __init__(self, node: torch.fx.Node, nodes: list, at: torch.fx.Node):
        self.node, self.nodes, self.at = node, nodes, at


# views that show all of their base's elements, in another shape or order: the same statistics
# (as the eager probe's cache gives a transpose of a value the row of the value)
_SAME_VALUES = {"view", "_unsafe_view", "reshape", "permute", "t", "transpose", "squeeze", "unsqueeze", "alias",
                "expand", "slice"}


def values_source(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose values ``node``'s are, following views that keep every element (a
    reshape, a permute, an ``expand`` or ``slice`` that changes nothing): reading it gives
    ``node``'s statistics, and one read serves every view of it."""
    while node.op == "call_function" and isinstance(node.target, OpOverload) \
            and ops.base(node.target) in _SAME_VALUES and node.args and isinstance(node.args[0], torch.fx.Node):
        base, val = node.args[0].meta.get("val"), node.meta.get("val")
        if not (isinstance(base, torch.Tensor) and isinstance(val, torch.Tensor) and base.dtype == val.dtype
                and base.device == val.device and statically_known_true(base.numel() == val.numel())):
            break
        node = node.args[0]
    return node


def row_windows(graph: torch.fx.Graph, stats: dict, order: list, backward: bool) -> tuple[list, list]:
    """One :func:`_stats_rows` call per window of CPU values (in graph order, bounded by
    ``WINDOW_VALUES`` and ``WINDOW_BYTES``), inserted after the window's last reductions.  Returns
    the stats nodes for the recording op and the values in the order of their rows.  The values a
    graph returns are marked, and a backward graph's inputs (the activations its forward saved,
    which autograd keeps unwritten) are marked for their rows to be looked up."""
    pos = {n: i for i, n in enumerate(graph.nodes)}
    flat, rows = [], []
    for n in order:
        if not isinstance(stats[n], Reductions):
            flat.extend(stats[n])
            rows.append(n)
    cpu = sorted((n for n in order if isinstance(stats[n], Reductions)), key=lambda n: pos[stats[n].at])
    window: list = []
    size = 0
    out = next(n for n in reversed(graph.nodes) if n.op == "output").all_input_nodes
    returned = {*out, *map(values_source, out)}      # a returned view's values are its base's

    def role(node) -> int:
        return (GRAPH_INPUT if backward and node.op == "placeholder" else 0) | (GRAPH_OUTPUT if node in returned else 0)

    def close():
        last = max((stats[n].at for n in window), key=pos.__getitem__)
        with graph.inserting_after(last):
            flat.append(graph.call_function(torch.ops.dispatchprobe.stats_rows.default,
                                            ([stats[n].node for n in window], [r for n in window for r in stats[n].nodes],
                                             [role(stats[n].node) for n in window])))
        rows.extend(window)

    for n in cpu:
        val = n.meta["val"]
        nbytes = hint(val.numel()) * val.element_size()
        if window and (len(window) == WINDOW_VALUES or size + nbytes > WINDOW_BYTES):
            close()
            window, size = [], 0
        window.append(n)
        size += nbytes
    if window:
        close()
    return flat, rows


def stats_nodes(graph: torch.fx.Graph, node: torch.fx.Node, at: torch.fx.Node):
    """Nodes computing a device stats row of ``node``'s value, inserted after ``at``: on a CPU four
    fused reductions (:class:`Reductions`, completed by :func:`row_windows`); on an accelerator, where the extra
    reductions cost no memory pass and a host read would sync, the whole row in the graph (six 0-d
    nodes): the formulas of :func:`~dispatchprobe.torch.tensor_backend.device_stats_row`, and the finite
    max/min of values holding inf/nan in that row's layout (:func:`statistics.from_row`), in ops
    with inductor lowerings (``isfinite``/``stack`` have none)."""
    aten = torch.ops.aten
    val = node.meta["val"]
    if val.device.type == "cpu" and cpu_stats() == "host":
        return Reductions(node, [], at)
    acc = torch.float64 if val.dtype in (torch.float64,) or not (val.dtype.is_floating_point or val.dtype == torch.bool) \
        else torch.float32
    with graph.inserting_after(at):
        x = node if val.dtype == acc else graph.call_function(torch.ops.prims.convert_element_type.default, (node, acc))
    new = [] if x is node else [x]

    def call(op, *args, **kwargs):
        with graph.inserting_after(new[-1] if new else at):
            n = graph.call_function(op, args, kwargs)
        new.append(n)
        return n

    if val.dtype == torch.bfloat16:
        # the value as stored: in a fused kernel inductor keeps a bf16 value in float32, unrounded
        # (and folds casts back and forth): round to nearest even on the bits, as a store does
        bits = call(aten.view.dtype, x, torch.int32)
        odd = call(aten.bitwise_and.Scalar, call(aten.bitwise_right_shift.Tensor_Scalar, bits, 16), 1)
        up = call(aten.add.Tensor, call(aten.add.Scalar, bits, 0x7FFF), odd)
        rounded = call(aten.view.dtype, call(aten.bitwise_and.Scalar, up, -65536), torch.float32)
        x = call(aten.where.self, call(aten.ne.Tensor, x, x), x, rounded)
    hi = call(aten.amax.default, x)
    lo = call(aten.amin.default, x)
    if val.device.type == "cpu":
        # the eager probe's reductions (sums in the accumulator dtype): values whose sums are not
        # finite are completed from the tensor itself by _stats_rows, as the eager probe does
        total = call(aten.sum.default, x)
        sumsq = call(aten.sum.default, call(aten.mul.Tensor, x, x))
        # in the accumulator dtype: the window's stack promotes them to float64 exactly (converts
        # in the graph would be four more nodes per value for inductor to compile)
        return Reductions(node, [hi, lo, total, sumsq], sumsq)
    # sums in float64: float32 ones overflow on common values (attention masks at finfo.min), and
    # the eager probe redoes those from the tensor, which is gone once the graph call returns
    wide = x if acc == torch.float64 else call(torch.ops.prims.convert_element_type.default, x, torch.float64)
    total = call(aten.sum.default, wide)
    sumsq = call(aten.sum.default, call(aten.mul.Tensor, wide, wide))
    norm = call(aten.sqrt.default, sumsq)
    nan = call(aten.sum.dim_IntList, call(aten.ne.Tensor, x, x), [], dtype=acc)
    finite = call(aten.eq.Scalar, call(aten.mul.Scalar, x, 0), 0)
    nonfinite = call(aten.sum.dim_IntList, call(aten.logical_not.default, finite), [], dtype=acc)
    inf = call(aten.sub.Tensor, nonfinite, nan)
    # the eager record's finite_max/finite_min, in the same fused pass: where the row holds inf/nan
    # they take the sum and norm slots (statistics.from_row derives those from the other fields)
    def const(v):
        return call(aten.full.default, [], v, dtype=acc, device=val.device, pin_memory=False)
    fmax = call(aten.amax.default, call(aten.where.self, finite, x, const(-math.inf)))
    fmin = call(aten.amin.default, call(aten.where.self, finite, x, const(math.inf)))
    carry = call(aten.logical_and.default, call(aten.gt.Scalar, nonfinite, 0), call(aten.gt.Scalar, fmax, -math.inf))
    total = call(aten.where.self, carry, call(torch.ops.prims.convert_element_type.default, fmax, torch.float64), total)
    norm = call(aten.where.self, carry, call(torch.ops.prims.convert_element_type.default, fmin, torch.float64), norm)
    return [hi, lo, total, norm, nan, inf]


class Reads:
    """Where the pass reads a value, so that inductor does what it does without the probe.

    After the last reader of the value's memory: of the value and of every view of that memory
    (a slice's base and its other slices).  Inductor decides at the readers whether to store a
    value (in its dtype: bf16 rounding) or to recompute it inline in each reader, and a read
    before that decision changes it (pytorch#168186, #141436).  Reading a view stores its base:
    a reader of a sibling view lowered after that loads the stored values instead of computing
    them in its own loop, where a vectorised ``sin`` differs from the scalar one in the last bit
    (a rotary embedding's backward reads ``mul(grad, sin)`` through two slices).
    Before anything writes its memory: the ``copy_`` of a mutated graph input, and the functional
    ops inductor's reinplacing pass may turn in place (``index_put``, ``*_scatter``, foreach ops),
    which it keeps functional when the value is read after them (pytorch#183986)."""

    def __init__(self, graph: torch.fx.Graph, users: dict):
        get_node_storage = node_storage
        self.storage = node_storage
        self.users = users
        self.pos = {n: i for i, n in enumerate(graph.nodes)}
        self.last_placeholder = last_placeholder(graph)
        candidates = reinplace_candidates()
        self.writes: dict = {}            # storage -> positions of the nodes that (may) write it
        self.sharing: dict = {}           # storage -> the nodes whose values are views of it
        for n in graph.nodes:
            if get_node_storage(n) is not None:
                self.sharing.setdefault(get_node_storage(n), []).append(n)
            written = [n.args[0]] if n.target in candidates and n.args else []
            if isinstance(n.target, OpOverload) and op_schema(n.target).is_mutable:
                for i, a in enumerate(op_schema(n.target).arguments):
                    if a.alias_info is not None and a.alias_info.is_write:
                        written.append(n.args[i] if i < len(n.args) else n.kwargs.get(a.name))
            for arg in written:
                for t in arg if isinstance(arg, (list, tuple)) else (arg,):
                    if isinstance(t, torch.fx.Node) and get_node_storage(t) is not None:
                        self.writes.setdefault(get_node_storage(t), []).append(self.pos[n])

    def written_after(self, n) -> int | None:
        """Position of the first node after ``n`` that writes its memory, if any."""
        after = [p for p in self.writes.get(self.storage(n), ()) if p > self.pos[n]]
        return min(after) if after else None

    def at(self, n: torch.fx.Node) -> torch.fx.Node:
        limit = self.written_after(n)
        storage = self.storage(n)
        readers, seen = [], set()
        todo = [u for v in (self.sharing.get(storage, ()) if storage is not None else (n,)) for u in self.users.get(v, ())]
        todo.extend(self.users.get(n, ()))
        while todo:
            u = todo.pop()
            if u in seen or u.op == "output" or u not in self.pos or (limit is not None and self.pos[u] >= limit):
                continue
            seen.add(u)
            readers.append(u)
            if isinstance(u.target, OpOverload) and ops.is_alias(u.target):
                todo.extend(self.users.get(u, ()))
        if readers:
            return max(readers, key=self.pos.__getitem__)
        return n if n.op != "placeholder" else self.last_placeholder


def last_placeholder(graph: torch.fx.Graph) -> torch.fx.Node:
    last = None
    for n in graph.nodes:
        if n.op == "placeholder":
            last = n
    return last
