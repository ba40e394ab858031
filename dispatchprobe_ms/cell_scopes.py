"""Cell scopes in PyNative (``Net.fc1``): cell hooks on the ``model=`` the user passes, kept out
of MindSpore's graph compiler.

MindSpore has no global cell hooks, so scopes come from hooks on the model's cells.  A graph
compiled while they are installed (a ``@ms.jit`` function or method called inside ``with
probe:``) would have to compile the hooks too, which it cannot (plain Python with side effects):
the user's compile would fail.  :func:`hooks_hidden_from_compiles` takes the probe's hooks off
the cells while MindSpore compiles and puts them back afterwards; the compiled graph has none
(its kernels are recorded from MindSpore's dump, :mod:`dispatchprobe_ms.graph_capture`).
"""

from __future__ import annotations

import contextlib
import functools

try:
    from mindspore.graph import api as _graph_api
except ImportError:                                   # mindspore < 2.9
    from mindspore.common import api as _graph_api

# forward primitives whose backward kernel MindSpore's CPU runs outside the dispatch mode
# (single-op graphs, confirmed with GLOG_v=1): reported, never silently absent
UNOBSERVED_BACKWARD = {"BiasAdd": "BiasAddGrad", "LayerNorm": "LayerNormGrad", "Softmax": "SoftmaxBackward",
                       "Dropout": "DropoutGrad", "BatchNorm": "BatchNormGrad", "Sqrt": "SqrtGrad",
                       "SparseSoftmaxCrossEntropyWithLogits": "SparseSoftmaxCrossEntropyWithLogitsGrad"}

# the compile entries of MindSpore's graph executors (jit functions and methods, graph cells)
_COMPILERS = [(cls, "compile") for cls in (getattr(_graph_api, "_JitExecutor", None),
                                            getattr(_graph_api, "_CellGraphExecutor", None)) if cls is not None]
_installed: list["CellScopes"] = []       # the scopes whose hooks are on cells now
_originals: dict = {}


def _guarded(original):
    @functools.wraps(original)
    def compile_without_probe_hooks(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            for scopes in list(_installed):
                stack.enter_context(scopes.hidden())
            return original(*args, **kwargs)
    return compile_without_probe_hooks


def _guard_compiles() -> None:
    for cls, attr in _COMPILERS:
        if (cls, attr) not in _originals:
            _originals[(cls, attr)] = getattr(cls, attr)
            setattr(cls, attr, _guarded(_originals[(cls, attr)]))


def _unguard_compiles() -> None:
    for (cls, attr), original in _originals.items():
        setattr(cls, attr, original)
    _originals.clear()


class CellScopes:
    """Cell names (``Net.fc1``) and the active cell, forward and backward, from cell hooks.

    Backward hooks make MindSpore insert identity ``View`` ops around each cell's call:
    :meth:`is_hook_view` keeps them out of the records.  A cell whose backward ran no observable
    primitive is noted in ``unobserved``.  ``hooks=False`` (GRAPH_MODE): no hook is installed."""

    def __init__(self, probe, model, hooks: bool = True):
        self.probe, self.model, self.hooks = probe, model, hooks
        self.forward_stack: list[str] = []
        self.backward_stack: list[str] = []
        self._handles: list = []
        self._hook_views = False
        self._ops_in: dict[str, int] = {}          # backward ops seen while the cell was active
        self.unobserved: dict[str, str] = {}       # cell -> why its backward is not (fully) recorded

    def current(self, stage: str) -> str:
        stack = self.backward_stack if stage == "backward" else self.forward_stack
        return stack[-1] if stack else ""

    def install(self) -> None:
        if self.model is None or not self.hooks:
            return
        root = type(self.model).__name__
        for path, cell in self.model.cells_and_names():
            scope = f"{root}.{path}" if path else root
            kind = type(cell).__name__
            self._handles += [
                cell.register_forward_pre_hook(lambda c, i, s=scope: self._enter(s)),
                cell.register_forward_hook(lambda c, i, o, s=scope, k=kind: self._leave(s, k, i, o)),
                cell.register_backward_pre_hook(lambda c, go, s=scope: self._enter_backward(s)),
                cell.register_backward_hook(lambda c, gi, go, s=scope, k=kind: self._leave_backward(s, k, go, gi)),
            ]
        _installed.append(self)
        _guard_compiles()

    def uninstall(self) -> None:
        if self in _installed:
            _installed.remove(self)
            if not _installed:
                _unguard_compiles()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.forward_stack.clear()
        self.backward_stack.clear()

    @contextlib.contextmanager
    def hidden(self):
        """The probe's hooks off their cells (in place: MindSpore's backward-hook objects hold the
        same dictionaries), put back in their order afterwards."""
        taken = []
        for h in self._handles:
            hooks = h.hook_dict_ref() if h.hook_dict_ref is not None else None
            if hooks is not None and h.handle_id in hooks:
                taken.append((hooks, h.handle_id, hooks.pop(h.handle_id)))
        try:
            yield
        finally:
            for hooks, key, fn in taken:
                hooks[key] = fn

    def is_hook_view(self, name: str, inputs) -> bool:
        """An identity ``View`` right after a cell boundary (one per tensor the cell takes or
        returns, and then some): the backward hooks' machinery, not the user's."""
        if self._hook_views and name == "View" and len(inputs) == 2 and list(inputs[1]) == list(inputs[0].shape):
            return True
        self._hook_views = False
        return False

    def saw_op(self, name: str, stage: str) -> None:
        if stage == "backward":
            for scope in self.backward_stack:
                self._ops_in[scope] = self._ops_in.get(scope, 0) + 1
        elif name in UNOBSERVED_BACKWARD and self.forward_stack:
            self.unobserved.setdefault(self.forward_stack[-1], f"{UNOBSERVED_BACKWARD[name]} runs outside "
                                       "the dispatch mode on this device")

    def _enter(self, scope: str) -> None:
        self.forward_stack.append(scope)
        self._hook_views = True

    def _leave(self, scope: str, kind: str, inputs, output) -> None:
        if self.forward_stack and self.forward_stack[-1] == scope:
            self.forward_stack.pop()
        self._hook_views = True
        self.probe.on_module(kind, scope, "forward", inputs, output)

    def _enter_backward(self, scope: str) -> None:
        self.backward_stack.append(scope)
        self._ops_in[scope] = 0

    def _leave_backward(self, scope: str, kind: str, grad_out, grad_in) -> None:
        if scope in self.backward_stack:
            self.backward_stack.remove(scope)
        if not self._ops_in.pop(scope, 1) and not any(s.startswith(scope + ".") for s in self._ops_in):
            self.unobserved.setdefault(scope, "its backward ran no primitive the dispatch mode sees")
        self.probe.on_module(kind, scope, "backward", grad_out, grad_in)
