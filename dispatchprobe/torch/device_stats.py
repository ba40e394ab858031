"""One kernel launch for the statistics row of an accelerator tensor, where torch's reductions take
about fourteen (aminmax, two sums, two counts, the casts and the stack): a Triton kernel, used on
the devices Triton compiles for (CUDA, ROCm, XPU) when the ``triton`` package torch ships with is
importable. Elsewhere, or with ``DISPATCHPROBE_FUSED_STATS=0``, :func:`row` returns None and the
caller uses torch's reductions.

The row is :func:`dispatchprobe.standards.statistics.from_row`'s layout (max, min, sum, L2 norm,
nan count, inf count; where the values hold inf/nan and some are finite, the finite max and min in
the sum and norm slots), in float64, with sums accumulated in float64 in a fixed order, so a
tensor's row is the same on every run. Nothing is read back here: rows stay on the device until
the recorder reads a batch of them with one host sync.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_ONE_PROGRAM = 1 << 16        # elements one program reduces; larger tensors: partials, then one more launch
_BLOCK = 1024


@functools.lru_cache(maxsize=None)
def _kernels():
    """The two kernels (compiled on first launch), or None where Triton is unavailable or off."""
    if os.environ.get("DISPATCHPROBE_FUSED_STATS", "1").lower() in ("0", "false", "no", "off"):
        return None
    try:
        from . import device_stats_kernels as k
    except Exception:       # not installed (CPU-only torch), or broken
        return None
    return k.reduce_stats, k.finish_stats


def available(t: torch.Tensor) -> bool:
    """Whether :func:`row` can reduce ``t`` (device, dtype, layout)."""
    return t.device.type in ("cuda", "xpu") and t.dtype in _DTYPES and _kernels() is not None


def row(x: torch.Tensor) -> torch.Tensor | None:
    """The float64 statistics row of ``x`` (a non-empty tensor on an accelerator) on its device,
    or None when the kernel cannot take it (the caller then uses torch's reductions)."""
    if not available(x):
        return None
    return launch(x)


def launch(x: torch.Tensor) -> torch.Tensor:
    """:func:`row` without the checks (any device Triton runs on, its interpreter included)."""
    if not x.is_contiguous():
        x = x.contiguous()            # one copy; the reduction itself stays one pass
    reduce_, finish = _kernels()
    n = x.numel()
    out = torch.empty(6, dtype=torch.float64, device=x.device)
    switch = x.device.type == "cuda" and x.device.index != torch.cuda.current_device()
    with torch.cuda.device(x.device) if switch else contextlib.nullcontext():
        if n <= _ONE_PROGRAM:
            reduce_[(1,)](x, out, n, n, BLOCK=_BLOCK, FINAL=True)
        else:
            parts = -(-n // _ONE_PROGRAM)
            partials = torch.empty(parts * 8, dtype=torch.float64, device=x.device)
            reduce_[(parts,)](x, partials, n, _ONE_PROGRAM, BLOCK=_BLOCK, FINAL=False)
            finish[(1,)](partials, out, parts, BLOCK=128)
    return out
