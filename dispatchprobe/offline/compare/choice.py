"""Discrete choices the runs make differently: an op that turns float values into a discrete answer
(``topk``'s indices, ``argmax``, a comparison's mask, a float-to-int cast) whose answer differs while
the values it chose from agree within tolerance.  A near-tie that the two runs' rounding resolves
apart (a mixture-of-experts router sending a token to another expert in bfloat16 than in float32)
is no kernel's error, yet everything computed from that answer then differs by far more than
rounding: other rows gathered, other group sizes, other experts' weights.  No op reading those
values can be judged by how far its outputs moved, so the values are followed by data flow from the
choice on (:meth:`Choices.spread`) and their differences are the choice's, never an op's own."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ...standards import verdicts as V
from ..views import LOOK_BACK, STATS_TOLERANCE
from ...standards.loader import is_float

# the reasons of the rows a choice (or a random op whose draws differ) leaves unjudged
# (:meth:`Choices.unjudged_rows`), per the root's cause: its own differing outputs, and what follows it.
# They count apart in the summary (``_Tally``) and read as "not judged", never as an error the verdict
# does not claim
MADE = {"choice": "a discrete choice the runs made differently, from values that agree within tolerance: not judged",
        "random": "a random op whose draws differ between the runs (each run's generator): not judged"}
AFTER = {"choice": "follows a discrete choice the runs made differently",
         "random": "follows a random op whose draws differ between the runs"}


def undecided_kind(reasons: pd.Series) -> pd.Series:
    """Per row: ``"choice"`` or ``"random"`` where its reason is one :data:`MADE`/:data:`AFTER` gives
    for it, else None."""
    text = reasons.astype(str)
    out = pd.Series([None] * len(text), index=text.index, dtype=object)
    for kind in ("choice", "random"):
        out[text.str.startswith(AFTER[kind]) | (text == MADE[kind])] = kind
    return out


class Choices:
    """Per run, the records whose values follow a choice the runs made differently, each with the
    :class:`~.origin.Root` of the earliest such choice it follows.

    ``df``: the part's rows (A's record order); ``a``, ``b``: the two runs (:class:`~.origin.Side`);
    ``rows``: the lineage's per-row lists (see ``__init__``); ``pair_a``: B's record -> A's."""

    def __init__(self, df, a, b, rows: dict, pair_a: dict):
        self.df, self.sides, self.pair_a = df, {"a": a, "b": b}, pair_a
        # per row (plain lists, as the lineage holds them): differs above the statistics floor, is an error
        # row, is an input, both dtypes float; each run's id() of the row's spec
        self.off, self.bad, self.is_in, self.floats, self.spec = (rows[k] for k in ("off", "bad", "is_in", "floats",
                                                                                   "spec"))
        discrete = _discrete(df["dtype_a"]) & _discrete(df["dtype_b"]) if len(df) else np.zeros(0, bool)
        # the records a choice can be made at (a discrete output that differs): the rest never ask more
        at = discrete & np.asarray(rows["off"], bool) & ~np.asarray(rows["is_in"], bool) if len(df) else discrete
        self.candidates = set(df["uid"].to_numpy()[at].tolist())
        self.discrete = discrete.tolist()
        self.moved = self.not_judged = None        # per row, on first use (_rows)
        self.out_row = self.in_row = None          # (A's record, arg) -> output/input row, on first use (_rows)
        self.root: dict = {"a": {}, "b": {}}       # record -> Root of the choice its values follow
        self.chosen: dict = {"a": {}, "b": {}}     # choice record -> its discrete outputs that differ (args)
        self.linked: dict = {"a": {}, "b": {}}     # discrete input spec no record made -> carrying output it is part of

    def flipped(self, i: int, rows: range) -> list:
        """The discrete output rows of paired record ``i`` (A's, its ``rows``) that make it a choice the
        runs made differently: they differ, the record reads float values that all agree within
        tolerance yet differ at all, and no discrete value it reads differs.  Inputs that do not differ
        at all leave the discrete answer the op's own (a wrong ``argmax`` kernel is still named)."""
        if i not in self.candidates:
            return []
        self._rows()
        outs = [k for k in rows if not self.is_in[k] and self.discrete[k] and self.off[k]]
        ins = [k for k in rows if self.is_in[k]]
        floats = [k for k in ins if self.floats[k]]
        if not floats or any(self.bad[k] for k in floats) or not any(self.moved[k] for k in floats):
            return []
        return [] if any(self.discrete[k] and self.off[k] for k in ins) else outs

    def followed(self, i: int, j: int | None):
        """The earliest choice paired records ``i`` (A) and ``j`` (B) follow, in either run (None: none)."""
        if not self.root["a"] and not self.root["b"]:
            return None
        ra, rb = self.root["a"].get(i), self.root["b"].get(j) if j is not None else None
        return ra if rb is None else rb if ra is None else min(ra, rb)

    def follows(self, side: str, index: int):
        """The Root of the choice record ``index`` of run ``side`` follows (None: none)."""
        return self.root[side].get(index)

    def record(self, i: int, j: int | None, root, args: list) -> None:
        """Notes choice ``root`` made at paired records ``i`` (A) and ``j`` (B) with the discrete
        outputs ``args``, and marks what each run computes from those outputs."""
        for name, index in (("a", i), ("b", j)):
            if index is None:
                continue
            self.chosen[name][index] = set(args)
            self.root[name][index] = root
            self.spread(name, index)

    def _carries(self, name: str, src: tuple) -> bool:
        """Whether output ``src`` (record, arg) of run ``name`` can hold values that follow a choice: a
        choice's discrete output that differs; an output of a record that follows one, unless its row
        shows a float value that does not differ at all (a shape-only ``zeros_like``, an ``arange``).
        A discrete value's statistics agree although its elements differ (a one-hot mask of other
        experts), so a discrete output always carries."""
        p, parg = src
        if p not in self.root[name]:
            return False
        if p in self.chosen[name]:
            return parg in self.chosen[name][p]
        self._rows()
        pa = p if name == "a" else self.pair_a.get(p)
        k = self.out_row.get((pa, parg)) if pa is not None else None
        return k is None or self.discrete[k] or self.off[k] or self.not_judged[k]

    def spread(self, name: str, start: int) -> None:
        """Marks the records of run ``name`` after ``start`` that read a value carrying a choice
        (:meth:`_carries`), in execution order, each with the earliest choice it follows.  A discrete
        value no record made is read through a view no record shows (``torch.where``'s index tensors
        are columns of ``nonzero``'s output): it carries a choice where a carrying discrete output
        of its dtype made before it can hold its values (:meth:`_part_of`), as does one whose
        recorded producer made a value that agrees although it differs (:meth:`_unlike`)."""
        side = self.sides[name]
        roots, src, linked = self.root[name], side.flow.src, self.linked[name]
        carriers: list = []      # (record, arg, spec) of the discrete outputs carrying a choice, in order
        for u in range(start, len(side.recs)):
            found = roots.get(u) if u == start else None
            for io, arg, spec in side.flow.walks[u]:
                if io == "input" and u != start:
                    got = linked.get(id(spec)) or src.get(id(spec))
                    if got is not None and not self._carries(name, got) and self._unlike(name, u, arg, got):
                        got = None
                    if got is None and not is_float(spec.get("dtype") or "float32"):
                        got = self._part_of(spec, carriers)
                        if got is not None:
                            linked[id(spec)] = got
                    if got is not None and self._carries(name, got):
                        root = roots[got[0]]
                        found = root if found is None or (root.weak, root.at) < (found.weak, found.at) else found
                elif io == "output" and found is not None and not is_float(spec.get("dtype") or "float32"):
                    carriers.append((u, arg, spec))
            if found is not None and u != start:
                old = roots.get(u)
                roots[u] = found if old is None or (found.weak, found.at) < (old.weak, old.at) else old

    def _unlike(self, name: str, u: int, arg: str, src: tuple) -> bool:
        """Discrete input ``arg`` of record ``u`` of run ``name`` differs while the output ``src`` the
        data flow names as its producer agrees: that link is wrong (a value that agrees makes none that
        differs; identical contents found by key, an in-place write the flow does not see)."""
        self._rows()
        ua, pa = (u, src[0]) if name == "a" else (self.pair_a.get(u), self.pair_a.get(src[0]))
        k, pk = self.in_row.get((ua, arg)), self.out_row.get((pa, src[1]))
        return k is not None and pk is not None and self.discrete[k] and self.off[k] and not self.off[pk]

    def _rows(self) -> None:
        """Built on first use: ``out_row``/``in_row``, (A's record, arg) -> its output/input row; per row,
        ``moved`` (any measurable difference at all, however small: the evidence that a near-tie was
        rounded apart) and ``not_judged``."""
        if self.out_row is None:
            not_judged = self.df["status"].to_numpy(object) == V.NOT_JUDGED
            self.moved = ((self.df["error"].to_numpy(np.float64) > 0) & ~not_judged).tolist()
            self.not_judged = not_judged.tolist()
            uid, args = self.df["uid"].tolist(), self.df["arg"].tolist()
            self.out_row = {(uid[k], args[k]): k for k in range(len(uid)) if not self.is_in[k]}
            self.in_row = {(uid[k], args[k]): k for k in range(len(uid)) if self.is_in[k]}

    @staticmethod
    def _part_of(spec: dict, carriers: list):
        """The latest of ``carriers`` (record, arg, spec) whose values can hold ``spec``'s: the same
        dtype, at least as many elements, a range containing its range and a norm no smaller (the
        containment :mod:`...views` tests for a part of a value).  None: none can."""
        st = spec.get("stats") or {}
        for u, arg, base in reversed(carriers[-LOOK_BACK:]):
            bst = base.get("stats") or {}
            if base.get("dtype") != spec.get("dtype") or not st or not bst:
                continue
            if _numel(base) >= _numel(spec) and bst["min"] <= st["min"] and bst["max"] >= st["max"] \
                    and bst["norm"] * (1 + STATS_TOLERANCE) >= st["norm"]:
                return u, arg
        return None

    def unjudged_rows(self, uid, args, pair_b: dict, where) -> dict:
        """The rows (indexes into ``df``) whose verdict a choice takes: its discrete outputs that differ
        (:data:`MADE`) and every error or warning row of a record whose values follow a choice, in
        either run (:data:`AFTER`, naming it by ``where(root)``); the choice record's other rows are its
        own (the values it chose from, its float outputs).  A random op whose draws differ
        (:meth:`record` with a root of cause ``"random"``) is such a root too.  Returns {row: reason}."""
        if not (self.root["a"] or self.root["b"]) or not len(self.df):
            return {}
        status = self.df["status"].to_numpy(object)
        judged = np.flatnonzero((status == V.ERROR) | (status == V.WARNING))
        reasons, said = {}, {}
        for k in judged.tolist():
            i = int(uid[k])
            if i in self.chosen["a"]:
                if args[k] in self.chosen["a"][i] and not self.is_in[k]:
                    reasons[k] = MADE[_kind(self.root["a"][i])]
                continue
            root = self.followed(i, pair_b.get(i))
            if root is not None:
                if root not in said:
                    said[root] = f"{AFTER[_kind(root)]}, {where(root)}: not judged"
                reasons[k] = said[root]
        return reasons

    def input_root(self, k: int):
        """The choice input row ``k`` carries, from either run's producer of it (the link :meth:`spread`
        inferred first; None: none)."""
        for name in ("a", "b"):
            spec = self.spec[name][k]
            got = self.linked[name].get(spec) or self.sides[name].flow.src.get(spec)
            if got is not None and self._carries(name, got):
                return self.root[name][got[0]]
        return None

    def as_source(self, root, stage: str) -> tuple:
        """A choice as (own-stage, inherited) source of a value of ``stage``: its own stage's, or handed
        on from the stage it was made in (a backward reading the forward's routed values)."""
        return (root, None) if self.sides["a"].recs[root.index]["stage"] == stage else (None, root)


def _kind(root) -> str:
    """A root's kind of undecided point: ``"random"`` (a random op's draws) or ``"choice"``."""
    return "random" if root.cause == "random" else "choice"


def _discrete(dtypes: pd.Series) -> np.ndarray:
    """Per row: the dtype is no float (an integer or bool: indices, masks, counts)."""
    codes, names = pd.factorize(dtypes.to_numpy(object))
    kinds = np.array([not is_float(d) if isinstance(d, str) else False for d in names] + [False], bool)
    return kinds[codes]      # code -1 (a missing dtype) takes the last: no


def _numel(spec: dict) -> int:
    """A spec's element count (a symbolic size counted as 1)."""
    n = 1
    for d in spec.get("shape") or ():
        n *= d if isinstance(d, int) else 1
    return n
