"""Inductor's internals ``probe_backend`` plugs into: its compile entries, config, decomposition
table, post-grad pass interface, FX graph cache, lowering and scheduler, kernel provenance and
output code.  Needs torch >= 2.13 (``compile/requires.py`` says so at the call); checked on 2.13.0
and 2.14.1.  Everything but the pass interface is imported on first use (importing inductor's
compile pipeline imports dynamo)."""

from __future__ import annotations

import contextlib

from torch._inductor.custom_graph_pass import CustomGraphPass

__all__ = ["CustomGraphPass", "compile_fx", "compile_fx_inner", "config", "rounds_fused_casts", "select_decomp_table",
           "hash_of_files", "cache_dir", "fx_graph_cache_key", "fx_cache_loads", "lowering_classes", "realize_if_boxed",
           "is_stored", "scheduled_apart", "placed_apart", "kernel_provenance", "eager_output", "reinplace_candidates",
           "node_storage"]


def compile_fx(gm, example_inputs, **kwargs):
    """Inductor's whole pipeline (AOTAutograd, then ``inner_compile`` per graph)."""
    from torch._inductor.compile_fx import compile_fx as run
    return run(gm, example_inputs, **kwargs)


def compile_fx_inner(gm, inputs, **kwargs):
    """Inductor's compile of one post-AOTAutograd graph."""
    from torch._inductor.compile_fx import compile_fx_inner as run
    return run(gm, inputs, **kwargs)


def config():
    """Inductor's config module (``patch``, ``fx_graph_cache``, ...)."""
    import torch._inductor.config as inductor_config
    return inductor_config


def rounds_fused_casts() -> bool:
    """Whether inductor's fused kernels round a value cast to bfloat16 or float16 before the ops fused
    with the cast read it (``emulate_precision_casts``, False by default: they read the float32 value
    the kernel computed).  Checked on torch 2.14.1; a torch without the setting counts as False."""
    return bool(getattr(config(), "emulate_precision_casts", False))


def select_decomp_table() -> dict:
    """Inductor's decomposition table."""
    from torch._inductor.decomposition import select_decomp_table as table
    return table()


def hash_of_files(files: tuple) -> bytes:
    """Inductor's hash of source files, as custom passes key the FX graph cache with."""
    from torch._inductor.custom_graph_pass import get_hash_for_files
    return get_hash_for_files(files)


def cache_dir() -> str:
    """Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR`` or its default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as where
    return where()


def fx_graph_cache_key(compiled):
    """The FX graph cache key a compiled graph was stored or found under, or None."""
    return getattr(compiled, "_fx_graph_cache_key", None)


@contextlib.contextmanager
def fx_cache_loads():
    """The FX graph cache keys of the graphs loaded meanwhile (an AOTAutograd hit loads its
    graphs by these keys without compiling them); none noted where a torch loads otherwise."""
    from torch._inductor.codecache import FxGraphCache
    keys: list = []
    load_with_key = FxGraphCache.__dict__.get("load_with_key")
    if not isinstance(load_with_key, staticmethod):
        yield keys
        return

    def noting(key, *args, **kwargs):
        found = load_with_key.__func__(key, *args, **kwargs)
        if found[0] is not None:
            keys.append(key)
        return found
    FxGraphCache.load_with_key = staticmethod(noting)
    try:
        yield keys
    finally:
        FxGraphCache.load_with_key = load_with_key


def lowering_classes() -> tuple:
    """(``GraphLowering``, ``Scheduler``): whose ``run_node`` and ``can_fuse`` the backend wraps."""
    from torch._inductor.graph import GraphLowering
    from torch._inductor.scheduler import Scheduler
    return GraphLowering, Scheduler


@contextlib.contextmanager
def scheduled_apart(ours):
    """Inductor schedules the graphs compiled meanwhile as if the nodes ``ours(node)`` picks were not
    there, and runs those where its kernels end anyway.  Its peak-memory reordering (which picks
    among orders by their estimated peak) orders the other nodes alone, and before the buffers' last
    uses are computed (which decide when memory is freed and reused) ``ours`` are placed by
    :func:`placed_apart`; where they cannot be (a node of the others that depends on one of
    ``ours`` is ordered before what that one reads), the schedule is inductor's as it is."""
    from torch._inductor import memory
    from torch._inductor.scheduler import Scheduler
    compute_last_usage = Scheduler.compute_last_usage
    reorder_for_peak_memory = memory.reorder_for_peak_memory

    def reorder_others(nodes, *args, **kwargs):
        others = [n for n in nodes if not ours(n)]
        if len(others) == len(nodes):
            return reorder_for_peak_memory(nodes, *args, **kwargs)
        return placed_apart(reorder_for_peak_memory(others, *args, **kwargs) + [n for n in nodes if ours(n)], ours) \
            or reorder_for_peak_memory(nodes, *args, **kwargs)

    def placed_first(self):
        self.nodes = placed_apart(self.nodes, ours) or self.nodes
        return compute_last_usage(self)
    memory.reorder_for_peak_memory = reorder_others
    Scheduler.compute_last_usage = placed_first
    try:
        yield
    finally:
        memory.reorder_for_peak_memory = reorder_for_peak_memory
        Scheduler.compute_last_usage = compute_last_usage


def _names(node) -> set:
    return {*node.get_buffer_names(), *node.get_operation_names()}


def _deps(node) -> set:
    return {d.name for d in node.unmet_dependencies}


def _ends_kernel(node) -> bool:
    """Whether the kernel being generated ends at ``node``: the C++ backend generates the loops of
    consecutive scheduled nodes as one kernel, up to an extern call or a template; the others
    generate one kernel per scheduled node."""
    from torch._inductor.scheduler import FusedSchedulerNode, NopKernelSchedulerNode, SchedulerNode
    device = node.get_device()
    return (device is not None and device.type != "cpu") \
        or not isinstance(node, (SchedulerNode, FusedSchedulerNode, NopKernelSchedulerNode)) \
        or node.is_extern() or node.is_template() or node.is_foreach()


# scheduled nodes one of ``ours`` waits at most for a kernel's end: where none comes (a graph
# without matrix products), the values it reads are not all kept to the end of the graph
_WAIT = 16


def placed_apart(nodes: list, ours) -> list | None:
    """The schedule ``nodes`` with the others in their order and each of ``ours`` (in theirs) run
    right after the first node ending a kernel (:func:`_ends_kernel`) once all it reads is
    computed (or ``_WAIT`` nodes later): between two extern calls, so that the kernels of the others
    are generated as without ``ours``, and ``ours``' own loops make kernels of their own.  A node
    of the others that depends on one of ``ours`` gets it just before it.  None where no such
    order exists."""
    mine = [n for n in nodes if ours(n)]
    if not mine:
        return nodes
    made = set().union(*map(_names, nodes))
    mine_made = set().union(*map(_names, mine))
    done: set = set()
    out: list = []

    def emit(n):
        out.append(n)
        done.update(_names(n))

    def ready(n) -> bool:
        return all(d in done or d not in made for d in _deps(n))

    def flush(until=None) -> bool:
        while mine and ready(mine[0]) and (until is None or not until <= done):
            emit(mine.pop(0))
        return until is None or until <= done

    flush()          # what reads only the graph's inputs: first
    waited = 0
    for node in nodes:
        if ours(node):
            continue
        needed = _deps(node) & mine_made
        if needed and not flush(needed):
            return None
        emit(node)
        waited = waited + 1 if mine and ready(mine[0]) else 0
        if _ends_kernel(node) or waited > _WAIT:
            flush()
            waited = 0
    flush()
    return None if mine else out


def realize_if_boxed(box) -> None:
    """Stores a lowered value (an ``ir.TensorBox``) instead of inlining it into its readers."""
    from torch._inductor import ir
    if isinstance(box, ir.TensorBox):
        box.realize()


def is_stored(box) -> bool:
    """Whether a lowered value is in memory (a buffer, or any view of one) rather than a loop body
    that its readers inline: a reader lowered while it is not stored computes it itself."""
    from torch._inductor import ir
    x = box
    while isinstance(x, (ir.TensorBox, ir.BaseView)):      # views of a value: its storage
        x = x.data
    return not (isinstance(x, ir.StorageBox) and isinstance(x.data, (ir.Pointwise, ir.Reduction, ir.Scan, ir.Sort)))


class kernel_provenance:
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


_eager_output_class = None


def eager_output(gm):
    """An instrumented aten graph run eagerly, in inductor's compiled-output interface."""
    global _eager_output_class
    if _eager_output_class is None:
        from torch._inductor.output_code import OutputCode

        class EagerOutput(OutputCode):
            def __init__(self, gm):
                self.gm = gm
                self._boxed_call = True

            def __call__(self, inputs):
                return self.gm(*inputs)

            def post_compile(self, example_inputs, constants, graph_kwargs) -> None:
                pass

            def set_triton_bundle(self, triton_bundle) -> None:
                pass

        _eager_output_class = EagerOutput
    return _eager_output_class(gm)


def reinplace_candidates() -> tuple:
    """The functional ops inductor's reinplacing pass may turn in place (their first argument written)."""
    from torch._inductor.fx_passes import reinplace
    return (*reinplace.inplaceable_ops, *reinplace._SCATTER_OP_TO_VIEW, *reinplace.inplaceable_foreach_ops)


def node_storage(node):
    """The storage an FX node's value lives in (views share their base's), or None."""
    from torch._inductor.fx_utils import get_node_storage
    return get_node_storage(node)
