"""Forward ops activation checkpointing re-runs inside backward (records marked ``recompute``).

A checkpointed run re-runs a forward piece while its backward runs, to remake the values it did
not keep; the same program without checkpointing runs nothing there.  Such a record is no backward
op: it reproduces a forward value of its own run, which the backward ops then read.  So a
recomputed record is compared only with the other run's recomputed records of the same scope
(both runs checkpoint that module: op by op, as any records).  Where the other run does not
re-run that scope, the records are set aside before alignment, listed as unmatched with the reason
and never judged: the backward ops reading their values are then linked, by the values' keys, to
the forward records that made those values first (the values a re-run reproduces), so a backward
that follows from differing forward values says so as without checkpointing."""

from __future__ import annotations

RECOMPUTED = "recomputed by activation checkpointing"


def recomputed(record: dict) -> bool:
    return bool(record.get("recompute"))


def set_aside(recs_a: list, recs_b: list) -> tuple[list, list, list, list]:
    """(records of A kept, of B kept, of A set aside, of B set aside): a recomputed record is set
    aside where the other run re-runs nothing of its scope.  The same scopes are kept whichever
    run is A."""
    scopes_a = {r["scope"] for r in recs_a if recomputed(r)}
    scopes_b = {r["scope"] for r in recs_b if recomputed(r)}
    if scopes_a == scopes_b:
        return recs_a, recs_b, [], []
    both = scopes_a & scopes_b
    out = []
    for recs in (recs_a, recs_b):
        out.append([r for r in recs if not recomputed(r) or r["scope"] in both])
    for recs in (recs_a, recs_b):
        out.append([r for r in recs if recomputed(r) and r["scope"] not in both])
    return tuple(out)


def one_run_only(side: str) -> str:
    """The ``explained`` text of a recomputed record the other run has no re-run of."""
    return f"{RECOMPUTED} in run {side.upper()} only: not judged (it reproduces a forward value of its run)"


def unpaired() -> str:
    """The ``explained`` text of a recomputed record both runs re-run the scope of, left unpaired."""
    return f"{RECOMPUTED}, no counterpart among the other run's re-run ops: not judged"
