"""What each kind of torch tensor is for the record: the one place that decides which memory the
probe may read, so that every task (statistics, tensor, overflow, free_benchmark) reads only that.

- a plain dense tensor (``Tensor``, ``Parameter``) with memory: itself;
- a ``DTensor``: its local shard, with the placements and the mesh in the record;
- a functorch wrapper (``grad``/``jvp`` level): the tensor it wraps, at the level where the values
  are, with that level in the record; a ``vmap`` batched tensor: metadata only (the ops below the
  transform, which the probe records, hold its per-sample values);
- a forward-AD zero tensor (``_efficientzerotensor``): no memory, every element 0;
- no memory to read (FSDP2's parameters between all-gathers, whose storage is resized to 0;
  ``meta``; fake and functional tensors; other wrapper subclasses; sparse layouts): metadata
  only, with the reason, and the memory is never touched.

Reading must also leave a tensor's memory as its owner manages it: ``Tensor.numpy()`` makes a
storage non-resizable for good (FSDP2 frees parameters by resizing), so the probe never takes a
numpy view of memory it does not own; caches hold storages by weak reference only.
"""

from __future__ import annotations

import torch

from .internals.tensors import DISABLED_DISPATCH as _DISABLED
from .internals.tensors import FakeTensor, dtensor_spec, is_zerotensor, local_tensor, tensor_version
from .internals.tensors import functorch as _functorch
from .process_state import STATE
_plain_class: dict[type, bool] = {}


def _is_plain_class(cls: type) -> bool:
    """``Tensor``, ``Parameter`` and subclasses that leave dispatch to torch (no ``__torch_dispatch__``)."""
    hit = _plain_class.get(cls)
    if hit is None:
        hit = _plain_class[cls] = getattr(cls, "__torch_dispatch__", None) is _DISABLED
    return hit


def readable(t: torch.Tensor) -> bool:
    """Whether ``t``'s own memory holds its values and may be read now (the per-op fast path):
    a plain strided tensor with allocated memory.  Empty tensors count as readable."""
    cls = type(t)
    if cls is not torch.Tensor and cls is not torch.nn.Parameter and not _is_plain_class(cls):
        return False
    try:
        ptr = t.data_ptr()       # raises for wrappers without storage, sparse and mkldnn layouts
    except (RuntimeError, NotImplementedError):
        return False
    return (ptr != 0 and t.layout == torch.strided) or t.numel() == 0


_desugaring: dict[tuple, int] = {}


def desugars(types: tuple) -> int:
    """Whether a call's tensor types include a wrapper subclass that turns each of its ops into
    ops on plain tensors (``DTensor``, ``AsyncCollectiveTensor``: anything flattenable): a dispatch
    mode should let it run first (return ``NotImplemented``) and record the local ops and
    collectives it issues.  :data:`FAKE` for a ``FakeTensor`` call (DTensor's sharding propagation
    runs each new op on fake tensors once): no computation of the user's, to run unrecorded.
    Asked on every op: answered once per tuple of types (0: plain)."""
    hit = _desugaring.get(types)
    if hit is None:
        hit = _desugaring[types] = (FAKE if any(issubclass(cls, FakeTensor) for cls in types)
                                    else int(any(hasattr(cls, "__tensor_flatten__") for cls in types)))
    return hit


FAKE = 2


def resolve(t: torch.Tensor) -> tuple[torch.Tensor | None, dict]:
    """(the plain tensor whose values stand for ``t``, or None; fields for ``t``'s record)."""
    if readable(t):
        return t, {}
    if _functorch.is_functorch_wrapped_tensor(t):
        return _unwrap(t)
    dtensor = _dtensor_fields(t)
    if dtensor is not None:
        local, fields = resolve(local_tensor(t))
        return local, {**fields, "dtensor": dtensor}
    return _without_values(t)


def _unwrap(t: torch.Tensor) -> tuple[torch.Tensor | None, dict]:
    level = _functorch.maybe_get_level(t)
    if _functorch.is_batchedtensor(t):
        return None, {"functorch": {"levels": [level], "batched": True},
                      "no_values": "vmap batched tensor: the ops below the transform record its per-sample values"}
    inner, fields = resolve(_functorch.get_unwrapped(t))
    below = fields.get("functorch", {})
    return inner, {**fields, "functorch": {**below, "levels": [level, *below.get("levels", [])]}}


def _dtensor_fields(t) -> dict | None:
    spec = dtensor_spec(t)
    if spec is None or local_tensor(t) is None:
        return None
    mesh = spec.mesh
    return {"placements": [str(p) for p in spec.placements], "mesh": mesh.mesh.tolist(),
            "mesh_dim_names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
            "local_shape": list(local_tensor(t).shape)}


def _without_values(t: torch.Tensor) -> tuple[torch.Tensor | None, dict]:
    """Metadata only, and why (``no_values`` in the record)."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter or _is_plain_class(type(t)):
        if is_zerotensor(t):
            return None, {"zero": True, "no_values": "forward-AD zero tensor: no memory, every element is 0"}
        if t.is_meta:
            return None, {"no_values": "meta tensor"}
        if t.layout != torch.strided:
            return None, {"no_values": f"{str(t.layout).removeprefix('torch.')} layout"}
        return None, {"no_values": "storage not allocated (e.g. an FSDP parameter between all-gathers)"}
    name = type(t).__name__
    if name == "AsyncCollectiveTensor":
        return None, {"no_values": "result of a collective not yet waited for"}
    return None, {"no_values": f"tensor subclass {name} (its values are read where it runs plain ops)"}


def values(t: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor whose values may be read for ``t``, or None (metadata only)."""
    return t if readable(t) else resolve(t)[0]


def fields(t: torch.Tensor) -> dict:
    """The record fields :func:`resolve` adds for ``t`` (none for a plain tensor)."""
    return {} if readable(t) else resolve(t)[1]


_unseen_writes = STATE.unseen_writes     # storage address -> writes its version counters never saw (read by fused_stats too)


def unseen_write(t: torch.Tensor) -> None:
    """Counts a write to ``t``'s memory that moved no version counter (a collective filling a
    buffer, a custom op writing an argument its schema does not mark): :func:`version` changes,
    so nothing measured or saved of that memory before is taken for its values after."""
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return
    _unseen_writes[ptr] = _unseen_writes.get(ptr, 0) + 1


def version(t: torch.Tensor):
    """The version of ``t``'s values, for caches keyed by it: the in-place counter, and the
    writes it did not see (:func:`unseen_write`)."""
    if not _unseen_writes:
        return tensor_version(t)
    try:
        return tensor_version(t), _unseen_writes.get(t.untyped_storage().data_ptr(), 0)
    except (RuntimeError, NotImplementedError):
        return tensor_version(t)
