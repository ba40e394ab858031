"""Pairs the records of two runs (numpy/pandas/stdlib only; never imports torch).

Runs on different devices, dtypes or versions differ in their op sequences (``addmm`` vs ``mm``
+ ``add``, casts under autocast, recomputation).  Per stage, op records are aligned with
:class:`difflib.SequenceMatcher` on ``(scope, op, output shapes)``, then inside every gap on
``(scope, op)`` (e.g. another batch size), then on ``(scope, cast or compute, output shapes)`` (a
substituted kernel: a cast never stands in for a compute op), then on ``(op, output shapes)``
between nested scopes (a layer wrapped in one run only, ``fc2`` vs ``fc2.inner``); the scope in
every key keeps pairs inside one module or its wrapper; a module's repeated calls that one run
makes in another order (a compiled graph's loop over a ``set``) re-pair by their values.  Module
records pair by ``(scope, stage, call)``; ``match="exact"`` pairs by record name.  Whatever is left is returned
as unmatched, never dropped.  A mapping (YAML, see docs/compare.md) first renames A's ops and
scope prefixes into B's vocabulary.  Runs of two frameworks compare a span of records each run
computes differently (a loss cell against ``F.cross_entropy``) as one region, by its data flow:
the values entering it and the values leaving it (:func:`compare_regions`).
"""

from __future__ import annotations

import bisect
import difflib
import itertools
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple
from math import isfinite, prod, sqrt

import numpy as np
import yaml

from ..core import op_traits
from ..records.format import output_shapes, walk
from .regions import (by_phase, compare_regions, fed_alike, phases, producers, region_spans, sized_mean,  # noqa: F401
                      stat_terms, stats_distance)

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
    regions: dict = field(default_factory=dict)  # ("a"/"b", index of a region's last record) -> the region's record
    spans: list = field(default_factory=list)    # [(ia, ib)]: unpaired spans still to compare as regions

    def records(self, recs: list, side: str) -> list:
        """``recs`` (run ``side``'s) with each region's last record standing for the whole region:
        its entering values as inputs, its leaving values as outputs (:func:`compare_regions`)."""
        if not self.regions:
            return recs
        return [self.regions.get((side, i), r) for i, r in enumerate(recs)]


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
    a0 = b0 = 0
    for blk in _common_blocks(ka_mid, kb_mid):
        if blk.a > a0 or blk.b > b0:
            gaps.append((ia_mid[a0:blk.a], ib_mid[b0:blk.b]))
        for k in range(blk.size):
            pairs.append((ia_mid[blk.a + k], ib_mid[blk.b + k], how))
        a0, b0 = blk.a + blk.size, blk.b + blk.size
    return gaps


def _common_blocks(ka: list, kb: list) -> list:
    """difflib's matching blocks of two key sequences, the same whichever is given first: where equal
    keys could pair several ways (two frameworks running a backward's two ``bmm`` in other orders),
    difflib picks by its first argument, so the two sequences go to it in one fixed order (by their
    text) and the blocks come back mirrored; else the pairs, and the verdict, changed with the runs'
    order."""
    if repr(ka) <= repr(kb):
        return difflib.SequenceMatcher(None, ka, kb, autojunk=False).get_matching_blocks()
    return [difflib.Match(b.b, b.a, b.size)
            for b in difflib.SequenceMatcher(None, kb, ka, autojunk=False).get_matching_blocks()]


def _lone(found: list, recs_a: list, recs_b: list, ga: list, gb: list, scope, mapping: Mapping) -> list:
    """``found``'s pairs whose records are each the only compute record of their scope in the gap
    (``ga``, ``gb``): across frameworks a kernel substitutes for another alone in its module (an
    untranslated ``SigmoidGrad`` for ``sigmoid_backward``); among a loss's ~30 primitives at top
    level one of the same shape as ``_log_softmax`` is no substitute for it (a region instead)."""
    def counts(recs, g, m):
        return Counter(scope(recs[i], m) for i in g if recs[i]["kind"] == "op" and not op_traits.is_cast(recs[i]["op"]))
    na, nb = counts(recs_a, ga, mapping), counts(recs_b, gb, Mapping())
    return [p for p in found if na[scope(recs_a[p[0]], mapping)] == 1 and nb[recs_b[p[1]]["scope"]] == 1]


def _closest_stand_in(found: list, ka: list, kb: list, ga: list, gb: list, recs_a: list, recs_b: list) -> bool:
    """Re-pairs, in place, a pair of the shapes-only pass whose key one record of one run's gap holds
    and several of the other's: the one record pairs with the one of those whose outputs' statistics
    are closest, the ordered pair kept on a tie and no pair moved across another.  Why: a kernel of
    one run stands for several records of the other (eager's ``stack``, the backward of ``unbind``,
    for a compiled graph's three ``select_backward`` and the ``add`` of them, all of one shape), and
    the order pairs it with the first piece, whose values are a third of it, instead of the record
    holding the whole value.  The records are ranked by :func:`_value_roles` first: a piece another
    of them computes on (``g * sigmoid(x)`` of silu's backward decomposed) is never the whole value,
    whatever its statistics (a forward difference can leave a piece's nearer the one record's).
    True if any pair moved."""
    count_a, count_b = Counter(ka), Counter(kb)
    key_a, key_b = dict(zip(ga, ka)), dict(zip(gb, kb))
    at_a, at_b = {i: n for n, i in enumerate(ga)}, {j: n for n, j in enumerate(gb)}
    moved = False
    for n, (x, y, how) in enumerate(found):
        k = key_a[x]
        if count_a[k] == 1 and count_b[k] > 1:
            cands = [j for j in gb if key_b[j] == k]
            role = _value_roles(recs_b, cands)
            best = min(cands, key=lambda j: (role[j], _output_distance(recs_a[x], recs_b[j]), j != y,
                                             abs(at_b[j] - at_b[y])))
            new = (x, best)
        elif count_b[k] == 1 and count_a[k] > 1:
            cands = [i for i in ga if key_a[i] == k]
            role = _value_roles(recs_a, cands)
            best = min(cands, key=lambda i: (role[i], _output_distance(recs_a[i], recs_b[y]), i != x,
                                             abs(at_a[i] - at_a[x])))
            new = (best, y)
        else:
            continue
        if new == (x, y) or any((at_a[p] - at_a[new[0]]) * (at_b[q] - at_b[new[1]]) <= 0
                                for m, (p, q, _) in enumerate(found) if m != n):
            continue       # unchanged, or it would cross (or meet) another pair: the order stands
        found[n] = (*new, how)
        moved = True
    return moved


# what a record is among records that may each stand for one value (:func:`_value_roles`)
WHOLE, COPY, PIECE = 0, 1, 2


def _value_roles(recs: list, cands: list) -> dict:
    """Per record of ``cands`` (indices into ``recs``), what it holds of the value they may each stand
    for: ``PIECE`` where another of them reads it and computes a different value from it (silu's
    backward decomposed: ``g * sigmoid(x)``, which the next ``mul`` reads), ``COPY`` where it reads
    another of them and gives back the same value (equal output statistics: eager's ``cat`` of an
    empty cache with the keys a compiled graph never copies), else ``WHOLE``.  Why: a piece holds part
    of the computation, never the value a kernel of the other run makes at once; a copy holds the
    value but is fed otherwise than the record that made it, whose counterpart is the one wanted.
    Data flow by :func:`.regions.producers` over ``cands`` alone (saved-tensor key, statistics, view)."""
    order = sorted(cands)
    role = dict.fromkeys(cands, WHOLE)
    if len(order) < 2:
        return role
    for reader, made_from in enumerate(producers([recs[i] for i in order])):
        for maker in made_from:
            if _same_value(recs[order[maker]], recs[order[reader]]):
                role[order[reader]] = max(role[order[reader]], COPY)
            else:
                role[order[maker]] = PIECE
    return role


def _same_value(ra: dict, rb: dict) -> bool:
    """Whether two records give back the same values as far as their records tell: outputs of one
    number, shapes, dtypes and statistics (all of them, none missing)."""
    out_a, out_b = ra.get("outputs") or (), rb.get("outputs") or ()
    return len(out_a) == len(out_b) > 0 and all(
        isinstance(sa, dict) and isinstance(sb, dict) and sa.get("stats") and sa.get("stats") == sb.get("stats")
        and sa.get("shape") == sb.get("shape") and sa.get("dtype") == sb.get("dtype") for sa, sb in zip(out_a, out_b))


def _whole_values(recs: list, cands: list) -> list:
    """Of sibling records ``cands``, those of the best role :func:`_value_roles` gives any of them."""
    if len(cands) < 2:
        return cands
    role = _value_roles(recs, cands)
    best = min(role.values())
    return [c for c in cands if role[c] == best]


def _between_pairs(ga: list, gb: list, found: list) -> list:
    """The gaps of ``ga``/``gb`` (record indices in order) left between ``found``'s pairs (in order)."""
    gaps, a0, b0 = [], 0, 0
    at_a, at_b = {i: k for k, i in enumerate(ga)}, {j: k for k, j in enumerate(gb)}
    for i, j, _ in sorted(found, key=lambda p: at_a[p[0]]):
        if at_a[i] > a0 or at_b[j] > b0:
            gaps.append((ga[a0:at_a[i]], gb[b0:at_b[j]]))
        a0, b0 = at_a[i] + 1, at_b[j] + 1
    if a0 < len(ga) or b0 < len(gb):
        gaps.append((ga[a0:], gb[b0:]))
    return gaps


def _nested(sa: str, sb: str) -> bool:
    """One scope is the other or inside it (a module wrapped in one run only); ops outside every
    module (scope "") nest only with each other."""
    return sa == sb or (bool(sa) and sb.startswith(sa + ".")) or (bool(sb) and sa.startswith(sb + "."))


def _sizes(record: dict) -> tuple:
    return tuple(math.prod(s) for s in output_shapes(record))


def op_shapes(record: dict) -> tuple:
    """The shapes alignment keys a record on: its outputs', or, for an op that returns no tensor (an
    in-place foreach update, a fused optimizer step), those of the tensors it is given, marked as
    such. Without them every such call of an op shares one empty key, and one optimizer's
    step-count increment pairs with another implementation's epsilon add."""
    shapes = output_shapes(record)
    if shapes:
        return shapes
    given = tuple(tuple(spec["shape"]) for _, _, spec in walk(record, outputs=False))
    return ("given", *given) if given else shapes


def output_kinds(record: dict) -> tuple:
    """The kind of each output tensor's dtype (floating, integer, bool, complex): a kernel standing in
    for another computes the same kind of value (``addmm`` for ``mm``, in any float dtype), so an
    ``eq``'s mask never pairs with an ``arange``'s indices of the same shape."""
    return tuple(_KINDS.get(spec.get("dtype"), None) or _kind(spec.get("dtype", ""))
                 for _, _, spec in walk(record, inputs=False))


_KINDS: dict = {}


def _kind(dtype: str) -> str:
    name = dtype.lower().rsplit(".", 1)[-1]
    kind = "b" if name.startswith("bool") else "c" if name.startswith("complex") else \
        "i" if name.startswith(("int", "uint", "long", "short")) else "f" if "float" in name or name == "half" else name
    _KINDS[dtype] = kind
    return kind


def _ranks(record: dict, outputs: bool = True) -> tuple:
    return tuple(len(spec["shape"]) for _, _, spec in walk(record, outputs=outputs))


def _output_ranks(record: dict) -> list:
    """Per output of a record, the ranks of its tensors, or None where the op gave back no value
    there (a ``none`` output)."""
    return [None if spec.get("type") == "none" else _ranks({"outputs": [spec]})
            for spec in record.get("outputs") or ()]


def _same_ranks(ra: dict, rb: dict) -> bool:
    """Calls of one op on other shapes (another batch or sequence length) keep each tensor's rank;
    calls whose tensors differ in number or rank compute different things (an optimizer's
    step-count increment on scalars and its epsilon add on the parameters' shapes).  An output one
    call gives back no value for is left out (:func:`_optional_outputs_only`)."""
    return _ranks(ra) == _ranks(rb) or (_ranks(ra, False) == _ranks(rb, False) and _optional_outputs_only(ra, rb))


def _optional_outputs_only(ra: dict, rb: dict) -> bool:
    """Whether two records of one op differ in their outputs only where one of them gave back no
    value (a ``none`` output): a compiled graph's ``native_layer_norm`` returns no mean where
    nothing reads it, an eager one always does, and the two calls compute the same normalised
    values.  The outputs both hold keep their ranks, and one at least is a tensor in both."""
    out_a, out_b = _output_ranks(ra), _output_ranks(rb)
    both = [(x, y) for x, y in zip(out_a, out_b) if x is not None and y is not None]
    return len(out_a) == len(out_b) and bool(both) and all(x == y and x for x, y in both)


def batched_shapes(record: dict) -> tuple:
    """Output shapes with the batch dimensions in front of the last two merged: two frameworks run
    one batched matmul over ``(2, 2, 4, 8)`` and over ``(4, 4, 8)``."""
    return tuple((math.prod(s[:-2]), *s[-2:]) if len(s) > 3 else s for s in output_shapes(record))


def _cross_shapes(record: dict) -> tuple:
    """What the passes across frameworks key a record's outputs on: :func:`batched_shapes` and the
    kind of each output's dtype.  A call on integers is no counterpart of one on floats of the same
    shape: a MindSpore graph runs a loss's ``MaskedFill`` on the int64 labels and on float values in
    another order than PyNative, and shapes alone paired them across (then re-paired by statistics
    to another call, the verdict naming a different suspect with the runs swapped)."""
    return batched_shapes(record), output_kinds(record)


def functional(op: str) -> str:
    """An in-place op's name as its functional variant's (``aten.div_.Tensor`` -> ``aten.div.Tensor``):
    a compiled graph computes an eager ``div_`` as ``div`` (functionalization), the same values.
    Answered once per distinct name (asked for every record and every pair)."""
    name = _FUNCTIONAL.get(op)
    if name is None:
        parts = op.split(".")
        if len(parts) >= 2 and parts[1].endswith("_") and not parts[1].endswith("__"):
            parts[1] = parts[1][:-1]
        name = _FUNCTIONAL[op] = ".".join(parts)
    return name


_FUNCTIONAL: dict = {}


def align_ops(recs_a: list, recs_b: list, ia: list, ib: list, mapping: Mapping, cross: bool = False,
              made: tuple = ()) -> Alignment:
    """Fuzzy alignment of op records ia (of recs_a) against ib (of recs_b), one stage; ``cross``
    (runs of two frameworks): shapes keyed with their batch dimensions merged, what the ordered
    passes leave paired by key regardless of order (:func:`_pair_leftovers`), and the unpaired spans
    both runs hold between the same paired records returned as ``spans``, to be compared as regions
    by their data flow (:func:`regions.compare_regions`) once every stage is paired; a lone record
    on each side with the same output shapes stays a substituted kernel.  ``made``: each run's
    :func:`regions.producers` (``cross``): records pair by shape alone only where their inputs
    come from paired records alike."""
    shapes = _cross_shapes if cross else op_shapes

    def scope(r, m):
        return m.scope(r["scope"]) if m else r["scope"]

    def op(r, m):
        return functional(m.op(r["op"]) if m else r["op"])

    def nested(ra, rb):
        return _nested(scope(ra, mapping), rb["scope"])

    def same_size(ra, rb):   # across frameworks (outputs may differ in number): a scaling of a scalar is no
        return _sizes(ra)[:1] == _sizes(rb)[:1] and output_kinds(ra)[:1] == output_kinds(rb)[:1]   # counterpart
        # of one of a matrix, nor one on integers of one on floats

    substituted = ("shapes", lambda r, m: (scope(r, m), op_traits.is_cast(op(r, m)), _writes_in_place(r), shapes(r),
                                        output_kinds(r)), None)
    keyers = (
        ("op+shapes", lambda r, m: (scope(r, m), op(r, m), shapes(r)), None),
        ("op", lambda r, m: (scope(r, m), op(r, m)), same_size if cross else _same_ranks),
        # a substituted kernel (addmm for mm): same shapes, but a cast only ever pairs with a cast;
        # across frameworks only where the inputs come from paired records alike (else: a region)
        substituted,
        # a module wrapped in one run (a bf16 wrapper around fc2): its ops sit one scope deeper
        ("op+shapes, nested scope", lambda r, m: (op(r, m), shapes(r)), nested),
    )
    none = Mapping()
    pairs: list = []
    gaps = by_phase(recs_a, recs_b, [(ia, ib)]) if cross else [(ia, ib)]
    for how, key, accept in keyers:
        next_gaps = []
        for ga, gb in gaps:
            if not ga or not gb:
                next_gaps.append((ga, gb))
                continue
            ka = [key(recs_a[i], mapping) for i in ga]
            kb = [key(recs_b[i], none) for i in gb]
            found: list = []
            split = _match_blocks(ka, kb, ga, gb, how, found)
            if key is substituted[1] and not cross and _closest_stand_in(found, ka, kb, ga, gb, recs_a, recs_b):
                split = _between_pairs(ga, gb, found)
            if accept is not None or (cross and how == "shapes"):   # pairs the key alone cannot rule out
                kept = [p for p in found if accept is None or accept(recs_a[p[0]], recs_b[p[1]])]
                if cross and how == "shapes":      # go back where they sit
                    kept = fed_alike(_lone(kept, recs_a, recs_b, ga, gb, scope, mapping), pairs, *made)
                if len(kept) < len(found):
                    split = _between_pairs(ga, gb, kept)
                found = kept
            next_gaps.extend(split)
            pairs.extend(found)
        gaps = next_gaps
    if _closest_siblings(recs_a, recs_b, pairs, gaps):   # a pair moved: the gaps between pairs moved too
        gaps = _between_pairs(ia, ib, pairs)
    if not cross and _reordered_calls(recs_a, recs_b, ia, ib, pairs):
        paired_a, paired_b = {p[0] for p in pairs}, {p[1] for p in pairs}
        gaps = [([i for i in ia if i not in paired_a], [j for j in ib if j not in paired_b])]
    spans: list = []
    if cross:
        gaps = _pair_leftovers(recs_a, recs_b, gaps, keyers[0][1], mapping, pairs)
        gaps, spans = region_spans(recs_a, recs_b, gaps, lambda r, m: substituted[1](r, m), mapping, pairs)
    only_a = [i for ga, _ in gaps for i in ga] + [i for ga, _ in spans for i in ga]
    only_b = [i for _, gb in gaps for i in gb] + [i for _, gb in spans for i in gb]
    return Alignment(pairs, only_a, only_b, spans=spans)


def _writes_in_place(r: dict) -> bool:
    """Whether an aten record's op writes into its first input (``add_``): no kernel substituted for a
    computing op (autograd accumulating a gradient, ``add_``, is no ``mm``, whatever the shapes)."""
    return op_traits.writes_in_place(r["op"])


def _sibling(r: dict) -> tuple:
    return r["scope"], functional(r["op"]), output_shapes(r)


def _relative_gaps(va: np.ndarray, vb: np.ndarray) -> np.ndarray:
    """:func:`regions.relative_gap` of arrays ``va`` and ``vb`` (broadcast), the same value bit for
    bit: equal infinities 0 apart, an infinity and any other number 1 apart, nan staying nan."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        rel = np.abs(va - vb) / (np.abs(va) + np.abs(vb) + 1e-30)
    odd = np.isnan(rel)
    if odd.any():
        limits = odd & ~np.isnan(va) & ~np.isnan(vb)
        rel = np.where(limits, (va != vb).astype(float), rel)
    return rel


def _closeness(recs_a: list, recs_b: list, cand_a: list, cand_b: list) -> tuple:
    """How far apart records ``cand_a`` (of recs_a) are from ``cand_b`` (of recs_b), every pair at
    once: their outputs', then their inputs' summed :func:`regions.stats_distance` as two
    ``(len(cand_a), len(cand_b))`` arrays (non-finite distances, from nan statistics, count as
    far).  In numpy, the same IEEE operations in the same order as the scalar distance (slots summed
    left to right), so ties and choices are those of the per-pair sum; an integer statistic float64
    would round is measured by the scalar distance itself."""
    out = []
    for io in ("outputs", "inputs"):
        specs = [[recs[i].get(io) or () for i in cand] for recs, cand in ((recs_a, cand_a), (recs_b, cand_b))]
        width = min(max(map(len, side), default=0) for side in specs)
        rows = [[[v for n in range(width) for v in
                  (stat_terms(r[n]) if n < len(r) and isinstance(r[n], dict) else (None, None))] for r in side]
                for side in specs]
        if any(isinstance(v, int) and abs(v) > 2 ** 52 for side in rows for row in side for v in row):
            d = np.array([[sum(stats_distance(sa, sb) for sa, sb in zip(ra, rb)
                               if isinstance(sa, dict) and isinstance(sb, dict)) for rb in specs[1]]
                          for ra in specs[0]], float).reshape(len(cand_a), len(cand_b))
            out.append(np.where(np.isfinite(d), d, np.inf))
            continue
        known = [np.array([[v is not None for v in row] for row in side], bool).reshape(len(side), width, 2)
                 for side in rows]
        vals = [np.array([[0.0 if v is None else v for v in row] for row in side], float).reshape(len(side), width, 2)
                for side in rows]
        rel = _relative_gaps(vals[0][:, None], vals[1][None])
        rel = np.where(known[0][:, None] & known[1][None], rel, 0.0)
        d = np.cumsum(rel[..., 0] + rel[..., 1], axis=-1)[..., -1] if width else np.zeros((len(cand_a), len(cand_b)))
        out.append(np.where(np.isfinite(d), d, np.inf))     # (cumsum: in order, not pairwise)
    return tuple(out)


def _closest_siblings(recs_a: list, recs_b: list, pairs: list, gaps: list) -> bool:
    """Re-pair each pair among its unpaired siblings (records of the same scope, op and output
    shapes on its own side, between the same neighbouring pairs), the closest values first: one run
    may compute a value twice where the other computes it once (eager recomputes ``self / other``
    in ``div``'s backward, a compiled graph reuses the forward's), and the order alone pairs the
    other run's one call with whichever comes first.  Order is kept (each pair stays between its
    neighbours); ties keep the ordered pass's choice.  Only the records of the best role
    :func:`_value_roles` gives any sibling are chosen among: a piece another sibling computes on is
    a step of a chain, not the value computed twice.  ``gaps``: the unpaired records, (A's, B's)
    per gap.  Changes ``pairs`` in place; True if any moved."""
    free: tuple = ({}, {})
    for gap in gaps:
        for side, recs in ((0, recs_a), (1, recs_b)):
            for i in gap[side]:
                free[side].setdefault(_sibling(recs[i]), []).append(i)
    if not free[0] and not free[1]:
        return False
    for side in free:
        for lst in side.values():
            lst.sort()
    kinds = ({key[:2] for key in free[0]}, {key[:2] for key in free[1]})   # (scope, op) of the unpaired
    names: dict = {}     # op -> its functional name, asked once per distinct op

    def may_have_siblings(r, side):
        op = r["op"]
        name = names.get(op)
        if name is None:
            name = names[op] = functional(op)
        return (r["scope"], name) in kinds[side]
    candidates = [k for k, p in enumerate(pairs)
                  if may_have_siblings(recs_a[p[0]], 0) or may_have_siblings(recs_b[p[1]], 1)]
    if not candidates:
        return False
    order = sorted(range(len(pairs)), key=lambda k: pairs[k][0])   # record indices keep each run's order
    at = {k: n for n, k in enumerate(order)}
    moved = False
    for k in candidates:
        n = at[k]
        i, j, how = pairs[k]
        sib_a, sib_b = _sibling(recs_a[i]), _sibling(recs_b[j])
        cand = []
        for side, x, sib in ((0, i, sib_a), (1, j, sib_b)):
            lo = pairs[order[n - 1]][side] if n else -1
            hi = pairs[order[n + 1]][side] if n + 1 < len(order) else math.inf
            lst = free[side].get(sib, [])
            cand.append([x] + lst[bisect.bisect_right(lst, lo):bisect.bisect_left(lst, hi)])
        if len(cand[0]) == 1 and len(cand[1]) == 1:
            continue
        cand = [_whole_values(recs_a, cand[0]), _whole_values(recs_b, cand[1])]
        far_out, far_in = (m.tolist() for m in _closeness(recs_a, recs_b, cand[0], cand[1]))
        # ties: the ordered pass's pair, then the nearest to it, the earliest (the same whichever run is A)
        best = min((far_out[p][q], far_in[p][q], (x, y) != (i, j), abs(x - i) + abs(y - j), x + y, x, y)
                   for p, x in enumerate(cand[0]) for q, y in enumerate(cand[1]))
        x, y = best[-2:]
        if (x, y) == (i, j):
            continue
        for side, old, new, key in ((0, i, x, sib_a), (1, j, y, sib_b)):
            if old != new:
                lst = free[side][key]
                lst.remove(new)
                bisect.insort(lst, old)
        pairs[k] = (x, y, how)
        moved = True
    return moved


def _reordered_calls(recs_a: list, recs_b: list, ia: list, ib: list, pairs: list) -> bool:
    """Re-pair the records of one stretch of a module's ops (consecutive records of one scope in
    each run) among those of the same op and output shapes, the closest values first, where that
    brings the stretch's pairs strictly closer than the order does: one run may make a module's
    independent calls in another order (a compiled graph traced from a loop over a ``set`` runs it
    in insertion order, eager Python in hash order: Gemma3's rotary embedding per attention kind),
    and the order alone pairs each call with the other's.  Unpaired records of the stretch take
    part (a call one run computes a value of once less).  A group moves only where its pairs'
    distance (outputs' and inputs' statistics together) falls to half or less: rounding noise
    (a bf16 run's two adds of near-equal outputs) never reorders pairs.  Ties keep the ordered
    pairs.  The groups that cannot move (most: their ordered pairs already the closest) are told
    apart for all groups at once (:func:`_movable`), the others ranked one by one.  Changes
    ``pairs`` in place (they may then cross inside the stretch); True if any moved."""
    def stretches(recs, idx):
        out, run, prev = {}, -1, None
        for i in idx:
            if recs[i]["scope"] != prev:
                run, prev = run + 1, recs[i]["scope"]
            out[i] = run
        return out
    run_a, run_b = stretches(recs_a, ia), stretches(recs_b, ib)
    groups: dict = {}       # (stretch A, stretch B, op, shapes) -> indices into pairs
    for k, (i, j, _) in enumerate(pairs):
        # a pair of two ops (one kernel standing in for another) is no call made in another order: its
        # group would hold one run's kind of record only, and a move would depend on which run is A
        if i in run_a and j in run_b and functional(recs_a[i]["op"]) == functional(recs_b[j]["op"]):
            groups.setdefault((run_a[i], run_b[j], *_sibling(recs_a[i])[1:]), []).append(k)
    paired_a, paired_b = {p[0] for p in pairs}, {p[1] for p in pairs}
    members: tuple = ({}, {})     # (stretch, op, shapes) -> the unpaired records of it, per side
    for side, recs, idx, run, paired in ((0, recs_a, ia, run_a, paired_a), (1, recs_b, ib, run_b, paired_b)):
        for i in idx:
            if i not in paired:
                members[side].setdefault((run[i], *_sibling(recs[i])[1:]), []).append(i)
    # a group of one pair takes part where its stretch holds an unpaired record of its kind
    groups = {g: ks for g, ks in groups.items() if len(ks) <= _MAX_GROUP and (
        len(ks) > 1 or (g[0], *g[2:]) in members[0] or (g[1], *g[2:]) in members[1])}
    if not groups:
        return False

    def candidates(sa, sb, op, shapes, old):
        return (sorted({p[0] for p in old} | set(members[0].get((sa, op, shapes), ()))),
                sorted({p[1] for p in old} | set(members[1].get((sb, op, shapes), ()))))
    jobs = [(g, ks, *candidates(*g, [pairs[k] for k in ks])) for g, ks in groups.items()]
    fits = [len(cand_a) <= _MAX_GROUP and len(cand_b) <= _MAX_GROUP for _, _, cand_a, cand_b in jobs]
    movable = iter(_movable(recs_a, recs_b, [(cand_a, cand_b, [pairs[k][:2] for k in ks])
                                             for (_, ks, cand_a, cand_b), fit in zip(jobs, fits) if fit]))
    moved, touched = False, set()     # the unpaired records' lists a move changed
    for ((sa, sb, op, shapes), ks, cand_a, cand_b), fit in zip(jobs, fits):
        may = next(movable) if fit else None
        old = [pairs[k] for k in ks]
        if (0, sa, op, shapes) in touched or (1, sb, op, shapes) in touched:   # ranked on the lists as they are now
            cand_a, cand_b = candidates(sa, sb, op, shapes, old)
            fit, may = len(cand_a) <= _MAX_GROUP and len(cand_b) <= _MAX_GROUP, None
        if not fit or may is False:
            continue
        far_out, far_in = _closeness(recs_a, recs_b, cand_a, cand_b)
        far = far_out + far_in
        at_a, at_b = {x: n for n, x in enumerate(cand_a)}, {y: n for n, y in enumerate(cand_b)}
        ordered = {(p[0], p[1]) for p in old}
        # (an ordered pair of non-finite statistics, a value gone inf or nan, stays where it is)
        before = sum(far[at_a[x], at_b[y]].item() for x, y in ordered)
        # any len(old) pairs cost at least the len(old) smallest distances (all >= 0): where even these
        # are not under half, nothing moves (the margin covers the sums' rounding)
        floor = float(np.sort(far, axis=None)[:len(old)].sum())
        if not math.isfinite(before) or not 2 * floor < before * (1 + 1e-9):
            continue
        far = far.tolist()
        cost = {(x, y): far[p][q] for p, x in enumerate(cand_a) for q, y in enumerate(cand_b)}
        # ties: the ordered pass's pairs, then the nearest in order, the earliest (the same either way round)
        ranked = sorted(cost, key=lambda xy: (cost[xy], xy not in ordered, abs(at_a[xy[0]] - at_b[xy[1]]),
                                              at_a[xy[0]] + at_b[xy[1]], xy))
        used_a, used_b, new = set(), set(), []
        for x, y in ranked:
            if x not in used_a and y not in used_b:
                used_a.add(x)
                used_b.add(y)
                new.append((x, y))
                if len(new) == len(old):
                    break
        before = sum(cost[xy] for xy in ordered)
        if set(new) == ordered or not 2 * sum(cost[xy] for xy in new) < before:
            continue
        how = old[0][2]
        for k, (x, y) in zip(ks, sorted(new)):
            pairs[k] = (x, y, how)
        for side, key, was, now in ((0, (sa, op, shapes), {p[0] for p in old}, used_a),
                                    (1, (sb, op, shapes), {p[1] for p in old}, used_b)):
            free = set(members[side].get(key, ())) - now | (was - now)
            members[side][key] = sorted(free)
            touched.add((side, *key))
        moved = True
    return moved


def _movable(recs_a: list, recs_b: list, groups: list) -> list:
    """For each group ``(cand_a, cand_b, ordered pairs)`` of :func:`_reordered_calls`: False where
    no re-pairing can move it, decided for all groups at once: its ordered pairs' distance is
    not finite, or any choice of that many pairs (at least the sum of that many smallest
    distances, all >= 0) is not under half of it.  The distances are :func:`_closeness`'s bit for
    bit (:func:`_closeness_many`); the sums here add in another order than the group's own
    decision, so the margin (1e-6 relative, far above a sum's rounding) only ever sends a
    borderline group on to that decision.  None where not measured here (an integer statistic
    float64 would round): the group is ranked."""
    out: list = [None] * len(groups)
    for idx, far in _closeness_many(recs_a, recs_b, [g[:2] for g in groups]):
        n_a, n_b = far.shape[1], far.shape[2]
        size = n_a * n_b
        k = np.fromiter((len(groups[g][2]) for g in idx), np.int64, count=len(idx))
        gid = np.repeat(np.arange(len(idx)), k)
        xy = np.array([xy for g in idx for xy in groups[g][2]], np.int64).reshape(-1, 2)
        cand_a = np.array([groups[g][0] for g in idx], np.int64)
        cand_b = np.array([groups[g][1] for g in idx], np.int64)
        # each ordered pair's place among its group's candidates (every pair is one of them)
        at_a = (cand_a[gid] == xy[:, :1]).argmax(1)
        at_b = (cand_b[gid] == xy[:, 1:]).argmax(1)
        flat = gid * size + at_a * n_b + at_b
        # (bincount adds each group's pairs in their order, as the group's own sum does)
        before = np.bincount(gid, weights=far.reshape(-1)[flat], minlength=len(idx))
        floor = np.cumsum(np.sort(far.reshape(len(idx), size), axis=1), axis=1)[np.arange(len(idx)), k - 1]
        with np.errstate(invalid="ignore"):
            still = ~(~np.isfinite(before) | (2 * floor >= before * (1 + 1e-6)))
        for g, may in zip(idx, still.tolist()):
            out[g] = may
    return out


def _stat_row(record: dict, io: str) -> tuple:
    """``(terms, first, gaps)``: the record's specs under ``io`` as flat :func:`regions.stat_terms`
    (``(None, None)`` for a slot that is no spec), the first slot holding an integer float64 would
    round (inf: none), and whether any term is None."""
    row: list = []
    first, gaps = math.inf, False
    for n, spec in enumerate(record.get(io) or ()):
        try:                   # the usual spec: both statistics floats
            st = spec["stats"]
            mean, norm = st["mean"], st["norm"]
            if type(mean) is float and type(norm) is float:
                row += (sized_mean(mean, norm, spec.get("shape")), norm)
                continue
        except (KeyError, TypeError, IndexError):
            pass
        terms = stat_terms(spec) if isinstance(spec, dict) else (None, None)
        for v in terms:
            if isinstance(v, int) and abs(v) > 2 ** 52 and first > n:
                first = n
            gaps = gaps or v is None
        row += terms
    return row, first, gaps


class _Terms(NamedTuple):
    """:func:`_stat_row` of many records of one run and one side (inputs or outputs), as columns:
    each record's terms a stretch of ``values`` (``start``, ``length``, indexed by record), the
    terms that are None flagged in ``known`` (None where none is), and per record the first slot
    holding an integer float64 would round (``first``, inf: none; such a term is stored as 0.0 and
    never read: a group measuring that slot is left out)."""

    values: np.ndarray
    known: np.ndarray | None
    start: np.ndarray
    length: np.ndarray
    first: np.ndarray
    odd: bool           # any record with such an integer


def _stat_columns(recs: list, idx, io: str) -> _Terms:
    """:class:`_Terms` of records ``idx``: the usual record (every spec's mean and norm floats) read
    in one loop without a call per record, the others by :func:`_stat_row`."""
    flat: list = []
    lens = []
    firsts, holes = {}, False
    for i in idx:
        mark = len(flat)
        try:
            for spec in recs[i].get(io) or ():
                st = spec["stats"]
                mean, norm = st["mean"], st["norm"]
                if type(mean) is not float or type(norm) is not float:
                    raise TypeError
                shape = spec.get("shape")      # regions.sized_mean, inline: a call per tensor otherwise
                if isinstance(shape, (list, tuple)) and isfinite(mean + norm) and (n := prod(shape)) > 0:
                    mean = mean + 2.0 * norm / sqrt(n)
                flat += (mean, norm)
        except (KeyError, TypeError, IndexError):
            del flat[mark:]
            row, first, gaps = _stat_row(recs[i], io)
            holes = holes or gaps
            if first != math.inf:
                firsts[i] = first
                row = [0.0 if isinstance(v, int) and abs(v) > 2 ** 52 else v for v in row]
            flat += row
        lens.append(len(flat) - mark)
    n = len(recs)
    start, length, first = np.zeros(n, np.int64), np.zeros(n, np.int64), np.full(n, math.inf)
    at = np.array(idx, np.int64)
    length[at] = lens
    start[at] = np.cumsum(length[at]) - length[at]
    for i, f in firsts.items():
        first[i] = f
    known = None
    if holes:
        known = np.array([v is not None for v in flat], bool)
        flat = [0.0 if v is None else v for v in flat]
    return _Terms(np.array(flat, float), known, start, length, first, bool(firsts))


def _gathered(terms: _Terms, cands: np.ndarray, width: int) -> tuple:
    """The first ``width`` slots' terms of records ``cands`` (any shape) as an array of shape
    ``cands.shape + (width, 2)``: slots a record lacks (or a None term) are 0.0 and flagged False
    in the mask returned beside (None where every term is there)."""
    col = np.arange(2 * width)
    take = terms.start[cands][..., None] + col
    valid = col < terms.length[cands][..., None]
    take = np.where(valid, take, 0)
    vals = np.where(valid, terms.values[take], 0.0) if len(terms.values) else np.zeros(take.shape)
    mask = valid if terms.known is None else valid & terms.known[take]
    shape = cands.shape + (width, 2)
    return vals.reshape(shape), None if mask.all() else mask.reshape(shape)


# elements of the largest array _closeness_many makes at once (8 bytes each)
_CHUNK = 1 << 22


def _closeness_many(recs_a: list, recs_b: list, groups: list):
    """:func:`_closeness` of many groups ``(cand_a, cand_b)`` at once, their outputs' and inputs'
    distances summed (``far_out + far_in``): groups of one size and width computed together, the
    same IEEE operations in the same order, so each matrix equals the group's own bit for bit.
    Yields ``(group indices, far)`` with ``far`` of shape ``(len(indices), len(cand_a),
    len(cand_b))``; a group holding an integer statistic float64 would round is left out.  Each
    record's statistics are read once into columns (:class:`_Terms`), the groups' taken from them
    by numpy."""
    if not groups:
        return
    terms = {}
    widths = []      # per io: each group's width (slots both sides measure), -1 where left out
    for side, recs in ((0, recs_a), (1, recs_b)):
        wanted = sorted({i for cands in groups for i in cands[side]})
        for io in ("outputs", "inputs"):
            terms[side, io] = _stat_columns(recs, wanted, io)
    sizes = [np.fromiter((len(c[side]) for c in groups), np.int64, count=len(groups)) for side in (0, 1)]
    flat = [np.fromiter(itertools.chain.from_iterable(c[side] for c in groups), np.int64,
                        count=int(sizes[side].sum())) for side in (0, 1)]
    starts = [np.cumsum(n) - n for n in sizes]
    for io in ("outputs", "inputs"):
        most = [np.maximum.reduceat(terms[side, io].length[flat[side]], starts[side]) // 2 for side in (0, 1)]
        width = np.minimum(*most)
        if terms[0, io].odd or terms[1, io].odd:
            lowest = [np.minimum.reduceat(terms[side, io].first[flat[side]], starts[side]) for side in (0, 1)]
            width = np.where((lowest[0] < width) | (lowest[1] < width), -1, width)
        widths.append(width)
    keep = (widths[0] >= 0) & (widths[1] >= 0)
    buckets: dict = {}
    for g, key in zip(np.flatnonzero(keep).tolist(),
                      zip(sizes[0][keep].tolist(), sizes[1][keep].tolist(), widths[0][keep].tolist(),
                          widths[1][keep].tolist())):
        buckets.setdefault(key, []).append(g)
    for (na, nb, w_out, w_in), members in buckets.items():
        per = max(1, _CHUNK // (na * nb * max(w_out, w_in, 1) * 2))
        for begin in range(0, len(members), per):
            idx = members[begin:begin + per]
            cands = [np.array([groups[g][side] for g in idx], np.int64).reshape(len(idx), n)
                     for side, n in ((0, na), (1, nb))]
            far = None
            for io, width in (("outputs", w_out), ("inputs", w_in)):
                if width:
                    (va, ka), (vb, kb) = (_gathered(terms[side, io], cands[side], width) for side in (0, 1))
                    va, vb = va[:, :, None], vb[:, None]
                    rel = _relative_gaps(va, vb)
                    if ka is not None or kb is not None:
                        both = (np.ones(va.shape, bool) if ka is None else ka[:, :, None]) & \
                            (np.ones(vb.shape, bool) if kb is None else kb[:, None])
                        rel = np.where(both, rel, 0.0)
                    d = np.cumsum(rel[..., 0] + rel[..., 1], axis=-1)[..., -1]
                else:
                    d = np.zeros((len(idx), na, nb))
                d = np.where(np.isfinite(d), d, np.inf)
                far = d if far is None else far + d
            yield idx, far


def _pair_leftovers(recs_a: list, recs_b: list, gaps: list, key, mapping: Mapping, pairs: list) -> list:
    """Records no ordered pass could pair, paired by equal ``(scope, op, shapes)`` wherever they sit
    in the stage's phase (:func:`regions.by_phase`), the closest statistics first: two frameworks'
    autodiff may run a stage's independent ops in other orders (attention's four backward matmuls),
    never a loss's op on one side of the backward with an optimizer's on the other.  Returns the gaps
    less what paired."""
    left_a = [i for ga, _ in gaps for i in ga]
    left_b = [j for _, gb in gaps for j in gb]
    phase_a, phase_b = phases(recs_a), phases(recs_b)
    by_key: dict = {}
    for j in left_b:
        by_key.setdefault((phase_b[j], key(recs_b[j], Mapping())), []).append(j)
    cands = []
    for i in left_a:
        for j in by_key.get((phase_a[i], key(recs_a[i], mapping)), ()):
            # ties go by the two positions together, the same whichever run is A
            cands.append((_output_distance(recs_a[i], recs_b[j]), i + j, abs(i - j), i, j))
    used_a, used_b = set(), set()
    for *_, i, j in sorted(cands):
        if i not in used_a and j not in used_b:
            used_a.add(i)
            used_b.add(j)
            pairs.append((i, j, "op+shapes, by statistics"))
    return [([i for i in ga if i not in used_a], [j for j in gb if j not in used_b]) for ga, gb in gaps]


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


def _output_distance(ra: dict, rb: dict) -> float:
    return sum(stats_distance(sa, sb) for sa, sb in zip(ra.get("outputs") or (), rb.get("outputs") or ()))


# Above this many pairs of one key (a loop inside one module), re-paired within consecutive runs only.
_MAX_GROUP = 64


def pair_runs_by_stats(pairs: list, recs_a: list, recs_b: list) -> list:
    """Pairs whose records share kind, stage, scope, op and output shapes (batch dimensions merged)
    and dtype kinds are re-paired among themselves by closest output statistics, the order breaking ties: two
    frameworks may run equal ops in other orders (the two backward ``mul`` of a product, attention's
    backward matmuls).  A key with more than ``_MAX_GROUP`` pairs is re-paired within runs of
    consecutive pairs only."""
    def key(r):
        return r["kind"], r["stage"], r["scope"], r["op"], _cross_shapes(r)
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


def _by_stage_kind(recs: list) -> dict:
    """(stage, kind) -> the indices of its records, in order: one pass over a part's records."""
    out: dict = {}
    for i, r in enumerate(recs):
        key = r["stage"], r["kind"]
        got = out.get(key)
        if got is None:
            out[key] = [i]
        else:
            got.append(i)
    return out


def align(recs_a: list, recs_b: list, match: str = "fuzzy", mapping: Mapping | None = None,
          by_stats: bool = False) -> Alignment:
    """Align two parts' records (ops per stage, modules by scope); pairs sorted by A's order.
    ``by_stats`` (runs of two frameworks): equal-key runs paired by closest statistics
    (:func:`pair_runs_by_stats`), spans each run computes differently compared as regions
    (:func:`regions.compare_regions`: ``Alignment.records`` gives the records they pair)."""
    mapping = mapping or Mapping()
    pairs, only_a, only_b, spans = [], [], [], []
    made = (producers(recs_a), producers(recs_b)) if by_stats else ()
    parts_a, parts_b = _by_stage_kind(recs_a), _by_stage_kind(recs_b)
    for stage in ("forward", "backward"):
        for kind in ("op", "module"):
            ia, ib = parts_a.pop((stage, kind), []), parts_b.pop((stage, kind), [])
            if kind == "module":
                al = align_modules(recs_a, recs_b, ia, ib, mapping)
            elif match == "exact":
                al = align_exact(recs_a, recs_b, ia, ib, mapping)
            else:
                al = align_ops(recs_a, recs_b, ia, ib, mapping, cross=by_stats, made=made)
            pairs += al.pairs
            spans += al.spans
            only_a += al.only_a
            only_b += al.only_b
    # records of any other stage count as unmatched rather than vanish
    only_a += [i for (stage, _), idx in parts_a.items() if stage not in ("forward", "backward") for i in idx]
    only_b += [i for (stage, _), idx in parts_b.items() if stage not in ("forward", "backward") for i in idx]
    pairs = pair_runs_by_stats(pairs, recs_a, recs_b) if by_stats else sorted(pairs)
    inside, regions = {}, {}
    if spans:   # every stage paired: what a region hands on is known by who reads it
        region_pairs, regions, inside = compare_regions(recs_a, recs_b, spans, pairs)
        pairs = sorted(pairs + region_pairs)
        last_a, last_b = {i for i, _, _ in region_pairs}, {j for _, j, _ in region_pairs}
        only_a, only_b = [i for i in only_a if i not in last_a], [j for j in only_b if j not in last_b]
    return Alignment(pairs, sorted(only_a), sorted(only_b), inside, regions)
