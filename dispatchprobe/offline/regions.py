"""Regions: spans of records two runs compute differently, compared by their data flow (numpy-free,
never imports torch).

Two frameworks often compute one piece of a model with different ops: MindSpore's
``nn.CrossEntropyLoss`` runs ~30 primitives where PyTorch's ``F.cross_entropy`` runs
``_log_softmax`` and ``nll_loss_forward``, wherever each sits (in a cell of its own, or at top
level outside every module).  Op by op they cannot pair; pairing them by shape alone compares a
subtraction with a log-softmax.  So the records each run holds between the same two paired records
(a *span*) are one region, compared at its boundary: the values entering it (read by its records,
made by none of them: paired by size and closest statistics) and the values leaving it (made
there and read by a record outside it: paired by the paired record that reads them, and the
region's result, its last record's outputs, in order).  The region's last record stands for the
region in the comparison (``op`` ``region(N ops: first .. last)``), its other records are listed as
"inside a region compared at its boundary"; a difference made inside it is named at the region.
"""

from __future__ import annotations

import math

from ..core import op_traits
from ..records.format import walk
from .views import ViewIndex

_NONE = {"type": "none"}


def stats_distance(sa: dict, sb: dict) -> float:
    """How far apart two tensor specs' statistics are (relative differences of mean, measured
    against the values' size, and norm; 0 where either lacks them): what pairs values when order
    cannot."""
    return terms_distance(stat_terms(sa), stat_terms(sb))


def stat_terms(spec: dict) -> tuple:
    """A spec's mean (:func:`sized_mean`) and norm as :func:`terms_distance` reads them (None where
    not a number): read once per record where one record is measured against many."""
    st = spec.get("stats") or {}
    mean, norm = (x if isinstance(x := st.get(k), (int, float)) else None for k in ("mean", "norm"))
    return sized_mean(mean, norm, spec.get("shape")), norm


def sized_mean(mean, norm, shape) -> float | None:
    """The mean shifted by twice the values' root mean square (``norm / sqrt(n)``), which bounds
    its size, so the term lies between one and three of them.  Why: a mean whose terms cancel (a
    centred gradient's, 1e-10 of values near 1e-2) differs between two runs by rounding noise that
    is any size relative to the mean itself, and such noise decided which calls paired (an eager
    and a compiled run's optimizer steps paired one bias with another); against the values' size it
    is as small as it is.  Unchanged where not both floats or the size is unknown."""
    if type(mean) is not float or type(norm) is not float or not isinstance(shape, (list, tuple)) \
            or not math.isfinite(mean + norm):     # an infinite value has no size to shift by (-inf + inf: nan)
        return mean
    n = math.prod(shape)
    return mean + 2.0 * norm / math.sqrt(n) if n > 0 else mean


def terms_distance(ta: tuple, tb: tuple) -> float:
    """:func:`stats_distance` of two specs' :func:`stat_terms`: infinite where a statistic is nan
    (values holding nan are as far from everything as can be).  Why not nan: every comparison with
    nan is false, so ``crossed >= straight`` chose to exchange a multiply's operands where one of
    them held nan, and a sort of distances holding nan orders the others arbitrarily."""
    total = 0.0
    for x, y in zip(ta, tb):
        if x is not None and y is not None:
            total += relative_gap(x, y)
    return total if total == total else math.inf


def relative_gap(x: float, y: float) -> float:
    """``|x - y| / (|x| + |y|)``, between 0 and 1, with infinities at its limits: 0 where the two
    are equal (``-inf`` and ``-inf``), 1 where one is infinite and the other is not equal (``-inf``
    against ``0``, against ``inf``).  Why: a mask's fill constant is ``-inf``, and the plain formula
    gives nan for every pair holding one, so statistics could not pair two such calls by value and
    the order paired a ``-inf`` with a ``0``.  A nan statistic stays nan (far from everything)."""
    gap = abs(x - y) / (abs(x) + abs(y) + 1e-30)
    if math.isnan(gap) and not math.isnan(x) and not math.isnan(y):
        return 0.0 if x == y else 1.0
    return gap


def _value_keys(spec: dict) -> list:
    """What recognises a value across records: its saved-tensor key and its dtype + statistics."""
    st = spec.get("stats")
    return [k for k in (spec.get("data"), (spec.get("dtype"), *map(str, st.values())) if st else None) if k is not None]


def _key(spec: dict):
    keys = _value_keys(spec)
    return keys[0] if keys else None


def _tensors(specs) -> list:
    return [s for s in specs or () if s.get("type") == "tensor"]


# ---- which spans are regions ----------------------------------------------------------------------
def region_spans(recs_a: list, recs_b: list, gaps: list, key, mapping, pairs: list) -> tuple[list, list]:
    """Split one stage's gaps (``[(ia, ib)]``: records no pass could pair, each run's between the
    same paired records) into those left unpaired and the spans to compare as regions: both runs
    hold compute records there.  A lone record on each side with equal ``key`` (scope, cast or
    compute, shapes) is a substituted kernel: paired as one (``pairs``).  A record at a span's end
    in the module of the paired record beside it, a module the other run's span does not enter
    (a hook scaling a layer's output, next to a loss region), belongs to that module: it stays
    unpaired."""
    paired_a = {i for i, _, _ in pairs}
    paired_b = {j for _, j, _ in pairs}
    none = type(mapping)()
    left, spans = [], []
    for ga, gb in by_phase(recs_a, recs_b, gaps):
        if not (_computes(recs_a, ga) and _computes(recs_b, gb)):
            left.append((ga, gb))
            continue
        if len(ga) == 1 and len(gb) == 1 and key(recs_a[ga[0]], mapping) == key(recs_b[gb[0]], none):
            pairs.append((ga[0], gb[0], "shapes"))
            continue
        scopes_a = {mapping.scope(recs_a[i]["scope"]) if mapping else recs_a[i]["scope"] for i in ga}
        scopes_b = {recs_b[j]["scope"] for j in gb}
        ka, out_a = _trim(recs_a, ga, paired_a, scopes_b, mapping)
        kb, out_b = _trim(recs_b, gb, paired_b, scopes_a, none)
        if _computes(recs_a, ka) and _computes(recs_b, kb):
            spans.append((ka, kb))
            left.append((out_a, out_b))
        else:
            left.append((ga, gb))
    return left, spans


def by_phase(recs_a: list, recs_b: list, gaps: list) -> list:
    """``gaps`` split at the backward: the loss a step computes before its backward and the optimizer
    step after it sit in one gap of the forward stage (both at top level), yet are no one region (a
    MindSpore ``Adam`` primitive per parameter against PyTorch's Adam ops would swallow the loss).
    The pieces pair by phase (:func:`phases`); a phase one run alone has stays unpaired."""
    phase_a, phase_b = phases(recs_a), phases(recs_b)
    out = []
    for ga, gb in gaps:
        pa, pb = _group(ga, phase_a), _group(gb, phase_b)
        if len(pa) < 2 and len(pb) < 2 and pa.keys() == pb.keys():
            out.append((ga, gb))
            continue
        out.extend((pa.get(k, []), pb.get(k, [])) for k in sorted(pa.keys() | pb.keys()))
    return out


def phases(recs: list) -> list:
    """Each record's phase: 0 before the part's first backward op, 1 from it on.  Only that first
    one counts: a compiled graph runs its optimizer kernels as soon as each gradient is ready, between
    backward kernels, where an eager run's follow the whole backward.  A forward op after it that
    goes on computing the forward (it reads values of phase 0's forward records, none of the
    backward's, and writes no input in place as an optimizer's state update does) stays in phase 0:
    a MindSpore graph runs backward kernels that need no loss before the loss's last kernels, which
    would else be no counterparts of the other run's."""
    first = next((i for i, r in enumerate(recs) if r["kind"] == "op" and r["stage"] == "backward"), len(recs))
    out = [0] * first + [1] * (len(recs) - first)
    if first == len(recs):
        return out
    alias, made = _aliases(recs), {}     # value key -> the phase its maker's value belongs to
    for i, r in enumerate(recs):
        if i >= first and r["kind"] == "op" and r["stage"] == "forward" and _continues_forward(r, made, alias):
            out[i] = 0
        later = 1 if r["stage"] == "backward" else out[i]
        for _, _, spec in walk(r, inputs=False):
            made.update((_resolve(k, alias), later) for k in _value_keys(spec))
    return out


def _continues_forward(record: dict, made: dict, alias: dict) -> bool:
    """Whether ``record`` reads a value a phase-0 forward record made and none of a later phase, and
    is no in-place aten op (``step += 1``: its scalar's statistics may equal a forward value's)."""
    if op_traits.writes_in_place(record["op"]):
        return False
    read = {made.get(_resolve(k, alias)) for _, _, spec in walk(record, outputs=False) for k in _value_keys(spec)}
    return 0 in read and 1 not in read


def _group(idx: list, phases: list) -> dict:
    out: dict = {}
    for i in idx:
        out.setdefault(phases[i], []).append(i)
    return out


def _computes(recs: list, idx: list) -> bool:
    return any(recs[i]["kind"] == "op" and not op_traits.is_cast(recs[i]["op"]) for i in idx)


def _trim(recs: list, g: list, paired: set, other_scopes: set, mapping) -> tuple[list, list]:
    """``g`` less its end records that sit in the module of the paired record beside them, where
    the other run's span has no record in that module: (kept, trimmed)."""
    def scope(i):
        return mapping.scope(recs[i]["scope"]) if mapping else recs[i]["scope"]

    def beside(i, step):
        k = i + step
        while 0 <= k < len(recs) and recs[k]["stage"] == recs[i]["stage"]:
            if k in paired and recs[k]["kind"] == "op":
                return scope(k)
            k += step
        return None

    def own_module(i, step):
        s = scope(i)
        return bool(s) and s == beside(i, step) and not any(o == s or o.startswith(s + ".") for o in other_scopes)
    lo, hi = 0, len(g)
    while lo < hi - 1 and own_module(g[lo], -1):
        lo += 1
    while hi - 1 > lo and own_module(g[hi - 1], 1):
        hi -= 1
    return g[lo:hi], g[:lo] + g[hi:]


# ---- the values at a region's boundary -------------------------------------------------------------
def _entering(recs: list, idx: list) -> list:
    """The tensor values records ``idx`` read that none of them made (in order, each once): a
    region's inputs.  Left-out layout ops a record carries (``through``) pass a made value on."""
    made, seen, out = set(), set(), []
    for i in idx:
        r = recs[i]
        for t in r.get("through", ()):
            ins = _tensors(t.get("inputs"))
            if ins and made.intersection(_value_keys(ins[0])):
                made.update(k for s in _tensors(t.get("outputs")) for k in _value_keys(s))
        for io, _, spec in walk(r):
            keys = _value_keys(spec)
            if io == "output":
                made.update(keys)
            elif keys and not made.intersection(keys) and not seen.intersection(keys):
                seen.update(keys)
                out.append(spec)
    return out


def _region_inputs(xa: list, xb: list, most: float = 0.05, most_scalar: float = 1e-6) -> list:
    """Two regions' entering values paired by size and closest statistics (at most ``most`` apart:
    a value one framework's region reads and the other's does not, such as a softmax where the other
    reads a log-softmax, stays out); in A's order.  A single number says nothing of what it is, so
    it pairs only with an equal one (``most_scalar``): an optimizer's state scalars (MindSpore's
    beta powers, 0.999, PyTorch's step counts, 1.0) are no counterparts, however close."""
    def numel(s):
        return math.prod(s.get("shape") or ())

    def whole(s):
        return str(s.get("dtype", "")).startswith(("int", "uint", "bool"))
    cands = sorted((stats_distance(sa, sb), x + y, x, y) for x, sa in enumerate(xa) for y, sb in enumerate(xb)
                   if numel(sa) == numel(sb) and whole(sa) == whole(sb))
    used_a, used_b, out = set(), set(), []
    for d, _, x, y in cands:
        if d <= (most if numel(xa[x]) > 1 else most_scalar) and x not in used_a and y not in used_b:
            used_a.add(x)
            used_b.add(y)
            out.append((x, xa[x], xb[y]))
    return [(sa, sb) for _, sa, sb in sorted(out, key=lambda t: t[0])]


def _aliases(recs: list) -> dict:
    """value key -> the key of the value it is a layout of (a left-out reshape or transpose a
    record carries in ``through``)."""
    alias: dict = {}
    for r in recs:
        for t in r.get("through", ()):
            ins = _tensors(t.get("inputs"))
            if ins and (src := _key(ins[0])) is not None:
                for s in _tensors(t.get("outputs")):
                    if (k := _key(s)) is not None and k != src:
                        alias[k] = src
    return alias


def _resolve(k, alias: dict):
    hops = 0
    while k in alias and hops < 8:
        k, hops = alias[k], hops + 1
    return k


def _readers(recs: list) -> dict:
    """value key -> [(record index, input arg)] of every record reading it; a value read through
    a left-out layout op (``through``: a reshape, a transpose) counts as read itself."""
    alias = _aliases(recs)
    out: dict = {}
    for i, r in enumerate(recs):
        for _, arg, spec in walk(r, outputs=False):
            for k in {_resolve(k, alias) for k in _value_keys(spec)}:
                out.setdefault(k, []).append((i, arg))
    return out


def producers(recs: list) -> list:
    """Per record, the records of its own stage that made its tensor inputs (a set): the data
    flow :func:`fed_alike` checks a pair by.  An input is found by saved-tensor key, else by dtype
    and statistics (a reshape autograd made keeps them), else as a view no record shows of an
    earlier output (an expand, a slice: :class:`.views.ViewIndex`)."""
    alias, made, out, views = _aliases(recs), {}, [], ViewIndex()
    for i, r in enumerate(recs):
        got = set()
        for io, _, spec in walk(r):
            keys = [_resolve(k, alias) for k in _value_keys(spec)]
            if io == "input":
                p = next((made[k] for k in keys if k in made), None)
                if p is None and r["kind"] == "op":
                    p = views.find(spec)
                if p is not None and recs[p]["stage"] == r["stage"]:
                    got.add(p)
            else:
                made.update((k, i) for k in keys)
                views.add(spec, i)
        out.append(got)
    return out


def fed_alike(found: list, pairs: list, made_a: list, made_b: list) -> list:
    """``found``'s pairs (records one substitutes for the other: other ops of one shape) whose
    inputs come from paired records alike (or from no record of the stage): a subtraction inside a
    loss reads a maximum no paired record made, so it is no counterpart of the other run's
    log-softmax.  Repeated until no pair is left out (a chain of substitutes)."""
    kept = list(found)
    while True:
        pair_b = {i: j for i, j, _ in pairs} | {i: j for i, j, _ in kept}
        pair_a = {j: i for i, j in pair_b.items()}
        ok = [p for p in kept if all(pair_b.get(x) in made_b[p[1]] for x in made_a[p[0]])
              and all(pair_a.get(y) in made_a[p[0]] for y in made_b[p[1]])]
        if len(ok) == len(kept):
            return kept
        kept = ok


def _leaving(recs: list, group: list, readers: dict) -> list:
    """[(spec, readers outside the region, position among the region's results or None)] of the
    values region ``group`` makes that a record outside it reads later (its own stage's or the
    next), and of its last record's outputs (the region's result); in the order they are made.
    Values are told apart by saved-tensor key, else by dtype and statistics.  The result is the last
    record's that computes from values, not a constant of their shape after it (autograd's
    ``ones_like`` seed of the backward, which one run records in the forward and the other not)."""
    inside, at, out = set(group), {}, []
    last = next((i for i in reversed(group) if not op_traits.reads_metadata_only(recs[i]["op"])), group[-1])
    for i in group:
        for n, (_, _, spec) in enumerate(walk(recs[i], inputs=False)):
            k = _key(spec)
            if k is None:
                continue
            result = n if i == last else None
            if k in at:
                if result is not None and out[at[k]][2] is None:
                    out[at[k]][2] = result
                continue
            outside = sorted({(c, arg) for key in _value_keys(spec) for c, arg in readers.get(key, ())
                              if c > i and c not in inside})
            if outside or result is not None:
                at[k] = len(out)
                out.append([spec, outside, result])
    return out


def _region_outputs(la: list, lb: list, pair_b: dict) -> list:
    """Two regions' leaving values paired: those a pair of records reads at the same argument, then
    those a pair of records reads (of one size), then the regions' results (their last records'
    outputs) in order; [(index in la, index in lb)] in A's order.  Candidates are taken by kind,
    then by both positions together: the same pairs whichever run is A."""
    def numel(s):
        return math.prod(s.get("shape") or ())
    by_reader: dict = {}
    for y, (_, rd, _) in enumerate(lb):
        for c, arg in rd:
            by_reader.setdefault(c, []).append((arg, y))
    cands = set()
    for x, (sa, rd, _) in enumerate(la):
        for c, arg in rd:
            for a, y in by_reader.get(pair_b.get(c), ()):
                if a == arg:
                    cands.add((0, x + y, x, y))
                elif numel(lb[y][0]) == numel(sa):
                    cands.add((1, x + y, x, y))
    ra = sorted((n, x) for x, (_, _, n) in enumerate(la) if n is not None)
    rb = sorted((n, y) for y, (_, _, n) in enumerate(lb) if n is not None)
    cands.update((2 + k, x + y, x, y) for k, ((_, x), (_, y)) in enumerate(zip(ra, rb))
                 if numel(la[x][0]) == numel(lb[y][0]))
    used_a, used_b, out = set(), set(), []
    for *_, x, y in sorted(cands):
        if x not in used_a and y not in used_b:
            used_a.add(x)
            used_b.add(y)
            out.append((x, y))
    return sorted(out)


def common_scope(scopes) -> str:
    """The innermost module holding every scope ("" when one is at top level)."""
    common = None
    for s in scopes:
        parts = s.split(".") if s else []
        if common is None:
            common = parts
            continue
        n = 0
        while n < min(len(common), len(parts)) and common[n] == parts[n]:
            n += 1
        common = common[:n]
    return ".".join(common or [])


def _region_record(recs: list, group: list, inputs: list, outputs: list) -> dict:
    """The record standing for region ``group``: its last record with the region's boundary values."""
    op = op_traits.region_label([recs[i]["op"] for i in group])
    # where it sits: its computing records' modules (a cast of its input at top level, PyTorch's
    # ``.long()`` of the token ids before an embedding, does not move it out of the embedding)
    computing = [i for i in group if not op_traits.is_cast(recs[i]["op"])] or group
    new = dict(recs[group[-1]], op=op, scope=common_scope(recs[i]["scope"] for i in computing),
               inputs=inputs, outputs=outputs, kwargs={}, region=[recs[i]["name"] for i in group])
    new.pop("fused", None)
    return new


def compare_regions(recs_a: list, recs_b: list, spans: list, pairs: list) -> tuple[list, dict, dict]:
    """Each span (``[(ia, ib)]``, :func:`region_spans`) as a region compared at its boundary,
    once every stage is paired (``pairs``: a value a forward region makes may be read in backward).
    Returns (the regions' pairs: their last records, how "region boundary"; ``{(side, last index):
    the region's record}`` standing for each region; ``{(side, index): the region's scope}`` of the
    records inside).  Values of one run only are placed where the other run's record has none, so
    arguments pair by position."""
    pair_b = {i: j for i, j, _ in pairs}
    read_a, read_b = _readers(recs_a), _readers(recs_b)
    out_pairs, regions, inside = [], {}, {}
    for ga, gb in spans:
        ea, eb = _entering(recs_a, ga), _entering(recs_b, gb)
        ins = _region_inputs(ea, eb)
        in_a = [sa for sa, _ in ins] + [s for s in ea if not any(s is x for x, _ in ins)]
        in_b = [sb for _, sb in ins] + [_NONE] * (len(in_a) - len(ins)) + \
            [s for s in eb if not any(s is y for _, y in ins)]
        la, lb = _leaving(recs_a, ga, read_a), _leaving(recs_b, gb, read_b)
        outs = _region_outputs(la, lb, pair_b)
        got_a, got_b = [x for x, _ in outs], [y for _, y in outs]
        out_a = [la[x][0] for x in got_a] + [e[0] for x, e in enumerate(la) if x not in got_a]
        out_b = [lb[y][0] for y in got_b] + [_NONE] * (len(la) - len(got_a)) + \
            [e[0] for y, e in enumerate(lb) if y not in got_b]
        regions["a", ga[-1]] = _region_record(recs_a, ga, in_a, out_a)
        regions["b", gb[-1]] = _region_record(recs_b, gb, in_b, out_b)
        out_pairs.append((ga[-1], gb[-1], "region boundary"))
        for side, g in (("a", ga), ("b", gb)):
            label = regions[side, g[-1]]["scope"] or "<top>"
            inside.update({(side, i): label for i in g[:-1]})
    return out_pairs, regions, inside
