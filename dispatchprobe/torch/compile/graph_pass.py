"""The post-grad pass: group a graph's nodes into eager op calls, add their statistics and one
recording op, and keep the records' templates."""

from __future__ import annotations

import operator

import torch
import torch.fx

from .. import tensor_backend as torch_backend
from .. import ops
from ..internals.dispatch import OpOverload, tree_map
from ..internals.inductor import CustomGraphPass
from ...core.events import has_nonfinite_scalar
from ...core.recorder import encode_plain
from ...records.format import walk
from .decompositions import CALL_KEY, OUTPUT_KEY, VALUE_KEY, Call, Value, hint
from .rerun import rerun_module
from .runtime import GraphRecords
from .statistics_nodes import Reads, Reductions, row_windows, stats_nodes, values_source

class Group:
    """The post-grad nodes of one eager op call: same ``original_aten``, ``seq_nr`` and
    partitioner tag."""

    def __init__(self, op, nodes):
        self.op = op
        self.nodes = nodes


class Instrument(CustomGraphPass):
    """The post-grad pass of one graph: group nodes into eager op calls, add the statistics of
    each group's values and one recording op, and keep the records' templates.  ``key``: what
    its output depends on beyond the graph inductor hashes (:mod:`.cache`)."""

    def __init__(self, owner: "ProbeBackend", roots: "FrameScopes", backward: bool, slot: int, key: str = ""):
        self.owner = owner
        self.roots = roots
        self.backward = backward
        self.slot = slot
        self.key = key
        self.records: GraphRecords | None = None
        self.added: set = set()       # the nodes the pass added
        self.inlined: set = set()     # the user's values its readers compute inline (lowering)

    def uuid(self) -> str:
        return self.key

    def __call__(self, graph: torch.fx.Graph) -> None:
        before = set(graph.nodes)
        try:
            self._instrument(graph)
        finally:
            self.added = {n for n in graph.nodes if n not in before}

    def _instrument(self, graph: torch.fx.Graph) -> None:
        task = self.owner.config.task
        # task overflow: the graph as it is now (before the statistics and the later passes), to
        # re-run eagerly when a call overflows
        plain = rerun_module(graph) if self.owner.config.task == "overflow" else None
        groups = self._groups(graph)
        users = {n: tuple(n.users) for n in graph.nodes}      # before the statistics add users
        records = self.records = GraphRecords(self.owner, "backward" if self.backward else "forward", self.roots, self.slot)
        # a graph whose traced nodes carry autograd's sequence numbers tells the nodes a rewrite added
        numbered = any(n.meta.get("seq_nr") is not None for n in graph.nodes)
        stats: dict[torch.fx.Node, list] = {}
        order: list[torch.fx.Node] = []
        for group in groups:
            exact = len([n for n in group.nodes if n.target is not operator.getitem]) == 1 \
                and str(group.nodes[0].target) == str(group.op)
            outputs = self._exported(group, not exact, self.owner_of)
            if not any(o is not None for o in outputs):
                continue
            call = None
            if exact:
                first = group.nodes[0]
                inputs = list(first.args)
                kwargs = dict(first.kwargs)
            else:
                inputs, kwargs = [], {}
                call = traced_call(group)
                if call is not None:
                    inputs, kwargs, traced_outputs = call_values(graph, group, call, self.owner_of, users)
                    if any(o is not None for o in traced_outputs):
                        outputs = traced_outputs
            template = add_template(records, group, inputs, kwargs, outputs, exact, call is not None, numbered)
            if task == "overflow":
                template.check_inputs(group, exact)
            for n in template.tensor_nodes:
                if n not in stats:
                    stats[n] = None
                    order.append(n)
        if not records.templates:
            return
        # one read per set of values: a view keeping all of a value's elements takes its row (not
        # with task tensor, which saves each value as its record shows it)
        source = {n: values_source(n) for n in order} if task != "tensor" else {}
        order = list(dict.fromkeys(source.get(n, n) for n in order))
        # where each value is read: after its last reader, before anything writes it; values that
        # something writes later are copied there for the reads at the end of the graph
        reads = Reads(graph, users)
        kept = {}
        for n in order:
            at = reads.at(n)
            if reads.written_after(n) and (task == "tensor" or n.meta["val"].device.type == "cpu"):
                with graph.inserting_after(at):
                    at = kept[n] = graph.call_function(torch.ops.aten.clone.default, (n,))
                kept[n].meta["val"] = n.meta["val"]
            stats[n] = stats_nodes(graph, kept.get(n, n), at)
            if isinstance(stats[n], Reductions):
                stats[n].node = kept.get(n, n)
        flat, order = row_windows(graph, stats, order, self.backward)
        values = [kept.get(n, n) for n in order] if task == "tensor" else []
        inputs = []
        if task == "overflow":
            records.rerun = plain
            inputs = [n for n in graph.nodes if n.op == "placeholder"]
            if not all(isinstance(n.meta.get("val"), torch.Tensor) for n in inputs):
                records.rerun, inputs = None, []        # symbolic sizes: detection only
        out = next(n for n in reversed(graph.nodes) if n.op == "output")
        with graph.inserting_before(out):
            symbols = [n for n in graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.SymInt)]
            records.symbols = [n.meta["val"].node.expr for n in symbols]
            graph.call_function(torch.ops.dispatchprobe.record.default, (flat, values, inputs, records.slot, symbols))
        records.finish(order, source)

    def note_inlined(self) -> None:
        """After lowering: each record names, in ``compiled.inlined``, its floating inputs that were
        not in memory when the pass read them.  Every reader computed such a value inline, and
        the recorded value is the pass's own computation of it (stored by a kernel of its own),
        which may round differently from the reader's: run-ut cannot check the reader bit for bit."""
        for t in self.records.templates if self.records is not None else ():
            nodes = {id(spec): node for spec, node in t.__dict__.pop("read", ())}
            labels = [arg for _, arg, spec in walk({"inputs": t.inputs, "kwargs": t.kwargs}, outputs=False)
                      if nodes.get(id(spec)) in self.inlined]
            if labels:
                t.compiled["inlined"] = labels
        self.inlined = set()

    def _groups(self, graph: torch.fx.Graph) -> list[Group]:
        by_key: dict = {}
        last: dict = {}        # (op, partitioner tag) -> key of its latest decomposed call
        latest: dict = {}      # (op, seq_nr, partitioner tag) -> key of its latest decomposed call
        groups: list[Group] = []
        owner_of: dict = {}
        node_level = self.owner.granularity == "node"
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            if node.target is operator.getitem and node.args[0] in owner_of:
                g = owner_of[node.args[0]]
                g.nodes.append(node)
                owner_of[node] = g
                continue
            if not isinstance(node.target, OpOverload) or node.target.namespace == "dispatchprobe":
                continue
            tag = node.meta.get("partitioner_tag")
            if node_level:      # every node where it runs, recomputed ones included
                g = Group(node.target, [node])
                groups.append(g)
                owner_of[node] = g
                continue
            # the partitioner moves work across graphs: recomputed forward values in backward
            # (recorded in forward), parts of backward ops in forward (recorded with the rest)
            if tag == ("is_forward" if self.backward else "is_backward"):
                continue
            op = node.meta.get("original_aten") or node.target
            seq_nr = node.meta.get("seq_nr")
            # a node of the original op itself is one eager call (two mm of one addmm's backward)
            exact = str(op) == str(node.target)
            if exact:
                key = node
            elif seq_nr is not None:
                # one autograd node can make several calls of one op (cumsum's backward: two flips),
                # each decomposed on its own: one record each, as eager records them
                base = (str(op), seq_nr, tag)
                call = node.meta.get(CALL_KEY)
                key = base + (id(call),) if call is not None else latest.get(base, base)
                latest[base] = last[(str(op), tag)] = key
            else:   # made by a pattern rewrite, without seq_nr: part of the call it rewrote
                key = last.get((str(op), tag), node)
            g = by_key.get(key)
            if g is None:
                g = by_key[key] = Group(op, [])
                groups.append(g)
            g.nodes.append(node)
            owner_of[node] = g
        self.owner_of = owner_of
        session_like = self.owner.config
        wanted = []
        for g in groups:
            op = g.op
            if isinstance(op, OpOverload):
                if ops.never_recorded(op) or (not session_like.include_views and ops.is_alias(op)):
                    continue
            wanted.append(g)
        return wanted

    @staticmethod
    def _exported(group: Group, decomposed: bool, owner_of: dict) -> list[torch.fx.Node]:
        """The values of an op call: a node's own outputs; of a decomposition only its main
        result, the last of its values another op call reads (its other values, such as layer
        norm's mean, cannot be told apart from intermediates the partitioner saves)."""
        inside = set(group.nodes)
        out = [n for n in group.nodes if isinstance(n.meta.get("val"), torch.Tensor)
               and any(u not in inside for u in n.users)]
        if not decomposed:
            first = group.nodes[0]
            if isinstance(first.meta.get("val"), (tuple, list)):
                # outputs by position (None: unread by the graph), named output.i as in eager
                at = {n.args[1]: n for n in out if n.target is operator.getitem and n.args[0] is first}
                return [at.get(i) for i in range(len(first.meta["val"]))]
            return out
        read = [n for n in out if any(owner_of.get(u) not in (None, group) for u in n.users)]
        return (read or out)[-1:]


def traced_call(group: Group) -> Call | None:
    """The traced call a decomposed group comes from, when its nodes name exactly one."""
    calls = {id(c): c for c in (n.meta.get(CALL_KEY) for n in group.nodes) if c is not None}
    if len(calls) != 1:
        return None
    call = next(iter(calls.values()))
    return call if str(call.op) == str(group.op) else None


def call_values(graph: torch.fx.Graph, group: Group, call: Call, owner_of: dict, users: dict):
    """A decomposed call's arguments and outputs in the graph: each tensor argument is the node
    holding the value it was called with (a :class:`Value` when the graph does not read it any
    more); each output is the node the decomposition returned in that position, if an op outside
    the call reads it."""
    inside = set(group.nodes)
    holders: dict = {}
    for n in graph.nodes:
        vid = n.meta.get(VALUE_KEY)
        if vid is not None and n not in inside and isinstance(n.meta.get("val"), torch.Tensor):
            holders.setdefault(vid, []).append(n)
    reads = []          # what the call's nodes read from outside it: preferred holders
    for n in group.nodes:
        for a in n.all_input_nodes:
            if a not in inside and a not in reads and isinstance(a.meta.get("val"), torch.Tensor):
                reads.append(a)
    used: set = set()

    def node_of(v: Value):
        # only the node holding that very value: a value of the same shape found otherwise may be
        # another one (the joint graph's CSE gives layer norm's backward the forward's x_hat, not x)
        found = [n for n in holders.get(v.id, ()) if n not in used]
        if not found:
            return v
        found.sort(key=lambda n: n not in reads)
        used.add(found[0])
        return found[0]

    args, kwargs = tree_map(lambda x: node_of(x) if isinstance(x, Value) else x, (list(call.args), dict(call.kwargs)))
    at = {}
    for n in group.nodes:
        i = n.meta.get(OUTPUT_KEY)
        if i is not None and n.meta.get(CALL_KEY) is call and isinstance(n.meta.get("val"), torch.Tensor) \
                and any(owner_of.get(u) is not group for u in users.get(n, ())):
            at.setdefault(i, n)
    return args, kwargs, [at.get(i) for i in range(call.outputs)]


class Template:
    """One record of a graph call, all but its call index and statistics."""

    def __init__(self, op: str, scope: str, nodes: list[str], exact: bool):
        self.op, self.scope = op, scope
        self.tensor_nodes: list[torch.fx.Node] = []
        self.inputs: list = []
        self.kwargs: dict = {}
        self.outputs: list = []
        self.slots: list[tuple[dict, torch.fx.Node]] = []   # (tensor spec, node) filled per call
        self.compiled = {"nodes": nodes, "decomposed": not exact}
        self.rows: list[int] = []
        self.producers: list[torch.fx.Node] = []   # task overflow: the values the call reads
        self.nonfinite_scalar = False              # it is given inf/nan (masked_fill(mask, -inf))
        self.symbolic: list[tuple[dict, object]] = []   # (spec, its sizes as SymInts): dynamic shapes

    def check_inputs(self, group, exact: bool) -> None:
        """Task overflow: what the call reads, to tell an overflow it makes from one it passes on.
        A decomposed call records no inputs: its statistics are taken of the values its nodes read
        from outside it, and its constants (``full(-inf)``) count as inf given to it."""
        inside = set(group.nodes)
        for node in group.nodes:
            for a in (*node.args, *node.kwargs.values()):
                self.nonfinite_scalar |= has_nonfinite_scalar(a)
                if not exact and isinstance(a, torch.fx.Node) and a not in inside and a not in self.producers \
                        and isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].numel() \
                        and not a.meta["val"].is_complex():
                    self.producers.append(a)
                    self.tensor_nodes.append(a)

    def encode(self, value):
        if isinstance(value, Value):
            # an argument the compiled graph no longer reads: its metadata, not a tensor to compare
            spec = value.spec
            return {"type": "other", "repr": f"{spec['dtype']}{spec['shape']} tensor, not read by the compiled graph",
                    "unread": spec}
        if isinstance(value, torch.fx.Node):
            val = value.meta.get("val")
            if isinstance(val, torch.Tensor):
                spec = torch_backend.traced_meta(val)
                if not all(isinstance(d, int) for d in (*spec["shape"], *(spec["stride"] or ()))):
                    self.symbolic.append((spec, (spec["shape"], spec["stride"])))
                spec["shape"] = [hint(d) for d in spec["shape"]]       # symbolic sizes: their hints
                spec["stride"] = [hint(d) for d in spec["stride"]] if spec["stride"] is not None else None
                spec["requires_grad"] = False
                if val.numel() and not val.is_complex():
                    self.tensor_nodes.append(value)
                    self.slots.append((spec, value))
                return spec
            if isinstance(val, (int, float, bool)) or hasattr(val, "node"):   # symbolic sizes: hint
                try:
                    spec = encode_plain(hint(val) if isinstance(val, torch.SymInt) else val, torch_backend)
                except Exception:
                    return {"type": "other", "repr": str(val)}
                if isinstance(val, torch.SymInt):
                    self.symbolic.append((spec, val))
                return spec
            return {"type": "other", "repr": value.name}
        if isinstance(value, (list, tuple)):
            # fx's immutable_list/tuple as the plain kinds eager records and replay rebuild
            return {"type": "tuple" if isinstance(value, tuple) else "list", "value": [self.encode(v) for v in value]}
        return encode_plain(value, torch_backend)


def add_template(records: GraphRecords, group: Group, inputs, kwargs, outputs, exact: bool,
                 traced: bool = False, numbered: bool = False) -> Template:
    """The template of one op call's records, added to ``records``; ``numbered``: the graph's
    traced nodes carry autograd's sequence numbers (``seq_nr``), so a group without any was made
    by a graph rewrite."""
    scope = records.roots.node_scope(group.nodes[0].meta, records.stage)
    t = Template(str(group.op), scope, [n.name for n in group.nodes], exact)
    if not exact:
        t.compiled["call"] = traced
    if numbered and not any(n.meta.get("seq_nr") is not None for n in group.nodes):
        # every node a graph rewrite (an inductor pattern pass) made, none traced from the program:
        # no eager call of its own, which compare says of such a record left without a counterpart
        t.compiled["rewrite"] = True
    original = group.nodes[0].meta.get("original_aten")
    if records.owner.granularity == "node" and original is not None and str(original) != t.op:
        t.compiled["original_aten"] = str(original)      # the eager op this node computes part of
    t.inputs = [t.encode(a) for a in inputs]
    t.kwargs = {k: t.encode(v) for k, v in kwargs.items()}
    t.outputs = [t.encode(o) for o in outputs]
    t.output_type = "single" if len(outputs) == 1 else "tuple"
    records.templates.append(t)
    return t
