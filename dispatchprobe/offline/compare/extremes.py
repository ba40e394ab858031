"""An activation's own difference measured on the recorded statistics: its output's largest (and
smallest) value is the activation of its input's, so the op can be re-run in float64 on each run's
recorded input extremes, as :mod:`.rerun` re-runs an op on saved tensors.

Why: runs in other precisions differ at every op by the lower precision's rounding, and on
statistics alone a stretch of ops may grow that by several roundings (``origin.ROUNDINGS``), which
hides a kernel a few percent off (a relu 5 % off within 16 bfloat16 roundings).  At the extremes
the op hands its input's difference on exactly (``relu``) or with one rounding of its own (``gelu``,
``silu``, ``sigmoid``, ``tanh``): what the recorded output extremes differ by beyond that is the
kernel's own, whatever the inputs differ by.  Only a finding counts: extremes that agree say
nothing of the values between them (a kernel wrong for negative inputs only), which the rest of the
lineage still judges.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

from ...core.op_traits import base_name
from .rerun import ROUNDOFF

TRANSCENDENTAL = 1e-5   # a float32 kernel's approximation of erf/exp/tanh, relative (far below bfloat16's rounding)


def _gelu(x: float, approximate: str) -> float:
    if approximate == "tanh":
        return 0.5 * x * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1.0 + math.erf(x / math.sqrt(2.0)))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


class Monotone(NamedTuple):
    """An activation whose output extremes are ``f`` of its input's: the largest always, where its
    input's largest is at least ``from_max`` (gelu and silu rise from their minimum on, and are
    negative below 0 only); the smallest too where ``min_too`` (``f`` rises everywhere)."""

    f: Callable[[float, str], float]
    min_too: bool
    rounds: bool           # the kernel rounds its result once (relu picks values: exact)
    from_max: float = -math.inf


ACTIVATIONS = {
    "relu": Monotone(lambda x, _: max(x, 0.0), True, False),
    "gelu": Monotone(_gelu, False, True, 0.0),
    "silu": Monotone(lambda x, _: x * _sigmoid(x), False, True, 0.0),
    "sigmoid": Monotone(lambda x, _: _sigmoid(x), True, True),
    "tanh": Monotone(lambda x, _: math.tanh(x), True, True),
}


def activation(op: str) -> Monotone | None:
    """The :class:`Monotone` activation ``op`` computes (its in-place form too), or None."""
    return ACTIVATIONS.get(base_name(op).rstrip("_"))


def _approximate(record: dict) -> str:
    """gelu's ``approximate`` argument as recorded ("none" where not given)."""
    spec = (record.get("kwargs") or {}).get("approximate")
    value = spec.get("value") if isinstance(spec, dict) else spec
    return value if isinstance(value, str) else "none"


def _reference(act: Monotone, extreme: str, x: float, approximate: str) -> float | None:
    """``f`` of one input extreme where the output's same extreme is ``f`` of it, else None."""
    if not math.isfinite(x) or (extreme == "min" and not act.min_too) or (extreme == "max" and x < act.from_max):
        return None
    return act.f(x, approximate)


def own_difference(rec_a: dict, rec_b: dict, extremes_in: tuple, extremes_out: tuple, dtypes: tuple) -> bool | None:
    """Whether an activation's output extremes differ by more than its input extremes carry through
    it, plus each run's rounding: True, a kernel's own difference; False, none at the extremes;
    None where the op is no :class:`Monotone` activation in both runs or no extreme applies.
    ``extremes_in``/``extremes_out``: ``{"max": (a, b), "min": (a, b)}`` of the input and output
    rows, ``dtypes``: the output's in each run.  As :mod:`.rerun` measures: the output's difference
    less the references' difference, against the smaller of the runs' deviations from their
    reference (a kernel's approximation, which both runs' kernels share) and both runs' unit
    roundoffs, at the size of the values (both runs': the same whichever run is A)."""
    act = activation(rec_a["op"])
    if act is None or activation(rec_b["op"]) is not act:
        return None
    modes = (_approximate(rec_a), _approximate(rec_b))
    allowance = 2 * sum(ROUNDOFF.get(d, ROUNDOFF["float32"]) for d in dtypes) + (TRANSCENDENTAL if act.rounds else 0.0)
    decided = None
    for extreme in ("max", "min"):
        xs, ys = extremes_in.get(extreme), extremes_out.get(extreme)
        if xs is None or ys is None or not all(math.isfinite(v) for v in ys):
            continue
        refs = [_reference(act, extreme, x, mode) for x, mode in zip(xs, modes)]
        if None in refs:
            continue
        scale = max(*(abs(v) for v in (*refs, *ys)), 1e-300)
        dev_a, dev_b = ys[0] - refs[0], ys[1] - refs[1]
        own = abs(dev_a - dev_b) / scale
        rounding = min(abs(dev_a), abs(dev_b)) / scale
        if own > 4 * rounding + allowance:
            return True
        decided = False
    return decided
