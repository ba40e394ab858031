"""Where inf/nan started across ranks: each rank's first record holding inf/nan is either an op
that made them from finite values (:func:`dispatchprobe.records.nonfinite.made`: the origin), a
collective whose own inputs were finite (they arrived from another rank through it), or an op
whose inputs already held them (they came with the rank's data)."""

from __future__ import annotations

from typing import NamedTuple

from ...core.collective_roles import role
from ...records.format import walk
from ...records.nonfinite import made


class FirstNonfinite(NamedTuple):
    rank: int
    index: int
    record: dict
    how: str                # "made", "received", "came in"
    collectives_before: int  # numbered collectives this rank ran before it (orders ranks' events)


def _nonfinite(spec: dict) -> bool:
    st = spec.get("stats") or {}
    return bool(st.get("nan") or st.get("inf"))


def first_nonfinite(rank: int, records: list) -> FirstNonfinite | None:
    before = 0
    for i, r in enumerate(records):
        if r.get("kind") != "op":
            continue
        info = r.get("collective")
        if any(_nonfinite(s) for _, _, s in walk(r, inputs=False)):
            if info:
                ro = role(r["op"])
                given = [s for io, arg, s in walk(r, outputs=False)
                         if ro and ro.given and (arg == ro.given or arg.startswith(ro.given + "."))]
                if not any(_nonfinite(s) for s in given):
                    return FirstNonfinite(rank, i, r, "received", before)
            how = "made" if made(r) else "came in"
            return FirstNonfinite(rank, i, r, how, before)
        if info and "seq" in info:
            before += 1
    return None


def describe(first: FirstNonfinite) -> str:
    r = first.record
    where = f"{r['op']} [{r.get('scope') or '<top>'}] ({r.get('stage')})"
    if first.how == "received":
        info = r["collective"]
        return f"rank {first.rank} received inf/nan through {where} #{info.get('seq')} on group {info.get('group')}"
    if first.how == "made":
        return f"rank {first.rank} made inf/nan from finite inputs in {where}"
    return f"rank {first.rank}'s inf/nan came in with the inputs of {where}, its first recorded op holding any"
