"""Dynamo's private controls the probe uses: its C-level frame evaluation (keeping dynamo out of
the dispatch mode's frames), the module wrapper it makes, the frame it is tracing, the tracing
context and functorch's config.  The frame controls are checked on torch 2.13 and 2.14.1; where
a torch lacks them in this shape (2.5.1) :data:`FRAMES` is None and torch's own wrapper keeps
dynamo out instead."""

from __future__ import annotations

import os
import sys

import torch

__all__ = ["AOT_RUNTIME_MODULE", "AOT_RUNTIME_FILE", "FRAMES", "frame_controls", "frame_callback", "call_outside_dynamo", "never_compiled", "is_optimized_module", "wrapped_module",
           "traced_frame_locals", "clear_output_strides", "functorch_config"]


def frame_controls():
    """torch's C-level controls of dynamo's frame evaluation, or None where this torch lacks them
    in the shape the probe uses."""
    try:
        from torch._C._dynamo import eval_frame as frames
        frames._FrameExecStrategy(frames._FrameAction.SKIP, frames._FrameAction.DEFAULT)
        frames.get_eval_frame_callback, frames.set_eval_frame, frames.set_code_exec_strategy  # noqa: B018
    except (ImportError, AttributeError, TypeError):
        return None
    return frames


#: The module and the file of AOTAutograd's runtime wrappers, inside which every compiled region runs
#: (looked up, never imported: importing it imports dynamo).  Checked on torch 2.5.1 to 2.14.1.
AOT_RUNTIME_MODULE = "torch._functorch._aot_autograd.runtime_wrappers"
AOT_RUNTIME_FILE = os.path.join(torch.__path__[0], "_functorch", "_aot_autograd", "runtime_wrappers.py")

#: torch's C-level controls of dynamo's frame evaluation, or None (see the module's docstring).
FRAMES = frame_controls()

#: dynamo's frame callback now (None: not inside compiled code), or None where :data:`FRAMES` is.
frame_callback = FRAMES.get_eval_frame_callback if FRAMES is not None else None


def call_outside_dynamo(fn, *args):
    """Run ``fn`` with dynamo's frame callback off, as torch's recursive disable does."""
    prior = FRAMES.set_eval_frame(None)
    try:
        return fn(*args)
    finally:
        FRAMES.set_eval_frame(prior)


def never_compiled(code) -> None:
    """Dynamo runs frames of ``code`` as they are (the frames they call are its usual business)."""
    FRAMES.set_code_exec_strategy(code, FRAMES._FrameExecStrategy(FRAMES._FrameAction.SKIP,
                                                                  FRAMES._FrameAction.DEFAULT))


if FRAMES is not None:        # the frame that hands an op on with dynamo off
    never_compiled(call_outside_dynamo.__code__)


def is_optimized_module(m) -> bool:
    """Whether ``m`` is the wrapper ``torch.compile(module)`` returns (dynamo imported only if it is)."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    return dynamo is not None and isinstance(m, dynamo.OptimizedModule)


def wrapped_module(m):
    """The module ``torch.compile(module)``'s wrapper ``m`` calls (:func:`is_optimized_module`)."""
    return m._orig_mod


def traced_frame_locals() -> dict:
    """The locals of the frame dynamo is tracing now, {} when it traces none."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        return InstructionTranslator.current_tx().f_locals
    except Exception:        # not called by dynamo (a direct backend call)
        return {}


def clear_output_strides() -> None:
    """Forget the output strides a cache hit gave the tracing context: the compile that follows
    sets them anew (and refuses to find some there)."""
    context = torch._guards.TracingContext.try_get()
    if context is not None and context.output_strides:
        context.output_strides.clear()


def functorch_config():
    """functorch's config module (``enable_autograd_cache``, ``patch``)."""
    from torch._functorch import config
    return config
