"""One config object for every task, loaded from kwargs, a dict, JSON or YAML.

msprobe's ``config.json`` keys are accepted as they are (``task``, ``dump_path``, ``level``
``L0/L1/mix``, ``step``, ``rank``, ``scope``, ``list``, ``data_mode``, ``summary_mode``, the nested
``statistics``/``tensor``/``overflow_check``/``free_benchmark`` sections).  Anything unknown or
impossible fails at construction, in one line naming the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from .perturbations import PERTURBATIONS
from .tasks import TASKS, canonical

LEVELS = ("op", "module", "mix")
_LEVEL_ALIASES = {"L0": "module", "L1": "op", "L2": "op", "mix": "mix"}
DATA_MODES = ("all", "forward", "backward", "input", "output")
HANDLER_TYPES = ("check", "fix")
FUZZ_STAGES = ("forward", "backward")
OVERFLOW_STAGES = ("forward", "backward", "both")


class ConfigError(ValueError):
    """A config that cannot work; the message names the key and the allowed values."""


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
class Config:
    """Everything a probe needs.  See the README's "Config" section for each key."""

    task: str = "statistics"
    dump_path: str = "./dispatchprobe_dump"
    level: str = "op"
    step: list[int] = field(default_factory=list)       # empty: every step
    rank: list[int] = field(default_factory=list)       # empty: every rank
    scope: list[str] = field(default_factory=list)      # module scope prefixes; empty: all
    list: list[str] = field(default_factory=list)       # op names: exact, substring or regex
    data_mode: list[str] = field(default_factory=lambda: ["all"])
    include_views: bool = False     # record view/metadata-only ops (view, t, expand, ...)
    stack: bool = False             # record the Python stack of each forward op (deduplicated)
    checksum: bool = False          # a fast hash of each tensor's bytes (msprobe summary_mode=md5)
    overwrite: bool = False         # delete this rank's records of an earlier run in dump_path first
    overflow: OverflowConfig = field(default_factory=OverflowConfig)
    free_benchmark: FreeBenchmarkConfig = field(default_factory=FreeBenchmarkConfig)

    @classmethod
    def load(cls, source: "Config | str | os.PathLike | dict | None" = None, **overrides) -> "Config":
        """Build a config from a Config, a path to JSON/YAML, a dict, and/or keyword overrides."""
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
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls._from_dict(data)

    @classmethod
    def _from_dict(cls, data: dict) -> "Config":
        data = _flatten_msprobe(dict(data))
        sections = {"overflow": OverflowConfig, "free_benchmark": FreeBenchmarkConfig}
        kwargs: dict[str, Any] = {}
        top = {f.name: f for f in dataclasses.fields(cls)}
        for key, value in data.items():
            if key in _IGNORED_MSPROBE_KEYS:
                continue
            if key in sections and isinstance(value, dict):
                kwargs[key] = _build_section(sections[key], key, value)
                continue
            section = next((s for s, c in sections.items() if key in _field_names(c)), None)
            if key not in top and section is not None:
                kwargs.setdefault(section, {})
                if isinstance(kwargs[section], dict):
                    kwargs[section][key] = value
                else:
                    setattr(kwargs[section], key, value)
                continue
            if key not in top:
                allowed = sorted(set(top) | _field_names(OverflowConfig) | _field_names(FreeBenchmarkConfig))
                raise ConfigError(f"config: unknown key {key!r}; allowed keys: {', '.join(allowed)}")
            kwargs[key] = value
        for name, klass in sections.items():
            if isinstance(kwargs.get(name), dict):
                kwargs[name] = _build_section(klass, name, kwargs[name])
        cfg = cls(**kwargs)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        self.task = canonical(self.task)
        _choice("task", self.task, tuple(TASKS))
        self.level = _LEVEL_ALIASES.get(self.level, self.level)
        _choice("level", self.level, LEVELS)
        _type("dump_path", self.dump_path, str)
        if not self.dump_path:
            raise ConfigError("config: 'dump_path' must not be empty")
        self.step = _int_list("step", self.step)
        self.rank = _int_list("rank", self.rank)
        self.scope = _str_list("scope", self.scope)
        self.list = _str_list("list", self.list)
        self.data_mode = _str_list("data_mode", self.data_mode) or ["all"]
        for mode in self.data_mode:
            _choice("data_mode", mode, DATA_MODES)
        for key in ("include_views", "stack", "checksum", "overwrite"):
            _type(key, getattr(self, key), bool)
        o, fb = self.overflow, self.free_benchmark
        _type("overflow_nums", o.overflow_nums, int)
        o.check_mode = {"all": "both"}.get(o.check_mode, o.check_mode)  # msprobe's spelling
        _choice("check_mode", o.check_mode, OVERFLOW_STAGES)
        _choice("pert_mode", fb.pert_mode, tuple(PERTURBATIONS))
        _choice("handler_type", fb.handler_type, HANDLER_TYPES)
        _choice("fuzz_stage", fb.fuzz_stage, FUZZ_STAGES)
        fb.fuzz_device = {"npu": "same", "gpu": "same", "cuda": "same"}.get(fb.fuzz_device, fb.fuzz_device)
        _choice("fuzz_device", fb.fuzz_device, ("same", "cpu"))
        for key in ("preheat_step", "max_sample", "seed"):
            _type(key, getattr(fb, key), int)
        fixable = [p.name for p in PERTURBATIONS.values() if p.fixable]
        if fb.handler_type == "fix" and fb.pert_mode not in fixable:
            raise ConfigError(f"config: handler_type='fix' needs pert_mode {' or '.join(map(repr, fixable))}, "
                              f"got {fb.pert_mode!r}")
        on_cpu = [p.name for p in PERTURBATIONS.values() if p.device == "cpu"]
        if (fb.fuzz_device == "cpu") != (fb.pert_mode in on_cpu):
            raise ConfigError(f"config: fuzz_device='cpu' goes with pert_mode={' or '.join(map(repr, on_cpu))} "
                              "and only with it")
        if TASKS[self.task].checks_ops and self.level == "module":
            raise ConfigError(f"config: task={self.task!r} checks ops; level must be 'op' or 'mix', not 'module'")

    def stage_enabled(self, stage: str) -> bool:
        modes = set(self.data_mode)
        return "all" in modes or stage in modes or not (modes & {"forward", "backward"})

    def io_enabled(self, io: str) -> bool:
        modes = set(self.data_mode)
        return "all" in modes or io in modes or not (modes & {"input", "output"})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_IGNORED_MSPROBE_KEYS = {"enable_dataloader", "is_deterministic", "framework", "file_format",
                         "fuzz_level", "acl_config", "online_run_ut", "nfs_path", "host", "port",
                         "error_data_path", "white_list", "black_list"}


def _field_names(klass) -> set[str]:
    return {f.name for f in dataclasses.fields(klass)}


def _flatten_msprobe(data: dict) -> dict:
    """Merge msprobe's per-task sections (``"statistics": {...}``) into the top level."""
    for section in ("statistics", "tensor"):
        if isinstance(data.get(section), dict):
            data.update(data.pop(section))
    if isinstance(data.get("overflow_check"), dict):
        data["overflow"] = {**data.get("overflow", {}), **data.pop("overflow_check")}
    if isinstance(data.get("free_benchmark"), dict):
        section = dict(data["free_benchmark"])
        for key in ("scope", "list"):
            if key in section:
                data[key] = section.pop(key)
        data["free_benchmark"] = section
    if "summary_mode" in data:
        mode = data.pop("summary_mode")
        _choice("summary_mode", mode, ("statistics", "md5"))
        data["checksum"] = mode == "md5"
    if isinstance(data.get("data_mode"), str):
        data["data_mode"] = [data["data_mode"]]
    return data


def _build_section(klass, name: str, values: dict):
    allowed = _field_names(klass)
    values = {k: v for k, v in values.items() if k not in _IGNORED_MSPROBE_KEYS}
    for key in values:
        if key not in allowed:
            raise ConfigError(f"config: unknown key {key!r} in '{name}'; allowed: {', '.join(sorted(allowed))}")
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


def _choice(key: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"config: {key}={value!r} is not allowed; choose one of: {', '.join(allowed)}")


def _type(key: str, value, klass) -> None:
    if not isinstance(value, klass) or (klass is int and isinstance(value, bool)):
        raise ConfigError(f"config: {key} must be {klass.__name__}, got {value!r}")


def _int_list(key: str, value) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"config: {key} must be a list of integers (e.g. [0, 2] or ['0-3']), got {value!r}")
    out: list[int] = []
    for item in value:
        if isinstance(item, str) and "-" in item:
            lo, _, hi = item.partition("-")
            if lo.strip().isdigit() and hi.strip().isdigit():
                out.extend(range(int(lo), int(hi) + 1))
                continue
        if isinstance(item, bool) or not isinstance(item, int):
            try:
                item = int(item)
            except (TypeError, ValueError):
                raise ConfigError(f"config: {key} must hold integers or 'a-b' ranges, got {item!r}") from None
        if item < 0:
            raise ConfigError(f"config: {key} must hold non-negative integers, got {item}")
        out.append(item)
    return out


def _str_list(key: str, value) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"config: {key} must be a list of strings, got {value!r}")
    return list(value)
