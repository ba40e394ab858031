"""The autograd engine's and ``nn.Module``'s private state the probe reads or sets: whether
backward is running and which node, callbacks at the end of backward, the global module hook
dictionaries, the code objects of a module call.  Checked on torch 2.5.1 to 2.14.1 (the engine's
``_engine_run_backward`` is None where a torch lacks it)."""

from __future__ import annotations

import torch
from torch.nn.modules import module as _module

__all__ = ["current_graph_task_id", "current_autograd_node", "node_sequence_nr", "next_sequence_nr",
           "checkpoint_recomputing", "queue_backward_callback", "ENGINE_RUN_CODE",
           "MODULE_CALL_CODES", "forward_hooks", "put_back_global_hooks", "take_out_global_hooks"]

#: The id of the backward pass running on this thread, -1 outside backward.
current_graph_task_id = torch._C._current_graph_task_id

#: The autograd node being run now (None between nodes, in a callback queued for the end of backward).
current_autograd_node = torch._C._current_autograd_node

#: The code objects of ``Module.__call__`` (a frame running one is a module call).
MODULE_CALL_CODES = (_module.Module._call_impl.__code__, _module.Module._wrapped_call_impl.__code__)

#: The code of the engine's entry from Python (backward ops run below it), or None.
ENGINE_RUN_CODE = getattr(getattr(torch.autograd.graph, "_engine_run_backward", None), "__code__", None)


def node_sequence_nr(node) -> int:
    """An autograd node's sequence number (the order nodes were made in, per thread)."""
    return node._sequence_nr()


def next_sequence_nr() -> int:
    """The sequence number the next autograd node made on this thread will get (nodes made
    before now have smaller ones; ``AccumulateGrad`` nodes have the largest 64-bit number)."""
    return torch._C._autograd._get_sequence_nr()


_top_saved_tensors_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def checkpoint_recomputing(node) -> bool:
    """Whether ``torch.utils.checkpoint`` is re-running a forward now, inside backward: the
    reentrant variant runs it in its own node's backward (``CheckpointFunctionBackward``), the
    non-reentrant one while unpacking a saved tensor, under its ``_recomputation_hook`` saved-tensor
    hooks.  For a checkpointed function that enters no module (modules' re-runs are told by
    their scopes, see ``ModuleScopes.recomputed_scope``)."""
    if node is not None and node.name() == "CheckpointFunctionBackward":
        return True
    hooks = _top_saved_tensors_hooks(True) if _top_saved_tensors_hooks is not None else None
    return bool(hooks) and getattr(hooks[0], "__qualname__", "").startswith("_recomputation_hook.")


def queue_backward_callback(fn) -> None:
    """Run ``fn`` when the running backward pass ends (after the callbacks queued before it)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def forward_hooks(mod) -> dict:
    """A module's own forward hooks, {handle id: hook}, in the order they run."""
    return mod._forward_hooks


def put_back_global_hooks(ids: tuple, pre, post) -> None:
    """Registers ``pre`` and ``post`` (always called) again as the global forward hooks under the
    handle ids they had (``ids``): dynamo guards on these dictionaries, so the same ids keep a
    compiled model's guards passing."""
    _module._global_forward_pre_hooks[ids[0]] = pre
    _module._global_forward_hooks[ids[1]] = post
    _module._global_forward_hooks_always_called[ids[1]] = True


def take_out_global_hooks(ids: tuple) -> None:
    """Removes the global forward hooks of handle ids ``ids`` (their handles stay usable)."""
    _module._global_forward_pre_hooks.pop(ids[0], None)
    _module._global_forward_hooks.pop(ids[1], None)
    _module._global_forward_hooks_always_called.pop(ids[1], None)
