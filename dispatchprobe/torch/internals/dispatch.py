"""The dispatcher's private entries the probe runs on: the dispatch mode, pytrees, dispatch keys
and op schemas.  Checked on torch 2.5.1 to 2.14.1 (the same names throughout)."""

from __future__ import annotations

import contextlib

import torch
from torch._ops import HigherOrderOperator, OpOverload
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

__all__ = ["HigherOrderOperator", "OpOverload", "TorchDispatchMode", "tree_flatten", "tree_leaves", "tree_map", "tree_unflatten",
           "autograd_on", "no_functorch", "op_schema", "schema_info", "set_grad_enabled"]

#: Turns autograd on or off without ``torch.no_grad``'s decorator machinery (per op, a third of its cost).
set_grad_enabled = torch._C._set_grad_enabled

#: A context in which functorch's wrappers are not applied (values unwrapped by the probe stay unwrapped).
no_functorch = torch._C._DisableFuncTorch


def op_schema(func):
    """An op overload's ``FunctionSchema`` (arguments, returns, alias marks)."""
    return func._schema


def schema_info(schema):
    """torch's ``SchemaInfo`` of a schema: which arguments an op may write, including the writes
    its marks miss (batch norm's running statistics)."""
    return torch._C._SchemaInfo(schema)


def _python_and_autocast_keys():
    """The Python key and every autocast key this torch knows (``AutocastCPU``, ``AutocastCUDA``, ...)."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.Python)
    for name in torch._C.DispatchKey.__members__:
        if name.startswith("Autocast"):
            keys = keys.add(getattr(torch._C.DispatchKey, name))
    return keys


#: Excluded inside :func:`autograd_on`: the Python key (no re-entry into the dispatch mode) and the
#: autocast keys.  Outside any autocast region torch keeps the autocast keys excluded; with them
#: active an ``mm`` on float32 runs in bfloat16 on CPU (autocast's CPU default) whatever
#: ``torch.is_autocast_enabled()`` says.
_EXCLUDED_WITH_AUTOGRAD = _python_and_autocast_keys()


@contextlib.contextmanager
def autograd_on():
    """Autograd back on inside ``__torch_dispatch__`` (which runs with the autograd keys
    excluded), so a handler can differentiate a re-run.  The Python key stays excluded, and the
    autocast keys too: a re-run computes in the dtypes it is given, never recast (inside an autocast
    region a free-benchmark gradient check of a float32 ``mm`` would run in bfloat16)."""
    keys = torch._C._dispatch_tls_local_include_set()
    with torch._C._ForceDispatchKeyGuard(keys, _EXCLUDED_WITH_AUTOGRAD), torch.enable_grad():
        yield
