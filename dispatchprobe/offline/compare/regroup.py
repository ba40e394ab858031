"""Sums whose terms the two runs group differently: where a value's gradient is accumulated.

Autograd adds up a value's gradient from each of its uses.  Where one run makes a second tensor of
the value (an RMSNorm's ``x.to(float32)`` is a copy in a bf16 model, the value itself in a float32
one), it sums that gradient in two groups, a cast between them: ``g + (t1 + t2)`` against
``(g + t1) + t2``.  The totals are the same value; the partial sums are not, and whichever of them
the alignment pairs, their rows compare different sums of the same terms and may differ by any
amount while the totals agree.  Such rows are no evidence of where a difference enters (the
lineage of :mod:`.origin` reads the terms and the totals instead), and a one-run-only partial sum
only regroups terms: never a suspect by itself.
"""

from __future__ import annotations

import numpy as np

from ...core import op_traits


class Regrouping:
    """The element-wise sums the two runs group differently, found from each run's one-run-only
    sums.  ``partial``: per run, its one-run-only partial sums (element-wise sums, and casts of
    them); ``regrouped``: paired records (run A's index), element-wise sums in both runs, that read
    a one-run-only partial sum or feed one in either run; ``partial_out``: of those, the ones whose
    output is itself a partial sum in either run (it feeds a one-run-only one), so that their
    output rows compare no one value either."""

    def __init__(self, a, b, pair_b: dict, pair_a: dict):
        self.a, self.b, self.pair_b, self.pair_a = a, b, pair_b, pair_a
        self.partial: dict = {"a": set(), "b": set()}
        self.regrouped: set = set()
        self.partial_out: set = set()
        for side in (a, b):
            self._scan(side)

    def producer(self, side, spec_id: int) -> tuple | None:
        """(record, output arg) that made the input whose spec has id ``spec_id`` in run ``side``,
        past one-run-only casts (a cast makes no new sum), or None where no record did."""
        src = side.flow.src.get(spec_id)
        while src is not None and src[0] in side.only and op_traits.is_cast(side.recs[src[0]]["op"]) \
                and src[0] not in self.partial[side.name]:
            ins = [sp for io, _, sp in side.flow.walks[src[0]] if io == "input"]
            if not ins:
                break
            src = side.flow.src.get(id(ins[0]))
        return src

    def _to_a(self, side, i: int) -> int | None:
        """Paired record ``i`` of run ``side`` as run A's index, where both runs' ops are sums."""
        j = i if side.name == "a" else self.pair_a.get(i)
        k = self.pair_b.get(j) if j is not None else None
        if k is None or not (op_traits.is_elementwise_sum(self.a.recs[j]["op"])
                             and op_traits.is_elementwise_sum(self.b.recs[k]["op"])):
            return None
        return j

    def _producers(self, side, u: int) -> list:
        return [p[0] for io, _, spec in side.flow.walks[u] if io == "input"
                and (p := self.producer(side, id(spec))) is not None]

    def _scan(self, side) -> None:
        """One pass over run ``side``'s element-wise sums and casts, in order (a producer comes
        before its consumers)."""
        partial = self.partial[side.name]
        for u, rec in enumerate(side.recs):
            if rec["kind"] != "op":
                continue
            op = rec["op"]
            is_sum = op_traits.is_elementwise_sum(op)
            if u in side.only:
                if not is_sum and not (op_traits.is_cast(op) and any(
                        (p := side.flow.src.get(id(spec))) is not None and p[0] in partial
                        for io, _, spec in side.flow.walks[u] if io == "input")):
                    continue
                partial.add(u)
                if is_sum:     # the paired sums it adds up are partial sums in this run
                    for p in self._producers(side, u):
                        if p not in side.only and (pa := self._to_a(side, p)) is not None:
                            self.regrouped.add(pa)
                            self.partial_out.add(pa)
            elif is_sum and any(p in partial for p in self._producers(side, u)):
                if (ia := self._to_a(side, u)) is not None:
                    self.regrouped.add(ia)

    def same_value(self, spec_a: int, spec_b: int) -> bool:
        """Both runs' producers of an input (its specs' ids) are one pair, one output: the row
        compares one value."""
        src_a, src_b = self.producer(self.a, spec_a), self.producer(self.b, spec_b)
        return src_a is not None and src_b is not None and self.pair_b.get(src_a[0]) == src_b[0] \
            and src_a[1] == src_b[1]

    def partial_rows(self, uid: np.ndarray, is_in: np.ndarray, spec_a: list, spec_b: list) -> np.ndarray:
        """Per row (``uid``: its record, run A's index; ``spec_a``/``spec_b``: its specs' ids): does
        it compare two partial sums?  An input of a regrouped sum whose producers are no one pair,
        an output of one whose output is a partial sum in either run."""
        out = np.zeros(len(uid), bool)
        if not self.regrouped:
            return out
        for k in np.flatnonzero(np.isin(uid, np.fromiter(self.regrouped, np.int64))).tolist():
            out[k] = not self.same_value(spec_a[k], spec_b[k]) if is_in[k] else int(uid[k]) in self.partial_out
        return out
