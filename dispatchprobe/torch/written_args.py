"""The arguments an op writes, recorded as the op received them: stand-ins for tensors an
in-place op is about to overwrite, and ``out=`` destinations recorded as undefined."""

from __future__ import annotations

import torch

from . import tensor_backend as torch_backend


def replace_args(positions, args, kwargs, replace):
    """``args``/``kwargs`` with each tensor at ``positions`` ((index, name) pairs), and each
    tensor of a list there, replaced by ``replace(tensor)``."""
    args, kwargs = list(args), dict(kwargs)

    def swap(t):
        if isinstance(t, (list, tuple)):
            return type(t)(swap(x) for x in t)
        return replace(t) if isinstance(t, torch.Tensor) else t

    for i, name in positions:
        if i < len(args):
            args[i] = swap(args[i])
        elif name in kwargs:
            kwargs[name] = swap(kwargs[name])
    return tuple(args), kwargs


def destinations(outs, args, kwargs, undefined: set | None):
    """``out=`` arguments recorded as undefined (shape and dtype only, never judged, replayed as
    zeros): aliases stand in for them, so the op's output, the same tensor, keeps its values, which
    are defined once the op wrote them, uninitialised memory (``torch.empty``) as it was or not."""
    undefined = set() if undefined is None else undefined

    def alias(t):
        new = t.detach()
        undefined.add(id(new))
        undefined.discard(id(t))
        return new

    return (*replace_args(outs, args, kwargs, alias), undefined)


def copy_written(probe, written, args, kwargs, undefined: set | None):
    """Stand-ins for the tensors an op is about to overwrite (a tensor, or each tensor of a list:
    the optimizers' ``_foreach_*_``), in place of the originals: the record holds what the op
    received (:meth:`~dispatchprobe.core.session.ProbeSession.stand_in_for_written`: a copy, or
    the tensor's entry measured now).  A copy of an undefined tensor is undefined too."""
    def copy(old):
        new = torch_backend.clone(old)
        if undefined and id(old) in undefined:
            undefined.add(id(new))
        return new

    def stand_in(old):
        return probe.stand_in_for_written(old, bool(undefined) and id(old) in undefined, copy)

    return replace_args(written, args, kwargs, stand_in)
