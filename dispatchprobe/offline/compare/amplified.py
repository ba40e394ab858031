"""Error rows that are a parameter moved apart by the optimizer amplifying rounding noise: where a
parameter's gradient is mathematically zero (an attention key bias: softmax is shift-invariant),
each run's gradient there is rounding noise of its own, and a normalising optimizer (Adam's
``m / (sqrt(v) + eps)``) turns any noise into an update of a sizeable part of the learning rate,
so the runs' parameters part although neither computation diverged.

Sound only where the traced facts say so, element by element: at every step up to the one that
made the value, the backward row that produced the gradient the optimizer applied passed (within
tolerance or by the cancellation rule); the elements that differ are exactly elements whose
gradient is at rounding level in both runs (below the rounding bound of its terms,
:func:`...standards.rounding.carried_bound` of that backward record, the cancellation rule's
bound) and differs between the runs (the noise itself: a changed optimizer with equal gradients
is not explained); with those elements held equal the value agrees.  Every error row of the step
must be such a value: the parameter's own (bitwise each run's value after an optimizer step), or,
with the optimizer stepping inside the probe, a value of the parameter's shape that the
optimizer's ops (the forward records after the step's backward) made (its moments, its update,
the parameter mid-step), never what the parameter feeds.  The same runs so get the same verdict
wherever ``opt.step()`` is.  A changed learning rate or optimizer moves elements with real
gradients and stays a divergence.

On statistics alone (no saved tensors) the same holds where a parameter's gradient is noise in
every element: the backward record that produced it is the one whose output has, in each run, the
gradient's statistics, shape size and dtype bit for bit (statistics are a function of the values);
where the gradient's norm is within that record's rounding bound in both runs, every element is
noise (none exceeds the norm), and where the two gradients' statistics differ, the noise differs.
Every element of the parameter is then explained, and a row is that parameter's value where its
statistics, shape and dtype equal, bit for bit in each run, the parameter's recorded value.  A
gradient only partly noise (a fused query/key/value bias) explains nothing on statistics: which
elements are noise they cannot tell."""

from __future__ import annotations

import json
import os
from typing import NamedTuple

import numpy as np
import pandas as pd

from ...records.reader import Part
from ...standards import statistics as S
from ...standards import verdicts as V
from ...standards.rounding import carried_bound
from .parallel import Value, param_specs, score

# the columns the rule reads of the backward outputs that may have produced a gradient
KEPT = ["arg", "shape_a", "shape_b", "dtype_a", "dtype_b", "data_a", "data_b",
        "status", "name_a", "name_b"] + [f"{k}_{side}" for k in S.KEYS for side in ("a", "b")]
_NORM = S.KEYS.index("norm")


def _array(part, key):
    if part is None or key is None or (isinstance(key, float) and np.isnan(key)):
        return None
    try:
        return part.tensor(key)
    except Exception:  # noqa: BLE001 - unreadable: this row is not explained
        return None


def _value(arr: np.ndarray) -> Value:
    return Value(tuple(arr.shape), str(arr.dtype), None, arr)


def _stats(stats) -> tuple | None:
    """Statistics in :data:`S.KEYS` order; None unless all are there and finite (a NaN equals nothing)."""
    try:
        got = tuple(float(stats[k]) for k in S.KEYS)
    except (KeyError, TypeError, ValueError):
        return None
    return got if all(np.isfinite(got)) else None


class _Seen(NamedTuple):
    """One run's value as its records show it: shape, dtype, statistics and, where saved, its array."""

    shape: tuple
    dtype: str
    stats: tuple | None
    array: np.ndarray | None = None

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def same_stats(self, other: _Seen) -> bool:
        """As many elements of one dtype with statistics equal bit for bit: statistics are a function
        of the values in C order, so one value shows the same ones wherever it is recorded."""
        return self.stats is not None and self.stats == other.stats and self.size == other.size \
            and self.dtype == other.dtype

    def same(self, other: _Seen) -> bool:
        """The same value: equal arrays where both are read, else equal shape and statistics."""
        if self.array is not None and other.array is not None:
            return self.array.shape == other.array.shape and np.array_equal(self.array, other.array)
        return self.shape == other.shape and self.same_stats(other)


def _row_seen(row, side: str, part=None) -> _Seen:
    """Run ``side``'s value of a table row (its array read only with ``part``)."""
    stats = _stats({k: row.get(f"{k}_{side}") for k in S.KEYS})
    return _Seen(_shape(row.get(f"shape_{side}")), str(row.get(f"dtype_{side}")), stats,
                 _array(part, row.get(f"data_{side}")))


def _spec_seen(spec: dict, part=None) -> _Seen:
    """A parameter record's value (its array read only with ``part``)."""
    return _Seen(_shape(spec.get("shape")), str(spec.get("dtype")), _stats(spec.get("stats") or {}),
                 _array(part, spec.get("data")))


def _unloaded(part):
    """The part read afresh, so that what the rule reads of it is not kept on the run's part (a long
    run's earlier parts would all stay in memory)."""
    return Part(part.path, part.step, part.rank) if isinstance(part, Part) else part


def _producer_bound(params: _Parameters, step: int, ga: _Seen, gb: _Seen) -> float | None:
    """The rounding bound of the gradient from its terms (:func:`carried_bound`, the smaller of the
    two runs'): of the backward record whose output is, in each run, the gradient the optimizer
    applied (bitwise where both are saved, else by statistics), and whose row passed (within
    tolerance or by the cancellation rule); None where no such record produced it or its terms are
    unknown."""
    pa, pb = params.parts[step]
    saved = ga.array is not None and gb.array is not None
    for row in params.outputs(step):
        if not _produced(row, pa, pb, ga, gb, saved):
            continue
        if row["status"] != V.PASS:
            return None
        bounds = []
        for part, name in ((pa, row["name_a"]), (pb, row["name_b"])):
            rec = _record_named(part, name)
            got = carried_bound(rec, row["arg"]) if rec is not None else None
            if got is None:
                return None
            bounds.append(got[0])
        return min(bounds)
    return None


def _record_named(part, name: str) -> dict | None:
    """The part's op record ``name``: its line found in ``ops.jsonl`` and parsed alone (a long run's
    earlier parts are not parsed whole again, part after part); the whole file read where no line
    shows the name as the writer writes it."""
    try:
        with open(os.path.join(part.path, "ops.jsonl"), "rb") as f:
            data = f.read()
    except (OSError, AttributeError):
        data = b""
    needle = b'"name":' + json.dumps(name).encode()
    at = data.find(needle)
    while at >= 0:
        end = data.find(b"\n", at)
        try:
            rec = json.loads(data[data.rfind(b"\n", 0, at) + 1:end if end >= 0 else len(data)])
        except ValueError:
            rec = None
        if isinstance(rec, dict) and rec.get("name") == name:
            return rec
        at = data.find(needle, at + 1)
    return next((r for r in _unloaded(part).records if r.get("name") == name), None)


def _produced(row, pa, pb, ga: _Seen, gb: _Seen, saved: bool) -> bool:
    """Whether the row's output is, in each run, the gradient: bitwise where the gradients are
    saved, else by statistics."""
    if int(np.prod(_shape(row.get("shape_a")))) != ga.size:    # read only tensors that could be it
        return False
    if not saved:
        return _row_seen(row, "a").same_stats(ga) and _row_seen(row, "b").same_stats(gb)
    xa, xb = _array(pa, row.get("data_a")), _array(pb, row.get("data_b"))
    return xa is not None and xb is not None and xa.size == ga.size and xb.size == gb.size \
        and np.array_equal(xa.ravel(), ga.array.ravel()) and np.array_equal(xb.ravel(), gb.array.ravel())


def _noise(ga, gb, bound: float) -> np.ndarray | None:
    """The elements where the gradient is rounding noise: below its rounding bound in both runs
    (together too) and different between them; None where the gradients are not of one shape."""
    if ga.shape != gb.shape:
        return None
    a, b = np.abs(ga.astype(np.float64)), np.abs(gb.astype(np.float64))
    noise = (np.fmax(a, b) <= bound) & (ga != gb)
    if max(float(np.linalg.norm(a[noise])), float(np.linalg.norm(b[noise]))) > bound:
        return np.zeros(ga.shape, bool)
    return noise


def _whole_noise(ga: _Seen, gb: _Seen, bound: float) -> np.ndarray | None:
    """On statistics: every element is noise where the gradient's norm (no element exceeds it) is
    within the bound in both runs and the gradients' statistics differ; else none is known to be
    (which elements are, statistics cannot tell).  None where the gradients are not of one shape."""
    if ga.shape != gb.shape or ga.stats is None or gb.stats is None:
        return None
    whole = max(ga.stats[_NORM], gb.stats[_NORM]) <= bound and not ga.same_stats(gb)
    return np.full(ga.shape, whole)


def _explains(ra: _Seen, rb: _Seen, noise: np.ndarray) -> int:
    """How many elements of a value the noise explains (0: it does not explain the difference): the
    value differs in some noise elements, and with them held equal it agrees.  On statistics only a
    noise of every element explains a value (then all its elements)."""
    if ra.shape != rb.shape or ra.shape != noise.shape:
        return 0
    if ra.array is None or rb.array is None:
        return ra.size if "float" in ra.dtype and noise.all() and not ra.same_stats(rb) else 0
    a, b = ra.array, rb.array
    if a.shape != noise.shape or b.shape != noise.shape or a.dtype.kind != "f":
        return 0
    moved = noise & (a != b)
    if not moved.any():
        return 0
    held = np.where(noise, a, b)
    return int(moved.sum()) if score(_value(a), _value(held))["status"] == V.PASS else 0


class _Parameters:
    """Each parameter's values after each step's optimizer step and where its gradients were noise,
    read from both runs' parameter records (each step's read on demand: most runs never ask)."""

    def __init__(self, table: pd.DataFrame, kept: dict, run_a, run_b, rank: int, last: int, known: dict):
        self.table, self.kept, self.rank = table, kept, rank
        self.steps = [s for s, r in sorted(run_a.parts) if r == rank and s <= last and (s, r) in run_b.parts]
        self.parts = {s: (run_a.parts[(s, rank)], run_b.parts[(s, rank)]) for s in self.steps}
        self._specs: dict = {}
        self._seen: dict = {}
        self._known = known     # ("step"/"through", key, step) -> mask or None, kept part to part by a Trail
        # the parameters this step's and the step before's records hold
        self.names = sorted({k[1:] for s in self.steps[-2:] for qa, qb in [self.specs(s)] for k in qa
                             if k[0] == "value" and k in qb})

    def specs(self, step: int) -> tuple:
        """Run A's and run B's parameter records of ``step`` (:func:`param_specs`)."""
        if step not in self._specs:
            self._specs[step] = tuple(param_specs({self.rank: _unloaded(p)}) for p in self.parts[step])
        return self._specs[step]

    def outputs(self, step: int) -> list:
        """The backward outputs of ``step`` that may have produced a gradient: the table's rows, or
        what the Trail kept of an earlier part's."""
        if (step, self.rank) not in self.kept:
            here = (self.table["step"] == step).to_numpy() & (self.table["rank"] == self.rank).to_numpy()
            self.kept[step, self.rank] = _backward_outputs(self.table, here)
        return self.kept[step, self.rank]

    def shapes(self) -> set:
        """The shapes of the parameters' recorded values."""
        return {x[0].shape for s in self.steps[-2:] for key in self.names if (x := self.seen("value", key, s))}

    def seen(self, what: str, key: tuple, step: int, arrays: bool = False) -> tuple | None:
        """Run A's and run B's recorded ``what`` ("value", "grad") of parameter ``key`` at ``step``
        (``arrays``: with their saved arrays), or None where either is unrecorded."""
        if (what, key, step, arrays) not in self._seen:
            (qa, qb), spec = self.specs(step), (what,) + key
            got = None
            if spec in qa and spec in qb and self.rank in qa[spec] and self.rank in qb[spec]:
                parts = self.parts[step] if arrays else (None, None)
                got = (_spec_seen(qa[spec][self.rank], parts[0]), _spec_seen(qb[spec][self.rank], parts[1]))
                if arrays and any(x.array is None for x in got):
                    got = None
            self._seen[what, key, step, arrays] = got
        return self._seen[what, key, step, arrays]

    def holds(self, key: tuple, step: int, ra: _Seen, rb: _Seen) -> bool:
        """Whether the row's values are, in each run, the parameter's value after ``step``'s optimizer
        step: bitwise where the row's arrays are read, else by shape and statistics."""
        got = self.seen("value", key, step) if step in self.parts else None
        if got is None or got[0].shape != ra.shape:
            return False
        if ra.array is not None and rb.array is not None:
            got = self.seen("value", key, step, arrays=True)
        return got is not None and got[0].same(ra) and got[1].same(rb)

    def noise(self, key: tuple, step: int) -> np.ndarray | None:
        """The elements where the parameter's gradients up to ``step`` were noise, or None where any
        of those gradients is unrecorded or came from a backward row that did not pass.  Each step's
        union is kept: a long run's next part adds its own step only."""
        steps = [s for s in self.steps if s <= step]
        start = next((i + 1 for i in range(len(steps) - 1, -1, -1) if ("through", key, steps[i]) in self._known), 0)
        mask = self._known["through", key, steps[start - 1]] if start else _NOTHING
        for s in steps[start:]:
            mask = _union(mask, self._step_noise(key, s))
            self._known["through", key, s] = mask
        return None if mask is _NOTHING else mask

    def _step_noise(self, key: tuple, step: int) -> np.ndarray | None:
        """The elements where the parameter's gradient at ``step`` was noise (:func:`_noise`, or on
        statistics :func:`_whole_noise`), or None."""
        if ("step", key, step) not in self._known:
            grads = self.seen("grad", key, step, arrays=True) or self.seen("grad", key, step)
            bound = _producer_bound(self, step, *grads) if grads else None
            if bound is None:
                mask = None
            elif grads[0].array is not None:
                mask = _noise(grads[0].array, grads[1].array, bound)
            else:
                mask = _whole_noise(*grads, bound)
            self._known["step", key, step] = mask
        return self._known["step", key, step]

    def first_noise(self, key: tuple) -> int:
        """The first step whose gradient of the parameter was noise somewhere."""
        return next(s for s in self.steps if (m := self.noise(key, s)) is not None and m.any())


_NOTHING = object()     # no step's gradient seen yet


def _union(mask, here):
    """``mask`` with a step's noise ``here`` added; None once either is unknown or they disagree in shape."""
    if mask is _NOTHING:
        return here
    if mask is None or here is None or mask.shape != here.shape:
        return None
    return mask | here


def _optimizer_records(records) -> set:
    """The names of the forward op records after the part's last backward record: the optimizer
    stepping inside the probe (none where it steps outside)."""
    ops = [r for r in records if r.get("kind") == "op"]
    last = max((i for i, r in enumerate(ops) if r.get("stage") == "backward"), default=len(ops))
    return {r.get("name") for r in ops[last + 1:] if r.get("stage") == "forward"}


def _shape(value) -> tuple:
    """A row's or a record's shape as a tuple (the table holds tuples; a written one, their text)."""
    if isinstance(value, str):
        value = value.strip("()[] ").split(",")
        return tuple(int(x) for x in value if x.strip())
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return ()
    return tuple(int(x) for x in value)


def _explained_row(params: _Parameters, ra: _Seen, rb: _Seen, optimizer: bool, step: int):
    """``(parameter, elements)`` when the row is a value of a parameter moved apart by noise: its
    value after this or the previous step's optimizer step (bitwise, or by statistics), or
    (``optimizer``: the row is the optimizer's own) a value of its shape that the optimizer's ops
    made this step; None otherwise."""
    earlier = [s for s in params.steps if s < step]
    for key in params.names:
        for made in ([earlier[-1]] if earlier else []) + [step]:
            if params.holds(key, made, ra, rb):
                mask = params.noise(key, made)
                n = _explains(ra, rb, mask) if mask is not None else 0
                return (key, n) if n else None
    if not optimizer:
        return None
    for key in params.names:
        mask = params.noise(key, step)
        if mask is not None and mask.shape == ra.shape and (n := _explains(ra, rb, mask)):
            return key, n
    return None


def explain(table: pd.DataFrame, run_a, run_b, step: int, rank: int,
            trail: Trail | None = None) -> tuple[list, dict] | None:
    """``(row indexes, {parameter name: (step, gradient step, elements, on statistics)})`` when every
    error row of ``step``/``rank`` is a value of a parameter whose difference is cancelled gradient
    noise an optimizer step amplified; else None.  The earlier steps' rows are ``table``'s, or
    what ``trail`` kept of them."""
    errors = table[(table["step"] == step) & (table["rank"] == rank) & (table["status"] == V.ERROR)]
    na, nb = run_a.parts.get((step, rank)), run_b.parts.get((step, rank))
    if not len(errors) or na is None or nb is None:
        return None
    params = _Parameters(table, dict(trail.rows) if trail is not None else {}, run_a, run_b, rank, step,
                         trail.noise.setdefault(rank, {}) if trail is not None else {})
    # read no value unless every error row could be a parameter's value: an input, or the optimizer's
    shapes = params.shapes()
    if not all(_shape(shape) in shapes for shape in errors["shape_a"]):
        return None
    inputs = (errors["io"] == "input").to_numpy()
    ours = (_optimizer_records(_unloaded(na).records), _optimizer_records(_unloaded(nb).records)) \
        if not inputs.all() else (set(), set())
    optimizer = [a in ours[0] and b in ours[1] for a, b in zip(errors["name_a"], errors["name_b"])]
    if not all(inputs | np.array(optimizer, bool)):
        return None
    rows, facts = [], {}
    for (idx, row), own in zip(errors.iterrows(), optimizer):
        ra, rb = _row_seen(row, "a", na), _row_seen(row, "b", nb)
        got = _explained_row(params, ra, rb, own, step)
        if got is None:
            return None
        key, n = got
        facts.setdefault(key[0], (step, params.first_noise(key), n, ra.array is None or rb.array is None))
        rows.append(idx)
    return rows, facts


class Trail:
    """What the rule keeps of the parts compared so far (in step order), so that a later part's
    error rows can be traced to an earlier step's gradient without reading that part again: its
    backward outputs that may have produced a parameter's gradient (saved tensors, or the
    statistics of a recorded gradient) and the noise found."""

    def __init__(self, run_a, run_b):
        self.run_a, self.run_b = run_a, run_b
        self.rows: dict = {}     # (step, rank) -> that part's backward outputs that may be a gradient (dicts)
        self.noise: dict = {}    # rank -> {("step"/"through", parameter key, step): noise mask or None}

    def explain(self, table: pd.DataFrame) -> tuple[list, dict] | None:
        """:func:`explain` of one part's table."""
        step, rank = int(table["step"].iloc[0]), int(table["rank"].iloc[0])
        return explain(table, self.run_a, self.run_b, step, rank, self)

    def keep(self, table: pd.DataFrame) -> None:
        """Keep the part's backward outputs that may be a parameter's gradient: saved, or whose norm
        in each run is the norm of one of the run's recorded gradients of that step."""
        step, rank = int(table["step"].iloc[0]), int(table["rank"].iloc[0])
        could = table["data_a"].notna().to_numpy() if "data_a" in table.columns else np.zeros(len(table), bool)
        norms = [_gradient_norms(run.parts.get((step, rank)), rank) for run in (self.run_a, self.run_b)]
        if "norm_a" in table.columns and "norm_b" in table.columns:
            could = could | table["norm_a"].isin(norms[0]).to_numpy() & table["norm_b"].isin(norms[1]).to_numpy()
        rows = _backward_outputs(table, could)
        if rows:
            self.rows[step, rank] = rows


def _backward_outputs(table: pd.DataFrame, among: np.ndarray) -> list:
    """The table's backward output rows among ``among``, as dicts of the columns the rule reads
    (a long run keeps some per part: dicts, not a DataFrame each)."""
    pick = np.flatnonzero(among & (table["stage"] == "backward").to_numpy() & (table["io"] == "output").to_numpy())
    if not len(pick):
        return []
    columns = [c for c in KEPT if c in table.columns]
    return [dict(zip(columns, values)) for values in zip(*(table[c].to_numpy()[pick] for c in columns))]


def _gradient_norms(part, rank: int) -> set:
    """The norms of the part's recorded gradients (none where the part or its records are missing)."""
    if part is None:
        return set()
    specs = param_specs({rank: _unloaded(part)})
    stats = [_stats(s[rank].get("stats") or {}) for k, s in specs.items() if k[0] == "grad" and rank in s]
    return {x[_NORM] for x in stats if x is not None}


def said(facts: dict) -> list:
    """The verdict's lines for :func:`explain`'s parameters, one each."""
    return [f"parameter {name} differs from step {step}: its step {grad_step} gradient is zero up to rounding "
            f"(cancelled) in {_elements(n, whole)}, and the optimizer's normalisation amplified that noise; "
            "not a precision divergence" for name, (step, grad_step, n, whole) in facts.items()]


def _elements(n: int, whole: bool) -> str:
    """Which elements: all of them (statistics tell no element apart) or the ones where the runs part."""
    return f"all {n} of its elements" if whole else f"the {n} element(s) where the runs part"
