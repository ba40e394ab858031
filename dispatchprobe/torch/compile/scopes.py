"""Module scopes of compiled nodes, named as the eager probe names them."""

from __future__ import annotations

import re
import sys
import weakref

import torch

from ..internals.autograd import MODULE_CALL_CODES
from ..internals.dynamo import is_optimized_module, traced_frame_locals

_SOURCE = re.compile(r"^L\['([^']+)'\]")
_CALLS = set(MODULE_CALL_CODES)


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
