"""Collective ops (``c10d.*`` from eager ``torch.distributed``, ``_c10d_functional.*`` from DTensor
and compiled code) as the eager capture records them.

- A collective's outputs are valid only once its work is waited for (``async_op``, functional
  collectives' lazy ``wait_tensor``): the capture waits before reading them (:func:`settle`), which
  changes when the wait happens, not any value.  The tensors an in-place collective overwrites
  (``allreduce_``'s list) are copied first, so its record holds the inputs it was given.
- Its process group is recorded with the group's name and ranks, its reduce op by name
  (:func:`encode_script_object`; a functional collective's ``group_name`` string is given the
  same form by :func:`named_groups`).
- A collective is never run again by a check (a re-run on one rank would desynchronise the group).
"""

from __future__ import annotations

import torch

NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional"})
# in-place c10d collectives whose schemas do not mark the tensors they overwrite
_OVERWRITES = {"allreduce_": "tensors", "allreduce_coalesced_": "tensors", "broadcast_": "tensors",
               "reduce_": "tensors"}
_group_arg: dict[int, tuple] = {}     # id(overload) -> (overload, index of its group_name argument or None)


def is_collective(func) -> bool:
    return getattr(func, "namespace", None) in NAMESPACES


def _dist():
    return torch.distributed if torch.distributed.is_available() else None


class GroupName:
    """A functional collective's ``group_name`` argument, recorded as its process group."""

    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name


def _group_index(func):
    hit = _group_arg.get(id(func))
    if hit is None:
        index = next((i for i, a in enumerate(func._schema.arguments) if a.name == "group_name"), None)
        hit = _group_arg[id(func)] = (func, index)
    return hit[1]


def named_groups(func, args: tuple, kwargs: dict):
    """``args``/``kwargs`` for the record, a ``group_name`` string given as :class:`GroupName`."""
    index = _group_index(func)
    if index is None:
        return args, kwargs
    if index < len(args) and isinstance(args[index], str):
        args = (*args[:index], GroupName(args[index]), *args[index + 1:])
    elif isinstance(kwargs.get("group_name"), str):
        kwargs = {**kwargs, "group_name": GroupName(kwargs["group_name"])}
    return args, kwargs


def copy_overwritten(func, args: tuple, kwargs: dict):
    """Copies of the tensors an in-place collective is about to overwrite (for its record)."""
    name = _OVERWRITES.get(func._schema.name.partition("::")[2]) if func.namespace == "c10d" else None
    if name is None:
        return args, kwargs
    with torch.no_grad():
        if args and isinstance(args[0], (list, tuple)):
            return ([t.clone() if isinstance(t, torch.Tensor) else t for t in args[0]], *args[1:]), kwargs
        if isinstance(kwargs.get(name), (list, tuple)):
            return args, {**kwargs, name: [t.clone() for t in kwargs[name]]}
    return args, kwargs


def settle(func, out) -> None:
    """Wait for the collective's work, so that its outputs hold their values when read."""
    if func.namespace == "c10d":
        dist = _dist()
        for item in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(item, torch.ScriptObject) and _type_name(item).endswith(".Work"):
                dist.distributed_c10d.Work.unbox(item).wait()
    elif func.namespace == "_c10d_functional" and func._schema.name != "_c10d_functional::wait_tensor":
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                torch.ops._c10d_functional.wait_tensor(t)


def _type_name(obj) -> str:
    try:
        return obj._type().qualified_name()
    except (RuntimeError, AttributeError):
        return ""


def _group(pg) -> dict:
    dist = _dist()
    out = {"type": "process_group", "name": pg.group_name}
    try:
        out["ranks"] = dist.get_process_group_ranks(pg)
    except (RuntimeError, ValueError, KeyError):
        out["size"] = pg.size()
    return out


def encode_group_name(value: GroupName) -> dict:
    dist = _dist()
    try:
        return _group(dist.distributed_c10d._resolve_process_group(value.name))
    except (RuntimeError, ValueError, KeyError, AttributeError):
        return {"type": "process_group", "name": value.name}


def encode_script_object(value) -> dict:
    """A ``torch.ScriptObject`` argument: a process group (name, ranks), a reduce op (name), or
    its class name."""
    name = _type_name(value)
    dist = _dist()
    if dist is not None and name.endswith("c10d.ProcessGroup"):
        return _group(dist.ProcessGroup.unbox(value))
    if dist is not None and name.endswith("c10d.ReduceOp"):
        op = value.op()
        names = {int(v): k for k, v in dist.ReduceOp.RedOpType.__members__.items()}
        return {"type": "reduce_op", "value": names.get(int(op), str(op))}
    return {"type": "other", "repr": name or repr(value)[:200]}
