"""Whether two runs are otherwise bit-identical, so that any statistics difference is a difference.

Statistics are deterministic (``standards.statistics.tree_sums``: equal values give equal
statistics on every path), so between runs of the same kernels a statistics difference of any
size means the values differ, and lineage starts at the first one.  Across frameworks, framework
versions, device kinds, precisions or compiled against eager code, kernels round differently at
every op and statistics below a small floor count as equal (``origin.STATS_NOISE``)."""

from __future__ import annotations

import numpy as np
import pandas as pd


def device_kind(manifest: dict) -> str:
    """``cuda`` of ``cuda:1``; "" when the manifest does not say."""
    return str(manifest.get("device") or "").split(":")[0]


def same_kernels(manifest_a: dict, manifest_b: dict) -> bool:
    """Both runs recorded by the same framework and version on the same kind of device."""
    return all(manifest_a.get(k) and manifest_a.get(k) == manifest_b.get(k) for k in ("framework", "framework_version")) \
        and bool(device_kind(manifest_a)) and device_kind(manifest_a) == device_kind(manifest_b)


def otherwise_identical(df: pd.DataFrame, recs_a: list, recs_b: list, pairs: list, only_a, only_b,
                        differing: np.ndarray) -> bool:
    """Of two runs of the same kernels (:func:`same_kernels`), one step/rank part: every paired
    record compiled in both runs or in neither, every paired tensor of one dtype and carrying the
    same precision, and the records before the first difference (``differing``: its rows, at any
    size, or a record in one run only) paired one to one in the same order.  The same whichever
    run is A."""
    if not len(df):
        return False
    if (df["dtype_a"].to_numpy(object) != df["dtype_b"].to_numpy(object)).any() or \
            (df["lineage_a"].to_numpy() != df["lineage_b"].to_numpy()).any():
        return False
    if any(bool(recs_a[i].get("compiled")) != bool(recs_b[j].get("compiled")) for i, j, _ in pairs):
        return False
    rows = np.flatnonzero(differing)
    first = min(([int(df["uid"].to_numpy()[rows].min())] if len(rows) else []) + [*only_a, *only_b], default=None)
    if first is None:
        return True
    to_b = {i: j for i, j, _ in pairs}
    return all(to_b.get(k) == k for k in range(first))
