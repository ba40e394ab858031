"""An op's nested values (tuples, lists, dicts of tensors and scalars), walked once for any
framework: the adapter says what a tensor is."""

from __future__ import annotations

from typing import Callable


def walk(obj, is_tensor: Callable, fn: Callable):
    """``obj`` with ``fn(t)`` in place of each tensor ``t`` (containers rebuilt, the rest kept)."""
    if is_tensor(obj):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(walk(v, is_tensor, fn) for v in obj)
    if isinstance(obj, dict):
        return {k: walk(v, is_tensor, fn) for k, v in obj.items()}
    return obj


def collect(obj, wanted: Callable) -> list:
    """The tensors in ``obj`` for which ``wanted(t)`` holds, in order."""
    found: list = []
    walk(obj, wanted, found.append)
    return found


def indexed_outputs(outputs, wanted: Callable) -> list:
    """``(output index, tensor)`` of an op's top-level outputs for which ``wanted(t)`` holds."""
    flat = outputs if isinstance(outputs, (tuple, list)) else [outputs]
    return [(i, t) for i, t in enumerate(flat) if wanted(t)]


def user_stack(framework_dir: str, skip: int = 2) -> tuple:
    """The Python frames of user code at this moment, innermost last: the framework's frames
    (under ``framework_dir``) and dispatchprobe's own left out."""
    import os
    import traceback
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))      # .../dispatchprobe
    own = (framework_dir, package + os.sep, package + "_ms" + os.sep, "<frozen ", "contextlib.py")
    return tuple(f"{f.filename}:{f.lineno} in {f.name}" for f in traceback.extract_stack()[:-skip]
                 if not f.filename.startswith(own))


def pair_outputs(original, result, is_tensor: Callable, one: Callable):
    """``one(original output, re-run output)`` over an op's outputs, a tensor or a tuple/list of
    them (``fix`` replacing outputs); None when the two do not have the same form."""
    if is_tensor(original):
        return one(original, result)
    if isinstance(original, (tuple, list)) and isinstance(result, (tuple, list)):
        return type(original)(one(o, n) for o, n in zip(original, result))
    return None
