"""The driver: each step/rank part paired, scored and traced (in parallel processes with ``-j``),
then one table and one :class:`Verdict` for the whole runs."""

from __future__ import annotations

import math
import operator
import os
from collections import Counter
from dataclasses import replace
from concurrent.futures import ProcessPoolExecutor
from typing import NamedTuple

import numpy as np
import pandas as pd

from ...core import op_traits
from ...records.reader import Part, RecordError, find_manifest, load, no_gc
from ...standards import verdicts as V
from ...standards.loader import standard
from ..align import Mapping, align, functional
from ..launcher import engine_for, gathered, said_by_rank0
from ..translate import Translation
from .columns import (BOOL_FIELDS, FLOAT_FIELDS, HEAD_FIELDS, INT_FIELDS, ROW_FIELDS, TENSOR_FIELDS, TEXT_FIELDS,
                      COLUMNS, UNMATCHED_COLUMNS)
from .choice import AFTER, undecided_kind
from .exact import same_kernels
from .origin import PARTIAL_SUMS, STATS_NOISE, Side, differs, trace
from .rerun import float64_rerun
from .rewired import REWIRED
from . import loss_scale
from . import recompute
from .pairing import (REWRITTEN, PairingShare, decomposed_scopes, explain_unobservable, data_flow, user_frames, pair_tensors,
                      pairing_share, rewritten, say_rewritten)
from .scoring import score_pairs
from .task_mismatch import NOT_RECORDED, explanation, flagged_only_side, tasks_note, unaligned_hint
from ..coverage import graphs_note, unrecorded_graphs, unrecorded_steps_note
from .verdict import UNFINISHED, Result, RunsDoNotAlign, Verdict, call_words
from .parallel import layout_difference, optimizer_step
from .amplified import Trail as AmplifiedTrail
from .amplified import said as amplified_lines
from .drift import DRIFTED, Drift


# unmatched records run by the other framework where no probe sees them (pairing.explain_unobservable)
# and records inside a region compared at its boundary: a difference passes through them to the region's
_UNOBSERVED = ("not observable in the other framework", "no counterpart in the other framework",
               "inside a region compared at its boundary", NOT_RECORDED, recompute.RECOMPUTED)


# a tensor's recorded statistics in the order the loop below takes them (one call for the six)
_STAT_KEYS = ("nan", "inf", "max", "min", "mean", "norm")
_STAT_VALUES = operator.itemgetter(*_STAT_KEYS)


class PartResult(NamedTuple):
    rows: pd.DataFrame
    unmatched: pd.DataFrame
    problems: list
    divergences: list     # per stage at most one :class:`Divergence` (a departure where it has no error rows)
    aligned: tuple        # (compute records paired, compute records of A, of B)
    pairing: PairingShare = PairingShare()   # how each run's op records were paired, per stage
    arrays: dict | None = None   # the columns of ``rows`` as numpy arrays, where known (the parts are joined from them)
    skipped: tuple | None = None  # (step, rank, run) where that run's loss scaler skips this step's update (.loss_scale)


def compare_parts(part_a: Part, part_b: Part, match: str = "fuzzy", mapping: Mapping | None = None,
                  tensors: bool = True, translate: tuple = (None, None), framework: str | None = "torch",
                  kernels: bool = False, texts: dict | None = None) -> PartResult:
    """Compare one step/rank part against another; ``translate``: each side's
    :class:`~dispatchprobe.offline.translate.Translation` into aten's vocabulary, or None;
    ``framework``: both parts' framework, whose replay re-runs ops in float64 to place an origin
    (None: decided on the recorded errors); ``kernels``: the runs' manifests say the same kernels
    (:func:`.exact.same_kernels`: any statistics difference may count); ``texts``: the table's
    repeated strings and shapes (names, scopes, dtypes), one object per value shared by the parts
    given the same dict (a run of 1,000 steps repeats each step's), else each part's own."""
    with no_gc():
        return _compare_parts(part_a, part_b, match, mapping or Mapping(), tensors, translate, framework, kernels,
                              {} if texts is None else texts)


def _compare_parts(part_a: Part, part_b: Part, match: str, mapping: Mapping, tensors: bool, translate: tuple,
                   framework: str | None, kernels: bool = False, texts: dict | None = None):
    recs_a, recs_b = (t.records(p.records) if t else p.records for t, p in zip(translate, (part_a, part_b)))
    if any(translate):   # two frameworks: aten copies of left-out layout primitives out, fused kernels vs pieces
        ta, tb = translate
        recs_a, recs_b = tb.aten_side(recs_a) if tb and not ta else recs_a, ta.aten_side(recs_b) if ta and not tb else recs_b
        recs_a, recs_b = ta.fuse(recs_a, recs_b) if ta else recs_a, tb.fuse(recs_b, recs_a) if tb else recs_b
    # an overflow re-run of a compiled record repeats that record's call (same name): compared once
    recs_a, recs_b = ([r for r in recs if not (r.get("compiled") or {}).get("rerun")] for recs in (recs_a, recs_b))
    decomposed = decomposed_scopes(recs_a, recs_b, translate) if any(translate) else set()
    if decomposed:       # compared at the module's boundary: its ops go to unmatched, explained
        inside = lambda r: r["kind"] == "op" and (r["stage"], r["scope"]) in decomposed   # noqa: E731
        set_aside = [[r for r in recs if inside(r)] for recs in (recs_a, recs_b)]
        recs_a, recs_b = ([r for r in recs if not inside(r)] for recs in (recs_a, recs_b))
    # forward ops one run re-runs in backward (activation checkpointing): not judged, see .recompute
    recs_a, recs_b, *rerun_only = recompute.set_aside(recs_a, recs_b)
    problems = list(part_a.problems) + list(part_b.problems)
    # a run scaling its loss (GradScaler, MindSpore's amp scalers): its gradients compared unscaled, see .loss_scale
    recs_a, recs_b, scaling = loss_scale.unscaled(recs_a, recs_b, permuted=any(translate))
    if scaling is not None and scaling.whole_backward:
        problems.append(f"step {part_a.step} rank {part_a.rank}: {scaling.whole_backward}")
    cross = any(translate)     # two frameworks: argument order and op order may differ, not the values
    al = align(recs_a, recs_b, match=match, mapping=mapping, by_stats=cross)
    recs_a, recs_b = al.records(recs_a, "a"), al.records(recs_b, "b")   # a region's last record stands for it
    step, rank = part_a.step, part_a.rank

    # sequence numbers per stage, in A's (and B's) execution order
    def seqs(recs):
        counters, out = {}, []
        for r in recs:
            c = counters.get(r["stage"], 0)
            out.append(c)
            counters[r["stage"]] = c + 1
        return out
    seq_a, seq_b = seqs(recs_a), seqs(recs_b)
    spreads = framework == "torch" and not cross     # undefined values spread (pairing.data_flow)
    flow_a, flow_b = data_flow(recs_a, cross, spreads), data_flow(recs_b, cross, spreads)
    walks_a, walks_b = flow_a.walks, flow_b.walks
    # most runs carry no lower precision and no undefined value: no per-row lookup then
    lin_a, lin_b = flow_a.lineage.get if flow_a.lineage else None, flow_b.lineage.get if flow_b.lineage else None
    und_a, und_b = flow_a.undefined, flow_b.undefined

    rows = []          # per paired tensor: its pair's index in heads, then the tensor's fields
    append = rows.append
    heads = []         # per pair with a tensor row: HEAD_FIELDS (stored once, not per tensor)
    empty: dict = {}
    by_ops: dict = {}   # (op A, op B, how) -> (same, overwritten): a few distinct keys over 100k pairs
    # the table keeps one object per distinct text or shape, not the records' copies of it (which
    # would outlive the records, per row)
    keep = (texts if texts is not None else {}).setdefault
    for i, j, how in al.pairs:
        ra, rb = recs_a[i], recs_b[j]
        op_a, op_b = ra["op"], rb["op"]
        known = by_ops.get((op_a, op_b, how))
        if known is None:
            # the same op, or its in-place and functional variants (eager div_, a compiled graph's div):
            # the same arguments, compared one by one
            known = by_ops[op_a, op_b, how] = (
                functional(mapping.op(op_a)) == functional(op_b) or how in ("module", "region boundary"),
                # either run's op (an eager copy_ paired with a graph's functional copy): its destination
                # is not read
                op_traits.overwrites_first_input(op_a) or op_traits.overwrites_first_input(op_b))
        same, overwritten = known
        stack = None
        head = (keep(ra["stage"], ra["stage"]), keep(ra["kind"], ra["kind"]), seq_a[i], seq_b[j],
                keep(ra["scope"], ra["scope"]),
                keep(op_a, op_a), keep(op_b, op_b), keep(ra["name"], ra["name"]), keep(rb["name"], rb["name"]),
                ra["call"], rb["call"], how)
        tensor_pairs = pair_tensors(walks_a[i], walks_b[j], same, op_b if cross else "")
        h = len(heads)
        for io, arg, sa, sb in tensor_pairs:
            if overwritten and op_traits.first_argument(arg):
                continue  # the destination's old (often uninitialised) content is not an input
            if stack is None:
                frames = user_frames(part_a, ra) if ra.get("stack") is not None else []
                stack = " | ".join(frames[-3:]) if frames else ""
                stack = keep(stack, stack)
            sta, stb = sa.get("stats") or empty, sb.get("stats") or empty
            try:       # the usual statistics: all six keys, read in one call
                na, ia, xa, mia, mea, noa = _STAT_VALUES(sta)
            except (KeyError, TypeError):
                na, ia, xa, mia, mea, noa = map(sta.get, _STAT_KEYS)
            try:
                nb, ib, xb, mib, meb, nob = _STAT_VALUES(stb)
            except (KeyError, TypeError):
                nb, ib, xb, mib, meb, nob = map(stb.get, _STAT_KEYS)
            # TENSOR_FIELDS, in order (a plain tuple: the hot loop)
            da, db, ha, hb = sa["dtype"], sb["dtype"], tuple(sa["shape"]), tuple(sb["shape"])
            append((h, io, arg, keep(da, da), keep(db, db), keep(ha, ha), keep(hb, hb),
                    na, nb, ia, ib, sa.get("checksum"), sb.get("checksum"), sa.get("data"), sb.get("data"),
                    bool(und_a) and id(sa) in und_a, bool(und_b) and id(sb) in und_b,
                    lin_a(id(sa), -1) if lin_a else -1, lin_b(id(sb), -1) if lin_b else -1, id(sa), id(sb),
                    xa, xb, mia, mib, mea, meb, noa, nob))
        if stack is not None:    # a row was made
            heads.append(head + (stack, i))
    # the typed columns as they are: the default (one block per dtype) copies them all again, about a
    # second and as much memory again for 300,000 rows
    df = pd.DataFrame(_table(heads, rows), copy=False)
    df.insert(0, "rank", rank)
    df.insert(0, "step", step)

    rows = []
    for side, idx, recs, seq in (("a", al.only_a, recs_a, seq_a), ("b", al.only_b, recs_b, seq_b)):
        for i in idx:
            r = recs[i]
            rows.append((step, rank, side, r["stage"], r["kind"], seq[i], r["scope"], r["op"], r["name"], r["call"],
                         op_traits.is_cast(r["op"])))
    explained = [""] * len(rows)
    for k, (side, i) in enumerate((side, i) for side, idx in (("a", al.only_a), ("b", al.only_b)) for i in idx):
        if (side, i) in al.inside:   # a region one run computes in a cell of its own: compared at its boundary
            explained[k] = f"inside a region compared at its boundary ({al.inside[side, i]})"
        elif scaling is not None and scaling.explains((recs_a if side == "a" else recs_b)[i]):
            explained[k] = scaling.explanation(side)
        elif recompute.recomputed((recs_a if side == "a" else recs_b)[i]):
            explained[k] = recompute.unpaired()
        elif rewritten((recs_a if side == "a" else recs_b)[i]):
            explained[k] = REWRITTEN
    manifests = (find_manifest(part_a.path)[1], find_manifest(part_b.path)[1])
    partial = flagged_only_side(*manifests)
    if partial:      # the other run's records an inline check does not make: no counterpart by design
        why = explanation(*manifests)
        explained = [why if r[2] != partial and not e else e for r, e in zip(rows, explained)]
    if decomposed:
        for side, recs in zip("ab", set_aside):
            for r in recs:
                rows.append((step, rank, side, r["stage"], r["kind"], -1, r["scope"], r["op"], r["name"], r["call"],
                             op_traits.is_cast(r["op"])))
                explained.append(f"decomposed differently: compared at the boundary of {r['scope']}")
    for side, recs in zip("ab", rerun_only):
        for r in recs:
            rows.append((step, rank, side, r["stage"], r["kind"], -1, r["scope"], r["op"], r["name"], r["call"],
                         op_traits.is_cast(r["op"])))
            explained.append(recompute.one_run_only(side))
    unmatched = pd.DataFrame(rows, columns=UNMATCHED_COLUMNS)
    unmatched["explained"] = explained
    unmatched = explain_unobservable(unmatched, translate, problems, step, rank, (recs_a, recs_b))
    say_rewritten(unmatched, problems, step, rank)
    if decomposed:
        problems.append(f"step {step} rank {rank}: compared at their boundary (the frameworks decompose them "
                        f"differently): {', '.join(sorted({f'{sc} ({st})' for st, sc in decomposed}))}")
    if recs_a and recs_b and not al.pairs:
        problems.append(f"step {step} rank {rank}: no record of {part_a.path} could be aligned with "
                        f"{part_b.path} ({unaligned_hint(*manifests, short=True)})")
    elif len(unmatched) and (unexplained := int((~unmatched["is_cast"] & (unmatched["explained"] == "")).sum())):
        # a guess at why only where the records left unexplained are many (explained ones have their reason)
        hint = f" ({unaligned_hint(*manifests, short=True)})" if unexplained > 0.2 * (len(recs_a) + len(recs_b)) else ""
        problems.append(f"step {step} rank {rank}: {unexplained} of "
                        f"{len(recs_a) + len(recs_b)} records could not be aligned{hint}; listed in unmatched.csv")
    arrays: dict = {}
    df = score_pairs(df, *(scaling.parts(part_a, part_b) if scaling else (part_a, part_b)), tensors, problems,
                     (recs_a, recs_b, al.pairs, flow_a.src, flow_b.src), arrays)
    if scaling is not None:
        df = scaling.judge(df, arrays)
        if scaling.overflowed:
            problems.append(f"step {step} rank {rank}: {scaling.overflowed}")
    # compute records: counted per distinct op (a few over 100k records), casts left out; those inside a
    # region outside every module (a loss function, an optimizer step, which two frameworks compute with
    # other ops) are compared at its boundary, as a decomposed module's are: neither aligned nor not
    at_top = [Counter(recs[i]["op"] for (s, i), scope in al.inside.items() if s == side and scope == "<top>")
              for side, recs in (("a", recs_a), ("b", recs_b))]
    compute = [_compute(Counter(map(_OP, recs)) - top) for recs, top in zip((recs_a, recs_b), at_top)]
    paired = _compute(Counter(recs_a[i]["op"] for i, _, _ in al.pairs))
    rerun = float64_rerun(framework, part_a, part_b) if tensors and framework and not any(translate) else None
    if rerun is not None:   # re-runs read at most 1/64 of what the metrics read (compare's speed)
        rerun.elements = max(1 << 18, sum(math.prod(s) for s in df["shape_a"]) // 64)
    sides = [("a", i) for i in al.only_a] + [("b", i) for i in al.only_b]   # the unmatched rows' first records
    unobserved = ({i for (s, i), why in zip(sides, unmatched["explained"]) if s == "a" and why.startswith(_UNOBSERVED)},
                  {i for (s, i), why in zip(sides, unmatched["explained"]) if s == "b" and why.startswith(_UNOBSERVED)})
    side_a = Side("a", part_a, recs_a, seq_a, flow_a, frozenset(al.only_a), frozenset(unobserved[0]))
    side_b = Side("b", part_b, recs_b, seq_b, flow_b, frozenset(al.only_b), frozenset(unobserved[1]))
    df["origin"], divs = trace(df, side_a, side_b, al.pairs, rerun, kernels and not any(translate))
    if arrays and list(arrays) == list(df.columns[:-1]) and isinstance(df["origin"].dtype, np.dtype):
        arrays["origin"] = df["origin"].to_numpy()
    else:
        arrays = None
    return PartResult(df, unmatched, problems, divs, (paired, *compute),
                      pairing_share(al.pairs, recs_a, recs_b, unmatched), arrays,
                      (step, rank, scaling.skipped) if scaling is not None and scaling.skipped else None)


_OP = operator.itemgetter("op")


def _compute(ops: Counter) -> int:
    """How many of the records counted by op in ``ops`` are compute records (not casts)."""
    return sum(n for op, n in ops.items() if not op_traits.is_cast(op))


def _typed(name: str, col):
    """A table column from the tuple of its values: typed by numpy at once where its type is known
    (pandas infers a list's element by element), else what pandas infers from the list."""
    if name in FLOAT_FIELDS:  # None -> nan; numbers and "inf"/"nan" strings -> float, as float() does
        return np.array(col, dtype=np.float64)
    if name in INT_FIELDS:
        return np.array(col, dtype=np.int64)
    if name in BOOL_FIELDS:
        return np.array(col, dtype=bool)
    if name in TEXT_FIELDS:
        out = np.empty(len(col), dtype=object)
        try:
            out[:] = col    # str or None
            return out
        except ValueError:         # a sequence numpy would unpack: as a list
            return list(col)
    types = set(map(type, col))
    if types == {int}:   # what pandas infers from the list, made at once
        try:
            return np.array(col, dtype=np.int64)
        except OverflowError:
            return list(col)
    if types == {tuple}:   # shapes: one object array of the tuples
        return np.fromiter(col, dtype=object, count=len(col))
    return list(col)


def _table(heads: list, rows: list) -> dict:
    """The paired tensors' columns (``ROW_FIELDS`` order) from the pairs' ``heads`` (``HEAD_FIELDS``)
    and the tensors' ``rows`` (their pair's index in ``heads``, then ``TENSOR_FIELDS``): a pair's
    fields typed once per pair and repeated for its tensors by one numpy take."""
    at = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
    cols = dict(zip(HEAD_FIELDS, zip(*heads) if heads else [()] * len(HEAD_FIELDS)))
    cols.update(zip(TENSOR_FIELDS, _transposed(rows, 1 + len(TENSOR_FIELDS))[1:]))
    data = {}
    for name in ROW_FIELDS:
        col = _typed(name, cols.pop(name))
        if name in HEAD_FIELDS:   # the same values, so the same type as a per-tensor column's
            col = col[at] if isinstance(col, np.ndarray) else [col[k] for k in at.tolist()]
        data[name] = col
    return data


def _transposed(rows: list, width: int, chunk: int = 1024) -> list:
    """The columns of ``rows`` (tuples of ``width`` values), each a list: transposed a chunk of rows at
    a time, which stay in the cache (``zip(*rows)`` over 300,000 rows takes twice as long)."""
    cols: list = [[] for _ in range(width)]
    for start in range(0, len(rows), chunk):
        for col, part in zip(cols, zip(*rows[start:start + chunk])):
            col.extend(part)
    return cols


def _worker(args, texts: dict | None = None):
    path_a, key_a, path_b, key_b, match, mapping, tensors, translate, framework, kernels = args
    with no_gc():     # the collector runs again once the parts' records are gone (a full pass over them: ~1 s per 100k ops)
        part_a, part_b = Part(path_a, *key_a), Part(path_b, *key_b)
        result = compare_parts(part_a, part_b, match=match, mapping=mapping, tensors=tensors, translate=translate,
                               framework=framework, kernels=kernels, texts=texts)
        del part_a, part_b
    return result


def _translations(run_a, run_b, mapping: Mapping) -> tuple:
    """Runs of two frameworks are compared in aten's vocabulary: the non-torch side(s) translated.
    So are two MindSpore runs of which one recorded a compiled graph's kernels and the other
    PyNative's primitives (the manifest's ``graph_kernels``): two vocabularies of one framework."""
    fa, fb = (r.manifest.get("framework") or "torch" for r in (run_a, run_b))
    if fa == fb and (fa == "torch" or bool(run_a.manifest.get("graph_kernels")) == bool(run_b.manifest.get("graph_kernels"))):
        return None, None
    return tuple(None if f == "torch" else Translation.shipped(f, mapping.frameworks.get(f)) for f in (fa, fb))


def compare(a, b, *, match: str = "fuzzy", mapping: str | Mapping | None = None, out: str | None = None,
            jobs: int = 1, progress: bool = False, tensors: bool = True, metric: str = "cosine",
            keep_table: bool = True) -> Result:
    """Compare run (or step/rank folder) ``a`` (under test) against ``b`` (benchmark).

    Returns ``(table, verdict)``: one row per compared tensor (columns in docs/compare.md) and a
    :class:`Verdict`.  With ``out``, writes ``compare.csv``, ``compare.xlsx``, ``unmatched.csv``
    and ``compare.html`` there.  Raises :class:`RecordError` when nothing could be compared, and
    :class:`RunsDoNotAlign` (a ``RecordError``) when less than ``min_aligned`` of the smaller run's compute
    records pair.  ``keep_table=False``: the table returned is empty (the reports and the verdict are
    the same), and compare holds one step/rank part's rows at a time however long the runs.
    """
    if match not in ("fuzzy", "exact"):
        raise ValueError(f"--match must be 'fuzzy' or 'exact', not {match!r}")
    if not isinstance(mapping, Mapping):
        mapping = Mapping.load(mapping)
    run_a, run_b = load(a), load(b)
    engine = engine_for(run_a)
    from ..grad_compare import grad_compare, is_grad_run
    if is_grad_run(run_a) or is_grad_run(run_b):      # gradient directions per step and parameter
        return said_by_rank0(engine, lambda: grad_compare(run_a, run_b, out=out), _elsewhere)
    problems: list[str] = unfinished_notes(run_a, run_b)
    for note in (tasks_note(run_a.manifest, run_b.manifest), unrecorded_graphs(run_a.manifest, run_b.manifest),
                 *(f"run {side}: {n}" for side, run in (("A", run_a), ("B", run_b))
                   if (n := unrecorded_steps_note(run.manifest)))):
        if note:
            problems.append(note)
    if len(run_a.parts) == 1 and len(run_b.parts) == 1:
        jobs_list = [(next(iter(run_a.parts)), next(iter(run_b.parts)))]
    elif _other_parallelism(run_a, run_b):
        return _across_parallelism(run_a, run_b, out, tensors, engine)
    else:
        common = sorted(set(run_a.parts) & set(run_b.parts))
        for run, other in ((run_a, run_b), (run_b, run_a)):
            alone = sorted(set(run.parts) - set(other.parts))
            if alone:        # one line, whatever the number of steps and ranks
                problems.append(f"{_span('step', {k[0] for k in alone})} x {_span('rank', {k[1] for k in alone})}: "
                                f"{len(alone)} step/rank part(s) only in {run.path}; not compared")
        jobs_list = [(k, k) for k in common]
        merged = _steps_in_one_part(run_a, run_b, common)
        if merged:
            problems.append(merged)
    if not jobs_list:
        raise RecordError(f"{run_a.path} and {run_b.path} have no step/rank in common "
                          f"({sorted(run_a.parts)} vs {sorted(run_b.parts)})")
    translate = _translations(run_a, run_b, mapping)
    fa, fb = (r.manifest.get("framework") or "torch" for r in (run_a, run_b))
    kernels = same_kernels(run_a.manifest, run_b.manifest)
    tasks = [(run_a.parts[ka].path, ka, run_b.parts[kb].path, kb, match, mapping, tensors, translate,
              fa if fa == fb else None, kernels) for ka, kb in jobs_list]
    # under a launcher each rank compares every world-th part with its -j workers; rank 0 merges
    results = gathered(engine, tasks, lambda share: _run_tasks(share, jobs, progress) if engine is None
                       else list(_run_tasks(share, jobs, progress)))
    return said_by_rank0(engine, lambda: _judged_past_one_part(
        _merge(results, run_a, run_b, jobs_list, problems, (fa, fb), out, metric, progress, keep_table),
        merged if len(run_a.parts) > 1 or len(run_b.parts) > 1 else ""), _elsewhere)


def backward_passes(records: list) -> int:
    """How many times backward runs in a part's op records (stretches of backward records): one per
    training step, or per micro-batch of a step that accumulates gradients."""
    passes, before = 0, None
    for r in records:
        if r.get("kind") != "op":
            continue
        stage = r.get("stage")
        passes += stage == "backward" and before != "backward"
        before = stage
    return passes


def _steps_in_one_part(run_a, run_b, common: list) -> str:
    """Why the runs' steps do not pair, where one run holds steps the other lacks and the other's first
    common part runs backward more often: that run recorded several training steps as one (its loop
    never called ``probe.step()`` and no ``torch.optim`` optimizer ended its steps), so its part's
    first step pairs with the other's and the rest of it with nothing (:func:`_judged_past_one_part`);
    else "".  Runs that accumulate gradients alike hold their steps alike."""
    if not common:
        return ""
    key = common[0]
    for run, other in ((run_a, run_b), (run_b, run_a)):
        alone = sorted({k[0] for k in run.parts} - {k[0] for k in other.parts})
        if not alone:
            continue
        mine, theirs = (backward_passes(r.parts[key].records) for r in (run, other))
        if theirs > mine >= 1:
            return (f"{other.path}'s step {key[0]} rank {key[1]} runs backward {theirs} times, {run.path}'s "
                    f"{mine}, and {run.path}'s {_span('step', set(alone))} are not in {other.path}: it records "
                    f"several training steps as one (call probe.step() after each step; without it only a "
                    f"torch.optim optimizer's steps end a step); only its first is compared")
    return ""


def _judged_past_one_part(result: Result, merged: str) -> Result:
    """``result``, unless one run recorded several steps as one (``merged``: :func:`_steps_in_one_part`)
    and it found no error: its later steps were compared with nothing, so a difference entering there
    (another learning rate) would go unseen, and "the runs agree" would say more than was compared:
    :class:`RunsDoNotAlign` then.  A divergence found where the first steps pair is one (a wrong
    kernel runs in every step) and stands."""
    if merged and result.verdict.passed:
        raise RunsDoNotAlign(f"the runs do not align: {merged}", result)
    return result


def _elsewhere(verdict) -> Result:
    """What compare returns on a launcher's other ranks: rank 0's verdict (the table is rank 0's)."""
    return Result(pd.DataFrame(), verdict)


# rows gathered from the parts before they are counted, reported and dropped: each pandas pass over a
# table has a fixed cost (a 1,000-step run's parts are some 600 rows each); this many rows are ~70 MB
CHUNK_ROWS = 50_000


def _merge(results, run_a, run_b, jobs_list: list, problems: list, frameworks: tuple, out, metric: str,
           progress: bool, keep_table: bool = True) -> Result:
    """One verdict from the parts' results (in ``jobs_list`` order), their tables counted and reported
    a chunk of ``CHUNK_ROWS`` rows at a time (or one part, where larger) and then dropped (a
    :class:`~..report.ReportWriter` keeps what the reports need), so memory is bounded by a chunk
    whatever the run's length; the whole table joined and returned only with ``keep_table``."""
    unmatched, divs, aligned = [], [], np.zeros(3, np.int64)
    pairing = PairingShare(frameworks)
    tally, facts, earlier, drift = _Tally(), {}, None, Drift(run_a, run_b)
    chosen: dict = {}        # rank -> (step, the point, "choice" or "random") of its first point compare cannot
                             # judge past: a discrete choice the runs made differently, a random op's draws
    kept: list | None = [] if keep_table else None
    skipped: list = []       # (step, rank, run) of the updates a run's loss scaler skipped
    writer = None
    if out:
        from ..report import ReportWriter
        writer = ReportWriter(out, str(run_a.path), str(run_b.path), metric)
    chunk: list = []
    marks: set = set()

    def flush():
        if not chunk:
            return
        table = chunk[0] if len(chunk) == 1 else pd.concat(chunk, ignore_index=True)
        chunk.clear()
        tally.add(table)
        # the reported columns, in order (the arrays as they are: a copy would hold the table twice)
        table = pd.DataFrame({c: table[c] for c in COLUMNS if c in table.columns}, copy=False)
        if writer is not None:
            writer.add(table, set(marks))
        marks.clear()
        if kept is not None:
            kept.append(table)
    renamed = jobs_list[0][0] != jobs_list[0][1] and len(jobs_list) == 1   # one part of each, other step/rank
    rows = 0
    for res in _one_at_a_time(results):
        table = res.rows if res.arrays is None else pd.DataFrame(res.arrays, copy=False)
        if renamed and len(table):
            table["step"], table["rank"] = jobs_list[0][0]
        unmatched.append(res.unmatched)
        problems.extend(res.problems)
        aligned += res.aligned
        pairing.add(res.pairing)
        if res.skipped:
            skipped.append(res.skipped)
        table, part_divs = _past_undecided(table, list(res.divergences), chosen)
        part_divs, found, earlier = _amplified(table, part_divs, run_a, run_b, earlier)
        part_divs = drift.settle(table, part_divs)
        for d in part_divs:
            if not d.departure and d.cause in _UNDECIDED_AT:
                chosen.setdefault(d.rank, (d.step, d.follows if d.cause.startswith("after_") else
                                           f"{d.op} [{d.scope or '<top>'}] {call_words(d.call, d.call_b)} "
                                           f"{d.arg} ({d.at()}, step {d.step} rank {d.rank})",
                                           _UNDECIDED_AT[d.cause]))
        facts = {**found, **facts}         # each parameter said once, from the first step it differs
        divs.extend(part_divs)
        marks.update((d.step, d.rank, d.stage, d.kind, d.seq) for d in part_divs)
        if len(table):
            chunk.append(table)
            rows += len(table)
        del table, res
        if rows >= CHUNK_ROWS:
            flush()
            rows = 0
    flush()
    um = pd.concat(unmatched, ignore_index=True) if unmatched else pd.DataFrame(columns=UNMATCHED_COLUMNS + ["explained"])
    um["is_cast"] = um["is_cast"].astype(bool)
    first, departures = _first(divs, um, [k for k, _ in jobs_list],
                               lambda step, rank: optimizer_step(run_a, run_b, step, rank), skipped)
    whole, which = _aligned_against(aligned, run_a, run_b)
    share = float(aligned[0]) / max(whole, 1)
    verdict = Verdict(a=str(run_a.path), b=str(run_b.path), forward=first.get("forward"),
                      backward=first.get("backward"), counts=dict(tally.counts), unmatched=um, problems=problems,
                      parts=[k for k, _ in jobs_list], aligned=share,
                      same_run=_same_folder(run_a, run_b, jobs_list), departures=departures, pairing=pairing,
                      explained=amplified_lines(facts) + drift.lines(), below_floor=(tally.below, STATS_NOISE),
                      partial_sums=tally.partial_sums, rewired=tally.rewired, loss_scaled=tally.loss_scaled,
                      after_choice=tally.after_choice, after_random=tally.after_random, drifted=tally.drifted)
    table = _joined(kept) if kept else pd.DataFrame(columns=COLUMNS)
    if writer is not None:
        if not tally.rows:
            writer.add(pd.DataFrame(columns=list(table.columns) or COLUMNS))
        verdict.report = writer.finish(verdict, run_a.manifest, run_b.manifest, progress)
    if not tally.rows:
        why = problems[-1] if problems else "no tensor could be paired"
        raise RecordError(f"nothing could be compared: {why}"
                          + (f" (partial report: {verdict.report})" if verdict.report else ""))
    need = float(standard("compare_standards").get("min_aligned", 0.5))
    if share < need:
        raise RunsDoNotAlign(f"the runs do not align: {whole - int(aligned[0])} of {which} {whole} "
                             f"compute records could not be aligned ({unaligned_hint(run_a.manifest, run_b.manifest)})"
                             + (f" (partial report: {verdict.report})" if verdict.report else ""),
                             Result(table, verdict))
    return Result(table, verdict)


def _aligned_against(aligned, run_a, run_b) -> tuple[int, str]:
    """(compute records the paired share is taken of, whose): the smaller run's, so that a truncated or
    shorter run is judged on what it has; but where one run's compiled graphs were not recorded
    (``torch.compile`` without ``probe_backend``) its records are not the work it did, only the code
    around its graphs, and the share is of the other run's (else a model compiled whole pairs its
    loss and "agrees" with nothing else compared)."""
    unrecorded = [bool(graphs_note(r.manifest)) for r in (run_a, run_b)]
    if unrecorded == [True, False]:
        return int(aligned[2]), "run B's"
    if unrecorded == [False, True]:
        return int(aligned[1]), "run A's"
    return min(int(aligned[1]), int(aligned[2])), "the smaller run's"


# the divergence causes of a point compare cannot judge past (Verdict.undecided), and their kind
_UNDECIDED_AT = {"choice": "choice", "after_choice": "choice", "random": "random", "after_random": "random"}


def _past_undecided(table: pd.DataFrame, divs: list, chosen: dict) -> tuple:
    """A part of a later step of a rank whose earlier step made a discrete choice differently, or drew
    other random numbers, where the runs' values first differed (``chosen``): its values come from
    parameters that point moved apart, so its error and warning rows are not judged (naming it) and
    its divergences follow it, as the verdict says of everything past it.  Other parts are returned
    as they are."""
    if not len(table) or not chosen:
        return table, divs
    step, rank = int(table["step"].iat[0]), int(table["rank"].iat[0])
    made = chosen.get(rank)
    if made is None or made[0] >= step:
        return table, divs
    status = table["status"].to_numpy(object)
    rows = (status == V.ERROR) | (status == V.WARNING)
    if rows.any():
        table.loc[rows, "status"] = V.NOT_JUDGED
        table.loc[rows, "reason"] = f"{AFTER[made[2]]} at step {made[0]}, {made[1]}: not judged"
        if "origin" in table.columns:
            table.loc[rows, "origin"] = False
    return table, [d if d.departure else replace(d, cause=f"after_{made[2]}", follows=made[1], approximate=False,
                                                 failed="", metrics={}, module=None) for d in divs]


class _Tally:
    """The verdict's counts of the table's rows, summed part by part."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.rows = self.below = self.partial_sums = self.loss_scaled = self.after_choice = self.after_random = 0
        self.drifted = 0
        self.rewired = 0

    def add(self, table: pd.DataFrame) -> None:
        if not len(table):
            return
        self.rows += len(table)
        self.counts.update({k: int(v) for k, v in table["status"].value_counts().items()})
        self.below += int((differs(table, 0.0) & ~differs(table)).sum())   # statistics-only rows
        self.partial_sums += int((table["reason"] == PARTIAL_SUMS).sum())
        self.rewired += int((table["reason"] == REWIRED).sum())
        unjudged = table["reason"][table["status"].to_numpy(object) == V.NOT_JUDGED]
        if len(unjudged):
            kinds = undecided_kind(unjudged)
            self.after_choice += int((kinds == "choice").sum())
            self.after_random += int((kinds == "random").sum())
            self.drifted += int(unjudged.astype(str).str.startswith(DRIFTED).sum())
        self.loss_scaled += loss_scale.not_judged(table)


def _joined(tables: list) -> pd.DataFrame:
    """``pd.concat(tables, ignore_index=True)``; where every table has the same columns of the same
    numpy dtypes (what concat then keeps), joined a column at a time, each column's pieces freed
    once joined: the parts and the whole are never both held in full.  ``tables`` is emptied."""
    columns, dtypes = list(tables[0].columns), list(tables[0].dtypes)
    if not all(isinstance(d, np.dtype) for d in dtypes) or any((list(t.columns), list(t.dtypes)) != (columns, dtypes)
                                                                for t in tables[1:]):
        joined = pd.concat(tables, ignore_index=True)
        tables.clear()
        return joined
    pieces = {name: [t[name].to_numpy() for t in tables] for name in columns}
    tables.clear()
    return pd.DataFrame({name: np.concatenate(pieces.pop(name)) for name in columns}, copy=False)


def _amplified(table: pd.DataFrame, divs: list, run_a, run_b, trail: AmplifiedTrail | None) -> tuple:
    """A part whose error rows are only parameters moved apart by the optimizer amplifying cancelled
    gradient noise (:mod:`.amplified`): those rows pass with the reason and the part's divergences go.
    The rule reads what ``trail`` kept of the earlier parts (made at the first part).  Returns (the
    part's divergences, the parameters said, the trail with this part's)."""
    if not len(table):
        return divs, {}, trail
    trail = trail if trail is not None else AmplifiedTrail(run_a, run_b)
    found: dict = {}
    if (table["status"] == "error").any():
        got = trail.explain(table)
        if got is not None:
            rows, found = got
            table.loc[rows, "status"] = "pass"
            table.loc[rows, "reason"] = "parameter moved apart by the optimizer amplifying cancelled gradient noise"
            divs = [d for d in divs if d.departure]
    trail.keep(table)
    return divs, found, trail


def _other_parallelism(run_a, run_b) -> bool:
    """Whether the runs' rank counts differ for their parallelism, not for a ``rank`` filter (a run
    that recorded some ranks of a run like the other is compared rank by rank), or their ranks hold
    the parameters in other pieces (DDP against FSDP2: :func:`.parallel.layout_difference`)."""
    ranks = [{k[1] for k in r.parts} for r in (run_a, run_b)]
    if len(ranks[0]) == len(ranks[1]):
        return bool(layout_difference(run_a, run_b))
    small = 0 if len(ranks[0]) < len(ranks[1]) else 1
    filtered = ((run_a, run_b)[small].manifest.get("config") or {}).get("rank")
    return not (filtered and ranks[small] <= ranks[1 - small])


def _span(what: str, values: set) -> str:
    v = sorted(values)
    return f"{what} {v[0]}" if len(v) == 1 else f"{what}s {', '.join(map(str, v))}" if len(v) <= 4 else \
        f"{what}s {v[0]}..{v[-1]} ({len(v)})"


def unfinished_notes(run_a, run_b) -> list[str]:
    """One warning per run holding step/rank parts its probe never closed (no ``probe.step()`` or
    ``close()`` ended them: the program crashed inside the step, was killed, or is still recording),
    each starting with :data:`~.verdict.UNFINISHED`: what was recorded is compared, what would have
    followed never was, so an agreement is only an agreement up to where they end."""
    notes = []
    for side, run in (("A", run_a), ("B", run_b)):
        open_parts = [k for k, part in run.parts.items() if part.closed is False]
        if open_parts:
            notes.append(f"{UNFINISHED} run {side}: {_span('step', {k[0] for k in open_parts})} x "
                         f"{_span('rank', {k[1] for k in open_parts})}: {len(open_parts)} step/rank part(s) never "
                         "closed (the program ended inside the step: it crashed, was killed, or is still recording); "
                         "compared up to their last record")
    return notes


def _across_parallelism(run_a, run_b, out: str | None, tensors: bool, engine=None) -> Result:
    """Runs of different rank counts (1 process vs DDP/FSDP2): compared on what both hold
    (:mod:`.parallel`, steps shared among a launcher's ranks); ``out`` gets ``compare.csv``."""
    from .parallel import compare_parallelism, merge_steps
    steps = sorted({k[0] for k in run_a.parts} & {k[0] for k in run_b.parts})
    results = gathered(engine, steps, lambda share: compare_parallelism(run_a, run_b, tensors, share))
    def merged():
        table, verdict = merge_steps(run_a, run_b, results)
        verdict.problems[:0] = unfinished_notes(run_a, run_b)
        return _parallel_result(run_a, run_b, (table, verdict), out)
    return said_by_rank0(engine, merged, _elsewhere)


def _parallel_result(run_a, run_b, merged, out) -> Result:
    table, verdict = merged
    if out:
        from ...records.writer import atomic_write_text
        from ..frame_csv import csv_text
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, "compare.csv")
        atomic_write_text(path, csv_text(table))
        verdict.report = path
    if not len(table):
        raise RecordError(f"nothing could be compared across the parallelism of {run_a.path} and {run_b.path}: "
                          + "; ".join(verdict.unpaired[:3] or ["no loss, forward op or parameter record pairs"]))
    return Result(table, verdict)


# causes that name no source in their own part: the stage's differences come from elsewhere (another
# stage's values, a random draw or a discrete choice, rounding noise, constants); a rank whose values
# differ only through a collective's result says so, while the rank that made the difference names its op
_NO_SOURCE = frozenset({"inherited", "after_random", "after_inputs", "after_choice", "noise", "constant", "rounding"})


def _source_tier(d, received: set, sourced_from: float = float("inf")) -> float:
    """How a step/rank part's divergence ranks among the ranks' of its step: 0 names a source in its
    own part; 1 follows from elsewhere in the part (:data:`_NO_SOURCE`); 2 came from other ranks --
    values a collective received (cause ``received``), or inputs no recorded op made and no earlier
    step explains in a part that received differing values (``received``: its (rank, step); FSDP2
    hands each gradient on as a view of the reduce-scatter's flat result, which no record shows).
    Errors grown from rounding (cause ``rounding``) rank after the rest of 1 from step
    ``sourced_from`` on, where some part names a source of its own: there a rank's errors may come
    from that source through a collective (a wrong relu on rank 1 of a bfloat16 run reaches rank 0's
    reduce-scattered gradients), which one rank's records cannot tell from rounding."""
    if d.cause == "received" or (d.cause == "inputs" and not d.came_from and (d.rank, d.step) in received):
        return 2
    if d.cause == "rounding" and d.step >= sourced_from:
        return 1.5
    return int(d.cause in _NO_SOURCE)


def _first(divs: list, unmatched: pd.DataFrame, parts: list, stepped=None, skipped: list = ()) -> tuple[dict, list]:
    """Per stage, the divergence of the first step/rank part that has one; for the stages with none,
    their first departure.  Inputs that differ at a later step are traced to the earlier step's origin,
    and a later step never outranks it: where a stage departed within tolerance at an earlier step than
    its first divergence, that departure is the stage's divergence (every value entering the later
    step already differs, so its sources cannot be told from what the earlier step set off), unless
    the earlier step has a source beyond tolerance (a stage's error rows: a wrong backward kernel whose
    gradients the optimizer applied) or the parameter records name the one-run-only op that made the
    gradient that moved them apart.  A later step whose values differ only from where they entered it
    (no source of its own) after one run's loss scaler skipped an update (``skipped``: (step, rank,
    run)) says so (:func:`_after_skip`)."""
    by_part: dict = {}
    for d in divs:
        by_part.setdefault((d.rank, d.step), {})[(d.stage, d.departure)] = d
    first: dict = {}
    early: dict = {}
    sourced: set = set()     # divergences whose inputs an earlier step's source beyond tolerance moved apart
    for d in sorted(divs, key=lambda d: (d.step, d.rank)):
        if d.cause == "inputs" and not d.came_from:
            d.came_from, beyond = _came_from(by_part, unmatched, parts, d, stepped)
            if beyond:
                sourced.add(id(d))
    received = {(d.rank, d.step) for d in divs if d.cause == "received"}
    sourced_from = min((d.step for d in divs if not d.departure and _source_tier(d, received) == 0), default=float("inf"))
    for d in sorted(divs, key=lambda d: (d.step, _source_tier(d, received, sourced_from), d.rank)):
        (early if d.departure else first).setdefault(d.stage, d)
    for stage, d in list(first.items()):
        e = early.get(stage)
        if d.cause == "rounding":
            first[stage] = _parted_before(divs, d)
        elif e is not None and e.step < d.step and id(d) not in sourced:
            # an op of the later step that looks, on statistics alone, like it adds a difference of its own past
            # the error line (d.unjudged) is no rounding's: the line stays the departure's, naming that op
            first[stage] = _parted_before(divs, _grown_from(e, d)) if e.rounding_at and not d.unjudged \
                else _leads_to(e, d)
    for stage, d in list(first.items()):
        first[stage] = _after_skip(d, skipped)
    return first, [early[s] for s in ("forward", "backward") if s in early and s not in first]


# causes of a later step's line whose differences come from the values entering that step, not from an op of it
_ENTERED = frozenset({"rounding", "inputs", "after_inputs"})


def _after_skip(d, skipped: list):
    """``d`` as the line of a step after one whose update a run's loss scaler skipped (its loss scale
    overflowed in that step's backward: :mod:`.loss_scale`), where ``d``'s differences only entered
    with the step's values (:data:`_ENTERED`).  Why: the other run applied that update, so from the
    next step on the runs compute from other parameters; those error rows read as grown from
    rounding, or as parameters that differ, while the parameters differ by a whole update, which no
    kernel made.  Cause ``skipped``, no op named; ``d`` unchanged where no such skip precedes it."""
    if d.departure or d.cause not in _ENTERED:
        return d
    skip = max(((step, run) for step, rank, run in skipped if rank == d.rank and step < d.step), default=None)
    if skip is None:
        return d
    step, run = skip
    return replace(d, cause="skipped", approximate=False, unjudged="", came_from="",
                   follows=f"run {run.upper()}'s loss scaler skipped step {step}'s update (its loss scale "
                           f"overflowed in that step's backward)")


def _leads_to(e, d):
    """Departure ``e`` of an earlier step as its stage's divergence: ``d``'s error rows (a later
    step's) come after it, and the values entering that step already differ; an op of that step
    that looked like it added a difference of its own on statistics alone (``d.unjudged``) is
    still said."""
    where = f"{d.op} [{d.scope or '<top>'}]"
    why = (f"there the inputs/parameters differ, first seen at {where} {d.arg}" if d.cause == "inputs" else
           f"there they follow from differing {d.inherited_from()} values" if d.cause == "inherited" else
           f"there they come from other ranks through {where}" if d.cause == "received" else f"they start at {where}"
           + (" (approximate)" if d.approximate else ""))
    return replace(e, departure=False, errors=d.errors, unjudged=e.unjudged or d.unjudged,
                   failed=f"{e.failed} (within tolerance at step {e.step}; the {d.errors} {d.stage} error rows of "
                          f"step {d.step} rank {d.rank} come after it: {why})")


def _grown_from(e, d):
    """``d``'s error rows (a later step's) grown from departure ``e`` of an earlier step, a difference of
    rounding size where the runs compute in other precisions (fp16 or bf16 autocast against fp32, fp16
    against bf16): the optimizer's updates carried it into the later step's values, so ``e`` is no
    kernel's divergence and, the later step's values differing already, neither is an op of ``d``'s;
    cause ``rounding``, no op named."""
    return replace(d, cause="rounding", follows=e.rounding_at, approximate=False, unjudged="", came_from="")


def _parted_before(divs: list, d):
    """A stage whose error rows grew from differences of rounding size (cause ``rounding``) at a later
    step than the runs first parted: that step's values came from the earlier steps' updates, so the
    line names the first step and place where any value differs (any stage, any rank), not only
    where this step's difference enters."""
    earlier = [e for e in divs if e.step < d.step]
    if not earlier:
        return d
    e = min(earlier, key=lambda e: (e.step, e.rank, e.stage != "forward", e.seq))
    at = e.follows if e.cause == "rounding" else e.where()
    return replace(d, came_from=f"the runs part first at step {e.step}, at {at}; each step's update carries the "
                                f"difference into the next step's values")


def _came_from(by_part: dict, unmatched: pd.DataFrame, parts: list, d, stepped=None) -> tuple[str, bool]:
    """Where the values differing at step ``d.step``'s start came from: the nearest earlier step
    of the rank, its backward's own origin first (the gradients), else its forward's; an op present in
    one run only that made the gradient applied (a hook) comes before a difference within tolerance
    (eager and compiled kernels round apart everywhere).  Where that
    step's paired records agree, the parameter records (``stepped``: :func:`.parallel.optimizer_step`)
    say which parameter its optimizer step moved apart and which record made the gradient applied:
    an op present in one run only is the source where it made that gradient (a gradient hook),
    else the optimizer step is, its gradient made by records that agree (a normalising optimizer
    turns gradients that agree within rounding, an attention key bias's, into updates that part).
    Without them a one-run-only op is named as a suspect beside the optimizer step: such ops are
    also one run's decompositions (a compiled graph's), which make no gradient of their own.  Returns
    the line and whether it names a source beyond tolerance (a divergence with error rows, or the
    one-run-only op that made the gradient applied): such a source, not a difference within tolerance
    of that step, is where the later step's inputs part."""
    steps = {step for step, rank in parts if rank == d.rank}
    earlier = [step for step in steps if step < d.step]
    if not earlier:
        return "", False
    step = max(earlier)
    got = by_part.get((d.rank, step), {})
    um = unmatched[(unmatched["step"] == step) & (unmatched["rank"] == d.rank) & ~unmatched["is_cast"]
                   & (unmatched["explained"] == "")] if len(unmatched) else unmatched
    facts = None
    for departure in (False, True):
        if departure:   # a gradient a one-run-only op made (a hook) before a difference within tolerance
            facts = stepped(step, d.rank) if stepped is not None else None
            maker = _gradient_maker(um, facts)
            if maker is not None:
                return f"they come from step {step}: {_one_run_only(maker)}, which made the gradient applied; " \
                       f"{facts.said}", True
        for stage in ("backward", "forward"):
            src = got.get((stage, departure))
            if src is not None and src.cause not in ("inherited", "after_random", "after_inputs", "after_choice"):
                return f"they come from step {step}: {src.describe().splitlines()[0]}", not departure
    if facts is not None and facts.said:
        if facts.gradient_agrees is False and None not in facts.made_by:
            return (f"step {step}'s op records agree; they come from its optimizer step: {facts.said}, within what "
                    f"the records that made it allow (an optimizer normalising its updates, as Adam's, moves "
                    f"parameters apart by such differences)"), False
        return f"step {step}'s op records agree; they come from its optimizer step: {facts.said}", False
    if len(um):
        u = um.assign(_bwd=um["stage"] != "backward").sort_values(["_bwd", "seq", "op", "scope", "call"]).iloc[0]
        return (f"they come from step {step}, whose paired records agree: from an op present in one run only "
                f"(first: {_one_run_only(u)}) or from its optimizer step"), False
    return (f"step {step}'s records agree: they come from the optimizer step or other code between the steps "
            "(not recorded)"), False


def _gradient_maker(unmatched: pd.DataFrame, facts):
    """The one-run-only op (its ``unmatched`` row) that made the gradient the optimizer applied to the
    first parameter that differs after the step (``facts``: :func:`.parallel.optimizer_step`), or None."""
    if facts is None or not facts.said or not len(unmatched):
        return None
    for side, name in zip("ab", facts.made_by):
        maker = unmatched[(unmatched["side"] == side) & (unmatched["name"] == name)] if name is not None else ()
        if len(maker):
            return maker.iloc[0]
    return None


def _one_run_only(u) -> str:
    """An unmatched record's row, as the verdict names it."""
    return (f"{u['op']} [{u['scope'] or '<top>'}] call {u['call']} (#{u['seq']} in {u['stage']}), "
            f"present only in run {u['side'].upper()}")


def _same_folder(run_a, run_b, jobs_list) -> bool:
    """Whether every compared pair is one folder read twice (``compare A A``)."""
    return all(os.path.realpath(run_a.parts[ka].path) == os.path.realpath(run_b.parts[kb].path) for ka, kb in jobs_list)


def _progress_bar(total: int):
    """tqdm's bar over the parts, or None without tqdm.  Imported only for a bar shown: importing
    tqdm reads the installed packages' metadata, ~40 ms of a compare that shows no progress."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return None
    return tqdm(total=total, desc="compare", unit="part", leave=False)


def _one_at_a_time(results):
    """The items of ``results`` (a list or an iterator), a list's each dropped from it as it is handed
    on: the caller then holds one part's result at a time."""
    if not isinstance(results, list):
        yield from results
        return
    for k in range(len(results)):
        res, results[k] = results[k], None
        yield res


def _run_tasks(tasks, jobs: int, progress: bool):
    """The parts' results, in ``tasks``' order, each made when the caller asks for it (``-j``: at most
    two per worker made ahead), so that a long run's parts are never all held at once."""
    bar = _progress_bar(len(tasks)) if progress else None
    try:
        if jobs > 1 and len(tasks) > 1:
            with ProcessPoolExecutor(max_workers=min(jobs, len(tasks))) as pool:
                ahead = 2 * min(jobs, len(tasks))
                futures = [pool.submit(_worker, t) for t in tasks[:ahead]]
                for k in range(len(tasks)):
                    if k + ahead < len(tasks):
                        futures.append(pool.submit(_worker, tasks[k + ahead]))
                    res, futures[k] = futures[k].result(), None
                    if bar:
                        bar.update()
                    yield res
        else:
            texts: dict = {}    # the parts' tables share their strings and shapes (compare_parts)
            for t in tasks:
                res = _worker(t, texts)
                if bar:
                    bar.update()
                yield res
    finally:
        if bar:
            bar.close()
