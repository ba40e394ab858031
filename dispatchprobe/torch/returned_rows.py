"""The statistics rows of values compiled graphs returned, for readers that come after the graph.

A compiled graph's windows read the values it returns; a backward graph that takes a forward's
saved activations, and the parameter records that take a backward's gradients (autograd keeps
the graph's output as ``.grad``), look their rows up here instead of reading them again.  A
returned value is final (no later kernel of its graph writes it); autograd refuses to
differentiate through a saved activation written since, and an eager write moves its version,
part of the key; an entry is trusted only while its memory lives.
"""

from __future__ import annotations

import torch

from . import tensor_backend as torch_backend
from .process_state import STATE

_RETURNED = STATE.returned_rows     # key (_returned_key) -> (weak reference to the memory, row)
_PRUNE_AT = 4096


def returned_row(x: torch.Tensor):
    """The row a compiled graph's window read of ``x``, a value the graph returned, while ``x``
    still shows those values (same memory, view and version); else None."""
    key = _returned_key(x)
    hit = _RETURNED.get(key) if key is not None else None
    return hit[1] if hit is not None and torch_backend.memory_alive(hit[0]) else None


def remember_returned(x: torch.Tensor, row) -> None:
    global _PRUNE_AT
    key, ref = _returned_key(x), torch_backend.memory_ref(x)
    if key is None or ref is None:
        return
    _RETURNED[key] = (ref, row)
    if len(_RETURNED) >= _PRUNE_AT:          # entries of freed memory go, a few times a run
        for k in [k for k, (r, _) in _RETURNED.items() if not torch_backend.memory_alive(r)]:
            del _RETURNED[k]
        _PRUNE_AT = max(4096, 2 * len(_RETURNED))


def _returned_key(x: torch.Tensor):
    """The key of a returned value's row: shared by its views that show all of it (a forward may
    read a value its backward is given as a view, or the other way round)."""
    return torch_backend.dense_key(x) or torch_backend.identity(x)
