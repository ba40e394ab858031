"""Replicas: values that must be equal on a set of ranks, and the first op where one drifts.

The rule (docs/distributed.md): every value has the set of ranks that must hold it equal, from
the process groups the records name (:mod:`.groups`), never assumed to be every rank:
- parameters as ops receive them (``param: true``: DDP's replicas, FSDP2's all-gathered
  parameters; never a DTensor's local shard): the rank's replicas (the ranks joined by its
  data-parallel groups), parameters after the optimizer step included;
- the parameter records (``params.jsonl``): each gradient as the optimizer applies it (after its
  reduction) and each parameter after the step: a whole tensor on the rank's replicas, a
  DTensor's local shard on the ranks that hold the same shard (by its placements and mesh),
  placed after the step's last backward op;
- the results of all-reduce, all-gather and broadcast: the ranks of the collective's group
  (checked against their semantics by :mod:`.collectives`);
- what an op computes from such values only, with the same number arguments and not a random
  op: the ranks that hold every one of its tensor inputs (made by the same record and argument
  on each of them).
Ops join across ranks by record name (op, call index, stage).  An op whose replicated inputs
meet number arguments that differ by rank (a scale that depends on the rank) computes no replica;
it is named as a suspect when a replica drifts after it.  Once a value drifts, what is computed
from it is not compared again."""

from __future__ import annotations

from typing import NamedTuple

from ...core.op_traits import is_random
from ...records.format import walk
from ..compare.pairing import data_flow
from .groups import group_of, shard_holders
from .values import Values, classes, difference, judged, same_arrays, same_stats, stats_difference, stats_of

REPLICATING = ("all_reduce", "all_gather", "broadcast")
_NUMBERS = ("int", "float", "bool", "complex", "str")


class Drift(NamedTuple):
    index: int              # the record on the reference rank
    record: dict
    arg: str
    ranks: list             # the ranks whose value differs from the reference
    reference: int
    what: str               # "parameter", "computed from replicas", ...
    detail: str
    size: float
    context: str            # the collective before it, suspects
    group: list = []        # the ranks that must hold the value equal


class _Claim(NamedTuple):
    """One rank's claim that a value must be equal on ``members`` (compared once every member
    claims the same)."""

    key: tuple              # (record name, "input"/"output"/"param", arg, members)
    index: int
    record: dict
    arg: str
    spec: dict
    what: str
    deps: tuple             # keys of the claims this value was computed from
    context: tuple          # (the last collective before it, suspects)


def _numbers(record: dict) -> list:
    return [(arg, spec.get("value")) for _, arg, spec in walk(record, outputs=False, tensors_only=False)
            if spec.get("type") in _NUMBERS]


class _Rank:
    def __init__(self, rank: int, records: list):
        self.rank = rank
        self.records = records
        self.flow = data_flow(records)
        self.by_name = {r["name"]: i for i, r in enumerate(records) if r.get("kind") == "op"}
        self._sources: dict = {}

    def sources(self, i: int) -> tuple:
        """Per tensor input of record ``i``: "param", (name, arg) of the record that made it,
        "0-d" (a number given as a tensor) or None (data of this rank)."""
        hit = self._sources.get(i)
        if hit is None:
            out = []
            for io, _, spec in self.flow.walks[i]:
                if io != "input":
                    continue
                src = self.flow.src.get(id(spec))
                out.append("param" if spec.get("param") else
                           (self.records[src[0]]["name"], src[1]) if src is not None else
                           "0-d" if spec.get("shape") == [] else None)
            hit = self._sources[i] = tuple(out)
        return hit

    def same_call(self, i: int, other: "_Rank") -> bool:
        """Whether ``other`` ran record ``i``'s op on the same sources."""
        j = other.by_name.get(self.records[i]["name"])
        return j is not None and len(other.flow.walks[j]) == len(self.flow.walks[i]) and \
            other.sources(j) == self.sources(i)


def find_drifts(ranks: dict[int, list], values: Values, params: dict[int, list] | None = None,
                replicas: dict[int, frozenset] | None = None, limit: int = 20,
                peers: dict[int, frozenset] | None = None) -> tuple[list[Drift], int, int]:
    """The replica drifts among ``ranks`` (rank -> its records of one step; ``params``: rank -> its
    parameter records; ``replicas``: rank -> the ranks holding its parameters, :func:`.groups.replicas`;
    ``peers``: rank -> the ranks computing on its share of the batch, its tensor-parallel group),
    in record order, how many replicated values were compared, and how many ops a rank ran on
    other pieces than its tensor-parallel peers (the most on any rank): not judged across ranks; and
    the first of those (the lowest such rank's, in record order) as (rank, record), or None."""
    present = frozenset(ranks)
    state = {r: _Rank(r, ranks[r]) for r in sorted(ranks)}
    replicas = {r: s & present for r, s in (replicas or {}).items()}
    claims, apart, first_apart = {}, 0, None
    for r in state:
        by_peers, unequal = _peer_claims(state[r], state, (peers or {}).get(r, frozenset()) & present, values)
        claims[r] = _claims(state[r], state, replicas.get(r, frozenset()), (params or {}).get(r) or [], present) \
            + by_peers
        apart = max(apart, len(unequal))
        if unequal and first_apart is None:
            first_apart = (r, state[r].records[unequal[0]])
    holders: dict = {}
    for r, mine in claims.items():
        for c in mine:
            holders.setdefault(c.key, {})[r] = c
    checked: dict = {}
    tainted: set = set()
    drifts: list[Drift] = []
    compared = 0
    for r in sorted(claims):         # the lowest member first: what a value was computed from comes first
        for c in claims[r]:
            members = c.key[3]
            if r != min(members) or set(holders[c.key]) != members:
                continue
            if any(d in tainted for d in c.deps):
                tainted.add(c.key)
                continue
            compared += 1
            found = _compare({m: holders[c.key][m].spec for m in members}, values, checked, sorted(members))
            if found:
                tainted.add(c.key)
                drifts.append(_drift(c, found, sorted(members)))
    return sorted(drifts, key=lambda d: d.index)[:limit], compared, apart, first_apart


def _claims(me: _Rank, state: dict, mine: frozenset, params: list, present: frozenset) -> list[_Claim]:
    """One rank's claims, in its record order: which of its values must be equal on which ranks."""
    rank = me.rank
    alone = frozenset((rank,))
    backward = [i for i, r in enumerate(me.records) if r.get("stage") == "backward"]
    optimizer_at = backward[-1] + 1 if backward else len(me.records)   # the parameter records' place
    at_optimizer = None
    held: dict = {}                  # (record name, output arg) -> the ranks holding it equal
    out: list[_Claim] = []
    suspects: list[str] = []
    last_collective = ""
    for i, rec in enumerate(me.records):
        if at_optimizer is None and i >= optimizer_at:
            at_optimizer = (last_collective, list(suspects))
        if rec.get("kind") != "op":
            continue
        walks = me.flow.walks[i]
        context = (last_collective, list(suspects))
        sets, deps = [], []
        for (io, arg, spec), src in zip([w for w in walks if w[0] == "input"], me.sources(i)):
            if src == "param" and len(mine) > 1:
                key = (rec["name"], "input", arg, mine)
                out.append(_Claim(key, i, rec, arg, spec, "parameter", (), context))
                sets.append(mine)
                deps.append(key)
            elif isinstance(src, tuple) and src in held:
                sets.append(held[src])
                deps.append((src[0], "output", src[1], held[src]))
            elif src != "0-d":       # a 0-d constant is a number argument
                sets.append(alone)
        info = rec.get("collective") or {}
        if info:
            group = group_of(rec) & present
            if info.get("kind") in REPLICATING and rank in group and len(group) > 1:
                held.update(((rec["name"], arg), group) for io, arg, _ in walks if io == "output")
            last_collective = (f"{rec['op']} #{info.get('seq')} on group {info.get('group')} "
                               f"[{rec.get('scope') or '<top>'}]")
            suspects = []
            continue
        on = frozenset.intersection(*sets) if sets and not is_random(rec["op"]) else alone
        if len(on) > 1:
            same = {r for r in on if r == rank or me.same_call(i, state[r])}
            numbers = {r: _numbers(state[r].records[state[r].by_name[rec["name"]]]) for r in same}
            agree = frozenset(r for r in same if repr(numbers[r]) == repr(numbers[rank]))
            if agree != same:
                shown = "; ".join(f"rank {r}: " + ", ".join(f"{a}={v}" for a, v in numbers[r]) for r in sorted(same))
                suspects.append(f"{rec['op']} [{rec.get('scope') or '<top>'}] ({rec.get('stage')}) ran on "
                                f"replicated values with number arguments that differ by rank ({shown})")
            on = agree
        for io, arg, spec in walks:
            if io != "output":
                continue
            if spec.get("param") and len(mine) > 1:
                out.append(_Claim((rec["name"], "output", arg, mine), i, rec, arg, spec, "parameter", tuple(deps),
                                  context))
            elif len(on) > 1:
                held[rec["name"], arg] = on
                out.append(_Claim((rec["name"], "output", arg, on), i, rec, arg, spec, "computed from replicas only",
                                  tuple(deps), context))
    context = at_optimizer or (last_collective, suspects)
    for rec in params:
        spec = (rec.get("outputs") or [None])[0]
        if not spec:
            continue
        on = shard_holders(spec["dtensor"], rank) & present if "dtensor" in spec else mine
        if len(on) < 2:
            continue
        grad = rec["op"] == "param.grad"
        out.append(_Claim((rec["name"], "param", "", on), optimizer_at if grad else len(me.records), rec,
                          rec["scope"], spec, "gradient (as the optimizer applies it)" if grad else
                          "parameter after the step", (), context))
    return out


def _peer_claims(me: _Rank, state: dict, peers: frozenset, values: Values) -> list[_Claim]:
    """Tensor-parallel peers hold different pieces of the layers' weights, so no value of theirs is
    a replica by rule; but an op they run on equal tensor inputs with the same number arguments
    must give equal outputs (a wrong kernel on one of them is a drift).  One claim per output of
    each such op, on the ranks whose inputs equal this rank's (an equivalence: every member of
    the set computes the same set); random ops and collectives are left out.  Also returns the ops
    (record indices) that ran on inputs no peer shares (column shards, partial sums): no other rank
    holds their values, so nothing here judges them."""
    if len(peers) < 2:
        return [], []
    out, unequal, last_collective = [], [], ""
    for i, rec in enumerate(me.records):
        if rec.get("kind") != "op" or is_random(rec["op"]):
            continue
        if rec.get("collective"):
            info = rec["collective"]
            last_collective = (f"{rec['op']} #{info.get('seq')} on group {info.get('group')} "
                               f"[{rec.get('scope') or '<top>'}]")
            continue
        given = [spec for io, _, spec in me.flow.walks[i] if io == "input"]
        on = frozenset(r for r in peers if r == me.rank or _given_alike(me, i, given, state[r], values))
        if len(on) < 2:
            unequal.append(i)
            continue
        out += [_Claim((rec["name"], "output", arg, on), i, rec, arg, spec,
                       "computed by tensor-parallel peers from equal inputs", (), (last_collective, []))
                for io, arg, spec in me.flow.walks[i] if io == "output"]
    return out, unequal


def _given_alike(me: _Rank, i: int, given: list, other: _Rank, values: Values) -> bool:
    """Whether ``other`` ran record ``i``'s op with the same number arguments on tensor inputs equal
    to this rank's (statistics first: equal values share them, so differing ones settle it without
    reading a tensor; then bytes where saved)."""
    j = other.by_name.get(me.records[i]["name"])
    if j is None or repr(_numbers(other.records[j])) != repr(_numbers(me.records[i])):
        return False
    theirs = [spec for io, _, spec in other.flow.walks[j] if io == "input"]
    if len(theirs) != len(given):
        return False
    for mine, spec in zip(given, theirs):
        if not (judged(mine) and judged(spec)) or mine.get("shape") != spec.get("shape") or \
                mine.get("dtype") != spec.get("dtype"):
            return False
        if mine.get("stats") and spec.get("stats") and not same_stats(stats_of(mine), stats_of(spec)):
            return False
        a, b = values.array(me.rank, mine), values.array(other.rank, spec)
        if not (same_arrays(a, b) if a is not None and b is not None else same_stats(stats_of(mine), stats_of(spec))):
            return False
    return True


def _drift(claim: _Claim, found, group: list) -> Drift:
    ranks, reference, detail, size = found
    last_collective, suspects = claim.context
    context = (f"the last collective before it: {last_collective}" if last_collective
               else "before any collective of this step")
    if suspects:
        context += "; then " + "; ".join(suspects[-3:])
    return Drift(claim.index, claim.record, claim.arg, ranks, reference, claim.what, detail, size, context, group)


def _compare(specs: dict, values: Values, checked: dict, members: list):
    """None when the ranks' values agree (or cannot be judged), else (ranks that differ, the
    reference rank, how, size)."""
    if not all(judged(s) for s in specs.values()):
        return None
    arrays = {r: values.array(r, s) for r, s in specs.items()}
    key = (tuple(members), tuple((s.get("data"), repr(s.get("stats"))) for s in specs.values()))
    if key in checked:
        return checked[key]
    out = None
    if all(a is not None for a in arrays.values()):
        groups = classes(members, lambda x, y: same_arrays(arrays[x], arrays[y]))
        if len(groups) > 1:
            ref = groups[0][0]
            off = [r for g in groups[1:] for r in g]
            a, b = arrays[off[0]], arrays[ref]
            same_shape = a.shape == b.shape and a.size
            out = (off, ref, difference(a, b) if a.shape == b.shape else f"shape {a.shape} vs {b.shape}",
                   float(abs(a.astype(float) - b.astype(float)).max()) if same_shape else float("nan"))
    else:
        st = {r: stats_of(s) for r, s in specs.items()}
        groups = classes(members, lambda x, y: same_stats(st[x], st[y]))
        if len(groups) > 1:
            ref = groups[0][0]
            off = [r for g in groups[1:] for r in g]
            size = stats_difference(st[off[0]], st[ref])
            out = (off, ref, f"statistics differ (relative difference {size:.3g}: mean {st[off[0]]['mean']:.6g} vs "
                             f"{st[ref]['mean']:.6g}, norm {st[off[0]]['norm']:.6g} vs {st[ref]['norm']:.6g})", size)
    checked[key] = out
    return out
