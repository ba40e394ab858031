"""``torch.compile(model, backend=probe_backend(...))``: the probe inside compiled graphs.

The backend runs inductor's own pipeline (``compile_fx``: its decompositions, partitioner and
passes) and instruments each post-grad graph, forward and backward, in a custom post pass:
the statistics of every recorded value are computed inside the graph (inductor fuses them into
the producing kernels) and handed, as one vector per graph call, to a side-effectful recording
op.  The records go through the same session, recorder and writer as the eager probe's, in
execution order with the eager records of the code around the graphs.  See docs/compile.md.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import math
import operator
import re
import sys
import weakref

import torch
import torch.fx

from . import backend as torch_backend
from . import ops
from .capture import TorchSession, active_probes
from ..core.events import has_nonfinite_scalar
from ..core.recorder import encode_plain
from ..standards import statistics

STAT_FIELDS = 6          # max, min, sum, L2 norm, nan count, inf count: a device stats row
COMPILED_TASKS = ("statistics", "tensor", "overflow")
# "eager": a record per eager op call (post-grad nodes grouped by original_aten), which compare
# aligns with an eager run; "node": a record per post-grad node, the ops inductor compiles
GRANULARITIES = ("eager", "node")


# ---- the recording op ---------------------------------------------------------------------------
@torch.library.custom_op("dispatchprobe::record", mutates_args=())
def _record(stats: list[torch.Tensor], values: list[torch.Tensor], inputs: list[torch.Tensor], graph: int,
            sizes: list[int]) -> None:
    """One graph call: a row of ``STAT_FIELDS`` statistics per recorded tensor; with task ``tensor``
    the tensors themselves (copied here: inductor reuses its buffers after the call, and writes
    into them without bumping their version, the recorder's cache key); with task ``overflow``
    the graph's inputs, to re-run the graph eagerly on a hit; ``sizes``: the call's values of the
    graph's symbolic sizes (dynamic shapes), which give each record its shapes."""
    # six 0-d statistics per value (accelerators) or blocks of rows (CPU); cat promotes to float64
    block = torch.cat([s.reshape(-1) for s in stats]).to(torch.float64).view(-1, STAT_FIELDS)
    records = _GRAPHS[graph]
    if records.overflow:
        records.check(block, inputs, sizes)
    else:
        records.emit(block, [v.clone() for v in values] if values else None, sizes)


@_record.register_fake
def _(stats, values, inputs, graph, sizes):
    return None


torch.fx.node.has_side_effect(torch.ops.dispatchprobe.record.default)


# CPU statistics rows: the graph computes max, min, sum and sum of squares of each value, the
# eager probe's reductions in its accumulator dtype, and this op, called by the compiled code once
# for a window of values, completes their rows.  Values whose sums are finite hold no inf/nan; the
# others (and sums that overflowed) are completed from the tensor by the eager probe's own code:
# counting nan/inf and the finite max/min in the graph would cost three more reductions per value
# on every call, for values that almost never hold them (a host read here costs no sync on a CPU).
_LIB = torch.library.Library("dispatchprobe", "FRAGMENT")
_LIB.define("stats_rows(Tensor[] values, Tensor[] reductions) -> Tensor")
WINDOW_VALUES = 32              # values one stats_rows call completes at most ...
WINDOW_BYTES = 64 << 20         # ... and their bytes (kept alive until the call: a bounded delay)


def _stats_rows(values, reductions):
    """``reductions``: (max, min, sum, sum of squares) of each of ``values``; a (len, 6) row block."""
    flat = torch.stack(reductions).tolist()
    rows = []
    for i, x in enumerate(values):
        hi, lo, total, sq = flat[4 * i:4 * i + 4]
        if math.isfinite(sq) and math.isfinite(total):
            rows.append([hi, lo, total, math.sqrt(sq), 0.0, 0.0])
        else:        # inf/nan among the values (counted, finite max/min carried), or an overflowed sum
            n = x.numel()
            stats = torch_backend.complete_stats(statistics.source(x.detach(), torch).reshape(-1),
                                                 [hi, lo, total, math.sqrt(sq)])
            rows.append([float(v) for v in statistics.to_row(stats, n)])
    return torch.tensor(rows, dtype=torch.float64)


_LIB.impl("stats_rows", _stats_rows, "CPU")
_LIB.impl("stats_rows", lambda values, reductions: torch.empty(len(values), STAT_FIELDS, dtype=torch.float64,
                                                                device=values[0].device), "Meta")

_GRAPHS: dict[int, "_GraphRecords"] = {}
_graph_ids = itertools.count()


# ---- the session records are written through ---------------------------------------------------
class CompiledProbe(TorchSession):
    """The session of a probe backend: the eager probe's config, recorder and writer, started
    by the first graph call (there is no ``with``) and ended by :meth:`ProbeBackend.step`."""

    def _install(self) -> None:
        pass

    def _uninstall(self) -> None:
        pass


class ProbeBackend:
    """A ``torch.compile`` backend recording every compiled graph.  ``step()`` ends a training
    step (as ``DispatchProbe.step``), ``close()`` finishes the records (also run at exit)."""

    def __init__(self, config=None, *, inner: str = "inductor", model: torch.nn.Module | None = None,
                 granularity: str = "eager", **overrides):
        if inner not in ("inductor", "aot_eager"):
            raise ValueError(f"inner must be 'inductor' or 'aot_eager', not {inner!r}")
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be 'eager' or 'node', not {granularity!r}")
        self.inner = inner
        self.granularity = granularity
        # the session is created when a graph first records outside a DispatchProbe on the same
        # dump_path, so that such a probe alone may own the run directory
        self._args = (config, overrides)
        from ..core.config import Config
        self.config = Config.load(config, **overrides)
        if self.config.task not in COMPILED_TASKS:
            raise ValueError(f"probe_backend records the tasks {', '.join(COMPILED_TASKS)}, not {self.config.task!r}"
                             + (" (it checks each op eagerly: use DispatchProbe)" if self.config.task == "free_benchmark" else ""))
        self._session: CompiledProbe | None = None
        self.module_names = ModuleNames(model)
        atexit.register(self.close)

    @property
    def session(self) -> CompiledProbe:
        if self._session is None:
            config, overrides = self._args
            self._session = CompiledProbe(config, **overrides)
        return self._session

    def target(self):
        """The session a graph call records into now: an active DispatchProbe writing to the same
        run directory (so both capture paths share one record stream), else this backend's own."""
        for probe in reversed(active_probes):
            if probe.config.dump_path == self.config.dump_path:
                return probe
        session = self.session
        session.start()
        return session if session._active else None

    def step(self) -> None:
        if self._session is not None:
            self._session.step()

    def close(self) -> None:
        if self._session is not None:
            self._session.close()

    # -- compiling ------------------------------------------------------------------------------
    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from torch._functorch import config as functorch_config
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        roots = self.module_names.frame()

        def inner_compile(graph_module, inputs, **kw):
            instrument = _Instrument(self, roots, backward=bool(kw.get("is_backward")))
            if self.inner == "aot_eager":
                instrument(graph_module.graph)
                graph_module.recompile()
                return _EagerOutput(graph_module)
            with _kernel_provenance() as kernels, _unseen_by_lowering(instrument), \
                    torch._inductor.config.patch({"post_grad_custom_post_pass": instrument,
                                                  "trace.provenance_tracking_level": _PROVENANCE_LEVEL}):
                compiled = compile_fx_inner(graph_module, inputs, **kw)
            if instrument.records is not None:
                instrument.records.set_kernels(kernels)
            return compiled

        # both caches would skip the instrumenting pass: off for this backend's graphs only
        with functorch_config.patch(enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, inner_compile=inner_compile,
                              config_patches={"fx_graph_cache": False}, decompositions=_traced_decompositions())


@contextlib.contextmanager
def _unseen_by_lowering(instrument):
    """While inductor lowers a node of the user's graph, the nodes the pass added are hidden from
    its users: inductor realizes a value (stores it in its dtype) or inlines it into its readers
    by their number, which decides bf16 rounding (pytorch#168186): the statistics must not."""
    from torch._inductor.graph import GraphLowering

    run_node = GraphLowering.run_node

    def lowering_run_node(self, n):
        ours = instrument.added
        users = n.users
        if n in ours or not any(u in ours for u in users):
            return run_node(self, n)
        n.users = {u: v for u, v in users.items() if u not in ours}
        try:
            return run_node(self, n)
        finally:
            n.users = users

    GraphLowering.run_node = lowering_run_node
    try:
        yield
    finally:
        GraphLowering.run_node = run_node


# inductor's provenance tracking, level "basic": which post-grad nodes each generated kernel computes
# (level 1 also rewrites the metadata of pattern-matched nodes, which the grouping reads)
_PROVENANCE_LEVEL = 2


class _kernel_provenance:
    """Inductor's kernel -> post-grad nodes map of one graph's compile (``"cpp_fused_add_0:3": [node
    names]``), kept apart from other compiles' and merged back for torch's own tools afterwards."""

    def __enter__(self) -> dict:
        from torch._inductor import debug
        self.saved = debug._inductor_triton_kernel_to_post_grad_node_info
        self.ours = debug._inductor_triton_kernel_to_post_grad_node_info = {}
        return self.ours

    def __exit__(self, *exc) -> None:
        from torch._inductor import debug
        ours = debug._inductor_triton_kernel_to_post_grad_node_info
        self.ours.update(ours)
        self.saved.update(ours)
        debug._inductor_triton_kernel_to_post_grad_node_info = self.saved


def probe_backend(config=None, *, inner: str = "inductor", model: torch.nn.Module | None = None,
                  granularity: str = "eager", **overrides) -> ProbeBackend:
    """``torch.compile(model, backend=probe_backend(task="statistics", dump_path="runs/c"))``:
    record the compiled graphs' ops at eager granularity.  ``inner``: ``"inductor"`` (compiled
    code, the default) or ``"aot_eager"`` (the same instrumented aten graphs run eagerly).
    ``model`` names the scopes of graphs that start inside a submodule (after a graph break).
    ``granularity="node"`` records each post-grad node, the op inductor compiles, instead of the
    eager op call it comes from."""
    return ProbeBackend(config, inner=inner, model=model, granularity=granularity, **overrides)


def _eager_output_type():
    from torch._inductor.output_code import OutputCode

    class EagerOutput(OutputCode):
        """An instrumented aten graph run eagerly, in inductor's compiled-output interface."""

        def __init__(self, gm):
            self.gm = gm
            self._boxed_call = True

        def __call__(self, inputs):
            return self.gm(*inputs)

        def post_compile(self, example_inputs, constants, graph_kwargs) -> None:
            pass

        def set_triton_bundle(self, triton_bundle) -> None:
            pass

    return EagerOutput


def _EagerOutput(gm):
    global _EagerOutput
    cls = _eager_output_type()
    _EagerOutput = cls
    return cls(gm)


# ---- the calls inductor decomposes ---------------------------------------------------------------
CALL_KEY = "dispatchprobe_call"         # node.meta: the traced call (a _Call) a decomposition's node comes from
OUTPUT_KEY = "dispatchprobe_output"     # node.meta: which output of that call the node is
VALUE_KEY = "dispatchprobe_value"       # node.meta: identity of a value a traced call reads
_value_ids = itertools.count()


class _Value:
    """A tensor argument of a traced call: the id put on the node holding it, and its metadata
    (for an argument the post-grad graph no longer reads)."""

    __slots__ = ("id", "spec")

    def __init__(self, vid, spec: dict):
        self.id, self.spec = vid, spec


class _Call:
    """A call that inductor's decompositions replace, as AOTAutograd traced it: the op, its
    arguments (tensors as :class:`_Value`, symbolic sizes as their hints) and its output count.
    Plain data, shared by the nodes of its decomposition through their metadata (which survives
    the partitioner's and the passes' graph copies)."""

    __slots__ = ("op", "args", "kwargs", "outputs")

    def __init__(self, op, args, kwargs, outputs: int):
        self.op, self.args, self.kwargs, self.outputs = op, args, kwargs, outputs


_IDENTITIES = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def _traced_decompositions() -> dict:
    """Inductor's decomposition table, each entry noting the call it decomposes on the nodes it
    makes, so a decomposed call can be recorded with its arguments and its outputs by position."""
    from torch._inductor.decomposition import select_decomp_table
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
                spec = torch_backend.tensor_meta(x)
                spec["shape"] = [_hint(d) for d in spec["shape"]]
                spec["stride"] = [_hint(d) for d in spec["stride"]] if spec["stride"] is not None else None
                spec["requires_grad"] = False
                vid = None
                if slot is not None:
                    node = slot.proxy.node
                    # autograd's saved values are detach()es of the value, which later passes drop
                    while node.target in _IDENTITIES and isinstance(node.args[0], torch.fx.Node):
                        node = node.args[0]
                    vid = node.meta.setdefault(VALUE_KEY, next(_value_ids))
                return _Value(vid, spec)
            if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                return _hint(x)
            if isinstance(x, (list, tuple)):
                return type(x)(value(v) for v in x) if isinstance(x, tuple) else [value(v) for v in x]
            return x

        call_args = tuple(value(a) for a in args)
        call_kwargs = {k: value(v) for k, v in kwargs.items()}
        out = fn(*args, **kwargs)
        if out is NotImplemented:
            return out
        flat = out if isinstance(out, (tuple, list)) else (out,)
        call = _Call(op, call_args, call_kwargs, len(flat))
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


# ---- names and scopes -----------------------------------------------------------------------------
_SOURCE = re.compile(r"^L\['([^']+)'\]")
_CALLS = {torch.nn.Module._call_impl.__code__, torch.nn.Module._wrapped_call_impl.__code__}


class ModuleNames:
    """Eager's names of modules, as the eager probe's module tracker gives them: the first module
    seen is named by its class (``LlamaForCausalLM``), its submodules by their path in it
    (``LlamaForCausalLM.model.layers.0``); a name once given stays.  Weak: modules are not kept."""

    def __init__(self, model: torch.nn.Module | None = None):
        self._names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        if model is not None:
            self.add(model)

    def add(self, module: torch.nn.Module) -> None:
        if module in self._names:
            return
        root = type(module).__name__
        for path, sub in module.named_modules():
            if sub not in self._names:
                self._names[sub] = f"{root}.{path}" if path else root

    def frame(self) -> "FrameScopes":
        """The scopes of the frame dynamo compiles now.  Its graph's ``nn_module_stack`` entries are
        keyed by the modules' ids and carry source paths that depend on the frame's shape
        (``L['self'].layers.0``, ``L['args'][0].model...`` under a decorated ``forward``), so the
        modules are resolved as objects: those being called now (``Module.__call__`` frames on the
        stack, outermost = the model, innermost = the module running the frame's own ops) and the
        frame's locals, each with its eager name."""
        calling = []
        f = sys._getframe(1)
        while f is not None:
            if f.f_code in _CALLS:
                m = f.f_locals.get("self")
                if isinstance(m, torch.nn.Module) and not isinstance(m, torch._dynamo.eval_frame.OptimizedModule):
                    calling.append(m)
            f = f.f_back
        for m in reversed(calling):           # outermost first: it names its submodules
            self.add(m)
        local = {}
        try:
            from torch._dynamo.symbolic_convert import InstructionTranslator
            local = InstructionTranslator.current_tx().f_locals
        except Exception:        # not called by dynamo (a direct backend call)
            pass
        found = {k: v for k, v in local.items() if isinstance(v, torch.nn.Module)}
        for v in found.values():
            self.add(v)
        by_id = {str(id(m)): name for m, name in self._names.items()}
        return FrameScopes(by_id, self._names.get(calling[0], "") if calling else "",
                           {k: self._names[v] for k, v in found.items()})


class FrameScopes:
    """Names the innermost module of a node's ``nn_module_stack`` as eager does (plain names, no
    module references: a backward graph is compiled later, from these)."""

    def __init__(self, by_id: dict[str, str], current: str, local: dict[str, str]):
        self.by_id, self.current, self.local = by_id, current, local

    def scope(self, stack: dict | None) -> str:
        if not stack:
            return self.current
        key, (path, _) = list(stack.items())[-1]
        name = self.by_id.get(str(key).split("@")[0])
        if name is not None:
            return name
        m = _SOURCE.match(path)        # a module dynamo keys otherwise: its path from a named local
        if m:
            path = self.local.get(m.group(1), m.group(1)) + path[m.end():]
        return re.sub(r"\[(\d+)\]", r".\1", path).replace("._modules['", ".").replace("']", "")


# ---- the pass ------------------------------------------------------------------------------------
class _Reductions:
    """A CPU value's in-graph reductions, completed into its row by a :func:`_stats_rows` window."""

    def __init__(self, node: torch.fx.Node, nodes: list):
        self.node, self.nodes = node, nodes


def _row_windows(graph: torch.fx.Graph, stats: dict, order: list) -> tuple[list, list]:
    """One :func:`_stats_rows` call per window of CPU values (in graph order, bounded by
    ``WINDOW_VALUES`` and ``WINDOW_BYTES``), inserted after the window's last reductions.  Returns
    the stats nodes for the recording op and the values in the order of their rows."""
    pos = {n: i for i, n in enumerate(graph.nodes)}
    flat, rows = [], []
    for n in order:
        if not isinstance(stats[n], _Reductions):
            flat.extend(stats[n])
            rows.append(n)
    cpu = sorted((n for n in order if isinstance(stats[n], _Reductions)), key=lambda n: pos[stats[n].nodes[-1]])
    window: list = []
    size = 0

    def close():
        last = max((stats[n].nodes[-1] for n in window), key=pos.__getitem__)
        with graph.inserting_after(last):
            flat.append(graph.call_function(torch.ops.dispatchprobe.stats_rows.default,
                                            ([stats[n].node for n in window], [r for n in window for r in stats[n].nodes])))
        rows.extend(window)

    for n in cpu:
        val = n.meta["val"]
        nbytes = _hint(val.numel()) * val.element_size()
        if window and (len(window) == WINDOW_VALUES or size + nbytes > WINDOW_BYTES):
            close()
            window, size = [], 0
        window.append(n)
        size += nbytes
    if window:
        close()
    return flat, rows


def _stats_nodes(graph: torch.fx.Graph, node: torch.fx.Node, at: torch.fx.Node):
    """Nodes computing a device stats row of ``node``'s value, inserted after ``at``: on a CPU four
    fused reductions (:class:`_Reductions`, completed by :func:`_row_windows`); on an accelerator, where the extra
    reductions cost no memory pass and a host read would sync, the whole row in the graph (six 0-d
    nodes): the formulas of :func:`~dispatchprobe.torch.backend.device_stats_row`, and the finite
    max/min of values holding inf/nan in that row's layout (:func:`statistics.from_row`), in ops
    with inductor lowerings (``isfinite``/``stack`` have none)."""
    aten = torch.ops.aten
    val = node.meta["val"]
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
        reductions = [hi, lo, total, sumsq]
        if acc != torch.float64:       # one dtype: the window's stack is then a plain copy
            reductions = [call(torch.ops.prims.convert_element_type.default, r, torch.float64) for r in reductions]
        return _Reductions(node, reductions)
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


class _Group:
    """The post-grad nodes of one eager op call: same ``original_aten``, ``seq_nr`` and
    partitioner tag."""

    def __init__(self, op, nodes):
        self.op = op
        self.nodes = nodes


class _Instrument:
    """The post-grad pass of one graph: group nodes into eager op calls, add the statistics of
    each group's values and one recording op, and keep the records' templates."""

    def __init__(self, owner: ProbeBackend, roots: "FrameScopes", backward: bool):
        self.owner = owner
        self.roots = roots
        self.backward = backward
        self.records: _GraphRecords | None = None
        self.added: set = set()       # the nodes the pass added

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
        plain = _rerun_module(graph) if self.owner.config.task == "overflow" else None
        groups = self._groups(graph)
        users = {n: tuple(n.users) for n in graph.nodes}      # before the statistics add users
        records = self.records = _GraphRecords(self.owner, "backward" if self.backward else "forward", self.roots)
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
                call = _traced_call(group)
                if call is not None:
                    inputs, kwargs, traced_outputs = _call_values(graph, group, call, self.owner_of, users)
                    if any(o is not None for o in traced_outputs):
                        outputs = traced_outputs
            template = records.add(group, inputs, kwargs, outputs, exact, call is not None)
            if task == "overflow":
                template.check_inputs(group, exact)
            for n in template.tensor_nodes:
                if n not in stats:
                    stats[n] = None
                    order.append(n)
        if not records.templates:
            return
        # where each value is read: after its last reader, before anything writes it; values that
        # something writes later are copied there for the reads at the end of the graph
        reads = _Reads(graph, users)
        kept = {}
        for n in order:
            at = reads.at(n)
            if reads.written_after(n) and (task == "tensor" or n.meta["val"].device.type == "cpu"):
                with graph.inserting_after(at):
                    at = kept[n] = graph.call_function(torch.ops.aten.clone.default, (n,))
                kept[n].meta["val"] = n.meta["val"]
            stats[n] = _stats_nodes(graph, kept.get(n, n), at)
            if isinstance(stats[n], _Reductions):
                stats[n].node = kept.get(n, n)
        flat, order = _row_windows(graph, stats, order)
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
            graph.call_function(torch.ops.dispatchprobe.record.default, (flat, values, inputs, records.id, symbols))
        records.finish(order)

    def _groups(self, graph: torch.fx.Graph) -> list[_Group]:
        by_key: dict = {}
        last: dict = {}        # (op, partitioner tag) -> key of its latest decomposed call
        groups: list[_Group] = []
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
            if not isinstance(node.target, torch._ops.OpOverload) or node.target.namespace == "dispatchprobe":
                continue
            tag = node.meta.get("partitioner_tag")
            if node_level:      # every node where it runs, recomputed ones included
                g = _Group(node.target, [node])
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
                key = last[(str(op), tag)] = (str(op), seq_nr, tag)
            else:   # made by a pattern rewrite, without seq_nr: part of the call it rewrote
                key = last.get((str(op), tag), node)
            g = by_key.get(key)
            if g is None:
                g = by_key[key] = _Group(op, [])
                groups.append(g)
            g.nodes.append(node)
            owner_of[node] = g
        self.owner_of = owner_of
        session_like = self.owner.config
        wanted = []
        for g in groups:
            op = g.op
            if isinstance(op, torch._ops.OpOverload):
                if ops.never_recorded(op) or (not session_like.include_views and ops.is_alias(op)):
                    continue
            wanted.append(g)
        return wanted

    @staticmethod
    def _exported(group: _Group, decomposed: bool, owner_of: dict) -> list[torch.fx.Node]:
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


def _traced_call(group: _Group) -> _Call | None:
    """The traced call a decomposed group comes from, when its nodes name exactly one."""
    calls = {id(c): c for c in (n.meta.get(CALL_KEY) for n in group.nodes) if c is not None}
    if len(calls) != 1:
        return None
    call = next(iter(calls.values()))
    return call if str(call.op) == str(group.op) else None


def _call_values(graph: torch.fx.Graph, group: _Group, call: _Call, owner_of: dict, users: dict):
    """A decomposed call's arguments and outputs in the graph: each tensor argument is the node
    holding the value it was called with (a :class:`_Value` when the graph does not read it any
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

    def node_of(v: _Value):
        # only the node holding that very value: a value of the same shape found otherwise may be
        # another one (the joint graph's CSE gives layer norm's backward the forward's x_hat, not x)
        found = [n for n in holders.get(v.id, ()) if n not in used]
        if not found:
            return v
        found.sort(key=lambda n: n not in reads)
        used.add(found[0])
        return found[0]

    def resolve(x):
        if isinstance(x, _Value):
            return node_of(x)
        if isinstance(x, (list, tuple)):
            return type(x)(resolve(v) for v in x) if isinstance(x, tuple) else [resolve(v) for v in x]
        return x

    args = [resolve(a) for a in call.args]
    kwargs = {k: resolve(v) for k, v in call.kwargs.items()}
    at = {}
    for n in group.nodes:
        i = n.meta.get(OUTPUT_KEY)
        if i is not None and n.meta.get(CALL_KEY) is call and isinstance(n.meta.get("val"), torch.Tensor) \
                and any(owner_of.get(u) is not group for u in users.get(n, ())):
            at.setdefault(i, n)
    return args, kwargs, [at.get(i) for i in range(call.outputs)]


class _Reads:
    """Where the pass reads a value, so that inductor does what it does without the probe.

    After the value's last reader (following views): inductor decides at the readers whether to
    store the value (in its dtype: bf16 rounding) or to recompute it inline, and a statistic
    read earlier would see it before that decision (pytorch#168186, #141436).  Before anything
    writes its memory: the ``copy_`` of a mutated graph input, and the functional ops inductor's
    reinplacing pass may turn in place (``index_put``, ``*_scatter``, foreach ops), which it
    keeps functional when the value is read after them (pytorch#183986)."""

    def __init__(self, graph: torch.fx.Graph, users: dict):
        from torch._inductor.fx_passes import reinplace
        from torch._inductor.fx_utils import get_node_storage
        self.storage = get_node_storage
        self.users = users
        self.pos = {n: i for i, n in enumerate(graph.nodes)}
        self.last_placeholder = _last_placeholder(graph)
        candidates = (*reinplace.inplaceable_ops, *reinplace._SCATTER_OP_TO_VIEW, *reinplace.inplaceable_foreach_ops)
        self.writes: dict = {}            # storage -> positions of the nodes that (may) write it
        for n in graph.nodes:
            written = [n.args[0]] if n.target in candidates and n.args else []
            if isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable:
                for i, a in enumerate(n.target._schema.arguments):
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
        readers, todo = [], list(self.users.get(n, ()))
        while todo:
            u = todo.pop()
            if u.op == "output" or u not in self.pos or (limit is not None and self.pos[u] >= limit):
                continue
            readers.append(u)
            if isinstance(u.target, torch._ops.OpOverload) and ops.is_alias(u.target):
                todo.extend(self.users.get(u, ()))
        if readers:
            return max(readers, key=self.pos.__getitem__)
        return n if n.op != "placeholder" else self.last_placeholder


def _last_placeholder(graph: torch.fx.Graph) -> torch.fx.Node:
    last = None
    for n in graph.nodes:
        if n.op == "placeholder":
            last = n
    return last


class _Template:
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
        if isinstance(value, _Value):
            # an argument the compiled graph no longer reads: its metadata, not a tensor to compare
            spec = value.spec
            return {"type": "other", "repr": f"{spec['dtype']}{spec['shape']} tensor, not read by the compiled graph",
                    "unread": spec}
        if isinstance(value, torch.fx.Node):
            val = value.meta.get("val")
            if isinstance(val, torch.Tensor):
                spec = torch_backend.tensor_meta(val)
                if not all(isinstance(d, int) for d in (*spec["shape"], *(spec["stride"] or ()))):
                    self.symbolic.append((spec, (spec["shape"], spec["stride"])))
                spec["shape"] = [_hint(d) for d in spec["shape"]]       # symbolic sizes: their hints
                spec["stride"] = [_hint(d) for d in spec["stride"]] if spec["stride"] is not None else None
                spec["requires_grad"] = False
                if val.numel() and not val.is_complex():
                    self.tensor_nodes.append(value)
                    self.slots.append((spec, value))
                return spec
            if isinstance(val, (int, float, bool)) or hasattr(val, "node"):   # symbolic sizes: hint
                try:
                    spec = encode_plain(_hint(val) if isinstance(val, torch.SymInt) else val, torch_backend)
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


def _hint(size):
    """A size (or symbolic scalar) as the plain value of its hint."""
    if isinstance(size, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        hint = size.node.hint
        if hint is None:
            return -1 if isinstance(size, torch.SymInt) else None
        return {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(size)](hint)
    return int(size)


class _GraphRecords:
    """The records one compiled graph writes per call, and how its statistics map onto them."""

    def __init__(self, owner: ProbeBackend, stage: str, roots: "FrameScopes"):
        self.owner = owner
        self.stage = stage
        self.roots = roots
        self.id = next(_graph_ids)
        self.templates: list[_Template] = []
        self.overflow = owner.config.task == "overflow"
        self.rerun: torch.fx.GraphModule | None = None
        self.symbols: list = []            # the sympy symbols of the graph's SymInt inputs
        self._resolved: dict[tuple, dict] = {}
        _GRAPHS[self.id] = self

    def resolve(self, sizes) -> dict:
        """Dynamic shapes: {id(template spec): the spec with this call's shapes, strides and
        sizes}, from the call's values of the graph's symbolic sizes (one evaluation per distinct
        set of sizes).  Sizes of symbols the graph is not given (data-dependent) keep their hints."""
        if not sizes:
            return {}
        key = tuple(int(v) for v in sizes)
        hit = self._resolved.get(key)
        if hit is not None:
            return hit
        env = dict(zip(self.symbols, key))

        def value(size):
            if not isinstance(size, torch.SymInt):
                return int(size)
            expr = size.node.expr
            expr = expr.xreplace(env) if hasattr(expr, "xreplace") else expr
            return int(expr) if getattr(expr, "is_number", True) else _hint(size)
        hit = self._resolved[key] = {}
        for t in self.templates:
            for spec, sym in t.symbolic:
                if isinstance(sym, tuple):
                    shape, stride = sym
                    hit[id(spec)] = {**spec, "shape": [value(d) for d in shape],
                                     "stride": [value(d) for d in stride] if stride is not None else None}
                else:
                    hit[id(spec)] = {**spec, "value": value(sym)}
        return hit

    def add(self, group: _Group, inputs, kwargs, outputs, exact: bool, traced: bool = False) -> _Template:
        scope_meta = group.nodes[0].meta.get("fwd_nn_module_stack" if self.stage == "backward" else "nn_module_stack")
        if self.stage == "backward" and not scope_meta:
            scope_meta = group.nodes[0].meta.get("nn_module_stack")
        t = _Template(str(group.op), self.roots.scope(scope_meta), [n.name for n in group.nodes], exact)
        if not exact:
            t.compiled["call"] = traced
        original = group.nodes[0].meta.get("original_aten")
        if self.owner.granularity == "node" and original is not None and str(original) != t.op:
            t.compiled["original_aten"] = str(original)      # the eager op this node computes part of
        t.inputs = [t.encode(a) for a in inputs]
        t.kwargs = {k: t.encode(v) for k, v in kwargs.items()}
        t.outputs = [t.encode(o) for o in outputs]
        t.output_type = "single" if len(outputs) == 1 else "tuple"
        self.templates.append(t)
        return t

    def finish(self, order: list) -> None:
        row_of = {n: i for i, n in enumerate(order)}
        for t in self.templates:
            t.rows = [row_of[n] for _, n in t.slots]
            outs = {id(o) for o in t.outputs}
            t.out_rows = [r for (spec, _), r in zip(t.slots, t.rows) if id(spec) in outs]
            t.in_rows = [r for (spec, _), r in zip(t.slots, t.rows) if id(spec) not in outs] \
                + [row_of[n] for n in t.producers]
            t.producers = []
            t.node_slots = t.slots
            t.slots = [spec for spec, _ in t.slots]
            t.tensor_nodes = []

    def set_kernels(self, kernels: dict) -> None:
        """Inductor provenance: each record names the generated kernels that compute its nodes
        (``cpp_fused_add_native_layer_norm_0:4``, ``extern_kernels.addmm:1``: name and debug handle,
        as in the provenance comments of inductor's output code), in the order inductor made them."""
        by_node: dict[str, list] = {}
        for kernel, names in sorted(kernels.items(), key=lambda kv: _handle(kv[0])):
            for name in names:
                by_node.setdefault(name, []).append(kernel)
        for t in self.templates:
            found = []
            for name in t.compiled["nodes"]:
                found.extend(k for k in by_node.get(name, ()) if k not in found)
            t.compiled["kernels"] = sorted(found, key=_handle)

    def emit(self, block: torch.Tensor, values: list | None = None, sizes=()) -> None:
        """One graph call: a record per template, in graph order;
        ``values``: the recorded tensors (task ``tensor``), saved with the records."""
        session = self.owner.target()
        if session is None or not session.recording(self.stage, self.templates[0].scope):
            return
        # a CPU block is read at once (no sync), each value's statistics made once for all its
        # records; an accelerator's rows wait in the recorder for one sync with its other rows
        host = block.device.type == "cpu"
        rows = block.tolist() if host else block.unbind(0)
        made: dict[int, dict] = {}
        resolved = self.resolve(sizes)
        recorder = session.recorder
        selector = session.selector
        with session._writing():
            for t in self.templates:
                if not selector.op_selected(t.op) or not selector.scope_selected(t.scope):
                    continue
                record = {"id": None, "kind": "op", "name": None, "op": t.op, "stage": self.stage,
                          "scope": t.scope, "call": session.next_call(t.op, self.stage), "grad_fn": None,
                          "stack": None}
                record["name"] = f"{t.op}.{record['call']}.{self.stage}"
                fresh = dict(resolved)
                for spec, r in zip(t.slots, t.rows):
                    copy = fresh[id(spec)] = dict(resolved.get(id(spec), spec))
                    if not host:
                        recorder.defer_stats(copy, rows[r], math.prod(copy["shape"]))
                    elif r in made:
                        copy["stats"] = made[r]
                    else:
                        copy["stats"] = made[r] = statistics.from_row(rows[r], math.prod(copy["shape"]))
                    if values is not None and recorder.part.tensors is not None:
                        copy["data"] = recorder.save(values[r])
                if recorder.io_filter("input"):
                    record["inputs"] = _fill(t.inputs, fresh)
                    record["kwargs"] = {k: _fill(v, fresh) for k, v in t.kwargs.items()}
                if recorder.io_filter("output"):
                    record["output_type"] = t.output_type
                    record["outputs"] = _fill(t.outputs, fresh)
                record["compiled"] = {"graph": self.id, **t.compiled}
                recorder.emit(record)


    def check(self, block: torch.Tensor, inputs: list, sizes=()) -> None:
        """Task overflow, one graph call: the first call whose outputs hold inf/nan while what it
        reads is finite (and it is given no inf/nan) is a hit.  Its compiled record is written
        (flag ``overflow``), then the graph is re-run eagerly, node by node, through the session's
        overflow check, which finds the node, saves its inputs and replays it in float64."""
        session = self.owner.target()
        if session is None or not session.recording(self.stage, self.templates[0].scope):
            return
        rows = block.tolist()            # one host read per graph call

        def bad(r):
            return rows[r][4] + rows[r][5] > 0
        hit = next((t for t in self.templates if any(bad(r) for r in t.out_rows)
                    and not t.nonfinite_scalar and not any(bad(r) for r in t.in_rows)), None)
        if hit is None:
            return
        # call indexes as the other tasks give them (every recorded call of the graph counts), so the
        # hit and its eager re-run are one op identity with the eager probe's numbering
        selector = session.selector
        calls = {id(t): session.next_call(t.op, self.stage) for t in self.templates
                 if selector.op_selected(t.op) and selector.scope_selected(t.scope)}
        if id(hit) not in calls:
            return
        with session._writing():
            record = {"id": None, "kind": "op", "name": None, "op": hit.op, "stage": self.stage,
                      "scope": hit.scope, "call": calls[id(hit)], "grad_fn": None,
                      "stack": None}
            record["name"] = f"{hit.op}.{record['call']}.{self.stage}"
            fresh = dict(self.resolve(sizes))
            for spec, r in zip(hit.slots, hit.rows):
                copy = fresh[id(spec)] = dict(fresh.get(id(spec), spec))
                copy["stats"] = statistics.from_row(rows[r], math.prod(copy["shape"]))
            record["inputs"] = _fill(hit.inputs, fresh)
            record["kwargs"] = {k: _fill(v, fresh) for k, v in hit.kwargs.items()}
            record["output_type"] = hit.output_type
            record["outputs"] = _fill(hit.outputs, fresh)
            nan = sum(int(rows[r][4]) for r in hit.out_rows)
            inf = sum(int(rows[r][5]) for r in hit.out_rows)
            record["overflow"] = {"class": "critical", "nan": nan, "inf": inf,
                                  "rerun": "the graph is re-run eagerly: see the records after this one"
                                  if self.rerun is not None else "not re-run (symbolic sizes)"}
            record["compiled"] = {"graph": self.id, **hit.compiled}
            session.recorder.flush()
            session.recorder.write(record)
        if self.rerun is not None:
            node_calls = {name: calls[id(t)] for t in self.templates if id(t) in calls for name in t.compiled["nodes"]}
            _Rerun(self.rerun, session, self.stage, self.roots, node_calls,
                   {"graph": self.id, "rerun_of": record["name"]}).run(*inputs)


def _handle(kernel: str) -> int:
    """The provenance debug handle of ``"name:handle"`` (the order inductor generated the kernels)."""
    try:
        return int(kernel.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return -1


def _rerun_module(graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A copy of a post-grad graph, to run eagerly (node metadata kept)."""
    copy = torch.fx.Graph()
    out = copy.graph_copy(graph, {})
    copy.output(out)
    return torch.fx.GraphModule(graph.owning_module or torch.nn.Module(), copy)


class _Rerun(torch.fx.Interpreter):
    """Runs a post-grad graph eagerly, giving each node's call to the session as an op event, so
    the eager overflow check judges the graph's own ops (node granularity, scopes from metadata)."""

    def __init__(self, gm, session, stage: str, roots: "FrameScopes", node_calls: dict, mark: dict):
        super().__init__(gm)
        self.extra_traceback = False     # the check's OverflowDetected reaches the user as it is
        self.session, self.stage, self.roots = session, stage, roots
        self.node_calls, self.mark = node_calls, mark
        self._node = None

    def run(self, *args):
        """The graph's calls keep the call indexes of the graph call's records (no second numbering),
        and each record the check writes says which compiled record it re-runs, at which node."""
        session, recorder = self.session, self.session.recorder
        counted, write = session.next_call, recorder.write

        def next_call(op, stage):
            call = self.node_calls.get(self._node.name) if self._node is not None else None
            return call if call is not None else counted(op, stage)

        def write_marked(record):
            if record.get("kind") == "op" and self._node is not None:
                record["compiled"] = {**self.mark, "nodes": [self._node.name], "rerun": True}
            return write(record)

        session.next_call, recorder.write = next_call, write_marked
        try:
            return super().run(*args)
        finally:
            del session.next_call, recorder.write

    def run_node(self, n):
        self._node = n
        return super().run_node(n)

    def call_function(self, target, args, kwargs):
        out = super().call_function(target, args, kwargs)
        if isinstance(target, torch._ops.OpOverload) and not ops.never_recorded(target) \
                and not ops.is_alias(target):
            meta = self._node.meta
            scope = meta.get("fwd_nn_module_stack" if self.stage == "backward" else "nn_module_stack") \
                or meta.get("nn_module_stack")
            self.session.on_op(ops.op_name(target), self.stage, self.roots.scope(scope), args, kwargs, out,
                               func=target)
        return out


def _fill(value, fresh: dict):
    """A template value with this call's tensor specs in place of the template's."""
    if isinstance(value, list):
        return [_fill(v, fresh) for v in value]
    if isinstance(value, dict):
        hit = fresh.get(id(value))
        if hit is not None:
            return hit
        if value.get("type") in ("list", "tuple"):
            return {"type": value["type"], "value": [_fill(v, fresh) for v in value["value"]]}
        return value
    return value
