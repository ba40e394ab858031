"""Task overflow: a compiled graph re-run eagerly, node by node, through the session's check."""

from __future__ import annotations

import torch
import torch.fx

from .. import ops
from ..internals.dispatch import OpOverload

def rerun_module(graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A copy of a post-grad graph, to run eagerly (node metadata kept)."""
    copy = torch.fx.Graph()
    out = copy.graph_copy(graph, {})
    copy.output(out)
    return torch.fx.GraphModule(graph.owning_module or torch.nn.Module(), copy)


class Rerun(torch.fx.Interpreter):
    """Runs a post-grad graph eagerly, giving each node's call to the session as an op event, so
    the eager overflow check judges the graph's own ops (node granularity, scopes from metadata)."""

    def __init__(self, gm, session, stage: str, roots: "FrameScopes", node_calls: dict, mark: dict):
        super().__init__(gm)
        self.extra_traceback = False     # the check's OverflowDetected reaches the user as it is
        self.session, self.stage, self.roots = session, stage, roots
        self.node_calls, self.mark = node_calls, mark
        self._node = None

    def run_node(self, n):
        self._node = n
        return super().run_node(n)

    def call_function(self, target, args, kwargs):
        """Each node's call keeps the call index of the graph call's record (no second numbering),
        and each record the check writes says which compiled record it re-runs, at which node."""
        out = super().call_function(target, args, kwargs)
        if isinstance(target, OpOverload) and not ops.never_recorded(target) \
                and not ops.is_alias(target):
            node = self._node
            scope = self.roots.node_scope(node.meta, self.stage)
            self.session.on_op(ops.op_name(target), self.stage, scope, args, kwargs, out,
                               func=target, call=self.node_calls.get(node.name),
                               extra={"compiled": {**self.mark, "nodes": [node.name], "rerun": True}})
        return out
