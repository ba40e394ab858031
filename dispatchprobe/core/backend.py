"""The contract between the neutral core and a framework: what the recorder and the task logic
may ask of tensors.  A framework adapter provides one object (a module will do) with these
members -- ``dispatchprobe.torch.backend`` for PyTorch -- and nothing in ``core/`` touches a
framework any other way.

Tensors, dtypes, devices, ops (``func``) and generators are the framework's own objects, opaque
here.  Dtypes cross the line by name (``"bfloat16"``) where the core decides on them.  Values
that stay on an accelerator until a batched read-back (``Pending``) are opaque too; the core
only hands them back to :meth:`TensorBackend.read`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Protocol, runtime_checkable

Tensor = Any
Pending = Any      # a number (or vector) still on the device


@runtime_checkable
class TensorBackend(Protocol):
    # ---- identity of the framework (written to the run manifest) ----------------------------
    name: str
    version: str

    def accelerator(self) -> str:
        """The device a run is on: ``cpu``, ``cuda``, ``npu``, ..."""

    # ---- describing values (the record format) ------------------------------------------------
    def is_tensor(self, value) -> bool: ...
    def tensor_meta(self, t: Tensor) -> dict:
        """``{"type": "tensor", "dtype", "shape", "stride", "device", "requires_grad"}``."""
    def encode_other(self, value) -> dict:
        """A non-tensor, non-builtin argument (dtype, device, ...) as a JSON value replay can rebuild."""
    def dtype_name(self, dtype) -> str: ...
    def dtype_of(self, t: Tensor) -> str:
        """The tensor's dtype by name."""
    def shape(self, t: Tensor) -> list[int]: ...
    def numel(self, t: Tensor) -> int: ...
    def nbytes(self, t: Tensor) -> int: ...
    def on_host(self, t: Tensor) -> bool:
        """On the CPU: checks are judged at once; accelerator values are read back in batches."""

    # ---- statistics (formulas in dispatchprobe.standards.statistics) ------------------------
    def tensor_stats(self, tensors: list) -> list[dict | None]: ...
    def stats_on_device(self, t: Tensor) -> bool: ...
    def device_stats_row(self, t: Tensor) -> Pending: ...
    def read_stats_rows(self, rows: list, numels: list[int]) -> list[dict]: ...
    def checksum(self, t: Tensor) -> str: ...

    # ---- the recorder's per-value cache and tensor saving -------------------------------------
    def identity(self, t: Tensor):
        """A key equal for two tensors only while they show the same bytes; None if unknown."""
    def dense_key(self, t: Tensor):
        """A key shared by all views showing the same elements of one memory; None if not dense."""
    def memory_ref(self, t: Tensor):
        """A weak reference to the tensor's memory (keys are trusted only while it lives)."""
    def memory_alive(self, ref) -> bool: ...
    def storage_span(self, t: Tensor):
        """``(span_key, start, length, offset, stride, plain)`` to save shared memory once, or None."""
    def snapshot(self, t: Tensor) -> Tensor:
        """A private contiguous host copy, taken now (a later in-place op must not change it)."""
    def span_snapshot(self, t: Tensor, start: int, length: int) -> Tensor: ...
    def save_shard(self, tensors: dict, path: str) -> None:
        """Write snapshots as one safetensors file, bytes unchanged."""
    def same_values(self, event) -> dict:
        """``{id(output): input}`` for outputs that hold exactly an input's values (``clone``)."""

    # ---- walking an op's arguments and outputs ----------------------------------------------
    def float_tensors(self, obj) -> list:
        """The non-empty dense floating tensors in nested tuples/lists/dicts."""
    def float_outputs(self, outputs) -> list[tuple[int, Tensor]]:
        """``(output index, tensor)`` of every floating output, nested lists flattened."""
    def map_floats(self, fn: Callable, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``fn`` applied to every non-empty floating tensor of an op's arguments."""
    def swap_tensors(self, outputs, replacements: dict):
        """``outputs`` with the tensors keyed by ``id`` in ``replacements`` replaced."""
    def versions(self, tensors: Iterable) -> tuple:
        """In-place version counters: a later check tells whether inputs still hold what the op saw."""
    def detach(self, t: Tensor) -> Tensor: ...
    def clone(self, t: Tensor) -> Tensor: ...
    def to_device_of(self, t: Tensor, like: Tensor) -> Tensor: ...

    # ---- ops: traits and re-runs ----------------------------------------------------------
    def is_random(self, func) -> bool: ...
    def returns_alias(self, func) -> bool: ...
    def user_stack(self) -> tuple: ...
    def cast_args(self, args, kwargs, dtype_map: dict[str, str], device: str | None = None,
                  scratch=None) -> tuple[tuple, dict]:
        """Floating tensors (and dtype arguments) converted per ``{"float16": "float32"}``,
        moved to ``device`` if given; with ``scratch`` into reusable memory."""
    def protect_written(self, func, args, kwargs, original_args, original_kwargs) -> tuple[tuple, dict]:
        """A re-run must never write into the training's tensors: private copies of those it writes."""
    def run(self, func, args, kwargs, device_type: str = "cpu", tf32: bool = False):
        """Call the op again, outside any autocast region."""
    def device_type(self, t: Tensor) -> str: ...
    def input_grads(self, func, args, kwargs, grad_outs, generator, device_type: str, fixup=None):
        """``(gradients of the floating inputs, output gradients used)`` of one call, or None."""
    def replacement(self, original, result):
        """The re-run's outputs in the original's dtype, device and strides (``fix``)."""

    # ---- inline checks: numbers on the device, read back in batches ---------------------------
    def sq_norm(self, t: Tensor) -> Pending:
        """Squared L2 norm accumulated in float32 (float64 for float64): finite iff the tensor is,
        unless the squares overflow float32 (callers re-check with :meth:`all_finite`)."""
    def read(self, values) -> list:
        """Pending values read back with one host sync: a list of scalars gives a list of floats,
        one pending vector or matrix its (nested) list."""
    def all_finite(self, t: Tensor) -> bool: ...
    def nonfinite_counts(self, t: Tensor) -> tuple[int, int]: ...
    def max_abs_finite(self, t: Tensor) -> float: ...
    def dtype_max(self, dtype_name: str) -> float: ...
    def eps(self, dtype_name: str) -> float: ...

    # ---- free benchmark: perturbations and the measure --------------------------------------
    def generator(self, seed: int): ...
    def noise_source(self, seed: int):
        """An object whose ``apply(t)`` gives x * (1 + u * eps(dtype)) from its own seeded generator."""
    def bit_noise(self, t: Tensor) -> Tensor: ...
    def change_value_plan(self, func, args, kwargs):
        """``(args, output fix-up or None)`` with reduced operands' first/last entries swapped, or None."""
    def scratch(self):
        """Reusable host memory for one op's temporaries (``reset()`` between ops)."""
    def surely_within(self, actual: Tensor, expected: Tensor, limit: float, small: float, scratch=None) -> bool:
        """A conservative screen: True only when the measure is certainly within ``limit``."""
    def within_limits(self, actuals: list, expecteds: list, limits: list, small: float) -> Pending:
        """Per pair, on the device: the screen over many pairs at once."""
    def changes(self, actuals: list, expecteds: list, small: float) -> Pending:
        """The measure (:func:`dispatchprobe.standards.metrics.perturbation_terms`) per pair:
        ``(n, 2)`` rows of (max_rel, sign_flips), on the device."""
    def concat(self, pending: list) -> Pending: ...


def missing_members(backend) -> list[str]:
    """Members of :class:`TensorBackend` that ``backend`` lacks (an adapter's self-check)."""
    wanted = [n for n in dir(TensorBackend) if not n.startswith("_")] + list(TensorBackend.__annotations__)
    return sorted({n for n in wanted if not hasattr(backend, n)})
