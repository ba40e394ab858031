"""Scoring paired tensors: the statistics and tensor metrics of each row and its verdict, judged by
the tolerance of the precision its values carry."""

from __future__ import annotations

import contextlib
import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pandas as pd

from ...core import op_traits
from ...records.reader import Part, RecordError
from ...standards import metrics as M, rounding as R, statistics as S, verdicts as V
from ...standards.loader import is_float
from ...standards.verdicts import NOT_JUDGED
from .columns import STATS, TENSOR_METRICS, COMPUTED, PERFECT


def score_pairs(df: pd.DataFrame, part_a: Part, part_b: Part, tensors: bool, problems: list,
                records=None, arrays: dict | None = None) -> pd.DataFrame:
    """Add the metric and verdict columns to the paired rows (vectorised where the metric allows).
    ``records``: ``(records of A, records of B, pairs, data flow source of A, of B)`` as aligned, for
    the values that cancel (:func:`_within_rounding`).  ``arrays``: filled with the returned frame's
    columns as numpy arrays (name -> the array the frame holds) where :func:`_with_columns` can tell
    them without reading the frame again (a long run's parts are joined from them)."""
    n = len(df)
    sa = {s: df[f"{s}_a"].to_numpy(np.float64) for s in STATS}
    sb = {s: df[f"{s}_b"].to_numpy(np.float64) for s in STATS}
    # the new columns, added to the table at once below (one insertion each costs a part of a long
    # run about 5 ms: seconds over 1,000 steps)
    new = dict(S.compare_stats_columns(sa, sb))
    # the larger of the two directions: a run's statistics are judged the same whichever run is A
    stats_err = np.fmax(S.stats_error(sa, sb), S.stats_error(sb, sa))
    new["stats_err"] = stats_err
    dtype_a = df["dtype_a"].to_numpy(object)
    dtype_b = df["dtype_b"].to_numpy(object)
    judge_dtype, cross = judging_precisions(df, dtype_a, dtype_b)
    nonfinite = ((df["nan_a"].fillna(0).to_numpy() != df["nan_b"].fillna(0).to_numpy())
                 | (df["inf_a"].fillna(0).to_numpy() != df["inf_b"].fillna(0).to_numpy()))
    status, reason = S.judge_stats_columns(stats_err, judge_dtype, nonfinite)
    ca, cb = df["checksum_a"].to_numpy(object), df["checksum_b"].to_numpy(object)
    has_ck = ~pd.isna(ca) & ~pd.isna(cb) if n else np.zeros(0, dtype=bool)
    ck_equal = has_ck & (ca == cb) & (dtype_a == dtype_b)
    new["checksum_match"] = np.array(["", "unequal", "equal"], dtype=object)[has_ck.astype(np.intp) + ck_equal]
    status = np.where(ck_equal, V.PASS, status).astype(object)
    reason = np.where(ck_equal, "", np.where(has_ck & (status != V.PASS), reason + "; checksum unequal", reason)
                      ).astype(object)
    # undefined values (uninitialised memory) are never judged and never count towards a divergence
    undef_a, undef_b = df["undef_a"].to_numpy(bool), df["undef_b"].to_numpy(bool)
    undef = undef_a | undef_b
    if undef.any():
        status[undef] = NOT_JUDGED
        which = np.where(undef_a & undef_b, "both runs", np.where(undef_a, "run A", "run B"))
        dest = df["arg"].to_numpy(object)[undef] == "input.out"
        reason[undef] = [f"{V.OUT_PRIOR_CONTENTS if d else V.UNDEFINED_CONTENTS} in {w}"
                         for w, d in zip(which[undef], dest)]
        stats_err[undef] = np.nan      # (the array in new)
    error = stats_err.copy()
    for m in TENSOR_METRICS:
        new[m] = np.full(n, np.nan)
    df = _with_columns(df, new)

    if tensors and n:
        da, db = df["data_a"].to_numpy(object), df["data_b"].to_numpy(object)
        rows = np.flatnonzero(~pd.isna(da) & ~pd.isna(db) & ~undef)
        shapes_ok = [int(np.prod(df["shape_a"].iat[r])) == int(np.prod(df["shape_b"].iat[r])) for r in rows]
        rows = rows[np.array(shapes_ok, dtype=bool)] if len(rows) else rows
        if len(rows):
            results = _tensor_metrics(part_a, part_b, da[rows], db[rows], judge_dtype[rows],
                                      df["dtype_a"].to_numpy(object)[rows], problems)
            # the magnitude the absolute-error shortcut is scaled by: the smaller run's (either way round)
            scale = np.fmin(np.fmax(np.abs(sb["max"][rows]), np.abs(sb["min"][rows])),
                            np.fmax(np.abs(sa["max"][rows]), np.abs(sa["min"][rows])))
            mvals = {m: np.full(len(rows), np.nan) for m in TENSOR_METRICS}
            rel_l2 = mvals["rel_l2_err"]
            for k, (r, res) in enumerate(zip(rows, results)):
                if res is None:
                    continue
                met, kind = res
                for m in TENSOR_METRICS:
                    if m in met:
                        mvals[m][k] = met[m]
                if kind == "binary":
                    mism = met["binary_mismatch"]
                    status[r] = V.ERROR if mism > 0 else V.PASS
                    reason[r] = f"{mism:.2%} of elements differ" if mism > 0 else ""
                    rel_l2[k] = mism
                    continue
                if cross[r]:
                    st, why = V.judge_cross_precision(met, judge_dtype[r])
                else:
                    st, why = V.judge_compare(met, judge_dtype[r], float(scale[k]) if np.isfinite(scale[k]) else 1.0)
                status[r], reason[r] = st, why
                rel_l2[k] = math.inf if met.get("inf_nan_mismatch") else met["rel_l2_err"]
            for m in TENSOR_METRICS:
                df.loc[df.index[rows], m] = mvals[m]
            error[rows] = np.where(np.isnan(rel_l2), error[rows], rel_l2)
    cancelled, error_own = _within_rounding(df, status, reason, error, sa, sb, records, judge_dtype)
    return _with_columns(df, {"error": error, "status": status, "reason": reason, "cancelled": cancelled,
                              "error_own": error_own}, arrays)


def _with_columns(df: pd.DataFrame, new: dict, arrays: dict | None = None) -> pd.DataFrame:
    """``df`` with the columns of ``new`` set in its order (as ``df[k] = v`` one by one would), the
    ones it does not have yet added at once: a new frame of the same arrays (``pd.concat`` copies
    every column, ``df[k] = v`` each new one).  ``arrays`` (where every column is a numpy array):
    filled with the new frame's columns, read once here (reading a column costs some 28 us: a
    thousand parts of 90 columns, seconds)."""
    for k in [k for k in new if k in df.columns]:
        df[k] = new.pop(k)
    if not new:
        return df
    old = {c: df[c] for c in df.columns}
    out = pd.DataFrame({**old, **new}, index=df.index, copy=False)
    if arrays is not None and all(isinstance(d, np.dtype) for d in out.dtypes):
        arrays.update((c, s.to_numpy()) for c, s in old.items())
        arrays.update((c, out[c].to_numpy()) for c in new)    # as the frame holds them
    return out


def _within_rounding(df: pd.DataFrame, status, reason, error, sa: dict, sb: dict, records, judge_dtype) -> np.ndarray:
    """A value that an op made as a sum of terms (a reduction, an element-wise add or sub, a matrix
    product: :func:`~dispatchprobe.standards.rounding.terms_norm`) and that cancelled in both runs
    (its terms more than ``cancellation`` times its norm) passes when the runs differ by no more
    than the rounding its terms carry (:func:`~dispatchprobe.standards.rounding.carried_bound`, each
    run's from its own record and the precision the row is judged at, which lineage lowers; summed):
    cosine and relative errors there compare rounding noise (a bias gradient that is mathematically
    zero; a residual add whose operands nearly cancel).  Its producer's output row and every input
    row reading it (the producers found by each run's data flow, paired with each other) are judged
    alike.  The difference is the tensors' L2 distance, or without tensors the largest statistics
    difference (norm, max, min, and the mean's times sqrt(n): each a lower bound of it).  Its
    ``error`` becomes that difference relative to the terms (the magnitude it is computed from), so
    lineage sees a rounding-size difference, not the noise's own relative error.
    ``records``: ``(records of A, records of B, pairs, data flow source of A, of B)`` as aligned.
    Returns, per row, whether it passed so and is itself no larger than that rounding (its norm in
    both runs within the bound): lineage takes such a value as zero up to rounding, a source of
    noise that what is computed from it may amplify (an optimizer's normalisation); and, for every
    row that passed so, its error relative to itself (NaN elsewhere): a value that only partly
    cancelled (a matrix product whose terms are a few times its norm) is real, and an op reading it
    is judged against how far it differs relative to itself, not to its terms."""
    cancelled = np.zeros(len(df), bool)
    error_own = np.full(len(df), np.nan)
    cand = np.flatnonzero((status != V.PASS) & (status != NOT_JUDGED))
    if not len(cand) or records is None:
        return cancelled, error_own
    floats = {d: is_float(d) for d in set(judge_dtype[cand].tolist())}
    recs_a, recs_b, pairs, src_a, src_b = records
    pair_b = {i: j for i, j, _ in pairs}
    uid, args, io = df["uid"].to_numpy(), df["arg"].to_numpy(object), df["io"].to_numpy(object)
    spec_a, spec_b = df["spec_a"].to_numpy(), df["spec_b"].to_numpy()
    shape_a = df["shape_a"].to_numpy(object)
    rmse = df["rmse"].to_numpy(np.float64) if "rmse" in df else np.full(len(df), np.nan)
    terms: dict = {}        # (record of A, of B, output) -> its terms in each run, once
    bounds: dict = {}       # (record of A, of B, output, precision) -> (bound, terms) of each run, once
    for r in cand.tolist():
        if not floats[judge_dtype[r]]:     # integers do not round: any difference is one
            continue
        if io[r] == "output" and not _kept_cast(recs_a[int(uid[r])], recs_b[pair_b.get(int(uid[r]))]):
            i, j, out = int(uid[r]), pair_b.get(int(uid[r])), args[r]
        elif io[r] == "output":  # a cast keeping every value: the value its input's producers made
            i, j, out = _producers(src_a.get(id(recs_a[int(uid[r])]["inputs"][0])),
                                   src_b.get(id(recs_b[pair_b[int(uid[r])]]["inputs"][0])), pair_b)
        else:                # an input: the value its producers made
            i, j, out = _producers(src_a.get(int(spec_a[r])), src_b.get(int(spec_b[r])), pair_b)
        if i is None and j is None:
            continue
        # a value one run's records did not make (compiled code the probe does not see: a graph's
        # backward under plain inductor) has the other run's producer's terms for both
        rec_a = recs_a[i] if i is not None else recs_b[j]
        rec_b = recs_b[j] if j is not None else recs_a[i]
        # the terms first: most rows are no sum, or did not cancel (the bound is then never read)
        each = terms.get((i, j, out))
        if each is None:
            ta, tb = R.terms_norm(rec_a, out), R.terms_norm(rec_b, out)
            # a compiled graph may not read the input the terms are of (it computes from another value
            # equal to it): the paired op's terms in the other run stand for them
            each = terms[i, j, out] = (tb if ta is None else ta, ta if tb is None else tb)
        if any(t is None for t in each) or not all(R.cancelled(t, st["norm"][r]) for t, st in zip(each, (sa, sb))):
            continue
        key = (i, j, out, judge_dtype[r])
        if key not in bounds:
            bounds[key] = [R.carried_bound(rec, out, judge_dtype[r], t)
                           for rec, t in zip((rec_a, rec_b), each)]
        sides = bounds[key]
        bound = sum(x for x, _ in sides)
        n = max(int(np.prod(shape_a[r])), 1)
        diff = distance_bound(rmse[r], n, [sa[s][r] - sb[s][r] for s in ("norm", "max", "min", "mean")])
        if diff <= bound:
            cancelled[r] = max(abs(sa["norm"][r]), abs(sb["norm"][r])) <= bound
            error_own[r] = error[r]
            status[r] = V.PASS
            error[r] = diff / max(t for _, t in sides)
            made = "" if io[r] == "output" else f" ({rec_a['op']} {out})"
            reason[r] = (f"outputs{made} differ by {diff:.3g}, within the rounding bound of their terms "
                         f"({bound:.3g}; terms {max(t for _, t in sides):.3g}): the values cancel")
    return cancelled, error_own


def distance_bound(rmse: float, n: int, diffs) -> float:
    """How far apart a row's two values of ``n`` elements are, ``‖a-b‖``: ``rmse·√n`` where the
    tensors were measured, else the largest difference of the statistics ``diffs`` (norm, max,
    min, mean: each, the mean's times √n, a lower bound of it); a missing statistic bounds nothing,
    none at all: inf."""
    if math.isfinite(rmse):
        return rmse * math.sqrt(n)
    lower = [abs(d) * (math.sqrt(n) if s == "mean" else 1.0) for s, d in zip(("norm", "max", "min", "mean"), diffs)]
    return max((d for d in lower if d == d), default=math.inf)


def _kept_cast(rec_a: dict, rec_b: dict | None) -> bool:
    """Both paired records are casts that keep every value of their tensor input (the same float dtype,
    or a float widened): their output is the value they read, judged as that value is.  Why: a bf16
    autocast run's key-bias gradient, a sum that cancelled, passed as autograd's ``sum`` made it and
    failed as its float32 copy for the parameter (cosine 0.91 between two torch versions' bf16 runs)."""
    return rec_b is not None and all(_keeps_values(rec) for rec in (rec_a, rec_b))


_WIDER = {"float16": 1, "bfloat16": 1, "float32": 2, "float64": 3}


def _keeps_values(rec: dict) -> bool:
    if not op_traits.is_cast(rec["op"]):
        return False
    ins, outs = rec.get("inputs") or (), rec.get("outputs") or ()
    if not ins or not outs or not all(isinstance(x, dict) and x.get("type") == "tensor" for x in (ins[0], outs[0])):
        return False
    d_in, d_out = ins[0].get("dtype"), outs[0].get("dtype")
    return d_in == d_out or (d_in in _WIDER and d_out in _WIDER and _WIDER[d_out] > _WIDER[d_in])


def _producers(made_a, made_b, pair_b: dict) -> tuple:
    """``(record of A, record of B, output)`` that made a value both runs read (their data flow's
    sources ``made_a``, ``made_b``: (record, output) or None): both, where they pair and made the
    same output; one, where the other run's records made it nowhere; else ``(None, None, None)``."""
    if made_a is not None and made_b is not None:
        same = made_a[1] == made_b[1] and pair_b.get(made_a[0]) == made_b[0]
        return (made_a[0], made_b[0], made_a[1]) if same else (None, None, None)
    if made_a is not None:
        return made_a[0], None, made_a[1]
    return (None, made_b[0], made_b[1]) if made_b is not None else (None, None, None)


def pair_codes(xa, xb) -> tuple[np.ndarray, list]:
    """``statistics.factorize`` of the pairs ``zip(xa, xb)`` (codes, distinct pairs in order of first
    appearance) for two columns of text (dtypes): each column hashed once by pandas and the pairs
    told apart by their two codes, no tuple made per row.  Anything not text: as factorize does."""
    ca, ua = pd.factorize(np.asarray(xa, dtype=object))
    cb, ub = pd.factorize(np.asarray(xb, dtype=object))
    if len(ca) != len(cb) or not all(type(v) is str for v in (*ua, *ub)) or (ca < 0).any() or (cb < 0).any():
        return S.factorize(list(zip(xa, xb)))
    width = max(len(ub), 1)
    codes, keys = pd.factorize(ca.astype(np.int64) * width + cb)
    return codes.astype(np.int64), [(ua[k // width], ub[k % width]) for k in keys.tolist()]


def judging_precisions(df: pd.DataFrame, dtype_a, dtype_b) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the dtype whose tolerance applies and whether the pair is cross-precision.  A float
    pair is judged by the lowest precision among its two dtypes and the precisions its values were
    computed from (``DataFlow.lineage``); it is cross-precision when those differ between the runs
    (a bfloat16 layer in one run only: its outputs and everything computed from them)."""
    n = len(df)
    if not n:
        return np.zeros(0, object), np.zeros(0, bool)
    codes, uniques = pair_codes(dtype_a, dtype_b)
    base = np.array([V.lower_precision(x, y) for x, y in uniques], dtype=object)[codes]
    own_a = np.array([V.precision_rank(x) for x, _ in uniques], dtype=np.int64)[codes]
    own_b = np.array([V.precision_rank(y) for _, y in uniques], dtype=np.int64)[codes]
    lin_a, lin_b = df["lineage_a"].to_numpy(np.int64), df["lineage_b"].to_numpy(np.int64)
    carried_a = np.where(lin_a >= 0, np.minimum(lin_a, own_a), own_a)
    carried_b = np.where(lin_b >= 0, np.minimum(lin_b, own_b), own_b)
    floats = (own_a >= 0) & (own_b >= 0)
    cross = floats & ((own_a != own_b) | (carried_a != carried_b))
    names = np.array(V.PRECISIONS, dtype=object)
    judge = np.where(floats, names[np.clip(np.minimum(carried_a, carried_b), 0, None)], base)
    return judge, cross


def _tensor_metrics(part_a: Part, part_b: Part, keys_a, keys_b, judge_dtypes, dtypes_a, problems):
    """Metrics for each (key_a, key_b); each distinct pair computed once; tensors loaded in chunks."""
    out = [None] * len(keys_a)
    todo: dict = {}
    for k, pair in enumerate(zip(keys_a, keys_b, judge_dtypes)):
        todo.setdefault(pair, []).append(k)
    pairs = list(todo)
    workers = min(_threads(), len(pairs))
    with ThreadPoolExecutor(max_workers=workers) if workers > 1 else contextlib.nullcontext() as pool:
        _metrics_chunks(part_a, part_b, pairs, todo, out, problems, pool)
    return out


def _threads() -> int:
    """Threads for the tensor metrics: ``DISPATCHPROBE_THREADS``, else 1 (the metrics are many
    short numpy calls on cache-sized blocks, holding the GIL between them: threads contend).
    Parts (steps, ranks) still run in parallel processes (``-j``)."""
    env = os.environ.get("DISPATCHPROBE_THREADS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    return 1


def _metrics_chunks(part_a, part_b, pairs, todo, out, problems, pool):
    start = 0
    while start < len(pairs):
        chunk = pairs[start:start + 512]
        start += len(chunk)
        try:
            ta = part_a.tensors_of({p[0] for p in chunk})
            tb = part_b.tensors_of({p[1] for p in chunk})
        except RecordError as exc:
            problems.append(str(exc))
            ta, tb = {}, {}
            for p in chunk:  # fall back to one at a time: keep what can be read
                try:
                    ta[p[0]] = part_a.tensor(p[0])
                    tb[p[1]] = part_b.tensor(p[1])
                except RecordError:
                    pass
        # a value saved twice (an op's output and the next op's input, a view's base) is measured once:
        # pairs alike in all _metrics_of reads share the first one's metrics
        same_a, same_b = same_content(ta), same_content(tb)
        alike: dict = {}      # (A's content, B's content, judged dtype, same shapes, same bytes) -> pairs
        for p in chunk:
            a, b = ta.get(p[0]), tb.get(p[1])
            if a is not None and b is not None:
                firsts = same_a.get(p[0], p[0]), same_b.get(p[1], p[1])
                alike.setdefault((*firsts, p[2], a.shape == b.shape, _judged_same(a, b, p[2])), []).append(p)

        def one(key, ta=ta, tb=tb):
            first = alike[key][0]
            return _metrics_of(ta[first[0]], tb[first[1]], first[2], same=key[-1])
        keys = list(alike)
        # numpy releases the GIL in the element-wise passes: threads use every core
        for key, res in zip(keys, pool.map(one, keys) if pool else map(one, keys)):
            for p in alike[key]:
                for k in todo[p]:
                    out[k] = res
        del ta, tb, one


def same_content(tensors: dict) -> dict:
    """{key: the first key whose tensor has the same dtype and elements bit for bit in C order}
    over ``tensors`` (key -> array): a run saves one value under several keys (an op's output and
    the next op's input, a view and its base), a third of a transformer step's elements.  The
    metrics read the elements flattened, so such tensors share theirs, whatever their shapes and
    layouts (:func:`_metrics_of` reads only whether a pair's shapes agree and :func:`_judged_same`).
    Candidates are told by a few sampled elements, then compared in full."""
    firsts: dict = {}     # sample -> the first keys of the contents seen with it
    out = {}
    for key, x in tensors.items():
        if x is None:
            continue
        seen = firsts.setdefault(_sample(x), [])
        out[key] = next((k for k in seen if _identical(tensors[k], x)), key)
        if out[key] == key:
            seen.append(key)
    return out


def _sample(x: np.ndarray) -> tuple:
    """dtype, size and the bytes of five elements spread over ``x``: equal for equal tensors."""
    n = x.size
    picks = x.flat[[0, n // 5, n // 2, (4 * n) // 5, n - 1]].tobytes() if n else b""
    return x.dtype.str, n, picks


def _identical(x: np.ndarray, y: np.ndarray) -> bool:
    """The same dtype and elements bit for bit in C order (-0.0 is not 0.0, nan payloads count)."""
    if x.dtype != y.dtype or x.size != y.size:
        return False
    if x.size == 0:
        return True
    return _equal_bytes(np.ascontiguousarray(x), np.ascontiguousarray(y))


def _judged_same(a: np.ndarray, b: np.ndarray, dtype: str) -> bool | None:
    """Whether :func:`_metrics_of` finds the pair identical (no metrics to compute); None where it
    does not ask (a binary pair).  It depends on the pair's layout, not only its contents:
    :func:`_same_bytes` compares a contiguous pair's bytes and another's values (-0.0 equal to 0.0)."""
    if not is_float(dtype) or a.dtype.kind not in "fc" or b.dtype.kind not in "fc":
        return None
    return a.dtype == b.dtype and a.shape == b.shape and _same_bytes(a, b)


def _metrics_of(a: np.ndarray, b: np.ndarray, dtype: str, same: bool | None = None):
    """(metrics, kind) of one pair; ``same``: :func:`_judged_same` of the pair, where known."""
    if not is_float(dtype) or a.dtype.kind not in "fc" or b.dtype.kind not in "fc":
        return {"binary_mismatch": M.binary_mismatch(a, b), "elements": int(a.size)}, "binary"
    if same if same is not None else _judged_same(a, b, dtype):
        return {**PERFECT, "elements": int(a.size)}, "float"
    return M.compare_arrays(a, b, dtype, only=COMPUTED, symmetric=True), "float"


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-identical tensors (the common case between two runs): their bytes compared when both are
    plain contiguous arrays, else an element-wise pass.  Values equal but not bitwise (-0.0, nan
    payloads) simply go through the metrics, which find them perfect.  An empty array has no
    bytes to view: equal to an empty one of its shape."""
    if a.size == 0 or b.size == 0:
        return a.shape == b.shape
    if a.flags.c_contiguous and b.flags.c_contiguous:
        return _equal_bytes(a, b)
    return bool(np.array_equal(a, b))


def _equal_bytes(x: np.ndarray, y: np.ndarray) -> bool:
    """Whether two contiguous arrays hold the same bytes, compared as 8-byte words where their size
    allows: a memoryview comparison goes byte by byte in Python's C loop (~13 ns a byte: a
    second for a transformer step's identical pairs)."""
    bx, by = x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8)
    if bx.size != by.size:
        return False
    if bx.size % 8 == 0:
        bx, by = bx.view(np.uint64), by.view(np.uint64)
    # most unequal tensors differ early: their first 4 KB first
    return bool(np.array_equal(bx[:512], by[:512]) and np.array_equal(bx, by))
