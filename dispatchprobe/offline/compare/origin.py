"""Where the differences come from: each differing value followed back through the records' data
flow to the op where it enters."""

from __future__ import annotations

import bisect

import numpy as np
import pandas as pd

from ...core import op_traits
from ...records.reader import Part
from ...standards import verdicts as V
from ...standards.loader import standard
from .columns import TENSOR_METRICS
from .pairing import _Flow, _frames
from .verdict import Divergence


def _origins(df: pd.DataFrame) -> np.ndarray:
    """Per row: does its op introduce the error?  Yes when one of its outputs is an error and the
    worst output relative error exceeds ``origin_amplification`` times the worst input's (inputs that
    agree exactly give 0, so any failing output qualifies).  Inherited errors (inputs already as far
    off as the outputs) do not qualify, in forward or backward."""
    n = len(df)
    if not n:
        return np.zeros(0, dtype=bool)
    amp = float(standard("compare_standards").get("origin_amplification", 10.0))
    uid = df["uid"].to_numpy()
    is_out = (df["io"] == "output").to_numpy()
    status = df["status"].to_numpy(object)
    err = df["error"].to_numpy(np.float64)
    err = np.where(np.isnan(err), 0.0, err)
    key = pd.Series(uid)
    in_err = pd.Series(np.where(is_out, 0.0, err)).groupby(key).transform("max").to_numpy()
    out_bad = is_out & (status == V.ERROR)
    op_out_bad = pd.Series(out_bad).groupby(key).transform("any").to_numpy()
    out_err = pd.Series(np.where(out_bad, err, 0.0)).groupby(key).transform("max").to_numpy()
    return op_out_bad & (out_err > amp * in_err)



def _divergences(df: pd.DataFrame, part_a: Part, recs_a: list, recs_b: list, al, seq_a: list, seq_b: list,
                 flow_a: _Flow, flow_b: _Flow) -> list:
    """For each stage with error rows, the :class:`Divergence` they come from.

    One pass over run A's records in execution order follows each differing value (a warning or an
    error) back to where it started: the op that produced it, when that op's outputs differ while its
    inputs agree (or its error exceeds its inputs' ``origin_amplification``-fold); an op present in one
    run only, producing it or standing between the agreeing producer and the failing consumer; or no
    recorded op at all (the runs differ at their inputs/parameters).  Each record keeps the earliest
    such source, so the pass is linear in the records.  A stage's divergence is the earliest source of
    its error rows; backward values that differ only because forward values do are ``inherited``."""
    status = df["status"].to_numpy(object)
    bad = status == V.ERROR
    if not bad.any():
        return []
    bad_rows = bad.copy()
    off = bad | (status == V.WARNING)
    uid = df["uid"].to_numpy(np.int64)
    is_in = (df["io"] == "input").to_numpy()
    args = df["arg"].to_numpy(object)
    origin = df["origin"].to_numpy(bool)
    # the differing outputs: (record, arg) -> row
    out_row = {(int(uid[k]), args[k]): k for k in np.flatnonzero(off & ~is_in)}
    starts = np.flatnonzero(np.r_[True, uid[1:] != uid[:-1]])   # rows are in A's record order
    ends = np.r_[starts[1:], len(uid)]
    differs = np.add.reduceat(off, starts) > 0
    groups = {int(uid[s0]): (s0, e0) for s0, e0 in zip(starts[differs].tolist(), ends[differs].tolist())}
    # plain lists: element access in the pass below is many times cheaper than numpy's
    bad, off, is_in, origin = bad.tolist(), off.tolist(), is_in.tolist(), origin.tolist()
    pair_b = {i: j for i, j, _ in al.pairs}
    only_a = set(al.only_a)

    def unmatched_ops(recs, idx):   # per stage: sorted indices of one-run-only op records, compute ops first
        out: dict = {}
        for i in idx:
            r = recs[i]
            if r["kind"] == "op":
                out.setdefault((r["stage"], op_traits.is_cast(r["op"])), []).append(i)
        return out
    loose_a, loose_b = unmatched_ops(recs_a, al.only_a), unmatched_ops(recs_b, al.only_b)

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

    def root(seq, i, side, arg, cause):   # ordered by the stage position where it is seen
        return (seq, i, side, arg, cause)

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

    al_only_b = set(al.only_b)
    stage_src: dict = {}   # (stage, kind) -> [earliest own-stage source, earliest inherited one]
    for i in sorted(groups.keys() | {i for i in al.only_a if recs_a[i]["kind"] == "op"}):
        rec = recs_a[i]
        stage = rec["stage"]
        if i in only_a:   # what a one-run-only op passes on: itself, unless a cast passes on its input's
            own = (root(seq_a[i], i, "a", "", "unmatched"), None)
            follow = op_traits.is_cast(rec["op"])
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
        if any(off[k] and not is_in[k] for k in range(s0, e0)):
            if origin[s0] or not ins:
                b = root(seq_a[i], i, "a", "", "op")
            else:
                for k in ins:
                    kb, kh = source(i, k, stage)
                    b, h = mn(b, kb), mn(h, kh)
            best[i], inh[i] = b, h
        errs = [k for k in range(s0, e0) if bad[k]]
        if not errs:
            continue
        eb = eh = None
        if any(not is_in[k] for k in errs):
            eb, eh = b, h
        for k in errs:
            if is_in[k]:
                kb, kh = source(i, k, stage)
                eb, eh = mn(eb, kb), mn(eh, kh)
        acc = stage_src.setdefault((stage, rec["kind"]), [None, None])
        acc[0], acc[1] = mn(acc[0], eb), mn(acc[1], eh)
    out = []
    for stage in ("forward", "backward"):
        acc = stage_src.get((stage, "op")) or stage_src.get((stage, "module"))
        if acc is None:
            continue
        errors = int((bad_rows & (df["stage"] == stage).to_numpy()).sum())
        pick = acc[0] or acc[1]
        if pick is None:   # not reached: every differing value has a source; keep the verdict honest anyway
            k = int(np.flatnonzero(bad_rows & (df["stage"].to_numpy(object) == stage))[0])
            pick = root(seq_a[int(uid[k])], int(uid[k]), "a", args[k], "op")
        out.append(_describe(df, part_a, recs_a, recs_b, seq_a, seq_b, stage, pick, errors))
    return out


def _why(row) -> str:
    """A row's reason, with its statistics error filled in."""
    reason = row.reason
    if reason.startswith("statistics differ: error >") and pd.notna(row.stats_err):
        reason = reason.replace("error >", f"error {row.stats_err:.3g} >", 1)
    return reason


def _describe(df, part_a, recs_a, recs_b, seq_a, seq_b, stage, pick, errors) -> Divergence:
    seq, i, side, arg, cause = pick
    rec = recs_a[i] if side == "a" else recs_b[i]
    at = df[(df["uid"] == i) & (df["stage"] == stage)] if side == "a" else df.iloc[:0]
    step, rank = int(df["step"].iat[0]), int(df["rank"].iat[0])
    module = None
    if cause in ("op", "unrecorded"):
        rows = at[(at["io"] == "output") & at["status"].isin((V.ERROR, V.WARNING))] if cause == "op" \
            else at[at["arg"] == arg]
        failed = "; ".join(f"{r.arg}: {_why(r)}" for r in rows.itertuples() if r.reason) or "outputs differ"
        if cause == "op" and (rows["status"] != V.ERROR).all():
            failed += f" (below the error line, but the {errors} error rows after it start here)"
        if cause == "unrecorded":
            failed = f"{arg} differs although the op that produced it agreed ({failed})"
        scopes = df[(df["kind"] == "module") & (df["stage"] == stage) & (df["io"] == "output")
                    & df["status"].isin((V.ERROR, V.WARNING))]["scope"].unique()
        scope = rec["scope"]
        inside = [m for m in scopes if scope == m or scope.startswith(m + ".")]
        module = max(inside, key=lambda m: m.count(".")) if inside else None
    elif cause in ("inputs", "inherited"):
        rows = at[at["arg"] == arg]
        failed = "; ".join(_why(r) for r in rows.itertuples() if r.reason) or "values differ"
    else:   # unmatched: name the first failing record after it
        later = df[(df["stage"] == stage) & (df["status"] == V.ERROR) & (df["seq"] >= seq)]
        nxt = later.iloc[0] if len(later) else None
        failed = (f"no counterpart in run {'B' if side == 'a' else 'A'}; the first failing record after it is "
                  f"{nxt['op_a']} [{nxt['scope'] or '<top>'}] {nxt['arg']} (#{nxt['seq']})") if nxt is not None \
            else f"no counterpart in run {'B' if side == 'a' else 'A'}"
        rows = at.iloc[:0]
    row = rows.iloc[0] if len(rows) else None
    met = {m: row[m] for m in [*TENSOR_METRICS, "stats_err"] if row is not None and pd.notna(row[m])}
    frames = _frames(part_a, rec) if side == "a" and rec.get("stack") is not None else []
    return Divergence(stage=stage, step=step, rank=rank, seq=int(seq_a[i] if side == "a" else seq_b[i]),
                      scope=rec["scope"], op=rec["op"], name=rec["name"], call=int(rec["call"]), kind=rec["kind"],
                      failed=failed, metrics=met, stack=list(frames), module=module, cause=cause, side=side,
                      arg=arg, errors=errors)

