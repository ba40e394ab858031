"""The shipped precision standards, ``data/*.yaml`` (numbers live there, not in code), and dtype names."""

from __future__ import annotations

import functools
import os

import yaml

FLOAT_TYPES = ("float16", "bfloat16", "float32", "float64")


# libyaml's parser where PyYAML has it (the same safe constructors, a tenth of the pure-Python parser's time)
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@functools.cache
def standard(name: str = "standards") -> dict:
    """The parsed ``data/{name}.yaml`` (read once)."""
    with open(os.path.join(os.path.dirname(__file__), "data", f"{name}.yaml"), encoding="utf-8") as fh:
        return yaml.load(fh, Loader=_SAFE_LOADER)


def per_dtype(table, dtype: str, name: str = "standards"):
    """``dtype``'s value in a per-dtype table, else the table's ``default``.  ``table``: the
    table itself, or its key in standard ``name`` (dotted for a nested one: ``benchmark.tiers``)."""
    if isinstance(table, str):
        values = standard(name)
        for key in table.split("."):
            values = values[key]
        table = values
    return table.get(short_dtype(dtype), table["default"])


def short_dtype(dtype: str) -> str:
    """``torch.float16`` / ``Float16`` / ``half`` -> ``float16`` (each name worked out once: asked
    for every tensor of the rows compare judges)."""
    try:
        return _SHORT[dtype]
    except (KeyError, TypeError):
        pass
    name = str(dtype).rsplit(".", 1)[-1].lower()
    name = {"half": "float16", "float": "float32", "double": "float64", "bf16": "bfloat16"}.get(name, name)
    try:
        _SHORT[dtype] = name
    except TypeError:      # an unhashable name: answered, not kept
        pass
    return name


_SHORT: dict = {}


def is_float(dtype: str) -> bool:
    return short_dtype(dtype) in FLOAT_TYPES
