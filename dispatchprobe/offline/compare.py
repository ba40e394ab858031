"""Offline compare of two runs: align op by op, compute the metrics, name the first divergence.

Runs on numpy + pandas only (DESIGN invariant 1): this module, ``align``, ``report``, ``reader``
and ``standards`` never import torch.  Every metric, statistic and verdict comes from
``dispatchprobe.standards`` (invariant 2); the metric columns derive from its registry
(invariant 8).  Run A is the run under test ("actual"), run B the benchmark ("expected").

    >>> table, verdict = dispatchprobe.compare("runs/npu", "runs/cpu")
    >>> print(verdict)
"""

from __future__ import annotations

import bisect
import contextlib
import math
import os
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pandas as pd

from ..standards import metrics as M, statistics as S, verdicts as V
from ..standards.loader import is_float, standard
from ..core import op_traits
from .align import Mapping, align, stats_distance
from .translate import Translation
from ..records.reader import Part, RecordError, load, no_gc, tensor_list

STATS = S.KEYS
# the metrics compare shows (registry order; rel_l2_err also holds a binary row's mismatch rate)
TENSOR_METRICS = M.derived(M.compare_columns)
# CSV columns, in order (documented in docs/compare.md); stats_err and error are compare's own
COLUMNS = M.derived(lambda: ["step", "rank", "stage", "kind", "seq", "scope", "op_a", "op_b", "name_a", "name_b",
                             "call_a", "call_b", "match", "io", "arg", "dtype_a", "dtype_b", "shape_a", "shape_b"]
                    + [f"{s}_{side}" for s in STATS for side in ("a", "b")] + ["nan_a", "nan_b", "inf_a", "inf_b"]
                    + [f"{s}_diff" for s in STATS] + [f"{s}_rel_diff" for s in STATS] + ["checksum_match"]
                    + M.compare_columns() + ["stats_err", "error", "status", "reason", "origin", "stack"])
UNMATCHED_COLUMNS = ["step", "rank", "side", "stage", "kind", "seq", "scope", "op", "name", "call", "is_cast"]
# the metrics compare computes: its columns and what its verdicts read; and their values on equal tensors
_COMPUTED = M.derived(lambda: set(M.compare_columns()) | set(V.COMPARE_READS))
_PERFECT = M.derived(lambda: {m: M.METRICS[m].perfect for m in _COMPUTED})
# the per-tensor row built by compare_parts, before the statistics columns
_ROW_FIELDS = ("stage", "kind", "seq", "scope", "op_a", "op_b", "name_a", "name_b", "call_a", "call_b", "match",
               "io", "arg", "dtype_a", "dtype_b", "shape_a", "shape_b", "nan_a", "nan_b", "inf_a", "inf_b",
               "checksum_a", "checksum_b", "data_a", "data_b", "stack", "uid",
               # internal: undefined contents; the precision a value carries when below its dtype's
               "undef_a", "undef_b", "lineage_a", "lineage_b", "spec_a", "spec_b")
_FLOAT_FIELDS = frozenset(f"{s}_{side}" for s in STATS for side in ("a", "b"))
NOT_JUDGED = "not judged"   # status of a row whose values are undefined (uninitialised memory)


@dataclass
class Divergence:
    """Where one stage's error rows come from (``cause``):

    - ``op``: the first op (or smallest module) whose own error crosses the line: its outputs differ
      while its inputs agree, or its error exceeds its inputs' ``origin_amplification``-fold;
    - ``unmatched``: an op present in one run only (``side``) between agreeing and failing records;
    - ``inputs``: a value no recorded op produced (parameter, data) already differs (``arg``);
    - ``unrecorded``: an input differs although the op that produced it agreed;
    - ``inherited``: backward only: no backward op diverges by itself, its errors come from forward values.
    """

    stage: str
    step: int
    rank: int
    seq: int
    scope: str
    op: str
    name: str
    call: int
    kind: str
    failed: str                  # why: the reasons of its failing tensors
    metrics: dict = field(default_factory=dict)
    stack: list = field(default_factory=list)
    module: str | None = None    # smallest module whose output differs and whose inputs agree
    cause: str = "op"
    side: str = "a"              # the run holding the record (``unmatched`` ops of run B: "b")
    arg: str = ""                # the tensor where ``inputs``/``inherited``/``unrecorded`` is seen
    errors: int = 0              # error rows of this stage in this step/rank part

    def where(self) -> str:
        return (f"{self.op} [{self.scope or '<top>'}] call {self.call} "
                f"(#{self.seq} in {self.stage}{'' if self.side == 'a' else ' of run B'}, "
                f"step {self.step} rank {self.rank})")

    def describe(self) -> str:
        if self.cause == "inputs":
            lines = [f"the runs differ already at their inputs/parameters: first seen at {self.op} "
                     f"[{self.scope or '<top>'}] {self.arg} (#{self.seq} in {self.stage}, step {self.step} "
                     f"rank {self.rank}): {self.failed}"]
        elif self.cause == "inherited":
            lines = [f"{self.stage}: no {self.stage} op diverges by itself; its {self.errors} error rows follow from "
                     f"differing forward values (first at {self.op} [{self.scope or '<top>'}] {self.arg}, "
                     f"#{self.seq} in {self.stage}, step {self.step} rank {self.rank})"]
        elif self.cause == "unmatched":
            lines = [f"first {self.stage} divergence: {self.where()}, present only in run {self.side.upper()} "
                     f"(prime suspect): {self.failed}"]
        else:
            lines = [f"first {self.stage} divergence: {self.where()}: {self.failed}"]
        if self.module and self.module != self.scope:
            lines.append(f"  smallest module whose output differs: {self.module}")
        lines += [f"  at {frame}" for frame in self.stack[-4:]]
        return "\n".join(lines)


@dataclass
class Verdict:
    """What compare concluded; ``str()`` gives the terminal summary."""

    a: str
    b: str
    forward: Divergence | None
    backward: Divergence | None
    counts: dict
    unmatched: pd.DataFrame
    problems: list
    parts: list
    report: str | None = None
    aligned: float = 1.0         # share of the smaller run's compute records (ops, modules) paired
    same_run: bool = False       # A and B are the same folder: agreement says nothing

    @property
    def passed(self) -> bool:
        return self.counts.get("error", 0) == 0

    @property
    def damaged(self) -> list:
        """Problems reading saved tensors (cut short or corrupt shards): their rows fell back to
        statistics, so an agreement is only an agreement on what could be read."""
        return [p for p in self.problems if p.startswith("damaged record")]

    @property
    def inputs_differ(self) -> bool:
        return any(d is not None and d.cause == "inputs" for d in (self.forward, self.backward))

    @property
    def compared(self) -> int:
        return int(sum(self.counts.values()))

    def __str__(self) -> str:
        counts = ", ".join(f"{k} {self.counts.get(k, 0)}" for k in ("pass", "warning", "error"))
        if self.counts.get(NOT_JUDGED):
            counts += f", not judged {self.counts[NOT_JUDGED]} (undefined values)"
        lines = [f"compared {self.compared} tensors in {len(self.parts)} step/rank part(s): {counts}"]
        for div, stage in ((self.forward, "forward"), (self.backward, "backward")):
            lines.append(div.describe() if div else f"no {stage} divergence")
        if self.passed and self.damaged:
            lines.append("the runs agree on what could be read; damaged records were not compared (see the "
                         "warnings)")
        elif self.passed and self.same_run:
            lines.append(f"the runs agree: A and B are the same records ({self.a}); compare it with another run")
        elif self.passed:
            lines.append("the runs agree")
        compute = self.unmatched[~self.unmatched["is_cast"]] if len(self.unmatched) else self.unmatched
        if len(self.unmatched):
            lines.append(f"unmatched records: {len(self.unmatched)} ({len(compute)} compute ops or modules, "
                         f"{len(self.unmatched) - len(compute)} casts)")
        lines += [f"warning: {p}" for p in self.problems[:5]]
        if len(self.problems) > 5:
            lines.append(f"warning: ... {len(self.problems) - 5} more problems "
                         + ("(listed in the report)" if self.report else "(add -o DIR to list them in DIR/compare.html)"))
        if self.report:
            lines.append(f"report: {self.report}")
        return "\n".join(lines)


class RunsDoNotAlign(RecordError):
    """The runs' records mostly do not pair (different models or options); ``result`` holds what did."""

    def __init__(self, message: str, result=None):
        super().__init__(message)
        self.result = result


class Result(NamedTuple):
    """``(table, verdict)``; unpack it or use ``.table`` / ``.verdict``."""

    table: pd.DataFrame
    verdict: Verdict


# ---- one step/rank part -------------------------------------------------------------------------
def _swap_commutative(ta: list, tb: list) -> list:
    """``tb`` with its two inputs exchanged when they match ``ta``'s crosswise by their statistics
    (``mul(a, b)`` recorded as ``mul(b, a)`` by another framework)."""
    ins_a = [x for x in ta if x[1] in ("input.0", "input.1")]
    ins_b = [x for x in tb if x[1] in ("input.0", "input.1")]
    if len(ins_a) != 2 or len(ins_b) != 2:
        return tb
    straight = stats_distance(ins_a[0][2], ins_b[0][2]) + stats_distance(ins_a[1][2], ins_b[1][2])
    crossed = stats_distance(ins_a[0][2], ins_b[1][2]) + stats_distance(ins_a[1][2], ins_b[0][2])
    if crossed >= straight:
        return tb
    swap = {"input.0": ins_b[1][2], "input.1": ins_b[0][2]}
    return [(io, arg, swap.get(arg, spec)) if io == "input" else (io, arg, spec) for io, arg, spec in tb]


def _decomposed_scopes(recs_a: list, recs_b: list, translate: tuple) -> set:
    """(stage, scope) of the modules both runs recorded a boundary of, whose own ops differ (after
    translation): the two frameworks decompose that module differently (a loss), so it is
    compared at its boundary (its module records), not op by op."""
    def own_ops(recs, other):
        unseen = other.unobservable if other is not None else {}   # not a decomposition: unobserved
        ops, bounds = {}, set()
        for r in recs:
            key = (r["stage"], r["scope"])
            if r["kind"] == "module":
                bounds.add(key)
            elif r["scope"] and not (r["stage"] == "backward" and r["op"] in unseen):
                ops.setdefault(key, []).append(r["op"])
        return ops, bounds
    (ops_a, bounds_a), (ops_b, bounds_b) = own_ops(recs_a, translate[1]), own_ops(recs_b, translate[0])
    return {k for k in bounds_a & bounds_b if sorted(ops_a.get(k, [])) != sorted(ops_b.get(k, []))}


def _explain_unobservable(unmatched: pd.DataFrame, translate: tuple, problems: list, step: int, rank: int):
    """Mark the PyTorch side's unmatched backward records whose counterpart the other framework
    runs unobserved (``unobservable`` in its translation), and say so once."""
    for side, other in (("a", translate[1]), ("b", translate[0])):
        if other is None or not other.unobservable:
            continue
        hit = (unmatched["side"] == side) & (unmatched["stage"] == "backward") & unmatched["op"].isin(other.unobservable) \
            & (unmatched["explained"] == "")
        unmatched.loc[hit, "explained"] = [f"not observable in the other framework ({other.unobservable[op]})"
                                           for op in unmatched.loc[hit, "op"]]
        if hit.any():
            kernels = sorted({other.unobservable[op] for op in unmatched.loc[hit, "op"]})
            problems.append(f"step {step} rank {rank}: {int(hit.sum())} backward record(s) of run {side.upper()} have no "
                            f"counterpart: the other framework runs {', '.join(kernels)} outside its dispatch mode "
                            "on that device (not observable)")
    return unmatched


def _pair_tensors(ta: list, tb: list, same_op: bool, op: str = ""):
    """(io, arg, spec_a, spec_b) of two paired records' tensors (``ta``, ``tb``: their walks);
    ``op`` given (runs of two frameworks): a commutative op's inputs may come in the other order."""
    if same_op and op_traits.base_name(op) in op_traits.COMMUTATIVE:
        tb = _swap_commutative(ta, tb)
    if same_op and len(ta) == len(tb) and all(x[1] == y[1] for x, y in zip(ta, tb)):
        for (io, arg, sa), (_, _, sb) in zip(ta, tb):  # the usual case: the same arguments in order
            yield io, arg, sa, sb
    elif same_op:
        by_arg = {arg: (io, spec) for io, arg, spec in tb}
        for io, arg, spec in ta:
            hit = by_arg.get(arg)
            if hit is not None:
                yield io, arg, spec, hit[1]
    else:  # substituted kernel: pair outputs in order
        oa = [(arg, s) for io, arg, s in ta if io == "output"]
        ob = [s for io, arg, s in tb if io == "output"]
        for (arg, sa), sb in zip(oa, ob):
            yield "output", arg, sa, sb


class _Flow(NamedTuple):
    """The data flow of one part's records, keyed by ``id()`` of the tensor specs."""

    src: dict       # input spec -> (index, output arg) of the record that produced the value
    lineage: dict   # float spec -> the lowest precision rank (``verdicts.PRECISIONS``) it was computed
                    # from, where that is below its own dtype's
    walks: list     # per record: its tensors, ``(io, arg, spec)`` (records.format.walk)
    undefined: set  # specs flagged ``undefined`` (uninitialised memory)


def _signature(spec: dict):
    """A value recognised by its dtype and statistics, where no saved-tensor key says more
    (statistics records; reshapes autograd makes without a record keep all of them)."""
    st = spec.get("stats")
    if not st:
        return None
    if st.get("nan"):   # nan never equals itself: key it by its text
        return (spec["dtype"], *map(str, st.values()))
    return (spec["dtype"], *st.values())


def _flow(recs: list) -> _Flow:
    """Which earlier record produced each input (the latest with that value) and the precision each
    value carries: a float value computed from bfloat16 values carries bfloat16 rounding, whatever its
    own dtype.  Op records produce values; module records only where a part has no op records."""
    producers = "op" if any(r["kind"] == "op" for r in recs) else "module"
    by_data: dict = {}
    by_sig: dict = {}
    src: dict = {}
    lineage: dict = {}
    ranks: dict = {}
    undefined: set = set()
    walks = [tensor_list(r) for r in recs]
    for i, r in enumerate(recs):
        low = None
        produces = r["kind"] == producers
        for io, arg, spec in walks[i]:
            dt = spec["dtype"]
            own = ranks.get(dt)
            if own is None:
                own = ranks[dt] = V.precision_rank(dt)
            data = spec.get("data")
            if spec.get("undefined"):
                undefined.add(id(spec))
            if io == "input" or not produces:
                hit = by_data.get(data) if data is not None else None
                if hit is None:
                    sig = _signature(spec)
                    hit = by_sig.get(sig) if sig is not None else None
                if hit is not None and io == "input":
                    src[id(spec)] = hit[0], hit[1]
                if own < 0:
                    continue
                rk = own if hit is None or hit[2] is None else min(own, hit[2])
                if io == "output" and hit is None and low is not None:
                    rk = min(rk, low)
                if rk < own:
                    lineage[id(spec)] = rk
                if io == "input":
                    low = rk if low is None else min(low, rk)
            else:
                rk = None if own < 0 else own if low is None else min(own, low)
                if rk is not None and rk < own:
                    lineage[id(spec)] = rk
                entry = (i, arg, rk)
                if data is not None:
                    by_data[data] = entry
                sig = _signature(spec)
                if sig is not None:
                    by_sig[sig] = entry
    return _Flow(src, lineage, walks, undefined)


def _frames(part: Part, record: dict) -> list:
    try:
        return list(part.stacks.get(record.get("stack"), []))
    except Exception:  # a stacks file we cannot read must not stop a compare
        return []


class PartResult(NamedTuple):
    rows: pd.DataFrame
    unmatched: pd.DataFrame
    problems: list
    divergences: list     # at most one :class:`Divergence` per stage
    aligned: tuple        # (compute records paired, compute records of A, of B)


def compare_parts(part_a: Part, part_b: Part, match: str = "fuzzy", mapping: Mapping | None = None,
                  tensors: bool = True, translate: tuple = (None, None)) -> PartResult:
    """Compare one step/rank part against another; ``translate``: each side's
    :class:`~dispatchprobe.offline.translate.Translation` into aten's vocabulary, or None."""
    with no_gc():
        return _compare_parts(part_a, part_b, match, mapping or Mapping(), tensors, translate)


def _compare_parts(part_a: Part, part_b: Part, match: str, mapping: Mapping, tensors: bool, translate: tuple):
    recs_a, recs_b = (t.records(p.records) if t else p.records for t, p in zip(translate, (part_a, part_b)))
    # an overflow re-run of a compiled record repeats that record's call (same name): compared once
    recs_a, recs_b = ([r for r in recs if not (r.get("compiled") or {}).get("rerun")] for recs in (recs_a, recs_b))
    decomposed = _decomposed_scopes(recs_a, recs_b, translate) if any(translate) else set()
    if decomposed:       # compared at the module's boundary: its ops go to unmatched, explained
        inside = lambda r: r["kind"] == "op" and (r["stage"], r["scope"]) in decomposed   # noqa: E731
        set_aside = [[r for r in recs if inside(r)] for recs in (recs_a, recs_b)]
        recs_a, recs_b = ([r for r in recs if not inside(r)] for recs in (recs_a, recs_b))
    problems = list(part_a.problems) + list(part_b.problems)
    cross = any(translate)     # two frameworks: argument order and op order may differ, not the values
    al = align(recs_a, recs_b, match=match, mapping=mapping, by_stats=cross)
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
    flow_a, flow_b = _flow(recs_a), _flow(recs_b)
    walks_a, walks_b = flow_a.walks, flow_b.walks
    # most runs carry no lower precision and no undefined value: no per-row lookup then
    lin_a, lin_b = flow_a.lineage.get if flow_a.lineage else None, flow_b.lineage.get if flow_b.lineage else None
    und_a, und_b = flow_a.undefined, flow_b.undefined

    rows = []
    append = rows.append
    empty: dict = {}
    for i, j, how in al.pairs:
        ra, rb = recs_a[i], recs_b[j]
        same = mapping.op(ra["op"]) == rb["op"] or how == "module"
        stack = None
        head = (ra["stage"], ra["kind"], seq_a[i], ra["scope"], ra["op"], rb["op"], ra["name"], rb["name"],
                ra["call"], rb["call"], how)
        overwritten = op_traits.overwrites_first_input(ra["op"])
        for io, arg, sa, sb in _pair_tensors(walks_a[i], walks_b[j], same, rb["op"] if cross else ""):
            if overwritten and arg == "input.0":
                continue  # the destination's old (often uninitialised) content is not an input
            if stack is None:
                frames = _frames(part_a, ra) if ra.get("stack") is not None else []
                stack = " | ".join(frames[-3:]) if frames else ""
            sta, stb = sa.get("stats") or empty, sb.get("stats") or empty
            append(head + (io, arg, sa["dtype"], sb["dtype"], tuple(sa["shape"]), tuple(sb["shape"]),
                           sta.get("nan"), stb.get("nan"), sta.get("inf"), stb.get("inf"),
                           sa.get("checksum"), sb.get("checksum"), sa.get("data"), sb.get("data"), stack, i,
                           bool(und_a) and id(sa) in und_a, bool(und_b) and id(sb) in und_b,
                           lin_a(id(sa), -1) if lin_a else -1, lin_b(id(sb), -1) if lin_b else -1, id(sa), id(sb),
                           sta.get("max"), stb.get("max"), sta.get("min"), stb.get("min"),
                           sta.get("mean"), stb.get("mean"), sta.get("norm"), stb.get("norm")))
    names = _ROW_FIELDS + tuple(f"{s}_{side}" for s in STATS for side in ("a", "b"))
    columns = list(zip(*rows)) if rows else [()] * len(names)
    del rows
    data = {}
    for name, col in zip(names, columns):
        if name in _FLOAT_FIELDS:  # None -> nan; numbers and "inf"/"nan" strings -> float, as float() does
            data[name] = np.array(col, dtype=np.float64)
        else:
            data[name] = list(col)
    del columns
    df = pd.DataFrame(data)
    df.insert(0, "rank", rank)
    df.insert(0, "step", step)

    rows = []
    for side, idx, recs, seq in (("a", al.only_a, recs_a, seq_a), ("b", al.only_b, recs_b, seq_b)):
        for i in idx:
            r = recs[i]
            rows.append((step, rank, side, r["stage"], r["kind"], seq[i], r["scope"], r["op"], r["name"], r["call"],
                         op_traits.is_cast(r["op"])))
    explained = [""] * len(rows)
    if decomposed:
        for side, recs in zip("ab", set_aside):
            for r in recs:
                rows.append((step, rank, side, r["stage"], r["kind"], -1, r["scope"], r["op"], r["name"], r["call"],
                             op_traits.is_cast(r["op"])))
                explained.append(f"decomposed differently: compared at the boundary of {r['scope']}")
    unmatched = pd.DataFrame(rows, columns=UNMATCHED_COLUMNS)
    unmatched["explained"] = explained
    unmatched = _explain_unobservable(unmatched, translate, problems, step, rank)
    if decomposed:
        problems.append(f"step {step} rank {rank}: compared at their boundary (the frameworks decompose them "
                        f"differently): {', '.join(sorted({f'{sc} ({st})' for st, sc in decomposed}))}")
    if recs_a and recs_b and not al.pairs:
        problems.append(f"step {step} rank {rank}: no record of {part_a.path} could be aligned with "
                        f"{part_b.path} (different models?)")
    elif len(unmatched) and (~unmatched["is_cast"] & (unmatched["explained"] == "")).any():
        hint = " (different models or options?)" if len(unmatched) > 0.2 * (len(recs_a) + len(recs_b)) else ""
        problems.append(f"step {step} rank {rank}: {int((~unmatched['is_cast'] & (unmatched['explained'] == '')).sum())} of "
                        f"{len(recs_a) + len(recs_b)} records could not be aligned{hint}; listed in unmatched.csv")
    df = _score(df, part_a, part_b, tensors, problems)
    compute = [sum(1 for r in recs if not op_traits.is_cast(r["op"])) for recs in (recs_a, recs_b)]
    paired = sum(1 for i, _, _ in al.pairs if not op_traits.is_cast(recs_a[i]["op"]))
    divs = _divergences(df, part_a, recs_a, recs_b, al, seq_a, seq_b, flow_a, flow_b) if len(df) else []
    return PartResult(df, unmatched, problems, divs, (paired, *compute))


# ---- where the error rows come from ---------------------------------------------------------------
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


def _score(df: pd.DataFrame, part_a: Part, part_b: Part, tensors: bool, problems: list) -> pd.DataFrame:
    """Add the metric and verdict columns to the paired rows (vectorised where the metric allows)."""
    n = len(df)
    sa = {s: df[f"{s}_a"].to_numpy(np.float64) for s in STATS}
    sb = {s: df[f"{s}_b"].to_numpy(np.float64) for s in STATS}
    for k, v in S.compare_stats_columns(sa, sb).items():
        df[k] = v
    stats_err = S.stats_error(sa, sb)
    df["stats_err"] = stats_err
    dtype_a = df["dtype_a"].to_numpy(object)
    dtype_b = df["dtype_b"].to_numpy(object)
    judge_dtype, cross = _tolerances(df, dtype_a, dtype_b)
    nonfinite = ((df["nan_a"].fillna(0).to_numpy() != df["nan_b"].fillna(0).to_numpy())
                 | (df["inf_a"].fillna(0).to_numpy() != df["inf_b"].fillna(0).to_numpy()))
    status, reason = S.judge_stats_columns(stats_err, judge_dtype, nonfinite)
    ca, cb = df["checksum_a"].to_numpy(object), df["checksum_b"].to_numpy(object)
    has_ck = ~pd.isna(ca) & ~pd.isna(cb) if n else np.zeros(0, dtype=bool)
    ck_equal = has_ck & (ca == cb) & (dtype_a == dtype_b)
    df["checksum_match"] = np.where(has_ck, np.where(ck_equal, "equal", "unequal"), "")
    status = np.where(ck_equal, V.PASS, status).astype(object)
    reason = np.where(ck_equal, "", np.where(has_ck & (status != V.PASS), reason + "; checksum unequal", reason)
                      ).astype(object)
    # undefined values (uninitialised memory) are never judged and never count towards a divergence
    undef_a, undef_b = df["undef_a"].to_numpy(bool), df["undef_b"].to_numpy(bool)
    undef = undef_a | undef_b
    if undef.any():
        status[undef] = NOT_JUDGED
        which = np.where(undef_a & undef_b, "both runs", np.where(undef_a, "run A", "run B"))
        reason[undef] = [f"undefined contents (uninitialised memory) in {w}" for w in which[undef]]
        stats_err[undef] = np.nan
        df["stats_err"] = stats_err
    error = stats_err.copy()
    for m in TENSOR_METRICS:
        df[m] = np.nan

    if tensors and n:
        da, db = df["data_a"].to_numpy(object), df["data_b"].to_numpy(object)
        rows = np.flatnonzero(~pd.isna(da) & ~pd.isna(db) & ~undef)
        shapes_ok = [int(np.prod(df["shape_a"].iat[r])) == int(np.prod(df["shape_b"].iat[r])) for r in rows]
        rows = rows[np.array(shapes_ok, dtype=bool)] if len(rows) else rows
        if len(rows):
            results = _tensor_metrics(part_a, part_b, da[rows], db[rows], judge_dtype[rows],
                                      df["dtype_a"].to_numpy(object)[rows], problems)
            scale = np.fmax(np.abs(sb["max"][rows]), np.abs(sb["min"][rows]))
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
    df["error"] = error
    df["status"] = status
    df["reason"] = reason
    df["origin"] = _origins(df)
    return df


def _tolerances(df: pd.DataFrame, dtype_a, dtype_b) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the dtype whose tolerance applies and whether the pair is cross-precision.  A float
    pair is judged by the lowest precision among its two dtypes and the precisions its values were
    computed from (``_Flow.lineage``); it is cross-precision when those differ between the runs
    (a bfloat16 layer in one run only: its outputs and everything computed from them)."""
    n = len(df)
    if not n:
        return np.zeros(0, object), np.zeros(0, bool)
    codes, uniques = S.factorize(list(zip(dtype_a, dtype_b)))
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
        def one(p, ta=ta, tb=tb):
            a, b = ta.get(p[0]), tb.get(p[1])
            return None if a is None or b is None else _metrics_of(a, b, p[2])
        # numpy releases the GIL in the element-wise passes: threads use every core
        for p, res in zip(chunk, pool.map(one, chunk) if pool else map(one, chunk)):
            if res is None:
                continue
            for k in todo[p]:
                out[k] = res
        del ta, tb, one


def _metrics_of(a: np.ndarray, b: np.ndarray, dtype: str):
    if not is_float(dtype) or a.dtype.kind not in "fc" or b.dtype.kind not in "fc":
        return {"binary_mismatch": M.binary_mismatch(a, b), "elements": int(a.size)}, "binary"
    if a.dtype == b.dtype and a.shape == b.shape and _same_bytes(a, b):
        return {**_PERFECT, "elements": int(a.size)}, "float"
    return M.compare_arrays(a, b, dtype, only=_COMPUTED), "float"


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-identical tensors (the common case between two runs): a memcmp when both are plain
    contiguous arrays, else an element-wise pass.  Values equal but not bitwise (-0.0, nan
    payloads) simply go through the metrics, which find them perfect."""
    if a.flags.c_contiguous and b.flags.c_contiguous:
        return memoryview(a).cast("B") == memoryview(b).cast("B")
    return bool(np.array_equal(a, b))


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


# ---- whole runs ----------------------------------------------------------------------------------
def _worker(args):
    path_a, key_a, path_b, key_b, match, mapping, tensors, translate = args
    return compare_parts(Part(path_a, *key_a), Part(path_b, *key_b), match=match, mapping=mapping, tensors=tensors,
                         translate=translate)


def _translations(run_a, run_b, mapping: Mapping) -> tuple:
    """Runs of two frameworks are compared in aten's vocabulary: the non-torch side(s) translated."""
    fa, fb = (r.manifest.get("framework") or "torch" for r in (run_a, run_b))
    if fa == fb:
        return None, None
    return tuple(None if f == "torch" else Translation.shipped(f, mapping.frameworks.get(f)) for f in (fa, fb))


def compare(a, b, *, match: str = "fuzzy", mapping: str | Mapping | None = None, out: str | None = None,
            jobs: int = 1, progress: bool = False, tensors: bool = True, metric: str = "cosine") -> Result:
    """Compare run (or step/rank folder) ``a`` (under test) against ``b`` (benchmark).

    Returns ``(table, verdict)``: one row per compared tensor (columns in docs/compare.md) and a
    :class:`Verdict`.  With ``out``, writes ``compare.csv``, ``compare.xlsx``, ``unmatched.csv``
    and ``compare.html`` there.  Raises :class:`RecordError` when nothing could be compared, and
    :class:`RunsDoNotAlign` (a ``RecordError``) when less than ``min_aligned`` of the smaller run's compute
    records pair.
    """
    if match not in ("fuzzy", "exact"):
        raise ValueError(f"--match must be 'fuzzy' or 'exact', not {match!r}")
    if not isinstance(mapping, Mapping):
        mapping = Mapping.load(mapping)
    run_a, run_b = load(a), load(b)
    problems: list[str] = []
    if len(run_a.parts) == 1 and len(run_b.parts) == 1:
        jobs_list = [(next(iter(run_a.parts)), next(iter(run_b.parts)))]
    else:
        common = sorted(set(run_a.parts) & set(run_b.parts))
        for key in sorted(set(run_a.parts) - set(run_b.parts)):
            problems.append(f"step {key[0]} rank {key[1]}: only in {run_a.path}; not compared")
        for key in sorted(set(run_b.parts) - set(run_a.parts)):
            problems.append(f"step {key[0]} rank {key[1]}: only in {run_b.path}; not compared")
        jobs_list = [(k, k) for k in common]
    if not jobs_list:
        raise RecordError(f"{run_a.path} and {run_b.path} have no step/rank in common "
                          f"({sorted(run_a.parts)} vs {sorted(run_b.parts)})")
    translate = _translations(run_a, run_b, mapping)
    tasks = [(run_a.parts[ka].path, ka, run_b.parts[kb].path, kb, match, mapping, tensors, translate)
             for ka, kb in jobs_list]
    tables, unmatched, divs, aligned = [], [], [], np.zeros(3, np.int64)
    for res in _run_tasks(tasks, jobs, progress):
        tables.append(res.rows)
        unmatched.append(res.unmatched)
        problems.extend(res.problems)
        divs.extend(res.divergences)
        aligned += res.aligned
    table = pd.concat(tables, ignore_index=True) if tables else pd.DataFrame(columns=COLUMNS)
    um = pd.concat(unmatched, ignore_index=True) if unmatched else pd.DataFrame(columns=UNMATCHED_COLUMNS + ["explained"])
    um["is_cast"] = um["is_cast"].astype(bool)
    if jobs_list[0][0] != jobs_list[0][1] and len(jobs_list) == 1:
        table["step"], table["rank"] = jobs_list[0][0]
    # per stage, the divergence of the first step/rank part that has one
    first = {}
    for d in sorted(divs, key=lambda d: (d.step, d.rank)):
        first.setdefault(d.stage, d)
    for d in first.values():   # a divergence op whose own error is only a warning is an origin too
        if d.cause == "op" and len(table):
            at = ((table["step"] == d.step) & (table["rank"] == d.rank) & (table["stage"] == d.stage)
                  & (table["seq"] == d.seq) & (table["kind"] == d.kind) & (table["io"] == "output"))
            table.loc[at, "origin"] = True
    counts = {k: int(v) for k, v in table["status"].value_counts().items()} if len(table) else {}
    smaller = min(int(aligned[1]), int(aligned[2]))   # a truncated or shorter run is judged on what it has
    share = float(aligned[0]) / max(smaller, 1)
    verdict = Verdict(a=str(run_a.path), b=str(run_b.path), forward=first.get("forward"),
                      backward=first.get("backward"), counts=counts, unmatched=um, problems=problems,
                      parts=[k for k, _ in jobs_list], aligned=share,
                      same_run=_same_folder(run_a, run_b, jobs_list))
    table = table.drop(columns=["uid", "data_a", "data_b", "checksum_a", "checksum_b"], errors="ignore")
    table = table[[c for c in COLUMNS if c in table.columns]]
    if out:
        from .report import write_reports
        verdict.report = write_reports(out, table, verdict, run_a.manifest, run_b.manifest, metric=metric,
                                       progress=progress)
    if not len(table):
        why = problems[-1] if problems else "no tensor could be paired"
        raise RecordError(f"nothing could be compared: {why}"
                          + (f" (partial report: {verdict.report})" if verdict.report else ""))
    need = float(standard("compare_standards").get("min_aligned", 0.5))
    if share < need:
        raise RunsDoNotAlign(f"the runs do not align: {smaller - int(aligned[0])} of the smaller run's {smaller} "
                             f"compute records could not be aligned (different models or options?)"
                             + (f" (partial report: {verdict.report})" if verdict.report else ""),
                             Result(table, verdict))
    return Result(table, verdict)


def _same_folder(run_a, run_b, jobs_list) -> bool:
    """Whether every compared pair is one folder read twice (``compare A A``)."""
    return all(os.path.realpath(run_a.parts[ka].path) == os.path.realpath(run_b.parts[kb].path) for ka, kb in jobs_list)


def _run_tasks(tasks, jobs: int, progress: bool):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    bar = tqdm(total=len(tasks), desc="compare", unit="part", disable=not progress or tqdm is None,
               leave=False) if tqdm else None
    results = [None] * len(tasks)
    if jobs > 1 and len(tasks) > 1:
        with ProcessPoolExecutor(max_workers=min(jobs, len(tasks))) as pool:
            futures = {pool.submit(_worker, t): k for k, t in enumerate(tasks)}
            for fut in as_completed(futures):
                results[futures[fut]] = fut.result()
                if bar:
                    bar.update()
    else:
        for k, t in enumerate(tasks):
            results[k] = _worker(t)
            if bar:
                bar.update()
    if bar:
        bar.close()
    return results
