"""{{title}}

Written by `dispatchprobe repro`; needs only MindSpore and numpy (no dispatchprobe).  It re-runs the
one recorded primitive call with its saved inputs (inputs.safetensors, beside this file) in the
recorded dtypes, then the same call with floating inputs in float64, both with MindSpore on the
recorded device target, and prints the recorded-dtype result's error against the float64 one; then
that of the outputs the training process computed (outputs.safetensors, where they were saved)
against the same float64 run.

    python repro.py                 # on the recorded device ({{device}})
    python repro.py --device cpu    # elsewhere

Exit code: 0 the result agrees with float64, 2 it does not, 1 the call could not be run.
"""

import argparse
import importlib
import json
import math
import os
import struct
import sys

import mindspore as ms
import numpy as np
from mindspore import _c_expression
from mindspore.ops.primitive import _run_op

HERE = os.path.dirname(os.path.abspath(__file__))
# ---- the recorded call (filled in by dispatchprobe repro) ----
OP = {{op}}
DEVICE = {{device_literal}}
CALL = json.loads({{call}})
# the primitive's class and call form, as run-ut's MindSpore replay calls it
FORM = json.loads({{form}})
PRELUDES = {{preludes}}
RULE = json.loads({{rule}})
# the outputs the training process computed (outputs.safetensors): output -> its dtype and shape
RECORDED = json.loads({{recorded}})
# ---- end of the recorded call ----
FRAMEWORK = f"MindSpore {ms.__version__}"
xp = np                 # the array module the driver judges with

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
              "I16": np.int16, "I8": np.int8, "U8": np.uint8, "U16": np.uint16, "U32": np.uint32, "U64": np.uint64,
              "BOOL": np.bool_}
_TARGETS = {"cpu": "CPU", "npu": "Ascend", "ascend": "Ascend", "gpu": "GPU", "cuda": "GPU"}
_FLOATS = ("float16", "bfloat16", "float32")


def load_inputs(path):
    """The arrays of a safetensors file, read with numpy alone (8-byte header size, JSON header, raw
    little-endian bytes); bfloat16 as float32 (exact: numpy has no bfloat16)."""
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
        data = f.read()
    meta = header.pop("__metadata__", None) or {}
    out = {}
    for key, info in header.items():
        start, end = info["data_offsets"]
        raw = np.frombuffer(data[start:end], dtype=np.uint16 if info["dtype"] == "BF16" else _ST_DTYPES[info["dtype"]])
        a = (raw.astype(np.uint32) << 16).view(np.float32) if info["dtype"] == "BF16" else raw.copy()
        a = a.reshape(info["shape"])
        real = json.loads(meta[key]) if key in meta else None
        if real is not None and real.get("dtype"):
            a = a.view(np.dtype(real["dtype"])).reshape(real["shape"])
        if real is not None and real.get("view"):
            v = real["view"]
            flat = np.ascontiguousarray(a).reshape(-1)[v["offset"]:]
            a = np.lib.stride_tricks.as_strided(flat, v["shape"], [s * flat.itemsize for s in v["stride"]]).copy()
        out[key] = a
    return out


def decode(spec, path, tensors, bench):
    """One recorded argument as the replay builds it: a tensor in its recorded dtype, or (``bench``)
    floating tensors in float64."""
    kind = spec.get("type")
    if kind == "tensor":
        values = tensors[path] if not spec.get("undefined") else np.zeros(spec["shape"], np.float32)
        dtype = "float64" if bench and spec["dtype"] in _FLOATS else spec["dtype"]
        values = np.asarray(values, np.float64) if dtype == "float64" else values
        return ms.Tensor(np.ascontiguousarray(values)).astype(getattr(ms, dtype))
    if kind == "none":
        return None
    if kind in ("bool", "int", "str", "float"):
        return spec["value"]
    if kind in ("list", "tuple"):
        items = [decode(v, f"{path}.{i}", tensors, bench) for i, v in enumerate(spec["value"])]
        return items if kind == "list" else tuple(items)
    if kind == "dtype":
        return getattr(ms, spec["value"])
    raise SystemExit(f"{path} ({spec.get('repr', kind)}) cannot be rebuilt from the record")


def call(cls, tensors, bench):
    """The recorded call: a pyboost op through its ``pyboost_<name>`` function (dtypes as type ids),
    a legacy one through ``_run_op`` with the primitive built from the recorded attributes."""
    attrs = {k: decode(v, f"input.{k}", tensors, False) for k, v in CALL["kwargs"].items()}
    prim = cls(**attrs) if attrs else cls()
    args = [decode(s, f"input.{i}", tensors, bench) for i, s in enumerate(CALL["inputs"])]
    if FORM["pyboost"] and not attrs:
        from mindspore.ops.auto_generate.gen_ops_prim import dtype_to_type_id
        positions = set(FORM["dtype_positions"])
        return getattr(_c_expression, FORM["pyboost"])(prim, [
            dtype_to_type_id("Cast", "dtype", a) if i in positions and isinstance(a, ms.dtype.Type) else a
            for i, a in enumerate(args)])
    return _run_op(prim, OP, tuple(args))


def prepare(wanted):
    """(device target, the primitive class, where the benchmark runs); CannotRun where this machine or
    MindSpore lacks them."""
    target = _TARGETS.get(wanted.split(":")[0].lower(), wanted)
    try:
        ms.set_context(mode=ms.PYNATIVE_MODE)
        ms.set_device(target) if hasattr(ms, "set_device") else ms.set_context(device_target=target)
    except Exception:
        raise CannotRun(f"this machine has no {wanted} device: run with --device cpu (or where it was recorded)") \
            from None
    try:
        cls = getattr(importlib.import_module(FORM["module"]), FORM["class"])
    except (ImportError, AttributeError):
        raise CannotRun(f"{OP} does not exist in this MindSpore ({ms.__version__})") from None
    return target, cls, f"on {target}"


def run_device(cls, tensors, device):
    return call(cls, tensors, False)


def run_benchmark(cls, tensors):
    try:
        return call(cls, tensors, True)
    except Exception as exc:      # no float64 kernel for this primitive here
        raise CannotRun(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}") from None


def input_dtypes(tensors):
    specs, found = list(CALL["inputs"]) + list(CALL["kwargs"].values()), set()
    while specs:
        spec = specs.pop()
        if spec.get("type") == "tensor":
            found.add(spec["dtype"])
        elif spec.get("type") in ("list", "tuple"):
            specs.extend(spec["value"])
    return sorted(found)


def _host(t):
    if isinstance(t, ms.Tensor):
        return (t.astype(ms.float32) if t.dtype == ms.bfloat16 else t).asnumpy()
    return np.asarray(t)


def host_pair(d, b):
    """(result, benchmark, exact) as numpy: floating results in float64 (complex128), integer and
    bool ones (``exact``) with the benchmark in the result's dtype."""
    d, b = _host(d), _host(b)
    if d.dtype.kind not in "fc":
        return d, b.astype(d.dtype), True
    wide = np.complex128 if d.dtype.kind == "c" or b.dtype.kind == "c" else np.float64
    return d.astype(wide), b.astype(wide), False


def describe(d):
    if isinstance(d, ms.Tensor):
        return f"{str(d.dtype).lower()} {list(d.shape)}"
    return type(d).__name__
{{driver}}
