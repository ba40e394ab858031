"""Runs recorded with different tasks.  An inline check (overflow, free_benchmark) records only the
ops it flagged, so against a run of every op most records have no counterpart by design: those are
explained (never a suspect), the verdict says which tasks the runs used and what compare judged, and
a 'could not be aligned' line names the tasks instead of guessing different models."""

from __future__ import annotations

from ..coverage import unrecorded_graphs

FLAGGED_ONLY = ("overflow", "free_benchmark")     # inline checks: records of the ops they flagged only
NOT_RECORDED = "not recorded by the other run's task"


def task_of(manifest: dict):
    return (manifest.get("config") or {}).get("task")


def flagged_only_side(manifest_a: dict, manifest_b: dict) -> str | None:
    """``"a"`` or ``"b"``: the run that records only the ops its check flagged, where the other run's
    task records every op; None when the runs' records are alike (same task, or neither a check)."""
    ta, tb = task_of(manifest_a), task_of(manifest_b)
    if (ta in FLAGGED_ONLY) == (tb in FLAGGED_ONLY):
        return None
    return "a" if ta in FLAGGED_ONLY else "b"


def explanation(manifest_a: dict, manifest_b: dict) -> str:
    """The ``explained`` entry of a record only the run of every op has."""
    side = flagged_only_side(manifest_a, manifest_b)
    task = task_of(manifest_a if side == "a" else manifest_b)
    return f"{NOT_RECORDED} ({task} records only the ops it flagged)"


def tasks_note(manifest_a: dict, manifest_b: dict) -> str | None:
    """The verdict's line for runs of different tasks (None for runs of one task)."""
    ta, tb = task_of(manifest_a), task_of(manifest_b)
    if not ta or not tb or ta == tb or {ta, tb} == {"statistics", "tensor"}:
        return None
    held = " and ".join(f"{side} ({task}) holds only the ops it flagged" for side, task in (("A", ta), ("B", tb))
                        if task in FLAGGED_ONLY)
    return (f"the runs used different tasks, A {ta} and B {tb}" + (f": {held}; compare judged those ops against "
                                                                    "the other run's same ops, the other ops are not "
                                                                    "judged" if held else "")
            + "; record both runs with one task to compare them whole")


def unaligned_hint(manifest_a: dict, manifest_b: dict, short: bool = False) -> str:
    """The parenthesis of a 'could not be aligned' line: what the manifests say made the records
    differ (compiled graphs not recorded, other tasks), else a guess; ``short``: a part's line,
    beside the verdict's own warning line."""
    graphs = unrecorded_graphs(manifest_a, manifest_b, short)
    if graphs is not None:
        return graphs
    return "different models or options?" if tasks_note(manifest_a, manifest_b) is None else \
        f"the runs used different tasks, A {task_of(manifest_a)} and B {task_of(manifest_b)}"
