"""Where a record's inf/nan came from, read from the record alone (its tensors' statistics and its
number arguments): ``made`` from finite values by the op (what to look at), written from an inf/nan
``constant`` (``masked_fill(mask, -inf)``: a causal mask, intended), or ``carried`` from a tensor
input.  One classification for ``dispatchprobe show`` and the report pages' nan/inf badges."""

from __future__ import annotations

import numpy as np

from .format import walk

MADE, CONSTANT, CARRIED = "made", "constant", "carried"


def origin(record: dict, ops_recorded: bool = False) -> str:
    """How the inf/nan in ``record``'s outputs came about (meaningful when an output holds any):
    CARRIED when a tensor argument holds inf/nan, else CONSTANT when a number argument is one, else MADE.
    ``ops_recorded``: the run recorded the ops within modules too (level mix), so a module call's inf/nan
    made within it is CARRIED from the op that made it (that op is the one to look at)."""
    leaves = [spec for _, _, spec in walk(record, outputs=False, tensors_only=False)]
    if any(spec.get("type") == "tensor" and _nonfinite_tensor(spec) for spec in leaves):
        return CARRIED
    if any(spec.get("type") != "tensor" and _nonfinite_number(spec) for spec in leaves):
        return CONSTANT
    return CARRIED if ops_recorded and record.get("kind") == "module" else MADE


def made(record: dict, ops_recorded: bool = False) -> bool:
    """Whether the op (or module: see origin) made inf/nan from finite values: an output holds some, no
    argument does."""
    return any(_nonfinite_tensor(spec) for _, _, spec in walk(record, inputs=False)) \
        and origin(record, ops_recorded) == MADE


def _nonfinite_tensor(spec: dict) -> bool:
    stats = spec.get("stats") or {}
    return bool(stats.get("nan") or stats.get("inf"))


def _nonfinite_number(spec: dict) -> bool:
    """A number argument that is inf/nan (``-inf``, ``nan``; written as strings in the records)."""
    value = spec.get("value")
    try:
        return isinstance(value, (int, float, str)) and not isinstance(value, bool) and not np.isfinite(float(value))
    except (TypeError, ValueError):
        return False
