"""Each collective call, joined across the ranks of its group by (group, seq), against what it must
do: the same call on every rank (collective, shapes, dtypes, reduce op, root), then its values --
all-reduce: equal results on every rank, equal to the reduction of the inputs; all-gather: equal
results, the inputs laid side by side in group order; reduce-scatter: each rank's result the
shard of the reduced inputs; broadcast: every result equal to the root's input.  With saved
tensors equality is exact and reductions are judged as run-ut judges a sum; from statistics,
equal values have equal statistics and reductions are judged within the statistics limits."""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import numpy as np

from ...core.collective_roles import role
from ...records.format import walk
from ...standards import verdicts as V
from .values import (Values, classes, difference, judge_reduction, judge_relation, judged, same_arrays, same_stats,
                     stats_of)

SEMANTIC = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


class Call(NamedTuple):
    """One rank's record of a collective."""

    rank: int
    index: int              # the record's position in the rank's part
    record: dict
    members: list           # the group's global ranks
    given: list             # tensor specs the rank gave
    result: list            # tensor specs it got back


def calls_of(rank: int, records: list) -> dict:
    """(group, seq) -> :class:`Call` for one rank's numbered collectives."""
    out = {}
    for i, r in enumerate(records):
        info = r.get("collective")
        if not info or "seq" not in info:
            continue
        ro = role(r["op"])
        tensors = walk(r)
        group = next((v for v in r.get("inputs", ()) if v.get("type") == "process_group"), {})
        out[info.get("group"), info["seq"]] = Call(
            rank, i, r, group.get("ranks") or [],
            _under(tensors, ro.given if ro else None, "input"), _under(tensors, ro.result if ro else None, "output"))
    return out


def _under(tensors, prefix, io):
    if prefix is None:
        return []
    return [spec for kind, arg, spec in tensors if kind == io and (arg == prefix or arg.startswith(prefix + "."))]


def _signature(call: Call) -> tuple:
    info = call.record["collective"]
    return (call.record["op"], info.get("reduce_op"), info.get("root"),
            tuple((s["dtype"], tuple(s["shape"])) for s in call.given),
            tuple((s["dtype"], tuple(s["shape"])) for s in call.result))


def _describe(sig: tuple) -> str:
    op, red, root, given, result = sig
    extra = (f" {red}" if red else "") + (f" root {root}" if root is not None else "")
    shapes = ", ".join(f"{d}{list(s)}" for d, s in given or result)
    return f"{op}{extra} ({shapes})"


class Finding(NamedTuple):
    status: str             # V.PASS, V.ERROR, V.SKIP (not judged)
    ranks: list             # the ranks named
    detail: str
    size: float = float("nan")


def check_call(calls: list[Call], values: Values) -> Finding:
    """The verdict on one collective call, given every participating rank's record of it."""
    calls = sorted(calls, key=lambda c: c.members.index(c.rank) if c.rank in c.members else c.rank)
    sigs = [_signature(c) for c in calls]
    top = Counter(sigs).most_common(2)
    common = top[0][0] if len(top) > 1 and top[0][1] > top[1][1] else sigs[0]    # a tie: group index 0's
    odd = [c.rank for c, s in zip(calls, sigs) if s != common]
    if odd:
        other = next(s for s in sigs if s != common)
        return Finding(V.ERROR, odd, f"rank {odd[0]} calls {_describe(other)} where rank "
                                     f"{calls[sigs.index(common)].rank} calls {_describe(common)}")
    kind = calls[0].record["collective"].get("kind")
    if kind not in SEMANTIC:
        return Finding(V.PASS, [], f"{kind}: the same call on every rank (values not checked)")
    if not all(judged(s) for c in calls for s in (c.result if kind == "broadcast" else c.given + c.result)):
        return Finding(V.SKIP, [], "values not recorded (uninitialised or unreadable memory)")
    if (kind == "all_gather" and any(len(c.given) != 1 for c in calls)) or \
            (kind == "reduce_scatter" and any(len(c.result) != 1 for c in calls)):
        return Finding(V.PASS, [], f"{kind} of several tensors at once: the same call on every rank (values not "
                                   "checked)")
    if len({len(c.members) for c in calls}) != 1 or len(calls) < len(calls[0].members):
        missing = sorted(set(calls[0].members) - {c.rank for c in calls})
        return Finding(V.SKIP, missing, f"rank {', '.join(map(str, missing))} did not record this call: not judged")
    return _CHECKS[kind](calls, values)


def _arrays(calls, values, attr) -> list | None:
    """Per rank, its ``given``/``result`` tensors flattened and joined, or None without saved tensors."""
    out = []
    for c in calls:
        parts = [values.array(c.rank, s) for s in getattr(c, attr)]
        if not parts or any(p is None for p in parts):
            return None
        out.append(np.concatenate(parts) if len(parts) > 1 else parts[0])
    return out


def _stats(calls, attr) -> list | None:
    """Per rank, the statistics of its single ``given``/``result`` tensor (None for lists of them)."""
    if any(len(getattr(c, attr)) != 1 for c in calls):
        return None
    return [stats_of(getattr(c, attr)[0]) for c in calls]


def _equal_results(calls, values) -> Finding | None:
    """Every rank's result equal; a Finding naming the ranks outside the largest group of equal
    results (on a tie, the group of the group's first rank)."""
    arrays = _arrays(calls, values, "result")
    stats = _stats(calls, "result") if arrays is None else None
    if arrays is None and stats is None:
        return None
    same = (lambda i, j: same_arrays(arrays[i], arrays[j])) if arrays is not None else \
        (lambda i, j: same_stats(stats[i], stats[j]))
    groups = classes(range(len(calls)), same)
    if len(groups) == 1:
        return None
    ref, off = groups[0][0], [k for g in groups[1:] for k in g]
    how = difference(arrays[off[0]], arrays[ref]) if arrays is not None else "their statistics differ"
    return Finding(V.ERROR, [calls[k].rank for k in off],
                   f"results differ across ranks: rank {calls[off[0]].rank} vs rank {calls[ref].rank}: {how}")


_REDUCE = {"SUM": np.sum, "AVG": np.mean, "MAX": np.max, "MIN": np.min, "PRODUCT": np.prod}


def _reduced(calls, values):
    """(float64 reduction of the ranks' inputs, its terms' magnitudes), or None."""
    given = _arrays(calls, values, "given")
    op = _REDUCE.get(calls[0].record["collective"].get("reduce_op") or "")
    if given is None or op is None or len({g.size for g in given}) != 1:
        return None
    stack = np.stack([g.astype(np.float64) for g in given])
    with np.errstate(all="ignore"):
        return op(stack, axis=0), np.abs(stack).sum(axis=0)


def _reduction_by_stats(calls, dtype) -> Finding | None:
    """A reduction checked from statistics: the mean of a sum is the sum of the means (avg: their
    mean), a max the largest max, a min the smallest min."""
    given, result = _stats(calls, "given"), _stats(calls, "result")
    red = calls[0].record["collective"].get("reduce_op")
    if given is None or result is None or any(s["nan"] or s["inf"] for s in given):
        return Finding(V.SKIP, [], "the reduction is not checked from these statistics")
    scale = sum(max(abs(s["max"]), abs(s["min"])) for s in given)
    key, expected = {"SUM": ("mean", sum(s["mean"] for s in given)),
                     "AVG": ("mean", sum(s["mean"] for s in given) / len(given)),
                     "MAX": ("max", max(s["max"] for s in given)),
                     "MIN": ("min", min(s["min"] for s in given))}.get(red, (None, None))
    if key is None:
        return Finding(V.SKIP, [], f"{red}: the reduction is not checked from statistics")
    for c, s in zip(calls, result):
        verdict, err = judge_relation(s[key], expected, scale, dtype)
        if verdict == V.ERROR:
            return Finding(V.ERROR, [c.rank], f"rank {c.rank}'s result is not the {red} of the inputs: its {key} "
                                              f"{s[key]:.6g}, the inputs' give {expected:.6g}", err)
    return None


def _all_reduce(calls, values) -> Finding:
    differ = _equal_results(calls, values)
    if differ:
        return differ
    dtype = calls[0].result[0]["dtype"]
    reduced = _reduced(calls, values)
    results = _arrays(calls, values, "result")
    if reduced is None or results is None:
        return _reduction_by_stats(calls, dtype) or Finding(V.PASS, [], "equal on every rank, the reduction of the "
                                                                         "inputs")
    expected, terms = reduced
    for c, res in zip(calls, results):
        verdict, reason = judge_reduction(res, expected, terms, dtype)
        if verdict == V.ERROR:
            return Finding(V.ERROR, [c.rank], f"rank {c.rank}'s result is not the "
                                              f"{c.record['collective'].get('reduce_op')} of the inputs: {reason}")
    return Finding(V.PASS, [], "equal on every rank, the reduction of the inputs")


def _all_gather(calls, values) -> Finding:
    differ = _equal_results(calls, values)
    if differ:
        return differ
    given, results = _arrays(calls, values, "given"), _arrays(calls, values, "result")
    if given is not None and results is not None:
        whole = np.concatenate(given)
        for c, res in zip(calls, results):
            if not same_arrays(res, whole.astype(res.dtype, copy=False)):
                return Finding(V.ERROR, [c.rank], f"rank {c.rank}'s result is not the inputs side by side: "
                                                  + difference(res, whole))
        return Finding(V.PASS, [], "equal on every rank, the inputs side by side")
    g, r = _stats(calls, "given"), _stats(calls, "result")
    if g is None or r is None:
        return Finding(V.PASS, [], "equal on every rank")
    dtype = calls[0].result[0]["dtype"]
    sizes = [int(np.prod(c.given[0]["shape"])) for c in calls]
    scale = max(max(abs(s["max"]), abs(s["min"])) for s in g)
    for c, s in zip(calls, r):
        for key, expected in (("max", max(x["max"] for x in g)), ("min", min(x["min"] for x in g)),
                              ("mean", sum(x["mean"] * n for x, n in zip(g, sizes)) / max(sum(sizes), 1))):
            verdict, err = judge_relation(s[key], expected, scale, dtype)
            if verdict == V.ERROR:
                return Finding(V.ERROR, [c.rank], f"rank {c.rank}'s result is not the inputs side by side: its {key} "
                                                  f"{s[key]:.6g}, the inputs' give {expected:.6g}", err)
    return Finding(V.PASS, [], "equal on every rank, the inputs side by side")


def _reduce_scatter(calls, values) -> Finding:
    reduced = _reduced(calls, values)
    results = _arrays(calls, values, "result")
    dtype = calls[0].result[0]["dtype"]
    red = calls[0].record["collective"].get("reduce_op")
    if reduced is not None and results is not None:
        expected, terms = reduced
        n = len(calls)
        if expected.size != sum(r.size for r in results) or expected.size % n:
            return Finding(V.SKIP, [], "shard sizes do not divide the input: not judged")
        m = expected.size // n
        for i, (c, res) in enumerate(zip(calls, results)):
            verdict, reason = judge_reduction(res, expected[i * m:(i + 1) * m], terms[i * m:(i + 1) * m], dtype)
            if verdict == V.ERROR:
                return Finding(V.ERROR, [c.rank], f"rank {c.rank}'s result is not its shard of the {red} of the "
                                                  f"inputs: {reason}")
        return Finding(V.PASS, [], "each rank's result its shard of the reduction of the inputs")
    g, r = _stats(calls, "given"), _stats(calls, "result")
    if g is None or r is None or red not in ("SUM", "AVG") or any(s["nan"] or s["inf"] for s in g):
        return Finding(V.SKIP, [], "the reduction is not checked from these statistics")
    n_in = [int(np.prod(c.given[0]["shape"])) for c in calls]
    n_out = [int(np.prod(c.result[0]["shape"])) for c in calls]
    total_in = sum(s["mean"] * k for s, k in zip(g, n_in)) / (len(calls) if red == "AVG" else 1)
    total_out = sum(s["mean"] * k for s, k in zip(r, n_out))
    scale = sum(max(abs(s["max"]), abs(s["min"])) * k for s, k in zip(g, n_in))
    verdict, err = judge_relation(total_out, total_in, scale, dtype)
    if verdict == V.ERROR:
        return Finding(V.ERROR, [c.rank for c in calls], f"the shards' total {total_out:.6g} is not the {red} of the "
                                                         f"inputs' totals {total_in:.6g}", err)
    return Finding(V.PASS, [], "the shards' total is the reduction of the inputs' totals")


def _broadcast(calls, values) -> Finding:
    root = calls[0].record["collective"].get("root", 0)
    members = calls[0].members
    src = next((c for c in calls if members and c.rank == members[root]), None)
    if src is None:
        return Finding(V.SKIP, [], "the root's record is missing: not judged")
    if not src.given or not judged(src.given[0]):
        return Finding(V.SKIP, [], "the root's input was not recorded")
    arrays = _arrays(calls, values, "result")
    given = values.array(src.rank, src.given[0]) if len(src.given) == 1 else None
    for i, c in enumerate(calls):
        if arrays is not None and given is not None:
            if not same_arrays(arrays[i], given):
                return Finding(V.ERROR, [c.rank], f"rank {c.rank}'s result is not root rank {src.rank}'s input: "
                                                  + difference(arrays[i], given))
        elif len(c.result) == 1 and not same_stats(stats_of(c.result[0]), stats_of(src.given[0])):
            return Finding(V.ERROR, [c.rank], f"rank {c.rank}'s result is not root rank {src.rank}'s input "
                                              "(statistics differ)")
    return Finding(V.PASS, [], f"every rank holds root rank {src.rank}'s input")


_CHECKS = {"all_reduce": _all_reduce, "all_gather": _all_gather, "reduce_scatter": _reduce_scatter,
           "broadcast": _broadcast}
