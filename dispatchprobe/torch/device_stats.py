"""One kernel launch for the statistics of an accelerator tensor, where torch's reductions take
about fourteen (aminmax, two sums, two counts, the casts and the stack): a Triton kernel, used on
the devices Triton compiles for (CUDA, ROCm, XPU) when the ``triton`` package torch ships with is
importable. Elsewhere, or with ``DISPATCHPROBE_FUSED_STATS=0``, :func:`row` returns None and the
caller uses torch's reductions.

Each program of the launch reduces 65536 values into a partial row of 8 (max and min without nan,
finite max and min, sum, sum of squares, nan and inf counts), in float64; the partials stay on the
device until the recorder reads a batch of them with one host sync, and are combined there, in
order (:func:`dispatchprobe.standards.statistics.row_from_partials`), so a tensor's row is the same
on every run and no second launch finishes it.
"""

from __future__ import annotations

import functools
import os

import torch

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_ONE_PROGRAM = 1 << 16        # elements one program reduces into a partial row
_BLOCK = 1024


@functools.lru_cache(maxsize=None)
def _kernels():
    """The kernel (compiled on first launch), or None where Triton is unavailable or off."""
    if os.environ.get("DISPATCHPROBE_FUSED_STATS", "1").lower() in ("0", "false", "no", "off"):
        return None
    try:
        from . import device_stats_kernels as k
    except Exception:       # not installed (CPU-only torch), or broken
        return None
    return k.reduce_stats


def available(t: torch.Tensor) -> bool:
    """Whether :func:`row` can reduce ``t`` (device, dtype, layout)."""
    return t.dtype in _DTYPES and t.device.type in ("cuda", "xpu") and _kernels() is not None


def row(x: torch.Tensor) -> torch.Tensor | None:
    """The float64 partial rows of ``x`` (a non-empty tensor on an accelerator) on its device, one
    row of 8 per 65536 values, or None when the kernel cannot take it (the caller then uses
    torch's reductions)."""
    if not available(x):
        return None
    return launch(x)


def launch(x: torch.Tensor) -> torch.Tensor:
    """:func:`row` without the checks (any device Triton runs on, its interpreter included)."""
    if not x.is_contiguous():
        x = x.contiguous()            # one copy; the reduction itself stays one pass
    n = x.numel()
    parts = -(-n // _ONE_PROGRAM)
    device = x.device
    out = torch.empty((parts, 8), dtype=torch.float64, device=device)
    kernel = _kernels()[(parts,)]
    if device.type == "cuda" and _cuda_devices() > 1 and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):          # Triton launches on the current device
            kernel(x, out, n, _ONE_PROGRAM, BLOCK=_BLOCK)
    else:
        kernel(x, out, n, _ONE_PROGRAM, BLOCK=_BLOCK)
    return out


@functools.lru_cache(maxsize=None)
def _cuda_devices() -> int:
    return torch.cuda.device_count()
