"""One config object for every task, loaded from kwargs, a dict, JSON or YAML.

msprobe's ``config.json`` is accepted as it is: every key msprobe documents is in
:data:`MSPROBE_KEYS`, honoured or ignored with one warning line saying why, and msprobe's module
and API names in ``scope``/``list`` are read as module scopes and aten ops (:func:`msprobe_list`, :func:`msprobe_scope`).
Anything unknown or impossible fails at construction, in one line naming the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .perturbations import PERTURBATIONS
from .tasks import TASKS, canonical

LEVELS = ("op", "module", "mix")
GRAD_LEVELS = ("L0", "L1", "L2")     # the grad probe's, as msprobe defines them (docs/grad-probe.md)
_LEVEL_ALIASES = {"L0": "module", "L1": "op", "L2": "op", "mix": "mix"}
DATA_MODES = ("all", "forward", "backward", "input", "output")
HANDLER_TYPES = ("check", "fix")
FUZZ_STAGES = ("forward", "backward")
OVERFLOW_STAGES = ("forward", "backward", "both")
MAX_STEPS = 1_000_000       # a step range/schedule may list at most this many steps


class ConfigError(ValueError):
    """A config that cannot work; the message names the key and the allowed values."""


class ConfigWarning(UserWarning):
    """A config key or value read differently from msprobe (ignored, or mapped): one line each."""


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
    """Everything a probe needs.  See the README's "Config" section for each key."""

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
        data = _flatten_msprobe(data, task, notes)
        data.update(_flatten_msprobe(overrides, task, notes))
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
                raise ConfigError(f"config: unknown key {key!r}; allowed keys: {', '.join(allowed)}")
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
        if self.task in _MSPROBE_ONLY_TASKS:
            raise ConfigError(f"config: task={self.task!r} {_MSPROBE_ONLY_TASKS[self.task]}")
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
        for key in ("include_views", "stack", "checksum", "parameters", "overwrite", "is_deterministic"):
            _type(key, getattr(self, key), bool)
        if self.seed is not None:
            _type("seed", self.seed, int)
        self._validate_online()
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
        _validate_grad_probe(self.grad_probe)
        if TASKS[self.task].checks_ops and self.level == "module":
            raise ConfigError(f"config: task={self.task!r} checks ops; level must be 'op' or 'mix', not 'module'")
        for note in self._read_msprobe_values():
            warnings.warn(note, ConfigWarning, stacklevel=4)

    def _validate_online(self) -> None:
        _type("online_run_ut", self.online_run_ut, bool)
        for key in ("nfs_path", "host", "tls_path"):
            _type(key, getattr(self, key), str)
        _type("port", self.port, int)
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
        _check_regexes("list", self.list, "an aten op name")
        return notes

    def stage_enabled(self, stage: str) -> bool:
        modes = set(self.data_mode)
        return "all" in modes or stage in modes or not (modes & {"forward", "backward"})

    def io_enabled(self, io: str) -> bool:
        modes = set(self.data_mode)
        return "all" in modes or io in modes or not (modes & {"input", "output"})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---- msprobe's config.json ----------------------------------------------------------------------

class MsprobeKey(NamedTuple):
    """How one msprobe key is read: ``honoured`` names the dispatchprobe option it becomes;
    otherwise ``how`` says why it is ignored, with one warning unless its value is in ``inert``
    (values that ask for what dispatchprobe does anyway; ``ANY``: every value)."""

    sections: str
    honoured: bool
    how: str
    inert: tuple = ()


ANY = ("*any*",)
_RUN_UT = "an option of msprobe's run_ut command; dispatchprobe's is `dispatchprobe run-ut RUN` (see docs/run-ut.md)"

#: Every key of msprobe's config.json documented in msprobe's documentation and in msprobe's
#: config introduction (1.0.x to 8.x): how dispatchprobe reads it.  Keys of the run_ut/acc_check
#: section (and of the sections of tasks other than ``task``) are accepted without a word, as
#: msprobe does: they configure another task.
MSPROBE_KEYS: dict[str, MsprobeKey] = {
    # top level
    "task": MsprobeKey("top", True, "task: statistics, tensor, overflow_check (= overflow), free_benchmark, "
                       "grad_probe; run_ut/acc_check, structure, exception_dump: one line naming the equivalent"),
    "dump_path": MsprobeKey("top", True, "dump_path: the run directory"),
    "rank": MsprobeKey("top", True, "rank: ints and 'a-b' ranges"),
    "step": MsprobeKey("top", True, "step: ints, 'a-b' ranges, 'a-b:stride' and schedule {begin, end, stride}"),
    "level": MsprobeKey("top", True, "level: L0 = module, L1 = op, mix; L2 (kernels) = op (aten kernels)"),
    "seed": MsprobeKey("top", True, "seed: dispatchprobe.seed_all(seed) when the probe is built, and the "
                       "free benchmark's noise seed"),
    "is_deterministic": MsprobeKey("top", True, "is_deterministic: seed_all(seed, mode=True) when the probe is "
                                   "built (deterministic algorithms, cuBLAS workspace, cuDNN)"),
    "enable_dataloader": MsprobeKey("top", False, "dispatchprobe never ends training; mark steps with "
                                    "probe.step() (msprobe deprecated this switch)", (False,)),
    "acl_config": MsprobeKey("top", False, "Ascend ACL kernel dumps (level L2) are device-specific; "
                             "dispatchprobe records aten kernels at level op", ("", None)),
    "async_dump": MsprobeKey("top", False, "dispatchprobe always writes in the background and never syncs "
                             "the device per op", (False,)),
    "dump_enable": MsprobeKey("top", False, "the config is read once; switch recording with probe.start()/"
                              "stop() or `with probe:`", (True,)),
    "extra_info": MsprobeKey("top", False, "the module tree is always written; Python stacks are recorded "
                             "with stack: true", (False,)),
    "precision": MsprobeKey("top, run_ut", False, "statistics are always accumulated in float32 or wider "
                            "(msprobe's 'high')", ("high",)),
    "risk_level": MsprobeKey("top", False, "every aten op is recorded, view/metadata ops only with "
                             "include_views: true (about msprobe's FOCUS)", ("FOCUS",)),
    "framework": MsprobeKey("top", False, "the framework is the probe's (DispatchProbe: torch)", ANY),
    # statistics / tensor sections
    "scope": MsprobeKey("statistics, tensor, free_benchmark", True,
                        "scope: module scopes; msprobe module names -> '*.<attribute path>'"),
    "list": MsprobeKey("statistics, tensor, free_benchmark", True,
                       "list: aten op names/regexes; msprobe and torch API names -> the aten ops they run"),
    "data_mode": MsprobeKey("statistics, tensor", True, "data_mode"),
    "summary_mode": MsprobeKey("statistics, tensor", True, "checksum: md5/xor = CRC32 beside the statistics"),
    "tensor_list": MsprobeKey("statistics, tensor", False, "tensors are saved for every selected op (task "
                              "tensor) or none (task statistics); select ops with list", ([],)),
    "file_format": MsprobeKey("tensor", False, "tensors are always safetensors", ("npy",)),
    "backward_input": MsprobeKey("tensor", False, "backward ops are recorded with their inputs in every run; "
                                 "no earlier dump is needed", ("", [])),
    "bench_path": MsprobeKey("tensor", False, "no live MD5 comparison with an earlier run: record both runs "
                             "(checksum: true) and `dispatchprobe compare A B`", ("",)),
    "diff_nums": MsprobeKey("tensor", False, "goes with bench_path (no live comparison)", (1,)),
    "device": MsprobeKey("statistics", False, "statistics are computed on the tensor's own device", ANY),
    "online_run_ut": MsprobeKey("tensor", True, "online_run_ut: stream each op to `dispatchprobe run-ut --listen` "
                                "(or record into nfs_path for `run-ut --follow`); docs/online.md"),
    "nfs_path": MsprobeKey("tensor, run_ut", True, "nfs_path: the run directory (replaces dump_path) that "
                           "`dispatchprobe run-ut NFS_PATH --follow` judges as it is written"),
    "host": MsprobeKey("tensor, run_ut", True, "host: the checker's address (`run-ut --listen HOST:PORT`)"),
    "port": MsprobeKey("tensor, run_ut", True, "port: the checker's port"),
    "tls_path": MsprobeKey("tensor, run_ut", True, "tls_path: a directory with ca.crt (and client.crt + client.key "
                           "for mutual TLS); the checker's --tls-path holds server.crt, server.key (+ ca.crt)"),
    # overflow_check
    "overflow_nums": MsprobeKey("overflow_check", True, "overflow_nums"),
    "check_mode": MsprobeKey("overflow_check", True, "check_mode: all = both; aicore/atomic (Ascend units) "
                             "= both, with a warning"),
    # free_benchmark
    **{k: MsprobeKey("free_benchmark", True, k) for k in ("pert_mode", "handler_type", "fuzz_stage", "if_preheat",
                                                             "preheat_step", "max_sample")},
    "fuzz_device": MsprobeKey("free_benchmark", True, "fuzz_device: npu/gpu/cuda = same device, cpu"),
    "fuzz_level": MsprobeKey("free_benchmark", False, "free_benchmark.csv has msprobe's L1 columns", ("L1",)),
    # run_ut / acc_check (msprobe's pre-check command): another task
    **{k: MsprobeKey("run_ut", False, _RUN_UT, ANY) for k in ("white_list", "black_list", "error_data_path",
                                                               "is_online", "rank_list")},
    # grad_probe
    "grad_level": MsprobeKey("grad_probe", True, "grad_level: L0, L1, L2 (docs/grad-probe.md)"),
    "param_list": MsprobeKey("grad_probe", True, "param_list: parameter names; also dotted prefixes and regexes"),
    "bounds": MsprobeKey("grad_probe", True, "bounds: ascending numbers within int64's range"),
}

_MSPROBE_ONLY_TASKS = {
    "run_ut": "is msprobe's pre-check command; record with task='tensor' and run `dispatchprobe run-ut RUN` "
              "(online: `dispatchprobe run-ut --listen HOST:PORT` or `dispatchprobe run-ut NFS_PATH --follow`)",
    "acc_check": "is msprobe's pre-check command; record with task='tensor' and run `dispatchprobe run-ut RUN`",
    "structure": "is not a dispatchprobe task; level='module' with task='statistics' records the module tree",
    "exception_dump": "is Ascend's kernel exception dump; task='overflow' finds the first op making inf/nan",
}
_TASK_SECTION = {"statistics": "statistics", "tensor": "tensor", "overflow": "overflow_check",
                 "free_benchmark": "free_benchmark", "grad_probe": "grad_probe"}
_SECTION_KEYS = {      # what each msprobe section may hold (dispatchprobe's own keys included)
    "statistics": {"scope", "list", "data_mode", "summary_mode", "tensor_list", "device", "file_format"},
    "tensor": {"scope", "list", "data_mode", "summary_mode", "tensor_list", "file_format", "backward_input",
               "bench_path", "diff_nums", "online_run_ut", "nfs_path", "host", "port", "tls_path"},
    "run_ut": {"white_list", "black_list", "error_data_path", "is_online", "nfs_path", "host", "port",
               "rank_list", "tls_path", "precision"},
    "grad_probe": {"grad_level", "param_list", "bounds"},
}
_SECTION_KEYS["acc_check"] = _SECTION_KEYS["run_ut"]


def _field_names(klass) -> set[str]:
    return {f.name for f in dataclasses.fields(klass)}


def _flatten_msprobe(data: dict, task: str, notes: list[str]) -> dict:
    """msprobe's per-task sections: the one of ``task`` is lifted to the top level (its
    ``overflow_check``/``free_benchmark`` options to dispatchprobe's sections); the others configure
    another task and are dropped, as msprobe does, once their keys are known.  Ignored keys are
    dropped with a note unless their value is inert."""
    data = dict(data)
    chosen = _TASK_SECTION.get(canonical(task) if isinstance(task, str) else task)
    for name, allowed in _SECTION_KEYS.items():
        section = data.get(name)
        if not isinstance(section, dict):
            continue
        del data[name]
        for key in section:
            if key not in allowed:
                raise ConfigError(f"config: unknown key {key!r} in {name!r}; allowed: {', '.join(sorted(allowed))}")
        if name == chosen == "grad_probe":
            data["grad_probe"] = section
        elif name == chosen:
            data.update(section)
    if isinstance(data.get("overflow_check"), dict):
        data["overflow"] = {**data.get("overflow", {}), **data.pop("overflow_check")}
    if isinstance(data.get("free_benchmark"), dict):
        section = dict(data["free_benchmark"])
        for key in ("scope", "list"):
            if key in section:
                value = section.pop(key)
                if chosen == "free_benchmark":
                    data[key] = value
        data["free_benchmark"] = section
    for where in (data, data.get("overflow"), data.get("free_benchmark")):
        if isinstance(where, dict):
            _drop_ignored(where, notes)
    overflow = data.get("overflow")
    if isinstance(overflow, dict) and overflow.get("check_mode") in ("aicore", "atomic"):
        notes.append(f"config: check_mode={overflow['check_mode']!r} selects Ascend hardware units; "
                     "dispatchprobe checks every op, forward and backward (check_mode='both')")
        overflow["check_mode"] = "both"
    if "summary_mode" in data:
        mode = data.pop("summary_mode")
        _choice("summary_mode", mode, ("statistics", "md5", "xor"))
        data["checksum"] = mode != "statistics"
    if isinstance(data.get("data_mode"), str):
        data["data_mode"] = [data["data_mode"]]
    return data


def _check_regexes(key: str, entries: list, plain: str) -> None:
    """Each entry of ``key`` compiles as a regex, else one line saying how to write it."""
    for entry in entries:
        try:
            re.compile(entry)
        except re.error as exc:
            raise ConfigError(f"config: {key} entry {entry!r} is not a valid regex ({exc}); escape it "
                              f"(e.g. {re.escape(entry)!r}) or write {plain}") from None


def _validate_grad_probe(g: GradProbeConfig) -> None:
    """msprobe's checks on the grad_probe section, each failing in one line."""
    _choice("grad_level", g.grad_level, GRAD_LEVELS)
    g.param_list = _str_list("param_list", g.param_list)
    _check_regexes("param_list", g.param_list, "a parameter name")
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


def _drop_ignored(data: dict, notes: list[str]) -> None:
    for key in [k for k in data if k in MSPROBE_KEYS and not MSPROBE_KEYS[k].honoured]:
        value, row = data.pop(key), MSPROBE_KEYS[key]
        if row.inert is not ANY and value not in row.inert and value not in (None, [], {}):
            notes.append(f"config: {key}={value!r} ignored: {row.how}")


def _build_section(klass, name: str, values: dict):
    allowed = _field_names(klass)
    for key in values:
        if key not in allowed:
            raise ConfigError(f"config: unknown key {key!r} in '{name}'; allowed: {', '.join(sorted(allowed))}")
    return klass(**values)



# ---- msprobe's names in scope and list ----------------------------------------------------------

#: A torch API -> the aten ops it runs below autograd, forward and backward kernels (measured under
#: TorchDispatchMode, torch 2.13 CPU).  An API name in ``list`` selects these ops wherever they run:
#: ``torch.matmul`` selects every ``aten.mm``, also those of a linear layer's backward.
API_TO_ATEN: dict[str, tuple[str, ...]] = {
    "linear": ("addmm", "mm", "linear"),
    "matmul": ("mm", "bmm", "mv", "dot", "matmul"),
    "addmm": ("addmm", "mm"), "baddbmm": ("baddbmm", "bmm"), "einsum": ("bmm", "mm"),
    **dict.fromkeys(("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"),
                    ("convolution", "convolution_backward")),
    "softmax": ("_softmax", "_softmax_backward_data"),
    "log_softmax": ("_log_softmax", "_log_softmax_backward_data"),
    "gelu": ("gelu", "gelu_backward"), "relu": ("relu", "threshold_backward"),
    "silu": ("silu", "silu_backward"), "sigmoid": ("sigmoid", "sigmoid_backward"), "tanh": ("tanh", "tanh_backward"),
    "logsigmoid": ("log_sigmoid_forward", "log_sigmoid_backward"),
    "layer_norm": ("native_layer_norm", "native_layer_norm_backward"),
    "group_norm": ("native_group_norm", "native_group_norm_backward"),
    "batch_norm": ("native_batch_norm", "native_batch_norm_backward", r"_native_batch_norm_legit\w*",
                   r"cudnn_batch_norm\w*"),
    "embedding": ("embedding", "embedding_dense_backward"),
    "cross_entropy": ("_log_softmax", "_log_softmax_backward_data", r"nll_loss2?d?_forward", r"nll_loss2?d?_backward"),
    "nll_loss": (r"nll_loss2?d?_forward", r"nll_loss2?d?_backward"),
    "mse_loss": ("mse_loss", "mse_loss_backward"),
    "binary_cross_entropy_with_logits": ("binary_cross_entropy_with_logits",),
    "scaled_dot_product_attention": (r"_scaled_dot_product_\w+",),
    "dropout": ("native_dropout", "native_dropout_backward", "bernoulli_"),
    "square": ("pow",), "norm": ("linalg_vector_norm", "norm"), "pad": ("constant_pad_nd",),
    "max_pool2d": ("max_pool2d_with_indices", "max_pool2d_with_indices_backward"),
    "avg_pool2d": ("avg_pool2d", "avg_pool2d_backward"),
    "to": ("_to_copy",), "float": ("_to_copy",), "half": ("_to_copy",), "bfloat16": ("_to_copy",),
    "type_as": ("_to_copy",), "contiguous": ("clone",), "chunk": ("split",),
    # the aten op of the same name
    **{name: (name,) for name in (
        "mm", "bmm", "mv", "add", "sub", "mul", "div", "pow", "sqrt", "rsqrt", "exp", "log", "log1p", "abs", "neg",
        "reciprocal", "sin", "cos", "erf", "floor", "sum", "mean", "var", "std", "prod", "max", "min", "amax", "amin",
        "argmax", "maximum", "minimum", "cumsum", "cat", "stack", "split", "permute", "transpose", "masked_fill",
        "clamp", "where", "softplus", "leaky_relu", "hardtanh", "elu", "hardswish", "mish", "glu", "topk", "sort",
        "gather", "scatter", "index_select", "tril", "triu", "repeat", "zeros_like", "ones_like", "full",
        "add_", "sub_", "mul_", "div_", "copy_", "fill_", "zero_", "masked_fill_", "clamp_")},
}
_DUNDER = {"add": "add", "radd": "add", "iadd": "add_", "sub": "sub", "rsub": "rsub", "mul": "mul",
           "rmul": "mul", "imul": "mul_", "truediv": "div", "rtruediv": "div", "div": "div", "matmul": "matmul",
           "pow": "pow", "neg": "neg", "getitem": "index", "setitem": "index_put_"}

_MODULE_NAME = re.compile(r"^(?:Module|Cell)\.(?:(?P<path>.+)\.)?(?P<cls>[A-Za-z_]\w*)\."
                          r"(?P<stage>forward|backward)\.(?P<call>\d+)$")
_API_NAME = re.compile(r"^(?P<prefix>Tensor|Torch|Functional|NPU|VF|Aten|Distributed|Jit|Mint|MintFunctional|"
                       r"Primitive|torch\.nn\.functional|torch\.Tensor|torch\.ops\.aten|torch\._VF|torch|F|"
                       r"nn\.functional|mindspore(?:\.\w+)*)\.(?P<api>\w+)"
                       r"(?:\.(?P<call>\d+|default|Tensor|Scalar|out))?(?:\.(?P<stage>forward|backward))?$")
_ATEN_PREFIXES = ("Aten", "torch.ops.aten")


def _aten_pattern(ops: tuple[str, ...]) -> str:
    return r"^aten\.(" + "|".join(ops) + r")\."       # names are identifiers or regexes


def _api_ops(entry: str, m: re.Match) -> tuple[str, ...]:
    """The aten ops of one API name, or a one-line ConfigError saying how to write them."""
    prefix, api = m["prefix"], m["api"]
    if prefix in _ATEN_PREFIXES:
        return (api,)
    if api.startswith("__") and api.endswith("__"):
        api = _DUNDER.get(api.strip("_"), api.strip("_"))
    if prefix.startswith("mindspore") or prefix in ("Mint", "MintFunctional", "Primitive", "NPU", "Distributed"):
        raise ConfigError(f"config: list entry {entry!r} names a {prefix.split('.')[0]} API, which this probe does "
                          "not map; write the op name as recorded (a regex, e.g. 'allreduce' or '^npu\\\\.'), "
                          "`dispatchprobe show RUN` lists them")
    if api not in API_TO_ATEN:
        raise ConfigError(f"config: list entry {entry!r} is an API name dispatchprobe does not map to aten ops; "
                          f"write the aten op it runs instead (e.g. '{api}' or '^aten\\\\.{api}\\\\.'), "
                          "`dispatchprobe show RUN` lists the recorded names")
    return API_TO_ATEN[api]


def msprobe_scope(entries: list[str], notes: list[str], *, may_move: bool) -> tuple[list[str], list[str]]:
    """msprobe module names (``Module.<attribute path>.<Class>.<forward|backward>.<call>``) become
    ``*.<attribute path>`` (any root module); API names go to ``list`` when ``may_move`` (msprobe's
    free benchmark takes API calls in scope).  Returns (scope, entries for list)."""
    scope, to_list, mapped = [], [], []
    for entry in entries:
        m = _MODULE_NAME.match(entry)
        if m:
            scope.append(f"*.{m['path']}" if m["path"] else "*")
            mapped.append(f"{entry!r} -> {scope[-1]!r}")
        elif _API_NAME.match(entry):
            if not may_move:
                raise ConfigError(f"config: scope entry {entry!r} is an API name, not a module scope, and list is "
                                  "set too; put API names in list (their aten ops, every call)")
            to_list.append(entry)
        else:
            scope.append(entry)
    if mapped:
        pair = "; msprobe reads two names as the range between them" if len(entries) == 2 else ""
        notes.append(f"config: scope: msprobe module names read as module scopes (the module and its submodules, "
                     f"every call, forward and backward{pair}): {', '.join(mapped)}")
    if to_list:
        notes.append(f"config: scope: API names {to_list} read as list entries (every call of their aten ops; "
                     "msprobe reads two API names in scope as the range of calls between them)")
    return scope, to_list


def msprobe_list(entries: list[str], notes: list[str], *, may_move: bool) -> tuple[list[str], list[str]]:
    """msprobe API names (``Functional.linear.0.forward``, ``Tensor.add``) and torch API names
    (``torch.nn.functional.linear``) become a regex of the aten ops they run (:data:`API_TO_ATEN`);
    msprobe module names (level mix) go to ``scope`` when nothing else is in list and scope is empty.
    Other entries are aten names, substrings or regexes.  Returns (list, entries for scope)."""
    names, modules, mapped = [], [], []
    for entry in entries:
        if _MODULE_NAME.match(entry):
            modules.append(entry)
            continue
        m = _API_NAME.match(entry)
        if m:
            names.append(_aten_pattern(_api_ops(entry, m)))
            mapped.append(f"{entry!r} -> {names[-1]!r}")
        else:
            names.append(entry)
    if modules:
        if names or not may_move:
            raise ConfigError(f"config: list entry {modules[0]!r} is a module name; list and scope both filter "
                              "(an op must pass both), so put module names in scope")
        notes.append(f"config: list: module names {modules} read as scope (every op inside them)")
    if mapped:
        notes.append("config: list: API names read as the aten ops they run (every call, forward and backward, "
                     f"wherever they run): {', '.join(mapped)}")
    to_scope, _ = msprobe_scope(modules, notes, may_move=False) if modules else ([], [])
    return list(dict.fromkeys(names)), to_scope

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


_RANGE = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*(?::\s*(\d+)\s*)?$")
_SCHEDULE = re.compile(r"^\s*schedule\s*\((.*)\)\s*$")


def _int_list(key: str, value) -> list[int]:
    """Ints, ``"a-b"`` ranges, ``"a-b:stride"`` and msprobe's ``schedule(begin, end, stride)``
    (as ``{"begin": 4, "end": 10, "stride": 2}`` or the string ``"schedule(4, 10, 2)"``), sorted."""
    if isinstance(value, (int, dict, str)) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"config: {key} must be a list of integers (e.g. [0, 2], ['0-3'] or ['0-10:2']), "
                          f"got {value!r}")
    out: set[int] = set()
    for item in value:
        if isinstance(item, str) and _SCHEDULE.match(item):
            item = _schedule_args(key, _SCHEDULE.match(item)[1])
        if isinstance(item, dict):
            out.update(_schedule(key, item))
            continue
        m = _RANGE.match(item) if isinstance(item, str) else None
        if m:
            out.update(_schedule(key, {"begin": int(m[1]), "end": int(m[2]), "stride": int(m[3] or 1)}))
            continue
        if isinstance(item, bool) or not isinstance(item, int):
            try:
                item = int(item)
            except (TypeError, ValueError):
                raise ConfigError(f"config: {key} must hold integers, 'a-b' or 'a-b:stride' ranges, or "
                                  f"{{'begin', 'end', 'stride'}}, got {item!r}") from None
        if item < 0:
            raise ConfigError(f"config: {key} must hold non-negative integers, got {item}")
        out.add(item)
    return sorted(out)


def _schedule_args(key: str, text: str) -> dict:
    args: dict = {}
    for i, part in enumerate(p.strip() for p in text.split(",") if p.strip()):
        name, _, number = part.rpartition("=")
        name = name.strip() or ("begin", "end", "stride", "?")[min(i, 3)]
        if not number.strip().isdigit():
            raise ConfigError(f"config: {key}: schedule takes integers begin, end, stride, got {part!r}")
        args[name] = int(number)
    return args


def _schedule(key: str, spec: dict) -> range:
    """msprobe's schedule(begin=0, end, stride=1): begin, begin+stride, ... up to end inclusive."""
    unknown = set(spec) - {"begin", "end", "stride"}
    if unknown:
        raise ConfigError(f"config: {key}: a schedule has begin, end and stride, not {sorted(unknown)[0]!r}")
    begin, stride = spec.get("begin", 0), spec.get("stride", 1)
    if "end" not in spec:
        raise ConfigError(f"config: {key}: a schedule needs an end (steps are listed in the run manifest), e.g. "
                          f"{{'begin': {begin}, 'end': 1000, 'stride': {stride}}} or '{begin}-1000:{stride}'")
    end = spec["end"]
    for name, v in (("begin", begin), ("end", end), ("stride", stride)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"config: {key}: schedule {name} must be a non-negative integer, got {v!r}")
    if stride < 1 or end < begin:
        raise ConfigError(f"config: {key}: a schedule needs stride >= 1 and end >= begin, got {spec}")
    steps = range(begin, end + 1, stride)
    if len(steps) > MAX_STEPS:
        raise ConfigError(f"config: {key}: {len(steps)} steps; at most {MAX_STEPS} can be listed")
    return steps


def _str_list(key: str, value) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"config: {key} must be a list of strings, got {value!r}")
    return list(value)
