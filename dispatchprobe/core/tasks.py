"""The tasks a probe can run, one registration each: which handlers see the ops, and what the
config and the capture adapters must know about the task.  Add one with :func:`register_task`;
see docs/architecture.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Task:
    name: str
    handlers: Callable            # (session, recorder) -> list of Handler
    saves_tensors: bool = False   # the recorder saves every recorded tensor
    records_modules: bool = False # module boundaries are recorded at level "module"/"mix"
    checks_ops: bool = False      # works on ops: level must be "op" or "mix"
    aliases: tuple = ()           # other spellings accepted by the config (msprobe's)
    intercepts_ops: bool = True   # False: the task reads what the adapter gives it (the grad probe reads
                                  # gradients at optimizer steps); start()/stop() intercept nothing


TASKS: dict[str, Task] = {}


def register_task(name: str, **flags):
    """Decorator: ``@register_task("overflow", checks_ops=True)`` over ``handlers(session, recorder)``.
    A second task of the same name is refused."""
    if name in TASKS:
        raise ValueError(f"register_task: a task named {name!r} is already registered")

    def deco(fn):
        TASKS[name] = Task(name, fn, **flags)
        return fn
    return deco


def canonical(name: str) -> str:
    """The registered name for ``name`` or one of its aliases (unchanged if unknown)."""
    return next((t.name for t in TASKS.values() if name in t.aliases), name)


@register_task("tensor", saves_tensors=True, records_modules=True)
@register_task("statistics", records_modules=True)   # innermost runs first: statistics stays first
def _recorder_only(session, recorder):
    return [recorder]


@register_task("overflow", checks_ops=True, aliases=("overflow_check",))
def _overflow(session, recorder):
    from .overflow import OverflowHandler
    return [OverflowHandler(session, recorder)]


@register_task("free_benchmark", checks_ops=True)
def _free_benchmark(session, recorder):
    from .free_benchmark import FreeBenchmarkHandler
    return [FreeBenchmarkHandler(session, recorder)]


@register_task("grad_probe", intercepts_ops=False)
def _grad_probe(session, recorder):
    from .grad_probe import GradHandler
    return [GradHandler(session, recorder)]
