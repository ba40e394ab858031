"""A later step's error rows that are a parameter moved apart by the optimizer amplifying rounding
noise: where a parameter's gradient is mathematically zero (an attention key bias: softmax is
shift-invariant), each run's gradient there is rounding noise of its own, and a normalising
optimizer (Adam's ``m / (sqrt(v) + eps)``) turns any noise into an update of a sizeable part of
the learning rate, so the runs' parameters part although neither computation diverged.

Sound only where the traced facts say so, element by element: at the previous step the backward
row that produced the gradient the optimizer applied passed (within tolerance or by the
cancellation rule); the parameter's elements that move apart are exactly elements whose gradient
is at rounding level in both runs (below the rounding bound of its terms,
:func:`...standards.rounding.carried_bound` of that backward record, the cancellation rule's
bound) and differs between the runs (the noise itself: a changed optimizer with equal gradients
is not explained); with those elements held equal the parameter agrees; and every error row of
the later step is that parameter's own value (bitwise each run's value after the step), nothing
it feeds.  A changed learning rate or optimizer moves elements with real gradients and stays a
divergence."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ...standards import verdicts as V
from ...standards.rounding import carried_bound
from .parallel import Value, param_specs, score


def _array(part, key):
    if key is None or (isinstance(key, float) and np.isnan(key)):
        return None
    try:
        return part.tensor(key)
    except Exception:  # noqa: BLE001 - unreadable: this row is not explained
        return None


def _value(arr: np.ndarray) -> Value:
    return Value(tuple(arr.shape), str(arr.dtype), None, arr)


def _producer_bound(table: pd.DataFrame, pa, pb, step: int, rank: int, ga, gb) -> float | None:
    """The rounding bound of the gradient from its terms (:func:`carried_bound`, the smaller of the
    two runs'): of the backward record whose output is, bitwise in each run, the gradient the
    optimizer applied, and whose row passed (within tolerance or by the cancellation rule); None
    where no such record produced it or its terms are unknown."""
    rows = table[(table["step"] == step) & (table["rank"] == rank) & (table["stage"] == "backward")
                 & (table["io"] == "output")]
    for _, row in rows.iterrows():
        if str(row.get("shape_a")).count(",") > ga.ndim + 1:
            continue
        xa, xb = _array(pa, row["data_a"]), _array(pb, row["data_b"])
        if xa is None or xb is None or xa.size != ga.size or not np.array_equal(xa.ravel(), ga.ravel()) \
                or not np.array_equal(xb.ravel(), gb.ravel()):
            continue
        if row["status"] != V.PASS:
            return None
        bounds = []
        for part, name in ((pa, row["name_a"]), (pb, row["name_b"])):
            rec = next((r for r in part.records if r.get("name") == name), None)
            got = carried_bound(rec, row["arg"]) if rec is not None else None
            if got is None:
                return None
            bounds.append(got[0])
        return min(bounds)
    return None


def _explains(va, vb, ga, gb, bound: float) -> int:
    """How many elements of the parameter the noise explains (0: it does not explain the difference):
    elements whose gradient (its row passed) differs between the runs and is, in both, below the gradient's rounding
    bound (together too), and outside them the parameter agrees."""
    if va.shape != vb.shape or ga.shape != va.shape or gb.shape != va.shape or va.dtype.kind != "f":
        return 0
    a, b = np.abs(ga.astype(np.float64)), np.abs(gb.astype(np.float64))
    noise = (np.fmax(a, b) <= bound) & (ga != gb)
    if max(float(np.linalg.norm(a[noise])), float(np.linalg.norm(b[noise]))) > bound:
        return 0
    moved = noise & (va != vb)
    if not moved.any():
        return 0
    held = np.where(noise, va, vb)
    return int(moved.sum()) if score(_value(va), _value(held))["status"] == V.PASS else 0


def explain(table: pd.DataFrame, run_a, run_b, step: int, rank: int) -> tuple[list, list] | None:
    """``(row indexes, lines)`` when every error row of ``step``/``rank`` is a parameter whose
    difference is cancelled gradient noise the previous step's optimizer amplified; else None."""
    errors = table[(table["step"] == step) & (table["rank"] == rank) & (table["status"] == V.ERROR)]
    earlier = [s for s, r in run_a.parts if r == rank and s < step and (s, r) in run_b.parts]
    if not len(errors) or not earlier or "data_a" not in table.columns or (errors["io"] != "input").any():
        return None       # a parameter is an op's input: any other error row is not explained here
    prev = max(earlier)
    pa, pb = run_a.parts[(prev, rank)], run_b.parts[(prev, rank)]
    na, nb = run_a.parts.get((step, rank)), run_b.parts.get((step, rank))
    if na is None or nb is None:
        return None
    qa, qb = param_specs({rank: pa}), param_specs({rank: pb})
    values = {}
    for key in qa:
        if key[0] == "value" and key in qb and ("grad",) + key[1:] in qa and ("grad",) + key[1:] in qb:
            values[key] = None
    cache: dict = {}

    def load(key):
        if key not in cache:
            g = ("grad",) + key[1:]
            got = [_array(pa, qa[key][rank].get("data")), _array(pb, qb[key][rank].get("data")),
                   _array(pa, qa[g][rank].get("data")), _array(pb, qb[g][rank].get("data"))]
            cache[key] = got if all(x is not None for x in got) else None
        return cache[key]

    found: dict = {}
    for idx, row in errors.iterrows():
        ra, rb = _array(na, row["data_a"]), _array(nb, row["data_b"])
        if ra is None or rb is None:
            return None
        hit = None
        for key in values:
            got = load(key)
            if got is not None and got[0].shape == ra.shape and np.array_equal(got[0], ra) \
                    and np.array_equal(got[1], rb):
                hit = key
                break
        if hit is None:
            return None
        if hit not in found:
            got = load(hit)
            bound = _producer_bound(table, pa, pb, prev, rank, got[2], got[3])
            n = _explains(*got, bound) if bound is not None else 0
            if not n:
                return None
            found[hit] = [n, []]
        found[hit][1].append(idx)
    lines = [f"parameter {key[1]} differs from step {step}: its step {prev} gradient is zero up to rounding "
             f"(cancelled) in the {n} element(s) where the runs part, and the optimizer's normalisation "
             "amplified that noise; not a precision divergence" for key, (n, _) in found.items()]
    return [i for _, rows in found.values() for i in rows], lines
