"""{{title}}

Written by `dispatchprobe repro`; needs only PyTorch (no dispatchprobe).  It re-runs the one recorded
op call on the recorded device with its saved inputs (inputs.safetensors, beside this file) in the
recorded dtypes, then the same call on the CPU with floating inputs in float64, and prints the
device result's error against the float64 one; then that of the outputs the training process
computed (outputs.safetensors, where they were saved) against the same float64 run.

    python repro.py                 # on the recorded device ({{device}})
    python repro.py --device cpu    # elsewhere

Exit code: 0 the result agrees with float64, 2 it does not, 1 the call could not be run.
"""

import argparse
import json
import math
import os
import struct
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
# ---- the recorded call (filled in by dispatchprobe repro) ----
OP = {{op}}
DEVICE = {{device_literal}}
CALL = json.loads({{call}})
PRELUDES = {{preludes}}
RULE = json.loads({{rule}})
# the outputs the training process computed (outputs.safetensors): output -> its dtype and shape
RECORDED = json.loads({{recorded}})
# ---- end of the recorded call ----
FRAMEWORK = f"torch {torch.__version__}"
xp = torch              # the array module the driver judges with

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}
for _code, _name in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("U16", "uint16"),
                     ("U32", "uint32"), ("U64", "uint64"), ("C64", "complex64")):
    if hasattr(torch, _name):
        _ST_DTYPES[_code] = getattr(torch, _name)


def load_inputs(path):
    """The tensors of a safetensors file, read with torch alone (8-byte header size, JSON header,
    raw little-endian bytes); a dtype safetensors has no code for is named in the metadata."""
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
        data = bytearray(f.read())
    meta = header.pop("__metadata__", None) or {}
    out = {}
    for key, info in header.items():
        start, end = info["data_offsets"]
        t = torch.frombuffer(data, dtype=_ST_DTYPES[info["dtype"]], count=(end - start) // _ST_DTYPES[
            info["dtype"]].itemsize, offset=start) if end > start else torch.empty(0, dtype=_ST_DTYPES[info["dtype"]])
        t = t.reshape(info["shape"]).clone()
        real = json.loads(meta[key]) if key in meta else None
        if real is not None and real.get("dtype"):
            dtype = getattr(torch, real["dtype"])
            t = torch.view_as_complex(t) if dtype.is_complex and t.dtype != torch.uint8 else t.view(dtype)
            t = t.reshape(real["shape"])
        if real is not None and real.get("view"):
            v = real["view"]
            t = t.reshape(-1).as_strided(v["shape"], v["stride"], v["offset"]).clone()
        out[key] = t
    return out


def restride(t, stride):
    """``t``'s values in the recorded layout (some kernels depend on it)."""
    if stride is None or t.dim() == 0 or len(stride) != t.dim() or list(t.stride()) == list(stride) or t.numel() <= 1:
        return t
    if any(s == 0 for s, n in zip(stride, t.shape) if n > 1):       # an expanded (broadcast) view
        v = t
        for d, (s, n) in enumerate(zip(stride, t.shape)):
            if s == 0 and n > 1:
                v = v.narrow(d, 0, 1)
        return v.contiguous().expand(t.shape)
    out = torch.empty_strided(tuple(t.shape), tuple(stride), dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


_FORMATS = {"contiguous_format": torch.contiguous_format, "channels_last": torch.channels_last,
            "channels_last_3d": torch.channels_last_3d, "preserve_format": torch.preserve_format}


def decode(spec, path, tensors, device, bench, keep, wide_dtypes):
    """One recorded argument: on ``device`` as recorded, or (``bench``) on the CPU in float64; ``keep``:
    an argument the op writes keeps its dtype there; ``wide_dtypes``: dtype arguments in float64 too."""
    kind = spec.get("type")
    if kind == "tensor":
        if spec.get("undefined"):       # uninitialised memory: any contents do; zeros on both sides
            t = torch.zeros(spec["shape"], dtype=getattr(torch, spec["dtype"]))
        else:
            t = tensors[path]
        if bench and not keep and t.is_floating_point():
            t = t.to(torch.float64)
        elif bench and not keep and t.is_complex():
            t = t.to(torch.complex128)
        else:
            t = t.to(device if not bench else "cpu", copy=True)
        return restride(t, spec.get("stride"))
    if kind == "none":
        return None
    if kind in ("bool", "int", "str", "symint", "symbool"):
        return spec["value"]
    if kind in ("float", "symfloat"):
        return float(spec["value"])
    if kind == "complex":
        return complex(*spec["value"])
    if kind in ("list", "tuple"):
        items = [decode(v, f"{path}.{i}", tensors, device, bench, keep, wide_dtypes)
                 for i, v in enumerate(spec["value"])]
        return items if kind == "list" else tuple(items)
    if kind == "dtype":
        dtype = getattr(torch, spec["value"])
        return torch.float64 if wide_dtypes and dtype.is_floating_point else dtype
    if kind == "device":
        return torch.device("cpu") if bench else device
    if kind == "memory_format":
        return _FORMATS.get(spec["value"], torch.preserve_format)
    if kind == "layout":
        return torch.strided
    raise SystemExit(f"{path} ({spec.get('repr', kind)}) cannot be rebuilt from the record")


def written(func):
    """Arguments the op writes (``self`` of ``add_``, ``out=``), by position and by name."""
    return [(i, a.name) for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write]


def call(func, tensors, device, bench=False, keep=(), wide_dtypes=False):
    """The recorded call on ``device``, or (``bench``) in float64 on the CPU, the written arguments in
    ``keep`` left in their dtype; returns what it computed (an op returning nothing: what it wrote)."""
    kept = {x for pair in keep for x in pair}
    args = [decode(s, f"input.{i}", tensors, device, bench, i in kept, wide_dtypes)
            for i, s in enumerate(CALL["inputs"])]
    kwargs = {k: decode(s, f"input.{k}", tensors, device, bench, k in kept, wide_dtypes)
              for k, s in CALL["kwargs"].items()}
    out = func(*args, **kwargs)
    if out is None and not func._schema.returns:
        out = tuple(args[i] if i < len(args) else kwargs.get(name) for i, name in written(func))
        out = out[0] if len(out) == 1 else out
    return out


def prepare(wanted):
    """(device, the op, where the benchmark runs); CannotRun where this machine or torch lacks them."""
    device = torch.device(wanted)
    if device.type != "cpu" and not getattr(torch, device.type).is_available():
        raise CannotRun(f"this machine has no {device.type} device: run with --device cpu (or where it was recorded)")
    ns, name, overload = OP.split(".")
    try:
        func = getattr(getattr(getattr(torch.ops, ns), name), overload)
    except (AttributeError, RuntimeError):
        raise CannotRun(f"{OP} does not exist in this torch ({torch.__version__}): a custom op needs the module "
                        "that defines it (dispatchprobe repro --prelude FILE)") from None
    return device, func, "on the CPU"


def run_device(func, tensors, device):
    with torch.no_grad():
        return call(func, tensors, device)


def run_benchmark(func, tensors):
    """The call in float64 on the CPU.  As run-ut: written arguments keep their dtype (the result is
    stored in it), unless the kernel then refuses the mix; dtype arguments widened where the kernel
    insists they match its inputs."""
    keep = written(func)
    with torch.no_grad():
        for keep_written, wide_dtypes in ((keep, False), (keep, True), ((), True)):
            try:
                return call(func, tensors, torch.device("cpu"), True, keep_written, wide_dtypes)
            except Exception as exc:
                failure = f"{type(exc).__name__}: {exc}"
    raise CannotRun(failure)


def input_dtypes(tensors):
    return sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})


def host_pair(d, b):
    """(device result, benchmark, exact) on the CPU: floating results in float64 (complex128), integer
    and bool ones (``exact``) with the benchmark in the device's dtype."""
    if not isinstance(d, torch.Tensor):
        d, b = torch.tensor(d), torch.tensor(b)
    d, b = d.detach().cpu(), b.detach().cpu()
    if not (d.is_floating_point() or d.is_complex()):
        return d, b.to(d.dtype), True
    wide = torch.complex128 if d.is_complex() else torch.float64
    return d.to(wide), b.to(wide), False


def describe(d):
    return f"{str(d.dtype).removeprefix('torch.')} {list(d.shape)}" if isinstance(d, torch.Tensor) else type(d).__name__
{{driver}}