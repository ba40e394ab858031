"""The MindSpore replayer of run-ut: one recorded primitive call rebuilt and run in its recorded
dtypes ("device") and with float64 inputs ("benchmark"), both with MindSpore on this machine.

pyboost ops run through their ``pyboost_<name>`` function, legacy ones through ``_run_op`` with a
primitive built from the recorded attributes.  A primitive without a float64 kernel on the CPU
is skipped with that reason (no silent downgrade of the benchmark).
"""

from __future__ import annotations

import functools
import zlib

import mindspore as ms
import numpy as np
from mindspore import _c_expression
from mindspore.ops.primitive import _run_op

from dispatchprobe.core import op_traits
from dispatchprobe.offline.replayer import Output, Replayed, Replayer, ReplayError, Skip
from dispatchprobe.offline.translate import Translation

from . import ops
from .tensor_backend import dtype_of, host, tensor

_FLOATS = ("float16", "bfloat16", "float32")


def _callable(record: dict):
    """(function of the inputs, whether attributes are the kwargs) for the recorded primitive."""
    name = record["op"]
    cls = ops.primitive_class(name)
    if cls is None:
        raise Skip(f"primitive {name} does not exist in this MindSpore ({ms.__version__})")
    form = ops.pyboost_form(name)
    attrs = {k: _value(v, False, "") for k, v in (record.get("kwargs") or {}).items()}
    try:
        prim = cls(**attrs) if attrs else cls()
    except Exception as exc:  # noqa: BLE001 - a constructor that needs arguments the record lacks
        raise Skip(f"{name}: cannot build the primitive ({type(exc).__name__}: {exc})") from None
    if form is not None and not attrs:
        fn, positions = getattr(_c_expression, form[0]), form[1]
        return lambda args: fn(prim, [ops.dtype_to_id(a) if i in positions and isinstance(a, ms.dtype.Type) else a
                                      for i, a in enumerate(args)])
    return lambda args: _run_op(prim, name, tuple(args))


def call_form(record: dict) -> dict:
    """How ``dispatchprobe repro``'s script calls the recorded primitive, from the lookup the replay
    uses (:func:`ops.primitive_class`, :func:`ops.pyboost_form`): the class by module and name, its
    ``pyboost_<name>`` function and dtype positions (None: ``_run_op``).  ValueError in one line for
    a primitive that cannot be called again."""
    name = record["op"]
    if ops.is_random(name) or op_traits.base_name(name) in op_traits.RANDOM:
        raise ValueError(f"{record['name']} is a random op ({name}): its output cannot be reproduced from its inputs")
    cls = ops.primitive_class(name)
    if cls is None:
        raise ValueError(f"{record['name']}: primitive {name} does not exist in this MindSpore ({ms.__version__})")
    form = ops.pyboost_form(name)
    return {"module": cls.__module__, "class": cls.__name__, "pyboost": form[0] if form else None,
            "dtype_positions": list(form[1]) if form else []}


def _value(spec, bench: bool, path: str, source=None, record=None, random=False):
    kind = spec.get("type")
    if kind == "tensor":
        if random:
            st = spec.get("stats") or {"min": -1.0, "max": 1.0}
            rng = np.random.default_rng(zlib.crc32(f"{record['name']}:{path}".encode()))
            values = rng.uniform(st["min"], st["max"], size=spec["shape"]) if spec["dtype"] != "bool" \
                else rng.integers(0, 2, size=spec["shape"]).astype(bool)
        elif spec.get("data") is None and spec.get("no_values"):
            raise Skip(f"{path} has no values: {spec['no_values']}")
        elif spec.get("data") is None:
            raise Skip(f"{path} was not saved (statistics-only records: replay them with --random)")
        else:
            values = np.asarray(source.tensor(spec["data"])).reshape(spec["shape"])
        dtype = "float64" if bench and spec["dtype"] in _FLOATS else spec["dtype"]
        return tensor(np.asarray(values, dtype=np.float64) if dtype == "float64" else values, dtype)
    if kind == "none":
        return None
    if kind in ("bool", "int", "str", "float"):
        return spec["value"]
    if kind in ("list", "tuple"):
        items = [_value(v, bench, f"{path}.{i}", source, record, random) for i, v in enumerate(spec["value"])]
        return items if kind == "list" else tuple(items)
    if kind == "dtype":
        return getattr(ms, spec["value"])
    raise Skip(f"{path} ({spec.get('repr', kind)}) cannot be rebuilt from the record")


def _outputs(value) -> list:
    flat = value if isinstance(value, (tuple, list)) else (value,)
    return [(f"output.{i}", v) for i, v in enumerate(flat)]


def replay(record: dict, source, device, random: bool = False, keep_data: bool = False) -> Replayed:
    """Run the recorded call in its dtypes and with float64 inputs; outputs as numpy."""
    name = record["op"]
    if ops.is_random(name) or op_traits.base_name(name) in op_traits.RANDOM:
        raise Skip(f"random op ({name}): its output cannot be replayed deterministically")
    if "inputs" not in record:
        raise Skip("inputs were not recorded (io filter)")
    run = _callable(record)
    specs = record.get("inputs") or []
    result = Replayed(written=ops.writes_first(name))
    outs = {}
    for bench in (False, True):
        args = [_value(s, bench, f"input.{i}", source, record, random) for i, s in enumerate(specs)]
        if keep_data and not bench:
            result.data.update({f"input.{i}": host(a) for i, a in enumerate(args) if isinstance(a, ms.Tensor)})
        try:
            outs[bench] = _outputs(run(args))
        except Skip:
            raise
        except Exception as exc:  # noqa: BLE001 - the op's own failure
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            if not bench:
                raise ReplayError(f"device run failed: {why}") from None
            outs[bench], unmapped = _torch_benchmark(record, args)
            result.note = f"benchmark: the mapped torch op in float64 (MindSpore has no float64 {name} kernel here)"
            if outs[bench] is None:
                raise Skip(f"no float64 {name} kernel on {ms.get_context('device_target')} ({why}) and "
                           f"{unmapped}") from None
    if not result.note:       # a reduction's terms: the float64 run on |inputs| ("magnitude") or on ones ("count")
        result.terms = lambda kind="magnitude": _terms(run, specs, source, record, random, kind)
    bench_of = dict(outs[True])
    for out_name, d in outs[False]:
        b = bench_of.get(out_name)
        if not isinstance(d, ms.Tensor) or not isinstance(b, (ms.Tensor, np.ndarray)):
            continue
        dn, bn = host(d), host(b) if isinstance(b, ms.Tensor) else b
        result.outputs.append(Output(out_name, _widened(dn), _widened(bn),
                                     dtype_of(d), dtype_of(b) if isinstance(b, ms.Tensor) else str(bn.dtype),
                                     tuple(d.shape)))
        if keep_data:
            result.data[f"{out_name}.device"], result.data[f"{out_name}.bench"] = np.array(dn), np.array(bn)
    return result


def _widened(a: np.ndarray) -> np.ndarray:
    """Floating values in float64: numpy's own floats and MindSpore's bfloat16 (ml_dtypes, kind "V")."""
    return np.asarray(a, dtype=np.float64) if a.dtype.kind == "f" or a.dtype.name == "bfloat16" else a


def _terms(run, specs: list, source, record: dict, random: bool, kind: str) -> dict:
    """{output name: float64 array} of the primitive run in float64 on the absolute values of its
    floating inputs, or on ones: per output element, the magnitude (or number) of its terms."""
    def term(a):
        if not isinstance(a, ms.Tensor) or dtype_of(a) != "float64":
            return a
        x = np.abs(host(a)) if kind == "magnitude" else np.ones(tuple(a.shape))
        return tensor(np.asarray(x, dtype=np.float64), "float64")
    args = [term(_value(s, True, f"input.{i}", source, record, random)) for i, s in enumerate(specs)]
    return {name: np.asarray(host(v), dtype=np.float64) for name, v in _outputs(run(args)) if isinstance(v, ms.Tensor)}


_translation = functools.cache(lambda: Translation.shipped("mindspore"))   # read once, when first needed


def _torch_benchmark(record: dict, args: list):
    """``([(output name, float64 numpy)], None)`` of the aten op the shipped translation maps the
    primitive to, run by torch in float64 on the same inputs; ``(None, why not)`` when torch is
    missing, nothing is mapped, or the mapped op cannot be called from the inputs alone (the
    translation pairs tensors for compare; an op needing more, such as batch norm's
    training/momentum/eps, is not replayed from it)."""
    try:
        import torch
    except ImportError:
        return None, "torch, which replays mapped ops, is not importable"
    spec = _translation().ops.get(record["op"])
    positions = spec.get("inputs", list(range(len(args)))) if spec else [None]
    if spec is None or None in positions or any(not isinstance(args[p], ms.Tensor) for p in positions):
        return None, "no torch op mapped to it"
    _, name, overload = spec["op"].split(".")
    try:
        out = getattr(getattr(torch.ops.aten, name), overload)(
            *(torch.from_numpy(np.array(host(args[p]))) for p in positions))
    except Exception as exc:  # noqa: BLE001 - the mapping's limit, not the op's error
        return None, f"the mapped {spec['op']} cannot run from its inputs alone ({str(exc).splitlines()[0][:80]})"
    out = out if isinstance(out, (tuple, list)) else (out,)
    mapped = spec.get("outputs") or list(range(len(out)))
    return [(f"output.{i}", out[k].numpy()) for k, i in enumerate(mapped) if i is not None and k < len(out)], None


def resolve_device(name: str | None):
    target = ms.get_context("device_target")
    if name not in (None, target.lower(), target):
        raise ValueError(f"device {name!r}: MindSpore here runs on {target}; replay on another device needs "
                         "a MindSpore built for it")
    return target


# saved tensors read as numpy, MindSpore's thread pool fixed at start, no launcher: the defaults
REPLAYER = Replayer("mindspore", replay=replay, resolve_device=resolve_device, seed_rule="mindspore_benchmark",
                    call_form=call_form)
