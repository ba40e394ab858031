"""Pairs the records of two runs (numpy/pandas/stdlib only; never imports torch).

Runs on different devices, dtypes or versions differ in their op sequences (``addmm`` vs ``mm``
+ ``add``, casts under autocast, recomputation).  Per stage, op records are aligned with
:class:`difflib.SequenceMatcher` on ``(scope, op, output shapes)``, then inside every gap on
``(scope, op)`` (e.g. another batch size), then on ``(scope, cast or compute, output shapes)`` (a
substituted kernel: a cast never stands in for a compute op), then on ``(op, output shapes)``
between nested scopes (a layer wrapped in one run only, ``fc2`` vs ``fc2.inner``); the scope in
every key keeps pairs inside one module or its wrapper.  Module records pair by
``(scope, stage, call)``; ``match="exact"`` pairs by record name.  Whatever is left is returned
as unmatched, never dropped.  A mapping (YAML, see docs/compare.md) first renames A's ops and
scope prefixes into B's vocabulary.
"""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass, field

import yaml

from ..core import op_traits
from ..records.format import output_shapes, walk

# Above this many elements in a gap, the quadratic SequenceMatcher is replaced by in-order pairing.
_MAX_GAP = 20000


@dataclass
class Mapping:
    """Renames from run A's vocabulary to run B's: whole op names and scope prefixes."""

    ops: dict = field(default_factory=dict)
    scopes: dict = field(default_factory=dict)
    frameworks: dict = field(default_factory=dict)   # e.g. {"mindspore": {ops, regions, layout}}: offline.translate

    @classmethod
    def load(cls, path: str | None) -> "Mapping":
        if not path:
            return cls()
        if not os.path.isfile(path):
            raise ValueError(f"{path}: mapping file not found")
        try:
            with open(path, encoding="utf-8") as fh:
                data = yaml.safe_load(fh) or {}
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
        if not isinstance(data, dict) or set(data) - {"ops", "scopes", "mindspore"}:
            raise ValueError(f"{path}: a mapping file has only the keys 'ops', 'scopes' (each a dict) and "
                             "'mindspore' (extends the shipped MindSpore-to-aten translation)")
        ops, scopes = data.get("ops") or {}, data.get("scopes") or {}
        if not isinstance(ops, dict) or not isinstance(scopes, dict):
            raise ValueError(f"{path}: 'ops' and 'scopes' must each map names to names")
        frameworks = {"mindspore": data["mindspore"]} if isinstance(data.get("mindspore"), dict) else {}
        return cls({str(k): str(v) for k, v in ops.items()}, {str(k): str(v) for k, v in scopes.items()}, frameworks)

    def op(self, name: str) -> str:
        return self.ops.get(name, name)

    def scope(self, scope: str) -> str:
        if not self.scopes or not scope:
            return scope
        best = max((old for old in self.scopes if scope == old or scope.startswith(old + ".")), key=len, default=None)
        return scope if best is None else self.scopes[best] + scope[len(best):]

    def name(self, record: dict) -> str:
        """The record name in B's vocabulary (op and scope renamed)."""
        name = record["name"]
        if record["kind"] == "module":
            scope = record["scope"]
            return self.scope(scope) + name[len(scope):] if name.startswith(scope) else name
        op = record["op"]
        return self.op(op) + name[len(op):] if name.startswith(op) and op in self.ops else name

    def __bool__(self):
        return bool(self.ops or self.scopes)


@dataclass
class Alignment:
    pairs: list          # (index in A, index in B, how) -- indices into the records lists
    only_a: list         # indices into A's records
    only_b: list
    inside: dict = field(default_factory=dict)   # ("a"/"b", index) -> scope of the region compared at its boundary
    boundary: dict = field(default_factory=dict)  # (i, j) of a region-boundary pair -> [(spec_a, spec_b)]: its inputs


def _match_blocks(ka: list, kb: list, ia: list, ib: list, how: str, pairs: list):
    """Pair ia/ib (record indices) by equal keys; returns the unpaired gaps [(ia_part, ib_part)]."""
    n, m = len(ka), len(kb)
    # common prefix and suffix first: the usual case is two nearly identical sequences
    p = 0
    while p < n and p < m and ka[p] == kb[p]:
        p += 1
    s = 0
    while s < n - p and s < m - p and ka[n - 1 - s] == kb[m - 1 - s]:
        s += 1
    for k in range(p):
        pairs.append((ia[k], ib[k], how))
    for k in range(s):
        pairs.append((ia[n - s + k], ib[m - s + k], how))
    ka_mid, kb_mid = ka[p:n - s], kb[p:m - s]
    ia_mid, ib_mid = ia[p:n - s], ib[p:m - s]
    if not ka_mid or not kb_mid:
        return [(ia_mid, ib_mid)] if (ia_mid or ib_mid) else []
    if len(ka_mid) + len(kb_mid) > _MAX_GAP:
        return [(ia_mid, ib_mid)]
    gaps = []
    sm = difflib.SequenceMatcher(None, ka_mid, kb_mid, autojunk=False)
    a0 = b0 = 0
    for blk in sm.get_matching_blocks():
        if blk.a > a0 or blk.b > b0:
            gaps.append((ia_mid[a0:blk.a], ib_mid[b0:blk.b]))
        for k in range(blk.size):
            pairs.append((ia_mid[blk.a + k], ib_mid[blk.b + k], how))
        a0, b0 = blk.a + blk.size, blk.b + blk.size
    return gaps


def _nested(sa: str, sb: str) -> bool:
    """One scope is the other or inside it (a module wrapped in one run only); ops outside every
    module (scope "") nest only with each other."""
    return sa == sb or (bool(sa) and sb.startswith(sa + ".")) or (bool(sb) and sa.startswith(sb + "."))


def batched_shapes(record: dict) -> tuple:
    """Output shapes with the batch dimensions in front of the last two merged: two frameworks run
    one batched matmul over ``(2, 2, 4, 8)`` and over ``(4, 4, 8)``."""
    return tuple((math.prod(s[:-2]), *s[-2:]) if len(s) > 3 else s for s in output_shapes(record))


def align_ops(recs_a: list, recs_b: list, ia: list, ib: list, mapping: Mapping, regions: tuple | None = None) -> Alignment:
    """Fuzzy alignment of op records ia (of recs_a) against ib (of recs_b), one stage; ``regions``
    (each run's scopes; runs of two frameworks): shapes keyed with their batch dimensions merged,
    regions one run computes in a cell of its own compared at their boundary (:func:`_pair_regions`),
    and what is left paired by key regardless of order (:func:`_pair_leftovers`)."""
    shapes = output_shapes if regions is None else batched_shapes

    def scope(r, m):
        return m.scope(r["scope"]) if m else r["scope"]

    def op(r, m):
        return m.op(r["op"]) if m else r["op"]

    keyers = (
        ("op+shapes", lambda r, m: (scope(r, m), op(r, m), shapes(r)), None),
        ("op", lambda r, m: (scope(r, m), op(r, m)), None),
        # a substituted kernel (addmm for mm): same shapes, but a cast only ever pairs with a cast
        ("shapes", lambda r, m: (scope(r, m), op_traits.is_cast(op(r, m)), shapes(r)), None),
        # a module wrapped in one run (a bf16 wrapper around fc2): its ops sit one scope deeper
        ("op+shapes, nested scope", lambda r, m: (op(r, m), shapes(r)), _nested),
    )
    none = Mapping()
    pairs: list = []
    gaps = [(ia, ib)]
    for how, key, accept in keyers:
        next_gaps = []
        for ga, gb in gaps:
            if not ga or not gb:
                next_gaps.append((ga, gb))
                continue
            ka = [key(recs_a[i], mapping) for i in ga]
            kb = [key(recs_b[i], none) for i in gb]
            found: list = []
            next_gaps.extend(_match_blocks(ka, kb, ga, gb, how, found))
            if accept is not None:     # pairs the key alone cannot rule out go back to the unmatched
                ok = [accept(scope(recs_a[a], mapping), recs_b[b]["scope"]) for a, b, _ in found]
                rejected = [p for p, k in zip(found, ok) if not k]
                found = [p for p, k in zip(found, ok) if k]
                next_gaps.append(([a for a, _, _ in rejected], [b for _, b, _ in rejected]))
            pairs.extend(found)
        gaps = next_gaps
    inside: dict = {}
    boundary: dict = {}
    if regions is not None:
        gaps = _pair_regions(recs_a, recs_b, gaps, mapping, regions, pairs, inside, boundary)
        gaps = _pair_leftovers(recs_a, recs_b, gaps, lambda r, m: keyers[0][1](r, m), mapping, pairs)
    only_a = [i for ga, _ in gaps for i in ga]
    only_b = [i for _, gb in gaps for i in gb]
    return Alignment(pairs, only_a, only_b, inside, boundary)


def _within(scope: str, outer: str) -> bool:
    return not outer or scope == outer or scope.startswith(outer + ".")


def _pair_regions(recs_a: list, recs_b: list, gaps: list, mapping: Mapping, regions: tuple, pairs: list,
                  inside: dict, boundary: dict) -> list:
    """A module one run computes inside a cell of its own (MindSpore's ``nn.CrossEntropyLoss``)
    and the other in its caller (``F.cross_entropy`` at top level): when a gap's records on one
    side all lie in one scope the other run never records, and the other side's lie in an
    enclosing scope, the two regions are compared at their boundary: their last records (the
    region's result) pair, output by output, and the values entering the regions pair as its inputs
    (``boundary``: :func:`_region_inputs`); the records inside go to ``inside``.  ``regions``: the
    scopes each run records."""
    out = []
    for ga, gb in gaps:
        if ga and gb:
            sa = {mapping.scope(recs_a[i]["scope"]) if mapping else recs_a[i]["scope"] for i in ga}
            sb = {recs_b[i]["scope"] for i in gb}
            for own, other, other_scopes in ((sa, sb, regions[1]), (sb, sa, regions[0])):
                if len(own) == 1 and (inner := next(iter(own))) and inner not in other_scopes \
                        and all(_within(inner, o) and o != inner for o in other):
                    pairs.append((ga[-1], gb[-1], "region boundary"))
                    boundary[ga[-1], gb[-1]] = _region_inputs(_entering(recs_a, ga), _entering(recs_b, gb))
                    ga, gb = ga[:-1], gb[:-1]
                    inside.update({**{("a", i): inner for i in ga}, **{("b", i): inner for i in gb}})
                    break
        out.append((ga, gb))
    return out


def _value_keys(spec: dict) -> list:
    """What recognises a value across records: its saved-tensor key and its dtype + statistics."""
    st = spec.get("stats")
    return [k for k in (spec.get("data"), (spec.get("dtype"), *map(str, st.values())) if st else None) if k is not None]


def _entering(recs: list, idx: list) -> list:
    """The tensor values records ``idx`` read that none of them made (in order, each once): a
    region's inputs.  Left-out layout ops a record carries (``through``) pass a made value on."""
    made, seen, out = set(), set(), []
    for i in idx:
        r = recs[i]
        for t in r.get("through", ()):
            ins = [s for s in t.get("inputs") or () if s.get("type") == "tensor"]
            if ins and made.intersection(_value_keys(ins[0])):
                made.update(k for s in t.get("outputs") or () if s.get("type") == "tensor" for k in _value_keys(s))
        for io, _, spec in walk(r):
            keys = _value_keys(spec)
            if io == "output":
                made.update(keys)
            elif keys and not made.intersection(keys) and not seen.intersection(keys):
                seen.update(keys)
                out.append(spec)
    return out


def _region_inputs(xa: list, xb: list, most: float = 0.05) -> list:
    """Two regions' entering values paired by size and closest statistics (at most ``most`` apart:
    a value one framework's region reads and the other's does not, such as a softmax where the other
    reads a log-softmax, stays out); in A's order."""
    def numel(s):
        return math.prod(s.get("shape") or ())

    def whole(s):
        return str(s.get("dtype", "")).startswith(("int", "uint", "bool"))
    cands = sorted((stats_distance(sa, sb), x + y, x, y) for x, sa in enumerate(xa) for y, sb in enumerate(xb)
                   if numel(sa) == numel(sb) and whole(sa) == whole(sb))
    used_a, used_b, out = set(), set(), []
    for d, _, x, y in cands:
        if d <= most and x not in used_a and y not in used_b:
            used_a.add(x)
            used_b.add(y)
            out.append((x, xa[x], xb[y]))
    return [(sa, sb) for _, sa, sb in sorted(out, key=lambda t: t[0])]


def _pair_leftovers(recs_a: list, recs_b: list, gaps: list, key, mapping: Mapping, pairs: list) -> list:
    """Records no ordered pass could pair, paired by equal ``(scope, op, shapes)`` wherever they sit
    in the stage, the closest statistics first: two frameworks' autodiff may run a stage's
    independent ops in other orders (attention's four backward matmuls)."""
    left_a = [i for ga, _ in gaps for i in ga]
    left_b = [j for _, gb in gaps for j in gb]
    by_key: dict = {}
    for j in left_b:
        by_key.setdefault(key(recs_b[j], Mapping()), []).append(j)
    cands = []
    for i in left_a:
        for j in by_key.get(key(recs_a[i], mapping), ()):
            # ties go by the two positions together, the same whichever run is A
            cands.append((_output_distance(recs_a[i], recs_b[j]), i + j, abs(i - j), i, j))
    used_a, used_b = set(), set()
    for *_, i, j in sorted(cands):
        if i not in used_a and j not in used_b:
            used_a.add(i)
            used_b.add(j)
            pairs.append((i, j, "op+shapes, by statistics"))
    return [([i for i in left_a if i not in used_a], [j for j in left_b if j not in used_b])]


def _pair_by_key(ia: list, ib: list, key_a, key_b, how: str) -> Alignment:
    """Pair records whose keys are equal, each B record at most once; the rest is unmatched."""
    by_key = {key_b(i): i for i in ib}
    pairs, only_a, used = [], [], set()
    for i in ia:
        j = by_key.get(key_a(i))
        if j is None or j in used:
            only_a.append(i)
        else:
            pairs.append((i, j, how))
            used.add(j)
    return Alignment(pairs, only_a, [j for j in ib if j not in used])


def align_exact(recs_a: list, recs_b: list, ia: list, ib: list, mapping: Mapping) -> Alignment:
    """Pair by record name only (after the mapping)."""
    return _pair_by_key(ia, ib, lambda i: mapping.name(recs_a[i]) if mapping else recs_a[i]["name"],
                        lambda j: recs_b[j]["name"], "name")


def align_modules(recs_a: list, recs_b: list, ia: list, ib: list, mapping: Mapping) -> Alignment:
    """Module boundary records pair by (scope, stage, call)."""
    def key(r, m):
        return (m.scope(r["scope"]) if m else r["scope"], r["stage"], r["call"])
    return _pair_by_key(ia, ib, lambda i: key(recs_a[i], mapping), lambda j: key(recs_b[j], None), "module")


def stats_distance(sa: dict, sb: dict) -> float:
    """How far apart two tensor specs' statistics are (relative differences of mean and norm; 0
    where either lacks them): what pairs values when order cannot."""
    a, b = sa.get("stats") or {}, sb.get("stats") or {}
    total = 0.0
    for k in ("mean", "norm"):
        x, y = a.get(k), b.get(k)
        if isinstance(x, (int, float)) and isinstance(y, (int, float)):
            total += abs(x - y) / (abs(x) + abs(y) + 1e-30)
    return total


def _output_distance(ra: dict, rb: dict) -> float:
    return sum(stats_distance(sa, sb) for sa, sb in zip(ra.get("outputs") or (), rb.get("outputs") or ()))


# Above this many pairs of one key (a loop inside one module), re-paired within consecutive runs only.
_MAX_GROUP = 64


def pair_runs_by_stats(pairs: list, recs_a: list, recs_b: list) -> list:
    """Pairs whose records share kind, stage, scope, op and output shapes (batch dimensions merged)
    are re-paired among themselves by closest output statistics, the order breaking ties: two
    frameworks may run equal ops in other orders (the two backward ``mul`` of a product, attention's
    backward matmuls).  A key with more than ``_MAX_GROUP`` pairs is re-paired within runs of
    consecutive pairs only."""
    def key(r):
        return r["kind"], r["stage"], r["scope"], r["op"], batched_shapes(r)
    out, groups = [], {}
    for p in sorted(pairs):
        ka = key(recs_a[p[0]])
        if ka == key(recs_b[p[1]]):
            groups.setdefault(ka, []).append(p)
        else:
            out.append(p)
    for group in groups.values():
        runs = [group]
        if len(group) > _MAX_GROUP:
            runs = [[group[0]]]
            for p in group[1:]:
                prev = runs[-1][-1]
                if p[0] == prev[0] + 1 and p[1] == prev[1] + 1 and len(runs[-1]) < _MAX_GROUP:
                    runs[-1].append(p)
                else:
                    runs.append([p])
        for run in runs:
            out.extend(_closest(run, recs_a, recs_b))
    return sorted(out)


def _closest(run: list, recs_a: list, recs_b: list) -> list:
    """``run``'s records re-paired, the closest output statistics first (then the nearest in order)."""
    if len(run) < 2:
        return run
    # ties: the nearest in order, then the earliest of both positions together (the same either way round)
    cands = sorted((_output_distance(recs_a[a], recs_b[b]), abs(x - y), x + y, x, y)
                   for x, (a, _, _) in enumerate(run) for y, (_, b, _) in enumerate(run))
    used_a, used_b, out = set(), set(), []
    for *_, x, y in cands:
        if x not in used_a and y not in used_b:
            used_a.add(x)
            used_b.add(y)
            out.append((run[x][0], run[y][1], run[x][2]))
    return out


def align(recs_a: list, recs_b: list, match: str = "fuzzy", mapping: Mapping | None = None,
          by_stats: bool = False) -> Alignment:
    """Align two parts' records (ops per stage, modules by scope); pairs sorted by A's order.
    ``by_stats``: equal-key runs paired by closest statistics (:func:`pair_runs_by_stats`)."""
    mapping = mapping or Mapping()
    regions = ({mapping.scope(r["scope"]) for r in recs_a}, {r["scope"] for r in recs_b}) if by_stats else None
    pairs, only_a, only_b, inside, boundary = [], [], [], {}, {}
    for stage in ("forward", "backward"):
        for kind in ("op", "module"):
            ia = [i for i, r in enumerate(recs_a) if r["stage"] == stage and r["kind"] == kind]
            ib = [i for i, r in enumerate(recs_b) if r["stage"] == stage and r["kind"] == kind]
            if kind == "module":
                al = align_modules(recs_a, recs_b, ia, ib, mapping)
            elif match == "exact":
                al = align_exact(recs_a, recs_b, ia, ib, mapping)
            else:
                al = align_ops(recs_a, recs_b, ia, ib, mapping, regions)
            pairs += al.pairs
            inside.update(al.inside)
            boundary.update(al.boundary)
            only_a += al.only_a
            only_b += al.only_b
    # records of any other stage count as unmatched rather than vanish
    known = ("forward", "backward")
    only_a += [i for i, r in enumerate(recs_a) if r["stage"] not in known]
    only_b += [i for i, r in enumerate(recs_b) if r["stage"] not in known]
    pairs = pair_runs_by_stats(pairs, recs_a, recs_b) if by_stats else sorted(pairs)
    return Alignment(pairs, sorted(only_a), sorted(only_b), inside, boundary)
