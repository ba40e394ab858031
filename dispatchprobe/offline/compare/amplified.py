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
gradients and stays a divergence."""

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
        if int(np.prod(_shape(row.get("shape_a")))) != ga.size:    # read only tensors that could be it
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


def _explains(ra, rb, noise: np.ndarray) -> int:
    """How many elements of a value the noise explains (0: it does not explain the difference): the
    value differs in some noise elements, and with them held equal it agrees."""
    if ra.shape != rb.shape or ra.shape != noise.shape or ra.dtype.kind != "f":
        return 0
    moved = noise & (ra != rb)
    if not moved.any():
        return 0
    held = np.where(noise, ra, rb)
    return int(moved.sum()) if score(_value(ra), _value(held))["status"] == V.PASS else 0


class _Parameters:
    """Each parameter's values after each step's optimizer step and where its gradients were noise,
    read from both runs' parameter records (loaded on demand: most runs never ask)."""

    def __init__(self, table: pd.DataFrame, run_a, run_b, rank: int, last: int):
        self.table, self.rank = table, rank
        self.steps = [s for s, r in sorted(run_a.parts) if r == rank and s <= last and (s, r) in run_b.parts]
        self.parts = {s: (run_a.parts[(s, rank)], run_b.parts[(s, rank)]) for s in self.steps}
        self.specs = {s: (param_specs({rank: pa}), param_specs({rank: pb})) for s, (pa, pb) in self.parts.items()}
        self.names = sorted({k[1:] for qa, qb in self.specs.values() for k in qa if k[0] == "value" and k in qb})
        self._loaded: dict = {}
        self._noise: dict = {}

    def shapes(self) -> set:
        """The shapes of the parameters' recorded values."""
        return {_shape(qa[("value",) + key][self.rank].get("shape")) for qa, qb in self.specs.values()
                for key in self.names if ("value",) + key in qa}

    def arrays(self, what: str, key: tuple, step: int):
        """Run A's and run B's recorded ``what`` ("value", "grad") of parameter ``key`` at ``step``."""
        if (what, key, step) not in self._loaded:
            (pa, pb), (qa, qb) = self.parts[step], self.specs[step]
            spec = (what,) + key
            got = None
            if spec in qa and spec in qb:
                got = (_array(pa, qa[spec][self.rank].get("data")), _array(pb, qb[spec][self.rank].get("data")))
            self._loaded[what, key, step] = got if got and all(x is not None for x in got) else None
        return self._loaded[what, key, step]

    def noise(self, key: tuple, step: int) -> np.ndarray | None:
        """The elements where the parameter's gradients up to ``step`` were noise, or None where any
        of those gradients is unrecorded or came from a backward row that did not pass."""
        mask = None
        for s in [s for s in self.steps if s <= step]:
            here = self._step_noise(key, s)
            if here is None or (mask is not None and mask.shape != here.shape):
                return None
            mask = here if mask is None else mask | here
        return mask

    def _step_noise(self, key: tuple, step: int) -> np.ndarray | None:
        """The elements where the parameter's gradient at ``step`` was noise (:func:`_noise`), or None."""
        if (key, step) not in self._noise:
            grads = self.arrays("grad", key, step)
            pa, pb = self.parts[step]
            bound = _producer_bound(self.table, pa, pb, step, self.rank, *grads) if grads else None
            self._noise[key, step] = _noise(*grads, bound) if bound is not None else None
        return self._noise[key, step]

    def first_noise(self, key: tuple) -> int:
        """The first step whose gradient of the parameter was noise somewhere."""
        return next(s for s in self.steps if (m := self.noise(key, s)) is not None and m.any())


def _optimizer_records(part) -> set:
    """The names of the forward op records after the part's last backward record: the optimizer
    stepping inside the probe (none where it steps outside)."""
    ops = [r for r in part.records if r.get("kind") == "op"]
    last = max((i for i, r in enumerate(ops) if r.get("stage") == "backward"), default=len(ops))
    return {r.get("name") for r in ops[last + 1:] if r.get("stage") == "forward"}


def _shape(value) -> tuple:
    """A row's or a record's shape as a tuple (the table holds tuples; a written one, their text)."""
    if isinstance(value, str):
        value = value.strip("()[] ").split(",")
        return tuple(int(x) for x in value if x.strip())
    return tuple(int(x) for x in value) if value is not None else ()


def _explained_row(params: _Parameters, row, ra, rb, optimizer: bool, step: int):
    """``(parameter, elements)`` when the row is a value of a parameter moved apart by noise: its
    value after this or the previous step's optimizer step, bitwise, or (``optimizer``: the row is
    the optimizer's own) a value of its shape that the optimizer's ops made this step; None otherwise."""
    earlier = [s for s in params.steps if s < step]
    for key in params.names:
        for made in ([earlier[-1]] if earlier else []) + [step]:
            got = params.arrays("value", key, made) if made in params.parts else None
            if got is not None and got[0].shape == ra.shape and np.array_equal(got[0], ra) \
                    and np.array_equal(got[1], rb):
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


def explain(table: pd.DataFrame, run_a, run_b, step: int, rank: int) -> tuple[list, dict] | None:
    """``(row indexes, {parameter name: (step, gradient step, elements)})`` when every error row of
    ``step``/``rank`` is a value of a parameter whose difference is cancelled gradient noise an
    optimizer step amplified; else None."""
    errors = table[(table["step"] == step) & (table["rank"] == rank) & (table["status"] == V.ERROR)]
    na, nb = run_a.parts.get((step, rank)), run_b.parts.get((step, rank))
    if not len(errors) or "data_a" not in table.columns or na is None or nb is None:
        return None
    params = _Parameters(table, run_a, run_b, rank, step)
    shapes = params.shapes()
    ours = _optimizer_records(na), _optimizer_records(nb)
    optimizer = [row["name_a"] in ours[0] and row["name_b"] in ours[1] for _, row in errors.iterrows()]
    # read no tensor unless every error row could be a parameter's value: an input, or the optimizer's
    if not all(_shape(row["shape_a"]) in shapes and (row["io"] == "input" or own)
               for (_, row), own in zip(errors.iterrows(), optimizer)):
        return None
    rows, facts = [], {}
    for (idx, row), own in zip(errors.iterrows(), optimizer):
        ra, rb = _array(na, row["data_a"]), _array(nb, row["data_b"])
        got = _explained_row(params, row, ra, rb, own, step) if ra is not None and rb is not None else None
        if got is None:
            return None
        key, n = got
        facts.setdefault(key[0], (step, params.first_noise(key), n))
        rows.append(idx)
    return rows, facts


def said(facts: dict) -> list:
    """The verdict's lines for :func:`explain`'s parameters, one each."""
    return [f"parameter {name} differs from step {step}: its step {grad_step} gradient is zero up to rounding "
            f"(cancelled) in the {n} element(s) where the runs part, and the optimizer's normalisation "
            "amplified that noise; not a precision divergence" for name, (step, grad_step, n) in facts.items()]
