"""The MindSpore :class:`~dispatchprobe.core.tensor_backend.TensorBackend`.

Every number is computed in numpy (:mod:`dispatchprobe.core.host_numerics`) on the tensor's
host values: MindSpore's CPU lacks the reductions the statistics need (aminmax, vector norm,
dot), and running ops inside the dispatch handler must not disturb training.  ``asnumpy()`` is
zero-copy and writeable: it is only read here; whatever is kept is copied first.
"""

from __future__ import annotations

import functools
import math
import types
import weakref
import zlib

import mindspore as ms
import numpy as np

from dispatchprobe.core import host_numerics as hn
from dispatchprobe.core import nested_values as values
from dispatchprobe.records.writer import save_numpy_shard
from dispatchprobe.standards import statistics

from . import ops

name = "mindspore"
version = ms.__version__
FLOATS = ("float16", "bfloat16", "float32", "float64")
_EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23, "float64": 2.0 ** -52}
_MAX = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38,
        "float64": 1.7976931348623157e308}


@functools.cache
def accelerator() -> str:
    """The device target (fixed once MindSpore runs its first op): asked once, not per tensor."""
    return str(ms.get_context("device_target")).lower()


# ---- describing values ----------------------------------------------------------------------------
def is_tensor(value) -> bool:
    return isinstance(value, ms.Tensor)


@functools.cache
def dtype_name(dtype) -> str:
    return str(dtype).lower().removesuffix("_")


def dtype_of(t) -> str:
    return dtype_name(t.dtype)


def tensor_meta(t) -> dict:
    return {"type": "tensor", "dtype": dtype_of(t), "shape": list(t.shape), "stride": list(t.stride()),
            "device": accelerator(), "requires_grad": bool(getattr(t, "requires_grad", False))}


def encode_other(value) -> dict:
    if isinstance(value, ms.dtype.Type):
        return {"type": "dtype", "value": dtype_name(value)}
    return {"type": "other", "repr": repr(value)[:200]}


def shape(t) -> list[int]:
    return list(t.shape)


def numel(t) -> int:
    return int(math.prod(t.shape))


def nbytes(t) -> int:
    return int(t.nbytes)


def on_host(t) -> bool:
    return True


def device_type(t) -> str:
    return accelerator()


def host(t) -> np.ndarray:
    """The tensor's values as numpy, read-only (zero-copy on CPU: never written)."""
    return np.asarray(t.asnumpy())


def tensor(values: np.ndarray, dtype: str):
    """A new MindSpore tensor of ``values`` in ``dtype``."""
    out = ms.Tensor(np.ascontiguousarray(values))
    return out if dtype_of(out) == dtype else out.astype(getattr(ms, dtype))


# ---- statistics ------------------------------------------------------------------------------------
def tensor_stats(tensors: list, keys: list | None = None) -> list[dict | None]:
    return [hn.stats(host(t)) if numel(t) else None for t in tensors]


def stats_on_device(t) -> bool:
    return False


def device_stats_row(t):
    st = hn.stats(host(t))
    return [st["max"], st["min"], st["mean"] * numel(t), st["norm"], st["nan"], st["inf"]]


def read_stats_rows(rows: list, numels: list[int]) -> list[dict]:
    return [statistics.from_row(r, n) for r, n in zip(rows, numels)]


def stats_ready(rows: list) -> int:
    return len(rows)          # rows measured on the host


def checksum(t) -> str:
    return f"crc32:{zlib.crc32(np.ascontiguousarray(host(t)).tobytes()):08x}"


# ---- the recorder's cache and saved tensors -----------------------------------------------------------
def identity(t):
    """Memory address, layout and in-place version: the handler gets a new Python object for a
    tensor each time it is passed on, so the object itself cannot be the key.  The recorder
    trusts a key only while the first object seen (which holds the memory) lives."""
    return t.data_ptr(), tuple(t.shape), tuple(t.stride()), dtype_of(t), t._version


def dense_key(t):
    return None


def describe(t) -> tuple:
    return tensor_meta(t), identity(t), None


def storage_span(t):
    return None


def memory_ref(t):
    return weakref.ref(t)


def memory_alive(ref) -> bool:
    return ref is not None and ref() is not None


def memory_address(ref) -> int:
    """The tensor's identity while it lives (the ref is to the tensor: a MindSpore view is a tensor of
    its own, followed through the op that made it)."""
    t = ref()
    return id(t) if t is not None else -1


def cache_entry(ref, value) -> tuple:
    return (ref, value)


def snapshot(t) -> np.ndarray:
    return np.array(host(t), copy=True, order="C")


def span_snapshot(t, start: int, length: int) -> np.ndarray:
    return snapshot(t).reshape(-1)[start:start + length].copy()


save_shard = save_numpy_shard


def same_values(event) -> dict:
    return {}


# ---- an op's values -----------------------------------------------------------------------------------
def is_float(t) -> bool:
    return isinstance(t, ms.Tensor) and dtype_of(t) in FLOATS and numel(t) > 0


def float_tensors(obj) -> list:
    return values.collect(obj, is_float)


def float_outputs(outputs) -> list:
    return values.indexed_outputs(outputs, is_float)


def map_floats(fn, args, kwargs):
    return values.walk(tuple(args), is_float, fn), values.walk(dict(kwargs), is_float, fn)


def swap_tensors(outputs, replacements: dict):
    return values.walk(outputs, is_tensor, lambda t: replacements.get(id(t), t))


def versions(tensors) -> tuple:
    return tuple(t._version for t in tensors)


def detach(t):
    return t


def clone(t):
    return tensor(snapshot(t), dtype_of(t))


def to_device_of(t, like):
    return t


# ---- ops: traits and re-runs ------------------------------------------------------------------------------
def is_random(func) -> bool:
    return ops.is_random(func.name)


def returns_alias(func) -> bool:
    return ops.writes_first(func.name)


user_stack = ops.user_stack


def cast_args(args, kwargs, dtype_map: dict, device=None, scratch=None):
    """Floating tensors and dtype arguments converted per ``{"float16": "float32"}``."""
    def one(v):
        if isinstance(v, ms.dtype.Type) and dtype_name(v) in dtype_map:
            return getattr(ms, dtype_map[dtype_name(v)])
        if is_float(v) and dtype_of(v) in dtype_map:
            return tensor(host(v), dtype_map[dtype_of(v)])
        if isinstance(v, (tuple, list)):
            return type(v)(one(x) for x in v)
        return v
    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def protect_written(func, args, kwargs, original_args, original_kwargs):
    written = ops.written_positions(func.name)
    if written:
        args = tuple(clone(a) if i in written and i < len(original_args) and a is original_args[i] else a
                     for i, a in enumerate(args))
    return args, kwargs


def run(func, args, kwargs, device_type: str = "cpu", tf32: bool = False):
    return func(*args, **kwargs)


def input_grads(func, args, kwargs, grad_outs, generator, device_type: str, fixup=None, perturb=None, training_call=None):
    """Not available: a gradient taken inside the dispatch handler breaks the user's own
    ``value_and_grad`` (the session refuses ``fuzz_stage: backward``)."""
    return None


def replacement(original, result):
    def one(orig, new):
        if is_float(orig) and is_float(new) and list(orig.shape) == list(new.shape):
            return tensor(host(new), dtype_of(orig))
        return orig
    return values.pair_outputs(original, result, is_tensor, one)


# ---- inline checks: plain host numbers ("pending" values are already read) --------------------------------
def sq_norm(t) -> float:
    return hn.sq_norm(host(t))


def read(values) -> list:
    return list(values)


def concat(pending: list) -> list:
    return [v for part in pending for v in part]


def all_finite(t) -> bool:
    return bool(np.isfinite(host(t)).all())


def nonfinite_counts(t) -> tuple[int, int]:
    return hn.nonfinite_counts(host(t))


def max_abs_finite(t) -> float:
    return hn.max_abs_finite(host(t))


def dtype_max(dtype: str) -> float:
    return _MAX[dtype]


def eps(dtype: str) -> float:
    return _EPS[dtype]


# ---- free benchmark --------------------------------------------------------------------------------------
def generator(seed: int):
    return np.random.default_rng(seed)


class _Noise(hn.NoiseSource):
    def apply(self, t):
        return tensor(super().apply(host(t), dtype_of(t)), dtype_of(t))


def noise_source(seed: int) -> _Noise:
    return _Noise(seed)


def bit_noise(t):
    return tensor(hn.bit_noise(host(t), dtype_of(t)), dtype_of(t))


def saturated(t):
    limit = _MAX[dtype_of(t)]
    return tensor(np.clip(host(t), -limit, limit), dtype_of(t))


def change_value_plan(func, args, kwargs):
    """First and last entries along the reduced axis exchanged (``MatMul``, ``BatchMatMul``,
    ``SumExt``/``MeanExt``): the exact result is unchanged.  Other ops: None (not perturbed)."""
    name_, args = func.name, list(args)
    swap = lambda t, axis: tensor(hn.swap_first_last(host(t), axis), dtype_of(t))   # noqa: E731
    if name_ in ("MatMul", "BatchMatMul", "MatMulExt", "Mm") and len(args) >= 2:
        ta = len(args) > 2 and args[2] is True
        tb = len(args) > 3 and args[3] is True
        args[0], args[1] = swap(args[0], -2 if ta else -1), swap(args[1], -1 if tb else -2)
        return tuple(args), None
    if name_ in ("SumExt", "MeanExt") and args and is_float(args[0]) and len(args[0].shape):
        dims = args[1] if len(args) > 1 else None
        axis = dims[0] if isinstance(dims, (tuple, list)) and dims else dims if isinstance(dims, int) else \
            max(range(len(args[0].shape)), key=lambda d: args[0].shape[d])
        args[0] = swap(args[0], axis)
        return tuple(args), None
    return None


def scratch():
    """No reusable buffers: host numbers are computed by numpy as they come."""
    return types.SimpleNamespace(reset=lambda: None)


def surely_within(actual, expected, limit: float, small: float, scratch=None) -> bool:
    return hn.within(host(actual), host(expected), limit, small)


def within_limits(actuals: list, expecteds: list, limits: list, small: float) -> list:
    return [hn.within(host(a), host(e), lim, small) for a, e, lim in zip(actuals, expecteds, limits)]


def changes(actuals: list, expecteds: list, small: float) -> list:
    return [list(hn.changes(host(a), host(e), small)) for a, e in zip(actuals, expecteds)]
