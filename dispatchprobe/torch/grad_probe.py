"""The grad probe's torch side: at every optimizer's step pre-hook (torch's global hook), the
gradients of that optimizer's parameters are measured and handed to the task's handler
(:class:`dispatchprobe.core.grad_probe.GradHandler`).

A DTensor gradient (FSDP2, tensor parallel) is measured on its local shard and the measures are
reduced over the mesh dimensions it is sharded on (max, min, sums: one all-reduce of each kind per
group of parameters, the same on every rank), so every rank records the whole gradient's
statistics; its sign bits stay the local shard's, with the placement.  Every rank takes part in
those reductions, also a rank that ``rank`` leaves out.

Everything a step measures stays where the gradients are until the end: on an accelerator the
statistics, the L0 checksums and the packed sign bits of all parameters come to the host in one
transfer per device (:func:`fetch`); on a CPU the native kernel reads each contiguous float32 or
bfloat16 gradient once from memory for all of them (statistics, checksum, signs, L2 counts), and
numpy, faster there than torch's operations, measures the others.
"""

from __future__ import annotations

import math
import weakref

import numpy as np
import torch

from ..core.grad_probe import CHECKSUM_KIND, CHECKSUM_ROW, checksum_hex, checksum_of, grad_record, has_signs, md5_of, \
    measures
from . import fused_stats, hooks
from .internals.tensors import foreach_norm
from .parameters import ParamGrad, named_gradients, parameter_names, placement_of
from .process_state import ProbeWork

_NUMPY_FLOATS = (torch.float32, torch.float64, torch.float16)
_ONE_PASS = (torch.float32, torch.bfloat16)    # the dtypes fused_stats.grad_pass reads

_BIT_WEIGHTS: dict = {}


def packed_signs(t: torch.Tensor):
    """``t > 0`` packed as ``np.packbits`` packs (first element in the highest bit): a numpy array on a
    CPU; on an accelerator a uint8 tensor on the device (an eighth of a byte per element comes back,
    with the step's other results in one transfer, :func:`fetch`)."""
    if t.device.type == "cpu":
        if t.dtype in _NUMPY_FLOATS:            # numpy's comparison is some 3x faster than torch's on CPU
            return np.packbits(np.greater(t.numpy().reshape(-1), 0))
        return np.packbits((t.reshape(-1) > 0).numpy())
    bits = t.reshape(-1) > 0
    n = bits.numel()
    w = _BIT_WEIGHTS.get(bits.device)
    if w is None:
        w = _BIT_WEIGHTS[bits.device] = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8,
                                                     device=bits.device)
    if n % 8:
        bits = torch.nn.functional.pad(bits, (0, -n % 8))
    return (bits.view(torch.uint8).view(-1, 8) * w).sum(1, dtype=torch.uint8)


def checksum_on_device(t: torch.Tensor) -> torch.Tensor:
    """:func:`~dispatchprobe.core.grad_probe.checksum_of` computed where ``t`` lives: its bytes as
    int64 words (two's complement wraps as uint64 does: the same sums), the row and column sums of
    the words in rows of ``CHECKSUM_ROW``, combined on the device.  Returns int64 ``[S0, S1]`` on
    ``t``'s device; nothing is read back (:func:`checksum_hex` of the two reads them)."""
    raw = t.reshape(-1).view(torch.uint8)
    if raw.storage_offset() % 8:                        # an int64 view needs 8-byte alignment
        raw = raw.clone()
    full = raw.numel() // 8 * 8
    words = raw[:full].view(torch.int64)
    n = words.numel()
    rows = n // CHECKSUM_ROW
    block = words[:rows * CHECKSUM_ROW].view(rows, CHECKSUM_ROW)
    index = torch.arange(rows, dtype=torch.int64, device=t.device)
    cols = torch.arange(1, CHECKSUM_ROW + 1, dtype=torch.int64, device=t.device)
    row_sums = block.sum(1)                             # two reductions read the words: rows, columns
    s0 = row_sums.sum()
    s1 = (index * row_sums).sum() * CHECKSUM_ROW + (cols * block.sum(0)).sum()
    tail = words[rows * CHECKSUM_ROW:]
    if full < raw.numel():                              # the last word, zero-padded
        last = torch.zeros(8, dtype=torch.uint8, device=t.device)
        last[:raw.numel() - full] = raw[full:]
        tail = torch.cat([tail, last.view(torch.int64)])
    if tail.numel():
        weights = torch.arange(rows * CHECKSUM_ROW + 1, rows * CHECKSUM_ROW + tail.numel() + 1, dtype=torch.int64,
                               device=t.device)
        s0 = s0 + tail.sum()
        s1 = s1 + (weights * tail).sum()
    return torch.stack([s0, s1])


def checksum_record(t: torch.Tensor, md5: bool):
    """A gradient's L0 checksum for its record: msprobe's MD5 (on the host) when asked for, else
    ``{"kind", "value"}`` of :func:`checksum_of`: done here on a CPU, a pending int64 pair on a device."""
    if md5:
        return md5_of(t.float().cpu().numpy())
    if t.device.type != "cpu":
        return checksum_on_device(t)
    return {"kind": CHECKSUM_KIND, "value": checksum_of(t.reshape(-1).view(torch.uint8).numpy())}


def fetch(items: list) -> list:
    """The tensors among ``items`` (float64 rows, int64 checksums, uint8 sign bits) as numpy arrays
    of their dtype and shape, in one transfer per device (their bytes concatenated); anything else
    is returned as it is."""
    out = list(items)
    by_device: dict = {}
    for i, x in enumerate(items):
        if isinstance(x, torch.Tensor):
            by_device.setdefault(x.device, []).append(i)
    for idx in by_device.values():
        parts = [items[i].contiguous().reshape(-1).view(torch.uint8) for i in idx]
        host = torch.cat(parts).cpu().numpy()
        sizes = np.cumsum([p.numel() for p in parts])[:-1]
        for i, chunk in zip(idx, np.split(host, sizes)):
            t = items[i]
            dtype = np.dtype(str(t.dtype).removeprefix("torch."))
            out[i] = chunk.view(dtype).reshape(tuple(t.shape))
    return out


def measure_all(ts: list[torch.Tensor], level: str, bounds, signs: bool = False, checksum: bool = False):
    """Each gradient's (or shard's) measures (:func:`~dispatchprobe.core.grad_probe.measures`): a
    float64 row on its device, or floats on a CPU; with ``signs`` and ``checksum`` (the default L0
    checksum) also those of the CPU gradients the one-pass kernel reads.  Returns (rows, sign bits,
    checksum records), None where not computed here (:func:`packed_signs`, :func:`checksum_record`).

    On an accelerator: max and min in one reduction, the sums of squares of all gradients in one
    multi-tensor launch, nothing read back.  On a CPU, contiguous float32 and bfloat16 gradients
    (finite sums of squares) are read once from memory, all in one native call
    (:func:`~dispatchprobe.torch.fused_stats.grad_pass`); the others in numpy (its comparisons and
    reductions are faster than torch's there), with max, min and sum of squares by the statistics
    kernel where it is built."""
    n = len(ts)
    rows: list = [None] * n
    bits: list = [None] * n
    sums: list = [None] * n
    on_device = [i for i, t in enumerate(ts) if t.device.type != "cpu" and t.numel()]
    if on_device:
        flats = [ts[i].reshape(-1) for i in on_device]
        flats = [f if f.dtype in (torch.float32, torch.float64) else f.float() for f in flats]
        norms = foreach_norm(flats, 2)
        for i, f, norm in zip(on_device, flats, norms):
            lo, hi = torch.aminmax(f)
            head = torch.stack([hi, lo, norm * norm]).to(torch.float64)
            tail = measures(f, torch, level, bounds, base=[])
            rows[i] = torch.cat([head, torch.stack(tail).to(torch.float64)]) if tail else head
    one_pass = fused_stats.grad_rows
    if one_pass is not None:
        take = [i for i, t in enumerate(ts) if t.device.type == "cpu" and t.dtype in _ONE_PASS and t.numel()
                and t.is_contiguous()]
        counted = list(bounds) if level == "L2" else []
        for i, (row, s0, s1, packed) in zip(take, one_pass([ts[i] for i in take], counted, checksum, signs)):
            if row[0] != fused_stats.FINITE:
                continue                                # inf or nan: numpy's reductions, below
            rows[i] = [row[1], row[2], row[3]]
            if counted:
                below, numel = row[5:], ts[i].numel()
                rows[i] += [below[0], *(hi - lo for lo, hi in zip(below, below[1:])), numel - below[-1], row[4]]
            bits[i] = packed
            if checksum:
                sums[i] = {"kind": CHECKSUM_KIND, "value": checksum_hex(s0, s1)}
    for i, t in enumerate(ts):
        if rows[i] is None:
            rows[i] = _measure_on_host(t, level, bounds)
            bits[i] = sums[i] = None
    return rows, bits, sums


def _measure_on_host(t: torch.Tensor, level: str, bounds) -> list[float]:
    if t.device.type != "cpu":                      # an empty shard on a device
        return [float(v) for v in measures(t, torch, level, bounds)]
    base = None
    kernel = fused_stats.stats4
    if kernel is not None and t.numel() and t.dtype in (torch.float32, torch.bfloat16) and t.is_contiguous():
        mx, mn, _, sumsq = kernel(t)                  # sums in double; nan/inf: numpy's reductions
        base = [mx, mn, sumsq] if math.isfinite(sumsq) else None
    x = t.numpy() if t.dtype in _NUMPY_FLOATS else t.float().numpy()
    return [float(v) for v in measures(x, np, level, bounds, base)]


def _replicate_partial(g: ParamGrad) -> ParamGrad:
    """A gradient still pending a sum (``Partial``) is summed first: its max cannot be reduced."""
    from torch.distributed.tensor import Replicate
    if not any(p.is_partial() for p in g.dtensor.placements):
        return g
    full = g.dtensor.redistribute(placements=[Replicate() if p.is_partial() else p for p in g.dtensor.placements])
    return ParamGrad(g.name, g.param, full.to_local(), g.shape, g.source, dtensor=full, placement=placement_of(full))


def _reduce_sharded(grads: list[ParamGrad], rows: list[torch.Tensor]) -> None:
    """Reduce the measures of sharded gradients over the mesh dimensions they are sharded on, in
    place: per group of equal (mesh, sharded dimensions), one MAX, one MIN and one SUM all-reduce."""
    import torch.distributed as dist
    groups: dict = {}
    for i, g in enumerate(grads):
        if g.dtensor is None:
            continue
        mesh = g.dtensor.device_mesh
        dims = tuple(d for d, p in enumerate(g.dtensor.placements) if p.is_shard())
        if dims:
            groups.setdefault((id(mesh), dims), (mesh, dims, []))[2].append(i)
    for mesh, dims, idx in groups.values():
        device = grads[idx[0]].local.device
        block = torch.stack([torch.as_tensor(rows[i], dtype=torch.float64, device=device) for i in idx])
        hi, lo, sums = block[:, 0].contiguous(), block[:, 1].contiguous(), block[:, 2:].contiguous()
        for d in dims:
            group = mesh.get_group(d)
            dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
            dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        for k, i in enumerate(idx):
            rows[i] = torch.cat([hi[k:k + 1], lo[k:k + 1], sums[k]])


class GradReader:
    """Reads the gradients of every optimizer that steps, for one probe (its ``model`` names them)."""

    def __init__(self, session, model: torch.nn.Module):
        fused_stats.load()              # the one-pass CPU statistics kernel, where it is built
        self.handler = session.handlers[0]
        self.names = parameter_names(model)
        self._model = weakref.ref(model)
        ref = weakref.ref(self)

        def pre_step(optimizer, args, kwargs) -> None:
            reader = ref()
            if reader is not None:
                reader.on_step(optimizer)
        hooks.remove_collected()
        self._remove_hook = hooks.optimizer_hook(self, pre_step)     # a probe never closed leaves no hook behind

    def remove(self) -> None:
        self._remove_hook()

    def holds(self, optimizer) -> bool:
        """Whether ``optimizer`` updates parameters of the probe's model (not another model's).  The
        names are read again when the optimizer holds a parameter they lack: a model wrapped after
        the probe was built (``fully_shard`` replaces its parameters) is still named."""
        model = self._model()
        if model is None:       # its parameters are gone: their ids may now name another model's
            return False
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not all(id(p) in self.names for p in params):
            self.names = parameter_names(model)
        return any(id(p) in self.names for p in params)

    def on_step(self, optimizer) -> None:
        if not self.holds(optimizer):
            return
        h = self.handler
        step_on, here = h.begin(optimizer)
        if not step_on:
            return
        grads = [g for g in named_gradients(optimizer=optimizer, names=self.names)
                 if id(g.param) in self.names and h.select(g.name)]
        if not here and not any(g.dtensor is not None for g in grads):
            return          # a rank left out computes only what the other ranks' reductions need
        with ProbeWork():
            grads = [_replicate_partial(g) if g.dtensor is not None else g for g in grads]
            rows, signs, sums = measure_all([g.local for g in grads], h.level, h.bounds,
                                            signs=here and has_signs(h.level),
                                            checksum=here and h.level == "L0" and not h.md5)
            _reduce_sharded(grads, rows)
            if not here:
                return
            if has_signs(h.level):
                signs = [packed_signs(g.local) if b is None else b for g, b in zip(grads, signs)]
            if h.level == "L0":
                sums = [checksum_record(g.local, h.md5) if c is None else c for g, c in zip(grads, sums)]
            n = len(grads)
            host = fetch(rows + signs + sums)              # one transfer per device
            values, signs, sums = host[:n], host[n:2 * n], host[2 * n:]
            items = []
            for g, row, bits, checksum in zip(grads, values, signs, sums):
                rec = grad_record(g.name, dtype=str(g.local.dtype).removeprefix("torch."), shape=g.shape,
                                  values=row, level=h.level, bounds=h.bounds, source=g.source)
                if g.placement is not None:
                    rec["dtensor"] = g.placement.to_dict()
                if isinstance(checksum, str):
                    rec["md5"] = checksum
                elif isinstance(checksum, np.ndarray):
                    rec["checksum"] = {"kind": CHECKSUM_KIND, "value": checksum_hex(*(int(v) for v in checksum))}
                elif checksum is not None:
                    rec["checksum"] = checksum
                items.append((rec, bits))
            h.write(items)

