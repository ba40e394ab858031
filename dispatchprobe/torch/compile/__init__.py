"""``torch.compile(model, backend=probe_backend(...))``: the probe inside compiled graphs.

The backend runs inductor's own pipeline (``compile_fx``: its decompositions, partitioner and
passes) and instruments each post-grad graph, forward and backward, in a custom post pass
(:mod:`.graph_pass`): the statistics of every recorded value are computed inside the graph
(:mod:`.statistics_nodes`; inductor fuses them into the producing kernels) and handed, as one
vector per graph call, to a side-effectful recording op (:mod:`.runtime`).  The records go
through the session's public entry for calls measured elsewhere, in execution order with the
eager records of the code around the graphs.  See docs/compile.md.
"""

from .backend import COMPILED_TASKS, GRANULARITIES, CompiledProbe, ProbeBackend, _EagerOutput, probe_backend
from .runtime import STAT_FIELDS

__all__ = ["COMPILED_TASKS", "GRANULARITIES", "STAT_FIELDS", "CompiledProbe", "ProbeBackend", "probe_backend"]
