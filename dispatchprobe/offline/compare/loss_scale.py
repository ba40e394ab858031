"""Loss scaling: a run that multiplies its loss by a scale before backward (fp16 AMP's
``torch.amp.GradScaler``, DeepSpeed's and Megatron's loss scalers, MindSpore's ``amp`` scalers)
makes every gradient that scale times the other run's.

Those values differ by a power of two, exactly, and no kernel made the difference: compared as
they are, the scaled run's backward would be one long divergence starting at the multiply.  So,
where the runs' scales differ, the run with the larger scale has its gradient values divided by
the ratio of the scales (a power of two: exact) before anything reads them (alignment, scoring,
lineage), and those rows say so in their reason.  A run scales its loss in one of two forms the
records show.  Multiplied: a forward multiply of the 0-dim loss by a constant (a 0-dim tensor no
computation made, or a Python number), whose product the backward seed (``ones_like``) is made
from, and backward's multiply of the seed by it.  Given: backward's seed is itself the scale
(``loss.backward(torch.tensor(1024.))``; MindSpore's scaler, whose multiply runs in a graph no
record shows): the first value a backward pass reads that it did not compute and no forward
record read is a constant other than 1.  Which values carry the scale is read from the data flow:
the scaled loss, the scaled seed and every value the backward computes from them; forward values
the backward reads (saved tensors) do not carry it.  The scaler's own state (the scale, its
reciprocal, the scale update) differs by choice, not by computation: not judged.  A value computed
after backward from scaled gradients other than by the scaler's unscale (gradient clipping before
``unscale_``) need not scale linearly: not judged either.  Where a scaled run's backward cannot be
told apart soundly (a scale that is no power of two, whose division would round; the seed reaching
the ops other than through the multiply by the scale; two scales in one step), its whole backward
is not judged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from ...core import op_traits
from ...records.format import walk as _walk
from ...standards.rounding import LARGEST
from ...standards.verdicts import NOT_JUDGED
from .pairing import data_flow

SCALED, STATE, UNDECIDED, UNTRACED = "scaled", "state", "undecided", "untraced"
_UNKNOWN = frozenset({UNDECIDED, UNTRACED})     # not known to carry the scale: not judged
LOSS_SCALING = "loss scaling: "     # how the reasons of what it leaves not judged (and explains) begin
_SCALER_OPS = (op_traits.LOSS_SCALE_CHECK, op_traits.LOSS_SCALE_UPDATE)
_SEED_OF_LOSS = frozenset({"ones_like", "OnesLike"})   # autograd's seed made from the loss (torch.ones_like)
_MULTIPLY = frozenset({"mul", "Mul", "Muls"})            # torch's and MindSpore's, by a tensor or a number
_NUMBER = ("float", "int")
_LEAST_SCALE = 2.0        # loss scalers scale up; a loss halved or weighted below 2 is the model's own


@dataclass
class Seed:
    """Where one run scales its loss.  Multiplied: the forward multiply (record index ``mul``) of
    the loss by the scale (a 0-dim tensor's spec id ``scale_spec``, None for a Python number), and
    the backward seed (``ones_like``, ``seed``) made from the product.  Given: backward's seed is
    the scale itself; ``given`` is the spec id of its first read (record ``reader``) and ``maker``
    the (record, output arg) that made it, None where no record did."""

    scale: float
    mul: int | None = None
    scale_spec: int | None = None
    seed: int | None = None
    given: int | None = None
    reader: int | None = None
    maker: tuple | None = None
    key: object = None                    # the given seed's saved tensor or statistics (:func:`_key`)

    @property
    def exact(self) -> bool:
        """Dividing by it loses nothing (a power of two)."""
        return _power_of_two(self.scale)


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
    overflowed: str = ""                             # set where the larger scale overflowed (:meth:`_overflowed`)
    skipped: str = ""                                # then the run whose scaler skips this step's update ("a"/"b")

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

    def _scaled_by(self) -> tuple:
        """``("run B multiplies its loss by 65536", "run A does not")``: the larger scale first."""
        big = self.divided.upper()
        small = "B" if big == "A" else "A"
        other = f"run {small} by {_number(self.scales[small.lower()])}" if self.scales[small.lower()] != 1.0 else \
            f"run {small} does not"
        return f"run {big} multiplies its loss by {_number(self.scales[self.divided])}", other

    def not_judged_line(self) -> str:
        """The verdict's line where the scaled values could not be told apart."""
        mine, other = self._scaled_by()
        return (f"backward: not judged: {mine} (a loss scaler such as torch.amp.GradScaler) and {other}, and which "
                f"of its backward values carry the scale cannot be told from its records; compare runs scaled alike")

    def inexact_line(self) -> str:
        """The verdict's line where a scale is no power of two: divided out, its gradients would round."""
        mine, other = self._scaled_by()
        return (f"backward: not judged: {mine} and {other}; the ratio of the scales is no power of two, so the "
                f"gradients divided by it round and cannot be compared as those of unscaled runs; compare runs "
                f"scaled alike")

    def explains(self, rec: dict) -> bool:
        """Whether one-run-only record ``rec`` is a loss scaler's own (making, applying or updating the
        scale) or the backward seed a run makes where the other gives backward a scaled one."""
        return id(rec) in self.machinery

    def explanation(self, side: str) -> str:
        return f"{LOSS_SCALING}{self.said()} (the scaler's own op or backward seed)"

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
        self._overflowed(df, status, reason)
        df["status"], df["reason"] = status, reason
        if arrays:
            arrays["status"], arrays["reason"] = df["status"].to_numpy(), df["reason"].to_numpy()
        return df

    def _overflowed(self, df: pd.DataFrame, status: np.ndarray, reason: np.ndarray) -> None:
        """Not judged: the divided run's scaled values holding inf or nan where the other run's are
        finite, once one of them is the scale's own overflow (the other run's largest magnitude times
        the ratio is past the largest finite value of the scaled value's dtype).  Why: a loss scaler
        starts high and lowers its scale when the scaled gradients overflow (torch.amp.GradScaler
        skips that step's update), so a float16 run's first steps may hold inf that no kernel made
        wrong, and the first op to overflow would be named.  What spreads from it (inf times 0, inf
        minus inf) is the same overflow; a wrong kernel in such a step cannot be told (not judged)."""
        mine, other = self.divided, "b" if self.divided == "a" else "a"
        scaled = np.isin(_column(df, "spec", mine).astype(np.int64), np.fromiter(self.unscaled, np.int64))
        cand = scaled & _nonfinite(df, mine) & ~_nonfinite(df, other) & (status != NOT_JUDGED)
        if not cand.any():
            return
        with np.errstate(invalid="ignore"):
            largest = np.fmax(np.abs(_column(df, "max", other).astype(float)),
                              np.abs(_column(df, "min", other).astype(float)))
        limit = np.array([LARGEST.get(d, np.inf) for d in _column(df, "dtype", mine).tolist()])
        if not (cand & (largest * self.ratio > limit)).any():
            return
        why = (f"{LOSS_SCALING}inf/nan from the loss scale overflowing ({self.said()}: the other run's values "
               f"times {_number(self.ratio)} pass the largest finite value of its dtype): a loss scaler lowers "
               f"its scale and skips such a step's update; not a kernel's fault")
        status[cand], reason[cand] = NOT_JUDGED, why
        self.skipped = mine
        self.overflowed = (f"run {mine.upper()}'s loss scale overflows in this step's backward ({self.said()}; "
                           f"{int(cand.sum())} values hold inf/nan the other run's do not, not judged): a loss "
                           f"scaler skips such a step's update, so the runs' parameters differ after it")


def not_judged(table: pd.DataFrame) -> int:
    """How many rows of the whole table the loss scaling left not judged."""
    if not len(table):
        return 0
    return int(((table["status"] == NOT_JUDGED) & table["reason"].astype(str).str.startswith(LOSS_SCALING)).sum())


def _column(df: pd.DataFrame, name: str, side: str) -> np.ndarray:
    """One run's column of the table (``side`` is "a" or "b")."""
    return df[f"{name}_{side}"].to_numpy()


def _nonfinite(df: pd.DataFrame, side: str) -> np.ndarray:
    """Rows whose value in run ``side`` holds a nan or an inf (a missing count is none)."""
    return (np.nan_to_num(_column(df, "nan", side).astype(float)) > 0) \
        | (np.nan_to_num(_column(df, "inf", side).astype(float)) > 0)


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def _constant(spec: dict) -> float | None:
    """The value of a float tensor all of whose elements are one value, from its statistics, else None."""
    if not str(spec.get("dtype", "")).startswith(("float", "bfloat")):
        return None
    st = spec.get("stats") or {}
    hi, lo = st.get("max"), st.get("min")
    return float(hi) if hi is not None and hi == lo else None


def _value(spec: dict) -> float | None:
    """The value of a 0-dim float tensor from its statistics, else None."""
    return _constant(spec) if spec.get("shape") == [] else None


def _power_of_two(x: float | None) -> bool:
    if x is None or not math.isfinite(x) or x <= 0:
        return False
    mantissa, _ = math.frexp(x)
    return mantissa == 0.5


def _scale_like(x: float | None) -> bool:
    """A value a loss scaler could have multiplied the loss by (at least 2; a power of two or not)."""
    return x is not None and math.isfinite(x) and x >= _LEAST_SCALE


def _numbers(rec: dict) -> list:
    """The Python numbers among a record's inputs (``loss * 1024.0``'s wrapped scalar)."""
    return [float(x["value"]) for x in rec.get("inputs", ())
            if isinstance(x, dict) and x.get("type") in _NUMBER and not isinstance(x.get("value"), bool)]


def _tensors(rec: dict) -> list:
    return [x for x in rec.get("inputs", ()) if isinstance(x, dict) and x.get("type") == "tensor"]


def _candidate(recs: list) -> bool:
    """A cheap look before the data flow (one name test per record: this runs on every part).
    Multiplied: a forward multiply of a 0-dim tensor by a 0-dim tensor or a number of at least 2,
    and a forward ``ones_like``.  Given: the first tensor the first record of a backward pass
    reads (the gradient, first in backward formulas; not ``nll_loss_backward``'s total weight) is
    a constant of at least 2."""
    seeds = mul = given = False
    previous = None
    for r in recs:
        stage = r["stage"]
        if r["kind"] == "op" and stage == "backward" and previous != "backward":
            given = None                 # a pass starts: look at its first record reading tensors
        if r["kind"] == "op":
            previous = stage
        if given is None and stage == "backward" and r["kind"] == "op" and _tensors(r):
            given = _scale_like(_constant(_tensors(r)[0]))
            if given:
                return True
        if stage != "forward" or r["kind"] != "op":
            continue
        name = op_traits.base_name(r["op"])
        if name in _SEED_OF_LOSS:
            seeds = True
        elif name in _MULTIPLY and not mul:
            tensors = _tensors(r)
            mul = any(_scale_like(_value(s)) for s in tensors) or \
                (len(tensors) == 1 and tensors[0].get("shape") == [] and any(map(_scale_like, _numbers(r))))
        if seeds and mul:
            return True
    return False


def find_seeds(recs: list, flow) -> list:
    """Each loss scale of one part's records (:class:`Seed`), multiplied or given."""
    return _multiplied(recs, flow) + _given(recs, flow)


def _inputs_of(flow, u: int) -> list:
    return [spec for io, _, spec in flow.walks[u] if io == "input"]


def _multiplied(recs: list, flow) -> list:
    """Each forward ``ones_like`` whose input a forward multiply of the 0-dim loss by a scale made:
    a 0-dim float tensor of at least 2 that no forward computation made (read as state, or made by
    ``aten.full``), or a Python number of at least 2."""
    out = []
    for u, r in enumerate(recs):
        if r["stage"] != "forward" or op_traits.base_name(r["op"]) not in _SEED_OF_LOSS:
            continue
        ins = _inputs_of(flow, u)
        src = flow.src.get(id(ins[0])) if ins else None
        if src is None or recs[src[0]]["stage"] != "forward" or \
                op_traits.base_name(recs[src[0]]["op"]) not in _MULTIPLY:
            continue
        found = _scale_operand(recs, flow, src[0])
        if found is not None:
            out.append(Seed(found[0], mul=src[0], scale_spec=found[1], seed=u))
    return out


def _scale_operand(recs: list, flow, m: int) -> tuple | None:
    """``(scale, spec id or None)`` of multiply ``m`` of the 0-dim loss by a scale, else None."""
    operands = _inputs_of(flow, m)
    if len(operands) == 2 and all(_value(s) is not None for s in operands):
        scales = [s for s in operands if _scale_like(_value(s)) and _made_as_state(recs, flow, s)]
        return (_value(scales[0]), id(scales[0])) if len(scales) == 1 else None
    numbers = _numbers(recs[m])
    if len(operands) == 1 and operands[0].get("shape") == [] and len(numbers) == 1 and _scale_like(numbers[0]):
        return numbers[0], None
    return None


def _made_as_state(recs: list, flow, spec: dict) -> bool:
    src = flow.src.get(id(spec))
    return src is None or op_traits.base_name(recs[src[0]]["op"]) == "full"


def _given(recs: list, flow) -> list:
    """Each backward pass's seed that is a constant of at least 2 (see :func:`seed_reads`)."""
    out = []
    for u, spec, src in seed_reads(recs, flow):
        value = _constant(spec)
        if _scale_like(value):
            out.append(Seed(value, given=id(spec), reader=u, maker=src, key=_key(spec)))
    return out


def seed_reads(recs: list, flow) -> list:
    """Per backward pass, ``(record, spec, producer or None)`` of the first value it reads that
    enters it from outside (no record of the pass computed it from other values: made before the
    pass, by a pass's record reading no tensor such as MindSpore's ``Ones``, or by no record) and
    that no forward record read (a saved tensor, a forward constant): backward's seed."""
    out, read_forward, done = [], (set(), set()), 0
    for start, end in _backward_passes(recs):
        _read_in_forward(recs, flow, done, start, read_forward)
        done = start
        got = _first_entering(recs, flow, start, end, read_forward)
        if got is not None:
            out.append(got)
    return out


def _backward_passes(recs: list) -> list:
    """``(start, end)`` of each run of backward op records no forward op record interrupts."""
    passes, start = [], None
    for u, r in enumerate(recs):
        if r["kind"] != "op":
            continue
        if r["stage"] == "backward" and start is None:
            start = u
        elif r["stage"] != "backward" and start is not None:
            passes.append((start, u))
            start = None
    if start is not None:
        passes.append((start, len(recs)))
    return passes


def _read_in_forward(recs: list, flow, start: int, before: int, read: tuple) -> tuple:
    """``read`` (producers, keys) with the producers (record, output arg) whose values the forward
    records from ``start`` to before ``before`` read, and the keys of the values they read that no
    record made.  Records after a pass (a compiled graph's kernels, which MindSpore's probe adds
    at the step's end) are no reader of a value saved for it."""
    made, unmade = read
    for u in range(start, before):
        if recs[u]["kind"] != "op" or recs[u]["stage"] != "forward":
            continue
        for spec in _inputs_of(flow, u):
            src = flow.src.get(id(spec))
            if src is None:
                unmade.add(_key(spec))
            else:
                made.add(src)
    return read


def _range(spec: dict) -> tuple:
    """A value recognised by dtype, size, maximum and minimum, which a transposed view keeps."""
    st = spec.get("stats") or {}
    return spec.get("dtype"), math.prod(spec.get("shape") or ()), st.get("max"), st.get("min")


def _forward_values(recs: list, flow) -> set:
    """:func:`_range` of every value forward records read or made."""
    return {_range(spec) for u, r in enumerate(recs) if r["kind"] == "op" and r["stage"] == "forward"
            for _, _, spec in flow.walks[u]}


def _late_makers(recs: list, flow, seed: Seed) -> list:
    """Records after a given seed's first read that make its value: the multiply of the seed by the
    scale in a compiled graph (MindSpore's ``amp`` scalers), whose kernels the probe records at the
    end of the step, after the PyNative ops that read their outputs."""
    spec = next((s for io, _, s in flow.walks[seed.reader] if id(s) == seed.given), None)
    if spec is None:
        return []
    signature = _range(spec)
    return [u for u in range(seed.reader + 1, len(recs)) if recs[u]["kind"] == "op" and
            any(io == "output" and _range(out) == signature for io, _, out in flow.walks[u])]


def _key(spec: dict):
    """A value no record made, by its saved tensor, else by dtype, shape and statistics."""
    st = spec.get("stats") or {}
    return spec.get("data") or (spec.get("dtype"), tuple(spec.get("shape") or ()), st.get("min"), st.get("max"))


def _first_entering(recs: list, flow, start: int, end: int, read_forward: tuple) -> tuple | None:
    """The first float value the pass from ``start`` to ``end`` reads from outside that the forward
    did not read (see :func:`seed_reads`), as ``(record, spec, producer)``; None where the pass
    computes from a value before reading any such (its seed then is no value of its own)."""
    made, unmade = read_forward
    for u in range(start, end):
        if recs[u]["kind"] != "op":
            continue
        computed = False
        for spec in _inputs_of(flow, u):
            src = flow.src.get(id(spec))
            if src is not None and src[0] >= start and _inputs_of(flow, src[0]):
                computed = True          # made in the pass from other values: a gradient
                continue
            if (src in made) if src is not None else (_key(spec) in unmade):
                continue                 # a saved tensor or a constant the forward read too
            if str(spec.get("dtype", "")).startswith(("float", "bfloat")):
                return u, spec, src
        if computed:
            return None                  # the pass computes from its seed already: none entered before
    return None


class _Marks:
    """Per value (spec id) of one run, what it carries: the scale (``SCALED``), the scaler's
    state (``STATE``), something not known to scale linearly (``UNDECIDED``), or a backward value
    no record made and the forward does not hold, with what backward computes from it
    (``UNTRACED``: the output of a kernel the probe cannot observe, MindSpore's ``BiasAddGrad``, a
    gradient or not); the scaler's own records (indices); ``complete``: every backward use of each
    multiplied seed is the multiply by the scale."""

    def __init__(self, recs: list, flow, seeds: list):
        self.kind: dict = {}
        self.machinery: set = set()
        self.complete = True
        self.untraced: set = set()    # spec ids of the records reading an UNTRACED value
        self._out: dict = {}          # (record, output arg) -> kind
        multiplied = [s for s in seeds if s.mul is not None]
        muls, made_seed = {s.mul for s in multiplied}, {s.seed for s in multiplied}
        self._scales = {s.scale for s in seeds}
        self._number_scales = {s.scale for s in multiplied if s.scale_spec is None}
        self._given_keys = {s.key for s in seeds if s.given is not None and s.maker is None}
        self._forward_values = _forward_values(recs, flow)
        for s in multiplied:
            if s.scale_spec is not None:
                self._scale_state(recs, flow, s.scale_spec)
        for s in seeds:
            if s.given is not None:
                self._given_seed(flow, s)
                self.machinery.update(_late_makers(recs, flow, s))
        for u, r in enumerate(recs):
            if r["kind"] != "op":
                continue
            kinds, reads_seed = self._inputs(flow, flow.walks[u], made_seed, r["stage"] == "backward")
            kind = self._made(u, r, kinds, reads_seed, muls)
            if kind is not None:
                for io, arg, spec in flow.walks[u]:
                    if io == "output":
                        self._out[u, arg] = self.kind[id(spec)] = kind
            if UNTRACED in kinds:     # paired on values it cannot unscale: none of its values is judged
                self.untraced.update(id(spec) for _, _, spec in flow.walks[u])
        self._scaler_only(recs, flow)

    def _scale_state(self, recs: list, flow, scale_spec: int) -> None:
        """A multiplied scale's tensor is the scaler's state, and so is what made it (``aten.full``)."""
        self.kind[scale_spec] = STATE
        src = flow.src.get(scale_spec)
        if src is not None:       # aten.full at the scaler's first use
            self.machinery.add(src[0])
            self._out[src] = STATE
            self.kind.update((id(spec), STATE) for io, arg, spec in flow.walks[src[0]]
                             if io == "output" and arg == src[1])
            self._growth_tracker(recs, flow, src[0])

    def _given_seed(self, flow, seed: Seed) -> None:
        """A given seed carries the scale (it is 1 times the scale), and so does what made it."""
        self.kind[seed.given] = SCALED
        if seed.maker is not None:
            self.machinery.add(seed.maker[0])
            self._out[seed.maker] = SCALED
            self.kind.update((id(spec), SCALED) for io, arg, spec in flow.walks[seed.maker[0]]
                             if io == "output" and arg == seed.maker[1])

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
        A given seed no record made carries the scale wherever backward reads it.  Another 0-dim
        value equal to a scale is the scaler's state where no record made it, and outside backward
        always: the data flow, which finds producers by value, takes it for the scaled seed (1 times
        the scale), which only backward reads.  A value backward reads that no record made and the
        forward does not hold is ``UNTRACED``."""
        kinds, reads_seed = set(), False
        for io, _, spec in walk:
            if io != "input":
                continue
            src = flow.src.get(id(spec))
            if src is None and backward and self._given_keys and _key(spec) in self._given_keys:
                kind = SCALED
            elif (src is None or not backward) and _value(spec) in self._scales:
                kind = STATE
            elif src is None:
                kind = UNTRACED if backward and self._untraced(spec) else None
            else:
                kind = self._out.get(src)
            if kind is not None:
                self.kind[id(spec)] = kind
                kinds.add(kind)
            reads_seed |= src is not None and src[0] in made_seed
        return kinds, reads_seed

    def _untraced(self, spec: dict) -> bool:
        """A float value, not one constant (a backward formula's own: pow's exponent less one), that
        no forward record read or made (a saved tensor, a parameter read transposed)."""
        return str(spec.get("dtype", "")).startswith(("float", "bfloat")) and _constant(spec) is None and \
            _range(spec) not in self._forward_values

    def _made(self, u: int, r: dict, kinds: set, reads_seed: bool, muls: set) -> str | None:
        """What record ``u``'s outputs carry, given what its inputs do."""
        if u in muls:                                     # the loss times the scale
            self.machinery.add(u)
            return SCALED
        if reads_seed and r["stage"] == "backward":       # the seed times the scale (MulBackward0)
            twin = op_traits.base_name(r["op"]) in _MULTIPLY and \
                (STATE in kinds or any(n in self._number_scales for n in _numbers(r)))
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
        if not kinds & (_UNKNOWN | {SCALED}) or op_traits.reads_metadata_only(r["op"]):
            return None
        if UNTRACED in kinds:
            return UNTRACED
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
        return any(io == "input" and self.kind.get(id(spec)) in _UNKNOWN | {SCALED} for io, _, spec in walk)


def unscaled(recs_a: list, recs_b: list, permuted: bool = False) -> tuple:
    """``(records of A, records of B, LossScale or None)``: where the runs' loss scales differ,
    the run with the larger one has the statistics of the values carrying its scale divided by
    the ratio (copies of those specs and their records; the parsed records stay as they are).
    None where neither run scales its loss or both scale it alike (nothing changes).
    ``permuted``: records of two frameworks, translated (:func:`.pairing.data_flow`)."""
    found = {}
    for side, recs in (("a", recs_a), ("b", recs_b)):
        flow = data_flow(recs, permuted) if _candidate(recs) else None
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
    elif not _power_of_two(ls.ratio):
        ls.whole_backward = ls.inexact_line()
    else:
        out[divided] = _divide(out[divided], marks[divided], ls)
    for side, recs in (("a", recs_a), ("b", recs_b)):
        flow = found[side][1] or data_flow(recs, permuted)
        ls.machinery.update(id(out[side][u]) for u in _seed_makers(recs, flow))
        if marks[side] is not None:
            ls.machinery.update(id(out[side][u]) for u in marks[side].machinery)
            ls.not_judged.update(_not_judged(marks[side], ls))
    return out["a"], out["b"], ls


def _seed_makers(recs: list, flow) -> list:
    """The records making a run's backward seeds from no value (``ones_like``, ``aten.full``): one
    run makes its seed where the other gives backward a scaled one, so neither has a counterpart.
    Autograd's ``ones_like`` of the loss counts where no forward record reads it (a seed read
    through a view no record shows, a mean's expand, has no producer in the data flow)."""
    read_forward = _read_in_forward(recs, flow, 0, len(recs), (set(), set()))[0]
    read = [src[0] for _, _, src in seed_reads(recs, flow)
            if src is not None and (not _inputs_of(flow, src[0]) or op_traits.reads_metadata_only(recs[src[0]]["op"]))]
    autograd = [u for u, r in enumerate(recs)
                if r["kind"] == "op" and r["stage"] == "forward" and op_traits.base_name(r["op"]) in _SEED_OF_LOSS
                and not any((u, arg) in read_forward for io, arg, _ in flow.walks[u] if io == "output")]
    return read + autograd


def _not_judged(marks: _Marks, ls: LossScale) -> dict:
    """spec id -> reason, for the values of one run compare does not judge: the scaler's state,
    values computed from scaled gradients that need not scale with them, every value of a record
    reading a value no record made (alignment may have paired it on that value, undivided), and,
    where the scaled values cannot be divided (``ls.whole_backward``), every one of them (the
    scaled loss too)."""
    state = f"{LOSS_SCALING}the scaler's state ({ls.said()}): the runs scale differently"
    undecided = (f"{LOSS_SCALING}computed from scaled gradients other than by the scaler ({ls.said()}): need not "
                 f"scale with it; compare runs scaled alike")
    untraced = (f"{LOSS_SCALING}computed in backward from a value no record made (a kernel the probe cannot "
                f"observe): whether it carries the scale ({ls.said()}) cannot be told; compare runs scaled alike")
    why = {STATE: state, UNDECIDED: undecided, UNTRACED: untraced}
    if ls.whole_backward:
        why[SCALED] = LOSS_SCALING + ls.whole_backward
    out = dict.fromkeys(marks.untraced, untraced)
    out.update((spec_id, why[kind]) for spec_id, kind in marks.kind.items() if kind in why)
    return out


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
        new = {key: copied(r[key]) for key in ("inputs", "outputs") if key in r}
        if r.get("kwargs"):       # by name (a translated record's transposed operands under "unpaired")
            kwargs = {name: copied(value) for name, value in r["kwargs"].items()}
            new["kwargs"] = r["kwargs"] if all(kwargs[k] is r["kwargs"][k] for k in kwargs) else kwargs
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
    if len(scales) != 1 or not all(map(_power_of_two, scales)) or any(r["kind"] == "op" and op_traits.base_name(r["op"]) == op_traits.LOSS_SCALE_CHECK
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
