"""Torch tensor helpers of the inline checks (``overflow`` and ``free_benchmark``).

Everything here runs inside a handler, i.e. with the probe's dispatch mode popped and under
``no_grad``: none of these ops is recorded.  Random perturbations draw from the caller's own
``torch.Generator``, never from the global RNG.  The handlers keep the logic; this module is
the only place that touches torch tensors, so another framework's backend would supply the
same few functions.
"""

from __future__ import annotations

import contextlib
import math
import threading
import traceback

import torch
from torch.utils._pytree import tree_flatten, tree_map

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
HALF = (torch.float16, torch.bfloat16)
_aten = torch.ops.aten

# Ops that draw random numbers: re-running them would consume the global RNG and give other
# values by design.  Never re-run (any op with a ``generator`` argument is added on first use).
_RANDOM_PACKETS = {_aten.native_dropout, _aten.bernoulli, _aten.bernoulli_, _aten.uniform_, _aten.normal_,
                   _aten.rand, _aten.randn, _aten.rand_like, _aten.randn_like, _aten.randint, _aten.randint_like,
                   _aten.randperm, _aten.multinomial, _aten.exponential_, _aten.geometric_, _aten.cauchy_,
                   _aten.log_normal_, _aten.random_, _aten.rrelu_with_noise, _aten.normal}
_random_memo: dict = {}


def is_random(func) -> bool:
    hit = _random_memo.get(func)
    if hit is None:
        hit = func.overloadpacket in _RANDOM_PACKETS or any(
            a.name == "generator" for a in func._schema.arguments)
        _random_memo[func] = hit
    return hit


def returns_alias(func) -> bool:
    """True for ops whose output aliases an input (in-place, out=, views): not replaceable."""
    return any(r.alias_info is not None for r in func._schema.returns)


def float_tensors(obj) -> list[torch.Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor) and t.dtype in FLOATS
            and t.layout == torch.strided and not t.is_meta and t.numel() > 0]


def has_nonfinite_scalar(obj) -> bool:
    return any(isinstance(v, float) and not math.isfinite(v) for v in tree_flatten(obj)[0])


def flat_with_index(outputs) -> list[tuple[int, torch.Tensor]]:
    """(output index, tensor) of every float tensor output; nested lists flattened."""
    items = outputs if isinstance(outputs, (tuple, list)) else [outputs]
    out = []
    for i, o in enumerate(items):
        for t in float_tensors(o):
            out.append((i, t))
    return out


def norm32(t: torch.Tensor) -> torch.Tensor:
    """L2 norm accumulated in float32 (float64 for float64): inf/nan iff the tensor has one,
    except when float32 squares overflow (|x| > ~1e19), which callers re-check exactly."""
    x = t.detach()
    if x.dtype == torch.float32 and x.is_contiguous():
        flat = x.view(-1)
        return torch.dot(flat, flat)        # squared norm: one BLAS pass; callers take sqrt
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    n = torch.linalg.vector_norm(x, dtype=acc)
    return n * n


def nonfinite_counts(t: torch.Tensor) -> tuple[int, int]:
    return int(torch.isnan(t).sum()), int(torch.isinf(t).sum())


@contextlib.contextmanager
def no_autocast(device_type: str = "cpu"):
    """Re-runs of an aten op must not be re-cast by an enclosing autocast region."""
    with contextlib.ExitStack() as stack:
        for dev in {"cpu", device_type}:
            try:
                stack.enter_context(torch.autocast(dev, enabled=False))
            except RuntimeError:
                pass
        yield


@contextlib.contextmanager
def autograd_on():
    """Autograd back on inside ``__torch_dispatch__`` (which runs below it, with the autograd
    keys excluded), so a handler can differentiate a re-run of the op.  Only the Python key
    stays excluded; autocast is kept off by :func:`run`."""
    keys = torch._C._dispatch_tls_local_include_set()
    with torch._C._ForceDispatchKeyGuard(keys, torch._C.DispatchKeySet(torch._C.DispatchKey.Python)), \
            torch.enable_grad():
        yield


def cast_args(args, kwargs, dtype_map: dict, device=None):
    """Floating tensors (and floating ``dtype`` arguments) converted per ``dtype_map``
    ({from: to}); tensors moved to ``device`` if given.  Other values unchanged."""

    def conv(v):
        if isinstance(v, torch.Tensor):
            to = dtype_map.get(v.dtype, v.dtype)
            if to != v.dtype or (device is not None and v.device != device):
                return v.detach().to(device=device or v.device, dtype=to)
            return v
        if isinstance(v, torch.dtype):
            return dtype_map.get(v, v)
        if isinstance(v, torch.device) and device is not None:
            return device
        return v
    return tree_map(conv, tuple(args)), tree_map(conv, dict(kwargs))


# ---- threads -----------------------------------------------------------------------------------
# The checks' own CPU work (norms, perturbed copies, comparisons) is a few short memory-bound
# passes per op.  Run on several intra-op threads, each pass is a parallel region whose cost is
# a thread hand-off; on a busy host (more runnable threads than cores) that hand-off costs a
# scheduler time slice (milliseconds) instead of microseconds, so a pass on a 1 MB tensor took
# 1-8 ms on 2 threads against 0.03 ms on 1.  The handlers therefore do their own work on one
# thread, for tensors up to _SERIAL_MAX elements (beyond that, parallel passes pay off), and
# re-run the op itself (:func:`run`) on the user's thread count, so a re-run computes exactly
# what the original call did.  The count is restored before the training run continues.
_SERIAL_MAX = 1 << 21
_threads = threading.local()


@contextlib.contextmanager
def own_threads(tensors):
    """The handler's own work on one CPU thread (see above); a no-op off CPU or for big tensors."""
    n = torch.get_num_threads()
    if n == 1 or not tensors or tensors[0].device.type != "cpu" or \
            max(t.numel() for t in tensors) > _SERIAL_MAX:
        yield
        return
    stack = _threads.__dict__.setdefault("user", [])
    stack.append(n)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        stack.pop()
        torch.set_num_threads(n)


def run(func, args, kwargs, device_type: str = "cpu"):
    """Call the op again as the training run did: autocast off, the user's intra-op threads."""
    user = _threads.__dict__.get("user")
    if not user:
        with no_autocast(device_type):
            return func(*args, **kwargs)
    torch.set_num_threads(user[-1])
    try:
        with no_autocast(device_type):
            return func(*args, **kwargs)
    finally:
        torch.set_num_threads(1)


def user_stack(skip: int = 2) -> tuple:
    """The Python frames of user code at this moment (torch and dispatchprobe frames left out)."""
    import dispatchprobe
    skip_prefixes = (torch.__path__[0], dispatchprobe.__path__[0], "<frozen ", "contextlib.py")
    frames = traceback.extract_stack()[:-skip]
    return tuple(f"{f.filename}:{f.lineno} in {f.name}" for f in frames if not f.filename.startswith(skip_prefixes))


def surely_within(actual: torch.Tensor, expected: torch.Tensor, limit: float, small: float) -> bool:
    """A cheap, conservative screen before :func:`metrics.perturbation_change`: True only when
    that measure is certainly <= ``limit`` (every element's error is at most ``max|a - e|`` and
    its floor at least ``max(small, rms(e))``).  Not a second metric: a False goes to the
    metric.  Runs in torch on the tensors' device in float32 (float64 only when both sides are
    float64): a float64 reference (``improve_precision`` of float32) is rounded to float32 once,
    and that rounding (relative 2**-24, also on rms(e)) is taken off the limit, so the screen
    stays an upper bound on the float64 measure.  Three passes: equal (exits at the first
    difference), a - e, and one fused min/max; plus the norm of e."""
    a, e = actual.detach(), expected.detach()
    if a.device != e.device:
        a = a.to(e.device)
    slack = 0.0
    if a.dtype != torch.float64 or e.dtype != torch.float64:
        if e.dtype == torch.float64:
            e, slack = e.to(torch.float32), 2.0 ** -23
        elif e.dtype != torch.float32:
            e = e.to(torch.float32)
        if a.dtype == torch.float64:
            a, slack = a.to(torch.float32), 2.0 ** -23
        elif a.dtype != torch.float32:
            a = a.to(torch.float32)
    if not slack and torch.equal(a, e):
        return True
    lo, hi = torch.aminmax(a - e)
    rms = torch.linalg.vector_norm(e) / math.sqrt(max(e.numel(), 1))
    lo, hi, r = torch.stack([lo, hi, rms]).tolist()
    d = max(-lo, hi)
    return math.isfinite(d) and math.isfinite(r) and d <= (limit - slack) * max(small, r) * (1 - 1e-5)


# ---- free-benchmark perturbations -------------------------------------------------------------
def eps(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps)


_SMALL = {torch.float16: 1e-3, torch.bfloat16: 1e-3}


def small_value(dtype: torch.dtype) -> float:
    """The seeds' small-value threshold (1e-3 half types, 1e-6 otherwise): below it, no noise."""
    return _SMALL.get(dtype, 1e-6)


def _int_view(dtype):
    return {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
            torch.float64: torch.int64}[dtype]


def _noisy_mask(x: torch.Tensor) -> torch.Tensor:
    """Elements that get noise: finite with |x| >= the small-value threshold (2 passes: inf and
    nan are zeroed in the |x| buffer in place, so no ``isfinite``, itself several passes)."""
    ax = x.abs()
    ax.nan_to_num_(nan=0.0, posinf=0.0)
    return ax >= small_value(x.dtype)


def bit_noise(t: torch.Tensor) -> torch.Tensor:
    """Flip the last mantissa bit of every finite element with |x| >= the small-value threshold."""
    x = t.detach()
    if not x.is_contiguous():
        x = x.contiguous()
    return torch.bitwise_xor(x.view(_int_view(x.dtype)), _noisy_mask(x)).view(x.dtype).view(t.shape)


def add_noise(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """x * (1 + u * eps(dtype)), u uniform in [-1, 1) from ``gen``, where |x| is not small.

    The noise is about one unit in the last place: large enough to survive rounding in the
    input's dtype, small enough that a well-conditioned op moves by about as much.  The factor
    (1 + u * eps) is computed in float32 (float64 for float64) and set to exactly 1 where |x| is
    small, so those elements (and inf/nan, as a positive factor keeps them) are unchanged."""
    x = t.detach()
    e = eps(x.dtype)
    factor = torch.rand(x.shape, generator=gen, dtype=torch.float32, device="cpu")
    if x.dtype == torch.float64:
        factor = factor.double()
    factor = factor.to(x.device).mul_(2 * e).add_(1 - e)
    ax = x.abs()
    factor.masked_fill_(ax < small_value(x.dtype), 1.0)
    if x.dtype in HALF:
        return (x * factor).to(x.dtype)
    return x * factor


def swap_first_last(t: torch.Tensor, dim: int) -> torch.Tensor:
    """A copy with the first and last slices along ``dim`` exchanged."""
    n = t.shape[dim]
    if n < 2:
        return t.detach().clone()
    idx = torch.arange(n, device=t.device)
    idx[0], idx[-1] = n - 1, 0
    return t.detach().index_select(dim, idx)


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
        a, b = args[0], args[1]
        args[0], args[1] = swap_first_last(a, -1), swap_first_last(b, -2)
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
