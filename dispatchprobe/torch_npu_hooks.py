"""``torch_npu.hooks``' precision-compare and overflow hooks (the tools before msprobe) over ``DispatchProbe``.

Their scripts run with ``from torch_npu.hooks import ...`` (and ``torch_npu.hooks.tools``) changed to
``from dispatchprobe.torch_npu_hooks import ...``.  ``register_hook(model, hook)`` records every op
from then on, forward and backward, as its hooks on every layer and API would; the hook names the
task: ``wrap_acc_cmp_hook`` statistics for ``compare``, ``wrap_checkoverflow_hook`` the overflow
check (which raises at the first overflow, naming the op), ``wrap_async_datadump_hook`` tensors.
A dump file (``set_dump_path``) is a run directory here; ``compare(a, b, out.csv)`` is
``dispatchprobe compare``.  Runs close when the next ``set_dump_path`` starts another, or at exit.
"""

from __future__ import annotations

import atexit
import os
import sys
import warnings

from .core.config import ConfigError, ConfigWarning
from .core.seeding import seed_all

__all__ = ["compare", "register_hook", "schedule", "seed_all", "set_dump_path", "step_schedule",
           "wrap_acc_cmp_hook", "wrap_async_datadump_hook", "wrap_checkoverflow_hook"]


class _Hook:
    """What a ``wrap_*_hook`` asks for: a task of DispatchProbe."""

    def __init__(self, name: str, task: str):
        self.name, self.task = name, task

    def __repr__(self) -> str:
        return self.name


wrap_acc_cmp_hook = _Hook("wrap_acc_cmp_hook", "statistics")
wrap_checkoverflow_hook = _Hook("wrap_checkoverflow_hook", "overflow")
wrap_async_datadump_hook = _Hook("wrap_async_datadump_hook", "tensor")


class _Runs:
    """The process's hooked models and the probes recording them, one per task (the dump path and
    the step selection are the process's, as in torch_npu.hooks)."""

    def __init__(self):
        self.dump_path: str | None = None
        self.steps: list[int] = []
        self.probes: dict = {}          # (task, dump path) -> DispatchProbe
        self.hooked: list = []          # (model, hook, path) in the order they were registered

    def start(self, model, hook: _Hook, path: str | None) -> None:
        """Record with ``hook``'s task from now on (every op, as hooks on every layer and API would)."""
        from .torch.capture import DispatchProbe
        dump_path = path or self.dump_path or "./dispatchprobe_dump"
        key = (hook.task, dump_path)
        if key not in self.probes:
            # a dump file is rewritten by each run, as torch_npu.hooks rewrote it
            self.probes[key] = DispatchProbe(task=hook.task, dump_path=dump_path, step=self.steps, model=model,
                                             overwrite=True)
        self.probes[key].start()

    def close(self) -> None:
        probes, self.probes = self.probes, {}
        for probe in probes.values():
            probe.close()


RUNS = _Runs()


def set_dump_path(fpath=None) -> None:
    """Where the next records go (a run directory at ``fpath``): the runs recorded so far end, and
    the hooked models are recorded into this one from now on."""
    if fpath is not None and not isinstance(fpath, (str, os.PathLike)):
        raise ConfigError(f"set_dump_path: fpath must be a path, got {type(fpath).__name__}")
    RUNS.close()
    RUNS.dump_path = os.fspath(fpath) if fpath is not None else None
    for model, hook, path in RUNS.hooked:
        RUNS.start(model, hook, path)


def register_hook(model, hook, **kwargs) -> None:
    """Record from now on, forward and backward, with ``hook``'s task (``model`` names the module
    scopes); a dump hook (compare, async) from the next ``set_dump_path`` on when none was set.  ``schedule=schedule(...)`` selects steps (counted by ``step_schedule.step()``);
    ``path=`` (``wrap_async_datadump_hook``) is the dump directory; ``sample`` has no counterpart:
    statistics are computed over every value."""
    import torch
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"register_hook: model must be a torch.nn.Module, not {type(model).__name__}")
    if not isinstance(hook, _Hook):
        raise ConfigError(f"register_hook: hook must be one of {', '.join(map(repr, _HOOKS))}, got {hook!r}")
    unknown = set(kwargs) - {"sample", "schedule", "path"}
    if unknown:
        raise ConfigError(f"register_hook: unknown argument(s) {sorted(unknown)}; allowed: sample, schedule, path")
    if kwargs.get("sample") is False:
        warnings.warn("register_hook: sample=False: statistics are computed over every value anyway",
                      ConfigWarning, stacklevel=2)
    if "schedule" in kwargs:
        RUNS.steps = list(kwargs["schedule"])
    path = kwargs.get("path")
    RUNS.hooked.append((model, hook, path))
    if hook.task == "overflow" or path or RUNS.dump_path:
        RUNS.start(model, hook, path)
        return
    # a dump hook waits for its dump file (set_dump_path); without one, the model's first forward
    # starts it into the default path

    def first_forward(module, args) -> None:
        handle.remove()
        if not any(key[0] == hook.task for key in RUNS.probes):
            RUNS.start(model, hook, path)
    handle = model.register_forward_pre_hook(first_forward)


def schedule(begin: int = 0, end: int = sys.maxsize, stride: int = 1) -> list[int]:
    """The steps ``begin, begin + stride, ...`` up to ``end`` (included), as torch_npu.hooks counts them."""
    if end == sys.maxsize:
        if begin == 0 and stride == 1:
            return []           # every step
        raise ConfigError(f"schedule(begin={begin}, stride={stride}): give end= too (the run lists its steps)")
    return list(range(begin, end + 1, stride))


class _StepSchedule:
    """``step_schedule.step()`` ends a step of every run recording now; the hooks stay, so the
    next step is recorded (when the schedule selects it)."""

    def step(self) -> None:
        for probe in RUNS.probes.values():
            probe.step()
            probe.start()

    def reset_step(self) -> None:
        """Steps of a run directory are numbered once: they keep counting (one line says so)."""
        if any(p.step_no for p in RUNS.probes.values()):
            warnings.warn("step_schedule.reset_step(): steps keep counting in the same dump path (a run "
                          "directory holds each step once); set_dump_path() starts a new run at step 0",
                          ConfigWarning, stacklevel=2)


step_schedule = _StepSchedule()


def compare(pkl_path1, pkl_path2, output_path, shape_flag: bool = False):
    """``dispatchprobe compare pkl_path1 pkl_path2``: the table in ``output_path`` (CSV), the
    report beside it (``<output_path without .csv>/``), the verdict printed and returned.
    ``shape_flag=False`` pairs records by name, ``True`` by scope, op and shapes."""
    from .offline.compare import compare as compare_runs
    RUNS.close()          # what is still being recorded is on disk first
    report = os.path.splitext(os.fspath(output_path))[0] + "_report"
    table, verdict = compare_runs(pkl_path1, pkl_path2, match="fuzzy" if shape_flag else "exact", out=report)
    table.to_csv(output_path, index=False)
    print(verdict)
    return verdict


_HOOKS = (wrap_acc_cmp_hook, wrap_checkoverflow_hook, wrap_async_datadump_hook)
atexit.register(RUNS.close)
