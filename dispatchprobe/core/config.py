"""One config object for every task, loaded from kwargs, a dict, JSON or YAML.

msprobe's ``config.json`` is accepted as it is (``msprobe_config.py`` reads its sections, keys and
names into these options).  Anything unknown or impossible fails at construction, in one line
naming the key and what is allowed (``config_values.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from .config_values import (ConfigError, ConfigWarning, check_regexes, check_type, choice, int_list, str_list,
                            unknown_key)
from .msprobe_config import MSPROBE_ONLY_TASKS, flatten_msprobe, msprobe_list, msprobe_scope
from .perturbations import PERTURBATIONS
from .tasks import TASKS, canonical

__all__ = ["Config", "ConfigError", "ConfigWarning", "OverflowConfig", "FreeBenchmarkConfig", "GradProbeConfig"]

LEVELS = ("op", "module", "mix")
GRAD_LEVELS = ("L0", "L1", "L2")     # the grad probe's, as msprobe defines them (docs/grad-probe.md)
_LEVEL_ALIASES = {"L0": "module", "L1": "op", "L2": "op", "mix": "mix"}
DATA_MODES = ("all", "forward", "backward", "input", "output")
HANDLER_TYPES = ("check", "fix")
FUZZ_STAGES = ("forward", "backward")
OVERFLOW_STAGES = ("forward", "backward", "both")


@dataclass
class OverflowConfig:
    """Options of ``task="overflow"`` (msprobe section ``overflow_check``)."""

    overflow_nums: int = 1          # stop (raise) after this many overflows; -1 keeps going
    check_mode: str = "both"        # forward, backward or both
    replay: bool = True             # replay each flagged op in float64 on CPU to classify it


@dataclass
class FreeBenchmarkConfig:
    """Options of ``task="free_benchmark"`` (msprobe section ``free_benchmark``)."""

    pert_mode: str = "improve_precision"
    handler_type: str = "check"
    fuzz_stage: str = "forward"
    fuzz_device: str = "same"       # "same" (msprobe "npu") or "cpu" (with pert_mode="to_cpu")
    if_preheat: bool = False
    preheat_step: int = 15
    max_sample: int = 20
    seed: int = 1234                # seeds the probe's own noise generator, never the global RNG
    widen_float32: bool = False     # improve_precision also widens float32 to float64 (msprobe does not; slow)


@dataclass
class GradProbeConfig:
    """Options of ``task="grad_probe"`` (msprobe section ``grad_probe``; docs/grad-probe.md)."""

    grad_level: str = "L1"          # L0: max/min/norm/shape/MD5; L1: + signs; L2: + interval shares
    param_list: list[str] = field(default_factory=list)   # parameter names, dotted prefixes or regexes; empty: all
    bounds: list = field(default_factory=lambda: [-1, 0, 1])   # ascending; L2 counts the intervals they cut


@dataclass
class Config:
    """Everything a probe needs.  Each key: docs/recording.md, "Config"."""

    task: str = "statistics"
    dump_path: str = "./dispatchprobe_dump"
    level: str = "op"
    step: list[int] = field(default_factory=list)       # empty: every step
    rank: list[int] = field(default_factory=list)       # empty: every rank
    scope: list[str] = field(default_factory=list)      # module scopes; "*." stands for the root; empty: all
    list: list[str] = field(default_factory=list)       # op names: exact, substring or regex
    data_mode: list[str] = field(default_factory=lambda: ["all"])
    include_views: bool = False     # record view/metadata-only ops (view, t, expand, ...)
    stack: bool = False             # record the Python stack of each forward op (deduplicated)
    checksum: bool = False          # a fast hash of each tensor's bytes (msprobe summary_mode=md5)
    parameters: bool = True         # statistics/tensor: each parameter's gradient and value at optimizer steps
    overwrite: bool = False         # delete this rank's records of an earlier run in dump_path first
    seed: int | None = None         # set: the probe calls dispatchprobe.seed_all(seed) when it is built
    is_deterministic: bool = False  # the probe calls seed_all(seed or 1234, mode=True) when it is built
    # online run-ut (task tensor, docs/online.md): stream each op to `dispatchprobe run-ut --listen`
    # at host:port (TLS with the certificates in tls_path), or record into nfs_path for `--follow`
    online_run_ut: bool = False
    nfs_path: str = ""              # shared storage: the run directory a checker follows (replaces dump_path)
    host: str = ""
    port: int = -1
    tls_path: str = ""              # ca.crt (+ client.crt, client.key for mutual TLS); empty: plain TCP, loopback only
    online_queue_mb: float = 256.0  # the send queue's bound (serialised ops waiting for the network)
    online_wait_s: float = 60.0     # a full queue blocks training this long, then the op is dropped (counted)
    overflow: OverflowConfig = field(default_factory=OverflowConfig)
    free_benchmark: FreeBenchmarkConfig = field(default_factory=FreeBenchmarkConfig)
    grad_probe: GradProbeConfig = field(default_factory=GradProbeConfig)

    @classmethod
    def load(cls, source: "Config | str | os.PathLike | dict | None" = None, **overrides) -> "Config":
        """Build a config from a Config, a path to JSON/YAML, a dict, and/or keyword overrides.

        Every line worth saying about msprobe keys and values (ignored, or read differently) is
        one :class:`ConfigWarning`, emitted here once the config is valid."""
        if isinstance(source, Config):
            data = dataclasses.asdict(source)
        elif source is None:
            data = {}
        elif isinstance(source, dict):
            data = dict(source)
        elif isinstance(source, (str, os.PathLike)):
            data = _read_file(str(source))
        else:
            raise ConfigError(f"config: expected a path, dict or Config, got {type(source).__name__}")
        overrides = {k: v for k, v in overrides.items() if v is not None}
        task = overrides.get("task", data.get("task", "statistics"))
        notes: list[str] = []
        data = flatten_msprobe(data, task, notes)
        data.update(flatten_msprobe(overrides, task, notes))
        cfg = cls._from_dict(data)
        for note in dict.fromkeys(notes):
            warnings.warn(note, ConfigWarning, stacklevel=2)
        return cfg

    @classmethod
    def _from_dict(cls, data: dict) -> "Config":
        sections = {"overflow": OverflowConfig, "free_benchmark": FreeBenchmarkConfig, "grad_probe": GradProbeConfig}
        kwargs: dict[str, Any] = {}
        top = {f.name: f for f in dataclasses.fields(cls)}
        for key, value in data.items():
            if key in sections and isinstance(value, dict):
                kwargs[key] = {**kwargs.get(key, {}), **value}
                continue
            section = next((s for s, c in sections.items() if key in _field_names(c)), None)
            if key not in top and section is not None:
                kwargs.setdefault(section, {})[key] = value
                continue
            if key not in top:
                allowed = sorted(set(top).union(*(_field_names(c) for c in sections.values())))
                raise unknown_key(key, allowed)
            kwargs[key] = value
        if kwargs.get("seed") is not None:      # msprobe's top-level seed also seeds the free benchmark
            fb = kwargs.setdefault("free_benchmark", {})
            if isinstance(fb, dict) and "seed" not in fb:
                fb["seed"] = kwargs["seed"]
        for name, klass in sections.items():
            if isinstance(kwargs.get(name), dict):
                kwargs[name] = _build_section(klass, name, kwargs[name])
        cfg = cls(**kwargs)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        self.task = canonical(self.task)
        if self.task in MSPROBE_ONLY_TASKS:
            raise ConfigError(f"config: task={self.task!r} {MSPROBE_ONLY_TASKS[self.task]}")
        choice("task", self.task, tuple(TASKS))
        self.level = _LEVEL_ALIASES.get(self.level, self.level)
        choice("level", self.level, LEVELS)
        check_type("dump_path", self.dump_path, str)
        if not self.dump_path:
            raise ConfigError("config: 'dump_path' must not be empty")
        self.step = int_list("step", self.step)
        self.rank = int_list("rank", self.rank)
        self.scope = str_list("scope", self.scope)
        self.list = str_list("list", self.list)
        self.data_mode = str_list("data_mode", self.data_mode) or ["all"]
        for mode in self.data_mode:
            choice("data_mode", mode, DATA_MODES)
        for key in ("include_views", "stack", "checksum", "parameters", "overwrite", "is_deterministic"):
            check_type(key, getattr(self, key), bool)
        if self.seed is not None:
            check_type("seed", self.seed, int)
        self._validate_online()
        o, fb = self.overflow, self.free_benchmark
        check_type("overflow_nums", o.overflow_nums, int)
        if o.overflow_nums == 0 or o.overflow_nums < -1:     # msprobe's: the N-th overflow stops, -1 never
            raise ConfigError(f"config: overflow_nums={o.overflow_nums}: the number of critical overflows to stop "
                              "at (1 or more), or -1 to check on to the end")
        o.check_mode = {"all": "both"}.get(o.check_mode, o.check_mode)  # msprobe's spelling
        choice("check_mode", o.check_mode, OVERFLOW_STAGES)
        choice("pert_mode", fb.pert_mode, tuple(PERTURBATIONS))
        choice("handler_type", fb.handler_type, HANDLER_TYPES)
        choice("fuzz_stage", fb.fuzz_stage, FUZZ_STAGES)
        fb.fuzz_device = {"npu": "same", "gpu": "same", "cuda": "same"}.get(fb.fuzz_device, fb.fuzz_device)
        choice("fuzz_device", fb.fuzz_device, ("same", "cpu"))
        for key in ("preheat_step", "max_sample", "seed"):
            check_type(key, getattr(fb, key), int)
        fixable = [p.name for p in PERTURBATIONS.values() if p.fixable]
        if fb.handler_type == "fix" and fb.pert_mode not in fixable:
            raise ConfigError(f"config: handler_type='fix' needs pert_mode {' or '.join(map(repr, fixable))}, "
                              f"got {fb.pert_mode!r}")
        on_cpu = [p.name for p in PERTURBATIONS.values() if p.device == "cpu"]
        if (fb.fuzz_device == "cpu") != (fb.pert_mode in on_cpu):
            raise ConfigError(f"config: fuzz_device='cpu' goes with pert_mode={' or '.join(map(repr, on_cpu))} "
                              "and only with it")
        _validate_grad_probe(self.grad_probe)
        if TASKS[self.task].checks_ops and self.level == "module":
            raise ConfigError(f"config: task={self.task!r} checks ops; level must be 'op' or 'mix', not 'module'")
        for note in self._read_msprobe_values():
            warnings.warn(note, ConfigWarning, stacklevel=4)

    def _validate_online(self) -> None:
        check_type("online_run_ut", self.online_run_ut, bool)
        for key in ("nfs_path", "host", "tls_path"):
            check_type(key, getattr(self, key), str)
        check_type("port", self.port, int)
        for key in ("online_queue_mb", "online_wait_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"config: {key} must be a non-negative number, got {value!r}")
        if not self.online_run_ut:
            return
        if self.task != "tensor":
            raise ConfigError(f"config: online_run_ut streams saved tensors: it needs task='tensor', not {self.task!r}")
        if self.nfs_path:             # msprobe: nfs_path set, host/port/tls_path are not used
            self.dump_path = self.nfs_path
            return
        if not self.host or not 0 < self.port < 65536:
            raise ConfigError(f"config: online_run_ut needs host and port of a `dispatchprobe run-ut --listen` "
                              f"checker (or nfs_path, a directory it follows), got host={self.host!r} port={self.port}")
        if self.tls_path and not os.path.isdir(self.tls_path):
            raise ConfigError(f"config: tls_path {self.tls_path!r} is not a directory (it holds ca.crt, and "
                              "client.crt + client.key for mutual TLS)")

    @property
    def streams(self) -> bool:
        """Records go over the network to a checker, not to dump_path."""
        return self.online_run_ut and not self.nfs_path

    def _read_msprobe_values(self) -> list[str]:
        """msprobe module and API names in ``scope``/``list`` become module scopes and aten op
        patterns (in place); every ``list`` entry must then compile as a regex.  Returns the lines
        that say how names were read."""
        notes: list[str] = []
        scope, to_list = msprobe_scope(self.scope, notes, may_move=not self.list)
        names, to_scope = msprobe_list(self.list + to_list, notes, may_move=not self.scope)
        self.scope, self.list = scope + to_scope, names
        check_regexes("list", self.list, "an aten op name")
        return notes

    def stage_enabled(self, stage: str) -> bool:
        modes = set(self.data_mode)
        return "all" in modes or stage in modes or not (modes & {"forward", "backward"})

    def io_enabled(self, io: str) -> bool:
        modes = set(self.data_mode)
        return "all" in modes or io in modes or not (modes & {"input", "output"})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)



def _field_names(klass) -> set[str]:
    return {f.name for f in dataclasses.fields(klass)}



def _validate_grad_probe(g: GradProbeConfig) -> None:
    """msprobe's checks on the grad_probe section, each failing in one line."""
    choice("grad_level", g.grad_level, GRAD_LEVELS)
    g.param_list = str_list("param_list", g.param_list)
    check_regexes("param_list", g.param_list, "a parameter name")
    if isinstance(g.bounds, (int, float)) and not isinstance(g.bounds, bool):
        g.bounds = [g.bounds]
    if not isinstance(g.bounds, (list, tuple)) or not g.bounds:
        raise ConfigError(f"config: bounds must be a non-empty list of ascending numbers, e.g. [-1, 0, 1]; "
                          f"got {g.bounds!r}")
    for b in g.bounds:
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -2**63 <= b <= 2**63 - 1:
            raise ConfigError(f"config: bounds must hold numbers within int64's range, got {b!r}")
    if any(a >= b for a, b in zip(g.bounds, g.bounds[1:])):
        raise ConfigError(f"config: bounds must be strictly ascending, got {list(g.bounds)}")
    g.bounds = list(g.bounds)



def _build_section(klass, name: str, values: dict):
    allowed = _field_names(klass)
    for key in values:
        if key not in allowed:
            raise unknown_key(key, allowed, name)
    return klass(**values)


def _read_file(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"config: file not found: {path}")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml
            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
    except Exception as exc:  # the parser's own message says where
        raise ConfigError(f"config: cannot parse {path}: {exc}".splitlines()[0]) from None
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path} must hold a mapping of keys to values")
    return data

