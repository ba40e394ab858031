"""MindSpore PyNative capture: ``MsDispatchMode`` for the primitives, cell hooks for the scopes.

The handler runs the primitive first, untouched, and hands it to the core (task logic, records)
only afterwards; ops run inside the handler are not dispatched again, so the probe's own work is
never recorded.  Forward and backward are told apart by the autodiff engine id.
"""

from __future__ import annotations

import contextlib
import warnings

import mindspore as ms
from mindspore import nn
from mindspore._c_expression import _DispatchGuardStack
from mindspore.utils import MsDispatchMode

from dispatchprobe.core import values
from dispatchprobe.core.config import ConfigError
from dispatchprobe.core.session import ProbeSession

from . import backend as ms_backend
from . import ops

try:
    from mindspore.graph.api import _pynative_executor
except ImportError:                                   # mindspore < 2.9
    from mindspore.common.api import _pynative_executor

# forward primitives whose backward kernel MindSpore's CPU runs outside the dispatch mode
# (single-op graphs, confirmed with GLOG_v=1): reported, never silently absent
UNOBSERVED_BACKWARD = {"BiasAdd": "BiasAddGrad", "LayerNorm": "LayerNormGrad", "Softmax": "SoftmaxBackward",
                       "Dropout": "DropoutGrad", "BatchNorm": "BatchNormGrad", "Sqrt": "SqrtGrad",
                       "SparseSoftmaxCrossEntropyWithLogits": "SparseSoftmaxCrossEntropyWithLogitsGrad"}


def in_backward() -> bool:
    return _pynative_executor.get_current_autodiff_engine_id() != -1


class _Mode(MsDispatchMode):
    def __init__(self, probe: "DispatchProbe"):
        self.probe = probe

    def __ms_dispatch__(self, func, args, kwargs=None):
        probe = self.probe
        if probe.busy:
            return func(*args)
        name, call, inputs, attrs = ops.normalise(func, args)
        if probe.scopes.is_hook_view(name, inputs) or name in ops.NOT_RECORDED:
            return func(*args)
        stage = "backward" if in_backward() else "forward"
        probe.scopes.saw_op(name, stage)
        scope = probe.scopes.current(stage)
        if not probe.would_record(stage, scope, name):
            return func(*args)                                     # filtered: no copies, no record
        seen = inputs
        written = ops.written_positions(name)
        if written:                                                # their values before the op writes them
            seen = tuple(ms_backend.clone(v) if i in written and isinstance(v, ms.Tensor) else v
                         for i, v in enumerate(inputs))
        out = func(*args)
        if not values.collect(out, ms_backend.is_tensor):       # typeof, shape queries: no numerics
            return out
        replaced = probe.on_op(name, stage, scope, seen, attrs, out, func=call, stack=ops.user_stack)
        return out if replaced is None else replaced


class _CellScopes:
    """Cell names (``Net.fc1``) and the active cell, forward and backward, from cell hooks.

    Backward hooks make MindSpore insert identity ``View`` ops around each cell's call:
    :meth:`is_hook_view` keeps them out of the records.  A cell whose backward ran no observable primitive is noted in ``unobserved``."""

    def __init__(self, probe: "DispatchProbe", model):
        self.probe, self.model = probe, model
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
        if self.model is None:
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

    def uninstall(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.forward_stack.clear()
        self.backward_stack.clear()

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


class DispatchProbe(ProbeSession):
    """Record, check or perturb every MindSpore primitive run inside ``with probe:`` (PyNative).

    ``DispatchProbe(task="statistics", dump_path="runs/ms", model=net)``: the same config, tasks
    and records as the PyTorch probe.  ``model`` (an ``nn.Cell``) gives ops their cell scope;
    ``@jit`` functions and GRAPH_MODE cells run outside the dispatch mode and are not seen."""

    backend = ms_backend

    def __init__(self, config=None, *, model=None, optimizer=None, **overrides):
        if model is not None and not isinstance(model, nn.Cell):
            raise ConfigError(f"model must be a mindspore.nn.Cell, not {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, nn.Optimizer):
            raise ConfigError(f"optimizer must be a mindspore.nn.Optimizer, not {type(optimizer).__name__}")
        super().__init__(config, **overrides)
        self.grad_reader = None
        if not self.task.intercepts_ops:      # the grad probe: the gradients the optimizer receives
            if optimizer is None:
                raise ConfigError(f"task={self.task.name!r} needs optimizer=<the mindspore.nn.Optimizer>: the "
                                  "gradients are read as it receives them (its parameters name them)")
            from .grad_probe import GradReader
            self.grad_reader = GradReader(self, optimizer)
        if self.config.task == "free_benchmark" and self.config.free_benchmark.fuzz_stage == "backward":
            raise ConfigError("free_benchmark fuzz_stage 'backward' is not available for MindSpore: a gradient "
                              "taken inside the dispatch handler breaks the training's own value_and_grad")
        if ms.get_context("mode") != ms.PYNATIVE_MODE:
            warnings.warn("dispatchprobe_ms: GRAPH_MODE runs outside the dispatch mode; nothing will be "
                          "recorded (set mindspore.set_context(mode=mindspore.PYNATIVE_MODE))", RuntimeWarning)
        self.scopes = _CellScopes(self, model)
        self._mode: _Mode | None = None
        self._depth = 0

    def _install(self) -> None:
        self.scopes.install()
        if self.record_ops:
            self._mode = _Mode(self)
            self._mode.__enter__()
            self._depth = _DispatchGuardStack.depth()

    def _uninstall(self) -> None:
        if self._mode is not None:
            if _DispatchGuardStack.depth() != self._depth:      # its __exit__ pops whatever is on top
                raise RuntimeError("dispatchprobe_ms: another MsDispatchMode entered inside the probe is still "
                                   "active; exit it first")
            self._mode.__exit__(None, None, None)
            self._mode = None
        self.scopes.uninstall()

    def _quiet(self):
        return ms._no_grad() if hasattr(ms, "_no_grad") else contextlib.nullcontext()

    def summary(self) -> dict:
        out = super().summary()
        if self.scopes.unobserved:
            out["backward_not_observable"] = dict(self.scopes.unobserved)
        return out

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.grad_reader is not None:
                self.grad_reader.remove()
        if self.scopes.unobserved:
            cells = ", ".join(f"{c} ({why})" for c, why in sorted(self.scopes.unobserved.items()))
            warnings.warn(f"dispatchprobe_ms: backward not (fully) recorded for: {cells}", RuntimeWarning, stacklevel=2)
