"""``torch.compile(model, backend=probe_backend(...))``: the probe inside compiled graphs.

The backend runs inductor's own pipeline (``compile_fx``: its decompositions, partitioner and
passes) and instruments each post-grad graph, forward and backward, in a custom post pass
(:mod:`.graph_pass`): the statistics of every recorded value are computed inside the graph
(:mod:`.statistics_nodes`; inductor fuses them into the producing kernels) and handed, as one
vector per graph call, to a side-effectful recording op (:mod:`.runtime`).  The records go
through the session's public entry for calls measured elsewhere, in execution order with the
eager records of the code around the graphs.  See docs/compile.md.
"""

from __future__ import annotations

from .requires import MIN_TORCH, require_torch

__all__ = ["COMPILED_TASKS", "GRANULARITIES", "MIN_TORCH", "STAT_FIELDS", "CompiledProbe", "ProbeBackend",
           "probe_backend"]
# imported on first use: the modules below need torch >= MIN_TORCH, importing this package does not
_LAZY = {"COMPILED_TASKS": "compiler", "GRANULARITIES": "compiler", "CompiledProbe": "compiler",
         "ProbeBackend": "compiler", "STAT_FIELDS": "runtime"}


def probe_backend(config=None, *, inner: str = "inductor", model=None, granularity: str = "eager", **overrides):
    """``torch.compile(model, backend=probe_backend(task="statistics", dump_path="runs/c"))``:
    record the compiled graphs' ops at eager granularity.  ``inner``: ``"inductor"`` (compiled
    code, the default) or ``"aot_eager"`` (the same instrumented aten graphs run eagerly).
    ``model`` names the scopes of graphs that start inside a submodule (after a graph break).
    ``granularity="node"`` records each post-grad node, the op inductor compiles, instead of the
    eager op call it comes from.  Needs torch >= 2.13 (:data:`MIN_TORCH`): on an older torch this
    call raises a RuntimeError naming both versions."""
    require_torch("probe_backend")
    from . import compiler
    return compiler.probe_backend(config, inner=inner, model=model, granularity=granularity, **overrides)


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
