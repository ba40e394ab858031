"""Removing the global hooks of a probe collected unclosed, where torch is not looping over them.

A probe left unclosed (a notebook cell, an exception) is collected whenever the garbage collector
runs, and that may be inside one of torch's loops over its hook dictionaries (an optimizer step's
global hooks; a module call copies its hooks before looping in recent versions of torch): removing
a hook there stops the user's training with "OrderedDict mutated during iteration".  The collection
may also run in another thread (a writer thread's allocation), while the training thread is in
such a loop.  So a finalizer removes the hooks at once only when no thread has such a loop on its
stack; otherwise it queues them, and the queue is emptied when a probe is made, enters ``with``,
or closes.

torch's global optimizer step hooks, which every probe kind registers, go through
:func:`optimizer_hook`: each runs as the probe's own work (``ProbeWork``: no other probe records
its operations), and each is counted in ``STATE.optimizer_hooks`` while registered, so that
``STATE.held()`` shows one left behind."""

from __future__ import annotations

import os
import sys
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .process_state import STATE, ProbeWork

_pending = STATE.pending_removals          # removals queued by finalizers, run by remove_collected()
# the files whose functions loop over hook dictionaries (optimizer step hooks, module hooks)
_LOOPING = tuple(os.path.join(torch.__path__[0], *parts) for parts in
                 (("optim", "optimizer.py"), ("nn", "modules", "module.py")))


def optimizer_hook(owner, hook, post: bool = False):
    """Register ``hook(optimizer, args, kwargs)`` as torch's global optimizer step pre-hook (or
    post-hook) for ``owner``, a probe or its reader, which ``hook`` must hold only weakly.  Returns
    its ``remove``, which is also run once ``owner`` is collected (a probe never closed)."""
    def run(optimizer, args, kwargs) -> None:
        with ProbeWork():
            hook(optimizer, args, kwargs)
    handle = (register_optimizer_step_post_hook if post else register_optimizer_step_pre_hook)(run)
    held = STATE.optimizer_hooks
    held[handle.id] = type(owner).__name__

    def remove() -> None:
        handle.remove()
        held.pop(handle.id, None)
    remove_when_collected(owner, remove)
    return remove


def remove_when_collected(owner, *removers) -> weakref.finalize:
    """Run each of ``removers`` (a hook handle's ``remove``) once ``owner`` is collected or the
    returned finalizer is called: at once where it is safe, else at :func:`remove_collected`."""
    return weakref.finalize(owner, _remove_or_queue, removers)


def remove_collected() -> None:
    """Run the removals queued so far (call where torch iterates no hook dictionary)."""
    while _pending:
        _pending.pop(0)()


def _remove_or_queue(removers) -> None:
    _pending.extend(removers)
    if not _a_thread_in_a_hook_loop():
        remove_collected()


def _a_thread_in_a_hook_loop() -> bool:
    for frame in sys._current_frames().values():      # this thread's, and every other's
        while frame is not None:
            if frame.f_code.co_filename in _LOOPING:
                return True
            frame = frame.f_back
    return False
