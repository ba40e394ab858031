"""What a capture adapter hands to the core: one :class:`OpEvent` per intercepted call, given
to each :class:`Handler` of the session's task."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class OpEvent:
    """One intercepted call, in neutral terms."""

    kind: str                     # "op" (a kernel call) or "module" (a module boundary)
    op: str                       # e.g. "aten.addmm.default", or the module's type for kind="module"
    stage: str                    # "forward" or "backward"
    scope: str                    # module scope, e.g. "TinyTransformer.layers.1.mlp"
    call: int                     # n-th call of this op in this stage, step and rank
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    outputs: Any = None
    grad_fn: str | None = None    # backward ops: the autograd node that ran them
    stack: tuple | None = None    # Python frames ("file:line in func"), innermost last
    func: Callable | None = None  # the callable, so a handler can run it again
    undefined: set | None = None  # ids of argument tensors holding uninitialised memory
    extra: dict | None = None     # fields added to its records (a compiled graph's re-run: which record)

    def with_outputs(self, outputs) -> "OpEvent":
        """A shallow copy holding ``outputs`` instead: what a handler keeps of an op until a
        deferred check is read back (not ``dataclasses.replace``: it re-runs ``__init__``)."""
        kept = object.__new__(OpEvent)
        kept.__dict__.update(self.__dict__)
        kept.outputs = outputs
        return kept

    def with_call(self, args, kwargs) -> "OpEvent":
        """A shallow copy called with ``args``/``kwargs`` instead (a perturbation re-planned on
        the differentiated copies of the inputs)."""
        moved = object.__new__(OpEvent)
        moved.__dict__.update(self.__dict__)
        moved.args, moved.kwargs = args, kwargs
        return moved

    @property
    def name(self) -> str:
        return record_name(self.kind, self.op, self.scope, self.stage, self.call)


def record_name(kind: str, op: str, scope: str, stage: str, call: int) -> str:
    """Stable across runs and devices: op (or scope for modules), call index, stage."""
    if kind == "module":
        return f"{scope}.{stage}.{call}"
    return f"{op}.{call}.{stage}"


class Handler:
    """A task's reaction to each op.  ``on_op`` may return replacement outputs (``fix`` only).

    Built by the task registry (:mod:`dispatchprobe.core.tasks`) with the session (config,
    step, rank, part folder, backend) and the recorder that writes its records."""

    def on_op(self, event: OpEvent):  # pragma: no cover - interface
        return None

    def start_part(self) -> None:
        """A new step/rank part was opened: per-part state (caches, summary files) starts over."""

    def flush(self) -> None:
        """End of a capture region: finish deferred work (may write records, may raise)."""

    def boundary(self) -> None:
        """The user's code ran outside the probe: the next region starts or the part closes (a
        decision that waited for the step's end is taken now; may write records, may raise)."""

    def optimizer_stepping(self) -> None:
        """An optimizer is about to step (adapters report it from the framework's global hook)."""

    def loss_scale_seen(self, scale, found_inf) -> None:
        """A dynamic loss scaler's scale or check, as the adapter recognised it (see the session)."""

    def close(self) -> None:
        pass

    def summary(self) -> dict:
        """Counts an inline check reports (``checked``, ``flagged``, ...); empty for recording."""
        return {}


def flat_outputs(outputs) -> list:
    return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]


def has_nonfinite_scalar(obj) -> bool:
    """A Python float inf/nan anywhere in nested tuples/lists/dicts (``masked_fill(mask, -inf)``)."""
    if isinstance(obj, float):
        return not math.isfinite(obj)
    if isinstance(obj, (tuple, list)):
        return any(has_nonfinite_scalar(v) for v in obj)
    if isinstance(obj, dict):
        return any(has_nonfinite_scalar(v) for v in obj.values())
    return False
