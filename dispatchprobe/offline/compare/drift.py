"""A later step's error rows that follow only from parameters an optimizer step moved apart from
differences within tolerance.

Two clean programs whose kernels round apart (two torch versions, bfloat16 autocast) agree within
tolerance at step 0, yet an optimizer that normalises its update (Adam's first update is about
``lr * sign(g)`` for every element) moves a parameter whose gradient elements lie near zero by up
to twice the learning rate where the runs' roundings differ: the parameters part beyond tolerance,
and step 1's values computed from them do too.  Those rows are no precision verdict on any op
(each run computed them right from the parameters it had), so they are not judged, as the values
after a discrete choice are, and the verdict says where the runs parted.

Sound only where the traced facts say so: the rank's previous step has no error row left (its
gradients agree within tolerance); its parameter records show a parameter whose value after that
step's optimizer step differs beyond tolerance; every such parameter's gradient as the optimizer
applied it was made in each run by one pair of backward records of that step whose outputs passed
(nothing changed it between backward and the optimizer step: a clipping, a hook) and differs
between the runs (equal gradients moved apart are the optimizers' doing: another learning rate),
while some parameter whose gradients differ too keeps values that agree (the two optimizer steps
agree where no gradient element sits at rounding level: another optimizer moves them all); the
runs are of other kernels (two framework versions or device kinds: kernels that round apart);
the step's first differing input is, in each run, a parameter's value after that optimizer step;
and no op of the step is named as a source (its divergences are inputs that differ and what
follows from them) or looks, on statistics alone, like it adds a difference of its own (its
outputs off many times more than its inputs: :meth:`.origin.OwnShare.estimate`).  A wrong kernel
at that step is so still named: as the source where what it reads agrees up to rounding, else on
a ``not named:`` line, its rows errors.  A later step of a rank whose parameters so parted follows
them the same way.  An optimizer stepping inside the probe records the moving itself (the step's
forward records after its last backward one): where every error row of that step is its own, every
divergence not a departure is at its records, its paired ops are given the same numbers (another
learning rate shows there, and is named) and the parameter records show the parting as above, those
rows are not judged too, so the verdict is the one with the optimizer outside.

What statistics cannot tell apart is another learning rate in one run where the gradients differ
by rounding too: so the rows are not judged (exit code 1, as after a discrete choice), never
passed."""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import numpy as np
import pandas as pd

from ...records.format import walk
from ...records.reader import Part
from ...standards import statistics as S
from ...standards import verdicts as V
from .exact import same_kernels
from .parallel import assemble, made_by, param_specs, score

DRIFTED = "computed from parameters the optimizer moved apart from differences within tolerance"
# a part's divergence causes that name no op of the part: values that differ at its start, and what follows
# from them ("after_inputs" is not one: there a backward op looked like a source, on statistics alone)
FOLLOWS = frozenset({"inputs", "inherited"})


class Moved(NamedTuple):
    """Where a rank's parameters parted: the optimizer step and the first parameter moved apart."""

    step: int
    said: str


class Drift:
    """What the rule keeps of the parts compared so far (in step order), per rank: the last step
    compared and whether error rows were left in it, and where its parameters parted."""

    def __init__(self, run_a, run_b):
        self.run_a, self.run_b = run_a, run_b
        # runs of the same kernels (one framework version, one device kind) round alike wherever they
        # compute alike: their parameters parting is no rounding of two kernels
        self.same_kernels = same_kernels(run_a.manifest, run_b.manifest)
        self.last: dict = {}     # rank -> (step, error rows left in it)
        self.makers: dict = {}   # rank -> (name_a, name_b) of that step's backward records whose outputs pass
        self.moved: dict = {}    # rank -> Moved
        self.first: dict = {}    # rank -> the first step whose rows follow only from it
        self.inside: set = set()  # ranks whose optimizer, stepping inside the probe, recorded the moving

    def settle(self, table: pd.DataFrame, divs: list) -> list:
        """The part's divergences; where its error rows follow only from parameters moved apart
        (see the module's docstring), its error and warning rows not judged and its divergences
        other than departures dropped."""
        if not len(table) or self.same_kernels:
            return divs
        step, rank = int(table["step"].iat[0]), int(table["rank"].iat[0])
        status = table["status"].to_numpy(object)
        errors = status == V.ERROR
        prev, self.last[rank] = self.last.get(rank), (step, bool(errors.any()))
        makers, self.makers[rank] = self.makers.get(rank, set()), _passed_backward(table)
        if errors.any() and (prev is None or not prev[1]) and rank not in self.moved:
            optimizer = self._optimizer_moved(table, divs, step, rank)
            if optimizer is not None:
                return self._not_judged(table, optimizer, divs, step, rank, own=True)
        causes = {d.cause for d in divs if not d.departure}
        if not errors.any() or prev is None or not causes <= FOLLOWS | {"after_inputs"}:
            return divs
        if "after_inputs" in causes or any(d.amplifier and not d.departure for d in divs):
            # an op of the step looks, on statistics alone, like it adds a difference of its own to the
            # moved parameters' (a wrong kernel there): the rows stay errors and the line names it
            return [replace(d, unjudged=d.unjudged or d.amplifier) for d in divs]
        moved = self.moved.get(rank) or (None if prev[1] else self._moved(prev[0], rank, table, divs, makers))
        if moved is None:
            return divs
        self.moved[rank] = moved
        self.first.setdefault(rank, step)
        return self._not_judged(table, errors | (status == V.WARNING), divs, step, rank)

    def _not_judged(self, table: pd.DataFrame, rows: np.ndarray, divs: list, step: int, rank: int,
                    own: bool = False) -> list:
        """Marks ``rows`` of the part not judged (``own``: the optimizer's own values as it moved the
        parameters apart, stepping inside the probe) and returns its departures."""
        moved = self.moved[rank]
        table.loc[rows, "status"] = V.NOT_JUDGED
        table.loc[rows, "reason"] = (f"{DRIFTED} at step {moved.step}" + (": the optimizer's own values as it moved them"
                                                                          if own else "") + ": not judged")
        if "origin" in table.columns:
            table.loc[rows, "origin"] = False
        self.last[rank] = (step, False)
        return [d for d in divs if d.departure]

    def _optimizer_moved(self, table: pd.DataFrame, divs: list, step: int, rank: int) -> np.ndarray | None:
        """The rows of the part's optimizer stepping inside the probe (the forward records after its
        last backward record, in both runs) to leave not judged, where that optimizer step moved the
        rank's parameters apart from differences within tolerance: every error row of the part is the
        optimizer's, every divergence not a departure is at its records, and its parameter records
        show the parameters parted (:meth:`_moved`, with this step's backward records whose outputs
        passed as the gradients' makers).  Its error and warning rows are then values the moving made
        (moments, updates, the parameters mid-step), as the next step's parameters are when the
        optimizer steps outside the probe; else None."""
        parts = [run.parts.get((step, rank)) for run in (self.run_a, self.run_b)]
        if None in parts:
            return None
        ours = [_optimizer_records(Part(p.path, p.step, p.rank).records) for p in parts]
        if not ours[0] or not ours[1]:
            return None
        own = table["name_a"].isin(ours[0]).to_numpy() & table["name_b"].isin(ours[1]).to_numpy()
        status = table["status"].to_numpy(object)
        if ((status == V.ERROR) & ~own).any():
            return None
        names = set(zip(table["name_a"].to_numpy()[own].tolist(), table["name_b"].to_numpy()[own].tolist()))
        if any(_numbers(ours[0][a]) != _numbers(ours[1][b]) for a, b in names):
            return None       # another learning rate, betas, eps or weight decay: the optimizers differ
        if any(not d.departure and d.name not in ours[0 if d.side == "a" else 1] for d in divs):
            return None
        moved = self._moved(step, rank, table, [], _passed_backward(table))
        if moved is None:
            return None
        self.moved[rank] = moved
        self.inside.add(rank)
        return own & ((status == V.ERROR) | (status == V.WARNING))

    def _moved(self, step: int, rank: int, table: pd.DataFrame, divs: list, makers: set) -> Moved | None:
        """How ``step``'s optimizer step moved the rank's parameters apart, or None where the
        parameter records do not show it (see the module's docstring); ``makers``: that step's
        paired backward records whose outputs passed."""
        parts = [run.parts.get((step, rank)) for run in (self.run_a, self.run_b)]
        if None in parts:
            return None
        pa, pb = (Part(p.path, p.step, p.rank) for p in parts)     # read afresh: not kept on the run
        qa, qb = param_specs({rank: pa}), param_specs({rank: pb})
        first, alike = "", False
        for key in [k for k in qa if k[0] == "value" and k in qb and rank in qa[k] and rank in qb[k]]:
            va, _ = assemble(qa[key], {rank: pa}, True, [])
            vb, _ = assemble(qb[key], {rank: pb}, True, [])
            grad = ("grad",) + key[1:]
            ga, gb = (q[grad].get(rank) if grad in q else None for q in (qa, qb))
            if va is None or vb is None or va.shape != vb.shape or ga is None or gb is None:
                continue
            got = score(va, vb)
            if got["status"] != V.ERROR:
                # gradients apart by rounding that the steps kept alike: the optimizers agree
                alike = alike or _stats(ga) != _stats(gb)
                continue
            if not _rounded_apart(pa, pb, ga, gb, makers):
                return None
            first = first or f"parameter {key[1]} differs after it ({got['reason']})"
        if not first or not alike or not _parameters_first(table, divs, qa, qb, rank):
            return None
        return Moved(step, first)

    def lines(self) -> list:
        """The verdict's line per rank whose parameters parted.  An optimizer stepping inside the probe
        records the moving itself: its own values that part are said not judged too."""
        out = []
        for r, m in sorted(self.moved.items()):
            inside = r in self.inside
            rows = f"step {self.first[r]}" if r in self.first else f"the optimizer step of step {m.step}"
            own = " (its optimizer's own values, stepping inside the probe, not judged)" if inside else ""
            later = f", and what is computed from the moved parameters, step {self.first[r]} on, is not judged" \
                if r in self.first else ""
            out.append(f"{rows} rank {r}: its error rows are computed from parameters the optimizer step of "
                       f"step {m.step} moved apart from gradients that agree within tolerance ({m.said}): a normalising "
                       f"optimizer, as Adam's, turns such differences into updates that part, and statistics cannot "
                       f"tell that from another learning rate; step {m.step}'s values agree within tolerance{own}{later}")
        return out


def _optimizer_records(records) -> dict:
    """Name -> record of the forward op records after the part's last backward record: the optimizer
    stepping inside the probe (none where it steps outside, or where the part has no backward)."""
    ops = [r for r in records if r.get("kind") == "op"]
    last = max((i for i, r in enumerate(ops) if r.get("stage") == "backward"), default=len(ops))
    return {r.get("name"): r for r in ops[last + 1:] if r.get("stage") == "forward"}


def _numbers(record: dict) -> dict:
    """arg -> each number argument of ``record`` (a learning rate, a beta, an eps: the optimizer's
    settings, which its ops are given as numbers where it steps inside the probe)."""
    return {arg: spec.get("value") for _, arg, spec in walk(record, outputs=False, tensors_only=False)
            if spec.get("type") in ("int", "float")}


def _rounded_apart(pa, pb, grad_a: dict, grad_b: dict, makers: set) -> bool:
    """Whether a parameter's gradients as the optimizer applied them were made, in each run, by one
    pair of backward records whose outputs passed (not a one-run-only op, a gradient hook's), and
    differ: equal gradients moved apart are the optimizers' own doing (another learning rate)."""
    if _stats(grad_a) is None or _stats(grad_a) == _stats(grad_b):
        return False
    return (made_by(pa, grad_a), made_by(pb, grad_b)) in makers


def _passed_backward(table: pd.DataFrame) -> set:
    """(name_a, name_b) of the part's backward records whose output rows are not errors."""
    rows = table[(table["stage"] == "backward").to_numpy() & (table["io"] == "output").to_numpy()]
    bad = (rows["status"] == V.ERROR).to_numpy()
    failed = set(zip(rows["name_a"].to_numpy()[bad], rows["name_b"].to_numpy()[bad]))
    return set(zip(rows["name_a"].to_numpy(), rows["name_b"].to_numpy())) - failed


def _parameters_first(table: pd.DataFrame, divs: list, qa: dict, qb: dict, rank: int) -> bool:
    """Whether each forward divergence of differing inputs is first seen at a value that is, in each
    run, a parameter's value after the optimizer step (statistics equal bit for bit): not the batch."""
    values = [(k, _stats(qa[k][rank]), _stats(qb[k][rank])) for k in qa
              if k[0] == "value" and k in qb and rank in qa[k] and rank in qb[k]]
    for d in divs:
        if d.departure or d.cause != "inputs":
            continue
        row = table[(table["stage"] == d.stage).to_numpy() & (table["seq"] == d.seq).to_numpy()
                    & (table["arg"] == d.arg).to_numpy() & (table["io"] == "input").to_numpy()]
        if not len(row):
            return False
        seen_a = tuple(float(row[f"{k}_a"].iat[0]) for k in S.KEYS)
        seen_b = tuple(float(row[f"{k}_b"].iat[0]) for k in S.KEYS)
        if not any(sa == seen_a and sb == seen_b for _, sa, sb in values):
            return False
    return True


def _stats(spec: dict) -> tuple | None:
    """A parameter record's statistics in :data:`S.KEYS` order, None where any is missing or not finite."""
    try:
        got = tuple(float((spec.get("stats") or {})[k]) for k in S.KEYS)
    except (KeyError, TypeError, ValueError):
        return None
    return got if all(np.isfinite(got)) else None
