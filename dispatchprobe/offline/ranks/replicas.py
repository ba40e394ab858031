"""Replicas: values that must be equal on every rank of a data-parallel group, and the first op
where one drifts.

The rule (docs/distributed.md): the data-parallel group of a rank is the union of the groups its
gradients were reduced over (backward all-reduces and reduce-scatters with SUM or AVG: DDP's
buckets, FSDP2's reduce-scatters).  Across that group these are replicated:
- parameters as ops receive them (``param: true``: DDP's replicas, FSDP2's all-gathered
  parameters; never a DTensor's local shard), parameters after the optimizer step included;
- the parameter records (``params.jsonl``): each gradient as the optimizer applies it (after its
  reduction) and each parameter after the step, where they are whole tensors (not DTensor
  shards), placed after the step's last backward op;
- the results of all-reduce, all-gather and broadcast (checked against their semantics by
  :mod:`.collectives`);
- what an op computes from replicated values only: every tensor input replicated (the same
  producing record and argument on every rank), the same number arguments, not a random op.
Ops join across ranks by record name (op, call index, stage).  An op whose replicated inputs
meet number arguments that differ by rank (a scale that depends on the rank) computes no replica;
it is named as a suspect when a replica drifts after it."""

from __future__ import annotations

from typing import NamedTuple

from ...core.op_traits import is_random
from ...records.format import walk
from ..compare.pairing import _flow
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


def data_parallel_members(records: list) -> frozenset:
    """The global ranks this rank's gradients were reduced over (empty: none)."""
    out = set()
    for r in records:
        info = r.get("collective") or {}
        if r.get("stage") == "backward" and info.get("kind") in ("all_reduce", "reduce_scatter") \
                and info.get("reduce_op") in ("SUM", "AVG"):
            group = next((v for v in r.get("inputs", ()) if v.get("type") == "process_group"), {})
            out.update(group.get("ranks") or ())
    return frozenset(out)


def _numbers(record: dict) -> list:
    return [(arg, spec.get("value")) for _, arg, spec in walk(record, outputs=False, tensors_only=False)
            if spec.get("type") in _NUMBERS]


class _Rank:
    def __init__(self, rank: int, records: list):
        self.rank = rank
        self.records = records
        self.flow = _flow(records)
        self.by_name = {r["name"]: i for i, r in enumerate(records) if r.get("kind") == "op"}


def find_drifts(ranks: dict[int, list], values: Values, params: dict[int, list] | None = None,
                limit: int = 20) -> tuple[list[Drift], int]:
    """The replica drifts among ``ranks`` (rank -> its records of one step, one data-parallel group;
    ``params``: rank -> its parameter records), in the reference rank's record order, and how
    many replicated values were compared."""
    members = sorted(ranks)
    backward = [i for i, r in enumerate(ranks[members[0]]) if r.get("stage") == "backward"]
    optimizer_at = backward[-1] + 1 if backward else len(ranks[members[0]])   # the parameter records' place
    at_optimizer = None
    state = {r: _Rank(r, ranks[r]) for r in members}
    ref = state[members[0]]
    replicated: set = set()          # (record name, output arg) replicated on every rank
    checked: dict = {}
    drifts: list[Drift] = []
    suspects: list[str] = []
    last_collective = ""
    compared = 0
    for i, rec in enumerate(ref.records):
        if at_optimizer is None and i >= optimizer_at:
            at_optimizer = (last_collective, list(suspects))
        if rec.get("kind") != "op":
            continue
        idx = {r: state[r].by_name.get(rec["name"]) for r in members}
        if any(v is None for v in idx.values()):
            continue
        recs = {r: state[r].records[idx[r]] for r in members}
        walks = {r: state[r].flow.walks[idx[r]] for r in members}
        if len({len(w) for w in walks.values()}) != 1:
            continue
        info = rec.get("collective") or {}
        inputs_ok, any_tensor, bad_input = True, False, False
        for k, (io, arg, spec) in enumerate(walks[ref.rank]):
            if io != "input":
                continue
            specs = {r: walks[r][k][2] for r in members}
            any_tensor = True
            if all(s.get("param") for s in specs.values()):
                compared += 1
                drift = _compare(specs, values, checked, members)
                if drift:
                    bad_input = True
                    drifts.append(_drift(i, rec, arg, drift, "parameter", last_collective, suspects))
                continue
            sources = {r: state[r].flow.src.get(id(specs[r])) for r in members}
            if any(v is None for v in sources.values()):
                if not all(s.get("shape") == [] for s in specs.values()):     # a 0-d constant: a number argument
                    inputs_ok = False
                continue
            names = {(state[r].records[sources[r][0]]["name"], sources[r][1]) for r in members}
            if len(names) != 1 or next(iter(names)) not in replicated:
                inputs_ok = False
        if info:
            if info.get("kind") in REPLICATING:
                replicated.update((rec["name"], arg) for io, arg, _ in walks[ref.rank] if io == "output")
            last_collective = (f"{rec['op']} #{info.get('seq')} on group {info.get('group')} "
                               f"[{rec.get('scope') or '<top>'}]")
            suspects = []
            continue
        computed = inputs_ok and any_tensor and not bad_input and not is_random(rec["op"])
        if computed and len({repr(_numbers(r)) for r in recs.values()}) > 1:
            shown = "; ".join(f"rank {r}: " + ", ".join(f"{a}={v}" for a, v in _numbers(recs[r])) for r in members)
            suspects.append(f"{rec['op']} [{rec.get('scope') or '<top>'}] ({rec.get('stage')}) ran on replicated "
                            f"values with number arguments that differ by rank ({shown})")
            computed = False
        for k, (io, arg, spec) in enumerate(walks[ref.rank]):
            if io != "output":
                continue
            specs = {r: walks[r][k][2] for r in members}
            param = all(s.get("param") for s in specs.values())
            if not (computed or param):
                continue
            compared += 1
            drift = _compare(specs, values, checked, members)
            if drift:
                drifts.append(_drift(i, rec, arg, drift, "parameter" if param else "computed from replicas only",
                                     last_collective, suspects))
            elif computed:
                replicated.add((rec["name"], arg))
        if len(drifts) >= limit:
            break
    if params and all(params.get(r) for r in members):
        context = at_optimizer or (last_collective, suspects)
        n, found = _param_drifts(members, params, values, checked, optimizer_at, len(ref.records), context)
        compared += n
        drifts = sorted(drifts + found, key=lambda d: d.index)[:limit]
    return drifts, compared


def _param_drifts(members, params, values, checked, at, end, context) -> tuple[int, list[Drift]]:
    """Parameter records (gradients as applied, values after the step) compared across ``members``
    by name; DTensor shards (FSDP2, tensor parallel) hold different parts by design and are left out."""
    by_name = {r: {p["name"]: p for p in params[r]} for r in members}
    found, compared = [], 0
    for k, rec in enumerate(params[members[0]]):
        recs = [by_name[r].get(rec["name"]) for r in members]
        if any(x is None or not x.get("outputs") for x in recs) or any("dtensor" in x["outputs"][0] for x in recs):
            continue
        compared += 1
        drift = _compare({r: x["outputs"][0] for r, x in zip(members, recs)}, values, checked, members)
        if drift:
            what = "gradient (as the optimizer applies it)" if rec["op"] == "param.grad" else "parameter after the step"
            index = at if rec["op"] == "param.grad" else end     # gradients before the step's ops, values after
            found.append(_drift(index, rec, rec["scope"], drift, what, *context))
    return compared, found

def _drift(i, rec, arg, found, what, last_collective, suspects) -> Drift:
    ranks, reference, detail, size = found
    context = (f"the last collective before it: {last_collective}" if last_collective
               else "before any collective of this step")
    if suspects:
        context += "; then " + "; ".join(suspects[-3:])
    return Drift(i, rec, arg, ranks, reference, what, detail, size, context)


def _compare(specs: dict, values: Values, checked: dict, members: list):
    """None when the ranks' values agree (or cannot be judged), else (ranks that differ, the
    reference rank, how, size)."""
    if not all(judged(s) for s in specs.values()):
        return None
    arrays = {r: values.array(r, s) for r, s in specs.items()}
    key = tuple((s.get("data"), repr(s.get("stats"))) for s in specs.values())
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
