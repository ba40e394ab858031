"""torch.distributed's private entries the probe reads: functional collectives' wait, process
groups by name, TorchScript objects' class names and methods, DTensor's local shapes.  Checked on
torch 2.5.1 to 2.14.1 (a reduce op hides its ``op`` on 2.5 and 2.6: :func:`has_method` says so)."""

from __future__ import annotations

import torch

__all__ = ["FUNCTIONAL_NAMESPACE", "wait_functional", "resolve_process_group", "script_type_name", "has_method",
           "local_shape_and_offset"]

#: The namespace of functional collectives' ops (``_c10d_functional.all_reduce``).
FUNCTIONAL_NAMESPACE = "_c10d_functional"


def wait_functional(t) -> None:
    """Waits for a functional collective's result."""
    torch.ops._c10d_functional.wait_tensor(t)


def resolve_process_group(name: str):
    """The process group registered under ``name``."""
    return torch.distributed.distributed_c10d._resolve_process_group(name)


def script_type_name(obj) -> str:
    """A TorchScript object's qualified class name (``__torch__.torch.classes.c10d.Work``)."""
    return obj._type().qualified_name()


def has_method(obj, name: str) -> bool:
    """Whether a TorchScript object has method ``name``."""
    return obj._has_method(name)


def local_shape_and_offset(shape, mesh, placements):
    """DTensor's local shape and global offset of a shard, as torch computes them."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    return compute_local_shape_and_global_offset(shape, mesh, placements)
