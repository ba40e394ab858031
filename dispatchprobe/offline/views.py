"""Values read through a view no record shows (numpy-free, never imports torch).

A probe records no view op by default (``include_views``), and autograd makes views without one, so
an op may read ``x.expand(...)`` (``repeat_kv``), ``x.chunk(2)[0]``, ``x[..., :8]`` or ``x[i]`` of a
value some record made, while the statistics it records are not that value's: an expand repeats
elements (its norm grows by the square root of the repeats), a slice holds a part of them.  Found by
saved-tensor key or by dtype and statistics alone, such a value has no producer, and a compare then
says the runs differ "at their inputs" where a difference entered inside the model.

Its layout says it is such a view: a stride of 0 (repeated elements), or a span of memory larger than
its elements (a part of something larger).  :class:`ViewIndex` keeps the recent outputs and names,
for such a value, the latest one of its dtype and device it can be a view of: large enough to hold
its span, and with statistics it can come from (for an expand of a whole value, preferred: equal
maximum and minimum, the same mean and the norm times the root of the repeats; for a part: a range
within the value's, a norm no larger and no more nan/inf).  A part is inferred, not proven: what
reads the link checks it (a view of a value that agrees cannot differ).  The look-up runs only for
an input found neither by saved-tensor key nor by dtype and statistics whose layout is a view's, or
that may be a contiguous piece of a collective's flat buffer (below).

A collective's result is a flat buffer that frameworks hand out in contiguous pieces: FSDP2 gives the
optimizer each gradient as a view into its reduce-scatter's output, DDP's ``gradient_as_bucket_view``
each gradient as a view into its all-reduced bucket.  Such a piece has a plain contiguous layout, so
nothing in its record says it is a view; :meth:`ViewIndex.holders` lists the recent collective
results that can hold it (:func:`flat_buffer`), never every output, where a small value's statistics
fit inside many an unrelated larger one's."""

from __future__ import annotations

import math
from typing import NamedTuple

from ..core.collective_roles import role

# how far a pure expand's mean and norm may be from its base's (both summed in float32, in another order)
STATS_TOLERANCE = 1e-5
# how many earlier outputs of one dtype a view is looked for among
LOOK_BACK = 64


class Layout(NamedTuple):
    """How a value sits in memory, as its shape and strides say."""

    numel: int      # elements read
    repeats: int    # how often each element is read (the product of the stride-0 dimensions)
    span: int       # memory elements from its first element to its last one


def layout(spec: dict) -> Layout | None:
    """A tensor spec's :class:`Layout`, or None where shape or stride is not recorded (or it holds no
    element).  A 0-dim value is one element: the base of the expand a mean's backward reads.  A part's
    tensors share a few dozen shapes and strides: each pair is worked out once."""
    shape, stride = spec.get("shape"), spec.get("stride")
    if shape is None or stride is None or len(stride) != len(shape):
        return None
    try:
        key = (*shape, None, *stride)
        known = _LAYOUTS.get(key, _UNKNOWN)
    except TypeError:          # an unhashable size: worked out each time
        return _layout(shape, stride)
    if known is _UNKNOWN:
        if len(_LAYOUTS) >= _LAYOUTS_KEPT:
            _LAYOUTS.clear()
        known = _LAYOUTS[key] = _layout(shape, stride)
    return known


_LAYOUTS: dict = {}       # (*shape, None, *stride) -> its Layout (or None)
_LAYOUTS_KEPT = 4096
_UNKNOWN = object()


def _layout(shape: list, stride: list) -> Layout | None:
    numel = repeats = span = 1
    for n, s in zip(shape, stride):
        if not isinstance(n, int) or not isinstance(s, int):
            return None        # a symbolic size
        numel *= n
        if n > 1:
            if s == 0:
                repeats *= n
            else:
                span += (n - 1) * abs(s)
    return Layout(numel, repeats, span) if numel else None


def is_view(lay: Layout | None) -> bool:
    """The layout of a view of another value: repeated elements, or gaps in its memory."""
    return lay is not None and (lay.repeats > 1 or lay.span > lay.numel)


class _Stats(NamedTuple):
    """A value's recorded statistics, as the containment tests read them."""

    max: float
    min: float
    mean: float
    norm: float
    nan: int
    inf: int


def _stats(spec: dict) -> _Stats | None:
    """A spec's :class:`_Stats`, or None where one is missing or nan (nan compares with nothing)."""
    st = spec.get("stats") or {}
    vals = [st.get(k) for k in _Stats._fields]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
        return None
    if any(v != v for v in vals):
        return None
    return _Stats(*vals)


def _close(x: float, y: float, scale: float) -> bool:
    return abs(x - y) <= STATS_TOLERANCE * scale


def can_view(view: _Stats, lay: Layout, base: _Stats, base_lay: Layout, whole: bool) -> bool:
    """Whether a value of statistics ``view`` and layout ``lay`` can be a view of ``base``'s values:
    ``whole``, an expand of all of them (its statistics follow from the base's), else a part of them
    (possibly repeated)."""
    if lay.span > base_lay.span or view.max > base.max or view.min < base.min:
        return False
    distinct = lay.numel // lay.repeats
    if view.nan > base.nan * lay.repeats or view.inf > base.inf * lay.repeats:
        return False
    norm = view.norm / math.sqrt(lay.repeats)
    if whole:
        rms = base.norm / math.sqrt(base_lay.numel)
        return lay.repeats > 1 and distinct == base_lay.numel and view.max == base.max and view.min == base.min \
            and view.nan == base.nan * lay.repeats and _close(view.mean, base.mean, rms + abs(base.mean)) \
            and _close(norm, base.norm, base.norm)
    return distinct < base_lay.numel and norm <= base.norm * (1 + STATS_TOLERANCE)


def flat_buffer(record: dict, arg: str) -> bool:
    """Output ``arg`` of ``record`` is a collective's result (``output.0`` of an all-reduce, an
    all-gather, a reduce-scatter, ...): a flat buffer frameworks hand out in contiguous pieces."""
    got = role(record.get("op", "")) if record.get("kind") == "op" else None
    return got is not None and got.result is not None and arg.startswith(got.result)


class ViewIndex:
    """The outputs made so far by dtype and device, to find the value an unrecorded view was taken of.
    Adding an output costs one append; an output's layout and statistics are read the first time a
    view is looked for among the outputs before it, once."""

    def __init__(self):
        self.outputs: dict = {}    # (dtype, device) -> [[spec, entry, (stats, layout) once read]], in order
        self.flat: dict = {}       # the same, of the collectives' results only (:func:`flat_buffer`)

    def add(self, spec: dict, entry, flat: bool = False) -> None:
        """Output ``spec`` was made (``entry``: what the caller's data flow says of its producer);
        ``flat``: it is a collective's result, whose contiguous pieces are looked for too."""
        item = [spec, entry, None]
        key = (spec.get("dtype"), spec.get("device"))
        self.outputs.setdefault(key, []).append(item)
        if flat:
            self.flat.setdefault(key, []).append(item)

    def find(self, spec: dict):
        """The entry of the latest output input ``spec`` can be an unrecorded view of, or None (its
        layout is no view's, or no recent output can hold it).  An expand whose statistics follow
        from an output's (all of it, repeated) is that output's, before any later output it could
        be a part of."""
        lay = layout(spec)
        if not is_view(lay) or (st := _stats(spec)) is None:
            return None
        recent = self.outputs.get((spec.get("dtype"), spec.get("device")), [])[-LOOK_BACK:]
        for whole in (True, False) if lay.repeats > 1 else (False,):
            for item in reversed(recent):
                if _holds(item, st, lay, whole):
                    return item[1]
        return None

    def holders(self, spec: dict) -> list:
        """The entries of the recent collective results a value of no view's layout can be a
        contiguous piece of, latest first.  Statistics alone leave several (a gradient's values fit
        inside its neighbours' buffers too), so none of them is its producer by itself: a caller
        comparing two runs keeps the one both runs find at the same collective
        (``compare.origin.Lineage.common_piece``)."""
        recent = self.flat.get((spec.get("dtype"), spec.get("device")), [])[-LOOK_BACK:]
        lay = layout(spec) if recent else None
        if lay is None or is_view(lay) or (st := _stats(spec)) is None:
            return []
        return [item[1] for item in reversed(recent) if _holds(item, st, lay, False)]


def _holds(item: list, st: _Stats, lay: Layout, whole: bool) -> bool:
    """Whether indexed output ``item`` can hold a value of statistics ``st`` and layout ``lay``
    (:func:`can_view`); its own statistics and layout read on first use."""
    if item[2] is None:
        item[2] = _stats(item[0]), layout(item[0])
    base_st, base_lay = item[2]
    return base_st is not None and base_lay is not None and can_view(st, lay, base_st, base_lay, whole)
