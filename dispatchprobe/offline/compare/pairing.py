"""Pairing two parts' records tensor by tensor, and the data flow of one part's records (which
record produced each input, the precision each value carries)."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

import pandas as pd

from ...core import op_traits
from ...records.reader import Part, tensor_list
from ...standards import verdicts as V
from ..align import stats_distance
from ..views import ViewIndex, flat_buffer
from .recompute import RECOMPUTED, one_run_only


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


def decomposed_scopes(recs_a: list, recs_b: list, translate: tuple) -> set:
    """(stage, scope) of the modules both runs recorded a boundary of, whose own ops differ (after
    translation), each run having ops the other lacks: the two frameworks decompose that module
    differently (a loss), so it is compared at its boundary (its module records), not op by op.  A PyTorch op the other framework
    runs unobserved counts only where that side shows none of it (a visible ``SumExt`` pairs with
    ``sum``); one it has no counterpart of (an integer counter) never counts."""
    def own_ops(recs, other):
        ops, bounds = {}, set()
        for r in recs:
            key = (r["stage"], r["scope"])
            if r["kind"] == "module":
                bounds.add(key)
            elif r["scope"] and not (other is not None and other.without_counterpart(r)):
                ops.setdefault(key, Counter())[r["op"]] += 1
        return ops, bounds
    (ops_a, bounds_a), (ops_b, bounds_b) = own_ops(recs_a, translate[1]), own_ops(recs_b, translate[0])
    out = set()
    for key in bounds_a & bounds_b:
        a, b = ops_a.get(key, Counter()), ops_b.get(key, Counter())
        for mine, theirs, other in ((a, b, translate[1]), (b, a, translate[0])):
            if other is not None and key[0] == "backward":     # unobserved there: not a decomposition
                for op in set(mine) & set(other.unobservable):
                    mine[op] = min(mine[op], theirs[op])
        if (a - b) and (b - a):   # each run has ops the other lacks; ops in one run only (a hook's
            out.add(key)          # scaling inside the module) are that run's own, not a decomposition
    return out


def explain_unobservable(unmatched: pd.DataFrame, translate: tuple, problems: list, step: int, rank: int,
                          recs: tuple = ((), ())):
    """Mark the PyTorch side's unmatched backward records whose counterpart the other framework
    runs unobserved (``unobservable`` in its translation), and those it has no counterpart of (an
    integer counter, any stage; ``recs``: both sides' records, by name), and say so once."""
    for side, other, own in (("a", translate[1], recs[0]), ("b", translate[0], recs[1])):
        if other is None:
            continue
        mine = unmatched["side"] == side
        if other.no_counterpart and own:
            by_name = {r["name"]: r for r in own if r["kind"] == "op" and r["op"] in other.no_counterpart}
            kept = [other.without_counterpart(by_name[n]) if n in by_name else None for n in unmatched["name"]]
            hit = mine & pd.Series([k is not None for k in kept], index=unmatched.index) & (unmatched["explained"] == "")
            unmatched.loc[hit, "explained"] = [f"no counterpart in the other framework ({k})" for k, h in zip(kept, hit) if h]
        if not other.unobservable:
            continue
        hit = mine & (unmatched["stage"] == "backward") & unmatched["op"].isin(other.unobservable) \
            & (unmatched["explained"] == "")
        unmatched.loc[hit, "explained"] = [f"not observable in the other framework ({other.unobservable[op]})"
                                           for op in unmatched.loc[hit, "op"]]
        if hit.any():
            kernels = sorted({other.unobservable[op] for op in unmatched.loc[hit, "op"]})
            problems.append(f"step {step} rank {rank}: {int(hit.sum())} backward record(s) of run {side.upper()} have no "
                            f"counterpart: the other framework runs {', '.join(kernels)} outside its dispatch mode "
                            "on that device (not observable)")
    return unmatched


REWRITTEN = "made by a graph rewrite of the compiled run (inductor's pattern passes), no eager op call of its own"


def rewritten(record: dict) -> bool:
    """A compiled graph's record whose nodes a graph rewrite made, none traced from the program
    (``compiled.rewrite``): the other run, eager or compiled without that rewrite, has no
    counterpart of it."""
    compiled = record.get("compiled")
    return isinstance(compiled, dict) and bool(compiled.get("rewrite"))


def say_rewritten(unmatched: pd.DataFrame, problems: list, step: int, rank: int) -> None:
    """One line per run whose unmatched records a compiled graph's rewrite made."""
    if not len(unmatched):
        return
    for side in ("a", "b"):
        n = int(((unmatched["side"] == side) & (unmatched["explained"] == REWRITTEN)).sum())
        if n:
            problems.append(f"step {step} rank {rank}: {n} record(s) of run {side.upper()} have no counterpart: "
                            "its compiled graph's rewrites (inductor's pattern passes) made them, no eager op "
                            "call of their own (listed in unmatched.csv)")


def pair_tensors(ta: list, tb: list, same_op: bool, op: str = ""):
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


class DataFlow(NamedTuple):
    """The data flow of one part's records, keyed by ``id()`` of the tensor specs."""

    src: dict       # input spec -> (index, output arg) of the record that produced the value
    lineage: dict   # float spec -> the lowest precision rank (``verdicts.PRECISIONS``) it was computed
                    # from, where that is below its own dtype's
    walks: list     # per record: its tensors, ``(io, arg, spec)`` (records.format.walk)
    undefined: set  # specs flagged ``undefined`` (uninitialised memory)
    viewed: frozenset = frozenset()   # input specs whose producer is inferred: read through a view no
                                      # record shows, of that producer's output (:mod:`..views`)
    pieces: dict = {}   # input specs found by none of these that a collective's result can hold as a
                        # contiguous piece -> every such (index, output arg), latest first
                        # (views.ViewIndex.holders): no producer by itself (origin.Lineage.common_piece)


def _signature(spec: dict):
    """A value recognised by its dtype and statistics, where no saved-tensor key says more
    (statistics records; reshapes autograd makes without a record keep all of them)."""
    st = spec.get("stats")
    if not st:
        return None
    if st.get("nan"):   # nan never equals itself: key it by its text
        return (spec["dtype"], *map(str, st.values()))
    return (spec["dtype"], *st.values())


def data_flow(recs: list, permuted: bool = False, undefined_spreads: bool = False) -> DataFlow:
    """Which earlier record produced each input (the latest with that value) and the precision each
    value carries: a float value computed from bfloat16 values carries bfloat16 rounding, whatever its
    own dtype.  Op records produce values; module records only where a part has no op records.
    ``permuted`` (runs of two frameworks, whose layout ops are left out): a value not found otherwise
    is recognised by its size, maximum and minimum, which a transposed copy keeps exactly (its mean
    and norm, summed in another order, need not).  ``undefined_spreads`` (PyTorch runs): what an op
    computes from an undefined value it reads is undefined too; a MindSpore kernel is handed outputs
    its device never wrote and need not read them (BatchNormGrad's input 5 on the CPU)."""
    producers = "op" if any(r["kind"] == "op" for r in recs) else "module"
    by_data: dict = {}
    by_sig: dict = {}
    by_range: dict | None = {} if permuted else None
    src: dict = {}
    lineage: dict = {}
    ranks: dict = {}
    undefined: set = set()
    views, by_view_sig, viewed, pieces = ViewIndex(), {}, set(), {}
    made_undefined: set = set()    # (record, output arg) of values computed from undefined ones
    walks = [tensor_list(r) for r in recs]
    for i, r in enumerate(recs):
        for t in r.get("through", ()):   # a left-out layout op (translate.py): its output is its input
            ins, outs = tensor_list(t, outputs=False), tensor_list(t, inputs=False)
            if ins and outs:
                hit = _find(ins[0][2], by_data, by_sig, by_range)
                if hit is not None:
                    for _, _, spec in outs:
                        if spec.get("data") is not None:
                            by_data[spec["data"]] = hit
                        if (sig := _signature(spec)) is not None:
                            by_sig[sig] = hit
                        if by_range is not None and (key := _range(spec)) is not None:
                            by_range[key] = hit
        low = None
        produces = r["kind"] == producers
        # a value computed from uninitialised memory is garbage too (a pipeline stage's warm-up on
        # buffers nothing wrote): its record's outputs are undefined where it reads such a value
        tainted = False
        for io, arg, spec in walks[i]:
            dt = spec["dtype"]
            own = ranks.get(dt)
            if own is None:
                own = ranks[dt] = V.precision_rank(dt)
            data = spec.get("data")
            if spec.get("undefined") or (tainted and io == "output" and produces):
                undefined.add(id(spec))
            if io == "input" or not produces:
                hit = by_data.get(data) if data is not None else None
                carried = None      # a collective's piece: the precision every result holding it carries
                if hit is None:
                    sig = _signature(spec)
                    hit = by_sig.get(sig) if sig is not None else None
                    if hit is None and by_range is not None and (key := _range(spec)) is not None:
                        hit = by_range.get(key)
                    if hit is None and io == "input" and produces:
                        hit = _through_view(spec, sig, views, by_view_sig)
                        if hit is not None:
                            viewed.add(id(spec))
                        elif holders := views.holders(spec):
                            pieces[id(spec)] = [(e[0], e[1]) for e in holders]
                            carried = _carried_by_all(holders)
                if hit is not None and io == "input":
                    src[id(spec)] = hit[0], hit[1]
                    if (hit[0], hit[1]) in made_undefined:
                        undefined.add(id(spec))
                if undefined_spreads and io == "input" and id(spec) in undefined and _reads_values(r, arg):
                    tainted = True
                if own < 0:
                    continue
                rk = own if hit is None or hit[2] is None else min(own, hit[2])
                if carried is not None:
                    rk = min(rk, carried)
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
                if tainted:
                    made_undefined.add((i, arg))
                if data is not None:
                    by_data[data] = entry
                sig = _signature(spec)
                if sig is not None:
                    by_sig[sig] = entry
                if by_range is not None and (key := _range(spec)) is not None:
                    by_range[key] = entry
                views.add(spec, entry, flat_buffer(r, arg))
    return DataFlow(src, lineage, walks, undefined, frozenset(viewed), pieces)


def _reads_values(record: dict, arg: str) -> bool:
    """Whether ``record``'s op reads the values of its argument ``arg`` (not only its shape, as
    ``zeros_like``; not a destination it overwrites, as ``copy_``'s or an ``out=`` one).  aten's ops
    only: what a collective or a point-to-point op (``c10d.recv_``) does with a buffer is not an
    aten schema's to tell."""
    op = record.get("op", "")
    return op.startswith("aten.") and not (op_traits.reads_metadata_only(op) or op_traits.overwritten(op, arg)
                                           or arg.startswith("input.out"))


def _carried_by_all(holders: list) -> int | None:
    """The precision rank a contiguous piece of a collective's result carries whichever of the
    results that can hold it (``holders``' entries) it was taken of: the highest among them (a
    float32 gradient of a bfloat16 forward, FSDP2's reduce-scatter output, carries bfloat16's
    rounding only where every candidate does), None where one is no float."""
    ranks = [e[2] for e in holders]
    return None if any(r is None for r in ranks) else max(ranks)


def _through_view(spec: dict, sig, views: ViewIndex, by_view_sig: dict):
    """The producer entry of an input read through a view no record shows (an expand, a slice: its
    statistics are not its producer's), else None.  A view read again (its backward reads what the
    forward read) is the same value: found by its signature, not inferred a second time."""
    hit = by_view_sig.get(sig) if sig is not None else None
    if hit is None:
        hit = views.find(spec)
        if hit is not None and sig is not None:
            by_view_sig[sig] = hit
    return hit


def _range(spec: dict):
    """A value's size, maximum and minimum (None for a constant or nan-holding one: too common)."""
    st = spec.get("stats")
    if not st or st.get("nan") or st.get("max") == st.get("min") or st.get("max") is None:
        return None
    return spec["dtype"], math.prod(spec["shape"]), st["max"], st["min"]


def _find(spec: dict, by_data: dict, by_sig: dict, by_range: dict | None):
    """The producer entry of a value, by its saved-tensor key, else by its signature (else by its range)."""
    data = spec.get("data")
    hit = by_data.get(data) if data is not None else None
    if hit is None and (sig := _signature(spec)) is not None:
        hit = by_sig.get(sig)
    if hit is None and by_range is not None and (key := _range(spec)) is not None:
        hit = by_range.get(key)
    return hit


def user_frames(part: Part, record: dict) -> list:
    try:
        return list(part.stacks.get(record.get("stack"), []))
    except Exception:  # a stacks file we cannot read must not stop a compare
        return []



# why an unmatched record was compared at a boundary instead (``explained``, set by the driver)
_AT_BOUNDARY = ("inside a region compared at its boundary", "decomposed differently")
_STAGES = ("forward", "backward")
# the recomputed records one run only has (.recompute.one_run_only)
_RERUN_ONLY = tuple(one_run_only(s) for s in "ab")


@dataclass
class PairingShare:
    """How each run's compute op records (casts aside; a translated run's in aten's vocabulary)
    were paired, per stage: op by op, only at a region or module boundary (a loss cell against a
    function, a fused kernel against its pieces), or not at all (``explained``: of those, the ones
    whose reason compare knows: a kernel the other framework runs unobserved, a counter it does not
    keep).  Counted once here; the terminal, the reports and the tests read it from here."""

    frameworks: tuple = ("torch", "torch")
    counts: dict = field(default_factory=dict)   # (side, stage) -> Counter: records, op, boundary, unpaired, explained

    def add(self, other: "PairingShare") -> None:
        for key, c in other.counts.items():
            self.counts.setdefault(key, Counter()).update(c)

    def _count(self, side: str, stage: str | None, what: str) -> int:
        return sum(c[what] for (s, st), c in self.counts.items() if s == side and stage in (None, st))

    def share(self, side: str, stage: str | None = None) -> float:
        """The share of run ``side``'s ("a"/"b") records (of ``stage``, or all) paired op by op."""
        return self._count(side, stage, "op") / max(self._count(side, stage, "records"), 1)

    def lines(self) -> list:
        """One terminal line per stage with records."""
        out = []
        cross = self.frameworks[0] != self.frameworks[1]
        name = {s: f"{s.upper()} ({f})" if cross else s.upper() for s, f in zip("ab", self.frameworks)}
        for stage in _STAGES:
            if not any(self._count(s, stage, "records") for s in "ab"):
                continue
            n = {s: {w: self._count(s, stage, w) for w in ("records", "op", "boundary", "unpaired", "explained")}
                 for s in "ab"}
            unpaired = ", ".join(f"{s.upper()} {n[s]['unpaired']}" + (f" ({n[s]['explained']} explained)"
                                                                    if n[s]["explained"] else "") for s in "ab")
            out.append(f"{stage} records paired op by op: "
                       + ", ".join(f"{name[s]} {n[s]['op']}/{n[s]['records']}" for s in "ab")
                       + "; only at a region/module boundary: "
                       + ", ".join(f"{s.upper()} {n[s]['boundary']}" for s in "ab") + f"; unpaired: {unpaired}")
            out += [f"{stage}: {RECOMPUTED} in run {s.upper()} only: {self._count(s, stage, 'recomputed')} records, "
                    f"not judged (its backward reads the forward values they reproduce, compared in the forward)"
                    for s in "ab" if self._count(s, stage, "recomputed")]
        return out

    def frame(self) -> pd.DataFrame:
        """``pairing.csv``: one row per run and stage."""
        rows = [(s.upper(), f, st, *(self._count(s, st, w) for w in ("records", "op", "boundary", "unpaired",
                                                                     "explained")))
                for s, f in zip("ab", self.frameworks) for st in _STAGES if self._count(s, st, "records")]
        return pd.DataFrame(rows, columns=["run", "framework", "stage", "records", "op_by_op", "at_boundary",
                                           "unpaired", "unpaired_explained"])


_BOUNDARY_HOWS = frozenset(("region boundary", "module"))


def pairing_share(pairs: list, recs_a: list, recs_b: list, unmatched: pd.DataFrame) -> PairingShare:
    """Count one part's compute op records by how they were paired (``pairs``: the alignment's;
    ``unmatched``: the driver's table with its ``explained`` column).  A record standing for a
    fused region of the other run's kernel (``fused``: how many records it merged) counts as that
    many records at a boundary.  A run without op records (level ``module``) counts its module
    records, each paired at its boundary."""
    out = PairingShare()
    counts = out.counts
    kind = {s: "op" if any(r["kind"] == "op" for r in recs) else "module" for s, recs in (("a", recs_a), ("b", recs_b))}
    tally: dict = defaultdict(int)     # (side, stage, "records"/"op"/"boundary") -> records
    casts: dict = {}                   # op -> op_traits.is_cast(op), asked once per distinct op
    sides = (("a", kind["a"], recs_a, 0), ("b", kind["b"], recs_b, 1))
    for pair in pairs:
        fused = "fused" in recs_a[pair[0]] or "fused" in recs_b[pair[1]]
        how = "boundary" if fused or pair[2] in _BOUNDARY_HOWS else "op"
        for side, want, recs, at in sides:
            r = recs[pair[at]]
            if r["kind"] != want:
                continue
            op = r["op"]
            cast = casts.get(op)
            if cast is None:
                cast = casts[op] = op_traits.is_cast(op)
            if not cast:
                n = r.get("fused", 1) if fused else 1
                tally[side, r["stage"], "records"] += n
                tally[side, r["stage"], how] += n
    for (side, stage, what), n in tally.items():
        counts.setdefault((side, stage), Counter())[what] += n
    if len(unmatched):
        mine = unmatched["kind"] == unmatched["side"].map(kind)
        rows = unmatched[mine & ~unmatched["is_cast"].astype(bool)]
        for side, stage, why in zip(rows["side"], rows["stage"], rows["explained"]):
            c = counts.setdefault((side, stage), Counter())
            c["records"] += 1
            if why.startswith(_AT_BOUNDARY):
                c["boundary"] += 1
            else:
                c["unpaired"] += 1
                c["explained"] += bool(why)
                c["recomputed"] += why.startswith(_RERUN_ONLY)
    return out
