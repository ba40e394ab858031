"""The free benchmark's perturbations (``pert_mode``, msprobe's names), one registration each.

A perturbation turns an op call into the call to re-run: ``fn(check, event, inputs)`` returns
``(args, kwargs, output fix-up or None)``, or None to leave the op alone.  ``check`` is the
running :class:`~dispatchprobe.core.free_benchmark.FreeBenchmarkHandler` (its ``backend``,
``scratch``, ``noise`` and ``wider`` dtype map); ``inputs`` are the op's floating input tensors.
The config's allowed ``pert_mode`` values, the ``fix`` rule and the limits follow the flags
given here.  Add one with :func:`register_perturbation`; see docs/architecture.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Perturbation:
    name: str
    fn: Callable
    rerun_is_reference: bool = False   # the re-run is the better result (higher precision, CPU)
    fixable: bool = False              # handler_type="fix" may substitute the re-run's outputs
    noise: bool = False                # the inputs moved by ~eps: only amplification is a finding
    device: str = "same"               # "cpu": the re-run goes to the CPU (fuzz_device="cpu")
    # Moves elements between positions (differentiably): with fuzz_stage="backward" it is applied
    # inside the differentiated call, so each input gradient comes back in its input's own layout
    # (a gradient taken with respect to the moved copy is permuted: every element "differs").
    reorders: bool = False


PERTURBATIONS: dict[str, Perturbation] = {}


def register_perturbation(name: str, **flags):
    """Decorator: ``@register_perturbation("bit_noise", noise=True)`` over ``fn(check, event, inputs)``.
    A second perturbation of the same name is refused."""
    if name in PERTURBATIONS:
        raise ValueError(f"register_perturbation: a perturbation named {name!r} is already registered")

    def deco(fn):
        PERTURBATIONS[name] = Perturbation(name, fn, **flags)
        return fn
    return deco


@register_perturbation("improve_precision", rerun_is_reference=True, fixable=True)
def improve_precision(check, event, inputs):
    """float16/bfloat16 inputs in float32 (float32 in float64 with ``widen_float32``); ops with
    no input to widen are left alone (counted in ``not_widened``)."""
    backend = check.backend
    if not any(backend.dtype_of(t) in check.wider for t in inputs):
        check.not_widened += 1
        return None
    args, kwargs = backend.cast_args(event.args, event.kwargs, check.wider,
                                     scratch=None if check.fix else check.scratch)
    return args, kwargs, None


@register_perturbation("to_cpu", rerun_is_reference=True, fixable=True, device="cpu")
def to_cpu(check, event, inputs):
    """The same call on the CPU."""
    return (*check.backend.cast_args(event.args, event.kwargs, {}, device="cpu"), None)


@register_perturbation("no_change")
def no_change(check, event, inputs):
    """The same inputs again: any difference is non-determinism."""
    return event.args, event.kwargs, None


@register_perturbation("change_value", reorders=True)
def change_value(check, event, inputs):
    """First and last entries along the reduced dimension exchanged in every reduced operand
    (mm/bmm/addmm, sum/mean/amax/..., softmax/log_softmax/cumsum; other ops are skipped): the
    exact result is unchanged, so a difference is order-dependent rounding."""
    plan = check.backend.change_value_plan(event.func, event.args, event.kwargs)
    return None if plan is None else (plan[0], dict(event.kwargs), plan[1])


@register_perturbation("bit_noise", noise=True)
def bit_noise(check, event, inputs):
    """The last mantissa bit of every finite input element above the small-value threshold flipped."""
    return (*check.backend.map_floats(check.backend.bit_noise, event.args, event.kwargs), None)


@register_perturbation("add_noise", noise=True)
def add_noise(check, event, inputs):
    """x * (1 + u * eps(dtype)) where |x| is not small, u uniform in [-1, 1) from the check's
    own seeded generator (never the global RNG)."""
    return (*check.backend.map_floats(check.noise.apply, event.args, event.kwargs), None)
