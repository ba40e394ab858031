"""Where the differences come from: each differing value followed back through the records' data
flow to the op where it enters.

Thresholds decide *whether* two runs disagree; lineage decides *where*.  An op is where a difference
enters when its outputs differ while its inputs agree, or when its outputs differ by more than its
inputs' differences carried through it: measured by re-running it in float64 on both runs' recorded
inputs where tensors are saved and the framework is importable (:mod:`.rerun`), else estimated on
the recorded errors (outputs ``origin_amplification`` times further off than inputs; approximate).
Differences below the threshold count: a stage with no error rows still has a first *departure*."""

from __future__ import annotations

import bisect
from typing import NamedTuple

import numpy as np
import pandas as pd

from ...core import op_traits
from ...records.reader import Part
from ...standards import statistics as S, verdicts as V
from ...standards.loader import is_float, standard
from .columns import TENSOR_METRICS
from .pairing import _Flow, _frames
from .rerun import ROUNDOFF
from .verdict import Divergence


class Root(NamedTuple):
    """Where a difference enters, ordered by the stage position where it is seen; a difference of
    rounding size (``weak``) only where no larger one enters."""

    weak: bool      # an op's own difference no larger than a few roundings of its dtype
    seq: int        # position in the stage (run A's order)
    index: int      # the record (of ``side``'s run)
    side: str       # "a" or "b"
    arg: str        # the tensor, for the causes seen at a tensor (inputs, inherited, unrecorded)
    cause: str      # Divergence.cause


# statistics of equal values may differ by their own float32 accumulation: below this relative
# error, statistics-only rows count as equal (saved tensors count every bit)
STATS_NOISE = 1e-6


def differs(df: pd.DataFrame) -> np.ndarray:
    """Per row: do the runs' values differ at all (below the threshold too)?  Undefined values never do."""
    status = df["status"].to_numpy(object)
    err = df["error"].to_numpy(np.float64)
    measured = df["rel_l2_err"].notna().to_numpy()
    out = np.where(measured, err > 0, err > STATS_NOISE) | (status == V.ERROR) | (status == V.WARNING) | (df["checksum_match"] == "unequal").to_numpy()
    return out & (status != V.NOT_JUDGED)


NONE, WEAK, STRONG = 0, 1, 2    # an op's own difference: none, of rounding size, larger
ROUNDINGS = 16                  # "rounding size": up to this many unit roundoffs of the dtype (relative)
PASS_ON = 1.25                  # outputs relatively no further off than this x the inputs: passed on


class OwnShare:
    """Decides, per paired record of run A, whether its op adds a difference of its own."""

    def __init__(self, df, recs_a, recs_b, pair_b, rerun):
        self.amp = float(standard("compare_standards").get("origin_amplification", 10.0))
        self.err = np.nan_to_num(df["error"].to_numpy(np.float64), nan=0.0, posinf=np.inf).tolist()
        self.dtype_a, self.dtype_b = df["dtype_a"].tolist(), df["dtype_b"].tolist()
        # per row: both floats; the unit roundoff of the lower precision (one lookup per dtype pair)
        codes, pairs = S.factorize(list(zip(self.dtype_a, self.dtype_b)))
        self.floats = np.array([is_float(x) and is_float(y) for x, y in pairs], bool)[codes].tolist()
        self.unit = np.array([ROUNDOFF.get(V.lower_precision(x, y), ROUNDOFF["float32"]) for x, y in pairs],
                             np.float64)[codes].tolist()
        self.df = df
        self.recs_a, self.recs_b, self.pair_b, self.rerun = recs_a, recs_b, pair_b, rerun
        self.estimated: set = set()    # records with differing inputs decided by the recorded errors

    def __call__(self, i: int, outs: list, ins: list, measure: bool = True) -> int:
        """``outs``/``ins``: the record's differing output/input rows; ``measure``: whether a float64
        re-run may decide (not where an earlier larger-than-rounding source is already found)."""
        if not outs:
            return NONE
        if not ins:                  # inputs agree, outputs do not
            return STRONG if any(self.err[k] > ROUNDINGS * self.unit[k] for k in outs) else WEAK
        floats = [k for k in outs if self.floats[k]]
        if not floats:
            return NONE              # a discrete output (index, mask) follows any input difference
        out_err, in_err = max(self.err[k] for k in floats), max(self.err[k] for k in ins)
        if out_err <= ROUNDINGS * max(self.unit[k] for k in floats):
            return NONE              # a rounding-size output difference on differing inputs: nothing of its own
        j = self.pair_b.get(i)
        # re-run an op whose output is relatively further off than its inputs (an amplifier, or an error
        # of its own): one that passes its inputs' difference on no larger adds nothing measurable
        if measure and self.rerun is not None and j is not None and out_err > PASS_ON * in_err:
            if not hasattr(self, "args"):
                self.args, self.data_a, self.data_b = (self.df[c].tolist() for c in ("arg", "data_a", "data_b"))
            own = self.rerun.own(self.recs_a[i], self.recs_b[j],
                                 [(self.args[k], self.data_a[k], self.data_b[k],
                                   V.lower_precision(self.dtype_a[k], self.dtype_b[k])) for k in floats])
            if own is not None:
                return STRONG if own else NONE
        self.estimated.add(i)
        return STRONG if out_err > self.amp * in_err else NONE


def trace(df: pd.DataFrame, part_a: Part, recs_a: list, recs_b: list, al, seq_a: list, seq_b: list,
          flow_a: _Flow, flow_b: _Flow, rerun=None, unobserved: tuple = (set(), set())) -> tuple[np.ndarray, list]:
    """(per row: is it an output where a difference enters; per stage at most one :class:`Divergence`).

    One pass over run A's records in execution order follows each differing value (at any size)
    back to where it started: the op that produced it, when that op adds a difference of its own
    (:class:`OwnShare`); an op present in one run only, producing it or standing between the
    agreeing producer and the differing consumer; or no recorded op at all (the runs differ at their
    inputs/parameters).  Each record keeps the earliest such source, so the pass is linear in the
    records.  A stage's divergence is the earliest source of its error rows; a stage without error
    rows gets its first *departure* (the earliest own-stage source of any differing value).  Backward
    values that differ only because forward values do are ``inherited``.  ``unobserved``: each run's
    one-run-only records that the other framework runs where no probe sees them (an unobservable
    backward kernel): never a suspect, a difference passes through them as through a cast."""
    n = len(df)
    status = df["status"].to_numpy(object)
    bad = status == V.ERROR
    off = differs(df) if n else np.zeros(0, bool)
    origin_rows = np.zeros(n, bool)
    if not off.any():
        return origin_rows, []
    bad_rows, off_rows = bad.copy(), off.copy()
    uid = df["uid"].to_numpy(np.int64)
    is_in = (df["io"] == "input").to_numpy()
    args = df["arg"].to_numpy(object)
    # the differing outputs: (record, arg) -> row
    out_row = {(int(uid[k]), args[k]): k for k in np.flatnonzero(off & ~is_in)}
    starts = np.flatnonzero(np.r_[True, uid[1:] != uid[:-1]])   # rows are in A's record order
    ends = np.r_[starts[1:], len(uid)]
    touched = np.add.reduceat(off, starts) > 0
    groups = {int(uid[s0]): (s0, e0) for s0, e0 in zip(starts[touched].tolist(), ends[touched].tolist())}
    # plain lists: element access in the pass below is many times cheaper than numpy's
    err_stages = set(df["stage"].to_numpy(object)[bad].tolist())
    bad, off, is_in = bad.tolist(), off.tolist(), is_in.tolist()
    pair_b = {i: j for i, j, _ in al.pairs}
    own_share = OwnShare(df, recs_a, recs_b, pair_b, rerun)
    only_a = set(al.only_a)

    def unmatched_ops(recs, idx):   # per stage: sorted indices of one-run-only op records, compute ops first
        out: dict = {}
        for i in idx:
            r = recs[i]
            if r["kind"] == "op":
                out.setdefault((r["stage"], op_traits.is_cast(r["op"])), []).append(i)
        return out
    loose_a = unmatched_ops(recs_a, [i for i in al.only_a if i not in unobserved[0]])
    loose_b = unmatched_ops(recs_b, [i for i in al.only_b if i not in unobserved[1]])

    def between(recs_loose, stage, lo, hi):
        for cast in (False, True):
            cand = recs_loose.get((stage, cast), ())
            k = bisect.bisect_right(cand, lo)
            if k < len(cand) and cand[k] < hi:
                return cand[k]
        return None

    best: dict = {}     # record -> earliest own-stage source of its differing outputs (a root tuple)
    inh: dict = {}      # record -> earliest inherited source
    usrc: dict = {}     # one-run-only record of A -> (best, inherited) of what it passes on

    def root(seq, i, side, arg, cause, weak=False):
        return Root(weak, seq, i, side, arg, cause)

    def mn(x, y):
        return y if x is None else x if y is None else min(x, y)

    spec_a, spec_b = df["spec_a"].tolist(), df["spec_b"].tolist()   # id() of each row's specs
    src_of_a, src_of_b = flow_a.src.get, flow_b.src.get

    def source(r, k, stage):
        """(own-stage root, inherited root) of input row ``k`` of record ``r``, whose value differs."""
        arg = args[k]
        src, srcb = src_of_a(spec_a[k]), src_of_b(spec_b[k])
        if src is not None:
            p, parg = src
            if recs_a[p]["stage"] != stage:
                return None, root(seq_a[r], r, "a", arg, "inherited")
            if p in only_a:
                return usrc.get(p) or (root(seq_a[p], p, "a", "", "unmatched"), None)
            if (p, parg) in out_row:
                return best.get(p), inh.get(p)
            u = between(loose_a, stage, p, r)
            if u is not None:
                return root(seq_a[u], u, "a", "", "unmatched"), None
            jp, jr = pair_b.get(p), pair_b.get(r)
            if jp is not None and jr is not None:
                u = between(loose_b, recs_b[jr]["stage"], jp, jr)
                if u is not None:
                    return root(seq_a[r], u, "b", "", "unmatched"), None
            return root(seq_a[r], r, "a", arg, "unrecorded"), None
        if srcb is not None:
            pb = srcb[0]
            if pb in al_only_b:
                return root(seq_a[r], pb, "b", "", "unmatched"), None
            if recs_b[pb]["stage"] != stage:
                return None, root(seq_a[r], r, "a", arg, "inherited")
        if stage != "forward":   # backward values come from the forward (views autograd makes are not recorded)
            return None, root(seq_a[r], r, "a", arg, "inherited")
        return root(seq_a[r], r, "a", arg, "inputs"), None

    def uncompared(i, s0, e0):
        """Record ``i``'s inputs that have no row (a translation compares no transposed operand) but
        whose producer's output row differs: (that row, standing for the input; the input's source)."""
        compared = {spec_a[k] for k in range(s0, e0) if is_in[k]}
        overwritten = op_traits.overwrites_first_input(recs_a[i]["op"])
        out = []
        for io, arg, spec in flow_a.walks[i]:
            if io != "input" or id(spec) in compared or (overwritten and arg == "input.0"):
                continue
            src = src_of_a(id(spec))
            k = out_row.get(src) if src is not None else None
            if k is None:
                continue
            p = src[0]
            out.append((k, (None, root(seq_a[i], i, "a", arg, "inherited")) if recs_a[p]["stage"] != recs_a[i]["stage"]
                        else (best.get(p), inh.get(p))))
        return out

    al_only_b = set(al.only_b) - unobserved[1]
    stage_src: dict = {}   # (stage, kind, error) -> [earliest own-stage source, earliest inherited one]
    # a departure stage with no one-run-only op is settled by its first larger-than-rounding source:
    # every later source is seen later (the rest of the stage only fills the origin column)
    loose = {st for st, _ in loose_a} | {st for st, _ in loose_b}
    settled: set = set()
    for i in sorted(groups.keys() | {i for i in al.only_a if recs_a[i]["kind"] == "op"}):
        rec = recs_a[i]
        stage = rec["stage"]
        if stage in settled:
            continue
        if i in only_a:   # what a one-run-only op passes on: itself, unless a cast passes on its input's
            own = (root(seq_a[i], i, "a", "", "unmatched"), None)
            follow = op_traits.is_cast(rec["op"]) or i in unobserved[0]
            res = None
            for io, arg, spec in flow_a.walks[i]:
                if io != "input":
                    break
                src = flow_a.src.get(id(spec))
                if src is None or recs_a[src[0]]["stage"] != stage:
                    continue
                p, parg = src
                if p in only_a:   # a chain of one-run-only ops: its first one
                    up = usrc[p]
                    res = up if res is None else (mn(res[0], up[0]), mn(res[1], up[1]))
                    continue
                pk = out_row.get((p, parg))
                if pk is not None and (follow or bad[pk]):
                    res = (best.get(p), inh.get(p)) if res is None else (mn(res[0], best.get(p)), mn(res[1], inh.get(p)))
            usrc[i] = res if res is not None and (res[0] is not None or res[1] is not None) else own
            continue
        s0, e0 = groups[i]
        b = h = None
        ins = [k for k in range(s0, e0) if is_in[k] and off[k]]
        outs = [k for k in range(s0, e0) if off[k] and not is_in[k]]
        srcs = {k: source(i, k, stage) for k in ins}
        if outs:
            # a float64 re-run costs an op's replay twice: only while no larger source is known
            found = stage_src.get((stage, rec["kind"], stage in err_stages))
            hidden = uncompared(i, s0, e0)
            own = own_share(i, outs, ins + [k for k, _ in hidden], found is None or found[0] is None or found[0].weak)
            srcs.update((-1 - n, src) for n, (_, src) in enumerate(hidden))     # not rows: keys of their own
            if own:
                b = root(seq_a[i], i, "a", "", "op", own == WEAK)
                origin_rows[outs] = True
            else:
                for kb, kh in srcs.values():
                    b, h = mn(b, kb), mn(h, kh)
            best[i], inh[i] = b, h
        # the sources of its error rows (a stage with some), else of all its differing rows (a departure)
        error = stage in err_stages
        rows = [k for k in range(s0, e0) if bad[k]] if error else ins + outs
        if rows:
            eb = eh = None
            if any(not is_in[k] for k in rows):
                eb, eh = b, h
            for k in rows:
                if is_in[k]:
                    kb, kh = srcs[k]
                    eb, eh = mn(eb, kb), mn(eh, kh)
            acc = stage_src.setdefault((stage, rec["kind"], error), [None, None])
            acc[0], acc[1] = mn(acc[0], eb), mn(acc[1], eh)
            if not error and rec["kind"] == "op" and stage not in loose and acc[0] is not None and not acc[0].weak:
                settled.add(stage)
    out = []
    stages = df["stage"].to_numpy(object)
    for stage in ("forward", "backward"):
        errors = int((bad_rows & (stages == stage)).sum())
        acc = stage_src.get((stage, "op", bool(errors))) or stage_src.get((stage, "module", bool(errors)))
        if acc is None:
            continue
        pick = acc[0] or acc[1] if errors else acc[0]   # a departure is a stage's own
        if pick is None and errors:   # not reached: every differing value has a source; keep the verdict honest
            k = int(np.flatnonzero(bad_rows & (stages == stage))[0])
            pick = root(seq_a[int(uid[k])], int(uid[k]), "a", args[k], "op")
        if pick is None:
            continue
        div = _describe(df, part_a, recs_a, recs_b, seq_a, seq_b, stage, pick, errors, off_rows)
        div.approximate = pick.cause == "op" and pick.index in own_share.estimated
        out.append(div)
    return origin_rows, out


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


def _describe(df, part_a, recs_a, recs_b, seq_a, seq_b, stage, pick, errors, off) -> Divergence:
    _, seq, i, side, arg, cause = pick
    rec = recs_a[i] if side == "a" else recs_b[i]
    at = df[(df["uid"] == i) & (df["stage"] == stage) & off] if side == "a" else df.iloc[:0]
    step, rank = int(df["step"].iat[0]), int(df["rank"].iat[0])
    module = None
    if cause in ("op", "unrecorded"):
        rows = at[at["io"] == "output"] if cause == "op" else at[at["arg"] == arg]
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
    elif cause in ("inputs", "inherited"):
        rows = at[at["arg"] == arg]
        failed = "; ".join(_why(r) if r.reason else _size(r) for r in rows.itertuples()) or "values differ"
    else:   # unmatched: name the first failing (differing) record after it
        later = df[(df["stage"] == stage) & (df["status"] == V.ERROR if errors else off) & (df["seq"] >= seq)]
        nxt = later.iloc[0] if len(later) else None
        what = "failing" if errors else "differing"
        failed = (f"no counterpart in run {'B' if side == 'a' else 'A'}; the first {what} record after it is "
                  f"{nxt['op_a']} [{nxt['scope'] or '<top>'}] {nxt['arg']} (#{nxt['seq']})") if nxt is not None \
            else f"no counterpart in run {'B' if side == 'a' else 'A'}"
        rows = at.iloc[:0]
    row = rows.iloc[0] if len(rows) else None
    met = {m: row[m] for m in [*TENSOR_METRICS, "stats_err"] if row is not None and pd.notna(row[m])}
    frames = _frames(part_a, rec) if side == "a" and rec.get("stack") is not None else []
    return Divergence(stage=stage, step=step, rank=rank, seq=int(seq_a[i] if side == "a" else seq_b[i]),
                      scope=rec["scope"], op=rec["op"], name=rec["name"], call=int(rec["call"]), kind=rec["kind"],
                      failed=failed, metrics=met, stack=list(frames), module=module, cause=cause, side=side,
                      arg=arg, errors=errors, departure=not errors)
