"""One kernel launch for the statistics of an accelerator tensor, where torch's operations take
about thirty (the extremes, the counts, two summation trees, the casts and the stack): a Triton
kernel, used on the devices Triton compiles for (CUDA, ROCm, XPU) when the ``triton`` package
torch ships with is importable and at least :data:`MIN_TRITON`. Elsewhere, or with
``DISPATCHPROBE_FUSED_STATS=0``, :func:`row` returns None and the caller uses torch's operations,
which give the same row.

Each program of the launch reduces one chunk of 32768 values into a partial row
(:data:`dispatchprobe.standards.statistics.PARTIAL_FIELDS`), its sums in
:func:`~dispatchprobe.standards.statistics.tree_sums`' order; the partials stay on the device until
the recorder reads a batch of them with one host sync, and are combined there in that order
(:func:`~dispatchprobe.standards.statistics.row_from_partials`): the record the CPU paths give
the same values, bit for bit.
"""

from __future__ import annotations

import functools
import os

import torch

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_CHUNK = 32768        # values one program reduces: statistics.tree_sums' chunk
_FIELDS = 11          # statistics.PARTIAL_FIELDS


# the first Triton whose run of the kernel (its interpreter) gives the CPU record bit for bit;
# Triton 3.1 (torch 2.5) does not, and releases in between are not checked: torch's operations there
MIN_TRITON = (3, 8)


def triton_release() -> tuple[int, int] | None:
    """(major, minor) of the installed Triton, or None where it is not installed or broken."""
    try:
        import triton
        return tuple(int(p) for p in triton.__version__.split(".")[:2])
    except Exception:       # not installed (CPU-only torch), broken, or an odd version string
        return None


@functools.lru_cache(maxsize=None)
def _kernels():
    """The kernels' module (each compiled on first launch), or None where Triton is unavailable,
    older than :data:`MIN_TRITON`, or turned off."""
    if os.environ.get("DISPATCHPROBE_FUSED_STATS", "1").lower() in ("0", "false", "no", "off"):
        return None
    release = triton_release()
    if release is None or release < MIN_TRITON:
        return None
    try:
        from . import device_stats_kernels as k
    except Exception:       # broken
        return None
    return k


def kernels_loaded() -> bool:
    """Whether the kernels can be launched here (Triton importable, recent enough, not turned off)."""
    return _kernels() is not None


def available(t: torch.Tensor) -> bool:
    """Whether :func:`row` can reduce ``t`` (device, dtype, layout)."""
    return t.dtype in _DTYPES and t.device.type in ("cuda", "xpu") and _kernels() is not None


def row(seq: torch.Tensor, repeat: int = 1) -> torch.Tensor | None:
    """The float64 partial rows of 1-D ``seq`` (a tensor's values in memory order on an
    accelerator, each standing for ``repeat`` elements) on its device, one per chunk, or None
    when the kernel cannot take it (the caller then uses torch's operations)."""
    if not available(seq):
        return None
    return launch(seq, repeat)


def launch(seq: torch.Tensor, repeat: int = 1) -> torch.Tensor:
    """:func:`row` without the checks (any device Triton runs on, its interpreter included)."""
    seq = seq.contiguous()
    n = seq.numel()
    parts = -(-n // _CHUNK)
    device = seq.device
    out = torch.empty((parts, _FIELDS), dtype=torch.float64, device=device)
    _run(_kernels().reduce_stats[(parts,)], device, (seq, out, n, repeat), seq.dtype == torch.float64)
    return out


def launch_table(values: torch.Tensor, table: torch.Tensor, out: torch.Tensor) -> None:
    """Partial rows of many values copied into the 1-D buffer ``values``, one launch: ``table``
    (int64, on the device) has a row per chunk (start in ``values``, values in the chunk, repeat,
    row of ``out`` written), ``out`` the float64 rows (:mod:`.device_batch`)."""
    _run(_kernels().reduce_table[(table.shape[0],)], values.device, (values, table, out),
         values.dtype == torch.float64)


def _run(kernel, device, args: tuple, wide: bool) -> None:
    options = {"WIDE": wide, "enable_fp_fusion": False}
    if device.type == "cuda" and _cuda_devices() > 1 and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):          # Triton launches on the current device
            kernel(*args, **options)
    else:
        kernel(*args, **options)


@functools.lru_cache(maxsize=None)
def _cuda_devices() -> int:
    return torch.cuda.device_count()
