"""The contract between the neutral core and a framework: everything the recorder and the task
logic may ask of tensors.  An adapter provides one object (a module will do) with these members
-- ``dispatchprobe.torch.tensor_backend`` for PyTorch; nothing in ``core/`` touches a framework otherwise.

Tensors, dtypes, ops (``func``) and generators are the framework's objects, opaque here; dtypes
cross the line by name (``"bfloat16"``) where the core decides on them.  ``Pending`` values stay
on the device until :meth:`TensorBackend.read` brings many back with one host sync.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Protocol, runtime_checkable

Tensor = Any
Pending = Any


@runtime_checkable
class TensorBackend(Protocol):
    name: str                     # framework and version, for the run manifest
    version: str

    def accelerator(self) -> str: ...                       # "cpu", "cuda", "npu", ...

    # ---- describing values for the record (docs/record-format.md) -----------------------------
    def is_tensor(self, value) -> bool: ...
    def tensor_meta(self, t: Tensor) -> dict: ...            # type, dtype, shape, stride, device, requires_grad
    def encode_other(self, value) -> dict: ...               # dtype/device/... arguments, as replay rebuilds them
    def dtype_name(self, dtype) -> str: ...
    def dtype_of(self, t: Tensor) -> str: ...
    def shape(self, t: Tensor) -> list[int]: ...
    def numel(self, t: Tensor) -> int: ...
    def nbytes(self, t: Tensor) -> int: ...
    def on_host(self, t: Tensor) -> bool: ...                # host values are judged at once, others in batches
    def device_type(self, t: Tensor) -> str: ...

    # ---- statistics: the kernels (formulas in dispatchprobe.standards.statistics) -------------
    def tensor_stats(self, tensors: list, keys: list | None = None) -> list[dict | None]:
        """``keys``: each tensor's :meth:`identity` where known (the backend may read facts from it)."""
    def stats_on_device(self, t: Tensor) -> bool: ...
    def device_stats_row(self, t: Tensor) -> Pending: ...
    def read_stats_rows(self, rows: list, numels: list[int]) -> list[dict]: ...
    def stats_ready(self, rows: list) -> int:
        """How many leading ``rows`` :meth:`read_stats_rows` reads without waiting for a device."""
    def checksum(self, t: Tensor) -> str: ...

    # ---- the recorder's per-value cache and tensor saving -------------------------------------
    def identity(self, t: Tensor):
        """A key equal for two tensors only while they show the same bytes (None: unknown)."""
    def dense_key(self, t: Tensor):
        """A key shared by the views showing the same elements of one memory (None: not dense)."""
    def describe(self, t: Tensor) -> tuple:
        """``(tensor_meta(t), identity(t), dense_key(t))``: the per-op path asks all at once."""
    # optional, for records joined from JSON pieces (Recorder.record_line), running no framework
    # operation: ``LINE_TYPES``, the classes ``line_facts(value)`` takes -> ``(identity, dense key,
    # look)`` of a plain tensor in host memory, else None; ``meta_of(look)`` -> its tensor_meta;
    # ``line_stats(identities)`` -> their statistics, or None unless every value is finite and read
    # natively; ``line_entry(t, stats, json)`` -> the cache pair of a value so described;
    # ``CONSTANT_TYPES``: argument types whose entry is a function of the value alone;
    # ``copied_from(func, args, out)``: the argument ``out`` copies bit for bit in its layout
    def memory_ref(self, t: Tensor):
        """A weak reference to the memory: keys are trusted only while it lives."""
    def cache_entry(self, ref, value) -> tuple:
        """``(ref, value)`` as the recorder caches it; where the framework can, kept out of
        Python's cyclic garbage collector (its parts hold no cycles)."""
    def memory_alive(self, ref) -> bool: ...
    def memory_address(self, ref) -> int:
        """The address of the memory :meth:`memory_ref` saw: shared by every view of that memory,
        and no other memory's while :meth:`memory_alive` (the overflow check follows values by it)."""
    def storage_span(self, t: Tensor):
        """``(span_key, start, length, offset, stride, plain)`` to save shared memory once, or None."""
    def snapshot(self, t: Tensor):
        """A private contiguous host copy taken now: a later in-place op must not change it.  Any
        object the backend's ``save_shard`` and ``nbytes`` take (torch: a ``Snapshot``, no tensor)."""
    def span_snapshot(self, t: Tensor, start: int, length: int): ...
    def save_shard(self, tensors: dict, path: str) -> None: ...   # one safetensors file, bytes unchanged
    def same_values(self, event) -> dict:
        """``{id(output): input}`` for outputs holding exactly an input's values (``clone``)."""

    # ---- an op's values ------------------------------------------------------------------------
    def float_tensors(self, obj) -> list: ...                # non-empty dense floating tensors, nested
    def float_outputs(self, outputs) -> list[tuple[int, Tensor]]: ...   # (output index, tensor)
    def map_floats(self, fn: Callable, args: tuple, kwargs: dict) -> tuple[tuple, dict]: ...
    def swap_tensors(self, outputs, replacements: dict): ...  # tensors keyed by id() replaced
    def versions(self, tensors: Iterable) -> tuple: ...      # in-place counters: do inputs still hold what the op saw?
    def detach(self, t: Tensor) -> Tensor: ...
    def clone(self, t: Tensor) -> Tensor: ...
    def to_device_of(self, t: Tensor, like: Tensor) -> Tensor: ...

    # ---- ops: traits and re-runs ----------------------------------------------------------
    def is_random(self, func) -> bool: ...
    def returns_alias(self, func) -> bool: ...
    def user_stack(self) -> tuple: ...
    def cast_args(self, args, kwargs, dtype_map: dict[str, str], device: str | None = None,
                  scratch=None) -> tuple[tuple, dict]:
        """Floating tensors and dtype arguments converted per ``{"float16": "float32"}``, moved to
        ``device`` if given; with ``scratch`` into reusable memory."""
    def protect_written(self, func, args, kwargs, original_args, original_kwargs) -> tuple[tuple, dict]:
        """Private copies of the training's tensors the op writes: a re-run never writes into them."""
    def run(self, func, args, kwargs, device_type: str = "cpu", tf32: bool = False): ...  # outside autocast
    def input_grads(self, func, args, kwargs, grad_outs, generator, device_type: str, fixup=None,
                    perturb=None, training_call=None):
        """``(gradients of the floating inputs, output gradients used)`` of one call, or None.
        ``perturb(args, kwargs) -> (args, kwargs, fixup)`` is applied to the differentiated
        inputs with autograd on (a reordering perturbation: gradients in the inputs' layout);
        ``training_call`` (the training's ``(args, kwargs)``) says which inputs it differentiates."""
    def replacement(self, original, result): ...             # fix: re-run outputs in the original's dtype/layout

    # ---- inline checks: numbers on the device, read back in batches ---------------------------
    def sq_norm(self, t: Tensor) -> Pending:
        """Squared L2 norm accumulated in float32 (float64 for float64): finite iff the tensor is,
        unless the squares overflow float32 (callers re-check with ``all_finite``)."""
    def read(self, values) -> list: ...                      # a list of scalars, or one vector/matrix
    def concat(self, pending: list) -> Pending: ...
    def all_finite(self, t: Tensor) -> bool: ...
    def nonfinite_counts(self, t: Tensor) -> tuple[int, int]: ...
    def max_abs_finite(self, t: Tensor) -> float: ...
    def dtype_max(self, dtype_name: str) -> float: ...
    def eps(self, dtype_name: str) -> float: ...

    # ---- free benchmark: perturbation primitives and the measure ------------------------------
    def generator(self, seed: int): ...                     # private: never the global RNG
    def noise_source(self, seed: int): ...                  # .apply(t): x * (1 + u * eps), own generator
    def bit_noise(self, t: Tensor) -> Tensor: ...
    def saturated(self, t: Tensor) -> Tensor: ...            # a copy with +-inf at its dtype's finite max
    def change_value_plan(self, func, args, kwargs): ...    # (args, output fix-up) or None
    def scratch(self): ...                                  # reusable host memory, .reset() per op
    def surely_within(self, actual: Tensor, expected: Tensor, limit: float, small: float, scratch=None) -> bool:
        """A conservative screen: True only when the measure is certainly within ``limit``."""
    def within_limits(self, actuals: list, expecteds: list, limits: list, small: float) -> Pending: ...
    def changes(self, actuals: list, expecteds: list, small: float) -> Pending:
        """:func:`dispatchprobe.standards.metrics.perturbation_terms` per pair: rows of (max_rel, sign_flips)."""


def missing_members(backend) -> list[str]:
    """Members of :class:`TensorBackend` that ``backend`` lacks (an adapter's self-check)."""
    wanted = [n for n in dir(TensorBackend) if not n.startswith("_")] + list(TensorBackend.__annotations__)
    return sorted({n for n in wanted if not hasattr(backend, n)})
