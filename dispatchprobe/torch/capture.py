"""PyTorch eager capture: a TorchDispatchMode below autograd plus module-scope tracking.

The mode sees every aten call -- forward, and backward too when ``.backward()`` runs inside
the probe -- after autocast and autograd have done their work, so what is recorded is what the
kernels computed.  Module scope comes from global module hooks in forward and from multi-grad
hooks in backward (the technique of ``torch.utils.module_tracker``), which observe gradients
without changing them.

Transparency: the mode runs the op first, untouched, and only then looks at its results, under
``no_grad`` with the mode itself popped (so the probe's own ops are not recorded).  Nothing here
draws from the global RNG.
"""

from __future__ import annotations

import weakref

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from . import backend as torch_backend
from . import ops
from ..core.events import OpEvent
from ..core.session import ProbeSession

class _ProbeMode(TorchDispatchMode):
    def __init__(self, probe: "DispatchProbe"):
        super().__init__()
        self.probe = probe

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        probe = self.probe
        if probe._busy or not probe._wants(func):
            return func(*args, **kwargs)
        seen_args, seen_kwargs = args, kwargs
        written = ops.reads_written(func)
        if written:  # in-place/out= ops: record the inputs as they were *before* the op ran
            seen_args, seen_kwargs = _copy_written(written, args, kwargs)
        out = func(*args, **kwargs)
        return probe._on_op(func, seen_args, seen_kwargs, out)


def _copy_written(written, args, kwargs):
    """Copies of the tensors an op is about to overwrite, in place of the originals."""
    args, kwargs = list(args), dict(kwargs)
    with torch.no_grad():
        for i, name in written:
            if i < len(args) and isinstance(args[i], torch.Tensor):
                args[i] = args[i].clone()
            elif isinstance(kwargs.get(name), torch.Tensor):
                kwargs[name] = kwargs[name].clone()
    return tuple(args), kwargs


class _ModuleScopes:
    """Tracks the module scope in forward and backward, and emits module-boundary events."""

    def __init__(self, probe: "DispatchProbe", root: torch.nn.Module | None):
        self.probe = probe
        self.forward_stack: list[str] = []
        self.backward_active: list[str] = []
        self._names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._handles: list = []
        self._grad_hooks: list = []
        self._callback_queued = False
        self._pending_grad_out: dict = {}
        if root is not None:
            self._name_tree(root, type(root).__name__)

    @property
    def current(self) -> str:
        if torch._C._current_graph_task_id() != -1:
            return self._innermost_backward()
        return self.forward_stack[-1] if self.forward_stack else ""

    def _innermost_backward(self) -> str:
        # Modules sharing an output tensor (a model whose last layer's output is its own) enter
        # backward together, outer one last: prefer the deepest descendant of the latest entry.
        active = self.backward_active
        if not active:
            return ""
        current = active[-1]
        for name in reversed(active):
            if name.startswith(current + "."):
                current = name
        return current

    def install(self) -> None:
        self._handles = [register_module_forward_pre_hook(self._pre), register_module_forward_hook(self._post)]

    def uninstall(self) -> None:
        for h in self._handles + self._grad_hooks:
            h.remove()
        self._handles, self._grad_hooks = [], []
        self.forward_stack.clear()

    def _name_tree(self, mod, name) -> None:
        self._names[mod] = name
        for child_name, child in mod.named_children():
            if child not in self._names:
                self._name_tree(child, f"{name}.{child_name}")

    def name_of(self, mod) -> str:
        name = self._names.get(mod)
        if name is None:
            self._name_tree(mod, type(mod).__name__)
            name = self._names[mod]
        return name

    # forward hooks --------------------------------------------------------------------------
    def _pre(self, mod, args) -> None:
        name = self.name_of(mod)
        self.forward_stack.append(name)
        tensors = [a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor) and a.requires_grad]
        if tensors and torch.is_grad_enabled():
            self._grad_hooks.append(register_multi_grad_hook(tensors, self._backward_exit(mod, name), mode="all"))

    def _post(self, mod, args, output) -> None:
        name = self.name_of(mod)
        if self.forward_stack and self.forward_stack[-1] == name:
            self.forward_stack.pop()
        elif name in self.forward_stack:
            self.forward_stack.remove(name)
        self.probe._on_module(mod, name, "forward", args, output)
        tensors = [a for a in tree_flatten(output)[0] if isinstance(a, torch.Tensor) and a.requires_grad]
        if tensors and torch.is_grad_enabled():
            self._grad_hooks.append(register_multi_grad_hook(tensors, self._backward_enter(name), mode="all"))

    # backward hooks (fire when the gradients of the watched tensors are ready) -----------
    def _backward_enter(self, name):
        def hook(grads):
            self._queue_reset()
            self.backward_active.append(name)
            self._pending_grad_out[name] = grads
        return hook

    def _backward_exit(self, mod, name):
        def hook(grads):
            if name in self.backward_active:
                idx = len(self.backward_active) - 1 - self.backward_active[::-1].index(name)
                del self.backward_active[idx]
            grad_out = self._pending_grad_out.pop(name, ())
            self.probe._on_module(mod, name, "backward", grad_out, tuple(grads))
        return hook

    def _queue_reset(self) -> None:
        if self._callback_queued:
            return

        def reset():
            self.backward_active.clear()
            self._pending_grad_out.clear()
            self._callback_queued = False
        torch.autograd.Variable._execution_engine.queue_callback(reset)
        self._callback_queued = True


class DispatchProbe(ProbeSession):
    """Record, check or perturb every op run inside ``with probe:``.

    ``DispatchProbe(task="statistics", dump_path="runs/a")``, ``DispatchProbe("config.yaml")``
    or ``DispatchProbe(config_dict, model=model)``.  Passing ``model`` names module scopes from
    it (``Transformer.layers.1.mlp``); without it the same names are derived on first use.
    """

    backend = torch_backend

    def __init__(self, config=None, *, model: torch.nn.Module | None = None, **overrides):
        super().__init__(config, **overrides)
        self._busy = False
        self._mode: _ProbeMode | None = None
        self.scopes = _ModuleScopes(self, model)
        level = self.config.level
        self._record_ops = level in ("op", "mix")
        self._record_modules = level in ("module", "mix") and self.task.records_modules
        self._wants_memo: dict = {}
        self._stage_on = {s: self.config.stage_enabled(s) for s in ("forward", "backward")}

    # ---- installation -------------------------------------------------------------------------
    def _install(self) -> None:
        self.scopes.install()
        if self._record_ops:
            self._mode = _ProbeMode(self)
            self._mode.__enter__()

    def _uninstall(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        self.scopes.uninstall()

    def _detect_rank(self) -> int:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank()
        return super()._detect_rank()

    def _open_part(self) -> None:
        self.rank = self._detect_rank()
        super()._open_part()

    # ---- per op -----------------------------------------------------------------------------------
    def _wants(self, func) -> bool:
        hit = self._wants_memo.get(func)
        if hit is None:
            hit = not ops.never_recorded(func) and self.selector.op_selected(ops.op_name(func))
            if not self.config.include_views and ops.is_alias(func):
                hit = False
            self._wants_memo[func] = hit
        return hit

    def _on_op(self, func, args, kwargs, out):
        backward = torch._C._current_graph_task_id() != -1
        stage = "backward" if backward else "forward"
        scope = self.scopes.current
        if not self._stage_on[stage] or not self.selector.scope_selected(scope):
            return out
        op = ops.op_name(func)
        grad_fn = None
        if backward:
            node = torch._C._current_autograd_node()
            grad_fn = node.name() if node is not None else None
        stack = ops.user_stack(3) if self.config.stack and not backward else None
        event = OpEvent("op", op, stage, scope, self.next_call(op, stage), args, kwargs, out,
                        grad_fn=grad_fn, stack=stack, func=func)
        self._busy = True
        try:
            with torch.no_grad():
                replaced = self.dispatch(event)
        finally:
            self._busy = False
        return out if replaced is None else replaced

    def _on_module(self, mod, name: str, stage: str, inputs, outputs) -> None:
        if not self._record_modules or self._busy or not self._stage_on[stage]:
            return
        if not self.selector.scope_selected(name):
            return
        type_name = type(mod).__name__
        event = OpEvent("module", type_name, stage, name, self.next_call(name, stage),
                        tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,), {}, outputs)
        self._busy = True
        try:
            with torch.no_grad():
                self.recorder.module(name, type_name)
                self.recorder.emit(self.recorder.encode(event, defer=True))
        finally:
            self._busy = False

