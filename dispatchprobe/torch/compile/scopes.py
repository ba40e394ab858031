"""Module scopes of compiled nodes, named as the eager probe names them."""

from __future__ import annotations

import re
import sys
from bisect import bisect_left
import weakref

import torch

from ..internals.autograd import MODULE_CALL_CODES
from ..internals.dynamo import is_optimized_module, traced_frame_locals

#: node meta: the forward module stack :meth:`FrameScopes.fill_backward` found for a backward node
#: AOTAutograd matched to no forward node (torch's own ``fwd_nn_module_stack`` left as it was)
FILLED = "dispatchprobe_fwd_nn_module_stack"

_SOURCE = re.compile(r"^L\['([^']+)'\]")
_CALLS = set(MODULE_CALL_CODES)


class ModuleNames:
    """Eager's names of modules, as the eager probe's module tracker gives them: the first module
    seen is named by its class (``LlamaForCausalLM``), its submodules by their path in it
    (``LlamaForCausalLM.model.layers.0``); a name once given stays.  Weak: modules are not kept."""

    def __init__(self, model: torch.nn.Module | None = None):
        self._names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.named_any = False           # once set, stays: the modules named may all be gone
        if model is not None:
            self.add(model)

    def add(self, module: torch.nn.Module) -> None:
        if module in self._names:
            return
        self.named_any = True
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
                if isinstance(m, torch.nn.Module) and not is_optimized_module(m):
                    calling.append(m)
            f = f.f_back
        for m in reversed(calling):           # outermost first: it names its submodules
            self.add(m)
        local = traced_frame_locals()
        found = {k: v for k, v in local.items() if isinstance(v, torch.nn.Module)}
        for v in found.values():
            self.add(v)
        by_id = {str(id(m)): name for m, name in self._names.items()}
        return FrameScopes(by_id, self._names.get(calling[0], "") if calling else "",
                           {k: self._names[v] for k, v in found.items()})


class FrameScopes:
    """Names the innermost module of a node's ``nn_module_stack`` as eager does (plain names, no
    module references: a backward graph is compiled later, from these).

    A backward node's scope is its forward node's (``fwd_nn_module_stack``, which AOTAutograd
    copies from the forward node of the same ``seq_nr``).  Where no forward node has that number
    (an in-place op: its autograd node is numbered before the functional node that computes it),
    the forward nodes numbered next below and above it say where its autograd node was made, as
    eager capture files it: their module when they agree, else the modules both are inside.  A
    gradient accumulation (``is_gradient_acc``: two gradients of one value added) is filed, as
    eager's engine adds them, under the node whose gradient arrives last: the lower numbered."""

    def __init__(self, by_id: dict[str, str], current: str, local: dict[str, str]):
        self.by_id, self.current, self.local = by_id, current, local
        self._forward: dict[int, dict | None] = {}     # seq_nr -> nn_module_stack of the forward graph

    def note_forward(self, graph: torch.fx.Graph) -> None:
        """Keeps the forward graph's ``seq_nr`` -> ``nn_module_stack`` (before its backward compiles)."""
        _note(self._forward, graph)

    def node_scope(self, meta: dict, stage: str) -> str:
        """The eager scope of a graph node of ``stage`` from its ``meta``."""
        if stage == "backward":
            return self.scope(meta.get("fwd_nn_module_stack") or meta.get(FILLED) or meta.get("nn_module_stack"))
        return self.scope(meta.get("nn_module_stack"))

    def fill_backward(self, graph: torch.fx.Graph) -> None:
        """Gives the backward graph's nodes that AOTAutograd matched to no forward node (meta
        ``FILLED``) the module stack their neighbours in numbering agree on (none: no agreement),
        and gradient accumulations the stack of their last arriving gradient."""
        marks = dict(self._forward)
        _note(marks, graph)           # forward nodes the partitioner recomputes in the backward
        seqs = sorted(marks)
        arrivals: dict = {}           # accumulation -> (seq_nr, stack) of its last arriving gradient
        for n in graph.nodes:
            m = n.meta
            seq = m.get("seq_nr")
            if n.op != "call_function" or seq is None or m.get("nn_module_stack") or m.get("fwd_nn_module_stack"):
                continue
            if m.get("is_gradient_acc"):
                ins = [arrivals.get(a) or (a.meta.get("seq_nr"),
                                           a.meta.get("fwd_nn_module_stack") or a.meta.get(FILLED))
                       for a in n.all_input_nodes]
                ins = [x for x in ins if x[0] is not None]
                if ins:
                    arrivals[n] = min(ins, key=lambda x: x[0])
                    if arrivals[n][1]:
                        m[FILLED] = arrivals[n][1]
                continue
            if seq in marks:
                continue
            i = bisect_left(seqs, seq)
            if 0 < i < len(seqs):
                stack = _common(marks[seqs[i - 1]], marks[seqs[i]])
                if stack:
                    m[FILLED] = stack

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


def _note(marks: dict, graph: torch.fx.Graph) -> None:
    """Adds a graph's forward nodes to ``marks`` (seq_nr -> nn_module_stack); the first node of a
    number is the op that made its autograd node (the later ones made none)."""
    for n in graph.nodes:
        seq = n.meta.get("seq_nr")
        if n.op == "call_function" and seq is not None and n.meta.get("partitioner_tag") != "is_backward" \
                and not n.meta.get("fwd_nn_module_stack") and "nn_module_stack" in n.meta:
            marks.setdefault(seq, n.meta["nn_module_stack"])


def _common(a: dict | None, b: dict | None) -> dict:
    """The modules two ``nn_module_stack`` entries share from the outermost (a dict, in order)."""
    out = {}
    for (ka, va), (kb, vb) in zip((a or {}).items(), (b or {}).items()):
        if ka != kb:
            break
        out[ka] = va
    return out
