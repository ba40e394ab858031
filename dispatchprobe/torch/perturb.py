"""The inline-check primitives of the torch backend (contract:
:class:`~dispatchprobe.core.tensor_backend.TensorBackend`, re-exported by :mod:`dispatchprobe.torch.tensor_backend`):
walk an op's tensors, re-run it, perturb its inputs, screen and measure changes on their device.

All of it runs inside a handler (dispatch mode popped, ``no_grad``), so none of these ops is
recorded; random perturbations draw from the handler's own ``torch.Generator``, never the global RNG.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

from ..core import nested_values
from ..standards.loader import per_dtype
from . import ops, tensor_kinds
from .internals.dispatch import autograd_on, tree_flatten, tree_unflatten
from .internals.tensors import foreach_norm

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_aten = torch.ops.aten


def protect_written(func, args, kwargs, original_args, original_kwargs):
    """``args``/``kwargs`` for a re-run, with a private copy of every tensor the op writes to
    that is still the caller's object (``fill_``/``copy_`` get the training tensor itself):
    a re-run never writes into the training's tensors."""
    written = ops.written_args(func)
    if not written:
        return args, kwargs
    args, kwargs = list(args), dict(kwargs)
    for i, name in written:
        if i < len(args) and isinstance(args[i], torch.Tensor) and i < len(original_args) \
                and args[i] is original_args[i]:
            args[i] = args[i].detach().clone()
        elif isinstance(kwargs.get(name), torch.Tensor) and kwargs[name] is original_kwargs.get(name):
            kwargs[name] = kwargs[name].detach().clone()
    return tuple(args), kwargs


def float_tensors(obj) -> list[torch.Tensor]:
    """The non-empty dense floating tensors in an op's arguments or outputs (nested tuples,
    lists and dicts: all an aten call holds; a plain walk, cheaper than pytree)."""
    out: list = []
    _collect(obj, out)
    return out


def _collect(obj, out: list) -> None:
    if isinstance(obj, torch.Tensor):
        # only memory the probe may read (tensor_kinds): a zero tensor, an FSDP parameter between
        # all-gathers, a fake or wrapper tensor is neither checked nor perturbed
        if obj.dtype in FLOATS and obj.numel() > 0 and tensor_kinds.readable(obj):
            out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            if isinstance(v, (torch.Tensor, tuple, list, dict)):
                _collect(v, out)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect(v, out)


def versions(tensors) -> tuple:
    """The in-place version counters: a check read back later tells by them whether an op's
    inputs still hold what the op saw."""
    return tuple(tensor_kinds.version(t) for t in tensors)


def float_outputs(outputs) -> list[tuple[int, torch.Tensor]]:
    """(output index, tensor) of every float tensor output; nested lists flattened."""
    items = outputs if isinstance(outputs, (tuple, list)) else [outputs]
    return [(i, t) for i, o in enumerate(items) for t in float_tensors(o)]


def swap_tensors(outputs, replacements: dict):
    """``outputs`` (a tensor or nested tuples/lists) with every tensor in ``replacements``
    (keyed by ``id``) replaced: a handler must not keep the training's own output objects, since
    autograd steals a gradient into ``.grad`` only when no one else holds it (else it copies)."""
    if isinstance(outputs, torch.Tensor):
        return replacements.get(id(outputs), outputs)
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(swap_tensors(o, replacements) for o in outputs)
    return outputs


def sq_norm(t: torch.Tensor) -> torch.Tensor:
    """L2 norm accumulated in float32 (float64 for float64): inf/nan iff the tensor has one,
    except when float32 squares overflow (|x| > ~1e19), which callers re-check exactly."""
    x = t.detach()
    if x.dtype == torch.float32 and x.is_contiguous():
        flat = x.view(-1)
        return torch.dot(flat, flat)        # squared norm: one BLAS pass; callers take sqrt
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    n = torch.linalg.vector_norm(x, dtype=acc)
    return n * n


def all_finite(t: torch.Tensor) -> bool:
    """Exact: one fused min/max pass (nan and inf reach one of them), no bool tensor.  False
    when the memory is gone by now (FSDP freed it before a deferred check): the norm taken
    when the op ran stands."""
    if not tensor_kinds.readable(t):
        return False
    try:
        lo, hi = torch.aminmax(t.detach())
    except (RuntimeError, NotImplementedError):     # no aminmax for this dtype/device
        return bool(torch.isfinite(t).all())
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def nonfinite_counts(t: torch.Tensor) -> tuple[int, int]:
    if not tensor_kinds.readable(t):     # freed before a deferred check: not counted
        return 0, 0
    return int(torch.isnan(t).sum()), int(torch.isinf(t).sum())


class Scratch:
    """Reusable CPU memory for the temporaries of one op's check (input casts, screen buffers),
    handed out front to back and taken back at once by :meth:`reset`: faulting in fresh pages
    costs more than the cast written into them.  Only for values that die with the check."""

    MIN_NUMEL = 1 << 16      # below this a fresh tensor is cheaper than slicing and viewing
    MAX_BYTES = 256 << 20    # the buffer (kept between ops) never grows beyond this

    def __init__(self):
        self._buf = torch.empty(0, dtype=torch.uint8)
        self._used = 0

    def reset(self) -> None:
        self._used = 0

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor: a slice of the buffer, or fresh memory when small or too big."""
        numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        start = -(-self._used // 64) * 64
        if numel < self.MIN_NUMEL or start + nbytes > self.MAX_BYTES:
            return torch.empty(shape, dtype=dtype)
        if start + nbytes > self._buf.numel():      # grow; blocks already handed out keep the old one
            self._buf = torch.empty(min(self.MAX_BYTES, max(start + nbytes, 2 * self._buf.numel())),
                                    dtype=torch.uint8)
        self._used = start + nbytes
        return self._buf[start:start + nbytes].view(dtype).view(shape)

    def cast(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``t`` converted to ``dtype`` (contiguous), in the buffer when that pays."""
        if t.device.type != "cpu" or t.layout != torch.strided or t.numel() < self.MIN_NUMEL:
            return _detached(t).to(dtype)
        return self.take(t.shape, dtype).copy_(_detached(t))


def _detached(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the source of a copy outside autograd's graph: itself under no_grad (the
    handlers' case, sparing a dispatcher call per input)."""
    return t.detach() if t.requires_grad and torch.is_grad_enabled() else t


def cast_args(args, kwargs, dtype_map: dict, device=None, scratch: Scratch | None = None):
    """Floating tensors (and floating ``dtype`` arguments) converted per ``dtype_map``
    ({from: to}, by name: ``{"bfloat16": "float32"}``); tensors moved to ``device`` if given.
    Other values unchanged.  With ``scratch``, CPU casts are written into it (contiguous)."""
    dtype_map = {getattr(torch, a): getattr(torch, b) for a, b in dtype_map.items()}
    device = torch.device(device) if isinstance(device, str) else device

    def conv(v):
        if isinstance(v, torch.Tensor):
            to = dtype_map.get(v.dtype, v.dtype)
            if to != v.dtype or (device is not None and v.device != device):
                if scratch is not None and device is None:
                    return scratch.cast(v, to)
                return _detached(v).to(device=device or v.device, dtype=to)
            return v
        if isinstance(v, torch.dtype):
            return dtype_map.get(v, v)
        if isinstance(v, torch.device) and device is not None:
            return device
        return v
    return map_args(conv, args, kwargs)


def map_floats(fn, args, kwargs):
    """``fn`` applied to every non-empty floating tensor of an op's (args, kwargs)."""
    return map_args(lambda v: fn(v) if isinstance(v, torch.Tensor) and v.dtype in FLOATS and v.numel() > 0
                    else v, args, kwargs)


def map_args(fn, args, kwargs):
    """``fn`` applied to every leaf of an aten call's (args, kwargs), nested tuples, lists and
    dicts walked directly (cheaper than pytree around small ops)."""
    def walk(v):
        if isinstance(v, (tuple, list)):
            return type(v)(walk(x) for x in v)
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        return fn(v)
    return tuple(walk(v) for v in args), {k: walk(v) for k, v in kwargs.items()}


@contextlib.contextmanager
def tf32_matmul():
    """CUDA float32 matmuls on TF32 tensor cores for the duration, then the user's setting back.

    Only for re-runs of ops whose float inputs were *all* 16-bit: those are exact in TF32, and
    products accumulate in float32, so the result is a float32 reference within accumulation
    rounding (~2^-23 per add).  A float32 operand would be rounded to TF32: never mixed ops."""
    m = torch.backends.cuda.matmul
    name = "fp32_precision" if hasattr(m, "fp32_precision") else "allow_tf32"   # new API: torch >= 2.9
    prev = getattr(m, name)
    setattr(m, name, "tf32" if name == "fp32_precision" else True)
    try:
        yield
    finally:
        setattr(m, name, prev)


def run(func, args, kwargs, device_type: str = "cpu", tf32: bool = False):
    """The op called again, never re-cast by an enclosing autocast region (entered only when
    autocast is on: the contexts cost more than a small op).  ``tf32``: on CUDA, float32 matmuls
    may use TF32 (:func:`tf32_matmul`; the caller vouches that every float input was 16-bit)."""
    try:
        plain = not (torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled(device_type))
    except RuntimeError:          # a device type autocast does not know
        plain = False
    tf32 = tf32 and device_type == "cuda"
    if plain and not tf32:
        return func(*args, **kwargs)
    with contextlib.ExitStack() as stack:
        if tf32:
            stack.enter_context(tf32_matmul())
        if not plain:
            for dev in {"cpu", device_type}:
                try:
                    stack.enter_context(torch.autocast(dev, enabled=False))
                except RuntimeError:    # a device type autocast does not know
                    pass
        return func(*args, **kwargs)


def _as_float32(t: torch.Tensor, scratch: Scratch | None) -> torch.Tensor:
    if t.dtype == torch.float32:
        return t
    if scratch is not None:
        return scratch.cast(t, torch.float32)
    return t.to(torch.float32)


# Margins of the float32 screens against the float64 measure: the floor (an rms from a float32
# sum of squares) is taken 0.1% low, the bound must hold 1e-5 inside the limit.
FLOOR_MARGIN, LIMIT_MARGIN = 1e-3, 1e-5


def surely_within(actual: torch.Tensor, expected: torch.Tensor, limit: float, small: float,
                  scratch: Scratch | None = None) -> bool:
    """A cheap, conservative screen before the measure (:func:`metrics.perturbation_terms` via
    :func:`changes`): True only when that measure is certainly <= ``limit`` (a False goes to it).
    Every element's error is at most ``max|a - e|`` and its floor at least ``max(small, rms(e))``;
    failing that, the measure's bound ``|a - e| <= limit * max(|e|, floor)`` is checked
    elementwise with the floor taken ``FLOOR_MARGIN`` low.  In float32 on the tensors' device
    (float64 only when both sides are): a float64 side is rounded to float32 once, and that
    rounding (2**-24 relative, also on rms(e)) is taken off the limit, so the screen stays an
    upper bound of the float64 measure.  Ops exact in float32 end at ``torch.equal``."""
    a, e = actual.detach(), expected.detach()
    if a.device != e.device:
        a = a.to(e.device)
    slack = 0.0
    if a.dtype != torch.float64 or e.dtype != torch.float64:
        if e.dtype == torch.float64 or a.dtype == torch.float64:
            slack = 2.0 ** -23
        a, e = _as_float32(a, scratch), _as_float32(e, scratch)
    if torch.equal(a, e):       # exits at the first difference: nearly free when they differ
        if not slack:
            return True
        # equal to the float64 reference rounded to float32: at most 2**-24 off where finite;
        # unless rounding made a finite float64 value inf (then the measure says inf)
        wide, rounded = (expected, e) if expected.dtype == torch.float64 else (actual, a)
        lo, hi = torch.aminmax(rounded)
        if math.isfinite(lo) and math.isfinite(hi) or \
                int(torch.isinf(wide).sum()) == int(torch.isinf(rounded).sum()):
            return True
    buffered = scratch is not None and a.device.type == "cpu" and e.numel() >= scratch.MIN_NUMEL
    diff = torch.sub(a, e, out=scratch.take(e.shape, e.dtype)) if buffered else a - e
    lo, hi = torch.aminmax(diff)
    sq = sq_norm(e)         # squared norm, one BLAS dot when e is contiguous float32
    lo, hi, sq = torch.stack([lo, hi, sq.to(lo.dtype)]).tolist()
    r = math.sqrt(sq / max(e.numel(), 1)) if math.isfinite(sq) else math.inf
    d = max(-lo, hi)
    if not (math.isfinite(d) and math.isfinite(r)):
        return False                          # inf/nan: the measure decides
    floor = max(small, r)
    if d <= (limit - slack) * floor * (1 - LIMIT_MARGIN):
        return True
    # elementwise, with the floor taken low (a lower floor can only raise the ratio, so this
    # stays an upper bound of the float64 measure)
    out = scratch.take(e.shape, e.dtype) if buffered else None
    ratio = _relative_errors(diff, e, floor * (1 - FLOOR_MARGIN), out)
    return float(ratio.max()) <= (limit - slack) * (1 - LIMIT_MARGIN)


def _relative_errors(diff: torch.Tensor, e: torch.Tensor, floor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The measure's elementwise term ``|a - e| / max(|e|, floor)``, written into ``diff``
    (``a - e``); ``floor`` a number or one value per element; ``|e|`` goes to ``out`` (may be
    ``e`` itself) or fresh memory."""
    den = e.abs() if out is None else torch.abs(e, out=out)
    den = den.clamp_(min=floor) if isinstance(floor, float) else torch.maximum(den, floor, out=den)
    return diff.abs_().div_(den)


class Segments:
    """The reductions of :func:`metrics.perturbation_terms` per segment of a flat concatenation
    (one per measured output), so a window of measures costs a few kernel launches, not a few per
    op.  Sums and maxima are ``_foreach_norm`` (one multi-tensor kernel) over the segments: every
    reduced value is >= 0, so the 1-, 2- and inf-norms are the sum, root of the sum of squares, max."""

    def __init__(self, lengths: list[int]):
        self.lengths = lengths

    def _norms(self, x, order):
        return torch.stack(foreach_norm(list(x.split(self.lengths)), order))

    def count(self, mask):
        return self._norms(mask.to(torch.float64), 1)

    def sumsq(self, x):
        return self._norms(x, 2) ** 2

    def max(self, x):
        return self._norms(x, float("inf"))

    def spread(self, per_segment):
        return torch.cat([v.expand(n) for v, n in zip(per_segment.unbind(), self.lengths)])


def _concat(tensors: list, dtype: torch.dtype) -> torch.Tensor:
    """The tensors flattened into one ``dtype`` vector on their device (one cast on the way)."""
    total = sum(t.numel() for t in tensors)
    out = torch.empty(total, dtype=dtype, device=tensors[0].device)
    return torch.cat([t.reshape(-1) for t in tensors], out=out)


def within_limits(actuals: list, expecteds: list, limits: list, small: float) -> torch.Tensor:
    """Per pair, on the pairs' device, nothing read back: True where the float64 measure
    (:func:`changes`) is certainly within its limit -- its elementwise bound in float32 over the
    concatenated pairs, per segment, with the margins and float64 rounding slack of
    :func:`surely_within`.  inf/nan in a pair, or a float32 sum of squares that overflows, never clears."""
    device = expecteds[0].device
    slack = 2.0 ** -23 if any(t.dtype == torch.float64 for t in (*actuals, *expecteds)) else 0.0
    a, e = _concat(actuals, torch.float32), _concat(expecteds, torch.float32)
    lengths = [t.numel() for t in expecteds]
    seg = Segments(lengths)
    sumsq = seg.sumsq(e)
    counts = torch.tensor(lengths, dtype=torch.float32).to(device, non_blocking=True)
    floor = (sumsq / counts).sqrt().clamp(min=small) * (1 - FLOOR_MARGIN)
    ratio = _relative_errors(a.sub_(e), e, seg.spread(floor), out=e)
    bound = [(limit - slack) * (1 - LIMIT_MARGIN) for limit in limits]
    bound = torch.tensor(bound, dtype=torch.float32).to(device, non_blocking=True)
    return (seg.max(ratio) <= bound) & torch.isfinite(sumsq)


def changes(actuals: list, expecteds: list, small: float) -> torch.Tensor:
    """:func:`metrics.perturbation_terms` of each (actual, expected) pair, as one (n, 2) float64
    tensor of (max_rel, sign_flips) rows on the pairs' device (nothing read back).  In float64:
    squares of large values overflow float32 and would hide a finding behind an infinite floor."""
    from ..standards.metrics import perturbation_terms
    a, e = _concat(actuals, torch.float64), _concat(expecteds, torch.float64)
    seg = Segments([t.numel() for t in expecteds])
    max_rel, flips = perturbation_terms(a, e, small, torch, seg)
    return torch.stack([max_rel, flips], dim=1)


# ---- free-benchmark perturbations -------------------------------------------------------------
def eps(dtype) -> float:
    """Machine epsilon of a torch dtype or a dtype name."""
    return float(torch.finfo(getattr(torch, dtype) if isinstance(dtype, str) else dtype).eps)


def dtype_max(name: str) -> float:
    return float(torch.finfo(getattr(torch, name)).max)


@functools.cache
def small_value(dtype: torch.dtype) -> float:
    """msprobe's small-value threshold (``standards.yaml``): below it, no noise."""
    return per_dtype("small_value", ops.dtype_name(dtype))


_INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
             torch.float64: torch.int64}


def _noisy_mask(x: torch.Tensor) -> torch.Tensor:
    """1 where an element gets noise (finite, |x| >= the small-value threshold), else 0, in
    x's dtype; built in place in one buffer, with no bool tensor and no ``isfinite`` passes."""
    ax = x.abs()
    ax.nan_to_num_(nan=0.0, posinf=0.0)
    return ax.ge_(small_value(x.dtype))


def bit_noise(t: torch.Tensor) -> torch.Tensor:
    """Flip the last mantissa bit of every finite element with |x| >= the small-value threshold."""
    x = t.detach()
    if not x.is_contiguous():
        x = x.contiguous()
    ints = _INT_VIEW[x.dtype]
    return _noisy_mask(x).to(ints).bitwise_xor_(x.view(ints)).view(x.dtype).view(t.shape)


class NoiseSource:
    """Multiplicative noise factors 1 + u * eps(dtype), u uniform in [-1, 1), from the caller's
    seeded ``torch.Generator`` (never the global RNG).

    A fresh uniform per element would cost more than the training step, so ``_POOL`` factors (a
    prime, out of step with power-of-two dimensions) are drawn once per (dtype, device) and read
    from a random offset per tensor and ``_CHUNK``: uniform factors, repeating every ``_POOL``
    elements.  Factors are float32 (float64 for float64): the 16-bit product is rounded once."""

    _POOL = 65521
    _CHUNK = 1 << 22

    def __init__(self, gen: torch.Generator):
        self.gen = gen
        self._tiled: dict = {}

    def _deltas(self, dtype, device, n):
        """u * eps(dtype), tiled to cover n + _POOL elements, float32 (float64 for float64)."""
        key = (dtype, device)
        tiled = self._tiled.get(key)
        if tiled is None or tiled.numel() < min(n, self._CHUNK) + self._POOL:
            if tiled is None:
                e = eps(dtype)
                u = torch.rand(self._POOL, generator=self.gen, dtype=torch.float64, device="cpu")
                pool = u.mul_(2 * e).sub_(e).to(dtype=torch.float64 if dtype == torch.float64
                                                 else torch.float32, device=device)
            else:
                pool = tiled[:self._POOL]
            reps = -(-(min(n, self._CHUNK) + self._POOL) // self._POOL)
            tiled = self._tiled[key] = pool.repeat(reps)
        return tiled

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        """x * (1 + u * eps) where x is finite and |x| >= the small-value threshold, x elsewhere.

        The factor (0/1 mask, times the deltas, plus 1) is built in place in one buffer: exactly 1
        where the mask is 0, so small values, inf and nan are unchanged."""
        x = t.detach()
        n = x.numel()
        wide = torch.float64 if x.dtype == torch.float64 else torch.float32
        deltas = self._deltas(x.dtype, x.device, n)
        flat = x.reshape(-1)
        chunks = []
        for start in range(0, n, self._CHUNK):
            part = flat[start:start + self._CHUNK]
            factor = _noisy_mask(part)            # in x's dtype: its small-value threshold
            if part.dtype != wide:
                part, factor = part.to(wide), factor.to(wide)
            off = int(torch.randint(self._POOL, (1,), generator=self.gen))
            factor.mul_(deltas[off:off + part.numel()]).add_(1.0)
            chunks.append(factor.mul_(part))
        out = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
        return _never_overflowed(out.to(x.dtype).view(x.shape), x)


def _never_overflowed(noisy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``noisy`` with ``x``'s own value wherever the noise pushed a finite value past the dtype's
    range: a mask filled with ``finfo.min`` (T5, BERT) times 1 + eps is -inf, and every op reading
    it would be flagged for an inf the training never had.  (x is kept where it was inf itself: the
    noise leaves inf alone.)  On CPU one min/max pass decides whether anything is inf; on an
    accelerator the select runs unconditionally, sparing a host sync per tensor."""
    if noisy.device.type == "cpu":
        lo, hi = torch.aminmax(noisy)
        if math.isfinite(lo) and math.isfinite(hi):
            return noisy
    return torch.where(torch.isinf(noisy), x, noisy)


def saturated(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with +-inf replaced by its dtype's largest finite value (nan stays nan)."""
    info = torch.finfo(t.dtype)
    return t.clamp(min=info.min, max=info.max)


def swap_first_last(t: torch.Tensor, dim: int) -> torch.Tensor:
    """A copy with the first and last slices along ``dim`` exchanged.  Differentiable (no
    ``detach``): with autograd on, gradients flow back to ``t`` in its own layout; the handlers'
    no_grad keeps it out of any graph otherwise."""
    n = t.shape[dim]
    if n < 2:
        return t.clone()
    idx = torch.arange(n, device=t.device)
    idx[0], idx[-1] = n - 1, 0
    return t.index_select(dim, idx)


# ops that reduce along dims named by the ``dim`` argument (output invariant under a swap) and
# ops whose output is permuted the same way as the input along ``dim``
_REDUCE_DIM = {_aten.sum, _aten.mean, _aten.amax, _aten.amin, _aten.logsumexp, _aten.prod, _aten.var,
               _aten.std, _aten.linalg_vector_norm, _aten.norm}
_PERMUTE_DIM = {_aten._softmax, _aten._log_softmax, _aten.cumsum}


def change_value_plan(func, args, kwargs):
    """How to apply ``change_value`` to this call: (new_args, fix_output) or None if unsupported.

    The first and last entries along the dimension the op reduces over are exchanged in every
    operand that is reduced, so the exact result is unchanged and any difference is rounding
    that depends on the order of the summands ("large eats small")."""
    packet = func.overloadpacket
    args = list(args)
    if packet in (_aten.mm, _aten.bmm) and len(args) >= 2:
        args[0], args[1] = swap_first_last(args[0], -1), swap_first_last(args[1], -2)
        return tuple(args), None
    if packet is _aten.addmm and len(args) >= 3:
        args[1], args[2] = swap_first_last(args[1], -1), swap_first_last(args[2], -2)
        return tuple(args), None
    if packet in _REDUCE_DIM or packet in _PERMUTE_DIM:
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return None
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if isinstance(dim, (list, tuple)):
            dim = dim[0] if dim else None
        if packet in _PERMUTE_DIM:
            if not isinstance(dim, int):
                return None
            args[0] = swap_first_last(x, dim)
            return tuple(args), (lambda out, d=dim: swap_first_last(out, d))
        if not isinstance(dim, int):
            dim = max(range(x.dim()), key=lambda d: x.shape[d])   # a full reduction: any dim
        args[0] = swap_first_last(x, dim)
        return tuple(args), None
    return None


# ---- the rest of the contract: one-line helpers the handlers call ------------------------------
def on_host(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def device_type(t: torch.Tensor) -> str:
    return t.device.type


def read(values) -> list:
    """One host sync: a list of 0-d tensors (dtypes promote) or one tensor, as Python values."""
    return (torch.stack(values) if isinstance(values, (list, tuple)) else values).tolist()


def concat(values: list) -> torch.Tensor:
    return torch.cat(values)


def detach(t: torch.Tensor) -> torch.Tensor:
    return t.detach()


def clone(t: torch.Tensor) -> torch.Tensor:
    return t.clone()


def to_device_of(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t if t.device == like.device else t.to(like.device)


def max_abs_finite(t: torch.Tensor) -> float:
    finite = t[torch.isfinite(t)]
    return float(finite.abs().max()) if finite.numel() else 0.0


def generator(seed: int) -> torch.Generator:
    """A private CPU generator: the probe never draws from the global RNG."""
    return torch.Generator().manual_seed(seed)


def noise_source(seed: int) -> NoiseSource:
    return NoiseSource(generator(seed))


def scratch() -> Scratch:
    return Scratch()


def replacement(original, result):
    """The re-run's outputs in the original's dtype, device and strides (``fix``)."""
    def one(orig, new):
        if not isinstance(orig, torch.Tensor) or not isinstance(new, torch.Tensor) or \
                orig.dtype not in FLOATS or new.shape != orig.shape:
            return orig
        out = torch.empty_like(orig)
        out.copy_(new)
        return out
    return nested_values.pair_outputs(original, result, lambda t: isinstance(t, torch.Tensor), one)


def differentiated_inputs(flat: list, training_flat: list) -> list[int]:
    """Positions in ``flat`` (a call's flattened arguments) to differentiate: the float inputs
    the training differentiates (``requires_grad`` in ``training_flat``, the training's own call,
    flattened alike), so an input autograd refuses to differentiate (an attention mask passed to
    ``_scaled_dot_product_flash_attention_for_cpu``) no longer costs the whole check; every float
    input where the training's call says nothing (no input requires grad: an op inside a compiled
    graph, which runs under no_grad)."""
    floats = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor) and v.dtype in FLOATS and v.numel() > 0]
    if len(training_flat) != len(flat):
        return floats
    trained = [i for i in floats if isinstance(training_flat[i], torch.Tensor) and training_flat[i].requires_grad]
    return trained or floats


def input_grads(func, args, kwargs, grad_outs, gen, device, fixup=None, perturb=None, training_call=None):
    """Gradients of the op's float inputs for the given (or fresh seeded random) output grads.
    ``perturb`` (``(args, kwargs) -> (args, kwargs, fixup)``) runs on the differentiated inputs
    with autograd on, so a perturbation that moves elements (``change_value``'s swap) hands back
    gradients in the inputs' own layout, comparable element by element with the unperturbed ones.
    ``training_call`` (the training's ``(args, kwargs)``; default ``args, kwargs``) says which
    inputs to differentiate: :func:`differentiated_inputs`."""
    flat, spec = tree_flatten((tuple(args), dict(kwargs)))
    leaves = []
    training_flat = flat if training_call is None else tree_flatten((tuple(training_call[0]), dict(training_call[1])))[0]
    for i in differentiated_inputs(flat, training_flat):
        flat[i] = flat[i].detach().clone().requires_grad_(True)
        leaves.append(flat[i])
    if not leaves:
        return None
    a, k = tree_unflatten(flat, spec)
    with autograd_on():
        if perturb is not None:
            a, k, fixup = perturb(a, k)
        out = run(func, a, k, device)
        if fixup is not None:
            out = fixup(out)
        outs = [t for _, t in float_outputs(out) if t.requires_grad]
        if not outs:
            return None
        if grad_outs is None:
            grad_outs = [torch.randn(t.shape, generator=gen, dtype=torch.float32).to(device=t.device, dtype=t.dtype)
                         for t in outs]
        grads = torch.autograd.grad(outs, leaves, [g.to(t.dtype) for g, t in zip(grad_outs, outs)],
                                    allow_unused=True)
    return list(grads), grad_outs
