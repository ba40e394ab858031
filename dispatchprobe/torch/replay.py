"""The torch replayer of run-ut: rebuild one recorded op call (the inverse of the recorder's
encoding, ``backend.encode_other``) and run it on the target device in the recorded dtypes
("device") and on CPU in float64 ("benchmark").  :data:`REPLAYER` is what run-ut drives.
"""

from __future__ import annotations

import atexit
import pickle
import json
import math
import os
import zlib

import numpy as np
import torch
from safetensors import safe_open

from ..core import op_traits
from ..offline.replayer import Output, Replayed, Replayer, ReplayError, Skip
from ..records.format import walk
from ..records.reader import Part
from . import ops, references
from .devices import usable_device
from .internals.dispatch import op_schema
from .internals.tensors import MKLDNN
from .ops import dtype_name
from .process_state import STATE

_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "channels_last": torch.channels_last,
                   "channels_last_3d": torch.channels_last_3d, "preserve_format": torch.preserve_format}
_LAYOUTS = {"strided": torch.strided, "sparse_coo": torch.sparse_coo, "mkldnn": MKLDNN}

# ---- ops ----------------------------------------------------------------------------------------
_OPS: dict = {}


def resolve(op: str):
    """``aten.addmm.default`` -> ``torch.ops.aten.addmm.default`` (Skip if this torch lacks it)."""
    hit = _OPS.get(op)
    if hit is None:
        parts = op.split(".")
        if len(parts) != 3:
            raise Skip(f"op {op!r} is not an 'namespace.name.overload' operator")
        try:
            hit = getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
        except (AttributeError, RuntimeError):
            raise Skip(f"op {op} does not exist in this torch ({torch.__version__}) or its loaded plugins") from None
        _OPS[op] = hit
    return hit


# ---- tensors -------------------------------------------------------------------------------------
_DTYPES = {}


def to_dtype(name: str) -> torch.dtype:
    hit = _DTYPES.get(name)
    if hit is None:
        hit = getattr(torch, str(name).removeprefix("torch."), None)
        if not isinstance(hit, torch.dtype):
            raise Skip(f"unknown dtype {name!r}")
        _DTYPES[name] = hit
    return hit


class TensorSource:
    """Saved tensors of one part, read exactly (bf16 stays bf16) with safetensors' torch API."""

    def __init__(self, part: Part):
        self.part = part
        self._handles: dict = {}

    def _handle(self, shard: str):
        h = self._handles.get(shard)
        if h is None:
            h = self._handles[shard] = safe_open(os.path.join(self.part.path, "tensors", shard), framework="pt")
        return h

    def has(self, key: str) -> bool:
        return self.part.has_tensor(key)

    def get(self, key: str) -> torch.Tensor:
        view = self.part.views.get(key)
        stored = view["base"] if view else key
        shard = self.part.shards.get(stored)
        if shard is None:
            raise Skip(f"saved tensor {key} is missing (the run ended before its shard was written)")
        path = os.path.join(self.part.path, "tensors", shard)
        try:
            handle = self._handle(shard)
            t = handle.get_tensor(stored)
            real = (handle.metadata() or {}).get(stored)
        except Exception as exc:  # noqa: BLE001 - any failure to read is the record's, not the op's
            raise Skip(f"damaged record: {path}: {' '.join(str(exc).split())[:160]}") from None
        if real is not None:      # a dtype safetensors has no code for (torch.snapshots.save_shard)
            real = json.loads(real)
            dtype = to_dtype(real["dtype"])
            t = torch.view_as_complex(t) if dtype.is_complex else t.view(dtype)
            t = t.reshape(real["shape"])
        if view:
            t = t.reshape(-1).as_strided(tuple(view["shape"]), tuple(view["stride"]), view["offset"]).clone()
        return t


def random_tensor(spec: dict, seed: int) -> torch.Tensor:
    """A tensor of the recorded shape and dtype whose values follow the recorded statistics."""
    dtype = to_dtype(spec["dtype"])
    shape = tuple(spec["shape"])
    st = spec.get("stats") or {}
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)

    def num(key, default):
        v = st.get(key)
        try:
            v = float(v)
        except (TypeError, ValueError):
            return default
        return v if math.isfinite(v) else default

    lo, hi = num("finite_min", num("min", -1.0)), num("finite_max", num("max", 1.0))
    if dtype == torch.bool:
        if lo == hi:
            return torch.full(shape, bool(lo), dtype=dtype)
        return torch.randint(0, 2, shape, generator=g).bool()
    if not (dtype.is_floating_point or dtype.is_complex):
        return torch.randint(int(math.floor(lo)), int(math.floor(hi)) + 1, shape, generator=g, dtype=torch.int64).to(dtype)
    mean = num("mean", (lo + hi) / 2)
    norm = num("norm", 0.0)
    var = norm * norm / n - mean * mean if n else 0.0
    std = math.sqrt(var) if var > 0 else (hi - lo) / 4
    x = torch.randn(shape, generator=g, dtype=torch.float64) * std + mean
    x = x.clamp(lo, hi) if lo <= hi else x
    return x.to(dtype)


def _restride(t: torch.Tensor, stride) -> torch.Tensor:
    """``t``'s values laid out with the recorded strides (some kernels depend on the layout)."""
    if stride is None or t.dim() == 0 or len(stride) != t.dim() or list(t.stride()) == list(stride) \
            or t.numel() <= 1:
        return t
    if any(s == 0 for s, n in zip(stride, t.shape) if n > 1):
        # an expanded view: keep one slice of each broadcast dim, expand it again
        v = t
        for d, (s, n) in enumerate(zip(stride, t.shape)):
            if s == 0 and n > 1:
                v = v.narrow(d, 0, 1)
        return v.contiguous().expand(t.shape)
    try:
        out = torch.empty_strided(tuple(t.shape), tuple(stride), dtype=t.dtype, device=t.device)
        out.copy_(t)
        return out
    except RuntimeError:
        return t


# ---- decoding a call -----------------------------------------------------------------------------
class CallBuilder:
    """Turns one record's encoded inputs into (args, kwargs) twice: device and benchmark."""

    def __init__(self, record: dict, source: TensorSource | None, random: bool):
        self.record = record
        self.source = source
        self.random = random
        self.cache: dict[str, torch.Tensor] = {}

    def tensor(self, spec: dict, path: str) -> torch.Tensor:
        hit = self.cache.get(path)
        if hit is not None:
            return hit
        key = spec.get("data")
        if spec.get("undefined") or _holds_nothing(spec):
            # uninitialised memory: any contents are a faithful instance; both runs get zeros
            # (an empty tensor has no contents: its shape and dtype are the whole value)
            t = torch.zeros(tuple(spec["shape"]), dtype=to_dtype(spec["dtype"]))
        elif self.random:
            t = random_tensor(spec, zlib.crc32(f"{self.record['name']}:{path}".encode()))
        elif key is None:
            raise Skip(f"{path} was not saved (statistics-only records: replay them with --random)")
        else:
            t = self.source.get(key)
            if list(t.shape) != list(spec["shape"]):
                t = t.reshape(spec["shape"])
            if dtype_name(t.dtype) != spec["dtype"]:
                t = t.to(to_dtype(spec["dtype"]))
        self.cache[path] = t
        return t

    def decode(self, spec, path: str, device: torch.device, bench: bool, keep_dtype: bool, alter=None):
        kind = spec.get("type")
        if kind == "tensor":
            t = self.tensor(spec, path)
            if bench:
                if t.is_floating_point() and not keep_dtype:
                    t = t.to(torch.float64)
                elif t.is_complex() and not keep_dtype:
                    t = t.to(torch.complex128)
                else:
                    t = t.clone()
            else:
                t = t.to(device, copy=True)
            if alter is not None and (t.is_floating_point() or t.is_complex()):
                t = alter(t)
            return _restride(t, spec.get("stride"))
        if kind == "none":
            return None
        if kind in ("bool", "int", "str", "symint", "symbool"):
            return spec["value"]
        if kind in ("float", "symfloat"):
            return float(spec["value"]) if alter is None else alter(float(spec["value"]))
        if kind == "complex":
            return complex(*spec["value"]) if alter is None else alter(complex(*spec["value"]))
        if kind in ("list", "tuple"):
            items = [self.decode(v, f"{path}.{i}", device, bench, keep_dtype, alter)
                     for i, v in enumerate(spec["value"])]
            return items if kind == "list" else tuple(items)
        if kind == "dtype":
            return to_dtype(spec["value"])
        if kind == "device":
            return torch.device("cpu") if bench else device
        if kind == "memory_format":
            return _MEMORY_FORMATS.get(spec["value"], torch.preserve_format)
        if kind == "layout":
            return _LAYOUTS.get(spec["value"], torch.strided)
        if kind == "generator":
            raise Skip(f"{path} is a random generator: the op is random")
        raise Skip(f"{path} ({spec.get('repr', kind)}) cannot be rebuilt from the record")

    def call(self, device: torch.device, bench: bool, written: set, alter=None):
        """(args, kwargs) of the device or the benchmark run; ``written`` args keep their dtype in
        the benchmark; ``alter``: applied to every floating tensor and scalar (the terms' runs)."""
        r = self.record
        args = [self.decode(s, f"input.{i}", device, bench, bench and i in written, alter)
                for i, s in enumerate(r.get("inputs") or ())]
        kwargs = {k: self.decode(s, f"input.{k}", device, bench, bench and k in written, alter)
                  for k, s in (r.get("kwargs") or {}).items()}
        return args, kwargs


def _holds_nothing(spec: dict) -> bool:
    """An empty tensor (a zero in its shape): rebuilt from its record alone, whether or not its
    (zero) bytes were saved; a compiled graph records none for it."""
    return 0 in (spec.get("shape") or ())


def check_replayable(record: dict, random: bool) -> None:
    """Raise :class:`Skip` with the reason when the op cannot be replayed."""
    base = op_traits.base_name(record["op"])
    if base in op_traits.RANDOM:
        raise Skip(f"random op ({base}): its output cannot be replayed deterministically")
    if base in op_traits.NOTHING_TO_CHECK:
        raise Skip(f"{base} allocates or reads metadata only: nothing to check")
    if record.get("inputs_overwritten"):
        raise Skip("its inputs were written in place before the check was read back: not saved")
    tensors = walk(record)
    if "inputs" not in record:
        raise Skip("inputs were not recorded (io filter)")
    compiled = record.get("compiled") or {}
    if compiled.get("decomposed") and not compiled.get("call"):
        raise Skip("decomposed by the compiler, its call not traced: the graph holds its pieces, not its "
                   "arguments (compare it with an eager run instead)")
    if compiled:
        for io, arg, s in walk(record, outputs=False, tensors_only=False):
            if s.get("type") == "other" and s.get("unread"):
                raise Skip(f"{arg} is not in the compiled graph (it reads other values in its place, such as "
                           "saved intermediates): no value to replay the call with")
    func = resolve(record["op"])
    written = {x for pair in ops.written_args(func) for x in pair}
    for i, s in enumerate(record.get("inputs") or ()):
        if i in written and s.get("type") == "tensor":
            stride, shape = s.get("stride"), s.get("shape")
            if stride and any(st == 0 and n > 1 for st, n in zip(stride, shape)):
                raise Skip("in-place op on an overlapping view (broadcast strides): cannot be rebuilt")
    if not random:
        for io, _, s in tensors:
            if io == "input" and s.get("data") is None and not s.get("undefined") and not _holds_nothing(s):
                raise Skip("inputs were not saved (statistics-only records: replay them with --random)")


def _flat_outputs(value, name: str | None = None) -> list:
    """[(name, leaf)] of a returned value, named as the record names outputs (``output.1.0``)."""
    if isinstance(value, (tuple, list)):
        return [leaf for i, v in enumerate(value) for leaf in _flat_outputs(v, f"{name or 'output'}.{i}")]
    return [(name or "output.0", value)]


def _as_tensor(v):
    if isinstance(v, torch.Tensor):
        return v
    if isinstance(v, bool):
        return torch.tensor(v)
    if isinstance(v, int):
        return torch.tensor(v, dtype=torch.int64)
    if isinstance(v, float):
        return torch.tensor(v, dtype=torch.float64)
    return None


def _is_no_cpu_kernel(exc: Exception) -> bool:
    msg = str(exc)
    return isinstance(exc, NotImplementedError) or "Could not run" in msg and "CPU" in msg


def replay(record: dict, source: TensorSource | None, device: torch.device, random: bool = False,
           keep_data: bool = False) -> Replayed:
    """Run the recorded call on ``device`` in the recorded dtypes and on CPU in float64."""
    check_replayable(record, random)
    func = resolve(record["op"])
    written = {x for pair in ops.written_args(func) for x in pair}
    builder = CallBuilder(record, source, random)
    result = Replayed(written=bool(written))
    with torch.no_grad():
        args, kwargs = builder.call(device, False, written)
        if keep_data:
            result.data.update(builder.cache)
        # what the training process computed, where it saved it (judged against the same benchmark)
        rec_leaves, shared = ([], []) if random else _recorded_outputs(record, builder, written)
        if shared:
            result.note = (f"recorded {', '.join(shared)} not judged: saved as the same tensor as the argument the op "
                           "writes, whose value before the op the record also needs")
        compiled = bool(record.get("compiled")) and not random
        if compiled:
            # a compiled graph's record: its kernel's outputs are the recorded ones (no eager rerun)
            dev_leaves = []
        else:
            try:
                dev_out = _results(func, args, kwargs)
            except Skip:
                raise
            except Exception as exc:  # noqa: BLE001 - the op's own failure is its error
                raise ReplayError(f"device run failed: {type(exc).__name__}: {_one_line(exc)}") from None
            dev_leaves = [(n, v.detach().cpu() if isinstance(v, torch.Tensor) else v) for n, v in _flat_outputs(dev_out)]
            del dev_out
        del args, kwargs
        bench = references.reference(record["op"], func)     # ops without a float64 kernel
        bench_out, widened = _bench(bench, builder, written)
        bench_leaves = _flat_outputs(bench_out)
        keep = set() if widened else written
        masks = _written_elements(record["op"], builder, keep)
    unwritten = [f"{name}: {int((~m).sum())} of {m.size} elements not judged: {masks.where}, the op leaves them "
                 "undefined" for name, m in masks.items()]
    result.note = "; ".join(x for x in (result.note, *unwritten) if x)
    if not compiled:
        if len(bench_leaves) != len(dev_leaves):
            raise ReplayError(f"device gave {len(dev_leaves)} outputs, benchmark {len(bench_leaves)}")
        for (name, d), (_, b) in zip(dev_leaves, bench_leaves):
            d, b = _as_tensor(d), _as_tensor(b)
            if d is None and b is None:
                continue
            if d is None or b is None:
                raise ReplayError(f"{name}: device gave {type(d).__name__}, benchmark {type(b).__name__}")
            result.outputs.append(Output(name, _written(to_numpy(d), masks, name), _written(to_numpy(b), masks, name),
                                         dtype_name(d.dtype), dtype_name(b.dtype), tuple(d.shape)))
            if keep_data:
                result.data[f"{name}.device"], result.data[f"{name}.bench"] = d, b
    bench_by_name = dict(bench_leaves)
    for name, r in rec_leaves:       # outputs the graph never read are not recorded: not judged
        b = _as_tensor(bench_by_name.get(name))
        if b is None:
            continue
        if tuple(r.shape) != tuple(b.shape):     # an auxiliary output whose size the kernel chooses
            result.note = "; ".join(x for x in (result.note, f"recorded {name} not judged: shape {list(r.shape)}, "
                                                f"{list(b.shape)} in the benchmark") if x)
            continue
        result.recorded.append(Output(name, _written(to_numpy(r), masks, name), _written(to_numpy(b), masks, name),
                                      dtype_name(r.dtype), dtype_name(b.dtype), tuple(r.shape)))
        if keep_data:
            result.data[f"{name}.recorded"], result.data[f"{name}.bench"] = r, b
    result.terms = lambda kind="magnitude": _written_only(_terms(record["op"], bench, builder, keep, kind), masks)
    result.spread = lambda: _written_only(_spread(bench, builder, keep, bench_leaves), masks)
    return result


class WrittenMasks(dict):
    """{output name: numpy bool mask of the elements the op writes}, for the outputs it leaves
    partly undefined; ``where`` says where the others lie (``references.register_defined``)."""

    def __init__(self, masks: dict, where: str = ""):
        super().__init__(masks)
        self.where = where


def _written_elements(op: str, builder: CallBuilder, written: set) -> WrittenMasks:
    """The masks of the elements ``op`` writes, from its benchmark arguments; empty for ops that
    write every element.  Why: the rest is uninitialised memory, which no benchmark can match."""
    if op not in references.DEFINED:
        return WrittenMasks({})
    args, kwargs = builder.call(torch.device("cpu"), True, written)
    masks, where = references.defined_elements(op, args, kwargs)
    return WrittenMasks({name: m.numpy() for name, m in masks.items()}, where)


def _written(array: np.ndarray, masks: WrittenMasks, name: str) -> np.ndarray:
    """The elements of output ``name`` the op wrote (all of them unless ``masks`` says otherwise)."""
    mask = masks.get(name)
    return array if mask is None or np.shape(mask) != np.shape(array) else array[mask]


def _written_only(arrays: dict, masks: WrittenMasks) -> dict:
    return {name: _written(a, masks, name) for name, a in arrays.items()}


def _recorded_outputs(record: dict, builder: CallBuilder, written: set) -> tuple[list, list]:
    """([(name, tensor)] of the outputs the training process saved, [names not judged]).  One
    whose tensor cannot be read (its shard never written) is left out: the replay is still judged.
    One saved as the same tensor as an argument the op writes is not judged: one saved value
    cannot be both that argument before the op and the output after it."""
    views = builder.source.part.views if builder.source is not None else {}

    def stored(key):
        return views[key]["base"] if key in views else key
    before = {stored(s["data"]) for io, arg, s in walk(record, outputs=False)
              if s.get("data") is not None and _arg_key(arg) in written}
    out, shared = [], []
    for _, arg, spec in walk(record, inputs=False):
        if spec.get("data") is None or spec.get("undefined"):
            continue
        if stored(spec["data"]) in before:
            shared.append(arg)
            continue
        try:
            out.append((arg, builder.tensor(spec, arg)))
        except Skip:
            continue
    return out, shared


def _arg_key(arg: str):
    """``input.0.1`` -> 0, ``input.out`` -> "out": the argument as ``ops.written_args`` names it."""
    head = arg.split(".")[1]
    return int(head) if head.isdigit() else head


def _results(func, args, kwargs):
    """What the op computed: its outputs, or the arguments it wrote when it returns nothing
    (the optimizers' ``_foreach_*_``)."""
    out = func(*args, **kwargs)
    if out is None and not op_schema(func).returns:
        out = tuple(args[i] if i < len(args) else kwargs.get(name) for i, name in ops.written_args(func))
        out = out[0] if len(out) == 1 else out
    return out


def _bench(func, builder: CallBuilder, written: set):
    """(benchmark output, whether written arguments were widened too).  Written arguments keep
    their dtype (the result must be stored in it) unless the kernel then rejects the mix; dtype
    arguments are widened when the kernel insists they match its inputs
    (``_log_softmax_backward_data``'s input_dtype)."""
    attempts = ((written, False), (written, True), (set(), True))
    for n, (keep, dtypes) in enumerate(attempts):
        bargs, bkwargs = builder.call(torch.device("cpu"), True, keep)
        if dtypes:
            bargs, bkwargs = _upcast_dtypes(bargs), {k: _upcast_dtypes(v) for k, v in bkwargs.items()}
        try:
            return _results(func, bargs, bkwargs), not keep
        except Exception as exc:  # noqa: BLE001
            if n == 0 and _is_no_cpu_kernel(exc):
                raise Skip(f"no CPU float64 kernel for the benchmark: {_one_line(exc)}") from None
            if n == len(attempts) - 1:
                raise Skip(f"cannot be upcast to float64 for the benchmark: {type(exc).__name__}: "
                           f"{_one_line(exc)}") from None
    raise AssertionError("unreachable")


def _run_floats(func, call) -> dict:
    """{output name: numpy array} of the floating outputs of ``func(*args, **kwargs)``; empty
    when the run fails (the outputs are then judged without it)."""
    args, kwargs = call
    with torch.no_grad():
        try:
            out = _results(func, args, kwargs)
        except Exception:  # noqa: BLE001
            return {}
    return {name: to_numpy(v) for name, v in _flat_outputs(out)
            if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())}


def _terms(op: str, bench, builder: CallBuilder, keep: set, kind: str) -> dict:
    """{output name: array}: each element's sum of |terms| (``kind`` ``"magnitude"``: the op's
    registered function of them, ``references.register_terms``, else the benchmark on |inputs|)
    or its number of terms (``"count"``: the benchmark on ones)."""
    cpu = torch.device("cpu")
    if kind == "magnitude" and op in references.TERMS:
        return _run_floats(references.TERMS[op], builder.call(cpu, True, keep))
    return _run_floats(bench, builder.call(cpu, True, keep, abs if kind == "magnitude" else _one))


def _one(x):
    return torch.ones_like(x) if isinstance(x, torch.Tensor) else type(x)(1)


_NUDGE = 2.0 ** -20   # relative input perturbation of the spread runs (linear regime in float64)


def _spread(func, builder: CallBuilder, written: set, bench_leaves: list) -> dict:
    """{output name: array}: how far each benchmark element moves when every floating input moves
    by a relative ``_NUDGE`` in random directions, over ``_NUDGE`` (the largest of two draws): the
    magnitude the element is computed from, which is its own size unless it cancelled."""
    base = {n: to_numpy(v) for n, v in bench_leaves
            if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())}
    out: dict = {}
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)

        def nudge(x):
            if isinstance(x, torch.Tensor):
                sign = torch.randint(0, 2, x.shape, generator=g).to(x.dtype) * 2 - 1
                return x * (1 + _NUDGE * sign)
            return x * (1 + _NUDGE * (1 if torch.randint(0, 2, (), generator=g).item() else -1))
        moved = _run_floats(func, builder.call(torch.device("cpu"), True, written, nudge))
        for name, v in moved.items():
            if name in base and np.shape(v) == np.shape(base[name]):
                d = np.abs(v - base[name]) / _NUDGE
                out[name] = d if name not in out else np.maximum(out[name], d)
    return out


def _upcast_dtypes(value):
    if isinstance(value, torch.dtype) and value.is_floating_point:
        return torch.float64
    if isinstance(value, list):
        return [_upcast_dtypes(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_upcast_dtypes(v) for v in value)
    return value


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())[:300]


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """float -> float64 numpy, complex -> complex128; integers and bool keep their type."""
    t = t.detach().cpu()
    if t.is_complex():
        return t.resolve_conj().to(torch.complex128).numpy()
    if t.is_floating_point():
        return t.to(torch.float64).numpy()
    if t.dtype in (torch.uint16, torch.uint32, torch.uint64):
        return t.to(torch.int64).numpy()
    return t.numpy()


# ---- devices -------------------------------------------------------------------------------------
def resolve_device(name: str | None) -> torch.device:
    """``--device``: ``cpu``, ``cuda[:i]``, ``npu[:i]`` (imports torch_npu), any ``torch.accelerator``
    type that has a device on this machine; None: such an accelerator, else cpu
    (:func:`.devices.usable_device`: a ValueError naming the device and why it is unusable)."""
    return usable_device(name)


# ---- the services run-ut asks of a framework ---------------------------------------------------
def set_threads(n: int) -> int:
    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    return prev


def save_error_data(path: str, data: dict, metadata: dict) -> None:
    """Complex tensors are stored as their (re, im) pairs (``torch.view_as_real``), listed in the
    metadata's ``complex`` entry."""
    from safetensors.torch import save_file
    tensors, cplx = {}, []
    for k, v in data.items():
        if isinstance(v, torch.Tensor):
            v = v.detach().cpu()
            if v.is_complex():
                v = torch.view_as_real(v.resolve_conj())
                cplx.append(k)
            tensors[k] = v.contiguous().clone()
    save_file(tensors, path, metadata=dict(metadata, **({"complex": ",".join(cplx)} if cplx else {})))


class TorchDistributed:
    """Object collectives over the gloo group torchrun set up, on tensors the adapter keeps.

    torch's own ``broadcast_object_list``/``gather_object`` drop their tensors while a gloo worker
    thread may still hold its work on them; that thread then needs the GIL to free them, and
    ``destroy_process_group`` (joining the thread with the GIL held) deadlocks (seen on torch 2.5).
    Every tensor handed to gloo here stays in ``STATE.collective_tensors`` until the group is
    destroyed, so gloo's threads never free a Python-owned tensor.  Objects travel pickled, between
    this tool's own ranks only.
    """

    def __init__(self, dist):
        self._dist, self.rank, self.world = dist, dist.get_rank(), dist.get_world_size()

    @staticmethod
    def _kept(t: torch.Tensor) -> torch.Tensor:
        STATE.collective_tensors.append(t)
        return t

    def _size(self, n: int = 0) -> torch.Tensor:
        return self._kept(torch.tensor([n], dtype=torch.int64))

    def _buffer(self, n: int) -> torch.Tensor:
        return self._kept(torch.zeros(n, dtype=torch.uint8))

    def _encoded(self, obj) -> torch.Tensor:
        return self._kept(torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8))

    def broadcast(self, obj, src: int = 0):
        data = self._encoded(obj) if self.rank == src else None
        size = self._size(data.numel() if data is not None else 0)
        self._dist.broadcast(size, src=src)
        if data is None:
            data = self._buffer(int(size))
        self._dist.broadcast(data, src=src)
        return obj if self.rank == src else pickle.loads(data.numpy().tobytes())

    def gather(self, obj, dst: int = 0):
        mine = self._encoded(obj)
        sizes = [self._size() for _ in range(self.world)]
        self._dist.all_gather(sizes, self._size(mine.numel()))
        padded = self._buffer(max(int(s) for s in sizes))
        padded[:mine.numel()] = mine
        bufs = [self._buffer(padded.numel()) for _ in range(self.world)] if self.rank == dst else None
        self._dist.gather(padded, bufs, dst=dst)
        if self.rank != dst:
            return None
        return [pickle.loads(b[:int(n)].numpy().tobytes()) for b, n in zip(bufs, sizes)]

    def barrier(self) -> None:
        self._dist.barrier()


def distributed() -> TorchDistributed | None:
    """The engine when launched by torchrun (a gloo group is initialised), else None.  A group
    this function made is destroyed when the process exits: left to the interpreter's teardown,
    gloo's threads could abort the process (SIGABRT) after its work was done."""
    import torch.distributed as dist
    if not dist.is_available():
        return None
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "MASTER_ADDR" not in os.environ:
            return None
        dist.init_process_group("gloo")
        atexit.register(_destroy_group, dist)
    return TorchDistributed(dist)


def _destroy_group(dist) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    STATE.collective_tensors.clear()


REPLAYER = Replayer("torch", replay=replay, resolve_device=resolve_device, tensor_source=TensorSource,
                    set_threads=set_threads, save_error_data=save_error_data, distributed=distributed)
