"""What a tensor is below its public face: its version counter, its base, its functorch and
DTensor wrappers, the layouts the record names.  Checked on torch 2.5.1 to 2.14.1."""

from __future__ import annotations

import operator

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["FakeTensor", "MKLDNN", "DISABLED_DISPATCH", "functorch", "tensor_version", "tensor_base", "is_view", "dtensor_spec",
           "is_zerotensor", "local_tensor", "foreach_norm", "safetensors_codes", "storage_expired",
           "storage_from_weak"]

#: The mkldnn layout (a layout with no public name).
MKLDNN = torch._mkldnn

#: The ``__torch_dispatch__`` of a class that leaves dispatch to torch (Tensor, Parameter).
DISABLED_DISPATCH = torch._C._disabled_torch_dispatch_impl

#: functorch's C entries: ``is_functorch_wrapped_tensor``, ``maybe_get_level``, ``is_batchedtensor``,
#: ``get_unwrapped``.
functorch = torch._C._functorch

#: A tensor's in-place version counter (a C-level getter: it runs per tensor per op).
tensor_version = operator.attrgetter("_version")

#: Whether a tensor is a view (a C-level call: it runs per tensor per op).
is_view = operator.methodcaller("_is_view")

#: The tensor a view was made from, or None.
tensor_base = operator.attrgetter("_base")

#: Whether a storage held by ``StorageWeakRef`` was freed, from its ``cdata`` (two calls fewer than its method).
storage_expired = torch.UntypedStorage._expired

#: The storage a ``StorageWeakRef``'s ``cdata`` refers to (one not expired), as a new strong reference.
storage_from_weak = torch.UntypedStorage._new_with_weak_ptr

#: Norms of a list of tensors in one call (what optimizers' gradient clipping uses).
foreach_norm = torch._foreach_norm


def is_zerotensor(t) -> bool:
    """Forward-AD's zero tensor: no memory, every element 0."""
    return t._is_zerotensor()


def local_tensor(t):
    """A DTensor's local shard, or None for any other tensor."""
    return getattr(t, "_local_tensor", None)


def dtensor_spec(t):
    """A DTensor's sharding spec (mesh, placements), or None for any other tensor."""
    return getattr(t, "_spec", None)


def safetensors_codes() -> dict:
    """safetensors' dtype codes by torch dtype (``torch.float32: "F32"``), from its own table."""
    from safetensors import torch as safetensors_torch
    return {dtype: code for code, dtype in safetensors_torch._TYPES.items()}
