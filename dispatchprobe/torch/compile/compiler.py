"""The ``torch.compile`` backend: inductor's pipeline with the probe's pass in it."""

from __future__ import annotations

import atexit
import contextlib
import os
import hashlib
import itertools

import torch
import torch.fx

from .. import fused_stats
from ..process_state import STATE
from ..session import TorchSession
from ..internals import inductor
from ..internals.dynamo import clear_output_strides, functorch_config
from ..internals.inductor import eager_output, kernel_provenance
from .decompositions import traced_decompositions
from . import cache
from .graph_pass import Instrument
from .runtime import GRAPHS, GraphRecords
from .statistics_nodes import cpu_stats
from .scopes import ModuleNames

COMPILED_TASKS = ("statistics", "tensor", "overflow")
# "eager": a record per eager op call (post-grad nodes grouped by original_aten), which compare
# aligns with an eager run; "node": a record per post-grad node, the ops inductor compiles
GRANULARITIES = ("eager", "node")
_backends = itertools.count()          # numbers backends in order of creation (their graphs' slots)


class CompiledProbe(TorchSession):
    """The session of a probe backend: the eager probe's config, recorder and writer, started
    by the first graph call (there is no ``with``) and ended by :meth:`ProbeBackend.step`."""

    modules = None                  # the backend's ModuleNames: the modules its graphs run

    def module_names(self):
        return self.modules._names if self.modules is not None else None

    def saw_modules(self) -> bool:
        return self.modules is not None and self.modules.named_any

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
        from ...core.config import Config
        self.config = Config.load(config, **overrides)
        if self.config.task not in COMPILED_TASKS:
            raise ValueError(f"probe_backend records the tasks {', '.join(COMPILED_TASKS)}, not {self.config.task!r}"
                             + (" (it checks each op eagerly: use DispatchProbe)" if self.config.task == "free_benchmark" else ""))
        self._session: CompiledProbe | None = None
        fused_stats.load()      # the one-pass CPU statistics kernel the windows use, where it is built
        self.module_names = ModuleNames(model)
        self._slots = itertools.count(next(_backends) << cache.SLOT_BITS)
        atexit.register(self.close)

    @property
    def session(self) -> CompiledProbe:
        if self._session is None:
            config, overrides = self._args
            self._session = CompiledProbe(config, **overrides)
            self._session.modules = self.module_names
        return self._session

    def target(self):
        """The session a graph call records into now: an active DispatchProbe writing to the same
        run directory (so both capture paths share one record stream), else this backend's own."""
        for probe in reversed(STATE.active_probes):
            if probe.config.dump_path == self.config.dump_path:
                probe.graphs_recorded = True
                return probe
        session = self.session
        session.start()
        return session if session.active else None

    def step(self) -> None:
        if self._session is not None:
            self._session.step()

    def close(self) -> None:
        if self._session is not None:
            self._session.close()

    # -- compiling ------------------------------------------------------------------------------
    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        roots = self.module_names.frame()
        # the slots the forward and backward graph record under, chosen now: the AOTAutograd
        # cache returns both graphs of a hit without calling inner_compile, so its key gets the
        # probe's (cache.Keyed: the slots, what else the templates depend on), and a hit is given
        # the templates kept beside the graphs it loaded
        slots = {"forward": self._next_slot(), "backward": self._next_slot()}
        aot_key = None
        if functorch_config().enable_autograd_cache and cache.cacheable(self, example_inputs):
            # (training or inference: which graphs an entry holds)
            grads = (torch.is_grad_enabled(), [getattr(x, "requires_grad", None) for x in example_inputs])
            aot_key = hashlib.sha256(repr((cache.source_digest(), self._config_key(), slots, grads,
                                           cache.frame_digest(gm, roots))).encode()).hexdigest()
        compiled_here = False      # whether inner_compile ran (not for an AOTAutograd hit)

        def inner_compile(graph_module, inputs, **kw):
            nonlocal compiled_here
            compiled_here = True
            backward = bool(kw.get("is_backward"))
            stage = "backward" if backward else "forward"
            slot = slots[stage]
            # backward nodes whose forward node AOTAutograd did not find get their scope here,
            # before the keys and templates that hold it
            (roots.fill_backward if backward else roots.note_forward)(graph_module.graph)
            if slot in GRAPHS:        # a second graph of this stage (not cached by AOTAutograd)
                slot = self._next_slot()
            if self.inner == "aot_eager":
                instrument = Instrument(self, roots, backward, slot)
                instrument(graph_module.graph)
                instrument.note_inlined()           # run eagerly: every value is in memory
                graph_module.recompile()
                return eager_output(graph_module)
            if "get_decomp_fn" in kw:
                # lowering's table: inductor's own (ours only notes calls while AOTAutograd traces),
                # which the FX graph cache can hash (our wrappers are not picklable)
                kw["get_decomp_fn"] = inductor.select_decomp_table
            use_cache = cache.cacheable(self, inputs)
            key = ""
            if use_cache:
                key = hashlib.sha256(repr((cache.source_digest(), self._config_key(), backward, slot,
                                           cache.graph_digest(graph_module, roots))).encode()).hexdigest()
            compiled = self._compile(graph_module, inputs, Instrument(self, roots, backward, slot, key), use_cache, kw)
            if compiled is None:        # a cache hit without its templates: compiled again, uncached
                clear_output_strides()
                compiled = self._compile(graph_module, inputs, Instrument(self, roots, backward, slot), False, kw)
            return compiled

        def compile_all(use_aot: bool):
            passes = {"post_grad_custom_post_pass": cache.Keyed(aot_key)} if use_aot else {}
            with functorch_config().patch(enable_autograd_cache=use_aot), inductor.config().patch(passes):
                return inductor.compile_fx(gm, example_inputs, inner_compile=inner_compile, decompositions=traced_decompositions())

        if aot_key is None:
            return compile_all(False)
        with inductor.fx_cache_loads() as loaded:
            compiled = compile_all(True)
        if not compiled_here and not self._loaded(loaded, roots, training=grads[0] and any(grads[1])):
            clear_output_strides()        # an AOTAutograd hit whose graphs' templates are not all here
            compiled = compile_all(False)
        return compiled

    def _next_slot(self) -> int:
        slot = next(self._slots)
        while slot in GRAPHS:
            slot = next(self._slots)
        return slot

    def _config_key(self) -> tuple:
        """What of the backend's config the pass's output depends on."""
        return (cpu_stats(), REALIZE_READS, self.config.task, self.granularity, self.config.include_views)

    def _loaded(self, keys: list, roots, training: bool) -> bool:
        """An AOTAutograd cache hit, which loaded its graphs by the FX graph cache ``keys``: their
        records, from the templates kept beside them, under the slots their code records to.
        False where any is missing, its slot is taken in this process, or the hit did not load
        both graphs of a training step (the graphs are then compiled again)."""
        graphs = [cache.load(key) for key in keys]
        if not graphs or any(g is None or g[0] in GRAPHS for g in graphs) \
                or sorted(g[1] for g in graphs) != (["backward", "forward"] if training else ["forward"]):
            return False
        for slot, stage, templates in graphs:
            GraphRecords(self, stage, roots, slot).templates = templates
        return True

    def _compile(self, graph_module, inputs, instrument: Instrument, use_cache: bool, kw):
        """Inductor's compile of one graph with the pass in it; through the FX graph cache where
        ``use_cache``, the templates kept beside the cached code (None: a hit without them)."""
        with kernel_provenance() as kernels, unseen_by_lowering(instrument), \
                inductor.config().patch({"post_grad_custom_post_pass": instrument, "fx_graph_cache": use_cache,
                                              "trace.provenance_tracking_level": PROVENANCE_LEVEL}):
            compiled = inductor.compile_fx_inner(graph_module, inputs, **kw)
        key = inductor.fx_graph_cache_key(compiled) if use_cache else None
        records = instrument.records
        if records is not None:          # the pass ran
            instrument.note_inlined()
            records.set_kernels(kernels, inductor.rounds_fused_casts())
            if key is not None:
                cache.save(key, records.templates, instrument.slot, records.stage)
        elif key is not None:            # a cache hit: the pass's templates, kept beside the code
            kept = cache.load(key)
            stage = "backward" if instrument.backward else "forward"
            if kept is None or kept[:2] != (instrument.slot, stage):
                return None
            GraphRecords(self, stage, instrument.roots, instrument.slot).templates = kept[2]
        return compiled


@contextlib.contextmanager
def unseen_by_lowering(instrument):
    """Inductor compiles the user's nodes as it would without the pass.  While it lowers a node of
    the user's graph, the nodes the pass added are hidden from its users: inductor realizes a
    value (stores it in its dtype) or inlines it into its readers by their number, which decides
    bf16 rounding (pytorch#168186): the statistics must not.  And the buffers made while it lowers
    the pass's nodes (values stored only to be read, a window's rows) are never fused with the
    user's: fused in, a store changes how the user's kernel is generated (a loop nest with one
    more store that inductor cannot vectorise computes its ``sin``/``cos`` with the scalar
    functions, which differ from the vectorised ones in the last bit).  And the scheduler orders
    the user's nodes as without the pass's, which run right after an extern call of the user's (a
    matrix product), where inductor ends the C++ kernel it generates anyway: a window's call
    between two of the user's nodes would split their kernel in two, and the layers of a model
    would get kernels of different code, each compiled on its own."""
    GraphLowering, Scheduler = inductor.lowering_classes()
    run_node = GraphLowering.run_node
    can_fuse = Scheduler.can_fuse
    ours_made: set = set()        # the names of the buffers made while lowering the pass's nodes

    def lowering_run_node(self, n):
        ours = instrument.added
        users = n.users
        if n in ours:
            first = len(self.buffers)
            # the user's floating values not in memory now, after all their readers: each reader
            # computed them inline, and what the probe reads is a computation of its own
            instrument.inlined.update(a for a in n.all_input_nodes if a not in ours and a.op == "call_function"
                                      and getattr(a.meta.get("val"), "is_floating_point", lambda: False)()
                                      and not inductor.is_stored(self.env.get(a)))
            try:
                if REALIZE_READS:
                    stored(self, n, ours)
                return run_node(self, n)
            finally:
                ours_made.update(b.get_name() for b in self.buffers[first:])
        if not any(u in ours for u in users):
            return run_node(self, n)
        n.users = {u: v for u, v in users.items() if u not in ours}
        try:
            return run_node(self, n)
        finally:
            n.users = users

    def apart(self, node1, node2, *args, **kwargs):
        if ours_made and _made_by(node1, ours_made) != _made_by(node2, ours_made):
            return False
        return can_fuse(self, node1, node2, *args, **kwargs)

    GraphLowering.run_node = lowering_run_node
    Scheduler.can_fuse = apart
    try:
        with inductor.scheduled_apart(lambda node: _made_by(node, ours_made)):
            yield
    finally:
        GraphLowering.run_node = run_node
        Scheduler.can_fuse = can_fuse


def _made_by(node, names: set) -> bool:
    """Whether a scheduler node (or fused group) writes a buffer made for the pass (a group never
    mixes the pass's buffers with the user's)."""
    return any(name in names for name in node.get_buffer_names())


REALIZE_READS = os.environ.get("DISPATCHPROBE_REALIZE_READS", "1") == "1"
_LOW = (torch.bfloat16, torch.float16)


def stored(lowering, n, ours) -> None:
    """A float32/float64/integer CPU value of the user's graph that a node of the pass reads, realized (stored) before that
    node is lowered: the CPU windows hand every recorded value to an extern op, which stores it
    anyway, and without this each of its reductions computes it again, in a loop of its own.
    Its own readers were lowered before (the pass reads after the last of them), so their kernels
    do not change."""
    for a in n.all_input_nodes:
        if a in ours or a.op != "call_function":
            continue
        val = a.meta.get("val")
        box = lowering.env.get(a)
        # not bf16/fp16: a stored value is rounded to its dtype where an inlined one is not, and
        # a reader lowered later (of a view, or after a write) would read the rounded one
        if isinstance(val, torch.Tensor) and val.device.type == "cpu" and val.dtype not in _LOW:
            inductor.realize_if_boxed(box)


# inductor's provenance tracking, level "basic": which post-grad nodes each generated kernel computes
# (level 1 also rewrites the metadata of pattern-matched nodes, which the grouping reads)
PROVENANCE_LEVEL = 2


def probe_backend(config=None, *, inner: str = "inductor", model: torch.nn.Module | None = None,
                  granularity: str = "eager", **overrides) -> ProbeBackend:
    """``torch.compile(model, backend=probe_backend(task="statistics", dump_path="runs/c"))``:
    record the compiled graphs' ops at eager granularity.  ``inner``: ``"inductor"`` (compiled
    code, the default) or ``"aot_eager"`` (the same instrumented aten graphs run eagerly).
    ``model`` names the scopes of graphs that start inside a submodule (after a graph break).
    ``granularity="node"`` records each post-grad node, the op inductor compiles, instead of the
    eager op call it comes from."""
    return ProbeBackend(config, inner=inner, model=model, granularity=granularity, **overrides)
