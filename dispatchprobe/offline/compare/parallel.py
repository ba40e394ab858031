"""Compare two runs of different parallelism (1 process vs DDP, FSDP2 or FSDP2 x tensor
parallelism of one model and global batch, or 2-rank DDP vs 2-rank FSDP2): what both hold,
assembled from the ranks, step by step.

- the loss: the last forward op with a 0-dim float output before backward, averaged over the
  data-parallel ranks (each rank's mean over its share of the batch);
- the forward ops, paired by module, op and call index within the module: an activation split
  over ranks along one dimension is concatenated back (the batch of data parallelism, the column
  shards of a column-wise tensor-parallel layer), a replicated value taken from the lowest rank, an
  FSDP2/DTensor shard gathered by its placements, a full reduction averaged (``mean``) or summed
  (``sum``) over the ranks; runs of the same ranks pair rank with rank; on a data-parallel x
  tensor-parallel mesh each tensor-parallel group's pieces are joined first (:class:`Mesh`);
- the backward ops, paired and assembled as the forward ops, a value computed from the loss's
  gradient divided by the number of shares each computing a mean over its share; a weight's
  gradient before its reduction (each share's own sum) is not paired, the parameter gradients are;
- each parameter's gradient as the optimizer read it (after DDP's all-reduce, FSDP's
  reduce-scatter: shards gathered) and its value after the step (the parameter records,
  ``params.jsonl``), paired by name (``module.`` of DDP and ``_orig_mod.`` of torch.compile left out).

Collectives and FSDP's own ops exist in one run only by nature and are listed as communication.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np
import pandas as pd

from ...records.format import walk
from ...standards import metrics as M, statistics as S, verdicts as V
from ...standards.loader import is_float
from ..ranks.groups import data_shares, group_of
from .loss_scale import gradients_alike
from .origin import ROUNDINGS
from .pairing import data_flow
from .rerun import ROUNDOFF
from .verdict import call_words, incomplete, partial_agreement

COMMUNICATION = ("c10d.", "_c10d_functional.", "fsdp.", "profiler.")   # one run's own by nature
TABLE_COLUMNS = ["step", "what", "name", "scope", "call_a", "call_b", "arg", "ranks_a", "ranks_b", "shape_a", "shape_b",
                 "dtype_a", "dtype_b", "how_a", "how_b", "cosine", "max_abs_err", "rel_l2_err", "stats_err", "status", "reason",
                 "after_one_run_only"]
_WRAPPERS = ("module.", "_orig_mod.")
RANK_BY_RANK = "(rank by rank)"      # how a value paired rank with rank is assembled: "rank 1 (rank by rank)"
UNEQUAL_SHARES = "unequal shares"    # reason of the parameter rows of runs that weigh the batch otherwise
_SHARD = re.compile(r"^(?:S\((\d+)\)|Shard\(dim=(\d+)\))$")


def parameter_name(name: str) -> str:
    """A parameter's name without the wrappers' prefixes (DDP's ``module.``, compile's ``_orig_mod.``)."""
    changed = True
    while changed:
        changed = False
        for w in _WRAPPERS:
            if name.startswith(w):
                name, changed = name[len(w):], True
    return name


def module_path(scope: str) -> str:
    """A module scope relative to the root module, wrappers left out (``DistributedDataParallel.module.up``
    and ``FSDPMLP.up`` are both ``up``)."""
    path = parameter_name(scope.partition(".")[2] + ".") if scope else ""
    return path[:-1] if path.endswith(".") else path    # the wrapper's own attribute (DDP's ``module``) is the root


@dataclass
class Value:
    """A value assembled from the ranks: its array (tensors saved) and/or its statistics."""

    shape: tuple
    dtype: str
    stats: dict | None
    array: np.ndarray | None = None
    how: str = ""               # "rank 0", "concatenated over ranks 0-1 (dim 0)", "gathered (S(0))", ...
    owners: np.ndarray | None = None    # per element of ``array``, the one rank that computed it (-1: several)
    carries: str = ""           # the lower precision it was computed from, where below its dtype ("bfloat16")


class Weights(NamedTuple):
    """How one run's ranks' pieces of a value weigh in the whole batch's, where the shares of the
    batch are unequal (3 and 2 of 5 samples): a full mean over the ranks weighs each rank's mean by
    the elements it averaged, and a gradient computed from a share's mean loss is that share's part
    of the batch times the whole batch's mean's gradient per element.  None: weigh the ranks alike."""

    averaged: dict | None = None    # rank -> the number of elements a full mean on it averages
    factors: dict | None = None     # rank -> what its gradient pieces are multiplied by (its share's part)
    interleaved: bool = False       # the shares hold the batch's samples in turn (:func:`batch_orders`)


ALIKE = Weights()       # every rank weighs alike (equal shares, one process, or a value no share's mean scales)
_PARTIAL_WITHOUT_TENSORS = ("a DTensor with a Partial placement (a sum not yet taken) recorded without its tensors: "
                            "statistics do not give the sum's")


@dataclass
class ParallelVerdict:
    """What the compare of two runs of different parallelism concluded (``str()``: the terminal lines)."""

    a: str
    b: str
    ranks_a: list
    ranks_b: list
    steps: list
    counts: dict
    first: dict | None          # the first row that errs: step, what, name, scope, reason, ...
    parted: dict | None         # the first row that is not a pass (error or warning): where the runs part
    departure: dict | None      # the first pass that is not bit-identical
    unpaired: list = field(default_factory=list)    # lines: what could not be paired
    problems: list = field(default_factory=list)
    report: str | None = None
    layout: str = ""            # runs of the same ranks: how their parameters' pieces differ
    unjudged: dict | None = None    # the first row not judged (unequal shares of the batch, ...)
    grown: Grown | None = None      # later steps' rows not judged as grown from rounding

    @property
    def passed(self) -> bool:
        return self.counts.get(V.ERROR, 0) == 0

    @property
    def undecided(self) -> bool:
        """No row fails and some were set aside as grown from rounding (exit code 1): the runs are
        not said to agree past tolerance they do not hold, nor is an op named."""
        return self.passed and self.grown is not None

    @property
    def damaged(self) -> list:
        return incomplete(self.problems)

    def __str__(self) -> str:
        counts = ", ".join(f"{k} {self.counts.get(k, 0)}" for k in (V.PASS, V.WARNING, V.ERROR))
        if self.counts.get(V.NOT_JUDGED):
            counts += f", {V.NOT_JUDGED} {self.counts[V.NOT_JUDGED]}"
        held = f" holding other pieces of the parameters ({self.layout})" if self.layout else ""
        lines = [f"different parallelism: run A has {_ranks(self.ranks_a)}, run B {_ranks(self.ranks_b)}{held}; compared "
                 f"what both hold (loss, forward and backward ops assembled over ranks, parameter gradients after reduction, "
                 f"parameters after each step) over {len(self.steps)} step(s): {counts}"]
        p = self.parted
        if p:
            lines.append(f"the runs part at step {p['step']} {_describe(p)} ({p['status']}: {p['reason']})")
            if p.get("after_one_run_only"):
                lines.append(f"  right after an op present in one run only (prime suspect): {p['after_one_run_only']}")
        if self.grown:
            g = self.grown
            later = sorted({r for r in self.steps if r > g.step})
            steps = f"step {later[0]}" if len(later) == 1 else f"steps {later[0]}-{later[-1]}"
            lines.append(f"grew from rounding: {g.rows} error row(s) of {steps} not judged, {GROWN.format(step=g.step)}: "
                         f"every value of step {g.step} agrees within tolerance, runs of other parallelism sum the "
                         f"gradients in other orders, and each such row is off by rounding size from values that differ "
                         f"already; no op named")
        if self.first and self.first is not p and (self.first["step"], self.first["name"], self.first["arg"]) != \
                (p["step"], p["name"], p["arg"]):
            f = self.first
            lines.append(f"first error: step {f['step']} {_describe(f)}: {f['reason']}")
        if not p:
            d = self.departure
            agree = "the runs agree on what was judged" if self.unjudged else "the runs agree"
            if self.damaged and d is None:
                agree = partial_agreement(self.damaged)
            lines.append(agree if d is None else
                         f"{agree} within tolerance; first departure: step {d['step']} {_describe(d)} "
                         f"(relative error {d['rel_l2_err']:.3g})")
        if self.unjudged:
            u = self.unjudged
            lines.append(f"not judged ({self.counts.get(V.NOT_JUDGED, 0)} rows), the first at step {u['step']} "
                         f"{_describe(u)}: {u['reason']}")
        lines += [f"not paired: {u}" for u in self.unpaired[:8]]
        if len(self.unpaired) > 8:
            lines.append(f"not paired: ... {len(self.unpaired) - 8} more")
        lines += [f"warning: {p}" for p in self.problems[:5]]
        if self.report:
            lines.append(f"report: {self.report}")
        return "\n".join(lines)


def _ranks(ranks: list) -> str:
    return f"{len(ranks)} rank{'s' if len(ranks) != 1 else ''} ({', '.join(map(str, ranks))})"


def _describe(row: dict) -> str:
    if row["what"] == "loss":
        return f"the loss ({row['name']})"
    if row["what"] in ("forward", "backward"):
        how = next((h for h in (str(row.get("how_a") or ""), str(row.get("how_b") or "")) if TP_PEERS_DIFFER in h),
                   str(row.get("how_a") or ""))
        on = f" on {how.partition(' (')[0]}" if how.endswith(RANK_BY_RANK) or TP_PEERS_DIFFER in how else ""
        at_fault = [m.group(1) for h in (row.get("how_a"), row.get("how_b")) if (m := _AT_FAULT.search(str(h or "")))]
        on = on or (f" on rank {at_fault[0]}" if at_fault else "")
        return f"{row['what']} op {row['name']} [{row['scope'] or '<root>'}]{_calls(row)} {row['arg']}{on}"
    return f"{'gradient' if row['what'] == 'grad' else 'value after the step'} of parameter {row['name']}"


def _calls(row: dict) -> str:
    """`` (call A 6, B 5)`` where the paired records (the lowest rank's of each run) are other calls of
    their op in the two runs (:func:`.verdict.call_words`): the row's name counts calls within the module,
    the same in both runs, and a run's own records are found by their calls; "" where they are one call."""
    a, b = row.get("call_a"), row.get("call_b")
    if a is None or b is None or pd.isna(a) or pd.isna(b) or int(a) == int(b):
        return ""
    return f" ({call_words(int(a), int(b))})"


# ---- assembling a value from the ranks --------------------------------------------------------------
def _read(part, spec, tensors: bool, problems: list):
    if not tensors or spec.get("data") is None:
        return None
    try:
        return part.tensor(spec["data"])
    except Exception as exc:  # noqa: BLE001 - a damaged shard: statistics only
        problems.append(f"damaged record: {part.path}: {exc}")
        return None


def _combine_stats(stats: list, sizes: list) -> dict | None:
    """Statistics of the concatenation of tensors, from theirs (exact for max/min/nan/inf/norm)."""
    if any(s is None for s in stats):
        return None
    n = sum(sizes)
    return {"max": max(s["max"] for s in stats), "min": min(s["min"] for s in stats),
            "mean": sum(s["mean"] * k for s, k in zip(stats, sizes)) / max(n, 1),
            "norm": float(np.sqrt(sum(s["norm"] ** 2 for s in stats))),
            "nan": sum(s.get("nan", 0) for s in stats), "inf": sum(s.get("inf", 0) for s in stats)}


INTERLEAVED = "interleaved (share k of N holds samples k, k+N, ...)"


def _concat(items: list, dim: int, how: str, interleaved: bool = False) -> Value:
    """``items``: (shape, dtype, stats, array) per rank, in order; ``interleaved``: pieces of one
    size along ``dim`` taken in turn, a row of each (the batch as ``DistributedSampler`` splits it)."""
    shapes = [it[0] for it in items]
    shape = list(shapes[0])
    shape[dim] = sum(s[dim] for s in shapes)
    arrays = [it[3] for it in items]
    array = None
    if all(a is not None for a in arrays):
        if interleaved and len({s[dim] for s in shapes}) == 1:
            array = np.stack(arrays, axis=dim + 1).reshape(shape)
            how = f"{how}, {INTERLEAVED}"
        else:
            array = np.concatenate(arrays, axis=dim)
    return Value(tuple(shape), items[0][1], _combine_stats([it[2] for it in items], [int(np.prod(s)) for s in shapes]),
                 array, how)


def _gather_dtensor(items: dict, meta: dict) -> Value | None:
    """The global tensor from each mesh rank's local shard (``items``: global rank -> (shape,
    dtype, stats, array)), mesh dimension by mesh dimension, innermost first."""
    placements = meta.get("placements") or []

    def build(mesh, level):
        if not isinstance(mesh, list):
            return items.get(mesh)
        subs = [build(m, level + 1) for m in mesh]
        if any(s is None for s in subs):
            return None
        p = placements[level] if level < len(placements) else "R"
        m = _SHARD.match(str(p))
        if m:
            v = _concat(subs, int(m.group(1) or m.group(2)), "")
            return (v.shape, v.dtype, v.stats, v.array)
        if str(p).startswith(("R", "Replicate")):
            return subs[0]
        return _partial_taken(subs, str(p))
    got = build(meta.get("mesh"), 0)
    if got is None:
        return None
    return Value(tuple(got[0]), got[1], got[2], got[3], f"gathered ({', '.join(map(str, placements))})")


def _partial_taken(subs: list, placement: str) -> tuple | None:
    """The value the pieces of a Partial placement stand for (``Partial(sum)``: their sum, ``avg``:
    their mean), from their arrays: their statistics do not give the sum's (None without arrays,
    or for another reduction)."""
    arrays = [s[3] for s in subs]
    how = placement.partition("(")[2].rstrip(")")
    if any(a is None for a in arrays) or how not in ("sum", "avg"):
        return None
    total = np.sum([np.asarray(a, np.float64) for a in arrays], axis=0) / (len(arrays) if how == "avg" else 1)
    total = total.astype(arrays[0].dtype)
    return subs[0][0], subs[0][1], S.record(total, np), total


def _place(items: dict, offsets: dict, shape: tuple, meta: dict) -> Value | None:
    """The whole tensor from the ranks' local shards placed at their offsets (replicas of a shard,
    same offset, counted once); None when the shards do not cover it."""
    pieces = {}
    for r in sorted(items):
        pieces.setdefault((tuple(offsets[r]), items[r][0]), items[r])
    sizes = [int(np.prod(local)) for (_, local) in pieces]
    if sum(sizes) != int(np.prod(shape)):
        return None
    arrays = [it[3] for it in pieces.values()]
    array = None
    if all(a is not None for a in arrays):
        array = np.zeros(shape, dtype=arrays[0].dtype)
        for ((offset, local), _), a in zip(pieces.items(), arrays):
            array[tuple(slice(o, o + n) for o, n in zip(offset, local))] = np.asarray(a).reshape(local)
    stats = _combine_stats([it[2] for it in pieces.values()], sizes)
    return Value(shape, next(iter(pieces.values()))[1], stats, array,
                 f"gathered ({', '.join(map(str, meta.get('placements') or []))})")


def _replicas(items: list) -> bool:
    """Whether the ranks' values are one value (equal arrays, else equal statistics)."""
    arrays = [it[3] for it in items]
    if all(a is not None for a in arrays):
        return all(np.array_equal(arrays[0], a, equal_nan=arrays[0].dtype.kind in "fc") for a in arrays[1:])
    return all(it[2] == items[0][2] for it in items[1:])


def _items(specs: dict, parts: dict, tensors: bool, problems: list, factors: dict | None = None) -> dict:
    """rank -> (shape, dtype, stats, array or None) of each rank's spec of one value, times
    ``factors[rank]`` where given (a gradient brought to the whole batch's scale by its share's
    part of the batch: each piece by its own rank's factor, before pieces are joined)."""
    return {r: _times((tuple(specs[r]["shape"]), specs[r]["dtype"], specs[r].get("stats"),
                       _read(parts[r], specs[r], tensors, problems)), (factors or {}).get(r, 1))
            for r in sorted(specs)}


def _times(item: tuple, k: float) -> tuple:
    """An item (shape, dtype, stats, array) times a positive ``k`` (max, min, mean and norm scale alike)."""
    if k == 1:
        return item
    shape, dtype, stats, array = item
    stats = {key: (x * k if key in ("max", "min", "mean", "norm") and x is not None else x)
             for key, x in stats.items()} if stats else stats
    array = None if array is None else (np.asarray(array, np.float64) * k).astype(np.asarray(array).dtype)
    return shape, dtype, stats, array


def rank_by_rank(sa: dict, sb: dict, pa: dict, pb: dict, tensors: bool, problems: list,
                 reduction: str | None, weights: tuple = (ALIKE, ALIKE)) -> tuple[list, str]:
    """Pairs of one value, rank with rank, where both runs hold it on the same ranks in the same
    shapes: runs of the same ranks whose parameters are cut otherwise (DDP against FSDP2), each
    rank computing on its share of the batch in both (a full ``mean``/``sum``: one pair, averaged/
    summed over the ranks).  Each rank's pair is judged on its own, as compare judges runs of one
    parallelism, so a change on one rank is not diluted by the others' agreeing shares.  Pieces
    that are one value on every rank in one run and not in the other mean something else in each
    (a replica against a share): not paired.  Returns ([(value of A, value of B)], why not);
    ([], "") where this does not apply."""
    if sorted(sa) != sorted(sb) or len(sa) < 2 or any(s.get("dtensor") for s in (*sa.values(), *sb.values())):
        return [], ""
    ia, ib = (_items(s, p, tensors, problems, w.factors) for s, p, w in ((sa, pa, weights[0]), (sb, pb, weights[1])))
    if any(ia[r][0] != ib[r][0] for r in ia):
        return [], ""
    if _replicas(list(ia.values())) != _replicas(list(ib.values())):
        return [], "equal on every rank in one run and not in the other (a replica against each rank's share)"
    if ia[min(ia)][0] == ():
        if reduction not in ("mean", "sum"):
            return [], ""
        (va, why_a), (vb, why_b) = (assemble(s, p, tensors, problems, (), reduction, w)
                                    for s, p, w in ((sa, pa, weights[0]), (sb, pb, weights[1])))
        return ([(va, vb)] if va is not None and vb is not None else []), why_a or why_b
    return [(Value(*ia[r], how=f"rank {r} {RANK_BY_RANK}"), Value(*ib[r], how=f"rank {r} {RANK_BY_RANK}"))
            for r in sorted(ia)], ""


def assemble(specs: dict, parts: dict, tensors: bool, problems: list, target: tuple | None = None,
             reduction: str | None = None, weights: Weights = ALIKE) -> tuple[Value | None, str]:
    """One value from each rank's spec of it (``specs``: rank -> spec), shaped like ``target``
    where the ranks split it, each rank's piece weighed by ``weights``; returns (value, why not)."""
    ranks = sorted(specs)
    first = specs[ranks[0]]
    items = _items(specs, parts, tensors, problems, weights.factors)
    meta = first.get("dtensor")
    if meta:
        partial = any(str(p).startswith(("P", "_Partial")) for p in meta.get("placements") or ())
        local = {r: (tuple(specs[r]["dtensor"].get("local_shape") or specs[r]["shape"]), *items[r][1:]) for r in ranks}
        if partial:     # the ranks' pieces summed, not placed (they sit at one offset)
            v = _gather_dtensor(local, meta)
            return (v, "") if v is not None else (None, _PARTIAL_WITHOUT_TENSORS)
        if all("offset" in specs[r]["dtensor"] for r in ranks):
            v = _place(local, {r: specs[r]["dtensor"]["offset"] for r in ranks}, tuple(first["shape"]), meta)
        else:
            v = _gather_dtensor(local, meta)
        return (v, "") if v is not None else (None, "a DTensor whose shards are not all recorded")
    shape = items[ranks[0]][0]
    if len(ranks) == 1 or target is None or tuple(target) == shape and not (reduction and shape == ()):
        if len(ranks) > 1 and not _replicas([items[r] for r in ranks]):
            return None, (f"of the same shape on every rank but not equal on them (a partial result of tensor "
                          f"parallelism, or each rank's own data)")
        return Value(shape, *items[ranks[0]][1:], how=f"rank {ranks[0]}"), ""
    if shape == () and reduction in ("mean", "sum"):
        v, why = _reduced([items[r] for r in ranks], reduction, [(weights.averaged or {}).get(r) for r in ranks],
                          f"{reduction} over ranks {ranks[0]}-{ranks[-1]}")
        return (v, "") if v is not None else (None, f"{why} on a rank")
    dim = _split_dim([items[r][0] for r in ranks], tuple(target))
    if dim is not None:
        how = f"concatenated over ranks {ranks[0]}-{ranks[-1]} (dim {dim})"
        return _concat([items[r] for r in ranks], dim, how, weights.interleaved), ""
    return None, f"shapes {[list(items[r][0]) for r in ranks]} on the ranks do not make {list(target)}"


def _split_dim(shapes: list, target: tuple) -> int | None:
    """The one dimension along which the ranks' pieces, side by side in rank order, make ``target``:
    dim 0 for a batch split over data-parallel ranks, the last for a column-wise tensor-parallel
    layer's output (its column shards); None where no dimension, or more than one, does."""
    fits = [d for d in range(len(target))
            if all(len(s) == len(target) and s[:d] + s[d + 1:] == target[:d] + target[d + 1:] for s in shapes)
            and sum(s[d] for s in shapes) == target[d]]
    return fits[0] if len(fits) == 1 else None


# ---- a data-parallel x tensor-parallel mesh ----------------------------------------------------------
TP_PEERS_DIFFER = "(its tensor-parallel peers differ)"   # how: "rank 1 (its tensor-parallel peers differ): ..."
_AT_FAULT = re.compile(r"the difference lies in rank (\d+)'s piece")


@dataclass
class Mesh:
    """How one run's ranks share the work: ``shares``, the ranks of each share of the batch in
    data-parallel order (the members of one tensor-parallel group together); ``partial``, per rank,
    id(output spec) -> the spec of the all-reduce that sums it (:func:`partial_sums`);
    ``batch_dim``, the dimension the shares split, learnt from the first value each share holds
    whole (replicated over its tensor-parallel group): it tells column shards of the batch's shares
    from the other way round where both would make the other run's shape."""

    shares: list
    partial: dict
    batch_dim: int | None = None


def mesh_of(parts: dict) -> Mesh | None:
    """The mesh of a step's parts, or None where no two ranks compute on the same share (no
    tensor parallelism: each rank's value is its own share or a replica, as :func:`assemble` reads)."""
    shares = data_shares({r: p.records for r, p in parts.items()})
    if all(len(share) == 1 for share in shares):
        return None
    return Mesh(shares, {r: partial_sums(p.records) for r, p in parts.items()})


def partial_sums(records: list) -> dict:
    """id(output spec) -> the spec of the collective's result that sums it, for each value of the
    model's forward and backward that an all-reduce (SUM, over several ranks) takes as its input,
    or that a reduce-scatter (SUM) takes laid out in pieces along a dimension other than the first
    (a ``cat`` of its chunks: sequence parallelism's row-wise output back to sequence shards, a
    column-wise layer's input gradient): a partial result of tensor parallelism, recorded before
    the collective sums it (the reduce-scatter's result: this rank's piece of the sum)."""
    forward = _model_forward(records) + _model_backward(records)
    flow = data_flow(forward)
    out = {}
    for i, rec in enumerate(forward):
        info = rec.get("collective") or {}
        if info.get("kind") not in ("all_reduce", "reduce_scatter") or info.get("reduce_op") != "SUM" or \
                len(group_of(rec)) < 2:
            continue
        given = [spec for io, _, spec in flow.walks[i] if io == "input"]
        results = [spec for io, _, spec in flow.walks[i] if io == "output"]
        for spec, result in zip(given, results):
            src = flow.src.get(id(spec))
            if src is not None and info["kind"] == "reduce_scatter":
                src = _chunks_of(forward, flow, src)
            if src is None:
                continue
            made = {arg: s for io, arg, s in flow.walks[src[0]] if io == "output"}.get(src[1])
            if made is not None:
                out[id(made)] = result
    return out


def _chunks_of(ops: list, flow, src: tuple) -> tuple | None:
    """The (index, output arg) of the one value a ``cat`` at ``src`` lays out, every input of it a
    chunk of that value (DTensor's redistribution of a partial sum to a shard along dimension d > 0:
    chunks along d stacked for the reduce-scatter); None where ``src`` is no such ``cat`` (FSDP2's
    reduce-scatter of several gradients packed together: no one partial value)."""
    if not ops[src[0]]["op"].startswith("aten.cat."):
        return None
    sources = {flow.src.get(id(spec)) for io, _, spec in flow.walks[src[0]] if io == "input"}
    return next(iter(sources)) if len(sources) == 1 and None not in sources else None


def _peers_given_equal(records: dict, share: list, tensors: bool, parts: dict, problems: list) -> bool:
    """Whether the members of one share ran the op on equal tensor inputs (so its outputs must be
    equal too): the premise for judging peers whose outputs differ one by one."""
    walks = {r: [s for _, _, s in walk(records[r], outputs=False)] for r in share}
    if len({len(w) for w in walks.values()}) != 1:
        return False
    for k in range(len(walks[share[0]])):
        specs = {r: walks[r][k] for r in share}
        if any("stats" not in s and "data" not in s for s in specs.values()):
            return False
        items = _items(specs, parts, tensors, problems)
        if len({it[0] for it in items.values()}) != 1 or not _replicas(list(items.values())):
            return False
    return True


def _summed(share: list, items: dict, specs: dict, mesh: Mesh, factor: float = 1) -> tuple:
    """One share's partial sums added up: the arrays where saved, else the collective's result (its
    statistics: those of the sum, which the parts' statistics do not give; a reduce-scatter's
    pieces of the sum combined), times ``factor`` as the parts (:func:`_items`)."""
    arrays = [items[r][3] for r in share]
    results = [mesh.partial[r][id(specs[r])] for r in share]
    stats = results[0].get("stats")
    if results[0].get("shape") != specs[share[0]].get("shape"):     # a reduce-scatter: each member a piece
        stats = _combine_stats([res.get("stats") for res in results], [math.prod(res["shape"]) for res in results])
    array = None
    if all(a is not None for a in arrays):
        array = np.sum([np.asarray(a, np.float64) for a in arrays], axis=0).astype(arrays[0].dtype)
    return (items[share[0]][0], items[share[0]][1], _times((None, None, stats, None), factor)[2], array)


def _join_share(share: list, items: dict, specs: dict, records: dict, mesh: Mesh, dim: int | None,
                tensors: bool, parts: dict, problems: list, factors: dict | None = None):
    """The pieces of one share joined: ``dim`` None, the whole on each member (one value; partial
    sums added; peers that ran the op on equal inputs yet differ: each member's, to judge one by
    one), else side by side along ``dim`` (column shards).  Returns (variants, how) or None."""
    own = [items[r] for r in share]
    if dim is not None:      # column shards: pieces, never equal values side by side
        if len(share) == 1 or any(len(it[0]) <= dim for it in own) or _replicas(own):
            return None
        v = _concat(own, dim, "")
        return ([(v.shape, v.dtype, v.stats, v.array)], f"side by side (dim {dim})")
    if len({it[0] for it in own}) != 1:
        return None
    if len(share) == 1 or _replicas(own):
        return [own[0]], "equal"
    if all(id(specs[r]) in mesh.partial[r] for r in share):
        return [_summed(share, items, specs, mesh, (factors or {}).get(share[0], 1))], "summed"
    if _peers_given_equal(records, share, tensors, parts, problems):
        return own, "differ"
    return None


def assemble_on_mesh(specs: dict, records: dict, parts: dict, mesh: Mesh, tensors: bool, problems: list,
                     target: tuple | None, reduction: str | None, stage: str = "forward",
                     weights: Weights = ALIKE) -> tuple[list, str]:
    """The whole value from the ranks of a data-parallel x tensor-parallel mesh, shaped like
    ``target`` (the other run's): each share's pieces joined first (replicas taken once, column
    shards side by side, partial sums added), then the shares as the batch's split.  Where the
    members of a share ran an op on equal inputs and still differ, one whole value per member
    index, so that each is judged and the one that parts names its rank.  In the backward, a value
    of one shape on every share that the shares hold unequal is each share's sum over its part of
    the batch (a weight's gradient before the data-parallel reduction), said so.  Returns ([value],
    why not); DTensors and runs without ``target`` go through :func:`assemble`."""
    if target is None or any(s.get("dtensor") for s in specs.values()):
        v, why = assemble(specs, parts, tensors, problems, target, reduction, weights)
        return ([v] if v is not None else []), why
    items = _items(specs, parts, tensors, problems, weights.factors)
    fits = []
    for dim in (None, *range(len(target))):
        joined = [_join_share(share, items, specs, records, mesh, dim, tensors, parts, problems, weights.factors)
                  for share in mesh.shares]
        if any(j is None for j in joined):
            continue
        how = _shares_fit([j[0][0][0] for j in joined], tuple(target), reduction)
        if how is not None:
            fits.append((joined, how))
    if len(fits) > 1 and mesh.batch_dim is not None:
        fits = [f for f in fits if f[1] == f"concatenated (dim {mesh.batch_dim})"]
    if len(fits) != 1:
        shapes = [[list(items[r][0]) for r in share] for share in mesh.shares]
        apart = "" if fits else _peers_apart(mesh, items, specs, records, tensors, parts, problems)
        return [], apart or (f"pieces {shapes} on the shares of the batch (tensor-parallel groups {mesh.shares}) "
                             f"{'do not make' if not fits else 'make in more than one way'} {list(target)}")
    joined, fit = fits[0]
    if mesh.batch_dim is None and fit.startswith("concatenated") and all(len(v) == 1 for v, _ in joined) and \
            {kind for _, kind in joined} <= {"equal"}:
        mesh.batch_dim = int(fit.rpartition(" ")[2].rstrip(")"))
    values, why = [], ""
    for t in range(max(len(variants) for variants, _ in joined)):
        chosen = [variants[t] if len(variants) > 1 else variants[0] for variants, _ in joined]
        named = [share[t] for share, (variants, _) in zip(mesh.shares, joined) if len(variants) > 1]
        how = _how_joined(mesh.shares, joined, fit)
        if named:
            how = f"rank {', '.join(map(str, named))} {TP_PEERS_DIFFER}: {how}"
        v, why = _join_shares(chosen, fit, reduction, how,
                              [(weights.averaged or {}).get(share[0]) for share in mesh.shares], weights.interleaved)
        if v is not None:
            if v.array is not None:
                v.owners = _owners(mesh.shares, joined, items, fit, t)
            values.append(v)
    if not values and stage == "backward" and fit == "equal":
        return [], ("each share's own sum over its part of the batch (a weight's gradient before its reduction "
                    "over the data-parallel group): the parameter gradients compare it after")
    if not values:
        return [], _peers_apart(mesh, items, specs, records, tensors, parts, problems) or why
    return values, ""


def _owners(shares: list, joined: list, items: dict, fit: str, t: int) -> np.ndarray | None:
    """Per element of a value assembled on a mesh, the one rank that computed it (-1 where several
    did: a replica, a sum), so that a difference found in the whole can be placed in one rank's
    piece (a wrong kernel on one rank inside column shards); None where the shares are not laid
    side by side."""
    pieces = []
    for share, (variants, kind) in zip(shares, joined):
        if kind.startswith("side by side"):
            dim = int(kind.rpartition(" ")[2].rstrip(")"))
            pieces.append(np.concatenate([np.full(items[r][0], r) for r in share], axis=dim))
        else:
            one = share[t] if kind == "differ" else share[0] if len(share) == 1 else -1
            pieces.append(np.full(variants[0][0], one))
    if fit.startswith("concatenated"):
        return np.concatenate(pieces, axis=int(fit.rpartition(" ")[2].rstrip(")")))
    return pieces[0] if fit == "one share" else None


def _piece_at_fault(a: Value, b: Value) -> int | None:
    """The one rank whose piece holds the largest differences (every element within half the largest
    difference), where one run's value was laid out from the ranks' pieces; None where several
    ranks' pieces share them (a difference from upstream) or nothing places them."""
    owners = a.owners if a.owners is not None else b.owners
    if owners is None or a.array is None or b.array is None or a.array.size != owners.size or \
            b.array.size != owners.size:
        return None
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(np.asarray(a.array, np.float64).reshape(owners.shape)
                      - np.asarray(b.array, np.float64).reshape(owners.shape))
    diff = np.nan_to_num(diff, nan=np.inf)
    top = float(diff.max()) if diff.size else 0.0
    if not top > 0:
        return None
    at = np.unique(owners[diff >= top / 2])
    return int(at[0]) if len(at) == 1 and at[0] >= 0 else None


def _how_joined(shares: list, joined: list, fit: str) -> str:
    """How a value was assembled: one share (tensor parallelism alone) as :func:`assemble` says it
    (``concatenated over ranks 0-1 (dim 1)``, ``rank 0``), several as the shares' split and how each
    share's pieces joined."""
    kinds = sorted({kind for _, kind in joined} - {"differ"})
    if len(shares) > 1:
        return f"{fit} over shares {shares}, each {' / '.join(kinds) or 'a rank'}"
    share, kind = shares[0], (kinds or ["differ"])[0]
    span = f"ranks {share[0]}-{share[-1]}"
    if kind.startswith("side by side"):
        return f"concatenated over {span} ({kind.partition('(')[2]}"
    return f"summed over {span}" if kind == "summed" else f"rank {share[0]}" if kind == "equal" else span


def _peers_apart(mesh: Mesh, items: dict, specs: dict, records: dict, tensors: bool, parts: dict,
                 problems: list) -> str:
    """Why a value the members of a share hold in one shape cannot be joined, where they hold it
    unequal, do not sum it by an all-reduce and ran its op on unequal inputs (a difference
    upstream, or a split no record shows): "" where no share is so."""
    for share in mesh.shares:
        own = [items[r] for r in share]
        if len(share) > 1 and len({it[0] for it in own}) == 1 and not _replicas(own) and \
                not all(id(specs[r]) in mesh.partial[r] for r in share) and \
                not _peers_given_equal(records, share, tensors, parts, problems):
            return (f"unequal on the ranks {share} of one tensor-parallel group, which ran it on unequal inputs "
                    "(a difference before it, or pieces no all-reduce sums): no whole value to pair")
    return ""


def _shares_fit(shapes: list, target: tuple, reduction: str | None) -> str | None:
    """How the shares' values make ``target``: one share, equal on every share, concatenated along
    one dimension (the batch), a full mean/sum over the shares; None where they do not."""
    if all(s == target for s in shapes):
        if target == () and len(shapes) > 1 and reduction in ("mean", "sum"):
            return reduction
        return "one share" if len(shapes) == 1 else "equal"
    dim = _split_dim(shapes, target) if len(shapes) > 1 else None
    return None if dim is None else f"concatenated (dim {dim})"


def _join_shares(chosen: list, fit: str, reduction: str | None, how: str, averaged: list,
                 interleaved: bool = False) -> tuple[Value | None, str]:
    if fit.startswith("concatenated"):
        return _concat(chosen, int(fit.rpartition(" ")[2].rstrip(")")), how, interleaved), ""
    if fit == "one share":
        return Value(*chosen[0], how=how), ""
    if fit == "equal":
        if not _replicas(chosen):
            return None, "of the same shape on every share of the batch but not equal on them (each share's own data)"
        return Value(*chosen[0], how=how), ""
    v, why = _reduced(chosen, reduction, averaged, how)
    return (v, "") if v is not None else (None, f"{why} on a share")


def _reduced(items: list, reduction: str, averaged: list, how: str) -> tuple[Value | None, str]:
    """A full ``sum``/``mean`` over the ranks (or shares) from each one's 0-dim result: the sum of
    sums; the mean of means weighed by the elements each averaged (``averaged``, where every one
    says), since a share of 3 samples and one of 2 make the whole batch's mean only so weighed,
    else alike.  Returns (value, why not)."""
    means = [it[2]["mean"] if it[2] else None for it in items]
    if any(m is None for m in means):
        return None, "a reduction whose statistics are missing"
    if reduction == "sum":
        weights = [1.0] * len(items)
    elif all(averaged):
        weights = [n / sum(averaged) for n in averaged]
    else:
        weights = [1.0 / len(items)] * len(items)
    arrays = [it[3] for it in items]
    array = np.asarray(sum(w * np.asarray(a, np.float64) for w, a in zip(weights, arrays))) if all(
        a is not None for a in arrays) else None
    x = sum(w * m for w, m in zip(weights, means))
    st = {"max": x, "min": x, "mean": x, "norm": abs(x), "nan": int(np.isnan(x)), "inf": int(np.isinf(x))}
    return Value((), items[0][1], st, array, how), ""


# ---- scoring one pair -----------------------------------------------------------------------------------
def score(a: Value, b: Value) -> dict:
    """The metrics and verdict of one assembled pair, the same with ``a`` and ``b`` swapped: neither
    run is the reference (relative errors against the smaller magnitude, the absolute-error shortcut
    scaled by the smaller run's, a statistics error the larger of the two directions)."""
    dtype = V.lower_precision(a.dtype, b.dtype)
    for carried in {a.carries, b.carries} - {""}:   # a float32 value computed in bfloat16 carries its rounding
        dtype = V.lower_precision(dtype, carried)
    row = {"cosine": np.nan, "max_abs_err": np.nan, "rel_l2_err": np.nan, "stats_err": np.nan, "precision": dtype}
    if a.array is not None and b.array is not None and a.array.size == b.array.size:
        if not is_float(dtype) or a.array.dtype.kind not in "fc":
            mism = M.binary_mismatch(a.array, b.array)
            return {**row, "rel_l2_err": mism, "status": V.ERROR if mism else V.PASS,
                    "reason": f"{mism:.2%} of elements differ" if mism else ""}
        if np.array_equal(a.array, b.array):
            return {**row, "cosine": 1.0, "max_abs_err": 0.0, "rel_l2_err": 0.0, "status": V.PASS, "reason": ""}
        met = M.compare_arrays(a.array, b.array, dtype, symmetric=True)
        scale = float(np.fmin(np.max(np.abs(a.array)), np.max(np.abs(b.array)))) if b.array.size else 1.0
        status, reason = V.judge_compare(met, dtype, scale if np.isfinite(scale) else 1.0)
        return {**row, **{k: met.get(k, np.nan) for k in ("cosine", "max_abs_err", "rel_l2_err")},
                "status": status, "reason": reason}
    if a.stats is None or b.stats is None:
        return {**row, "status": V.NOT_JUDGED,
                "reason": "no values recorded"}
    sa = {k: np.array([a.stats.get(k, np.nan)], np.float64) for k in S.KEYS}
    sb = {k: np.array([b.stats.get(k, np.nan)], np.float64) for k in S.KEYS}
    err = np.fmax(S.stats_error(sa, sb), S.stats_error(sb, sa))
    nonfinite = np.array([a.stats.get("nan", 0) != b.stats.get("nan", 0) or a.stats.get("inf", 0) != b.stats.get("inf", 0)])
    status, reason = S.judge_stats_columns(err, [dtype], nonfinite)
    return {**row, "stats_err": float(err[0]), "rel_l2_err": float(err[0]), "status": status[0], "reason": reason[0]}


# ---- the runs ------------------------------------------------------------------------------------------
def _loss_name(records: list) -> str | None:
    """The record name of the loss: the last forward op with a 0-dim float output before backward."""
    name = None
    for r in records:
        if r.get("stage") == "backward":
            break
        if r.get("kind") != "op" or r["op"].split(".")[1:2] == ["ones_like"]:
            continue
        outs = [s for _, _, s in walk(r, inputs=False)]
        if outs and outs[0].get("shape") == [] and is_float(outs[0].get("dtype", "")):
            name = r["name"]
    return name


# ops scaling a 0-dim value by a number (``loss / accumulation_steps``, ``loss * weight``)
SCALINGS = ("aten.div.Tensor", "aten.div.Scalar", "aten.mul.Tensor", "aten.mul.Scalar")


NLL_MEAN = 1    # nll_loss's ``reduction`` argument for a mean over the targets (torch's Reduction::Mean)


def mean_count(rec: dict) -> float | None:
    """The number of elements a full mean's record averages: a ``mean``'s input's elements, a mean
    ``nll_loss``'s (``cross_entropy``'s) targets counted by weight (its ``total_weight`` output: the
    targets not ignored, or their classes' weights summed); None where the record is neither or
    does not say."""
    if rec["op"] == "aten.mean.default" and len(rec.get("inputs", ())) == 1:
        given = [spec for _, _, spec in walk(rec, outputs=False)]
        return math.prod(given[0]["shape"]) if given and given[0].get("shape") is not None else None
    args = rec.get("inputs", ())
    if rec["op"] == "aten.nll_loss_forward.default" and len(args) > 3 and args[3].get("value") == NLL_MEAN:
        outs = [spec for _, _, spec in walk(rec, inputs=False)]
        total = (outs[1].get("stats") or {}).get("max") if len(outs) > 1 else None
        return float(total) if total is not None and math.isfinite(total) and total > 0 else None
    return None


class LossMean(NamedTuple):
    """A loss that is a full mean (``mean``, a mean ``nll_loss``) scaled by numbers: the mean's record
    name, the names of the scaling records after it and what each does (op, number), in order."""

    mean: str
    scalings: tuple     # record names
    numbers: tuple      # (op, number) of each scaling


def _scalings_of(rec: dict) -> list:
    """[(the 0-dim tensor a :data:`SCALINGS` record scales, the number it scales it by)]: by a number
    argument, or by a one-element tensor whose statistics give its one value (a loss scaler's
    scale: ``GradScaler.scale(loss)`` multiplies by a tensor).  Two one-element tensors multiplied
    each may be the one scaled, so both are given; [] where the record is no such scaling (no
    number, a value of more than one element)."""
    if rec["op"] not in SCALINGS:
        return []
    tensors = [spec for _, _, spec in walk(rec, outputs=False)]
    numbers = [v for v in rec.get("inputs", ()) if v.get("type") in ("int", "float")]
    if len(tensors) == 1 and tensors[0].get("shape") == [] and len(numbers) == 1:
        return [(tensors[0], numbers[0]["value"])]
    if len(tensors) != 2 or numbers or rec["op"] not in ("aten.mul.Tensor", "aten.div.Tensor"):
        return []
    out = []
    for k in (0, 1) if rec["op"] == "aten.mul.Tensor" else (0,):     # a division scales its dividend
        by = _one_value(tensors[1 - k])
        if tensors[k].get("shape") == [] and by is not None:
            out.append((tensors[k], by))
    return out


def _one_value(spec: dict) -> float | None:
    """The one finite value of a one-element tensor, from its statistics; None where it is not one."""
    stats = spec.get("stats") or {}
    if math.prod(spec.get("shape") or [1]) != 1 or stats.get("max") is None or stats.get("max") != stats.get("min"):
        return None
    value = float(stats["max"])
    return value if math.isfinite(value) else None


def _made(spec: dict, by: dict) -> bool:
    """Whether the output ``by`` of a record is the value ``spec`` (its saved data, else its statistics)."""
    if spec.get("data") is not None or by.get("data") is not None:
        return spec.get("data") == by.get("data")
    return spec.get("stats") is not None and spec.get("stats") == by.get("stats") and spec.get("dtype") == by.get("dtype")


def loss_mean(records: list) -> LossMean | None:
    """The loss as a full ``mean`` scaled by numbers (:class:`LossMean`): from the loss record back
    through the :data:`SCALINGS` that made it from the record before; None where it is no such
    mean (a sum, a mean of a product of two tensors)."""
    forward = _model_forward(records)
    name = _loss_name(records)
    at = next((i for i, r in enumerate(forward) if r["name"] == name), None)
    return _mean_before(forward, at, (), ()) if at is not None else None


def _mean_before(forward: list, at: int, scalings: tuple, numbers: tuple) -> LossMean | None:
    """:func:`loss_mean` from record ``at`` back, ``scalings`` and ``numbers`` found after it so far
    (nearest the loss first); each way a scaling may read the loss tried (:func:`_scalings_of`)."""
    rec = forward[at]
    if mean_count(rec) is not None:
        return LossMean(rec["name"], tuple(reversed(scalings)), tuple(reversed(numbers)))
    for given, number in _scalings_of(rec):
        before = next((i for i in range(at - 1, -1, -1) for _, _, out in walk(forward[i], inputs=False)
                       if _made(given, out)), None)
        found = None if before is None else \
            _mean_before(forward, before, (*scalings, rec["name"]), (*numbers, (rec["op"].split(".")[1], number)))
        if found is not None:
            return found
    return None


def _model_forward(records: list) -> list:
    """The forward op records of the model and its loss: those before backward begins (the
    optimizer's ops come after it; its result is in the parameter records), the seed of the
    gradient (``ones_like``) left out."""
    out = []
    for r in records:
        if r.get("stage") == "backward":
            break
        if r.get("kind") == "op" and r.get("stage") == "forward" and r["op"].split(".")[1:2] != ["ones_like"]:
            out.append(r)
    return out


def _keyed(records: list) -> dict:
    """The records by pairing key, in order: (module path, the name the record has counting its calls
    within that module only: ``aten.cat.default.1.forward``).  Counted per module, an op the other
    run lacks elsewhere (DDP's own ``cat`` of its buffers at the root, before the model runs) moves
    no other module's names, so the same op of the same module pairs across the runs."""
    calls: dict = {}
    out = {}
    for rec in records:
        path = module_path(rec["scope"])
        k = calls[path, rec["op"]] = calls.get((path, rec["op"]), -1) + 1
        out[path, f"{rec['op']}.{k}.{rec['stage']}"] = rec
    return out


def _forward(parts: dict) -> tuple[dict, list]:
    """key -> {rank: record} of the forward op records every rank holds (keys: :func:`_keyed`), and
    every rank's keys in order (the lowest rank's, each key some higher rank holds alone placed after
    the key before it there: an op one rank alone runs is an op of one run only, the prime suspect of
    a change on that rank)."""
    by_rank = {r: _keyed(_model_forward(p.records)) for r, p in parts.items()}
    first = by_rank[min(parts)]
    common = {n: {r: by_rank[r][n] for r in parts} for n in first if all(n in by_rank[r] for r in parts)}
    order = list(first)
    seen = set(order)
    for r in sorted(parts)[1:]:
        before = None
        for n in by_rank[r]:
            if n not in seen:
                order.insert(order.index(before) + 1 if before is not None else 0, n)
                seen.add(n)
            before = n
    return common, order


def _averaged(records: dict) -> dict | None:
    """rank -> the number of elements of an op's first tensor input on that rank (what a full
    ``mean`` averages there, to weigh each rank's mean by), or None where a rank's record holds none."""
    sizes = {}
    for r, rec in records.items():
        given = walk(rec, outputs=False)
        if not given or given[0][2].get("shape") is None:
            return None
        sizes[r] = math.prod(given[0][2]["shape"])
    return sizes


def _made_from_numbers(records: dict) -> bool:
    """Whether an op reads no tensor on any rank (``arange``, ``zeros``, ``full``): each rank makes
    its value from the program's numbers (``arange(batch)`` of its own share), never a share of a
    whole to lay side by side."""
    return not any(walk(rec, outputs=False) for rec in records.values())


def param_specs(parts: dict) -> dict:
    """(what, name, call) -> {rank: spec} of the parameter records."""
    out: dict = {}
    for r, p in parts.items():
        for rec in p.params:
            outs = rec.get("outputs") or []
            if outs:
                out.setdefault((rec["op"].partition(".")[2], parameter_name(rec["scope"]), rec["call"]), {})[r] = outs[0]
    return out


def _layout(spec: dict) -> tuple:
    """How a parameter record's tensor sits on a rank: its whole shape, the part this rank holds
    and the DTensor placements that cut it (none: the whole tensor, a replica)."""
    meta = spec.get("dtensor") or {}
    return (tuple(spec.get("shape") or ()), tuple(meta.get("local_shape") or spec.get("shape") or ()),
            tuple(map(str, meta.get("placements") or ())))


def _describe_layout(layout: tuple) -> str:
    whole, local, placements = layout
    return f"{', '.join(placements)}, {list(local)} of {list(whole)} on a rank" if placements else \
        f"whole ({list(whole)}) on every rank"


def layout_difference(run_a, run_b) -> str:
    """Why two runs of the same ranks hold their parameters in other pieces (DDP's whole replicas
    against FSDP2's or tensor parallelism's shards), or "" where each rank holds the same pieces:
    then a rank's ops compute on the same values in both runs and pair one to one; otherwise they
    do not (FSDP2 gathers and reduce-scatters what DDP all-reduces), and only what both hold once
    assembled from the ranks compares.  Read from the parameter records of the first step both
    runs hold; runs without them are taken as laid out alike."""
    common = sorted(set(run_a.parts) & set(run_b.parts))
    if not common:
        return ""
    step = common[0][0]
    for rank in sorted(r for s, r in common if s == step):
        specs_a, specs_b = (param_specs({rank: run.parts[step, rank]}) for run in (run_a, run_b))
        for key in [k for k in specs_a if k in specs_b]:
            la, lb = _layout(specs_a[key][rank]), _layout(specs_b[key][rank])
            if la != lb:
                return (f"parameter {key[1]} on rank {rank}: {_describe_layout(la)} in run A, "
                        f"{_describe_layout(lb)} in run B")
    return ""


def compare_parallelism(run_a, run_b, tensors: bool = True, steps: list | None = None) -> list:
    """Compare ``run_a`` with ``run_b`` (loaded runs of other ranks or parameter layouts) on what both hold, step by
    step: ``(step, rows, unpaired, problems, weighed apart)`` (:func:`weighed_apart`) for each of ``steps`` (default: every step both
    hold), for :func:`merge_steps`."""
    if steps is None:
        steps = sorted({k[0] for k in run_a.parts} & {k[0] for k in run_b.parts})
    stepped = stepped_steps(run_a), stepped_steps(run_b)
    out = []
    for step in steps:
        pa = {k[1]: p for k, p in run_a.parts.items() if k[0] == step}
        pb = {k[1]: p for k, p in run_b.parts.items() if k[0] == step}
        problems: list = []
        unpaired: list = []
        rows, apart = _step_rows(step, pa, pb, tensors, problems, unpaired)
        apart = apart or skipped_update(stepped, step)
        for p in (*pa.values(), *pb.values()):
            problems.extend(x for x in p.problems if x not in problems)
        out.append((step, rows, unpaired, problems, apart))
    return out


def stepped_steps(run) -> set:
    """The steps after which a run records its parameters (``params.jsonl``): those its optimizer stepped at."""
    return {k[0] for k, p in run.parts.items() if any(rec["op"].partition(".")[2] == "value" for rec in p.params)}


def skipped_update(stepped: tuple, step: int) -> str:
    """Why the runs' parameters differ after ``step`` by design, or "": one run's optimizer stepped
    there and the other's did not (``stepped``: :func:`stepped_steps` of each run, both recording
    parameters at some step), as a loss scaler skips an update whose scaled gradients overflowed."""
    if not all(stepped) or (step in stepped[0]) == (step in stepped[1]):
        return ""
    return (f"run {'A' if step not in stepped[0] else 'B'} records no parameters after step {step}'s optimizer step "
            "while the other run does: its optimizer did not step (a loss scaler skips an update whose scaled "
            "gradients overflowed), so the runs' parameters differ after it")


def merge_steps(run_a, run_b, steps: list) -> tuple[pd.DataFrame, ParallelVerdict]:
    """The table and verdict of :func:`compare_parallelism`'s steps (from one or several ranks)."""
    steps = sorted(steps, key=lambda s: s[0])
    ranks_a = sorted({k[1] for k in run_a.parts})
    ranks_b = sorted({k[1] for k in run_b.parts})
    steps_a, steps_b = {k[0] for k in run_a.parts}, {k[0] for k in run_b.parts}
    unpaired = [f"steps {sorted(steps_a ^ steps_b)} are in one run only"] if steps_a != steps_b else []
    problems: list = []
    rows: list = []
    for _, r, u, p, _ in steps:
        rows += r
        unpaired += u
        problems += [x for x in p if x not in problems]
    _after_update_weighed_apart(rows, [(s[0], s[4]) for s in steps if s[4]])
    grown = grown_from_rounding(rows)
    skipped = [(s[0], s[4]) for s in steps if s[4] and not s[4].startswith(UNEQUAL_SHARES)]
    if skipped:    # said where it is seen: the later steps' rows are not judged for it
        problems.insert(0, f"step {skipped[0][0]}: {skipped[0][1]}; the rows of the steps after it are not judged")
    table = pd.DataFrame(rows, columns=TABLE_COLUMNS)
    for c in ("call_a", "call_b"):       # whole numbers, none for the parameters' rows
        table[c] = pd.Series([None if pd.isna(v) else int(v) for v in table[c]], index=table.index, dtype=object)
    table["after_one_run_only"] = ["; ".join(x) if isinstance(x, list) else "" for x in table["after_one_run_only"]]
    counts = {k: int(v) for k, v in table["status"].value_counts().items()} if len(table) else {}
    first = parted = departure = unjudged = None
    if len(table):
        bad = table[table["status"] == V.ERROR]
        first = bad.iloc[0].to_dict() if len(bad) else None
        off = table[table["status"].isin([V.ERROR, V.WARNING])]
        parted = off.iloc[0].to_dict() if len(off) else None
        moved = table[(table["status"] == V.PASS) & (table["rel_l2_err"].fillna(1.0) != 0.0)]
        departure = moved.iloc[0].to_dict() if len(moved) else None
        unjudged = table[table["status"] == V.NOT_JUDGED]
        unjudged = unjudged.iloc[0].to_dict() if len(unjudged) else None
    verdict = ParallelVerdict(str(run_a.path), str(run_b.path), ranks_a, ranks_b, [s[0] for s in steps], counts,
                              first, parted, departure, unpaired, problems,
                              layout=layout_difference(run_a, run_b) if ranks_a == ranks_b else "", unjudged=unjudged,
                              grown=grown)
    return table, verdict


GROWN = "computed from parameters that differ by rounding after step {step}'s update"


class Grown(NamedTuple):
    """Rows of later steps not judged as grown from rounding (:func:`grown_from_rounding`)."""

    step: int           # the step after whose update the runs' parameters first differ
    rows: int           # how many rows were set aside
    first: dict         # the first of them


def grown_from_rounding(rows: list) -> Grown | None:
    """Marks not judged the error rows of later steps that grew from rounding, and says where.

    Runs of other parallelism sum the same gradients in other orders (a reduce-scatter over the
    ranks' shares, one process's backward over the whole batch): in bfloat16 their parameters
    differ by rounding after the first update, though every value of that step agrees within
    tolerance, and a normalising optimizer (AdamW) carries the difference on, so a later step's
    values may differ past the limits with no kernel computing wrongly.  Such a row is no op's
    divergence where: every earlier step has no error row and the parameters after one of them
    (``value`` rows) are not bit for bit equal; its error is of rounding size (:data:`ROUNDINGS`
    roundings of the precision it is judged at); and what it is computed from differs already -- an
    op that reads a parameter or a value whose row differs (a warning, or such a row itself), the
    loss, a parameter's gradient or value (computed from the parameters).  An op whose inputs agree
    within tolerance while its output does not is still named (a wrong kernel at that step), and
    so is one off by more than rounding; past the first error row kept, nothing is set aside (what
    follows may follow from it)."""
    steps: dict = {}
    for r in rows:
        steps.setdefault(r["step"], []).append(r)
    parted, marked = None, []
    for step in sorted(steps):
        here = steps[step]
        if parted is None:
            if any(r["status"] == V.ERROR for r in here):
                return None
            if any(r["what"] == "value" and r["status"] != V.NOT_JUDGED and r["rel_l2_err"] != 0 for r in here):
                parted = step
            continue
        differs: set = set()
        kept = False
        for r in here:
            own = (r.get("op_key"), r["arg"])
            if r["status"] == V.NOT_JUDGED:
                continue
            if r["what"] in ("loss", "grad", "value"):
                apart = True
            else:
                apart = r.get("reads_param", False) or any(x in differs for x in r.get("reads", ()))
            if r["status"] == V.ERROR and not kept:
                unit = ROUNDOFF.get(r.get("precision"), ROUNDOFF["float32"])
                if apart and np.nan_to_num(r["rel_l2_err"], nan=np.inf) <= ROUNDINGS * unit:
                    r.update(status=V.NOT_JUDGED, reason=f"{GROWN.format(step=parted)}: an error of rounding size "
                                                         f"on values that differ already, not judged")
                    marked.append(r)
                else:
                    kept = True
            if r["status"] != V.PASS:
                differs.add(own)
        if kept:
            break
    return Grown(parted, len(marked), marked[0]) if marked else None


def _after_update_weighed_apart(rows: list, apart: list) -> None:
    """The rows of the steps after the first whose update the runs weigh otherwise or one run skips
    (``apart``: (step, why) of the steps :func:`weighed_apart` or :func:`skipped_update` says so of)
    marked not judged: those steps start from parameters that differ by the program's design, so a
    difference there is no divergence to name (with or without parameter records to show it)."""
    if not apart:
        return
    first, why = min(apart)
    reason = (f"after step {first}'s update, which the runs weigh otherwise ({UNEQUAL_SHARES} of the batch): its "
              "parameters differ by design" if why.startswith(UNEQUAL_SHARES) else f"after step {first}'s update: {why}")
    for r in rows:
        if r["step"] > first and r["status"] != V.NOT_JUDGED:
            r.update(status=V.NOT_JUDGED, reason=reason)


def _step_rows(step: int, pa: dict, pb: dict, tensors: bool, problems: list, unpaired: list) -> tuple[list, str]:
    """The rows of one step (loss, forward, backward, parameters) and why the runs weigh its
    update otherwise ("" where they do not: :func:`weighed_apart`)."""
    rows = []
    ra, rb = ",".join(map(str, sorted(pa))), ",".join(map(str, sorted(pb)))

    def add(what, name, scope, arg, va, vb, carries=("", ""), calls=(None, None)):
        va, vb = (replace(v, carries=c) if c else v for v, c in zip((va, vb), carries))
        rows.append({"step": step, "what": what, "name": name, "scope": scope, "call_a": calls[0],
                     "call_b": calls[1], "arg": arg, "ranks_a": ra,
                     "ranks_b": rb, "shape_a": list(va.shape), "shape_b": list(vb.shape), "dtype_a": va.dtype,
                     "dtype_b": vb.dtype, "how_a": va.how, "how_b": vb.how, **score(va, vb)})

    def add_worst(what, name, scope, arg, pairs, carries=("", ""), calls=(None, None)):
        """One row for pairs judged rank by rank: the worst rank's (status, then error; the lowest rank on a tie)."""
        scored = [(va, vb, score(va, vb)) for va, vb in pairs]
        order = {V.ERROR: 0, V.WARNING: 1, V.PASS: 2}
        va, vb, got = min(scored, key=lambda x: (order.get(x[2]["status"], 3), -np.nan_to_num(x[2]["rel_l2_err"], nan=0.0)))
        rank = _piece_at_fault(va, vb) if got["status"] in (V.ERROR, V.WARNING) else None
        if rank is not None and TP_PEERS_DIFFER not in va.how + vb.how:
            fault = f" (the difference lies in rank {rank}'s piece)"
            va, vb = (replace(v, how=v.how + fault) if v.owners is not None else v for v in (va, vb))
        add(what, name, scope, arg, va, vb, carries, calls)

    # the loss and the forward ops
    fa, order_a = _forward(pa)
    fb, order_b = _forward(pb)
    mesh_a, mesh_b = mesh_of(pa), mesh_of(pb)
    loss = {_loss_name(pa[min(pa)].records), _loss_name(pb[min(pb)].records)} - {None}
    means = {side: loss_mean_counts(parts, forward) for side, parts, forward in (("a", pa, fa), ("b", pb, fb))}
    feeds_a, feeds_b = feeds(pa[min(pa)].records), feeds(pb[min(pb)].records)
    paired = set()
    keys = _in_both_orders(order_a, order_b, [n for n in order_a if n in fa and n in fb])
    laid = batch_orders(fa, fb, keys, (pa, mesh_a), (pb, mesh_b), tensors)
    for key in keys:
        rec_a, rec_b = fa[key], fb[key]
        name = key[1]
        calls = (rec_a[min(rec_a)]["call"], rec_b[min(rec_b)]["call"])
        what = "loss" if {rec_a[min(rec_a)]["name"], rec_b[min(rec_b)]["name"]} & loss else "forward"
        constant = _made_from_numbers(rec_a) or _made_from_numbers(rec_b)
        scope = max(module_path(rec_a[min(rec_a)]["scope"]), module_path(rec_b[min(rec_b)]["scope"]),
                    key=lambda sc: (sc.count("."), sc))    # the deeper where the runs' scopes differ
        parts_of_op = rec_a[min(rec_a)]["op"].split(".")
        reduction = parts_of_op[1] if len(parts_of_op) > 1 else None
        wa, wb = Weights(averaged=_averaged(rec_a)), Weights(averaged=_averaged(rec_b))
        is_loss_mean = key in means["a"] and key in means["b"]     # the loss's mean, scaled or not
        if is_loss_mean:
            wa, wb = Weights(averaged=means["a"][key]), Weights(averaged=means["b"][key])
        wa, wb = wa._replace(interleaved=laid[0]), wb._replace(interleaved=laid[1])
        for arg, sa, sb in _outputs_on_every_rank(rec_a, rec_b):
            carries = (carried(feeds_a.flow, sa), carried(feeds_b.flow, sb))
            if is_loss_mean:    # averaged as the mean (a mean nll_loss's other output: its own op's)
                reduction = "mean" if arg == "output.0" else parts_of_op[1]
            tb = tuple(sb[min(sb)]["shape"]) if len(sb) == 1 and not constant else None
            ta = tuple(sa[min(sa)]["shape"]) if len(sa) == 1 and not constant else None
            pairs, why_a = rank_by_rank(sa, sb, pa, pb, tensors, problems, reduction, (wa, wb))
            if pairs:
                add_worst(what, name, scope, arg, pairs, carries, calls)
                rows[-1]["key"] = rows[-1]["op_key"] = key
                paired.add(key)
                continue
            if mesh_a or mesh_b:
                pairs, why = _mesh_pairs((sa, rec_a, pa, mesh_a, tb, wa), (sb, rec_b, pb, mesh_b, ta, wb), tensors,
                                         problems, reduction)
                if pairs:
                    add_worst(what, name, scope, arg, pairs, carries, calls)
                    rows[-1]["key"] = rows[-1]["op_key"] = key
                    paired.add(key)
                elif arg == "output.0" and why:
                    unpaired.append(f"step {step} forward op {name} [{scope or '<root>'}]: {why}")
                continue
            va = vb = None
            why_b = ""
            if not why_a:
                va, why_a = assemble(sa, pa, tensors, problems, tb, reduction, wa)
                vb, why_b = assemble(sb, pb, tensors, problems, ta, reduction, wb)
            if va is not None and vb is not None and int(np.prod(va.shape)) != int(np.prod(vb.shape)) and constant:
                why_a = (f"made from the program's numbers on each rank (reads no tensor), shapes {list(va.shape)} "
                         f"and {list(vb.shape)}: a rank's own value, not a share of a whole")
            if va is None or vb is None or int(np.prod(va.shape)) != int(np.prod(vb.shape)):
                if arg == "output.0" and (why_a or why_b):
                    why = "; ".join(sorted({why_a, why_b} - {""}))
                    unpaired.append(f"step {step} forward op {name} [{scope or '<root>'}]: {why}")
                continue
            add(what, name, scope, arg, va, vb, carries, calls)
            rows[-1]["key"] = rows[-1]["op_key"] = key
            paired.add(key)
    (back_a, _), (back_b, _) = _backward(pa), _backward(pb)
    for key, arg, pairs, why in _backward_pairs(pa, pb, mesh_a, mesh_b, tensors, problems, (feeds_a, feeds_b), laid):
        rec = next(iter(back_a[key].values()))
        scope = module_path(rec["scope"])
        if pairs:
            add_worst("backward", key[1], scope, arg, pairs, calls=(back_a[key][min(back_a[key])]["call"],
                                                                    back_b[key][min(back_b[key])]["call"]))
            rows[-1]["op_key"] = key
        elif arg == "output.0" and why:
            unpaired.append(f"step {step} backward op {key[1]} [{scope or '<root>'}]: {why}")
    only = {}
    for side, order, other in (("a", order_a, fb), ("b", order_b, fa)):
        keys = [n for n in order if n not in other and not n[1].startswith(COMMUNICATION)]
        only[side] = keys
        if keys:
            unpaired.append(f"step {step}: {len(keys)} forward op(s) in run {side.upper()} only (first: {keys[0][1]} "
                            f"[{keys[0][0] or '<root>'}])")
    for r in rows:     # per paired row: the ops of one run only just before it (since the previous pair)
        key = r.pop("key", None)
        r["after_one_run_only"] = []
        for side, order in (("a", order_a), ("b", order_b)):
            if key not in order:
                continue
            k = order.index(key) - 1
            while k >= 0 and order[k] not in paired:
                if order[k] in only[side]:
                    r["after_one_run_only"].append((order.index(key) - k, f"{order[k][1]} [{order[k][0] or '<root>'}] "
                                                                          f"in run {side.upper()} only"))
                k -= 1
        # nearest first in either run, then by name: the same list whichever run is A
        r["after_one_run_only"] = [text for _, text in sorted(r["after_one_run_only"])]

    # parameters: gradients as the optimizer read them, values after its step
    qa, qb = param_specs(pa), param_specs(pb)
    apart = weighed_apart(pa, mesh_a, pb, mesh_b)
    if not qa or not qb:
        unpaired.append(f"step {step}: no parameter records in run {'A and B' if not qa and not qb else 'A' if not qa else 'B'} (record with the "
                        "statistics or tensor task and parameters: true; the optimizer must step while the probe records)")
    for what in ("grad", "value"):
        keys = [k for k in qa if k[0] == what] + [k for k in qb if k[0] == what and k not in qa]
        for key in _in_both_orders(list(qa), list(qb), keys):
            if key not in qa or key not in qb:
                unpaired.append(f"step {step}: parameter {key[1]} ({what}) only in run {'B' if key not in qa else 'A'}")
                continue
            va, why_a = assemble(qa[key], pa, tensors, problems)
            vb, why_b = assemble(qb[key], pb, tensors, problems)
            if va is None or vb is None:
                unpaired.append(f"step {step}: parameter {key[1]} ({what}): {why_a or why_b}")
                continue
            if va.shape != vb.shape:
                unpaired.append(f"step {step}: parameter {key[1]} ({what}): shapes {list(va.shape)} and {list(vb.shape)}")
                continue
            module = key[1].rpartition(".")[0]
            add(what, key[1], module, "value" if what == "value" else "grad", va, vb,
                (computed_in(back_a, module, feeds_a.flow), computed_in(back_b, module, feeds_b.flow))
                if what == "grad" else ("", ""))
            if apart:
                rows[-1].update(status=V.NOT_JUDGED, reason=apart)
    _mark_reads(rows, feeds_a, feeds_b)
    return rows, apart


def _mark_reads(rows: list, *fed: Feeds) -> None:
    """Each op row of a step given what its op reads, in either run (``fed``: each run's lowest
    rank's :class:`Feeds`): ``reads``, the (pairing key, output arg) of the step's rows whose values
    it reads, looking through ops without a row (collectives, FSDP's own ops, one run's own ops) to
    what they read; ``reads_param``, whether it or an op it looks through reads a parameter
    (``param: true``).  :func:`grown_from_rounding` tells from them whether an op's inputs differ
    already."""
    rowed = {(r["op_key"], r["arg"]) for r in rows if "op_key" in r}
    for feeds_of in fed:
        at = {key: i for i, key in feeds_of.keys.items()}
        flow = feeds_of.flow
        for r in rows:
            i = at.get(r.get("op_key"))
            if i is None:
                continue
            reads, param = set(r.get("reads", ())), r.get("reads_param", False)
            todo, seen = [i], set()
            while todo:
                j = todo.pop()
                if j in seen:
                    continue
                seen.add(j)
                for io, _, spec in flow.walks[j]:
                    if io != "input":
                        continue
                    param = param or bool(spec.get("param"))
                    src = flow.src.get(id(spec))
                    if src is None:
                        continue
                    made = (feeds_of.keys.get(src[0]), src[1])
                    if made in rowed:
                        reads.add(made)
                    else:
                        todo.append(src[0])
            r["reads"], r["reads_param"] = sorted(reads), param


def weighed_apart(pa: dict, mesh_a: Mesh | None, pb: dict, mesh_b: Mesh | None) -> str:
    """Why the runs' parameter gradients weigh the batch's samples otherwise, or "": a data-parallel
    reduction averages the shares' gradients alike, each the gradient of its share's mean, which is
    the whole batch's mean's only where the shares are equal; with shares of 3 and 2 samples it
    weighs each sample of the smaller share more, by design, so neither the gradients nor the
    parameters after the step can be held to one process's (or to other shares')."""
    sizes = share_sizes(pa, mesh_a), share_sizes(pb, mesh_b)
    if None in sizes:
        return ""
    weighs = [tuple(s) if len(set(s)) > 1 else "alike" for s in sizes]
    if weighs[0] == weighs[1]:
        return ""
    said = [f"run {side} averages {' and '.join(map(str, s))} elements on its {len(s)} shares" if w != "alike" else
            f"run {side} {'one mean over' if len(s) == 1 else 'equal shares of'} {sum(s)} elements"
            for side, s, w in zip("AB", sizes, weighs)]
    return (f"{UNEQUAL_SHARES} of the batch ({said[0]}, {said[1]}): a data-parallel reduction averages the shares' "
            "gradients alike, which weighs the samples of unequal shares otherwise than the whole batch's mean")


def _mesh_pairs(side_a: tuple, side_b: tuple, tensors: bool, problems: list, reduction: str | None,
                stage: str = "forward") -> tuple[list, str]:
    """The pairs of one value where a run is a data-parallel x tensor-parallel mesh (each side:
    specs, records and parts by rank, its :class:`Mesh` or None, the other run's shape, its
    :class:`Weights`): every
    whole value of one run against every whole value of the other ([], why not)."""
    values = []
    for specs, records, parts, mesh, target, weights in (side_a, side_b):
        if mesh is None:
            v, why = assemble(specs, parts, tensors, problems, target, reduction, weights)
            got = [v] if v is not None else []
        else:
            got, why = assemble_on_mesh(specs, records, parts, mesh, tensors, problems, target, reduction, stage,
                                        weights)
        if not got:
            return [], why
        values.append(got)
    pairs = [(va, vb) for va in values[0] for vb in values[1] if math.prod(va.shape) == math.prod(vb.shape)]
    return pairs, "" if pairs else f"shapes {list(values[0][0].shape)} and {list(values[1][0].shape)}"


def batch_orders(fa: dict, fb: dict, keys: list, side_a: tuple, side_b: tuple, tensors: bool) -> tuple:
    """Whether each run's shares hold the batch's samples in turn (``DistributedSampler``: share k of
    N takes samples k, k+N, ...) rather than in blocks (``x[k * b:(k + 1) * b]``), learnt from the
    first forward value that one run's several shares make along the batch and the other run holds
    on one rank, laid both ways, that is more than 10 times closer to the other run's one way (a
    value whose rows are alike, a mask repeated per sample, tells nothing: the next is tried).  Data
    parallelism's result does not depend on the order of the batch's samples, so laying them as the
    program split them is no allowance for a difference.  (False, False) where nothing tells (no tensors saved: statistics do not depend on
    that order; equal ranks in both runs: paired rank with rank)."""
    if not tensors:
        return False, False
    (pa, mesh_a), (pb, mesh_b) = side_a, side_b
    tried = 0
    for key in keys:
        sa, sb = (next(((s_a, s_b) for arg, s_a, s_b in _outputs_on_every_rank(fa[key], fb[key])
                        if arg == "output.0"), (None, None)))
        if sa is None or (len(sa) == 1) == (len(sb) == 1):
            continue
        many = 0 if len(sa) > 1 else 1
        target = tuple(next(iter((sb, sa)[many].values()))["shape"])
        specs, records, parts, mesh = (sa, fa[key], pa, mesh_a) if many == 0 else (sb, fb[key], pb, mesh_b)
        single = (sb, pb) if many == 0 else (sa, pa)
        other, _ = assemble(single[0], single[1], True, [], None)
        errors = {}
        for interleaved in (False, True):
            w = Weights(interleaved=interleaved)
            if mesh is None:
                v, _ = assemble(specs, parts, True, [], target, None, w)
                got = [v] if v is not None else []
            else:
                got, _ = assemble_on_mesh(specs, records, parts, mesh, True, [], target, None, "forward", w)
            if len(got) != 1 or got[0].array is None or other is None or other.array is None or \
                    not got[0].how.startswith("concatenated") or got[0].array.size != other.array.size:
                break
            diff = np.asarray(got[0].array, np.float64).ravel() - np.asarray(other.array, np.float64).ravel()
            errors[interleaved] = float(np.linalg.norm(diff))
        if len(errors) < 2:
            continue
        tried += 1
        if errors[True] * 10 < errors[False] or errors[False] * 10 < errors[True]:
            turns = errors[True] < errors[False]
            return (turns, False) if many == 0 else (False, turns)
        if tried == _ORDER_TRIES:      # rows alike both ways (a mask repeated per sample), or apart both ways
            break
    return False, False


_ORDER_TRIES = 16     # values laid both ways before the shares are taken for blocks


def _model_backward(records: list) -> list:
    """The backward op records of the model: from the first backward record to the last (the
    optimizer's ops come after them)."""
    stages = [r.get("stage") for r in records]
    if "backward" not in stages:
        return []
    first, last = stages.index("backward"), len(stages) - 1 - stages[::-1].index("backward")
    return [r for r in records[first:last + 1] if r.get("kind") == "op" and r.get("stage") == "backward"]


def _backward(parts: dict) -> tuple[dict, list]:
    """key -> {rank: record} of the backward op records every rank holds, and the lowest rank's keys
    in order (as :func:`_forward`)."""
    by_rank = {r: _keyed(_model_backward(p.records)) for r, p in parts.items()}
    first = by_rank[min(parts)]
    return {n: {r: by_rank[r][n] for r in parts} for n in first if all(n in by_rank[r] for r in parts)}, list(first)


def share_sizes(parts: dict, mesh: Mesh | None) -> list | None:
    """The number of elements each share of the batch's loss averages, in data-parallel order
    (read from the loss's input on the share's lowest rank: 3 and 2 rows of a batch of 5 split
    over 2 ranks); None where a share's loss is not a full ``mean``, scaled by numbers or not
    (:func:`loss_mean`: its weight unknown)."""
    sizes = []
    for share in mesh.shares if mesh else [[r] for r in sorted(parts)]:
        records = parts[share[0]].records
        found = loss_mean(records)
        rec = next((r for r in records if r.get("name") == found.mean), None) if found else None
        count = mean_count(rec) if rec is not None else None
        if count is None:
            return None
        sizes.append(count)
    return sizes


def gradient_factors(parts: dict, mesh: Mesh | None) -> dict | None:
    """rank -> what a run's backward values computed from the loss's gradient are multiplied by to
    be the whole batch's: each share's loss a mean over its n of the batch's N elements, its
    gradient per element is N/n times the whole batch's mean's, so each rank's piece is taken
    n/N times (1/2 on 2 equal shares, 3/5 and 2/5 on shares of 3 and 2; 1 for one process);
    None where a share's loss is not such a mean (the scale unknown)."""
    shares = mesh.shares if mesh else [[r] for r in sorted(parts)]
    if len(shares) == 1:
        return {r: 1 for r in parts}
    sizes = share_sizes(parts, mesh)
    if sizes is None:
        return None
    return {r: n / sum(sizes) for share, n in zip(shares, sizes) for r in share}


def loss_mean_counts(parts: dict, forward: dict) -> dict:
    """key -> {rank: the elements the loss's mean averages there} of each forward op whose first
    output is the loss's full mean (:func:`loss_mean`, keys of :func:`_forward`), scaled by numbers
    or not: over the ranks its results are averaged as the mean's, weighed by those elements (a
    linear scaling keeps a weighed mean; a mean ``nll_loss`` averages the targets it counts)."""
    found = loss_mean(parts[min(parts)].records)
    if found is None:
        return {}
    keys = {recs[min(recs)]["name"]: key for key, recs in forward.items()}
    mean = keys.get(found.mean)
    if mean is None:
        return {}
    counts = {r: mean_count(rec) for r, rec in forward[mean].items()}
    return {keys[n]: counts for n in (found.mean, *found.scalings) if n in keys}


def losses_scaled_alike(pa: dict, pb: dict) -> bool:
    """Whether the two runs' losses scale their means by the same numbers (both ``loss / 2``), where
    both are such means: a gradient's scale across the runs then follows from the shares alone."""
    ma, mb = loss_mean(pa[min(pa)].records), loss_mean(pb[min(pb)].records)
    return ma is None or mb is None or ma.numbers == mb.numbers


def gradient_outputs(records: list, flow=None) -> set:
    """(record name, output arg) of the backward values computed from the loss's gradient: the
    outputs of the first backward op of the model (autograd starts at the loss, whose gradient it
    reads: the seed, expanded by a view no record shows), then of every backward op reading such
    an output.  Only these carry the loss's scale; a backward op on forward values alone
    (``pow(x, 1)`` of a square's gradient) does not."""
    forward, backward = _model_forward(records), _model_backward(records)
    ops = forward + backward
    flow = flow or data_flow(ops)
    first = next((i for i in range(len(forward), len(ops)) if not ops[i]["op"].startswith(COMMUNICATION)), None)
    out: set = set()
    for i in range(len(forward), len(ops)):
        sources = [flow.src.get(id(spec)) for io, _, spec in flow.walks[i] if io == "input"]
        if i == first or any(src is not None and (ops[src[0]]["name"], src[1]) in out for src in sources):
            out.update((ops[i]["name"], arg) for io, arg, _ in flow.walks[i] if io == "output")
    return out


class Feeds(NamedTuple):
    """What each backward op of a run reads: the pairing key of every model op record
    (:func:`_keyed`, forward and backward) and, per backward record, the records whose outputs it
    reads (:func:`~.pairing.data_flow`, kept for :func:`gradient_outputs`)."""

    keys: dict      # record index -> pairing key
    given: dict     # backward record name -> the indices of the records it reads outputs of
    reads: dict     # record index -> the indices of the records it reads outputs of
    flow: object    # the data flow of the model's forward and backward op records


def feeds(records: list) -> Feeds:
    """:class:`Feeds` of one rank's part."""
    forward, backward = _model_forward(records), _model_backward(records)
    ops = forward + backward
    flow = data_flow(ops)
    at = {id(rec): i for i, rec in enumerate(ops)}
    keys = {at[id(rec)]: key for part in (forward, backward) for key, rec in _keyed(part).items()}
    reads = {i: sorted({src[0] for io, _, spec in flow.walks[i] if io == "input"
                        and (src := flow.src.get(id(spec))) is not None}) for i in range(len(ops))}
    return Feeds(keys, {ops[i]["name"]: reads[i] for i in range(len(forward), len(ops))}, reads, flow)


def _sources(feeds_of: Feeds, name: str, shared: set) -> set:
    """The pairing keys of backward ops both runs hold whose outputs backward record ``name`` reads
    (the gradients it is given; the forward values it reads pair by the program's order), looking
    through collectives, FSDP's own ops and ops only its run has (DTensor's redistributions, a
    partial sum of a gradient's terms the other run adds in another order) to what they read."""
    out, seen = set(), set()
    todo = list(feeds_of.given.get(name, ()))
    while todo:
        i = todo.pop()
        if i in seen:
            continue
        seen.add(i)
        key = feeds_of.keys.get(i)
        if key is not None and key[1].endswith(".forward"):
            continue
        if key is not None and key in shared and not key[1].startswith(COMMUNICATION):
            out.add(key)
        else:
            todo.extend(feeds_of.reads.get(i, ()))
    return out


def fed_otherwise(feeds_a: Feeds, feeds_b: Feeds, name_a: str, name_b: str, shared: set) -> str:
    """Why two backward records paired by module, op and call cannot be compared: they read the
    results of other ops ("" where they read the same), among the pairing keys ``shared`` (both runs
    hold them, and those records were found to read the same).  autograd adds a value's gradient
    terms in the order they arrive, which parallelism changes (a tensor-parallel layer's input
    gradient arrives after its all-reduce), so the n-th ``add`` of a module may sum other terms."""
    sa, sb = _sources(feeds_a, name_a, shared), _sources(feeds_b, name_b, shared)
    if sa == sb:
        return ""
    def said(keys: set) -> str:
        return ", ".join(f"{k[1]} [{k[0] or '<root>'}]" for k in sorted(keys)) or "none"
    # each run's own reads, in the order of what they say: swapping the runs swaps only the labels
    reads = "; ".join(f"read by run {run} only: {what}" for what, run in sorted([(said(sa - sb), "A"),
                                                                                (said(sb - sa), "B")]))
    return (f"it reads the results of other ops in the two runs ({reads}): autograd sums a gradient's terms in the "
            "order they arrive, which the parallelism changes")


def carried(flow, specs: dict) -> str:
    """The lower precision the lowest rank's value (``specs``: rank -> spec) was computed from, where
    below its own dtype (:func:`~.pairing.data_flow`: a float32 value computed from bfloat16 values
    carries bfloat16's rounding); "" where none."""
    rank = flow.lineage.get(id(specs[min(specs)]))
    return V.PRECISIONS[rank] if rank is not None and rank >= 0 else ""


def computed_in(backward: dict, module: str, flow) -> str:
    """The lowest float precision the backward ops of ``module`` (a module path) compute in or from on
    the lowest rank (``backward``: key -> {rank: record}, :func:`_backward`; ``flow``: its part's
    :func:`~.pairing.data_flow`), where below float32: a parameter's float32 gradient made from a
    bfloat16 backward (autocast, FSDP2's ``MixedPrecisionPolicy``) carries bfloat16's rounding; ""
    where none."""
    ranks = [min(V.precision_rank(spec.get("dtype", "")), flow.lineage.get(id(spec), len(V.PRECISIONS)))
             for key, recs in backward.items() if key[0] == module for _, _, spec in walk(recs[min(recs)], inputs=False)]
    low = min((r for r in ranks if r >= 0), default=None)
    return V.PRECISIONS[low] if low is not None and low < V.precision_rank("float32") else ""


def _said_scaled(v: Value, factors: dict) -> Value:
    """``v`` (its pieces taken times ``factors``: :func:`gradient_factors`) with its ``how`` saying so."""
    parts = sorted(set(factors.values()))
    if set(parts) <= {1}:
        return v
    if len(parts) == 1:
        k = round(1 / parts[0])
        return replace(v, how=f"{v.how}, divided by {k} (a mean over each of {k} shares)")
    return replace(v, how=f"{v.how}, each share's piece times its part of the batch "
                          f"({', '.join(f'{factors[r]:.3g}' for r in sorted(factors))} by rank)")


def _backward_pairs(pa: dict, pb: dict, mesh_a: Mesh | None, mesh_b: Mesh | None, tensors: bool, problems: list,
                    fed: tuple, laid: tuple = (False, False)):
    """(key, arg, pairs, why not) of the backward ops both runs hold, paired by module, op and call
    index within the module as the forward ops, each value assembled as they are (a gradient of
    activations split as they are, a share's partial sum over tensor parallelism added up), each
    rank's piece of a value computed from the loss's gradient taken times its run's
    :func:`gradient_factors`.  A weight's gradient before its reduction over the data-parallel
    group is each share's own sum: not paired (the parameter gradients are)."""
    ka, kb = gradient_factors(pa, mesh_a), gradient_factors(pb, mesh_b)
    if not losses_scaled_alike(pa, pb):
        ka = kb = None
    (ba, order_a), (bb, order_b) = _backward(pa), _backward(pb)
    feeds_a, feeds_b = fed
    grads_a, grads_b = (gradient_outputs(p[min(p)].records, f.flow) for p, f in ((pa, feeds_a), (pb, feeds_b)))
    shared = set(feeds_a.keys.values()) & set(feeds_b.keys.values())
    for key in _in_both_orders(order_a, order_b, [n for n in order_a if n in ba and n in bb]):
        if key[1].startswith(COMMUNICATION):
            continue
        rec_a, rec_b = ba[key], bb[key]
        otherwise = fed_otherwise(feeds_a, feeds_b, rec_a[min(rec_a)]["name"], rec_b[min(rec_b)]["name"], shared)
        if otherwise:       # what reads its result reads other values too: looked through
            shared.discard(key)
        for arg, sa, sb in _outputs_on_every_rank(rec_a, rec_b):
            if otherwise:
                yield key, arg, [], otherwise
                continue
            seeded = {(rec_a[min(rec_a)]["name"], arg) in grads_a, (rec_b[min(rec_b)]["name"], arg) in grads_b}
            if seeded == {True} and all(spec.get("shape") == [] for spec in (*sa.values(), *sb.values())) and \
                    ka is not None and kb is not None:
                # the gradient of a 0-dim value between the loss and its mean (``loss / 2``'s backward):
                # each share's loss scales its mean as the whole batch's does, so no share's part scales it.
                # Only where both runs scale their losses alike: transformers' Trainer multiplies a
                # data-parallel loss by the world size (1 in one process), a gradient 2 against 1 by design
                seeded = {False}
            if len(seeded) > 1:
                yield key, arg, [], "computed from the loss's gradient in one run only"
                continue
            if seeded == {True} and (ka is None or kb is None):
                yield key, arg, [], ("the loss is not a mean over each share of the batch: the scale of its "
                                     "gradients across the runs is unknown")
                continue
            wa, wb = (Weights(factors=ka), Weights(factors=kb)) if seeded == {True} else (ALIKE, ALIKE)
            wa, wb = wa._replace(interleaved=laid[0]), wb._replace(interleaved=laid[1])
            pairs, why = rank_by_rank(sa, sb, pa, pb, tensors, problems, None, (wa, wb))
            if not pairs and not why:
                tb = tuple(sb[min(sb)]["shape"]) if len(sb) == 1 else None
                ta = tuple(sa[min(sa)]["shape"]) if len(sa) == 1 else None
                pairs, why = _mesh_pairs((sa, rec_a, pa, mesh_a, tb, wa), (sb, rec_b, pb, mesh_b, ta, wb), tensors,
                                         problems, None, "backward")
            ca, cb = carried(feeds_a.flow, sa), carried(feeds_b.flow, sb)
            yield key, arg, [(_said_scaled(replace(va, carries=ca), wa.factors or {}),
                              _said_scaled(replace(vb, carries=cb), wb.factors or {})) for va, vb in pairs], why


def _in_both_orders(order_a: list, order_b: list, items: list) -> list:
    """``items`` in the two runs' orders together (by the sum of their positions, one run's alone
    for what only it holds; ties by name): the rows, and so the first that errs, come in one order
    whichever run is A."""
    pos_a, pos_b = {x: k for k, x in enumerate(order_a)}, {x: k for k, x in enumerate(order_b)}
    def key(x):
        at = [p[x] for p in (pos_a, pos_b) if x in p]
        return sum(at) * 2 // len(at), str(x)
    return sorted(items, key=key)


def _index(parts: dict, name: str) -> int:
    recs = parts[min(parts)].records
    return next(i for i, r in enumerate(recs) if r["name"] == name)


class OptimizerStep(NamedTuple):
    """What the parameter records say of a step's optimizer step (:func:`optimizer_step`)."""

    said: str = ""                    # the first parameter that differs after it, and its gradient
    gradient_agrees: bool | None = None     # None: no gradient recorded for it
    made_by: tuple = (None, None)     # per run: the backward op record whose output is that gradient


def made_by(part, spec: dict | None) -> str | None:
    """The name of the last backward op record of ``part`` with an output of ``spec``'s dtype, size
    and statistics (statistics of equal values are equal; a view, not recorded, may reshape it):
    the record that made a gradient."""
    stats = (spec or {}).get("stats")
    if not stats or spec.get("shape") is None:
        return None
    size, dtype = math.prod(spec["shape"]), spec.get("dtype")
    found = None
    for rec in part.records:
        if rec.get("kind") == "op" and rec.get("stage") == "backward" and any(
                o.get("stats") == stats and o.get("dtype") == dtype and math.prod(o.get("shape") or [0]) == size
                for o in rec.get("outputs") or () if isinstance(o, dict) and o.get("shape") is not None):
            found = rec.get("name")
    return found


def optimizer_step(run_a, run_b, step: int, rank: int, tensors: bool = True) -> OptimizerStep:
    """Two runs of the same parallelism whose op records of ``step`` agree but whose next step's
    inputs differ: the first parameter whose value after that step's optimizer step differs,
    whether its gradient as the optimizer applied it agreed, and which record made that gradient in
    each run (an empty :class:`OptimizerStep` without parameter records or difference)."""
    pa, pb = run_a.parts.get((step, rank)), run_b.parts.get((step, rank))
    if pa is None or pb is None:
        return OptimizerStep()
    qa, qb = param_specs({rank: pa}), param_specs({rank: pb})
    problems: list = []
    for key in [k for k in qa if k[0] == "value" and k in qb]:
        va, _ = assemble(qa[key], {rank: pa}, tensors, problems)
        vb, _ = assemble(qb[key], {rank: pb}, tensors, problems)
        if va is None or vb is None or va.shape != vb.shape:
            continue
        got = score(va, vb)
        if got["status"] == V.PASS:
            continue
        grad = ("grad", key[1], key[2])
        how, agrees, made = "", None, (None, None)
        if grad in qa and grad in qb:
            ga, _ = assemble(qa[grad], {rank: pa}, tensors, problems)
            gb, _ = assemble(qb[grad], {rank: pb}, tensors, problems)
            if ga is not None and gb is not None and ga.shape == gb.shape:
                g = score(*gradients_alike(ga, gb, pa, pb))     # a run scaling its loss: at one scale
                agrees = g["status"] == V.PASS
                how = " while its gradient as the optimizer applied it agrees" if agrees else \
                    f"; its gradient as the optimizer applied it differs too ({g['reason']})"
                made = (made_by(pa, qa[grad].get(rank)), made_by(pb, qb[grad].get(rank)))
        return OptimizerStep(f"parameter {key[1]} differs after it ({got['reason']}){how}", agrees, made)
    return OptimizerStep()


def _outputs_on_every_rank(rec_a: dict, rec_b: dict):
    """``(arg, {rank: spec} of run A, of run B)`` per output of one op's records (rank -> record in
    each run) that every rank of both runs recorded with values (statistics or a saved tensor)."""
    walks_a = {r: {arg: s for _, arg, s in walk(rec, inputs=False)} for r, rec in rec_a.items()}
    walks_b = {r: {arg: s for _, arg, s in walk(rec, inputs=False)} for r, rec in rec_b.items()}
    for arg in walks_a[min(walks_a)]:
        sa = {r: w[arg] for r, w in walks_a.items() if arg in w}
        sb = {r: w[arg] for r, w in walks_b.items() if arg in w}
        if len(sa) == len(walks_a) and len(sb) == len(walks_b) and all(
                "stats" in x or "data" in x for x in (*sa.values(), *sb.values())):
            yield arg, sa, sb
