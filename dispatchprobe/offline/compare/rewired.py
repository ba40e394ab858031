"""Inputs the two programs wire differently: a paired op whose outputs agree, reading in each run
values that are no counterparts of each other.

Two versions of a library may build one value in other ways: ``where(mask, 0, -inf)`` in one run,
``where(logical_not(mask), -inf, 0)`` in the other.  The op pairs, its output agrees, and its
input rows compare the mask with its negation and ``0`` with ``-inf``: they differ, yet no value
of either run is wrong, and nothing computed after the op differs.  Such a row says how the
programs are written, not how a kernel computes, so it is not judged, where every value it
compares is accounted for: made by a paired record whose own output row passes, a constant, or
a cast or a mask (discrete values) one run alone makes of such values, or, made by no record,
read by the other run's paired op too (swapped branches); and the two are no counterparts (one
value, copied by one run's casts, stays judged).  A value a paired record makes
wrongly keeps its error row (its own output row fails), and so keeps the op that made it named.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ...core import op_traits
from ...standards import verdicts as V
from ...standards.loader import is_float

REWIRED = ("an input the two programs build otherwise: each run reads values that agree or are constants "
           "(paired with other calls, or made by ops of one run only), and this op's outputs agree, so "
           "the difference is in how the programs are written, not in any value they compute")


def rewired_inputs_not_judged(df: pd.DataFrame, a, b, pair_b: dict, makes_constant) -> None:
    """Marks in ``df`` (a part's compare rows) ``not judged`` the differing input rows of paired ops
    whose outputs all pass, where the two runs read no counterparts and both runs' producers of that
    input are accounted for (see the module).  ``a``, ``b``: the runs (``origin.Side``); ``pair_b``: A's record -> B's;
    ``makes_constant(side, i)``: record ``i`` reads no tensor's values."""
    if not len(df):
        return
    status = df["status"].to_numpy(object)
    is_in = (df["io"] == "input").to_numpy()
    suspect = is_in & ((status == V.ERROR) | (status == V.WARNING))
    if not suspect.any():
        return
    uid = df["uid"].to_numpy(np.int64)
    args = df["arg"].to_numpy(object)
    out_status: dict = {}     # (A's record, output arg) -> status of its row
    for k in np.flatnonzero(~is_in).tolist():
        out_status[int(uid[k]), args[k]] = status[k]
    outputs_pass = _outputs_pass(out_status)
    pair_a = {j: i for i, j in pair_b.items()}
    agrees = _Accounted(out_status, a, b, pair_a, makes_constant)
    spec_a, spec_b = df["spec_a"].to_numpy(object), df["spec_b"].to_numpy(object)
    rows = []
    for k in np.flatnonzero(suspect).tolist():
        if not outputs_pass.get(int(uid[k])):
            continue
        i = int(uid[k])
        src_a, src_b = a.flow.src.get(spec_a[k]), b.flow.src.get(spec_b[k])
        if _counterparts(a, b, src_a, src_b, pair_b):
            continue
        if (agrees(a, src_a) if src_a is not None else _read_by_both(a, i, b, pair_b[i], spec_a[k])) and \
                (agrees(b, src_b) if src_b is not None else _read_by_both(b, pair_b[i], a, i, spec_b[k])):
            rows.append(k)
    if rows:
        df.loc[rows, "status"] = V.NOT_JUDGED
        df.loc[rows, "reason"] = REWIRED


def _read_by_both(side, index: int, other, other_index: int, spec_id: int) -> bool:
    """Whether a value no record of ``side`` made (a tensor from outside the recorded code), read by
    its record ``index``, is read as well by the other run's paired record, at another argument:
    one dtype, shape and statistics (``where``'s branches swapped pass the same two tensors)."""
    read = next((spec for io, _, spec in side.flow.walks[index] if io == "input" and id(spec) == spec_id), None)
    if read is None or not read.get("stats"):
        return False
    return any(io == "input" and _same_value(read, spec) for io, _, spec in other.flow.walks[other_index])


def _same_value(sa: dict, sb: dict) -> bool:
    return sa.get("dtype") == sb.get("dtype") and list(sa.get("shape") or ()) == list(sb.get("shape") or ()) \
        and sa.get("stats") == sb.get("stats")


def _counterparts(a, b, src_a, src_b, pair_b: dict) -> bool:
    """Whether the two runs read one value: made by a pair of records, through casts of one run only
    (a bfloat16 run's copy of it).  Such a row compares counterparts, and its difference is judged
    (a precision the runs differ in, a kernel's error) however the op's outputs come out."""
    src_a, src_b = _uncast(a, src_a), _uncast(b, src_b)
    return src_a is not None and src_b is not None and src_a[1] == src_b[1] and pair_b.get(src_a[0]) == src_b[0]


def _uncast(side, src):
    """The value a one-run-only cast (or chain of them) copies, else ``src`` itself."""
    while src is not None and src[0] in side.only and op_traits.is_cast(side.recs[src[0]]["op"]):
        read = [spec for io, _, spec in side.flow.walks[src[0]] if io == "input"]
        if len(read) != 1:
            break
        src = side.flow.src.get(id(read[0]))
    return src


def _outputs_pass(out_status: dict) -> dict:
    """A's record -> whether it has output rows and every one of them passes."""
    out: dict = {}
    for (i, _), st in out_status.items():
        out[i] = out.get(i, True) and st == V.PASS
    return out


class _Accounted:
    """Whether a value one run reads is accounted for: made by a paired record whose output row for
    it passes, by a constant maker, or by an op of one run only whose every input is accounted for
    and that is a cast or makes discrete values alone (``logical_not`` of a mask that agrees: a
    mask or an index carries no rounding; its encoding is the program's).  An op of one run only
    making floats (a gradient hook's ``mul``) is not: it may add a difference of its own, which
    stays judged.  Nor is a value no record made (a parameter, the batch): it may differ between
    the runs for reasons the records cannot see."""

    def __init__(self, out_status: dict, a, b, pair_a: dict, makes_constant):
        self.out_status, self.a, self.pair_a, self.makes_constant = out_status, a, pair_a, makes_constant
        self.seen: dict = {}

    def __call__(self, side, src) -> bool:
        if src is None:
            return False
        key = (side.name, src)
        if key not in self.seen:
            self.seen[key] = False        # (the data flow runs forward: no record reads itself)
            self.seen[key] = self._accounted(side, *src)
        return self.seen[key]

    def _accounted(self, side, index: int, arg: str) -> bool:
        if index in side.only:
            if side.recs[index]["kind"] != "op":
                return False
            if self.makes_constant(side, index):
                return True
            if not op_traits.is_cast(side.recs[index]["op"]) and any(
                    is_float(spec.get("dtype", "")) for io, _, spec in side.flow.walks[index] if io == "output"):
                return False
            return all(self(side, side.flow.src.get(id(spec)))
                       for io, _, spec in side.flow.walks[index] if io == "input")
        i = index if side is self.a else self.pair_a.get(index)
        return i is not None and self.out_status.get((i, arg)) == V.PASS
