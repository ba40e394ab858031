"""Whether an op or a module call comes from a compiled graph, read from the Python stack.

The eager probe records what the user's eager code runs; the calls compiled graphs make are
``probe_backend``'s business.  Used per op by the dispatch mode and per module call by the
module hooks, so the walk is short (see :func:`in_compiled_code`).
"""

from __future__ import annotations

import os
import sys

import torch

from .internals import autograd as torch_autograd
from .internals.dynamo import AOT_RUNTIME_FILE as _AOT_RUNTIME
from .internals.dynamo import AOT_RUNTIME_MODULE as _AOT_MODULE


def in_compiled_code(fx: bool = False) -> bool:
    """Whether the op is called by a compiled graph (inductor's ``.out`` calls, an ``aot_eager``
    graph's ops, a probe backend's recording op): every AOTAutograd-compiled region, forward
    and backward, runs inside a function of ``runtime_wrappers.py`` (not even imported until
    something is compiled: eager-only training pays one dictionary lookup per op).

    The walk up the stack stops at the first module call with no FX code below it: a compiled
    graph never calls a module of the user's (dynamo inlines modules; a graph break runs in the
    user's frames, outside the graph), so the graph's frames, when there are any, lie below it,
    and a deep model's stack is not walked to its root per op.  An ``aot_eager`` graph is itself a module (an FX
    ``GraphModule``): from FX code the walk goes on to the root.  A backward op stops the walk at
    the autograd engine's entry: a compiled backward runs below it.  ``fx``: the caller is a module
    hook of an FX graph."""
    if _AOT_MODULE not in sys.modules:
        return False
    f = sys._getframe(2)
    while f is not None:
        code = f.f_code
        name = code.co_filename
        if name == _AOT_RUNTIME:
            return True
        if code is _CALL_IMPL or code is _WRAPPED_CALL_IMPL:     # (hashing a code object costs more)
            if not fx:
                return False
        elif code is _ENGINE_RUN:
            return False
        elif name.startswith(_FX_CODE):
            fx = True
        f = f.f_back
    return False


_CALL_IMPL, _WRAPPED_CALL_IMPL = torch_autograd.MODULE_CALL_CODES
_ENGINE_RUN = torch_autograd.ENGINE_RUN_CODE
_FX_CODE = ("<eval_with_key>", os.path.join(torch.__path__[0], "fx", ""))
