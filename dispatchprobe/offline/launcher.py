"""Offline work spread over the processes of a launcher (``torchrun ... -m dispatchprobe compare``,
``ranks``): each rank takes every world-th piece of the work, rank 0 gathers the results, merges
them and writes the one report; the other ranks learn its verdict (or its error), so every rank
exits alike.  The collectives are the framework's own (run-ut's engine,
:meth:`~dispatchprobe.offline.replayer.Replayer.distributed`: torch.distributed over gloo),
reached only when a launcher started this process (``WORLD_SIZE`` > 1).
"""

from __future__ import annotations

import os

from ..records.reader import RecordError


def engine_for(run):
    """The launcher's engine when this process runs under one with other ranks, else None."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    from .replayer import replayer_for
    engine = replayer_for(run).distributed()
    return engine if engine is not None and engine.world > 1 else None


def gathered(engine, work: list, run_share):
    """``run_share(list)`` over this rank's share of ``work`` (every world-th item); on rank 0 the
    results of all of ``work`` in its order (``run_share`` returns one result per item), elsewhere
    None.  Without an engine: ``run_share(work)``."""
    if engine is None:
        return run_share(work)
    mine = run_share(work[engine.rank::engine.world])
    got = engine.gather(mine, dst=0)
    if engine.rank != 0:
        return None
    out: list = [None] * len(work)
    for r, res in enumerate(got):
        out[r::engine.world] = res
    return out


def said_by_rank0(engine, conclude, elsewhere):
    """``conclude()`` on rank 0, which returns ``(..., verdict)``; the other ranks return
    ``elsewhere(verdict)`` with rank 0's verdict, or raise its error."""
    if engine is None:
        return conclude()
    if engine.rank != 0:
        said = engine.broadcast(None)
        if isinstance(said, BaseException):
            raise said
        return elsewhere(said)
    try:
        result = conclude()
    except (RecordError, ValueError) as exc:
        engine.broadcast(exc)
        raise
    except BaseException:
        engine.broadcast(RecordError("rank 0 failed while merging the ranks' results (see its error)"))
        raise
    engine.broadcast(result[-1])
    return result
