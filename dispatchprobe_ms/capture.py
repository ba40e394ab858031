"""MindSpore PyNative capture: ``MsDispatchMode`` for the primitives, cell hooks for the scopes.

The handler runs the primitive first, untouched, and hands it to the core (task logic, records)
only afterwards; ops run inside the handler are not dispatched again, so the probe's own work is
never recorded.  Forward and backward are told apart by the autodiff engine id.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import mindspore as ms
from mindspore import nn
from mindspore._c_expression import _DispatchGuardStack
from mindspore.utils import MsDispatchMode

from dispatchprobe.core import nested_values as values
from dispatchprobe.core.config import ConfigError
from dispatchprobe.core.session import ProbeSession
from dispatchprobe.records.writer import write_manifest

from . import tensor_backend as ms_backend
from . import ops
from .cell_scopes import CellScopes

try:
    from mindspore.graph.api import _pynative_executor
except ImportError:                                   # mindspore < 2.9
    from mindspore.common.api import _pynative_executor

# the tasks whose records a graph's dumped kernels can give (the free benchmark re-runs ops, which a
# compiled graph does not let it do)
GRAPH_TASKS = ("statistics", "tensor", "overflow")


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
        unwritten = ops.unwritten_outputs(name, ms_backend.accelerator())
        undefined = {id(o) for i, o in enumerate(out) if i in unwritten} if unwritten and isinstance(out, tuple) else None
        replaced = probe.on_op(name, stage, scope, seen, attrs, out, func=call, stack=ops.user_stack,
                               undefined=undefined)
        return out if replaced is None else replaced


class DispatchProbe(ProbeSession):
    """Record, check or perturb every MindSpore primitive run inside ``with probe:``.

    ``DispatchProbe(task="statistics", dump_path="runs/ms", model=net)``: the same config, tasks
    and records as the PyTorch probe.  ``model`` (an ``nn.Cell``) gives ops their cell scope.
    PyNative primitives come from the dispatch mode; the kernels of compiled graphs (GRAPH_MODE
    cells, ``@jit`` functions) from MindSpore's dump, which the probe sets up when it is created
    (so create it before the first graph compile) and MindSpore writes only inside the recorded
    regions of the selected steps, narrowed to the kernels ``scope``/``list`` could select:
    ``graphs=False`` leaves it off, ``dump_filter=False`` dumps every kernel (filtered when read),
    ``keep_dump=True`` keeps MindSpore's files under ``dump_path/mindspore_dump``.  ``loss_scaler``
    (an ``amp.DynamicLossScaler``): the overflow task's backward overflows in a step whose scale
    backed off are the scaler's deliberate ones."""

    backend = ms_backend

    def __init__(self, config=None, *, model=None, optimizer=None, loss_scaler=None, graphs: bool = True,
                 keep_dump: bool = False, dump_filter: bool = True, **overrides):
        if model is not None and not isinstance(model, nn.Cell):
            raise ConfigError(f"model must be a mindspore.nn.Cell, not {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, nn.Optimizer):
            raise ConfigError(f"optimizer must be a mindspore.nn.Optimizer, not {type(optimizer).__name__}")
        if loss_scaler is not None and not isinstance(getattr(loss_scaler, "scale_value", None), ms.Parameter):
            raise ConfigError("loss_scaler must be a mindspore.amp loss scaler (a DynamicLossScaler: its scale_value "
                              f"Parameter is read), not {type(loss_scaler).__name__}")
        super().__init__(config, **overrides)
        # MindSpore scales the loss in compiled graphs (amp's jit functions): the overflow task learns of
        # the scaler from the user, and a scale that backed off marks the step's backward overflows expected
        self.loss_scaler = loss_scaler
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
        pynative = ms.get_context("mode") == ms.PYNATIVE_MODE
        self.graphs = None                    # compiled graphs' kernels, from MindSpore's dump
        if graphs and self.record_ops and self.task.name in GRAPH_TASKS:
            from .graph_capture import GraphCapture
            self.graphs = GraphCapture(self, model, os.path.join(self.run_dir, "mindspore_dump") if keep_dump else None,
                                       dump_filter=dump_filter)
            self.graphs.warn_if_unavailable(pynative)
        elif not pynative and not self.record_ops:
            warnings.warn(f"dispatchprobe_ms: level={self.config.level!r} records cell boundaries, which a GRAPH_MODE "
                          "graph does not show: nothing will be recorded (level 'op' or 'mix' records its kernels)",
                          RuntimeWarning, stacklevel=2)
        elif not pynative:
            warnings.warn(f"dispatchprobe_ms: task={self.task.name!r} needs PyNative: a GRAPH_MODE graph is recorded "
                          f"from MindSpore's dump, for the tasks {', '.join(GRAPH_TASKS)} (graphs=True)",
                          RuntimeWarning, stacklevel=2)
        # no cell hooks in GRAPH_MODE: MindSpore's graph compiler would have to compile them
        self.scopes = CellScopes(self, model, hooks=pynative)
        self._mode: _Mode | None = None
        self._depth = 0

    def _install(self) -> None:
        if self.loss_scaler is not None:
            self.loss_scale_seen(scale=self.loss_scaler.scale_value)
        if self.graphs is not None:
            self.graphs.start()
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
        if self.graphs is not None:
            self.graphs.finish()

    def _manifest_info(self) -> dict:
        info = super()._manifest_info()
        if self.graphs is not None and self.graphs.recorded:
            info["extra"] = {**info["extra"], "graph_kernels": True}    # compare reads it: see graph_capture
        return info

    def graph_kernels_recorded(self) -> None:
        """The first records of a compiled graph's kernels: the manifest says so (compare reads a
        graph run against a PyNative one in aten's vocabulary, as two frameworks)."""
        if self.online is None and self._manifest_written:
            with self.writing():
                write_manifest(self.run_dir, **self._manifest_info())

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
