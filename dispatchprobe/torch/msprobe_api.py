"""msprobe's ``PrecisionDebugger`` over a :class:`DispatchProbe`: msprobe scripts run with only the import changed.

``from dispatchprobe import PrecisionDebugger, seed_all`` stands for ``from msprobe.pytorch import
...``.  The arguments and the config file are read as ``DispatchProbe`` reads msprobe's
config.json (docs/msprobe-config.md), so the records are those the same config records natively.
What msprobe's interface does beyond its config is kept: one debugger per process (a second
construction returns the first), ``start``/``stop``/``step`` callable on the class, the grad
probe started by ``monitor(model)`` with the other calls doing nothing, ``overflow_nums`` ending
the checks while training goes on, and ``forward_backward_dump_end()``: the ops after it are not
recorded, the backward of those before it is (both in :mod:`.msprobe_probe`).
"""

from __future__ import annotations

import atexit
import functools
import warnings
import weakref

import torch

from ..core.config import Config, ConfigError, ConfigWarning
from .msprobe_probe import MsprobeProbe


class _OnTheDebugger:
    """msprobe's methods are classmethods acting on the process's one debugger: both
    ``debugger.start()`` and ``PrecisionDebugger.start()`` work."""

    def __init__(self, fn):
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __get__(self, obj, cls):
        if obj is None:
            obj = cls._instance
            if obj is None:
                raise RuntimeError(f"PrecisionDebugger.{self.fn.__name__}(): build PrecisionDebugger(...) first")
        return self.fn.__get__(obj, cls)


class PrecisionDebugger:
    """msprobe's ``PrecisionDebugger(config_path, task, dump_path, level, model, step)``.

    The arguments override the config file's keys, as in msprobe; the run is ``self.probe``
    (a :class:`DispatchProbe`; for the grad probe, built when ``monitor(model)`` names the model,
    unless ``model`` was given here).  ``close()`` (dispatchprobe's own; also run at exit) ends
    the run and lets a new debugger be built."""

    _instance: "PrecisionDebugger | None" = None

    def __new__(cls, *args, **kwargs):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __init__(self, config_path=None, task=None, dump_path=None, level=None, model=None, step=None):
        if getattr(self, "config", None) is not None:
            if any(v is not None for v in (config_path, task, dump_path, level, model, step)):
                warnings.warn("PrecisionDebugger: one per process, as msprobe's: this call returns the one built "
                              f"before (dump_path {self.config.dump_path!r}) and its arguments are ignored; "
                              "call debugger.close() first to start another run", ConfigWarning, stacklevel=2)
            return
        try:
            # as msprobe's dumps, a run replaces this rank's records of an earlier run in dump_path
            self._setup(config_path, dict(task=task, dump_path=dump_path, level=level, step=step, overwrite=True),
                        model)
        except BaseException:
            self.config = None
            type(self)._instance = None       # a failed construction leaves no debugger behind
            raise
        _close_at_exit(self)

    def _setup(self, config_path, overrides: dict, model) -> None:
        if config_path is not None and not isinstance(config_path, str):
            raise ConfigError(f"PrecisionDebugger: config_path must be a path string, got {type(config_path).__name__}")
        self.config = Config.load(config_path, **overrides)
        model = _one_model(model, grad_probe=self.grad_probe)
        self.probe: MsprobeProbe | None = None
        self._closed = False
        self._args = (config_path, overrides)
        if self.config.task != "grad_probe" or model is not None:
            self._build(model)

    def _build(self, model) -> None:
        config_path, overrides = self._args
        with warnings.catch_warnings():      # Config.load said each line once already
            warnings.simplefilter("ignore", ConfigWarning)
            self.probe = MsprobeProbe(config_path, model=model, **overrides)

    @property
    def grad_probe(self) -> bool:
        return self.config.task == "grad_probe"

    # ---- msprobe's interface --------------------------------------------------------------------
    @_OnTheDebugger
    def start(self, model=None, token_range=None) -> None:
        """Record from here (msprobe: ``debugger.start()`` / ``start(model)``).  The model only
        names module scopes, which are derived from the modules as they run without it; the
        grad probe is started by ``monitor(model)`` (or by start(model))."""
        if token_range is not None:
            _say_once("token_range", f"token_range={token_range!r}: every forward call of a step is recorded "
                      "(select ops with list/scope)")
        if self.grad_probe:
            if model is not None and self.probe is None:
                self._build(_one_model(model, grad_probe=True))
            return
        probe = self._probe()
        if probe.checks_ended is not None:
            return
        if not probe.active:
            probe.mark_window_start()
        probe.start()

    @_OnTheDebugger
    def forward_backward_dump_end(self) -> None:
        """Stop recording forward ops here; the backward of the ops since start() is recorded
        until stop()."""
        probe = self._probe()
        if not self.grad_probe and probe.active and probe.window is None:
            probe.close_window()

    @_OnTheDebugger
    def stop(self) -> None:
        if self.grad_probe:
            return
        probe = self._probe()
        probe.window = None
        probe.retrying(probe.stop)

    @_OnTheDebugger
    def step(self) -> None:
        """End of a training step.  The grad probe counts optimizer steps itself (msprobe's too)."""
        if self.grad_probe:
            return
        probe = self._probe()
        probe.window = None
        probe.retrying(probe.step)

    @_OnTheDebugger
    def monitor(self, model) -> None:
        """The grad probe's start (msprobe: ``debugger.monitor(model)``); other tasks: nothing."""
        if self.grad_probe and self.probe is None:
            self._build(_one_model(model, grad_probe=True))

    @_OnTheDebugger
    def set_init_step(self, step: int) -> None:
        """msprobe's ``set_init_step(step)``: the step number the next step's records take."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"PrecisionDebugger.set_init_step: step must be a non-negative integer, got {step!r}")
        probe = self._probe()
        if probe.active:
            raise ConfigError("PrecisionDebugger.set_init_step: call it before start(), not while recording")
        probe.step_no = step

    @_OnTheDebugger
    def save(self, variable, name, save_backward=True) -> None:
        """msprobe's level ``debug`` (any variable by name): not here, one line says so."""
        _say_once("save", f"PrecisionDebugger.save({name!r}) records nothing: dispatchprobe records the ops "
                  "below autograd; `dispatchprobe show RUN --op NAME` finds the op that made the variable")

    @_OnTheDebugger
    def module_dump(self, module, dump_name) -> None:
        """msprobe's one-module dump: a scope here, one line says so."""
        _say_once("module_dump", f"PrecisionDebugger.module_dump({dump_name!r}) selects nothing: select the "
                  "module with scope: ['*.<its attribute path>'] (it and what it runs, forward and backward)")

    @_OnTheDebugger
    def module_dump_end(self) -> None:
        """Goes with :meth:`module_dump` (which said what to do instead)."""

    @_OnTheDebugger
    def close(self) -> None:
        """End the run (at exit without it); the next PrecisionDebugger(...) starts a new one."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.probe is not None:
                self.probe.retrying(self.probe.close)
        finally:
            if type(self)._instance is self:
                type(self)._instance = None

    def _probe(self) -> MsprobeProbe:
        if self.probe is None:
            raise ConfigError("PrecisionDebugger: task 'grad_probe' needs the model: debugger.monitor(model)")
        return self.probe


def _one_model(model, grad_probe: bool = False):
    """msprobe takes a module or a list of modules; a DispatchProbe names scopes from one."""
    if model is None or isinstance(model, torch.nn.Module):
        return model
    if isinstance(model, (list, tuple)) and all(isinstance(m, torch.nn.Module) for m in model):
        if len(model) == 1:
            return model[0]
        if grad_probe:
            raise ConfigError("PrecisionDebugger: the grad probe reads one model's parameters: pass the model "
                              f"being trained, not a list of {len(model)}")
        warnings.warn("PrecisionDebugger: model: a list of modules names each module's scopes as it runs "
                      "(from its class name); only the grad probe needs one model", ConfigWarning, stacklevel=3)
        return None
    raise ConfigError(f"PrecisionDebugger: model must be a torch.nn.Module or a list of them, not {type(model).__name__}")


_SAID: set[str] = set()


def _say_once(what: str, line: str) -> None:
    """A msprobe call or argument that cannot mean the same here: one ConfigWarning line per process."""
    if what not in _SAID:
        _SAID.add(what)
        warnings.warn(line, ConfigWarning, stacklevel=4)


def _close_at_exit(debugger: PrecisionDebugger) -> None:
    """msprobe scripts never close the debugger: the run is closed when the process exits."""
    ref = weakref.ref(debugger)
    atexit.register(lambda: ref() is not None and ref().close())
