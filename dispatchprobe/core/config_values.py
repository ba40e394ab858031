"""The one-line checks of config values, shared by the config and msprobe's translation.

Each reader takes a key and its value and returns the value normalised (step ranges and schedules
as sorted ints) or raises :class:`ConfigError` in one line naming the key and what is allowed.
"""

from __future__ import annotations

import difflib
import re

MAX_STEPS = 1_000_000       # a step range/schedule may list at most this many steps


class ConfigError(ValueError):
    """A config that cannot work; the message names the key and the allowed values."""


class ConfigWarning(UserWarning):
    """A config key or value read differently from msprobe (ignored, or mapped): one line each."""


def unknown_key(key, allowed, where: str = "") -> ConfigError:
    """The error of a key no section knows: the nearest allowed key when one is close (a misspelling),
    else every allowed key."""
    place = f" in {where!r}" if where else ""
    near = difflib.get_close_matches(str(key), sorted(allowed), n=1, cutoff=0.6)
    if near:
        return ConfigError(f"config: unknown key {key!r}{place}; did you mean {near[0]!r}?")
    return ConfigError(f"config: unknown key {key!r}{place}; allowed keys: {', '.join(sorted(allowed))}")


def choice(key: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"config: {key}={value!r} is not allowed; choose one of: {', '.join(allowed)}")


def check_type(key: str, value, klass) -> None:
    if not isinstance(value, klass) or (klass is int and isinstance(value, bool)):
        raise ConfigError(f"config: {key} must be {klass.__name__}, got {value!r}")


_RANGE = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*(?::\s*(\d+)\s*)?$")
_SCHEDULE = re.compile(r"^\s*schedule\s*\((.*)\)\s*$")


def int_list(key: str, value) -> list[int]:
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


def str_list(key: str, value) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"config: {key} must be a list of strings, got {value!r}")
    return list(value)


def check_regexes(key: str, entries: list, plain: str) -> None:
    """Each entry of ``key`` compiles as a regex, else one line saying how to write it."""
    for entry in entries:
        try:
            re.compile(entry)
        except re.error as exc:
            raise ConfigError(f"config: {key} entry {entry!r} is not a valid regex ({exc}); escape it "
                              f"(e.g. {re.escape(entry)!r}) or write {plain}") from None

