"""Where the differences come from: each differing value followed back through the records' data
flow to the op where it enters.

Thresholds decide *whether* two runs disagree; lineage decides *where*.  An op is where a difference
enters when its outputs differ while its inputs agree, or when its outputs differ by more than its
inputs' differences carried through it: measured by re-running it in float64 on both runs' recorded
inputs where tensors are saved and the framework is importable (:mod:`.rerun`), else estimated on
the recorded errors (outputs ``origin_amplification`` times further off than inputs; approximate).
Differences below the threshold count: a stage with no error rows still has a first *departure*.
Between runs that are otherwise bit-identical (:mod:`.exact`) every statistics difference counts."""

from __future__ import annotations

import bisect
from typing import NamedTuple

import numpy as np
import pandas as pd

from ...core import op_traits
from ...core.collective_roles import brings_values
from ...records.format import fused_kernels, walk
from ...records.reader import Part
from ...standards import verdicts as V
from ...standards.loader import is_float, standard
from ...standards.rounding import LARGEST
from ..regions import common_scope, stats_distance
from .choice import Choices
from .columns import TENSOR_METRICS
from . import extremes
from .exact import otherwise_identical
from .pairing import DataFlow, user_frames
from .regroup import Regrouping
from .scoring import distance_bound, judging_precisions, pair_codes
from .rerun import ROUNDOFF
from .rewired import rewired_inputs_not_judged
from .verdict import Divergence, call_words, place_words


class Root(NamedTuple):
    """Where a difference enters.  Sources compare in an order that does not depend on which run is
    A: a difference of rounding size (``weak``) only where no larger one enters, constants the runs
    make differently (``CONSTANT``) and values zero up to rounding (``NOISE``) only where nothing else
    does; then by position in the stage (``at``,
    ``before``: a one-run-only op sits before the first paired record after it in its own run), then
    by what it is (``tie``)."""

    weak: int       # 0; ROUNDING: an op's own difference no larger than a few roundings of its dtype
                    # (or a discrete choice such a difference flipped, :mod:`.choice`);
                    # CONSTANT: a value made from the program's numbers (:meth:`Lineage.makes_constant`);
                    # NOISE: a value zero up to rounding (it passed by the cancellation rule)
    at: int         # position in the stage (run A's order) of the paired record it is seen at, or for
                    # a one-run-only op of the first paired record of its stage after it
    before: int     # a one-run-only op: minus its distance (in its run) to that record; else 0
    tie: tuple      # (op, scope, call) of a one-run-only op; (arg, "", 0) of a tensor
    index: int      # the record (of ``side``'s run)
    side: str       # "a" or "b"
    arg: str        # the tensor, for the causes seen at a tensor (inputs, inherited, unrecorded)
    cause: str      # Divergence.cause


# Root.weak: below a larger difference; below any computed one (a constant of the program); below any other source
ROUNDING, CONSTANT, NOISE = 1, 2, 3

# the largest finite value of each float dtype (torch.finfo(d).max of float64, float32, float16, bfloat16)
FLOAT_MAXES = tuple(LARGEST[d] for d in ("float64", "float32", "float16", "bfloat16"))
# a dtype's extremes as a program writes them, "the lowest value of my dtype" (finfo(d).min/max, +-inf)
DTYPE_EXTREMES = frozenset([*FLOAT_MAXES, *(-m for m in FLOAT_MAXES), float("inf"), float("-inf")])

# runs of other kernels (another framework, device kind or precision, compiled code) round differently
# at every op: below this relative error their statistics-only rows count as equal (saved tensors
# count every bit; runs otherwise bit-identical count every statistics difference, .exact)
STATS_NOISE = 1e-6


def differs(df: pd.DataFrame, floor: float = STATS_NOISE) -> np.ndarray:
    """Per row: do the runs' values differ at all (below the threshold too)?  Statistics-only rows by
    more than ``floor``.  Undefined values never do.  A sum that partly cancelled (its ``error`` taken
    relative to its terms by the cancellation rule) differs as far as it does relative to itself, as
    the records reading it measure it: relative to its terms it may fall below the floor, and the op
    reading it would then seem to make a difference its inputs already carry.  One zero up to
    rounding (``cancelled``) differs by any amount relative to itself: its own error stays."""
    status = df["status"].to_numpy(object)
    err = df["error"].to_numpy(np.float64)
    if "error_own" in df.columns:
        own = df["error_own"].to_numpy(np.float64)
        if "cancelled" in df.columns:
            own = np.where(df["cancelled"].to_numpy(bool), np.nan, own)
        err = np.fmax(err, own)
    measured = df["rel_l2_err"].notna().to_numpy()
    out = np.where(measured, err > 0, err > floor) | (status == V.ERROR) | (status == V.WARNING) | (df["checksum_match"] == "unequal").to_numpy()
    return out & (status != V.NOT_JUDGED)


NONE, WEAK, STRONG = 0, 1, 2    # an op's own difference: none, of rounding size, larger
ROUNDINGS = 16                  # "rounding size": up to this many unit roundoffs of the dtype (relative)
STRETCH_PAIRING = 0.5           # values no record made entering a stretch pair at most this far apart
                                # (regions.stats_distance: 0 equal, 2 as far apart as can be)
PASS_ON = 1.25                  # outputs relatively no further off than this x the inputs: passed on


class OwnShare:
    """Decides, per paired record of run A, whether its op adds a difference of its own."""

    def __init__(self, df, recs_a, recs_b, pair_b, rerun, error_rows):
        self.amp = float(standard("compare_standards").get("origin_amplification", 10.0))
        self.err = np.nan_to_num(df["error"].to_numpy(np.float64), nan=0.0, posinf=np.inf).tolist()
        # what an input hands on: a value passed by the cancellation rule (its error taken relative to
        # its terms) differs as far as it does relative to itself, which an op reading it is measured by
        own = df["error_own"].to_numpy(np.float64) if "error_own" in df.columns else None
        self.err_in = self.err if own is None or np.isnan(own).all() else \
            np.fmax(np.nan_to_num(own, nan=-np.inf, posinf=np.inf), self.err).tolist()
        self.dtype_a, self.dtype_b = df["dtype_a"].tolist(), df["dtype_b"].tolist()
        # per row: both floats; the unit roundoff of the lower precision (one lookup per dtype pair)
        codes, pairs = pair_codes(self.dtype_a, self.dtype_b)
        self.floats = np.array([is_float(x) and is_float(y) for x, y in pairs], bool)[codes].tolist()
        self.unit = np.array([ROUNDOFF.get(V.lower_precision(x, y), ROUNDOFF["float32"]) for x, y in pairs],
                             np.float64)[codes].tolist()
        self.df = df
        self.recs_a, self.recs_b, self.pair_b, self.rerun = recs_a, recs_b, pair_b, rerun
        self.estimated: set = set()    # records with differing inputs decided by the recorded errors
        self.sizes = None              # the columns _carries_noise reads, on first use
        self.error_rows = error_rows
        self.lines = None              # the columns estimate() reads, on first use (_lines)
        self.unjudged: dict = {}       # stage -> the first record estimate() passed over there
        self.unjudged_errors: dict = {}    # stage -> the first of those with an output past the error line
        self.below = None              # record -> its input rows differing below the floor (below_floor)
        self.activation_input = None   # activation record -> its input row, on first use (on_extremes)
        self.extremes = None           # the max/min columns, on first use (on_extremes)
        self.at_extremes: set = set()  # activations whose own difference was measured at their extremes

    def _carries_noise(self, outs: list, noise: list) -> bool:
        """Whether the outputs differ by no more than ``origin_amplification`` times the noise inputs'
        own size (``‖a‖ + ‖b‖`` of each, which bounds their difference): a value zero up to rounding
        differs by any amount relative to itself, which its row (relative to its terms) does not
        show, so relative errors cannot say what an op reading it adds (AdamW's ``lerp_`` of a key
        bias's gradient: 0.1 x the noise, as far off relatively); its absolute size can, for an op
        that does not scale it up more than that (an optimizer's update, an add beside larger
        operands: there a difference of the op's own is far larger than the noise and still named)."""
        if self.sizes is None:       # the columns read once; a row's size computed where asked
            df = self.df
            self.sizes = (df["shape_a"].tolist(), df["rmse"].tolist() if "rmse" in df else [np.nan] * len(df),
                          [df[f"{s}_diff"].tolist() for s in ("norm", "max", "min", "mean")],
                          (df["norm_a"].abs() + df["norm_b"].abs()).tolist())
        shapes, rmse, diffs, size = self.sizes

        def far(k):
            return distance_bound(rmse[k], max(int(np.prod(shapes[k])), 1), [d[k] for d in diffs])
        return max(far(k) for k in outs) <= self.amp * sum(size[k] for k in noise)

    def __call__(self, i: int, outs: list, ins: list, measure: bool = True, unmeasured: bool = False,
                 noise: tuple = (), carried: bool = False) -> int:
        """``outs``/``ins``: the record's differing output/input rows; ``measure``: whether a float64
        re-run may decide (not where an earlier larger-than-rounding source is already found);
        ``unmeasured``: an input without a row may differ (a one-run-only op made it); ``noise``: the
        rows of ``ins`` that are zero up to rounding (:meth:`_carries_noise`); ``carried``: an input's
        difference comes from a larger-than-rounding source before it (:meth:`estimate`)."""
        if not outs:
            return NONE
        if not ins:                  # inputs agree, outputs do not (or follow the input without a row)
            if unmeasured:
                return NONE
            if not any(self.beyond_rounding(k, output=True) for k in outs):
                return STRONG if self.on_extremes(i, outs) else WEAK
            return NONE if self.follows_below_floor(i, outs) else STRONG
        floats = [k for k in outs if self.floats[k]]
        if not floats:
            return NONE              # a discrete output (index, mask) follows any input difference
        if self.on_extremes(i, floats):
            return STRONG            # measured at its extremes: the stretch's rounding budget hides nothing
        out_err, in_err = max(self.err[k] for k in floats), max(self.err_in[k] for k in ins)
        if out_err <= ROUNDINGS * max(self.unit[k] for k in floats):
            return NONE              # a rounding-size output difference on differing inputs: nothing of its own
        # re-run an op whose output is relatively further off than its inputs (an amplifier, or an error
        # of its own): one that passes its inputs' difference on no larger adds nothing measurable
        if measure and out_err > PASS_ON * in_err:
            own = self.measured(i, floats)
            if own is not None:
                return STRONG if own else NONE
        if noise:
            if self._carries_noise(outs, noise):
                return NONE
            ins = [k for k in ins if k not in noise]
            if not ins:
                return STRONG if any(self.err[k] > ROUNDINGS * self.unit[k] for k in outs) else WEAK
            in_err = max(self.err_in[k] for k in ins)
        if op_traits.selects(self.recs_a[i]["op"]):
            self.estimated.add(i)
            return NONE              # picked elements of a differing input: their statistics bound nothing
        return self.estimate(i, floats, ins, out_err, in_err, carried)

    def on_extremes(self, i: int, outs: list) -> bool:
        """Paired record ``i``, an activation (:mod:`.extremes`), adds a difference of its own at its
        output's extremes, measured against its input's (``outs``: its differing float output rows).
        Why: runs in other precisions may differ by several roundings after a stretch of ops, within
        which :data:`ROUNDINGS` passes an output difference, and a relu 5 % off in a bfloat16 run
        compared with a float32 one passed as rounding; at the extremes an activation hands its
        input's difference on with one rounding of its own at most, so no budget is needed there."""
        j = self.pair_b.get(i)
        if j is None or extremes.activation(self.recs_a[i]["op"]) is None:
            return False
        if self.activation_input is None:
            self._activation_rows()
        k_in = self.activation_input.get(i)
        if k_in is None:
            return False
        ext = self.extremes
        for k in outs:
            found = extremes.own_difference(
                self.recs_a[i], self.recs_b[j], {e: (ext[e + "_a"][k_in], ext[e + "_b"][k_in]) for e in ("max", "min")},
                {e: (ext[e + "_a"][k], ext[e + "_b"][k]) for e in ("max", "min")}, (self.dtype_a[k], self.dtype_b[k]))
            if found:
                self.at_extremes.add(i)
                return True
        return False

    def _activation_rows(self) -> None:
        """Record -> its ``input.0`` row, of the activations' records (:meth:`on_extremes`), and the
        extremes columns, read once per part where an activation's output differs."""
        df = self.df
        ops = df["op_a"].to_numpy(object)
        is_act = {op: extremes.activation(op) is not None for op in set(ops.tolist())}
        rows = np.flatnonzero((df["io"] == "input").to_numpy() & (df["arg"] == "input.0").to_numpy()
                              & np.array([is_act[op] for op in ops.tolist()], bool))
        self.activation_input = dict(zip(df["uid"].to_numpy()[rows].tolist(), rows.tolist()))
        self.extremes = {c: df[c].to_numpy(np.float64).tolist() for c in ("max_a", "max_b", "min_a", "min_b")}

    def follows_below_floor(self, i: int, outs: list) -> bool:
        """Paired record ``i``, whose inputs count as agreeing, would be named below the error line as
        where a stage's error rows start, yet its inputs differ below the floor and its outputs
        (``outs``) by no more than ``origin_amplification`` times that: they may follow from those
        inputs (a matrix product hands a difference on several times larger), so it is not named."""
        floats = [k for k in outs if self.floats[k]]
        below = self.below_floor(i) if floats else []
        if not below:
            return False
        _, _, error_row, error_stage = self.lines or self._lines()
        if not error_stage[floats[0]] or any(error_row[k] for k in floats):
            return False
        self.estimated.add(i)
        return max(self.err[k] for k in floats) <= self.amp * max(self.err_in[k] for k in below)

    def below_floor(self, i: int) -> list:
        """Paired record ``i``'s input rows compared by statistics only that differ below the floor
        (:data:`STATS_NOISE`), which the lineage counts as equal.  Why: a forward kernel's difference
        reaches a backward matrix product through a gradient that differs by 5e-7 (the LM head's, from
        a wrong silu's logits), which the product hands on several times larger; judged as if its
        inputs agreed, the product was named where the backward's error rows start."""
        if self.below is None:
            df = self.df
            err = np.asarray(self.err_in, np.float64)
            rows = np.flatnonzero((df["io"] == "input").to_numpy() & df["rel_l2_err"].isna().to_numpy()
                                  & (err > 0) & (err <= STATS_NOISE) & np.asarray(self.floats, bool))
            self.below = {}
            for k, uid in zip(rows.tolist(), df["uid"].to_numpy()[rows].tolist()):
                self.below.setdefault(uid, []).append(k)
        return self.below.get(i, [])

    def measured(self, i: int, outs: list) -> bool | None:
        """Whether paired record ``i``'s float output rows ``outs`` differ by more than both runs' recorded
        inputs carry through it, by a float64 re-run of each run's record (:mod:`.rerun`); None where
        it cannot be re-run (no saved tensors, no framework, the budget spent)."""
        j = self.pair_b.get(i)
        if self.rerun is None or j is None or not outs:
            return None
        if not hasattr(self, "args"):
            self.args, self.data_a, self.data_b = (self.df[c].tolist() for c in ("arg", "data_a", "data_b"))
        return self.rerun.own(self.recs_a[i], self.recs_b[j],
                              [(self.args[k], self.data_a[k], self.data_b[k],
                                V.lower_precision(self.dtype_a[k], self.dtype_b[k])) for k in outs])

    def estimate(self, i: int, outs: list, ins: list, out_err: float, in_err: float, carried: bool = False) -> int:
        """An op's own difference judged on the recorded errors alone (inputs that differ, no float64
        re-run): its outputs off by ``out_err``, ``origin_amplification`` times further than its inputs.
        A statistics difference is a lower bound of the values' difference (a norm, a mean, an extreme
        average out or miss what differs element by element), so an input read by statistics only may
        differ far more than its row says, and the op reading it looks like it amplifies.  Such an input
        counts as off by at least a rounding of the precision its values were computed in, and such
        evidence names an op only where one of its outputs crosses the error line and its inputs differ
        by rounding only (``carried`` false: no source larger than rounding made their difference);
        otherwise, in a stage with error rows, the op is no source (its rows follow from its inputs) and
        is noted in ``unjudged``.  A forward kernel off below the lower precision's resolution then names
        no backward op after it, a kernel off by far more than rounding still crosses the line, and a
        layer norm's backward reading forward values a wrong gelu moved is not named for them."""
        self.estimated.add(i)
        if not out_err > self.amp * in_err:
            return NONE
        stats_only, judged_unit, error_row, error_stage = self.lines or self._lines()
        bounded = [k for k in ins if stats_only[k]]
        if not out_err > self.amp * max([in_err, *(judged_unit[k] for k in bounded)]):
            return NONE
        if bounded and error_stage[outs[0]] and (carried or not any(error_row[k] for k in outs)):
            self.unjudged.setdefault(self.recs_a[i]["stage"], i)
            if any(error_row[k] for k in outs):
                self.unjudged_errors.setdefault(self.recs_a[i]["stage"], i)
            return NONE
        return STRONG

    def statistics_only(self, k: int) -> bool:
        """Row ``k`` is compared by statistics only (no saved tensors on either side)."""
        return (self.lines or self._lines())[0][k]

    def beyond_rounding(self, k: int, output: bool = False) -> bool:
        """Input row ``k`` (``output``: output row) differs by more than a few roundings
        (:data:`ROUNDINGS`) of the lowest precision its values were computed in: a float32 gradient
        of a bfloat16-autocast run differs from a float32 run's by bfloat16's rounding, which no
        wrong kernel need explain; a fused attention's float32 ``logsumexp``, computed from bfloat16
        inputs, differs between two torch versions by bfloat16's rounding, no difference of the
        kernel's own larger than rounding."""
        unit = (self.lines or self._lines())[1][k]
        return (self.err if output else self.err_in)[k] > ROUNDINGS * max(self.unit[k], unit)

    def _lines(self) -> tuple:
        """Per row: compared by statistics only; the unit roundoff of the precision its values are
        judged at (the lowest they were computed in, scoring's); an error row; in a stage with some."""
        df, error_rows = self.df, self.error_rows
        judged = judging_precisions(df, df["dtype_a"].to_numpy(object), df["dtype_b"].to_numpy(object))[0] \
            if {"lineage_a", "lineage_b"} <= set(df.columns) else \
            [V.lower_precision(x, y) for x, y in zip(self.dtype_a, self.dtype_b)]
        stages = df["stage"].to_numpy(object)
        self.lines = (df["rel_l2_err"].isna().tolist(),
                      pd.Series(judged, dtype=object).map(ROUNDOFF).fillna(0.0).tolist(),
                      error_rows.tolist(), np.isin(stages, np.unique(stages[error_rows])).tolist())
        return self.lines


class Side(NamedTuple):
    """One run as lineage sees it: its records, their positions per stage (``seq``), its data flow,
    its one-run-only records and, of those, the ones the other framework runs where no probe sees
    them (an unobservable backward kernel: a difference passes through them as through a cast)."""

    name: str           # "a" or "b"
    part: Part
    recs: list
    seq: list
    flow: DataFlow
    only: frozenset
    unobserved: frozenset = frozenset()


# what a one-run-only cast of a value no record made passes on: that value, as it is (Lineage._cast_source)
UNPRODUCED = "unproduced"


def _keeps_values(dtype_in: str, dtype_out: str) -> bool:
    """A cast from ``dtype_in`` to ``dtype_out`` keeps every value exactly (the same dtype, or a float
    widened to float32 or float64)."""
    rank_in, rank_out = V.precision_rank(dtype_in), V.precision_rank(dtype_out)
    return dtype_in == dtype_out or (rank_in >= 0 and rank_out >= V.precision_rank("float32") and rank_out >= rank_in)


def _min(x, y):
    return y if x is None else x if y is None else min(x, y)


def _merge(x: tuple | None, y: tuple | None) -> tuple | None:
    """Two (own-stage, inherited) source pairs, each the earlier."""
    return y if x is None else x if y is None else (_min(x[0], y[0]), _min(x[1], y[1]))


def _numbers(record: dict) -> dict:
    """arg -> recorded value of each number argument (int or float; inf/nan written as strings)."""
    return {arg: spec.get("value") for _, arg, spec in walk(record, outputs=False, tensors_only=False)
            if spec.get("type") in ("int", "float")}


def _extreme(value) -> bool:
    """A recorded number is a float dtype's extreme (:data:`DTYPE_EXTREMES`)."""
    try:
        return float(value) in DTYPE_EXTREMES
    except (TypeError, ValueError):
        return False


COMPUTE, CAST, MAKER = 0, 1, 2     # one-run-only ops, as Lineage._loose sorts them
KINDS = (COMPUTE, CAST, MAKER)


def _between(loose: dict, stage: str, lo: int, hi: int, fits=None):
    """The first one-run-only op of ``stage`` strictly between records ``lo`` and ``hi`` (compute ops
    first, then casts, then constant makers) for which ``fits`` (index -> bool) holds, where given."""
    for kind in (COMPUTE, CAST, MAKER):
        cand = loose.get((stage, kind), ())
        k = bisect.bisect_right(cand, lo)
        while k < len(cand) and cand[k] < hi:
            if fits is None or fits(cand[k]):
                return cand[k]
            k += 1
    return None


def _writes_dtype(side, u: int, dtype) -> bool:
    """One-run-only record ``u`` of run ``side`` makes a value of ``dtype``, or writes into one in
    place: it can be what changed a value of that dtype between its producer and its reader."""
    op = side.recs[u]["op"]
    form = op.split(".")[1:2]            # the in-place form of any namespace's op (``mul_``, ``c10d.allreduce_``)
    overwrites = op_traits.overwrites_first_input(op) or bool(form) and form[0].endswith("_")
    return any(spec.get("dtype") == dtype for io, arg, spec in side.flow.walks[u]
               if io == "output" or (overwrites and arg == "input.0"))


class Lineage:
    """Follows each differing value (at any size) back to where it started, the same way whichever
    run is A: the op that produced it, when that op adds a difference of its own (:class:`OwnShare`);
    an op present in one run only, in either run, producing it or standing between the agreeing
    producer and the differing consumer; or no recorded op at all (the runs differ at their
    inputs/parameters).  Each input asks both runs' data flow for its producer, and one-run-only ops
    of both runs are visited in execution order, so the two runs play the same part.  One pass over
    the records; each keeps the earliest source (:class:`Root`'s order), so the pass is linear."""

    def __init__(self, df: pd.DataFrame, a: Side, b: Side, pairs: list, rerun=None, exact: bool = False):
        self.df, self.a, self.b, self.seq_a, self.exact = df, a, b, a.seq, exact
        self.pair_b = {i: j for i, j, _ in pairs}
        self.pair_a = {j: i for i, j, _ in pairs}
        self.bad_rows = df["status"].to_numpy(object) == V.ERROR
        self.uid = df["uid"].to_numpy(np.int64)
        self.args = df["arg"].to_numpy(object)
        is_in = (df["io"] == "input").to_numpy()
        self.spec = {"a": df["spec_a"].tolist(), "b": df["spec_b"].tolist()}   # id() of each row's specs
        self.spec_a, self.spec_b = self.spec["a"], self.spec["b"]
        # rows that compare two partial sums of one accumulation the runs group differently (.regroup):
        # no evidence of where a difference enters, so never error rows; what they hold is still followed
        self.regroup = Regrouping(a, b, self.pair_b, self.pair_a)
        self.partial_rows = self.regroup.partial_rows(self.uid, is_in, self.spec_a, self.spec_b)
        self.bad_rows &= ~self.partial_rows
        # inputs that read a value zero up to rounding (scoring's cancellation rule): each is a source of
        # noise for what is computed from it, however far below the floor its rescaled error sits
        noise = df["cancelled"].to_numpy(bool) & is_in if "cancelled" in df.columns else np.zeros(len(df), bool)
        self.off_rows = (differs(df, 0.0 if exact else STATS_NOISE) if len(df) else np.zeros(0, bool)) | noise
        # the differing outputs: (record of A, arg) -> row
        self.out_row = {(int(self.uid[k]), self.args[k]): k for k in np.flatnonzero(self.off_rows & ~is_in)}
        # plain lists: element access in the pass is many times cheaper than numpy's
        self.bad, self.off, self.is_in = self.bad_rows.tolist(), self.off_rows.tolist(), is_in.tolist()
        self.noise = noise.tolist()
        self.partial = self.partial_rows.tolist()
        self.src_a, self.src_b = a.flow.src.get, b.flow.src.get
        self.own_share = OwnShare(df, a.recs, b.recs, self.pair_b, rerun, self.bad_rows)
        self.choices = Choices(df, a, b, {"off": self.off, "bad": self.bad, "is_in": self.is_in, "spec": self.spec,
                                          "floats": self.own_share.floats}, self.pair_a)
        self.loose = {s.name: self._loose(s) for s in (a, b)}
        # per run: its one-run-only ops that make a constant (makes_constant): sources ranked after computed ones
        self.makers = {n: {i for (_, kind), recs in lo.items() if kind == MAKER for i in recs}
                       for n, lo in self.loose.items()}
        self.pairs = pairs
        # paired records where one run's kernel stands in for another's (``shapes``: other ops of one shape)
        self.stand_ins = {i for i, _, how in pairs if how == "shapes"}
        self.anchors: dict = {}  # per run, built on first use (runs with one-run-only ops): see _anchors
        self.boundary = {i for i, _, how in pairs if how == "region boundary"}   # rows for the values entering too
        self.places: dict = {}
        self.best: dict = {}     # paired record (A's index) -> earliest own-stage source of its differing outputs
        self.inh: dict = {}      # paired record (A's index) -> earliest inherited source
        self.passes: dict = {"a": {}, "b": {}}   # one-run-only record -> (best, inherited) of what it passes on
        # one-run-only record -> (the largest error of the differing paired values it reads, directly or
        # through other one-run-only records; their (best, inherited) sources)
        self.carried: dict = {"a": {}, "b": {}}
        # one-run-only records given a value that carries a source larger than rounding (:meth:`passed_on`)
        self.given: dict = {"a": set(), "b": set()}
        self.feeds: dict = {}    # stage -> earliest own-stage source of its values another stage reads differing
        # sums the runs group differently (.regroup) -> the largest difference of the terms each was given
        self.terms_err: dict = {}
        # partial sums ((run, one-run-only record), or ("p", paired record)) -> the earliest one-run-only op
        # other than a sum or cast (a hook scaling one group) among what they add up: the suspect where
        # their total differs more than its terms
        self.inside: dict = {}
        # stage -> where the rounding-size differences its error rows grew from enter (cause rounding: _unwound)
        self.grown: dict = {}
        # a stretch both runs compute with ops of their own, (stage, paired record before, after) -> the
        # sources of what it was given larger than rounding, or None (:meth:`stretch_given`)
        self.stretches: dict = {}
        self.span_ops: dict = {}  # (stage, paired record before, after) -> run name -> its one-run-only ops there
        self.entering_errs: dict = {}  # (stage, paired record before, after) -> the largest difference entering it
        # (run, reader, arg) -> how far apart the two runs' statistics of a value no record made are, where
        # it enters such a stretch and differs (:meth:`_unproduced_differing`)
        self.entering_gaps: dict = {}
        # a stretch given a difference whose output differs far more (:meth:`grown_in_stretch`), (stage,
        # paired record before, after) -> (the largest difference entering it, leaving it, the sources given)
        self.grew: dict = {}
        # a stand-in record given a difference far smaller than its own (:meth:`_stand_in_grew`) -> (what
        # entered, what left, the sources given, the first one-run-only op feeding it that was given one)
        self.region_grew: dict = {}
        self.inherits: dict = {}  # stage with error rows -> the earliest source they inherit from the other stage

    # ---- one-run-only ops and their place among the paired records -------------------------------
    def _loose(self, side: Side) -> dict:
        """(stage, COMPUTE/CAST/MAKER) -> sorted one-run-only op records a difference may start at (the
        unobserved ones and a profiler's marks never); constant makers apart, found only where no other
        op stands between."""
        out: dict = {}
        for i in sorted(side.only - side.unobserved):
            r = side.recs[i]
            if r["kind"] == "op" and not op_traits.is_annotation(r["op"]):
                kind = MAKER if self.makes_constant(side, i) else CAST if op_traits.is_cast(r["op"]) else COMPUTE
                out.setdefault((r["stage"], kind), []).append(i)
        return out

    @staticmethod
    def makes_constant(side: Side, i: int) -> bool:
        """Record ``i`` makes its outputs from the program's numbers alone: it reads no tensor's values
        (``zeros``, ``full``, ``arange``, ``scalar_tensor``; ``fill_`` of memory it overwrites; ``zeros_like``
        reading a shape).  Its outputs differ between runs only where the programs do (a
        ``torch.finfo(dtype).min`` mask value of another dtype, another code path), never by a kernel's
        precision: no suspect, a source ranked after every computed one.  A random op is not one."""
        rec = side.recs[i]
        if rec["kind"] != "op" or op_traits.is_random(rec["op"]):
            return False
        return not any(io == "input" and not op_traits.overwritten(rec["op"], arg)
                       for io, arg, _ in side.flow.walks[i]) or op_traits.reads_metadata_only(rec["op"])

    def constant_pair(self, i: int) -> bool:
        """Paired record ``i`` (A's index) makes a constant in both runs (:meth:`makes_constant`)."""
        j = self.pair_b.get(i)
        return j is not None and self.makes_constant(self.a, i) and self.makes_constant(self.b, j)

    def extremes_differ(self, i: int) -> bool:
        """Paired record ``i`` (A's index) is given another dtype's extreme in each run, and no other
        number differs: ``masked_fill(mask, torch.finfo(dtype).min)``, a ``clamp`` to ``finfo.max`` in
        runs of other dtypes (-3.40282e38 in float32, -3.38953e38 in bfloat16).  Where its tensor inputs
        agree, its outputs differ as the programs' constants do, not by a kernel; any other number that
        differs (a learning rate, an eps, an ``.item()``) leaves the op a suspect."""
        j = self.pair_b.get(i)
        if j is None:
            return False
        nums_a, nums_b = _numbers(self.a.recs[i]), _numbers(self.b.recs[j])
        if nums_a.keys() != nums_b.keys():
            return False
        differing = [(x, nums_b[arg]) for arg, x in nums_a.items() if x != nums_b[arg]]
        return bool(differing) and all(_extreme(x) and _extreme(y) for x, y in differing)

    def _anchors(self, side: Side, paired: list) -> dict:
        """stage -> (the side's paired records in order, their A index, their A position, the
        stage's record count in this run).  A profiler's marks are no anchors: a one-run-only cast
        just before ``record_function``'s enter hands its difference to the computation after it."""
        out: dict = {}
        to_a = (lambda i: i) if side.name == "a" else self.pair_a.__getitem__
        for i in paired:
            if op_traits.is_annotation(side.recs[i]["op"]):
                continue
            idx, a_idx, a_seq = out.setdefault(side.recs[i]["stage"], ([], [], []))[:3]
            k = to_a(i)
            idx.append(i)
            a_idx.append(k)
            a_seq.append(self.a.seq[k])
        counts: dict = {}
        for r in side.recs:
            counts[r["stage"]] = counts.get(r["stage"], 0) + 1
        return {st: (*v, counts.get(st, 0)) for st, v in out.items()} | \
            {st: ([], [], [], n) for st, n in counts.items() if st not in out}

    def place(self, side: Side, u: int) -> tuple:
        """(A index, A position, distance) of the first paired record of one-run-only record ``u``'s
        stage after it (past the stage's end where none), distance counted in ``u``'s run."""
        got = self.places.get((side.name, u))
        if got is None:
            if not self.anchors:
                self.anchors = {s.name: self._anchors(s, sorted(p[k] for p in self.pairs))
                                for k, s in enumerate((self.a, self.b))}
            idx, a_idx, a_seq, count = self.anchors[side.name][side.recs[u]["stage"]]
            n = bisect.bisect_right(idx, u)
            if n < len(idx):
                got = (a_idx[n], a_seq[n], side.seq[idx[n]] - side.seq[u])
            else:
                end = self.anchors["a"].get(side.recs[u]["stage"], ((), (), (), 0))[3]
                got = (len(self.a.recs), end, count - side.seq[u])
            self.places[side.name, u] = got
        return got

    def unmatched(self, side: Side, u: int) -> Root:
        """One-run-only op ``u`` as a source: a suspect, or a constant the other run does not make."""
        _, at, dist = self.place(side, u)
        r = side.recs[u]
        constant = u in self.makers[side.name]
        return Root(CONSTANT if constant else 0, at, -dist, (r["op"], r["scope"], int(r["call"])), u, side.name, "",
                    "constant" if constant else "unmatched")

    def seen_at(self, r: int, arg: str, cause: str, weak: bool = False) -> Root:
        """A source seen at paired record ``r`` (A's index), tensor ``arg`` ("" for the op itself)."""
        return Root(weak, self.seq_a[r], 0, (arg, "", 0), r, "a", arg, cause)

    # ---- where one differing value comes from ----------------------------------------------------
    def _from_producer(self, side: Side, src, consumer: int, stage: str, err: float = 0.0,
                       reach: float | None = None, row: int | None = None):
        """What run ``side``'s producer ``src`` (index, output arg) of a differing input of record
        ``consumer`` (of that run), off by ``err``, says: a (best, inherited) pair, "stage" (made in
        another stage), "agrees" (its output agrees and no one-run-only op stands between) or None
        (unknown).  A one-run-only producer that hands on no more than the difference it was given
        (``PASS_ON``) passes on that difference's sources (a compiled graph's gradient-accumulation
        ``add``, a folded ``where``, carrying a difference the forward made), and where that
        difference has none (a paired op's rounding below the error line), no source either: the
        other run reads the same value from that paired op and finds none (one torch version's
        ``slice_backward`` of a full slice after the ``lm_head`` gradient).  ``reach``: the
        consumer is a sum the runs group differently (:mod:`.regroup`) and the row compares two
        partial sums, which says nothing: a one-run-only producer hands on what reaches the total,
        ``reach``.  ``row``: the consumer's input row (:meth:`grown_in_stretch`)."""
        if src is None:
            return None
        p, parg = src
        if side.recs[p]["stage"] != stage:
            self._feeds_other_stage(side, p, parg, err if reach is None else reach)
            return "stage"
        if p in side.only:
            carried = self.carried[side.name].get(p)
            if reach is not None:
                err = reach
            if carried is not None and err <= PASS_ON * carried[0]:
                return carried[1]
            if (hook := self.inside.get((side.name, p))) is not None:
                return hook, None
            got = self.passes[side.name].get(p)
            if got is UNPRODUCED:       # an exact cast of a value no record made: as if read directly
                return None
            if reach is None and row is not None and (grown := self.grown_in_stretch(side, p, row)) is not None:
                return grown, None
            return got or ("agrees" if p in side.unobserved else (self.unmatched(side, p), None))
        pa = p if side is self.a else self.pair_a.get(p)
        if pa is not None and (pa, parg) in self.out_row:
            return self.best.get(pa), self.inh.get(pa)
        # an op between them changed it in place, or the link is a view no record shows: an op making
        # or writing a value of another dtype (a float rotary table beside a boolean mask) did not
        made = next((spec.get("dtype") for io, arg, spec in side.flow.walks[p] if io == "output" and arg == parg), None)
        u = _between(self.loose[side.name], stage, p, consumer,
                     None if made is None else lambda k: _writes_dtype(side, k, made))
        return (self.unmatched(side, u), None) if u is not None else "agrees"

    def _feeds_other_stage(self, side: Side, p: int, parg: str, err: float = 0.0) -> None:
        """Notes where a differing value made in one stage and read in another enters its own stage: a
        gradient an optimizer stepping inside the probe reads (forward-staged) that no backward record
        reads, as a gradient hook's (``p.register_hook(lambda g: g * 1.01)``): the backward's
        verdict names that hook, not 'no backward divergence'.  Its producer is a one-run-only op (its
        source: itself, or what it passes on) or a paired record whose output differs.  A one-run-only
        op whose reader's input differs (``err``) no more than what it was given (``PASS_ON``) hands
        that on, as it does to a reader of its own stage (:meth:`_from_producer`): its sources are
        the source (eager's key cache ``cat``, which a compiled graph folds away, read by attention's
        backward)."""
        stage = side.recs[p]["stage"]
        if p in side.only:
            got = self.passes[side.name].get(p)
            carried = self.carried[side.name].get(p)
            if carried is not None and err <= PASS_ON * carried[0]:
                got = carried[1]
            root = None if got is UNPRODUCED or (got is None and p in side.unobserved) else \
                got[0] if got is not None else self.unmatched(side, p)
        else:
            pa = p if side is self.a else self.pair_a.get(p)
            root = self.best.get(pa) if pa is not None and (pa, parg) in self.out_row else None
        if root is not None:
            self.feeds[stage] = _min(self.feeds.get(stage), root)

    def source(self, r: int, k: int, stage: str, reach: float | None = None) -> tuple:
        """(own-stage root, inherited root) of input row ``k`` of paired record ``r``, whose value
        differs, from both runs' producers of it; ``reach``: see :meth:`_from_producer`.  A value zero
        up to rounding is its own source, whatever made it: it differs by the rounding of its terms
        only (``NOISE``)."""
        if self.noise[k]:
            return self.seen_at(r, self.args[k], "noise", NOISE), None
        src_a, src_b = self.producers(self.spec_a[k], self.spec_b[k])
        weak = self._rounding(k)
        if src_a is None and src_b is None:    # no recorded op made it in either run
            return (None, self.seen_at(r, self.args[k], "inherited", weak)) if stage != "forward" else \
                (self.seen_at(r, self.args[k], "inputs", weak), None)
        # the usual case: both runs' producers are one pair of this stage whose output differs, which says it all
        if src_a is not None and src_b is not None and self.pair_b.get(src_a[0]) == src_b[0] \
                and src_a in self.out_row and self.a.recs[src_a[0]]["stage"] == stage:
            return self.best.get(src_a[0]), self.inh.get(src_a[0])
        jr = self.pair_b.get(r)
        err = self.own_share.err_in[k]
        got_a = self._from_producer(self.a, src_a, r, stage, err, reach, k)
        got_b = self._from_producer(self.b, src_b, jr, stage, err, reach, k) if jr is not None else None
        found = [g for g in (got_a, got_b) if type(g) is tuple]
        if found:
            got = found[0] if len(found) == 1 else _merge(*found)
            if weak and got[0] is not None and got[0].cause == "unmatched" and not got[0].weak and \
                    not self.stretch_fails(got[0], k):
                # a one-run-only op is judged by what it hands on: here a rounding-size difference
                return got[0]._replace(weak=True), got[1]
            return got
        arg = self.args[k]
        if "stage" in (got_a, got_b) or stage != "forward":   # backward values come from the forward
            return None, self.seen_at(r, arg, "inherited", weak)
        if "agrees" in (got_a, got_b):
            return self.seen_at(r, arg, "unrecorded", weak), None
        return self.seen_at(r, arg, "inputs", weak), None

    def producer(self, side: Side, spec: int):
        """(index, output arg) of the record of run ``side`` that made the value of input ``spec``
        (its ``id``), or None.  One inferred through a view no record shows (:mod:`...views`) stands
        where that record is present in one run only or its output differs too: a view of a value
        that agrees cannot differ, so there the value was no view of it."""
        src = (self.src_a if side is self.a else self.src_b)(spec)
        if src is None or spec not in side.flow.viewed or src[0] in side.only:
            return src
        pa = src[0] if side is self.a else self.pair_a.get(src[0])
        return src if pa is not None and (pa, src[1]) in self.out_row else None

    def producers(self, spec_a: int, spec_b: int) -> tuple:
        """Both runs' producers of one paired input (:meth:`producer`).  Where the two are paired
        records of different pairs, a producer inferred through a view is dropped: the view of the
        same value is found in both runs or in neither (the latest output that can hold a slice
        need not be the one it was taken of).  A contiguous piece of a collective's result stands
        only where both runs find it at one pair (:meth:`common_piece`)."""
        src_a, src_b = self.producer(self.a, spec_a), self.producer(self.b, spec_b)
        if src_a is None and src_b is None:
            return self.common_piece(spec_a, spec_b)
        both_paired = src_a is not None and src_b is not None and src_a[0] in self.pair_b and src_b[0] in self.pair_a
        if not both_paired or self.pair_b[src_a[0]] == src_b[0]:
            return src_a, src_b
        return (None if spec_a in self.a.flow.viewed else src_a), (None if spec_b in self.b.flow.viewed else src_b)

    def common_piece(self, spec_a: int, spec_b: int) -> tuple:
        """Both runs' producers of a value read as a contiguous piece of a collective's result: the
        latest paired collective whose result can hold it in both runs and differs (a piece of a
        result that agrees cannot differ); else (None, None).  Why: statistics leave several
        results able to hold a piece (an FSDP2 gradient fits inside the float32 parameters a later
        all-gather brings back, which a bfloat16 run's all-gather does not hold), and only the one
        both runs find is the one it was taken of, as far as the records can tell."""
        held_b = set(self.b.flow.pieces.get(spec_b, ()))
        for src in self.a.flow.pieces.get(spec_a, ()):
            other = self.pair_b.get(src[0])
            if other is not None and (other, src[1]) in held_b and src in self.out_row:
                return src, (other, src[1])
        return None, None

    def _rounding(self, k: int) -> bool:
        """Row ``k`` (a value no paired op made) differs by no more than a few roundings of its dtype:
        runs of other kernels (eager and compiled) round a view of a recorded value differently, which
        is no origin where a larger difference enters.  Runs otherwise bit-identical: every bit counts."""
        share = self.own_share
        return not self.exact and share.floats[k] and share.err[k] <= ROUNDINGS * share.unit[k]

    def uncompared(self, i: int, s0: int, e0: int) -> list:
        """Paired record ``i``'s inputs that have no row in either run (a translation compares no
        transposed operand) but whose producer's output row differs, or whose producer is a
        one-run-only op: (that row, standing for the input, or None; the input's source)."""
        out: dict = {}
        for side, rec in ((self.a, i), (self.b, self.pair_b.get(i))):
            if rec is None:
                continue
            walk = side.flow.walks[rec]
            if len(walk) == e0 - s0 and i not in self.boundary:
                continue   # every tensor has its row (the usual case: nothing to walk)
            spec = self.spec[side.name]
            compared = {spec[k] for k in range(s0, e0) if self.is_in[k]}
            op = side.recs[rec]["op"]
            for io, arg, sp in walk:
                if io != "input" or id(sp) in compared or op_traits.overwritten(op, arg):
                    continue
                src = self.producer(side, id(sp))
                if src is None:
                    continue
                p = src[0]
                if p in side.only:
                    got = self.passes[side.name].get(p)
                    stage = side.recs[rec]["stage"]
                    if got is UNPRODUCED:    # an exact cast of a value no record made: read as it is
                        got = (self.seen_at(i, arg, "inputs"), None) if stage == "forward" else \
                            (None, self.seen_at(i, arg, "inherited"))
                    if side.recs[p]["stage"] == stage and (got or p not in side.unobserved):
                        out[side.name, p] = None, got or (self.unmatched(side, p), None)
                    continue
                pa = p if side is self.a else self.pair_a.get(p)
                k = self.out_row.get((pa, src[1])) if pa is not None else None
                if k is None or k in out:
                    continue
                out[k] = k, ((None, self.seen_at(i, arg, "inherited")) if side.recs[p]["stage"] != side.recs[rec]["stage"]
                             else (self.best.get(pa), self.inh.get(pa)))
        return list(out.values())

    def passed_on(self, side: Side, u: int) -> tuple | None:
        """What one-run-only op ``u`` passes on: itself (a constant, where it makes one:
        :meth:`makes_constant`), unless a cast passes on its input's source, or its input already
        fails.  A kernel the other run does not observe is never a suspect: it passes on its inputs'
        source, or nothing (None).  Notes in ``carried`` the differing values it
        was given (their largest error and sources): a consumer whose input differs no more than that
        takes those sources instead (:meth:`_from_producer`).  A partial sum (:mod:`.regroup`) only
        regroups its terms: it passes on their sources, and starts no chain of one-run-only ops."""
        if u in self.makers[side.name]:    # what it reads, it reads for a shape at most
            return self.unmatched(side, u), None
        stage = side.recs[u]["stage"]
        cast = op_traits.is_cast(side.recs[u]["op"])
        partial = self.regroup.partial[side.name]
        follow = cast or u in side.unobserved or u in partial
        res = carried = held = None
        carried_err = 0.0
        given = False          # it reads a value that carries a source larger than rounding
        unproduced = False     # it reads a value no record of its stage made (a parameter, the batch)
        for io, arg, spec in side.flow.walks[u]:
            if io != "input":
                break
            src = self.producer(side, id(spec))
            if src is None or side.recs[src[0]]["stage"] != stage:
                unproduced = True
                if src is not None and self.given_differing(side, src):   # a forward value read in backward
                    res = _merge(res, (None, self.unmatched(side, u)._replace(cause="inherited", arg=arg)))
                continue
            p, parg = src
            if p in side.only:   # a chain of one-run-only ops: its first one
                if (got := self.passes[side.name].get(p)) is UNPRODUCED:
                    unproduced = True
                elif self._suspect_itself(side, p, got):
                    held = _merge(held, got)
                elif follow or p not in partial:
                    res = _merge(res, got)
                if (got := self.carried[side.name].get(p)) is not None:
                    carried_err, carried = max(carried_err, got[0]), _merge(carried, got[1])
                given = given or p in self.given[side.name]
                continue
            pa = p if side is self.a else self.pair_a.get(p)
            pk = self.out_row.get((pa, parg)) if pa is not None else None
            if pk is not None:
                carried_err = max(carried_err, self.handed_on(pa, pk))
                carried = _merge(carried, (self.best.get(pa), self.inh.get(pa)))
                given = given or self.carries_source(pk, (self.best.get(pa), self.inh.get(pa)))
            if pk is not None and (follow or self.bad[pk] and pa not in self.regroup.partial_out):
                res = _merge(res, (self.best.get(pa), self.inh.get(pa)))
        if carried is not None:
            self.carried[side.name][u] = carried_err, carried
        hands_on = given and u not in partial and not op_traits.keeps_relative(side.recs[u]["op"])
        if given and u not in partial:
            self.given[side.name].add(u)
            if hands_on:
                # given a difference made before it, by an op that may hand it on many times larger (a
                # matrix product's terms cancel): how far its output is off says nothing of its own
                # kernel, and no record of the other run computes the same value to measure it against:
                # it passes that difference's source on
                res = _merge(res, carried)
        if not hands_on:
            res = _merge(res, held)
        if u in partial:
            self.inside[side.name, u] = self.inside_op(side, [id(sp) for io, _, sp in side.flow.walks[u] if io == "input"])
        if res is not None and (res[0] is not None or res[1] is not None):
            return res
        if u in side.unobserved:
            return None
        if cast:
            return self._cast_source(side, u, unproduced)
        return self.stretch_given(side, u) or (self.unmatched(side, u), None)

    def _suspect_itself(self, side: Side, p: int, got) -> bool:
        """One-run-only op ``p`` was given a difference larger than rounding and passes on, as the
        source, a one-run-only op that was given one too (itself, or a copy before it: a ``clone``,
        whose output no record of the other run measures): only what reads it can tell whether that
        op added to the difference.  A reader that hands on what it is given many times larger
        (:meth:`passed_on`: torch 2.5.1's attention backward, a ``bmm`` after the ``clone`` of the
        gradient) cannot, so there that op is no suspect and the difference it was given is what
        the reader passes on."""
        given = self.given[side.name]
        return p in given and type(got) is tuple and got[0] is not None and got[0].cause == "unmatched" and \
            got[0].side == side.name and got[0].index in given

    def carries_source(self, k: int, src: tuple) -> bool:
        """Differing input row ``k`` carries a difference made before it: its (own-stage, inherited)
        sources ``src`` hold one larger than rounding, and it differs by more than its precision's
        rounding (:meth:`OwnShare.beyond_rounding`)."""
        return any(r is not None and not r.weak for r in src) and self.own_share.beyond_rounding(k)

    def given_differing(self, side: Side, src: tuple) -> bool:
        """A one-run-only op of run ``side`` is given, from the other stage, a difference it passes on
        rather than makes: the output ``src`` (index, arg) of a paired record of the forward it reads
        fails, or differs on statistics alone from a source larger than rounding (a wrong forward
        kernel).  Why: how far what it hands on differs is measured against what its own stage gave
        it (``carried``), which misses a forward value's difference entering it directly, and a
        statistics difference bounds nothing of it (eager's recomputed router ``div`` in a Mixtral's
        backward after a wrong forward silu): it is no suspect, that value's source is."""
        p, parg = src
        if p in side.only:     # a one-run-only forward op given a difference larger than rounding, or in a
            # stretch given one (the first op of a chain of them is named for the chain, which says nothing of
            # whether a value inside it differs)
            return p in self.given[side.name] or self.stretch_given(side, p) is not None
        pa = p if side is self.a else self.pair_a.get(p)
        k = self.out_row.get((pa, parg)) if pa is not None else None
        if k is None:
            return False
        return self.bad[k] or (self.own_share.statistics_only(k) and
                               self.carries_source(k, (self.best.get(pa), self.inh.get(pa))))

    def _cast_source(self, side: Side, u: int, unproduced: bool):
        """What a one-run-only cast ``u`` given no differing value hands on: never itself, a cast being
        data movement (autocast's, a ``.float()`` the other run need not make).  One that keeps every
        value (a widening or same-dtype cast) of a value no record made hands that value on as it is
        (``UNPRODUCED``: where it differs, the runs' inputs/parameters do: a buffer the other run holds
        in bfloat16).  Otherwise its values differ by its rounding at most: a rounding-size difference
        entering at the paired op it feeds (the first paired record after it; where none follows in
        its stage, the cast itself, as a rounding-size source)."""
        rec = side.recs[u]
        ins = [spec["dtype"] for io, arg, spec in side.flow.walks[u]
               if io == "input" and not op_traits.overwritten(rec["op"], arg)]
        outs = [spec["dtype"] for io, _, spec in side.flow.walks[u] if io == "output"]
        if unproduced and ins and outs and _keeps_values(ins[0], outs[0]):
            return UNPRODUCED
        at = self.place(side, u)[0]
        if at >= len(self.a.recs) or self.a.recs[at]["stage"] != rec["stage"]:
            return self.unmatched(side, u)._replace(weak=ROUNDING), None
        return self.seen_at(at, "", "op", ROUNDING), None

    def handed_on(self, i: int, k: int) -> float:
        """The difference output row ``k`` of paired record ``i`` hands on to what reads it, measured as
        the reader's input row measures it (:attr:`OwnShare.err_in`: relative to the value itself, also
        where the cancellation rule took the output's error relative to its terms).  Why: a one-run-only
        op passing a matrix product's gradient on unchanged (one torch version's ``slice_backward`` of
        a full slice) would otherwise seem to add a difference of its own, its input's error taken
        relative to the product's terms and its output's relative to itself."""
        return self.terms_err.get(i, 0.0) if i in self.regroup.partial_out else self.own_share.err_in[k]

    # ---- a value the runs compute with other ops from values that agree ----------------------------
    def feeds_region(self, root: Root | None, i: int) -> bool:
        """``root`` is a one-run-only op larger than rounding in the gap just before paired record ``i``
        (the first paired record after it in its run is ``i``): the other run's share of a value
        computed with other ops."""
        return root is not None and root.cause == "unmatched" and not root.weak and \
            self.place(self.a if root.side == "a" else self.b, root.index)[0] == i

    def region(self, i: int, hidden: list, outs: list, ins: list) -> str | None:
        """Paired record ``i`` is one run's kernel standing in for another's (other ops of one shape:
        eager's ``stack``, the backward of ``unbind``, for a compiled graph's ``select_backward`` pieces
        and the ``add`` of them), one-run-only ops just before it made what it reads from values that
        agree (``hidden``: :meth:`uncompared`), and its outputs differ: the runs compute that value
        with other ops, so the difference enters in one of them, either run's, and naming the
        one-run-only op would blame one run's share for a kernel the other run's may hold.  A float64
        re-run of the stand-in's two records decides where it can: "op" (its own kernels are off: the
        pair is the source) or "feeders" (they are right: the one-run-only ops stay the suspects);
        unmeasured (statistics, a record that cannot be re-run), "region": the source is the region
        (cause ``region``, :meth:`region_ops`).  Where those ops were given a difference from before
        them, the same holds only where the value differs far more than it (:meth:`_stand_in_grew`;
        ``ins``: ``i``'s differing input rows and their sources).  None where ``i`` is no such stand-in."""
        if i not in self.stand_ins:
            return None
        grew = self._stand_in_grew(i, outs, ins + [(k, src) for k, src in hidden if k is not None])
        if not grew and not any(k is None and self.feeds_region(src[0], i) for k, src in hidden):
            return None
        own = self.own_share.measured(i, [k for k in outs if self.own_share.floats[k]])
        return "region" if own is None else "op" if own else "feeders"

    def _stand_in_grew(self, i: int, outs: list, ins: list) -> bool:
        """Stand-in record ``i`` (:meth:`region`), fed by one-run-only ops just before it, is given a
        difference larger than rounding made before it (through those ops, or at its own differing
        input rows ``ins``: (row, sources)), and its outputs (``outs``) differ more than
        ``origin_amplification`` times the largest relative difference entering the value: those ops'
        inputs' (``carried``) and ``ins``.  Then the value adds a difference of its own, as
        :meth:`grown_in_stretch` says of a stretch, and is the source in place of what it was given;
        noted in ``region_grew`` (what entered, what left, its sources, the first of those one-run-only
        ops: the suspect where a float64 re-run clears ``i``)."""
        share, given, sources, first, fed = self.own_share, 0.0, None, None, False
        for side, rec in ((self.a, i), (self.b, self.pair_b.get(i))):
            found, todo = {rec}, [rec]
            while todo:
                for io, _, spec in side.flow.walks[todo.pop()]:
                    src = self.producer(side, id(spec)) if io == "input" else None
                    if src is None or src[0] not in side.only or src[0] in found or self.place(side, src[0])[0] != i:
                        continue
                    found.add(src[0])
                    todo.append(src[0])
                    first = _min(first, self.unmatched(side, src[0]))
                    fed = fed or src[0] in self.given[side.name]
                    if (got := self.carried[side.name].get(src[0])) is not None:
                        given, sources = max(given, got[0]), _merge(sources, got[1])
        for k, src in ins:
            given, sources = max(given, share.err_in[k]), _merge(sources, src)
            fed = fed or self.carries_source(k, src)
        floats = [k for k in outs if share.floats[k] and share.beyond_rounding(k, output=True)]
        if first is None or not fed or not floats:
            return False
        left = max(share.err[k] for k in floats)
        if not (0.0 < given and left > share.amp * given):
            return False
        self.region_grew[i] = (given, left, sources, first)
        return True

    def region_ops(self, i: int) -> dict:
        """Run name -> the ops each run computes region ``i``'s value with (:meth:`region`): the paired
        record and the one-run-only ops just before it that it reads, directly or through one another."""
        out = {}
        for side, rec in ((self.a, i), (self.b, self.pair_b.get(i))):
            found, todo = [rec], [rec]
            while todo:
                for io, _, spec in side.flow.walks[todo.pop()]:
                    src = self.producer(side, id(spec)) if io == "input" else None
                    if src is not None and src[0] in side.only and src[0] not in found and \
                            self.place(side, src[0])[0] == i:
                        found.append(src[0])
                        todo.append(src[0])
            out[side.name] = [side.recs[k]["op"] for k in sorted(found)]
        return out

    def _span(self, side: Side, u: int) -> tuple:
        """(stage, A index of the paired record before one-run-only op ``u``, of the one after it (None:
        the stage's start or end), run name -> that run's one-run-only compute records between those
        two); the records are kept per gap, which each of its one-run-only ops asks for."""
        stage = side.recs[u]["stage"]
        self.place(side, u)                       # the paired records of each run, in order (:meth:`_anchors`)
        idx, a_idx = self.anchors[side.name][stage][:2]
        n = bisect.bisect_right(idx, u)
        key = (stage, a_idx[n - 1] if n else None, a_idx[n] if n < len(a_idx) else None)
        ops = self.span_ops.get(key)
        if ops is None:
            ops = self.span_ops[key] = {s.name: self._loose_between(s, *key) for s in (self.a, self.b)}
        return (*key, ops)

    def computed_otherwise(self, side: Side, u: int) -> dict:
        """Run name -> the ops of the span one-run-only op ``u`` sits in, where the other run also holds
        compute ops of its own between the same two paired records: both runs compute that stretch with
        other ops (two torch versions' attention, a fused kernel against its pieces), so ``u`` is no
        extra op of one run and is not judged alone (:meth:`region_ops` is the same for a stand-in
        kernel).  Empty where the other run holds none there: ``u`` is an op one run adds."""
        ops = self._span(side, u)[3]
        if not all(ops.values()):
            return {}
        return {s.name: [s.recs[k]["op"] for k in ops[s.name]] for s in (self.a, self.b)}

    def stretch_fails(self, root: Root, k: int) -> bool:
        """Input row ``k`` reads a value of the stretch one-run-only op ``root`` sits in (both runs
        compute it with ops of their own), fails, and differs more than ``origin_amplification`` times
        the largest difference of the values entering the stretch (:meth:`_entering_err`): the stretch,
        judged whole as one op would be, adds a difference of its own that crosses the error line,
        however few roundings of its dtype that is.  Why: torch 2.13's fused attention against torch
        2.5.1's float32 pieces under bfloat16 autocast hands on a value 6e-5 apart, and a softmax 1%
        too large in one run 1e-2 apart: both within the 16 bfloat16 roundings a difference of rounding
        size may reach, but only the second fails where it leaves the stretch."""
        side = self.a if root.side == "a" else self.b
        if not self.bad[k] or root.index not in side.only or not self.computed_otherwise(side, root.index):
            return False
        return self.own_share.err_in[k] > self.own_share.amp * self._entering_err(side, root.index)

    def _entering_err(self, side: Side, u: int) -> float:
        """The largest difference of the recorded values entering the stretch one-run-only op ``u`` sits
        in, in either run: each paired producer's output row (the forward values a backward stretch
        reads among them), and what a one-run-only op before it was given (``carried``)."""
        stage, before, after, _ = self._span(side, u)
        key = (stage, before, after)
        if key not in self.entering_errs:
            err = 0.0
            for s in (self.a, self.b):
                ops = self._loose_between(s, stage, before, after, KINDS)
                inside = set(ops)
                for k in ops:
                    for io, arg, spec in s.flow.walks[k]:
                        if io != "input":
                            break
                        src = self.producer(s, id(spec))
                        if src is None or src[0] in inside:
                            continue
                        p, parg = src
                        if p in s.only:
                            got = self.carried[s.name].get(p)
                            err = max(err, got[0] if got is not None else 0.0)
                            continue
                        pa = p if s is self.a else self.pair_a.get(p)
                        pk = self.out_row.get((pa, parg)) if pa is not None else None
                        if pk is not None:
                            err = max(err, self.handed_on(pa, pk))
            self.entering_errs[key] = err
        return self.entering_errs[key]

    def stretch_bounds(self, side: Side, u: int) -> tuple:
        """(stage, the paired records before and after the stretch one-run-only op ``u`` sits in, as A
        indices or None, the innermost module holding both runs' ops of it): where a ``region`` line
        places the stretch, the same whichever run is A."""
        stage, before, after, ops = self._span(side, u)
        scopes = [s.recs[k]["scope"] for s in (self.a, self.b) for k in ops[s.name]]
        return stage, before, after, common_scope(scopes)

    def stretch_place(self, df: pd.DataFrame, side: Side, u: int) -> str:
        """Where the stretch one-run-only op ``u`` sits in is, said the same whichever run is A: the
        innermost module holding both runs' ops of it and the paired record after it (before it, at
        the stage's end)."""
        stage, before, after, scope = self.stretch_bounds(side, u)
        anchor = after if after is not None else before
        step, rank = int(df["step"].iat[0]), int(df["rank"].iat[0])
        place = f"(in {stage}, step {step} rank {rank})"
        if anchor is not None:
            rec = self.a.recs[anchor]
            place = (f"{'before' if anchor == after else 'after'} {rec['op']} [{rec['scope'] or '<top>'}] "
                     f"({self.named('a', anchor, stage)[1]}, step {step} rank {rank})")
        return f"a stretch each run computes with ops of its own [{scope or '<top>'}], {place}"

    def stretch_given(self, side: Side, u: int) -> tuple | None:
        """The sources of what the stretch one-run-only op ``u`` sits in was given, where both runs compute
        it with ops of their own (:meth:`computed_otherwise`) and a value entering it, in either run,
        carries a difference larger than rounding from before it: a paired record's output that fails or
        carries such a source, another one-run-only op's that passes one on, a forward value read in
        backward that differs, or a value no record made (a parameter, the batch) that differs from the
        other run's it pairs with (:meth:`_unproduced_differing`).  None where every value entering
        it agrees up to rounding.  Why: a stretch is judged whole, as one op would be: no record of the
        other run computes what one of its ops computes, so what it adds is unmeasured; given a
        difference, its own cannot be told apart and the line may not say it computed from agreeing
        values (a layer norm's weight 1% off in one run, read only there)."""
        stage, before, after, ops = self._span(side, u)
        if not all(ops.values()):
            return None
        key = (stage, before, after)
        if key not in self.stretches:
            res, loose, err = None, {}, 0.0
            for s in (self.a, self.b):    # its casts too: what enters through them enters the stretch
                got, loose[s.name], given = self._entering(s, self._loose_between(s, stage, before, after, KINDS),
                                                           stage)
                res, err = _merge(res, got), max(err, given)
            unproduced, gap = self._unproduced_differing(loose, stage)
            res, err = _merge(res, unproduced), max(err, gap)
            # what it passes on is what it was given beyond rounding: a rounding-size difference entering
            # beside it (eager and compiled kernels round apart at every op) is no source of its output's
            strong = tuple(r if r is not None and not r.weak else None for r in res or (None, None))
            self.stretches[key] = (strong if any(r is not None for r in strong) else None), err
        return self.stretches[key][0]

    def grown_in_stretch(self, side: Side, u: int, row: int) -> Root | None:
        """The stretch one-run-only op ``u`` sits in, as a source of its own, where it was given a
        difference larger than rounding (:meth:`stretch_given`) and the input row ``row`` of a paired
        record reading ``u``'s output differs by more than rounding and more than
        ``origin_amplification`` times the largest relative difference entering the stretch in either
        run; else None.  Why: passing the source of what it was given on whatever the stretch hands on
        let a gelu 0.03% off before a layer norm one run decomposes take the blame for an ``rsqrt`` 1%
        off inside it.  Noted in ``grew`` for the line."""
        if u in side.unobserved or self.stretch_given(side, u) is None or not self.own_share.beyond_rounding(row):
            return None
        stage, before, after, _ = self._span(side, u)
        key = (stage, before, after)
        given, err = self.stretches[key][1], self.own_share.err_in[row]
        if not (0.0 < given and err > self.own_share.amp * given):
            return None
        self.grew[key] = (given, max(err, self.grew.get(key, (0.0, 0.0))[1]), self.stretches[key][0])
        return self.unmatched(side, u)

    def _entering(self, side: Side, ops: list, stage: str) -> tuple:
        """(sources of the values entering run ``side``'s share ``ops`` of a stretch that carry a
        difference from before it, or None; [(reader, arg, spec)] of those no record made; the largest
        relative difference a value made by a record hands it, ``inf`` where one it reads has no row
        to measure it by: a one-run-only op's output that carries a source)."""
        inside, res, loose, err = set(ops), None, [], 0.0
        for k in ops:
            if k in self.makers[side.name]:     # what it reads, it reads for a shape at most
                continue
            for io, arg, spec in side.flow.walks[k]:
                if io != "input":
                    break
                src = self.producer(side, id(spec))
                if src is None:
                    loose.append((k, arg, spec))
                    continue
                p, parg = src
                if p in inside:
                    continue
                if side.recs[p]["stage"] != stage:
                    if self.given_differing(side, src):   # a forward value read in backward
                        res = _merge(res, (None, self.unmatched(side, k)._replace(cause="inherited", arg=arg)))
                        err = max(err, self._handed_across(side, src))
                    continue
                if p in side.only:
                    got = self.passes[side.name].get(p)
                    if type(got) is tuple:
                        res, err = _merge(res, got), np.inf
                    continue
                pa = p if side is self.a else self.pair_a.get(p)
                pk = self.out_row.get((pa, parg)) if pa is not None else None
                got = (self.best.get(pa), self.inh.get(pa))
                if pk is not None:
                    err = max(err, self.handed_on(pa, pk))
                    if self.bad[pk] or self.carries_source(pk, got):
                        res = _merge(res, got)
        return res, loose, err

    def _handed_across(self, side: Side, src: tuple) -> float:
        """How far the value ``src`` (index, arg) made in another stage differs, as a reader measures
        it: its paired record's output row; ``inf`` where a one-run-only op made it (no row)."""
        p, parg = src
        if p in side.only:
            return np.inf
        pa = p if side is self.a else self.pair_a.get(p)
        k = self.out_row.get((pa, parg)) if pa is not None else None
        return self.handed_on(pa, k) if k is not None else 0.0

    def _unproduced_differing(self, loose: dict, stage: str) -> tuple | None:
        """The values no record made entering a stretch in both runs (``loose``: run name -> [(reader,
        arg, spec)]), paired by shape, dtype and closest statistics, that differ by more than a few
        roundings of their dtype: a source at their reader, ``inputs`` (``inherited`` in backward, as
        :meth:`source` says of such values), kept in both runs (the earlier reader in its run wins,
        whichever run is A).  Values one run's stretch reads and the other's does not stay unpaired:
        nothing says how they should compare.  Returns (those sources or None, the largest
        statistics distance of the pairs)."""
        cands = []
        for x, (_, _, sa) in enumerate(loose["a"]):
            for y, (_, _, sb) in enumerate(loose["b"]):
                if sa.get("shape") == sb.get("shape") and sa.get("dtype") == sb.get("dtype") and \
                        is_float(sa.get("dtype", "")):
                    gap = stats_distance(sa, sb)
                    if gap <= STRETCH_PAIRING:
                        cands.append((gap, x + y, x, y))
        used_a, used_b, res, widest = set(), set(), None, 0.0
        cause = "inputs" if stage == "forward" else "inherited"
        for gap, _, x, y in sorted(cands):
            if x in used_a or y in used_b:
                continue
            used_a.add(x)
            used_b.add(y)
            widest = max(widest, gap)
            if gap <= ROUNDINGS * ROUNDOFF.get(loose["a"][x][2].get("dtype"), ROUNDOFF["float32"]):
                continue
            for side, (k, arg, _) in ((self.a, loose["a"][x]), (self.b, loose["b"][y])):
                root = self.unmatched(side, k)._replace(cause=cause, arg=arg)
                self.entering_gaps[side.name, k, arg] = gap
                res = _merge(res, (root, None) if cause == "inputs" else (None, root))
        return res, widest

    def _loose_between(self, side: Side, stage: str, before, after, kinds: tuple = (COMPUTE,)) -> list:
        """Run ``side``'s one-run-only records of ``stage`` and ``kinds`` (compute ops: :meth:`_loose`)
        between paired records ``before`` and ``after`` (A indices; None: the stage's start or end)."""
        to_side = (lambda k: k) if side is self.a else self.pair_b.get
        lo = -1 if before is None else to_side(before)
        hi = len(side.recs) if after is None else to_side(after)
        if lo is None or hi is None:
            return []
        out = []
        for kind in kinds:
            loose = self.loose[side.name].get((stage, kind), [])     # sorted
            out += loose[bisect.bisect_right(loose, lo):bisect.bisect_left(loose, hi)]
        return sorted(out)

    # ---- sums the runs group differently (.regroup) ------------------------------------------------
    def row_err(self, i: int, k: int) -> float:
        """The difference output row ``k`` of paired record ``i`` hands on: its error, or where it
        compares two partial sums, the largest difference of the terms they add up."""
        return self.terms_err.get(i, 0.0) if i in self.regroup.partial_out else self.own_share.err[k]

    def _given(self, side: Side, spec_id: int) -> float:
        """The difference run ``side``'s producer of an input hands on: a one-run-only partial sum's
        terms' (``carried``), a paired record's output row's (0.0 where it agrees)."""
        src = self.regroup.producer(side, spec_id)
        if src is None:
            return 0.0
        p, parg = src
        if p in side.only:
            got = self.carried[side.name].get(p)
            return got[0] if got is not None else 0.0
        pa = p if side is self.a else self.pair_a.get(p)
        k = self.out_row.get((pa, parg)) if pa is not None else None
        return self.row_err(pa, k) if k is not None else 0.0

    def reaching(self, i: int, ins: list, outs: list) -> float:
        """For paired record ``i``, a sum the runs group differently: what of its operands'
        differences reaches the total, its outputs' error, or 0.0 where its output is a partial sum
        too (the total is judged where it is read).  Notes in ``terms_err`` the largest difference
        of the terms it was given: of its rows that compare one value, of the other rows' producers
        (each run's: they compare two partial sums of the same terms, see :mod:`.regroup`)."""
        err = self.own_share.err
        self.terms_err[i] = max([err[k] if not self.partial[k] else
                                 max(self._given(self.a, self.spec_a[k]), self._given(self.b, self.spec_b[k]))
                                 for k in ins], default=0.0)
        if i in self.regroup.partial_out:
            return 0.0
        return max((err[k] for k in outs), default=0.0)

    def inside_op(self, side: Side, spec_ids: list) -> Root | None:
        """The earliest one-run-only op other than a sum or cast (past casts) among the producers of
        the inputs ``spec_ids`` of a partial sum of run ``side``, or inside the partial sums they are."""
        found = None
        for spec_id in spec_ids:
            src = self.regroup.producer(side, spec_id)
            if src is None:
                continue
            p = src[0]
            if p in side.only:     # a stretch given a difference passes it on (stretch_given): no suspect
                got = self.inside.get((side.name, p)) if p in self.regroup.partial[side.name] else \
                    None if p in side.unobserved or self.stretch_given(side, p) else self.unmatched(side, p)
            else:
                got = self.inside.get(("p", p if side is self.a else self.pair_a.get(p)))
            found = _min(found, got)
        return found

    def regrouped_own(self, i: int, reach: float, sources, outs: list, ins: list) -> int:
        """Whether regrouped sum ``i`` is where a difference enters: its output is the total in both
        runs, it differs ``origin_amplification`` times more than the terms it adds up, and no
        one-run-only op among them (a hook scaling one group) is a source (estimated, as
        :class:`OwnShare` estimates, :meth:`OwnShare.estimate`).  Its partial sums' rows say nothing either way."""
        amp = self.own_share.amp
        if i in self.regroup.partial_out or not reach > amp * self.terms_err.get(i, 0.0) or any(
                r is not None and r.cause == "unmatched" for src in sources for r in src):
            return NONE
        return self.own_share.estimate(i, outs, ins, reach, self.terms_err.get(i, 0.0))

    # ---- discrete choices the runs made differently (.choice) ---------------------------------------
    def choice_sources(self, i: int, ins: list, stage: str, followed: Root, reach) -> dict:
        """The sources of the differing inputs of paired record ``i``, whose values follow the choice
        ``followed``: an input carrying a choice, or a discrete one, has that choice as its source
        (an index that differs beside values that follow a choice is no rounding's); another input only
        where it is an error row (a difference beyond tolerance that came in by itself), its source as
        always; a difference within tolerance beside it is no source (a choice moves values far more).
        The record itself is never one: how far its outputs moved says nothing of its kernel.  Key -1
        holds ``followed``, which the outputs follow even where the inputs carrying it agree on
        statistics (a one-hot mask of other experts has the same statistics)."""
        out = {-1: self.choices.as_source(followed, stage)}
        for k in ins:
            carried = self.choices.input_root(k)
            if carried is None and self.choices.discrete[k]:
                carried = followed      # an index beside the choice's values: rounding makes no other index
            if carried is not None:
                out[k] = self.choices.as_source(carried, stage)
            elif self.bad[k]:
                out[k] = self.source(i, k, stage, reach if self.partial[k] else None)
            else:
                out[k] = (None, None)
        return out

    # ---- the pass ---------------------------------------------------------------------------------
    def trace(self) -> tuple[np.ndarray, list]:
        """(per row: is it an output where a difference enters; per stage at most one (root, error
        rows) pair: the earliest source of its error rows, or for a stage without error rows its first
        *departure*, the earliest own-stage source of any differing value).  Backward values that
        differ only because forward values do are ``inherited``."""
        df, a, b = self.df, self.a, self.b
        n = len(df)
        origin_rows = np.zeros(n, bool)
        if not self.off_rows.any():
            return origin_rows, []
        uid, off, bad, is_in = self.uid, self.off, self.bad, self.is_in
        starts = np.flatnonzero(np.r_[True, uid[1:] != uid[:-1]])   # rows are in A's record order
        ends = np.r_[starts[1:], len(uid)]
        touched = np.add.reduceat(self.off_rows, starts) > 0
        groups = {int(uid[s0]): (s0, e0) for s0, e0 in zip(starts[touched].tolist(), ends[touched].tolist())}
        stages = df["stage"].to_numpy(object)
        err_stages = set(stages[self.bad_rows].tolist())
        # visiting order: A's records, each one-run-only op of B just before the paired record after it
        visits = [(i, 0, 0) for i in groups] + [(i, 0, 0) for i in a.only if a.recs[i]["kind"] == "op"] + \
            [(self.place(b, j)[0], -1, j) for j in b.only if b.recs[j]["kind"] == "op"]
        stage_src: dict = {}   # (stage, kind, error) -> [earliest own-stage source, earliest inherited one]
        # a departure stage with no one-run-only op is settled by its first larger-than-rounding source:
        # every later source is seen later (the rest of the stage only fills the origin column)
        loose = {st for s in (a, b) for st, _ in self.loose[s.name]}
        settled: set = set()
        for i, order, j in sorted(visits):
            side, u = (b, j) if order else (a, i)
            rec = side.recs[u]
            stage = rec["stage"]
            if stage in settled:
                continue
            if u in side.only:
                chosen = self.choices.follows(side.name, u)
                self.passes[side.name][u] = self.choices.as_source(chosen, stage) if chosen is not None \
                    else self.passed_on(side, u)
                continue
            s0, e0 = groups[i]
            best = inh = None
            ins = [k for k in range(s0, e0) if is_in[k] and off[k]]
            outs = [k for k in range(s0, e0) if off[k] and not is_in[k]]
            # a sum the runs group differently: only its rows that compare one value are evidence, and its
            # own difference is the total's against its terms' (its partial sums' rows say nothing of one)
            regrouped = i in self.regroup.regrouped
            reach = self.reaching(i, ins, outs) if regrouped else None
            if regrouped:
                j = self.pair_b.get(i)
                self.inside["p", i] = _min(
                    self.inside_op(a, [self.spec_a[k] for k in range(s0, e0) if self.partial[k] and is_in[k]]),
                    self.inside_op(b, [self.spec_b[k] for k in range(s0, e0) if self.partial[k] and is_in[k]])
                    if j is not None else None)
            followed = self.choices.followed(i, self.pair_b.get(i))
            flipped: list = []
            if followed is not None:     # its values follow a discrete choice the runs made differently
                srcs = self.choice_sources(i, ins, stage, followed, reach)
                if outs:
                    for kb, kh in srcs.values():
                        best, inh = _min(best, kb), _min(inh, kh)
                    self.best[i], self.inh[i] = best, inh
            else:
                srcs = {k: self.source(i, k, stage, reach if self.partial[k] else None) for k in ins}
                flipped = self.choices.flipped(i, range(s0, e0))
                if flipped:
                    choice = self.seen_at(i, self.args[flipped[0]], "choice", ROUNDING)
                    self.choices.record(i, self.pair_b.get(i), choice, [self.args[k] for k in flipped])
                    origin_rows[flipped] = True
                    outs = [k for k in outs if k not in flipped]    # the rest are judged as any op's outputs
                    if not outs:
                        self.best[i] = choice
            if outs and followed is None:
                # a float64 re-run costs an op's replay twice: only while no larger source is known
                found = stage_src.get((stage, rec["kind"], stage in err_stages))
                hidden = self.uncompared(i, s0, e0)
                # a one-run-only op whose output no row compares may or may not hand on a difference: it is
                # a suspect only where the measured differing inputs (rows) with a source do not explain
                # the outputs' difference (they differ no less than PASS_ON times less).  The second
                # gradient of a tied weight, made by a kernel one run only has, is no origin where the
                # other gradient already carries the difference from later in the backward
                err = self.own_share.err
                measured = [k for k, src in [*((k, srcs[k]) for k in ins), *((k, s) for k, s in hidden if k is not None)]
                            if any(r is not None and not r.weak for r in src)]
                explained = bool(measured) and max(err[k] for k in outs) <= PASS_ON * max(err[k] for k in measured)
                region = None if explained or regrouped else self.region(i, hidden, outs, [(k, srcs[k]) for k in ins])
                if region is not None:   # a value the runs compute with other ops: the region decides
                    own = STRONG if region == "op" else NONE
                else:
                    own = self.regrouped_own(i, reach, srcs.values(), outs, ins) if regrouped else self.own_share(
                        i, outs, ins + [k for k, _ in hidden if k is not None],
                        found is None or found[0] is None or found[0].weak,
                        any(k is None for k, _ in hidden), [k for k in ins if self.noise[k]],
                        any(self.carries_source(k, src) for k, src in [*((k, srcs[k]) for k in ins),
                                                                        *((k, s) for k, s in hidden if k is not None)]))
                inside = self.seen_at(i, "", "region") if region == "region" else None
                if not self.exact and not any(self.own_share.beyond_rounding(k, output=True) for k in outs):
                    # a one-run-only op no row compares, whose reader's outputs differ by rounding only: judged
                    # by what it hands on, a rounding-size difference (as :meth:`source` judges one with a row)
                    hidden = [(k, (src[0]._replace(weak=ROUNDING), src[1]) if k is None and src[0] is not None
                               and src[0].cause == "unmatched" and not src[0].weak else src) for k, src in hidden]
                srcs.update((-1 - m, (inside, None) if inside is not None and self.feeds_region(src[0], i) else src)
                            for m, (k, src) in enumerate(hidden)     # not rows: keys of their own
                            if k is not None or not explained)
                if i in self.region_grew:    # it adds far more than it was given: the region, or its pieces
                    grown = inside or (self.region_grew[i][3] if region == "feeders" else None)
                    if grown is not None:
                        srcs = {-1: (grown, None)}
                if self.constant_pair(i) or (not ins and not hidden and self.extremes_differ(i)):
                    best = self.seen_at(i, "", "constant", CONSTANT)   # the programs differ, no kernel
                    origin_rows[outs] = True
                elif own:      # a collective's own difference is what the other ranks gave it
                    best = self.seen_at(i, "", "received" if brings_values(rec["op"]) else "op", own == WEAK)
                    origin_rows[outs] = True
                else:
                    for kb, kh in srcs.values():
                        best, inh = _min(best, kb), _min(inh, kh)
                    if inside is not None and best is inside:
                        origin_rows[outs] = True
                self.best[i], self.inh[i] = best, inh
            # the sources of its error rows (a stage with some), else of all its differing rows (a departure;
            # an input zero up to rounding is none: only what is computed from it may depart)
            error = stage in err_stages
            rows = [k for k in range(s0, e0) if bad[k]] if error else \
                [k for k in ins + outs if not self.noise[k] and not self.partial[k]]
            if rows:
                eb = eh = None
                if any(not is_in[k] and k not in flipped for k in rows):
                    eb, eh = best, inh
                for k in rows:
                    if is_in[k] or k in flipped:
                        kb, kh = srcs[k] if is_in[k] else (choice, None)
                        eb, eh = _min(eb, kb), _min(eh, kh)
                acc = stage_src.setdefault((stage, rec["kind"], error), [None, None])
                acc[0], acc[1] = _min(acc[0], eb), _min(acc[1], eh)
                if not error and rec["kind"] == "op" and stage not in loose and acc[0] is not None and not acc[0].weak:
                    settled.add(stage)
        out = []
        for stage in ("forward", "backward"):
            errors = int((self.bad_rows & (stages == stage)).sum())
            acc = stage_src.get((stage, "op", bool(errors))) or stage_src.get((stage, "module", bool(errors)))
            if acc is None:
                continue
            # a departure is a stage's own; constants and noise (values zero up to rounding) only where nothing else is
            own = acc[0] if acc[0] is not None and acc[0].weak < CONSTANT else None
            pick = (own or acc[1] or acc[0]) if errors else acc[0]
            if errors:
                self.inherits[stage] = acc[1]
            if pick is None and errors:   # not reached: every differing value has a source; keep the verdict honest
                k = int(np.flatnonzero(self.bad_rows & (stages == stage))[0])
                pick = self.seen_at(int(uid[k]), self.args[k], "op")
            if pick is not None:
                out.append((stage, pick, errors))
        return origin_rows, self._fed_stages(out)

    def _fed_stages(self, picks: list) -> list:
        """A stage without error rows whose values another stage's error rows inherit (:meth:`_feeds_other_stage`)
        is where those rows' difference enters: its source, where larger than rounding, stands as that
        stage's divergence (counting the rows it feeds), in place of a departure of its own."""
        inheriting = {stage: errors for stage, pick, errors in picks if errors and pick.cause == "inherited"}
        out = []
        for stage in ("forward", "backward"):
            other = "backward" if stage == "forward" else "forward"
            mine = next((p for p in picks if p[0] == stage), None)
            fed = self.feeds.get(stage)
            if other in inheriting and fed is not None and not fed.weak and not (mine and mine[2]):
                mine = (stage, fed, inheriting[other])
            if mine is not None:
                out.append(mine)
        return self._unwound(out)

    def _unwound(self, picks: list) -> list:
        """The picks with no stage inheriting from a stage that inherits back.  The forward holds the
        model's ops and an optimizer stepping inside the probe: its error rows may inherit from the
        gradients the backward made from forward values, and 'each from the other' names no source.
        Where the other stage names none larger than rounding, the chain is followed to its start,
        the values each stage hands the other (``feeds``): one larger than rounding is named by the
        stage it is in, which the other inherits from; else the error rows grew from differences of
        rounding size, a precision the runs differ in (cause ``rounding``; where those enter:
        ``grown``), and no op is named."""
        picked = {p[0]: p for p in picks}
        by_stage = dict(picked)
        kernels = {s for s, p, _ in picks if not p.weak and p.cause in ("op", "unmatched", "region")}
        for stage, pick, errors in picks:
            other = "backward" if stage == "forward" else "forward"
            if errors and self._rounding_beside_kernel(pick, self.inherits.get(stage), other in kernels):
                # an op's own difference of rounding size, where the stage's error rows also read values the
                # other stage's kernel moved by more than rounding: those rows follow from that kernel
                by_stage[stage] = (stage, self.inherits[stage], errors)
                continue
            if errors and self._precision_only(pick):
                if other in kernels and self.inherits.get(stage) is not None:
                    # the other stage names a kernel larger than rounding, whose values this stage reads: its
                    # error rows follow from those, beside the rounding of its own precision
                    by_stage[stage] = (stage, self.inherits[stage], errors)
                    continue
                self.grown[stage] = pick
                by_stage[stage] = (stage, pick._replace(cause="rounding"), errors)
        for stage in [s for s, p, errors in picks if errors and p.cause == "inherited"]:
            other = "backward" if stage == "forward" else "forward"
            theirs = picked.get(other)
            # the other stage names where its values part (a departure: within tolerance), except for an
            # optimizer's error rows where the gradients it reads part where the runs' precisions do (FSDP2's
            # bfloat16 copy of the parameters gathered again for the backward): those grew from rounding
            fed_rounding = stage == "forward" and self._precision_only(theirs[1]) if theirs is not None else False
            if theirs is not None and not fed_rounding and \
                    not (theirs[2] and (theirs[1].cause == "inherited" or self._precision_only(theirs[1]))):
                continue
            fed = [(s, self.feeds[s]) for s in (other, stage) if self.feeds.get(s) is not None]
            strong = [(s, root) for s, root in fed if not root.weak]
            if strong:         # the stage holding it names it (a stage without error rows: _fed_stages did)
                owner, root = strong[0]
                if owner == stage or theirs is not None and theirs[2]:
                    by_stage[owner] = (owner, root, by_stage[owner][2])
                continue
            start = self.feeds.get("forward") or self.feeds.get("backward")
            if start is not None and self._precision_only(start):
                self.grown[stage] = start
                by_stage[stage] = (stage, by_stage[stage][1]._replace(cause="rounding"), by_stage[stage][2])
        return [by_stage[s] for s in ("forward", "backward") if s in by_stage]

    @staticmethod
    def _rounding_beside_kernel(pick: Root, inherited: Root | None, other_names_kernel: bool) -> bool:
        """A stage's pick ``pick`` is an op's own difference of rounding size (a paired op, or a
        one-run-only one), while its error rows also inherit ``inherited``, a difference larger than
        rounding from the other stage, which names a kernel.  Why: a tanh 30% too large in a bfloat16
        forward moves the logits' gradient below the floor, and the LM head's backward ``mm`` hands
        that on as a difference of rounding size that looked like its own; the backward's error rows
        follow from the forward values the tanh moved, so the wrong tanh is their source, not it."""
        return pick.weak == ROUNDING and pick.cause in ("op", "unmatched") and other_names_kernel and \
            inherited is not None and not inherited.weak

    def _precision_only(self, root: Root) -> bool:
        """``root`` is a difference of rounding size (an op's own within a few roundings of its dtype,
        a cast's, inputs that differ by so much), picked where no larger one enters, where the runs
        compute in other precisions (:meth:`precisions`): error rows it is the source of grew from
        the rounding of the lower one, and no op is named for them.  Where the runs' dtypes agree
        such a difference is an op's own (a kernel off by less than a few roundings) and stays named."""
        return root.weak == ROUNDING and root.cause in ("op", "unmatched", "inputs", "unrecorded") and \
            self.precisions(root) is not None

    def precisions(self, root: Root) -> tuple | None:
        """(run A's, run B's) float dtype where the runs differ in precision at ``root``: a one-run-only
        op that makes values of another float dtype than it reads (a cast), or a paired record (the
        tensor ``arg``, where given) whose two runs hold other float dtypes, or whose inputs one run
        reads unrounded in a fused kernel (:meth:`fused_reads`); else None."""
        side = self.a if root.side == "a" else self.b
        if root.index in side.only and (stretch := self.stretch_precisions(side, root.index)) is not None:
            return stretch
        if root.index in side.only:
            op = side.recs[root.index]["op"]
            dtypes = {io: sorted({spec["dtype"] for kind, arg, spec in side.flow.walks[root.index]
                                  if kind == io and is_float(spec.get("dtype", "")) and not op_traits.overwritten(op, arg)})
                      for io in ("input", "output")}
            if not dtypes["input"] or not dtypes["output"] or dtypes["input"] == dtypes["output"]:
                return None
            made = ("/".join(dtypes["input"]), "/".join(dtypes["output"]))
            return made if side is self.b else made[::-1]
        i = root.index if side is self.a else self.pair_a.get(root.index)
        rows = (self.uid == i) & (self.df["stage"].to_numpy(object) == side.recs[root.index]["stage"])
        if root.arg:
            rows &= self.args == root.arg
        dtype_a, dtype_b = (self.df[c].to_numpy(object)[rows] for c in ("dtype_a", "dtype_b"))
        mixed = sorted({(x, y) for x, y in zip(dtype_a, dtype_b) if x != y and is_float(x) and is_float(y)})
        if mixed:
            return mixed[0]
        j = self.pair_b.get(i) if i is not None else None
        if j is None:
            return None
        read = [self.fused_reads(s, r, root.arg) for s, r in ((self.a, i), (self.b, j))]
        if read[0] == read[1]:
            return None
        said = []
        for got, s, r in zip(read, (self.a, self.b), (i, j)):
            dtypes = {wide for _, _, wide in got} or {spec["dtype"] for io, arg, spec in s.flow.walks[r]
                                                       if io == "input" and is_float(spec.get("dtype", ""))}
            said.append("/".join(sorted(dtypes)))
        return tuple(said)

    def fused_reads(self, side: Side, u: int, arg: str = "") -> list:
        """(input, dtype, precision) of each float input record ``u`` of run ``side`` reads unrounded:
        made by a record of a compiled kernel it is fused into, whose values the kernel holds at a
        higher precision than their dtype (``fused_precision``: inductor keeps a bfloat16 cast's
        float32 value for the ops fused with it), not as that record holds them.  ``arg``: that
        input only.  Why: the runs then compute that op at other precisions, though both records
        say bfloat16 (a rotary ``mul`` reading ``cos.to(bfloat16)``: eager's rounded, inductor's not)."""
        kernels = fused_kernels(side.recs[u])
        out = []
        if not kernels:
            return out
        for io, name, spec in side.flow.walks[u]:
            if io != "input" or (arg and name != arg) or not is_float(spec.get("dtype", "")):
                continue
            src = self.producer(side, id(spec))
            made = side.recs[src[0]] if src is not None else {}
            wide = (made.get("compiled") or {}).get("fused_precision")
            if wide and kernels & fused_kernels(made):
                out.append((name, spec["dtype"], wide))
        return out

    def stretch_precisions(self, side: Side, u: int) -> tuple | None:
        """(run A's, run B's) precisions in the stretch one-run-only op ``u`` sits in, where both runs
        compute it with ops of their own (:meth:`computed_otherwise`) and they differ: each the float
        dtypes its compute ops there read and those they make ("bfloat16 -> bfloat16/float32");
        else None (the op's own dtypes may still differ: :meth:`precisions`).  Why: torch 2.5.1's
        attention under bfloat16 autocast casts its bfloat16 query, key and value to float32 and
        computes in float32 (its backward too), torch 2.13's fused kernels read and make bfloat16:
        a stretch off by rounding size there grew from the runs' precisions, as an op computing in
        bfloat16 in one run and float32 in the other does."""
        ops = self._span(side, u)[3]
        if not all(ops.values()):
            return None
        said = []
        for s in (self.a, self.b):
            dtypes: dict = {"input": set(), "output": set()}
            for k in ops[s.name]:
                op = s.recs[k]["op"]
                for io, arg, spec in s.flow.walks[k]:
                    if is_float(spec.get("dtype", "")) and not (io == "input" and op_traits.overwritten(op, arg)):
                        dtypes[io].add(spec["dtype"])
            if not dtypes["input"] or not dtypes["output"]:
                return None
            said.append(" -> ".join("/".join(sorted(dtypes[io])) for io in ("input", "output")))
        return tuple(said) if said[0] != said[1] else None

    def grown_where(self, df: pd.DataFrame, stage: str) -> str:
        """Where the rounding-size differences a ``rounding`` stage's error rows grew from enter
        (:meth:`_unwound`), and the precisions the runs compute in there, where they differ."""
        return self.rounding_where(df, self.grown[stage])

    def rounding_at(self, df: pd.DataFrame, root: Root) -> str:
        """Where a stage without error rows first departs, said as :meth:`grown_where` says it, where
        that departure is a difference of rounding size at a precision the runs differ in
        (:meth:`_precision_only`); else "".  A later step's error rows that come after it grew from
        that rounding through the optimizer's updates: no op is named for them."""
        return self.rounding_where(df, root) if self._precision_only(root) else ""

    def paired_b(self, side: str, index: int) -> tuple:
        """(call, place in its stage) of run B's record paired with run ``side``'s record ``index``,
        (None, None) where it is run B's own or unpaired: what :func:`.verdict.call_words` and
        :func:`.verdict.place_words` name beside run A's."""
        j = self.pair_b.get(index) if side == "a" else None
        return (None, None) if j is None else (int(self.b.recs[j]["call"]), int(self.b.seq[j]))

    def named(self, side: str, index: int, stage: str | None = None) -> tuple:
        """(``call N``, ``seq in stage``) of run ``side``'s record ``index`` as a verdict names it: its
        paired record's call and place in run B beside them where they differ, so the words name the
        pair alike whichever run is A."""
        run = self.a if side == "a" else self.b
        rec = run.recs[index]
        call_b, seq_b = self.paired_b(side, index)
        where = f"{stage or rec['stage']}{'' if side == 'a' else ' of run B'}"
        return call_words(int(rec["call"]), call_b), place_words(int(run.seq[index]), where, seq_b)

    def rounding_where(self, df: pd.DataFrame, root: Root) -> str:
        """``root``'s place and the precisions the runs compute in there (:meth:`precisions`)."""
        side = self.a if root.side == "a" else self.b
        dtype_a, dtype_b = self.precisions(root)
        if root.index in side.only and self.stretch_precisions(side, root.index) is not None:
            # each run's dtypes in an order of their own, not run A's first: the same words whichever run is A
            each = "; ".join(f"run {name}: {said}" for said, name in sorted([(dtype_a, "A"), (dtype_b, "B")]))
            return f"{self.stretch_place(df, side, root.index)}, where the runs' ops of it read and make other float " \
                   f"dtypes ({each})"
        rec = side.recs[root.index]
        call, place = self.named(root.side, root.index)
        where = (f"{rec['op']} [{rec['scope'] or '<top>'}] {call} {root.arg + ' ' if root.arg else ''}"
                 f"({place}, step {int(df['step'].iat[0])} rank {int(df['rank'].iat[0])})")
        if root.index in side.only:
            made, read = (dtype_a, dtype_b) if side is self.a else (dtype_b, dtype_a)
            return f"{where}, present only in run {root.side.upper()}, which makes {made} values of {read} ones"
        return f"{where}, where run A computes in {dtype_a} and run B in {dtype_b}"


def trace(df: pd.DataFrame, a: Side, b: Side, pairs: list, rerun=None, same_kernels: bool = False
          ) -> tuple[np.ndarray, list]:
    """(per row: is it an output where a difference enters; per stage at most one :class:`Divergence`),
    by :class:`Lineage`; ``a``, ``b``: the two runs (:class:`Side`), ``pairs``: the alignment's;
    ``same_kernels``: the runs' manifests say the same framework, version and device kind
    (:func:`.exact.same_kernels`), so the part may be otherwise bit-identical."""
    rewired_inputs_not_judged(df, a, b, {i: j for i, j, _ in pairs}, Lineage.makes_constant)
    exact = same_kernels and len(df) > 0 and otherwise_identical(df, a.recs, b.recs, pairs, a.only, b.only,
                                                                 differs(df, 0.0))
    lineage = Lineage(df, a, b, pairs, rerun, exact)
    origin_rows, picks = lineage.trace()
    _partial_sums_not_judged(df, lineage.partial_rows)
    divs, roots = [], []
    unmeasured = (df["rel_l2_err"].isna() & (df["status"] != V.NOT_JUDGED)).to_numpy() if len(df) else np.zeros(0, bool)
    for stage, pick, errors in picks:
        div = _describe(df, lineage, stage, pick, errors, lineage.off_rows & ~lineage.partial_rows)
        if pick.side == "a":
            div.call_b, div.seq_b = lineage.paired_b("a", pick.index)
        if pick.cause == "choice" and a.recs[pick.index]["stage"] != stage:
            div = _after_choice(div, lineage, pick)
        # placed from the recorded errors, or from statistics (equal statistics do not make equal values);
        # an activation whose output's extremes are not its function of its input's is wrong itself, whatever
        # its input: measured, not estimated
        div.approximate = pick.cause in ("op", "region") and pick.index not in lineage.own_share.at_extremes and (
            pick.index in lineage.own_share.estimated
            or bool(unmeasured[(lineage.uid == pick.index) & (df["stage"].to_numpy(object) == stage)].any()))
        _paired_op(df, div, pick)
        if pick.cause == "rounding":
            div.follows = lineage.grown_where(df, stage)
        elif div.departure:
            div.rounding_at = lineage.rounding_at(df, pick)
        if pick.cause == "region":
            div.region = lineage.region_ops(pick.index)
            if pick.index in lineage.region_grew:
                _grown(lineage, div, *lineage.region_grew[pick.index][:3])
        elif pick.cause == "unmatched" and (span := lineage.computed_otherwise(a if pick.side == "a" else b, pick.index)):
            div.cause, div.region = "region", span
            _as_stretch(df, lineage, div, pick, lineage.off_rows & ~lineage.partial_rows)
        if (gap := lineage.entering_gaps.get((pick.side, pick.index, pick.arg))) is not None:
            div.failed = (f"a value no record made, read by a stretch the runs compute with ops of their own, differs "
                          f"from the value the other run's stretch reads there (statistics {gap:.3g} apart)")
        div.unjudged = _unjudged(df, lineage, stage, pick) if errors else ""
        div.amplifier = _unjudged(df, lineage, stage, None, past_line=True) if errors else ""
        divs.append(div)
        roots.append(pick)
    _not_judged(divs)
    if any(div.cause == "random" and not div.departure for div in divs):
        _follow_random(lineage, [pick for div, pick in zip(divs, roots) if div.cause == "random"])
    _choice_rows_not_judged(df, lineage, origin_rows)
    return origin_rows, divs


def _choice_rows_not_judged(df: pd.DataFrame, lineage: Lineage, origin_rows: np.ndarray) -> None:
    """Marks in ``df`` the rows a discrete choice the runs made differently leaves unjudged
    (:meth:`.choice.Choices.unjudged_rows`) ``not judged``, with the choice named: the verdict judges
    nothing past it, so no row, count, sheet or page may call them errors, nor any of them the origin
    of one (the verdict names the choice).  A random op whose draws differ is followed alike
    (:func:`_follow_random`)."""
    reasons = lineage.choices.unjudged_rows(lineage.uid, lineage.args, lineage.pair_b,
                                              lambda root: _choice_where(lineage, root))
    if reasons:
        rows = list(reasons)
        df.loc[rows, "status"] = V.NOT_JUDGED
        df.loc[rows, "reason"] = [reasons[k] for k in rows]
        origin_rows[rows] = False


def _follow_random(lineage: Lineage, picks: list) -> None:
    """Where the runs' values first differ at a random op (``picks``: the verdict's), every random op
    whose draws differ (that one, the part's later dropouts) is followed by data flow as a discrete
    choice is (:meth:`.choice.Choices.record`), so that its differing outputs and what is computed
    from them are not judged, as the verdict says (:func:`_choice_rows_not_judged`)."""
    is_in = np.asarray(lineage.is_in, bool)
    for pick in picks:       # the verdict's, which may be one run's own op
        if pick.side == "b" and pick.index not in lineage.pair_a:
            args = [arg for _, arg, _ in walk(lineage.b.recs[pick.index], inputs=False)]
            lineage.choices.record(None, pick.index, pick._replace(cause="random"), args)
        elif pick.side == "a" and pick.index not in lineage.pair_b:
            args = [arg for _, arg, _ in walk(lineage.a.recs[pick.index], inputs=False)]
            lineage.choices.record(pick.index, None, pick._replace(cause="random"), args)
    drew = lineage.off_rows & ~is_in
    for i in sorted(set(lineage.uid[drew].tolist())):      # paired random ops whose outputs differ
        j = lineage.pair_b.get(i)     # either run's: one framework's dropout is the other's region of ops
        if op_traits.is_random(lineage.a.recs[i]["op"]) or (j is not None and op_traits.is_random(lineage.b.recs[j]["op"])):
            args = [lineage.args[k] for k in np.flatnonzero(drew & (lineage.uid == i)).tolist()]
            lineage.choices.record(i, lineage.pair_b.get(i), lineage.seen_at(i, args[0], "random"), args)


def _choice_where(lineage: Lineage, root: Root) -> str:
    """A choice as a row's reason names it: op, scope, call, the discrete output, its place in its run."""
    side = lineage.a if root.side == "a" else lineage.b
    rec = side.recs[root.index]
    call, place = lineage.named(root.side, root.index)
    return f"{rec['op']} [{rec['scope'] or '<top>'}] {call} {root.arg} ({place})"


PARTIAL_SUMS = ("partial sums the runs group differently: a row of a sum whose terms each run adds in other "
                "groups (a sum in one run only), so its two values need not be one partial sum; the total "
                "is compared where it is read")


def _unjudged(df: pd.DataFrame, lineage: Lineage, stage: str, pick: Root | None, past_line: bool = False) -> str:
    """What the verdict says of the first op of ``stage`` whose own difference the recorded errors
    could not judge (:meth:`OwnShare.estimate`), where no op at or before it is named instead
    (``pick`` None: whatever is named; ``past_line``: the first whose output crosses the error line)."""
    i = (lineage.own_share.unjudged_errors if past_line else lineage.own_share.unjudged).get(stage)
    if i is None or (pick is not None and pick.cause in ("op", "unmatched", "region", "inputs", "unrecorded")
                     and pick.at <= lineage.seq_a[i]):
        return ""
    rec = lineage.a.recs[i]
    rows = df[(df["uid"] == i) & (df["stage"] == stage) & (df["io"] == "output")]
    worst = rows.loc[rows["error"].idxmax()] if len(rows) and rows["error"].notna().any() else None
    size = f"{worst['arg']} off by {worst['error']:.3g}, " if worst is not None else ""
    line = "past the error line" if worst is not None and worst["status"] == V.ERROR else "within tolerance"
    call, place = lineage.named("a", i, stage)
    return (f"{rec['op']} [{rec['scope'] or '<top>'}] {call} ({place}) reads inputs that differ already ({size}{line}) and looks like it amplifies "
            f"them on statistics alone; a statistics difference is a lower bound of the values' difference, so "
            f"whether it adds one of its own cannot be judged: record tensors (task tensor) to measure it")


def _partial_sums_not_judged(df: pd.DataFrame, rows: np.ndarray) -> None:
    """Marks in ``df`` the rows that compare two partial sums (:mod:`.regroup`) not judged, as
    undefined values are: their difference says nothing of either run (the same terms summed in
    other groups), so they count neither as errors nor towards a divergence."""
    if rows.any():
        df.loc[rows, "status"] = V.NOT_JUDGED
        df.loc[rows, "reason"] = PARTIAL_SUMS


def _paired_op(df: pd.DataFrame, div, pick) -> None:
    """Names in ``div`` the op of the other run's record paired with it, where it is another op (an
    eager and a compiled run, two frameworks): the same pair is named whichever run is A."""
    if div.cause in ("op", "random", "unrecorded", "region") and div.side == "a" and len(df):
        paired = set(df["op_b"].to_numpy(object)[df["uid"].to_numpy() == pick.index].tolist()) - {div.op}
        if len(paired) == 1:
            div.other_op = paired.pop()


def _not_judged(divs: list) -> None:
    """Marks the divergences that are no precision verdict.  One at a random op (either run's,
    :func:`op_traits.is_random`) is ``random``: its values depend on each run's generator (eager and
    compiled code, or two devices, draw different numbers).  A backward with error rows after such a
    forward is ``after_random``; one decided on statistics alone after forward inputs that differ
    already, or whose op statistics could not judge (``unjudged``), is ``after_inputs`` (a gradient's
    statistics need not move with its values: nll_loss's gradient has the same statistics for any
    targets)."""
    for div in divs:
        if div.cause in ("op", "unmatched", "unrecorded") and any(
                op_traits.is_random(op) for op in (div.op, div.other_op) if op):
            div.cause = "random"
    for cause, after in (("random", "after_random"), ("inputs", "after_inputs")):
        forward = next((d for d in divs if d.stage == "forward" and d.cause == cause and not d.departure), None)
        if forward is None:
            continue
        for div in divs:
            # on statistics, a backward op that would be named, or was passed over (not named: unjudged)
            if div.stage == "backward" and div.errors and (cause == "random" or div.approximate and div.cause in (
                    "op", "unrecorded") or cause == "inputs" and div.cause == "inherited" and div.unjudged):
                div.cause, div.follows, div.approximate = after, forward.where(), False


def _why(row) -> str:
    """A row's reason, with its statistics error filled in."""
    reason = row.reason
    if reason.startswith("statistics differ: error >") and pd.notna(row.stats_err):
        reason = reason.replace("error >", f"error {row.stats_err:.3g} >", 1)
    return reason


def _size(row) -> str:
    """How far a differing row is off, where its reason (a passing row's) says nothing."""
    if pd.notna(getattr(row, "max_rel_err", np.nan)) or pd.notna(getattr(row, "rel_l2_err", np.nan)):
        parts = [f"{m} {getattr(row, m):.3g}" for m in ("rel_l2_err", "max_rel_err", "max_abs_err")
                 if pd.notna(getattr(row, m, np.nan))]
        return "differs within tolerance: " + ", ".join(parts)
    if pd.notna(row.stats_err):
        return f"differs within tolerance: statistics error {row.stats_err:.3g}"
    return "differs within tolerance"


def _constant_values(row) -> str:
    """What a constant output holds in each run: its value, or its range where it holds several."""
    def held(lo, hi):
        return f"{lo:.6g}" if lo == hi else f"{lo:.6g} .. {hi:.6g}"
    return f"{row.arg} is {held(row.min_a, row.max_a)} in run A, {held(row.min_b, row.max_b)} in run B"


def _after_choice(div: Divergence, lineage: Lineage, pick: Root) -> Divergence:
    """A stage whose differences follow a choice made in the other stage (a backward reading the
    forward's routed values): ``after_choice``, naming the choice."""
    rec = lineage.a.recs[pick.index]
    call, place = lineage.named("a", pick.index)
    div.cause, div.follows, div.approximate = "after_choice", (
        f"{rec['op']} [{rec['scope'] or '<top>'}] {call} {pick.arg} ({place}, step {div.step} rank {div.rank})"), False
    div.failed, div.metrics, div.module = "", {}, None
    return div


def _chose_from(df: pd.DataFrame, i: int, stage: str) -> str:
    """How far the float values choice record ``i`` chose from differ (each input row)."""
    rows = df[(df["uid"] == i) & (df["stage"] == stage) & (df["io"] == "input")]
    floats = [r for r in rows.itertuples() if is_float(r.dtype_a) and is_float(r.dtype_b)]
    return "; ".join(f"{r.arg}: {_size(r) if r.status != V.ERROR else _why(r)}" if r.error > 0 else
                     f"{r.arg}: equal" for r in floats)


def _first_after(df, lineage: Lineage, stage: str, pick: Root, errors: int, off) -> str:
    """Names the first failing (differing, in a stage without error rows) record at or after the place
    of one-run-only ``pick``, or "" where none follows; its paired record's place in run B beside
    run A's, where it is another."""
    later = df[(df["stage"] == stage) & (df["status"] == V.ERROR if errors else off) & (df["seq"] >= pick.at)]
    if errors and not len(later):    # the error rows it makes are another stage's (Lineage._fed_stages)
        later = df[(df["stage"] != stage) & (df["status"] == V.ERROR)]
    if not len(later):
        return ""
    nxt = later.iloc[0]
    elsewhere = f" in {nxt['stage']}" if nxt["stage"] != stage else ""
    seq_b = lineage.paired_b("a", int(nxt["uid"]))[1]
    place = f"#{nxt['seq']}" if seq_b is None or seq_b == nxt["seq"] else f"A #{nxt['seq']}, B #{seq_b}"
    paired = f" (paired with {nxt['op_b']} in run B)" if nxt["op_b"] != nxt["op_a"] else ""
    return (f"the first {'failing' if errors else 'differing'} record after it is "
            f"{nxt['op_a']}{paired} [{nxt['scope'] or '<top>'}] {nxt['arg']} ({place}{elsewhere})")


def _as_stretch(df, lineage: Lineage, div: Divergence, pick: Root, off) -> None:
    """Places the ``region`` line of one-run-only ``pick``, whose stretch both runs compute with ops of
    their own (:meth:`Lineage.computed_otherwise`), at that stretch: the innermost module holding both
    runs' ops of it and the paired record after it (before it, at the stage's end).  Why: which run's
    op the trace meets first there is no fact about the stretch (two layer norms of one scope and call,
    eager's and a compiled graph's, tie, and the earlier record index won): the line named run A's op
    whichever run was A.  Placed at the stretch, it is the same line both ways round."""
    side = lineage.a if pick.side == "a" else lineage.b
    stage, before, after, scope = lineage.stretch_bounds(side, pick.index)
    anchor = after if after is not None else before
    div.scope, div.side, div.stack = scope, "a", []
    if anchor is not None:
        rec = lineage.a.recs[anchor]
        div.op, div.name, div.call, div.kind, div.seq = rec["op"], rec["name"], int(rec["call"]), rec["kind"], \
            int(lineage.seq_a[anchor])
        div.call_b, div.seq_b = lineage.paired_b("a", anchor)
    div.stretch = lineage.stretch_place(df, side, pick.index)
    after_it = _first_after(df, lineage, stage, pick, div.errors, off)
    div.failed = f"its value differs{': ' + after_it if after_it else ''}"
    grew = lineage.grew.get((stage, before, after))
    if grew is not None:
        _grown(lineage, div, *grew)


def _grown(lineage: Lineage, div: Divergence, given: float, left: float, sources) -> None:
    """Says in ``div`` (a ``region`` line) that the value differs ``left``, far more than what enters it
    (``given``, from ``sources``): the value the runs compute with other ops adds a difference of its
    own, larger than the one it was given, and the line may not say it computed from agreeing values."""
    first = next((r for r in sources or () if r is not None), None)
    div.entered = f"by at most {given:.3g}" + (f", from {_source_words(lineage, first)}" if first else "")
    div.failed += (f"; that differs {left:.3g}, {left / given:.3g} times more than what enters it: the "
                   f"value adds a difference of its own")
    div.approximate = True      # judged on the recorded errors: no float64 re-run measures such a value


def _source_words(lineage: Lineage, root: Root) -> str:
    """Where a source is, in words that are the same whichever run is A: op, scope, call, the tensor
    where it is seen, and the run holding it where only one run does."""
    side = lineage.a if root.side == "a" else lineage.b
    rec = side.recs[root.index]
    only = f", present only in run {root.side.upper()}" if root.index in side.only else ""
    return f"{rec['op']} [{rec['scope'] or '<top>'}] call {int(rec['call'])}{' ' + root.arg if root.arg else ''}{only}"


def _describe(df, lineage: Lineage, stage, pick: Root, errors, off) -> Divergence:
    i, side, arg, cause = pick.index, pick.side, pick.arg, pick.cause
    a, b = lineage.a, lineage.b
    run = a if side == "a" else b
    rec = run.recs[i]
    other = "B" if side == "a" else "A"
    at = df[(df["uid"] == i) & (df["stage"] == stage) & off] if side == "a" else df.iloc[:0]
    step, rank = int(df["step"].iat[0]), int(df["rank"].iat[0])
    module = None
    if cause in ("op", "unrecorded", "received", "region"):
        rows = at[at["io"] == "output"] if cause != "unrecorded" else at[at["arg"] == arg]
        failed = "; ".join(f"{r.arg}: {_why(r) if r.reason else _size(r)}" for r in rows.itertuples()) \
            or "outputs differ"
        if cause == "op" and errors and (rows["status"] != V.ERROR).all():
            failed += f" (below the error line, but the {errors} error rows after it start here)"
        if cause == "unrecorded":
            failed = f"{arg} differs although the op that produced it agreed ({failed})"
        scopes = df[(df["kind"] == "module") & (df["stage"] == stage) & (df["io"] == "output") & off]["scope"].unique()
        scope = rec["scope"]
        inside = [m for m in scopes if scope == m or scope.startswith(m + ".")]
        module = max(inside, key=lambda m: m.count(".")) if inside else None
    elif cause in ("inputs", "inherited", "noise", "rounding"):
        rows = at[at["arg"] == arg]
        failed = "; ".join(_why(r) if r.reason else _size(r) for r in rows.itertuples()) or "values differ"
    elif cause == "choice":
        rows = at[at["arg"] == arg]
        failed = "; ".join(f"{r.arg}: {_why(r) if r.reason else _size(r)}" for r in rows.itertuples()) \
            or f"{arg} differs"
        failed += f"; the values it chose from agree within tolerance ({_chose_from(df, i, stage)})"
    elif cause == "constant":
        rows = at[at["io"] == "output"]
        failed = "; ".join(_constant_values(r) for r in rows.itertuples()) or f"made in run {side.upper()} only"
    else:   # unmatched: name the first failing (differing) record after it
        after = _first_after(df, lineage, stage, pick, errors, off)
        failed = f"no counterpart in run {other}" + (f"; {after}" if after else "")
        rows = at.iloc[:0]
    row = rows.iloc[0] if len(rows) else None
    met = {m: row[m] for m in [*TENSOR_METRICS, "stats_err"] if row is not None and pd.notna(row[m])}
    frames = user_frames(run.part, rec) if rec.get("stack") is not None else []
    return Divergence(stage=stage, step=step, rank=rank, seq=int(run.seq[i]),
                      scope=rec["scope"], op=rec["op"], name=rec["name"], call=int(rec["call"]), kind=rec["kind"],
                      failed=failed, metrics=met, stack=list(frames), module=module, cause=cause, side=side,
                      arg=arg, errors=errors, departure=not errors, recomputed=bool(rec.get("recompute")))
