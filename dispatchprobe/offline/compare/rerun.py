"""How much of an op's output difference is its own: the op re-run in float64 on each run's recorded
inputs (the framework's run-ut replay) gives the difference its inputs' differences carry through
it; what the recorded outputs differ by beyond that, and beyond the op's rounding, is its own.

Optional: compare runs without the framework importable (docs/architecture.md: the offline side reads only records); then
:func:`float64_rerun` gives None and the origin is decided on statistics (approximate).
"""

from __future__ import annotations

import importlib

import numpy as np

from ...records.format import walk
from ...records.reader import Part

# unit roundoff per dtype: the rounding one correct kernel may add
ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
BUDGET = 32             # ops re-run per step/rank part; past it, the recorded errors decide (approximate)
ELEMENTS = 1 << 23      # and at most this many recorded elements (inputs and outputs of both runs;
                        # the driver sets it to 1/64 of what the part's metrics read)


class Float64Rerun:
    """Re-runs paired op records of two parts in float64 and measures each one's own contribution."""

    def __init__(self, module: str, part_a: Part, part_b: Part):
        self.module = module          # the framework's replay module: imported at the first re-run
        self.replayer = None
        self.parts = (part_a, part_b)
        self.left = BUDGET
        self.elements = ELEMENTS

    def _load(self) -> bool:
        if self.replayer is None:
            try:
                self.replayer = importlib.import_module(self.module).REPLAYER
                self.sources = [self.replayer.tensor_source(p) for p in self.parts]
                self.device = self.replayer.resolve_device("cpu")
            except Exception:  # noqa: BLE001 - not importable here: the recorded errors decide (approximate)
                self.left = 0
                return False
        return True

    def _bench(self, side: int, record: dict) -> dict | None:
        try:
            res = self.replayer.replay(record, self.sources[side], self.device, False)
        except Exception:  # noqa: BLE001 - not replayable (random, custom, unsaved): the statistics decide
            return None
        # a compiled graph's record is not run again (its kernel's outputs are the recorded ones): its
        # float64 benchmark comes with the recorded outputs, the same benchmark of the same inputs
        return {o.name: o.bench for o in (*res.recorded, *res.outputs)}

    def own(self, rec_a: dict, rec_b: dict, outputs: list) -> bool | None:
        """Whether any of ``outputs`` (``(arg, key_a, key_b, dtype)`` of the differing float outputs)
        differs by more than its inputs carry through the op plus twice its rounding; None when the
        op cannot be re-run (the caller falls back to the statistics rule)."""
        if self.left <= 0 or not outputs:
            return None
        size = _elements(rec_a) + _elements(rec_b)
        # the budget first: the framework is imported (seconds) only for an op that will be re-run
        if size > self.elements or not self._load():
            return None
        self.left -= 1
        self.elements -= size
        ref_a, ref_b = self._bench(0, rec_a), self._bench(1, rec_b)
        if ref_a is None or ref_b is None:
            return None
        decided = None
        for arg, key_a, key_b, dtype in outputs:
            ra, rb = ref_a.get(arg), ref_b.get(arg)
            if ra is None or rb is None or key_a is None or key_b is None:
                continue
            try:
                oa = np.asarray(self.parts[0].tensor(key_a), dtype=np.float64)
                ob = np.asarray(self.parts[1].tensor(key_b), dtype=np.float64)
                ra, rb = np.asarray(ra, dtype=np.float64), np.asarray(rb, dtype=np.float64)
                if not (oa.size == ob.size == ra.size == rb.size):
                    continue
                oa, ob, ra, rb = (x.reshape(-1) for x in (oa, ob, ra, rb))
            except Exception:  # noqa: BLE001 - complex, unreadable: not measured
                continue
            ok = np.isfinite(oa) & np.isfinite(ob) & np.isfinite(ra) & np.isfinite(rb)
            if not ok.all():
                if (np.isfinite(oa) != np.isfinite(ob)).any() and (np.isfinite(ra) == np.isfinite(rb)).all():
                    return True   # inf/nan in one run only that its inputs do not explain
                oa, ob, ra, rb = oa[ok], ob[ok], ra[ok], rb[ok]
            # both runs' sizes, so that the verdict is the same whichever run is A
            scale = max(*(float(np.linalg.norm(x)) for x in (ra, rb, oa, ob)), np.finfo(np.float64).tiny)
            own = float(np.linalg.norm((oa - ob) - (ra - rb))) / scale
            rounding = min(float(np.linalg.norm(oa - ra)), float(np.linalg.norm(ob - rb))) / scale
            if own > 4 * rounding + ROUNDOFF.get(dtype, 2.0 ** -24):
                return True
            decided = False
        return decided


def _elements(record: dict) -> int:
    n = 0
    for _, _, spec in walk(record):
        k = 1
        for d in spec.get("shape") or ():
            k *= int(d)
        n += k
    return n


def float64_rerun(framework: str, part_a: Part, part_b: Part) -> Float64Rerun | None:
    """The re-run for two parts of ``framework``, or None where it has no replayer.  The framework is
    imported at the first op to re-run (a compare of statistics records never imports it); where it
    cannot be, every op is decided on the recorded errors."""
    from ..replayer import REPLAYERS
    module = REPLAYERS.get(framework or "torch")
    return None if module is None else Float64Rerun(module, part_a, part_b)
