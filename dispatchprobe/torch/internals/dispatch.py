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


@contextlib.contextmanager
def autograd_on():
    """Autograd back on inside ``__torch_dispatch__`` (which runs with the autograd keys
    excluded), so a handler can differentiate a re-run.  Only the Python key stays excluded."""
    keys = torch._C._dispatch_tls_local_include_set()
    with torch._C._ForceDispatchKeyGuard(keys, torch._C.DispatchKeySet(torch._C.DispatchKey.Python)), \
            torch.enable_grad():
        yield
