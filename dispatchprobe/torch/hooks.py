"""Removing the global hooks of a probe collected unclosed, where torch is not looping over them.

A probe left unclosed (a notebook cell, an exception) is collected whenever the garbage collector
runs, and that may be inside one of torch's loops over its hook dictionaries (an optimizer step's
global hooks; a module call copies its hooks before looping in recent versions of torch): removing
a hook there stops the user's training with "OrderedDict mutated during iteration".  The collection
may also run in another thread (a writer thread's allocation), while the training thread is in
such a loop.  So a finalizer removes the hooks at once only when no thread has such a loop on its
stack; otherwise it queues them, and the queue is emptied when a probe is made, enters ``with``,
or closes."""

from __future__ import annotations

import os
import sys
import weakref

import torch

from .process_state import STATE

_pending = STATE.pending_removals          # removals queued by finalizers, run by remove_collected()
# the files whose functions loop over hook dictionaries (optimizer step hooks, module hooks)
_LOOPING = tuple(os.path.join(torch.__path__[0], *parts) for parts in
                 (("optim", "optimizer.py"), ("nn", "modules", "module.py")))


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
