"""A model's parameters and the gradients an optimizer is about to apply, readable on any setup.

The gradient a parameter's optimizer applies is read after every reduction the framework does
(DDP's all-reduce, FSDP2's reduce-scatter): ``param.main_grad`` where a framework keeps one
(Megatron-style mixed precision), else ``param.grad``.  A ``DTensor`` gradient (FSDP2, tensor
parallel) is never read directly (docs/architecture.md: the probe never reads a subclass's data):
its local shard is, with the placement that says which part of the whole gradient it holds.

Used by the grad probe (:mod:`dispatchprobe.torch.grad_probe`) and by anything that must pair
gradients across runs with different parallelism: a shard is placed in the whole gradient by
``offset`` and ``local_shape``.
"""

from __future__ import annotations

import copy
import functools
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch

from .internals.distributed import local_shape_and_offset

# wrapper modules that insert an attribute into every parameter name; stripped so that names agree
# across a plain, DDP, compiled and activation-checkpointed model
WRAPPER_PARTS = ("module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


@dataclass
class Placement:
    """Where a DTensor gradient's local shard lies in the whole gradient."""

    placements: list[str]           # e.g. ["Shard(dim=0)"], ["Replicate()"]
    mesh: list                      # the mesh's global ranks, nested per mesh dimension
    mesh_dim_names: list | None
    local_shape: list[int]
    offset: list[int]               # the shard's first element in the whole gradient, per dimension

    def to_dict(self) -> dict:
        """A copy (one Placement serves every step's records)."""
        return copy.deepcopy({"placements": self.placements, "mesh": self.mesh, "mesh_dim_names": self.mesh_dim_names,
                              "local_shape": self.local_shape, "offset": self.offset})


@dataclass
class ParamGrad:
    """One parameter's gradient as the optimizer receives it.

    ``local`` is a plain tensor (the whole gradient, or a DTensor's local shard, detached);
    ``dtensor`` is the DTensor gradient itself (for its mesh and collectives) or None;
    ``shape`` the whole gradient's shape; ``placement`` where ``local`` lies (DTensor only)."""

    name: str
    param: torch.nn.Parameter
    local: torch.Tensor
    shape: list[int]
    source: str                      # "grad" or "main_grad"
    dtensor: torch.Tensor | None = None
    placement: Placement | None = None


def clean_name(name: str) -> str:
    """A parameter name without the wrapper attributes of :data:`WRAPPER_PARTS`
    (``module.layers.0.weight`` under DDP -> ``layers.0.weight``)."""
    parts = [p for p in name.split(".") if p not in WRAPPER_PARTS]
    return ".".join(parts) if parts else name


def parameter_names(model: torch.nn.Module) -> dict[int, str]:
    """``id(param)`` -> its cleaned name in ``model`` (the first name of a shared parameter)."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=True):
        names.setdefault(id(p), clean_name(name))
    return names


def optimizer_parameters(optimizer: torch.optim.Optimizer) -> Iterator[torch.nn.Parameter]:
    """The parameters an optimizer updates, in its param groups' order (each once)."""
    seen: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                yield p


def kept_per_optimizer(kept: weakref.WeakKeyDictionary, optimizer, roots: list, make):
    """``make(optimizer, roots)``, kept in ``kept`` per optimizer while the roots (the same module
    objects) and the sizes of its parameter groups stay the same: asked at every step."""
    groups = tuple(len(g["params"]) for g in optimizer.param_groups)
    hit = kept.get(optimizer)
    if hit is not None and hit[1] == groups and len(hit[0]) == len(roots) \
            and all(ref() is root for ref, root in zip(hit[0], roots)):
        return hit[2]
    value = make(optimizer, roots)
    kept[optimizer] = ([weakref.ref(r) for r in roots], groups, value)
    return value


def updates_any(optimizer, roots: list) -> bool:
    """Whether ``optimizer`` updates a parameter of one of ``roots``, or tensors no module holds
    (``torch.func.functional_call``'s own copies of the parameters, which no model names)."""
    params = {id(p) for root in roots for p in root.parameters()}
    return any(id(p) in params or not isinstance(p, torch.nn.Parameter) for p in optimizer_parameters(optimizer))


def gradient_of(param: torch.Tensor) -> tuple[torch.Tensor | None, str]:
    """(the gradient an optimizer would apply to ``param``, "main_grad" or "grad"); None if it has none."""
    main = getattr(param, "__dict__", {}).get("main_grad")    # a missed attribute of a tensor is slow
    if isinstance(main, torch.Tensor):
        return main, "main_grad"
    return param.grad, "grad"


def _is_dtensor(t: torch.Tensor) -> bool:
    kind = type(t)
    return kind is not torch.Tensor and kind.__name__ == "DTensor" and hasattr(t, "to_local")


def placement_of(grad: torch.Tensor) -> Placement:
    """Where a DTensor's local shard lies in the whole tensor (this rank's view)."""
    return _placement(tuple(grad.shape), grad.device_mesh, tuple(grad.placements))


@functools.lru_cache(maxsize=4096)
def _placement(shape: tuple, mesh, placements: tuple) -> Placement:
    """:func:`placement_of`, once per shape, mesh and placements: torch works it out in Python
    through the mesh's layout, slowly, and the records ask at every optimizer step, of every
    parameter."""
    local_shape, offset = local_shape_and_offset(shape, mesh, placements)
    return Placement(placements=[repr(p) for p in placements], mesh=mesh.mesh.tolist(),
                     mesh_dim_names=list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
                     local_shape=list(local_shape), offset=list(offset) if offset else [0] * len(shape))


def read_gradient(name: str, param: torch.Tensor) -> ParamGrad | None:
    """One parameter's gradient as :class:`ParamGrad`, or None when it has none this step."""
    grad, source = gradient_of(param)
    if grad is None:
        return None
    if grad.requires_grad:        # (a detach per gradient is a dispatch per gradient, in a probe's mode)
        grad = grad.detach()
    if _is_dtensor(grad):
        return ParamGrad(name, param, grad.to_local().detach(), list(grad.shape), source, dtensor=grad,
                         placement=placement_of(grad))
    return ParamGrad(name, param, grad, list(grad.shape), source)


def named_gradients(model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                    names: dict[int, str] | None = None) -> list[ParamGrad]:
    """The gradients about to be applied, named as in ``model``: those of ``optimizer``'s parameters
    (in its order) when given, else of all of ``model``'s.  ``names``: a :func:`parameter_names`
    table computed once (parameters absent from it are named ``param_groups.{g}.{i}``)."""
    if names is None:
        names = parameter_names(model) if model is not None else {}
    if optimizer is not None:
        params = []
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                params.append((names.get(id(p), f"param_groups.{g}.{i}"), p))
        params = list({id(p): (n, p) for n, p in params}.values())
    elif model is not None:
        params = [(names.get(id(p), clean_name(n)), p) for n, p in model.named_parameters()]
    else:
        raise ValueError("named_gradients needs a model or an optimizer")
    out = []
    for name, p in params:
        pg = read_gradient(name, p)
        if pg is not None:
            out.append(pg)
    return out
