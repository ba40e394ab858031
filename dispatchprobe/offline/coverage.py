"""What a run's records leave out by the way it was recorded, said rather than guessed at: a model
compiled with ``torch.compile`` but not with ``probe_backend`` runs its graphs past the eager probe,
which records only the code around them (the loss, the optimizer, graph breaks), so against an
eager run most records have no counterpart."""

from __future__ import annotations

from ..records.format import UNRECORDED_GRAPHS, UNRECORDED_HIGHER_ORDER, unrecorded_steps_note  # noqa: F401


def graphs_note(manifest: dict) -> str | None:
    """The one-line account of a run whose compiled graphs were not recorded (None otherwise)."""
    if not manifest.get(UNRECORDED_GRAPHS):
        return None
    return ("torch.compile'd graphs ran without probe_backend: their ops are not recorded, only the code "
            "around them; compile with backend=probe_backend(...) to record inside them")


def unrecorded_graphs(manifest_a: dict, manifest_b: dict, short: bool = False) -> str | None:
    """The compare line naming the runs whose compiled graphs were not recorded (None: neither);
    ``short``: the few words a part's 'could not be aligned' line gives beside the run's line."""
    sides = [side for side, m in (("A", manifest_a), ("B", manifest_b)) if graphs_note(m)]
    if not sides:
        return None
    if short:
        return ("both runs'" if len(sides) == 2 else f"run {sides[0]}'s") + " compiled graphs were not recorded"
    who = "both runs" if len(sides) == 2 else f"run {sides[0]}"
    return f"{who}: {graphs_note(manifest_a if sides[0] == 'A' else manifest_b)}"


def higher_order_note(manifest: dict) -> str | None:
    """The one-line account of higher-order ops the eager probe ran outside compiled code (None: none)."""
    names = manifest.get(UNRECORDED_HIGHER_ORDER)
    if not names:
        return None
    return (f"higher-order ops ran outside compiled code ({', '.join(names)}): the ops they run inside "
            f"are not recorded")
