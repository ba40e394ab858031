"""{{title}}

Written by `dispatchprobe repro`; needs only PyTorch (no dispatchprobe).  It re-runs the one recorded
op call on the recorded device with its saved inputs (inputs.safetensors, beside this file) in the
recorded dtypes, then the same call on the CPU with floating inputs in float64, and prints the
device result's error against the float64 one.

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
# ---- end of the recorded call ----

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


def leaves(value, name="output"):
    if isinstance(value, (tuple, list)):
        return [leaf for i, v in enumerate(value) for leaf in leaves(v, f"{name}.{i}")]
    return [(name if name != "output" else "output.0", value)]


def judge(d, b):
    """(verdict, the numbers) of one output against float64, by the rule run-ut judges this op's outputs
    with (RULE["category"], thresholds of the recorded dtype): inf/nan where float64 has none (or the
    other way) is an error under every rule; integer and bool outputs must be equal."""
    if not isinstance(d, torch.Tensor):
        d, b = torch.tensor(d), torch.tensor(b)
    d, b = d.detach().cpu(), b.detach().cpu()
    if not (d.is_floating_point() or d.is_complex()):
        bad = int((d != b.to(d.dtype)).sum())
        return ("pass" if bad == 0 else "error"), f"{bad} of {d.numel()} elements differ (binary rule)"
    d, b = d.to(torch.complex128 if d.is_complex() else torch.float64), b.to(d.dtype if d.is_complex() else
                                                                               torch.float64)
    finite_d, finite_b = torch.isfinite(d), torch.isfinite(b)
    mismatch = int((finite_d != finite_b).sum() + ((~finite_d & ~finite_b) & (d != b) & ~(d.isnan() & b.isnan())).sum())
    both = finite_d & finite_b
    d, b = d[both], b[both]
    err = (d - b).abs()
    mag = b.abs()
    max_abs = float(err.max()) if err.numel() else 0.0
    rel = err / mag.clamp(min=RULE["small_value"])
    nd, nb = float(d.abs().square().sum().sqrt()), float(b.abs().square().sum().sqrt())
    cosine = float((d * b.conj()).real.sum() / (nd * nb)) if nd and nb else (1.0 if nd == nb else float("nan"))
    tiers = RULE["tiers"]
    shares = {tol: float((rel <= tol).double().mean()) if rel.numel() else 1.0 for tol in tiers}
    text = (f"max abs error {max_abs:.6g}, max rel error {float(rel.max()) if rel.numel() else 0.0:.6g}, "
            f"cosine {cosine:.6f}, inf/nan mismatches {mismatch}, within relative error "
            + ", ".join(f"{tol:g}: {share:.4%}" for tol, share in shares.items())
            + ("" if err.numel() else " (no element is finite on both sides)"))
    rule = RULE["category"]
    if mismatch:
        return "error", text
    if rule == "binary":
        bad = int((err > 0).sum())
        return ("pass" if bad == 0 else "error"), text + f"; {bad} elements differ"
    if rule == "absolute_threshold":
        small = mag < RULE["small_value"]
        rel_rate = float((rel[~small] > RULE["relative_limit"]).double().mean()) if (~small).any() else 0.0
        abs_rate = float((err[small] > RULE["small_value_atol"]).double().mean()) if small.any() else 0.0
        text += f"; relative error rate {rel_rate:.3g}, small-value error rate {abs_rate:.3g}"
        return ("error" if rel_rate > 0 or abs_rate > 0 else "pass"), text
    if rule == "ulp":
        info = torch.finfo(getattr(torch, RULE["dtype"]) if RULE["dtype"] in ("float16", "bfloat16", "float64")
                           else torch.float32)
        mantissa, min_exp = round(-math.log2(info.eps)), round(math.log2(info.tiny))
        exponent = torch.floor(torch.log2(mag))
        exponent = torch.where(torch.isfinite(exponent), exponent, torch.full_like(exponent, min_exp)).clamp(min=min_exp)
        ulp = err / torch.exp2(exponent - mantissa)
        over = float((ulp > RULE["ulp_threshold"]).double().mean()) if ulp.numel() else 0.0
        mean = float(ulp.mean()) if ulp.numel() else 0.0
        text += f"; ULP mean {mean:.3g}, share over {RULE['ulp_threshold']:g} ULP {over:.3g}"
        u = RULE["ulp"]
        if RULE["dtype"] in ("float16", "bfloat16"):
            return ("pass" if over < u["half_over_threshold"] else "error"), text
        return ("pass" if mean < u["float32_ulp_mean"] or over < u["float32_over_threshold"] else "error"), text
    if rule == "thousandth":
        tol = RULE["thousandth_tolerance"]
        share = float((rel <= tol).double().mean()) if rel.numel() else 1.0
        return ("pass" if share > RULE["thousandth_min"] or not rel.numel() else "error"), text
    if not math.isnan(cosine) and cosine <= RULE["cosine_min"]:
        return "error", text
    if math.isnan(cosine) and max_abs >= RULE["max_abs_pass"]:
        return "error", text + " (one side is all zeros)"
    if max_abs < RULE["max_abs_pass"]:
        return "pass", text
    for (tol, share), verdict in zip(shares.items(), ("error", "warning")):
        if share < 1 - tol:
            return verdict, text
    return "pass", text


_RULE_KEYS = {"benchmark": ("cosine_min", "max_abs_pass", "tiers"), "ulp": ("ulp_threshold", "ulp"), "binary": (),
              "absolute_threshold": ("small_value", "small_value_atol", "relative_limit"),
              "thousandth": ("thousandth_min", "thousandth_tolerance")}


def rule_text():
    """The rule and the thresholds it used, for the verdict line."""
    used = {k: RULE[k] for k in _RULE_KEYS.get(RULE["category"], _RULE_KEYS["benchmark"])}
    return f"run-ut's {RULE['category']} rule for {RULE['dtype']}: {json.dumps(used)}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=DEVICE, help=f"device of the recorded-dtype run (recorded: {DEVICE})")
    device = torch.device(ap.parse_args().device)
    sys.path.insert(0, HERE)
    for name in PRELUDES:          # the user's own kernels (torch.library), copied beside this script
        __import__(name)
    if device.type != "cpu" and not getattr(torch, device.type).is_available():
        print(f"this machine has no {device.type} device: run with --device cpu (or where it was recorded)")
        return 1
    ns, name, overload = OP.split(".")
    try:
        func = getattr(getattr(getattr(torch.ops, ns), name), overload)
    except (AttributeError, RuntimeError):
        print(f"{OP} does not exist in this torch ({torch.__version__}): a custom op needs the module that "
              "defines it (dispatchprobe repro --prelude FILE)")
        return 1
    tensors = load_inputs(os.path.join(HERE, "inputs.safetensors"))
    keep = written(func)
    with torch.no_grad():
        try:
            dev = leaves(call(func, tensors, device))
        except Exception as exc:          # the op's own failure on the device
            print(f"{OP} failed on {device}: {type(exc).__name__}: {exc}")
            return 1
        bench = None
        # as run-ut: written arguments keep their dtype (the result is stored in it), unless the kernel
        # then refuses the mix; dtype arguments widened where the kernel insists they match its inputs
        for keep_written, wide_dtypes in ((keep, False), (keep, True), ((), True)):
            try:
                bench = leaves(call(func, tensors, torch.device("cpu"), True, keep_written, wide_dtypes))
                break
            except Exception as exc:
                failure = f"{type(exc).__name__}: {exc}"
        if bench is None:
            print(f"{OP} could not run in float64 on the CPU ({failure}): no benchmark, not judged")
            return 1
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
    print(f"{OP} on {device} ({', '.join(dtypes) or 'no tensor inputs'}) against float64 on the CPU, torch "
          f"{torch.__version__}")
    worst = []
    for (out_name, d), (_, b) in zip(dev, bench):
        if d is None and b is None:
            continue
        verdict, text = judge(d, b)
        kind = f"{str(d.dtype).removeprefix('torch.')} {list(d.shape)}" if isinstance(d, torch.Tensor) else type(d).__name__
        print(f"  {out_name} {kind}: {verdict}: {text}")
        worst.append(verdict)
    if "error" in worst:
        print(f"differs from float64: error ({rule_text()})")
        return 2
    print("agrees with float64" + (" (a warning: the finer relative-error share is not met)" if "warning" in worst
                                   else "") + f" ({rule_text()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
