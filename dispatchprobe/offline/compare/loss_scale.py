"""Loss scaling: a run that multiplies its loss by a scale before backward (fp16 AMP's
``torch.amp.GradScaler``) makes every gradient that scale times the other run's.

Those values differ by a power of two, exactly, and no kernel made the difference: compared as
they are, the scaled run's backward would be one long divergence starting at the multiply.  So,
where the runs' scales differ, the run with the larger scale has its gradient values divided by
the ratio of the scales (a power of two: exact) before anything reads them (alignment, scoring,
lineage), and those rows say so in their reason.  Which values carry the scale is read from the
data flow: the scaled loss, the backward seed times the scale, and every value the backward
computes from them; forward values the backward reads (saved tensors) do not carry it.  The
scaler's own state (the scale, its reciprocal, the scale update) differs by choice, not by
computation: not judged.  A value computed after backward from scaled gradients other than by
the scaler's unscale (gradient clipping before ``unscale_``) need not scale linearly: not judged
either.  Where a scaled run's backward seed does not reach its ops through the multiply by the
scale, which values carry it cannot be told: its whole backward is not judged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from ...core import op_traits
from ...records.format import walk as _walk
from ...standards.verdicts import NOT_JUDGED
from .pairing import data_flow

SCALED, STATE, UNDECIDED = "scaled", "state", "undecided"
LOSS_SCALING = "loss scaling: "     # how the reasons of what it leaves not judged (and explains) begin
_SCALER_OPS = (op_traits.LOSS_SCALE_CHECK, op_traits.LOSS_SCALE_UPDATE)
_SEED = "aten.ones_like.default"          # autograd's seed of backward() (torch.ones_like of the loss)
_WATCHED = frozenset({_SEED, "aten.mul.Tensor"})


@dataclass
class Seed:
    """Where one run scales its loss: the forward multiply (record index), the scale's value and
    its spec, and the backward seed (``ones_like``) made from the scaled loss."""

    mul: int
    scale: float
    scale_spec: int
    seed: int


@dataclass
class LossScale:
    """What :func:`unscaled` found: each run's loss scale (1 where it has none), the run whose
    gradient values were divided (``divided``) and by what (``ratio``), and the marks the table
    and the unmatched records take."""

    scales: dict
    divided: str
    ratio: float
    unscaled: set = field(default_factory=set)       # ids of the divided copies of specs
    not_judged: dict = field(default_factory=dict)   # spec id -> reason (either run)
    machinery: set = field(default_factory=set)      # ids of the scalers' own records (either run)
    whole_backward: str = ""                         # set where the scaled values cannot be told
    keys: set = field(default_factory=set)           # saved tensors (task tensor) of the divided values

    def parts(self, part_a, part_b) -> tuple:
        """The parts as scoring reads their saved tensors: the divided run's scaled ones unscaled."""
        if not self.keys:
            return part_a, part_b
        if self.divided == "a":
            return UnscaledPart(part_a, self.keys, self.ratio), part_b
        return part_a, UnscaledPart(part_b, self.keys, self.ratio)

    def said(self) -> str:
        """``run B's loss scale 65536`` (and run A's where it has one)."""
        parts = [f"run {s.upper()}'s loss scale {_number(self.scales[s])}" for s in "ab" if self.scales[s] != 1.0]
        return ", ".join(parts)

    def note(self) -> str:
        return f"compared unscaled: {self.said()}"

    def not_judged_line(self) -> str:
        """The verdict's line where the scaled values could not be told apart."""
        big = self.divided.upper()
        small = "B" if big == "A" else "A"
        other = f"run {small} by {_number(self.scales[small.lower()])}" if self.scales[small.lower()] != 1.0 else \
            f"run {small} does not"
        return (f"backward: not judged: run {big} multiplies its loss by {_number(self.scales[self.divided])} (a loss "
                f"scaler such as torch.amp.GradScaler) and {other}, and which of its backward values carry the scale "
                f"cannot be told from its records; compare runs scaled alike")

    def explains(self, rec: dict) -> bool:
        """Whether one-run-only record ``rec`` is a loss scaler's own (making, applying or updating the scale)."""
        return id(rec) in self.machinery

    def explanation(self, side: str) -> str:
        return f"{LOSS_SCALING}{self.said()} (the scaler's own op)"

    def judge(self, df: pd.DataFrame, arrays: dict | None = None) -> pd.DataFrame:
        """The scored table with the divided rows' reason saying so, and the rows comparing the
        scalers' state or values that need not scale linearly not judged (``arrays``: the table's
        columns as :func:`.scoring.score_pairs` gave them, kept the same)."""
        if not len(df):
            return df
        spec_a, spec_b = df["spec_a"].to_numpy(np.int64), df["spec_b"].to_numpy(np.int64)
        status, reason = df["status"].to_numpy(object).copy(), df["reason"].to_numpy(object).copy()
        if self.whole_backward:
            off = df["stage"].to_numpy(object) == "backward"
            status[off], reason[off] = NOT_JUDGED, LOSS_SCALING + self.whole_backward
        divided = np.isin(spec_a if self.divided == "a" else spec_b, np.fromiter(self.unscaled, np.int64))
        note = self.note()
        for k in np.flatnonzero(divided & (status != NOT_JUDGED)).tolist():
            reason[k] = f"{reason[k]}; {note}" if reason[k] else note
        for k, (x, y) in enumerate(zip(spec_a.tolist(), spec_b.tolist()) if self.not_judged else ()):
            why = self.not_judged.get(x) or self.not_judged.get(y)
            if why:
                status[k], reason[k] = NOT_JUDGED, why
        df["status"], df["reason"] = status, reason
        if arrays:
            arrays["status"], arrays["reason"] = df["status"].to_numpy(), df["reason"].to_numpy()
        return df


def not_judged(table: pd.DataFrame) -> int:
    """How many rows of the whole table the loss scaling left not judged."""
    if not len(table):
        return 0
    return int(((table["status"] == NOT_JUDGED) & table["reason"].astype(str).str.startswith(LOSS_SCALING)).sum())


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def _value(spec: dict) -> float | None:
    """The value of a 0-dim float tensor from its statistics, else None."""
    if spec.get("shape") != [] or not str(spec.get("dtype", "")).startswith(("float", "bfloat")):
        return None
    st = spec.get("stats") or {}
    hi, lo = st.get("max"), st.get("min")
    return float(hi) if hi is not None and hi == lo else None


def _power_of_two(x: float | None) -> bool:
    if x is None or not math.isfinite(x) or x < 2:
        return False
    mantissa, _ = math.frexp(x)
    return mantissa == 0.5


def _candidate(recs: list) -> bool:
    """A cheap look before the data flow: a forward multiply of two 0-dim tensors, one a power of
    two of at least 2, and a backward seed (one name test per record: this runs on every part)."""
    seeds = mul = False
    for r in recs:
        op = r["op"]
        if op not in _WATCHED or r["stage"] != "forward":
            continue
        if op == _SEED:
            seeds = True
        elif not mul:
            mul = any(_power_of_two(_value(s)) for s in r.get("inputs", ()) if s.get("type") == "tensor")
        if seeds and mul:
            return True
    return False


def find_seeds(recs: list, flow) -> list:
    """Each backward seed made from a loss multiplied by a loss scale: the forward ``ones_like``
    whose input an ``aten.mul.Tensor`` of two 0-dim float tensors made, one of them a power of two
    of at least 2 that no forward computation made (read as state, or made by ``aten.full``)."""
    out = []
    for u, r in enumerate(recs):
        if r["op"] != _SEED or r["stage"] != "forward":
            continue
        ins = [spec for io, _, spec in flow.walks[u] if io == "input"]
        src = flow.src.get(id(ins[0])) if ins else None
        if src is None or recs[src[0]]["op"] != "aten.mul.Tensor" or recs[src[0]]["stage"] != "forward":
            continue
        m = src[0]
        operands = [spec for io, _, spec in flow.walks[m] if io == "input"]
        if len(operands) != 2 or any(_value(s) is None for s in operands):
            continue
        scales = [s for s in operands if _power_of_two(_value(s)) and _made_as_state(recs, flow, s)]
        if len(scales) == 1:
            out.append(Seed(m, _value(scales[0]), id(scales[0]), u))
    return out


def _made_as_state(recs: list, flow, spec: dict) -> bool:
    src = flow.src.get(id(spec))
    return src is None or op_traits.base_name(recs[src[0]]["op"]) == "full"


class _Marks:
    """Per value (spec id) of one run, what it carries: the scale (``SCALED``), the scaler's
    state (``STATE``), or something not known to scale linearly (``UNDECIDED``); the scaler's own
    records (indices); ``complete``: every backward use of each seed is the multiply by the scale."""

    def __init__(self, recs: list, flow, seeds: list):
        self.kind: dict = {}
        self.machinery: set = set()
        self.complete = True
        self._out: dict = {}          # (record, output arg) -> kind
        muls, made_seed = {s.mul for s in seeds}, {s.seed for s in seeds}
        self._scales = {s.scale for s in seeds}
        for s in seeds:
            self.kind[s.scale_spec] = STATE
            src = flow.src.get(s.scale_spec)
            if src is not None:       # aten.full at the scaler's first use
                self.machinery.add(src[0])
                self._out[src] = STATE
                self.kind.update((id(spec), STATE) for io, arg, spec in flow.walks[src[0]]
                                 if io == "output" and arg == src[1])
                self._growth_tracker(recs, flow, src[0])
        for u, r in enumerate(recs):
            if r["kind"] != "op":
                continue
            kinds, reads_seed = self._inputs(flow, flow.walks[u], made_seed, r["stage"] == "backward")
            kind = self._made(u, r, kinds, reads_seed, muls)
            if kind is not None:
                for io, arg, spec in flow.walks[u]:
                    if io == "output":
                        self._out[u, arg] = self.kind[id(spec)] = kind
        self._scaler_only(recs, flow)

    def _growth_tracker(self, recs: list, flow, made_scale: int) -> None:
        """GradScaler makes its growth tracker (``aten.full`` of an int32 zero) beside the scale;
        no record reads it where the scale update runs outside the probe: the scaler's own."""
        read = {p[0] for walk in flow.walks for io, _, spec in walk
                if io == "input" and (p := flow.src.get(id(spec))) is not None}
        for u in (made_scale - 1, made_scale + 1):
            if 0 <= u < len(recs) and op_traits.base_name(recs[u]["op"]) == "full" and u not in read:
                self.machinery.add(u)

    def _inputs(self, flow, walk: list, made_seed: set, backward: bool) -> tuple:
        """The kinds of a record's inputs (marked as read), and whether it reads a backward seed.
        A 0-dim value equal to the scale is the scaler's state where no record made it, and
        outside backward always: the data flow, which finds producers by value, takes it for the
        scaled seed (1 times the scale), which only backward reads."""
        kinds, reads_seed = set(), False
        for io, _, spec in walk:
            if io != "input":
                continue
            src = flow.src.get(id(spec))
            kind = STATE if (src is None or not backward) and _value(spec) in self._scales else \
                self._out.get(src) if src is not None else None
            if kind is not None:
                self.kind[id(spec)] = kind
                kinds.add(kind)
            reads_seed |= src is not None and src[0] in made_seed
        return kinds, reads_seed

    def _made(self, u: int, r: dict, kinds: set, reads_seed: bool, muls: set) -> str | None:
        """What record ``u``'s outputs carry, given what its inputs do."""
        if u in muls:                                     # the loss times the scale
            self.machinery.add(u)
            return SCALED
        if reads_seed and r["stage"] == "backward":       # the seed times the scale (MulBackward0)
            twin = r["op"] == "aten.mul.Tensor" and STATE in kinds
            self.complete &= twin
            if twin:
                self.machinery.add(u)
            return SCALED if twin else UNDECIDED
        if op_traits.base_name(r["op"]) in _SCALER_OPS:  # unscale (in place, read anew after it), update
            self.machinery.add(u)
            return STATE
        if STATE in kinds:                                # the scale's reciprocal, a copy of it
            self.machinery.add(u)
            return STATE
        if not kinds & {SCALED, UNDECIDED} or op_traits.reads_metadata_only(r["op"]):
            return None
        # autograd's backward is linear in the gradient; code after it (clipping before unscale_) need not be
        return SCALED if r["stage"] == "backward" and UNDECIDED not in kinds else UNDECIDED

    def _scaler_only(self, recs: list, flow) -> None:
        """Records only the scaler reads (the zero ``found_inf`` and its copy, which its unscale
        fills; an ``.item()`` of it, making no tensor, aside) and records reading only the
        scaler's values.  Never a record reading a scaled value, nor one whose output is scaled
        next (the loss): a one-run-only op there (a hook) stays a suspect."""
        users: dict = {}
        makes_tensor = [any(io == "output" for io, _, _ in walk) for walk in flow.walks]
        for u, walk in enumerate(flow.walks):
            for io, _, spec in walk:
                if io == "input" and (p := flow.src.get(id(spec))) is not None:
                    users.setdefault(p[0], set()).add(u)
        scaled_makers = {u for (u, _), kind in self._out.items() if kind == SCALED}
        for u in range(len(recs) - 1, -1, -1):
            got = users.get(u)
            if got and recs[u]["kind"] == "op" and not self._reads_scaled(flow.walks[u]) and \
                    any(v in self.machinery for v in got) and \
                    all(v in self.machinery and v not in scaled_makers or not makes_tensor[v] for v in got):
                self.machinery.add(u)
        for u, walk in enumerate(flow.walks):
            srcs = [flow.src.get(id(spec)) for io, _, spec in walk if io == "input"]
            if recs[u]["kind"] == "op" and srcs and all(p is not None and p[0] in self.machinery for p in srcs) \
                    and not self._reads_scaled(walk):
                self.machinery.add(u)

    def _reads_scaled(self, walk: list) -> bool:
        return any(io == "input" and self.kind.get(id(spec)) in (SCALED, UNDECIDED) for io, _, spec in walk)


def unscaled(recs_a: list, recs_b: list) -> tuple:
    """``(records of A, records of B, LossScale or None)``: where the runs' loss scales differ,
    the run with the larger one has the statistics of the values carrying its scale divided by
    the ratio (copies of those specs and their records; the parsed records stay as they are).
    None where neither run scales its loss or both scale it alike (nothing changes)."""
    found = {}
    for side, recs in (("a", recs_a), ("b", recs_b)):
        flow = data_flow(recs) if _candidate(recs) else None
        found[side] = (find_seeds(recs, flow) if flow is not None else [], flow)
    scales = {side: {s.scale for s in seeds} for side, (seeds, _) in found.items()}
    one = {side: max(got, default=1.0) for side, got in scales.items()}
    several = any(len(got) > 1 for got in scales.values())    # rescaled between two backwards of a step
    if one["a"] == one["b"] and not several:
        return recs_a, recs_b, None
    divided = "a" if one["a"] > one["b"] else "b"
    ls = LossScale(one, divided, max(one.values()) / min(one.values()))
    marks = {side: _Marks(recs, found[side][1], found[side][0]) if found[side][0] else None
             for side, recs in (("a", recs_a), ("b", recs_b))}
    out = {"a": recs_a, "b": recs_b}
    if several or not marks[divided].complete:
        ls.whole_backward = ls.not_judged_line()
    else:
        out[divided] = _divide(out[divided], marks[divided], ls)
    for side, m in marks.items():
        if m is not None:
            ls.machinery.update(id(out[side][u]) for u in m.machinery)
            ls.not_judged.update(_not_judged(m, ls))
    return out["a"], out["b"], ls


def _not_judged(marks: _Marks, ls: LossScale) -> dict:
    """spec id -> reason, for the values of one run compare does not judge: the scaler's state,
    and values computed from scaled gradients that need not scale with them."""
    state = f"{LOSS_SCALING}the scaler's state ({ls.said()}): the runs scale differently"
    undecided = (f"{LOSS_SCALING}computed from scaled gradients other than by the scaler ({ls.said()}): need not "
                 f"scale with it; compare runs scaled alike")
    return {spec_id: state if kind == STATE else undecided for spec_id, kind in marks.kind.items()
            if kind in (STATE, UNDECIDED)}


def _divide(recs: list, marks: _Marks, ls: LossScale) -> list:
    """``recs`` with each value marked ``SCALED`` in a copy whose statistics are divided by
    ``ls.ratio`` (checksums, of the scaled bytes, left out); the copies' ids go to ``ls.unscaled``."""
    copies: dict = {}
    for spec_id, kind in marks.kind.items():
        if kind == SCALED:
            copies[spec_id] = None
    if not copies:
        return recs

    def copied(x):
        if isinstance(x, dict):
            if id(x) in copies:
                got = copies[id(x)]
                if got is None:
                    got = copies[id(x)] = _divided_spec(x, ls.ratio)
                    ls.unscaled.add(id(got))
                return got
            if x.get("type") in ("list", "tuple") and isinstance(x.get("value"), list):
                new = [copied(v) for v in x["value"]]
                return x if all(n is v for n, v in zip(new, x["value"])) else {**x, "value": new}
            return x
        if isinstance(x, list):
            new = [copied(v) for v in x]
            return x if all(n is v for n, v in zip(new, x)) else new
        return x

    out = []
    for r in recs:
        new = {key: copied(r[key]) for key in ("inputs", "outputs", "kwargs") if key in r}
        out.append({**r, **new} if any(new[k] is not r[k] for k in new) else r)
    ls.keys = {spec["data"] for spec in copies.values() if spec is not None and spec.get("data") is not None}
    # a saved tensor a value carrying no scale shares (content saved once) cannot be read both ways
    shared = {spec.get("data") for rec in recs for _, _, spec in _walk(rec) if id(spec) not in copies} & ls.keys \
        if ls.keys else set()
    for spec in copies.values():
        if spec is not None and spec.get("data") in shared:
            ls.not_judged[id(spec)] = f"{LOSS_SCALING}its saved tensor is also a value the scale does not reach ({ls.said()})"
    ls.keys -= shared
    return out


def _divided_spec(spec: dict, ratio: float) -> dict:
    stats = dict(spec.get("stats") or {})
    for key in ("max", "min", "mean", "norm", "finite_max", "finite_min"):
        if isinstance(stats.get(key), (int, float)):
            stats[key] = stats[key] / ratio
    out = {**spec, "stats": stats}
    out.pop("checksum", None)
    return out


class UnscaledPart:
    """A part whose saved tensors under ``keys`` read divided by ``ratio`` (in at least float32:
    a float16 gradient divided by 65536 in float16 would lose its low bits), the rest as saved."""

    def __init__(self, part, keys: set, ratio: float):
        self._part, self._keys, self._ratio = part, keys, ratio

    def __getattr__(self, name):
        return getattr(self._part, name)

    def _unscaled(self, key, x):
        if key not in self._keys or x is None or x.dtype.kind not in "fc":
            return x
        return x.astype(np.promote_types(x.dtype, np.float32)) / self._ratio

    def tensors_of(self, keys) -> dict:
        return {k: self._unscaled(k, x) for k, x in self._part.tensors_of(keys).items()}

    def tensor(self, key):
        return self._unscaled(key, self._part.tensor(key))


def parameter_gradient_scale(part) -> float:
    """The loss scale a part's parameter gradient records (``params.jsonl``) carry: its scale where
    its records hold no unscale by the scaler (the gradients were recorded as backward left them,
    at the probe's exit), else 1 (the optimizer's step hook, which records them, runs after it)."""
    recs = part.records
    if not _candidate(recs):
        return 1.0
    scales = {s.scale for s in find_seeds(recs, data_flow(recs))}
    if len(scales) != 1 or any(r["kind"] == "op" and op_traits.base_name(r["op"]) == op_traits.LOSS_SCALE_CHECK
                               for r in recs):
        return 1.0
    return scales.pop()


def gradients_alike(grad_a, grad_b, part_a, part_b) -> tuple:
    """One parameter's gradients as the two parts recorded them (:class:`.parallel.Value`), the one
    carrying the larger loss scale divided by the ratio of the scales (see
    :func:`parameter_gradient_scale`)."""
    sa, sb = parameter_gradient_scale(part_a), parameter_gradient_scale(part_b)
    if sa == sb:
        return grad_a, grad_b
    ratio = max(sa, sb) / min(sa, sb)
    return (_divided_value(grad_a, ratio), grad_b) if sa > sb else (grad_a, _divided_value(grad_b, ratio))


def _divided_value(value, ratio: float):
    array = value.array
    if array is not None and array.dtype.kind in "fc":
        array = array.astype(np.promote_types(array.dtype, np.float32)) / ratio
    stats = _divided_spec({"stats": value.stats}, ratio)["stats"] if value.stats else value.stats
    return replace(value, stats=stats, array=array)
