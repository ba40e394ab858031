"""float64 references for ops that have no float64 kernel, for run-ut's benchmark.

run-ut judges an op by running it again on the CPU in float64.  Some ops refuse float64
(``aten._grouped_mm``, which runs the experts of mixture-of-experts models, takes only
float32/bf16/fp16): without a reference they could never be judged.  A reference computes the
same mathematical result from the same arguments, in the dtype it is given (float64 here).

Users add their own for custom kernels in the module they pass to ``run-ut --import``::

    from dispatchprobe.torch import register_reference

    @register_reference("mylib.fused_mlp.default")
    def fused_mlp(x, w1, w2):
        return torch.relu(x @ w1) @ w2
"""

from __future__ import annotations

from typing import Callable

import torch

REFERENCES: dict[str, Callable] = {}
# op -> (function of the op's arguments giving {output name: bool tensor of the elements it writes},
# where the others lie): ops that leave part of an output uninitialised
DEFINED: dict[str, tuple[Callable, str]] = {}
# op -> function of the op's float64 arguments giving its outputs' sums of |terms|: ops whose
# run on |inputs| does not give them (layer norm's x_hat = (x - mean) * rstd)
TERMS: dict[str, Callable] = {}


def register_reference(op: str) -> Callable:
    """Decorator: ``fn(*args, **kwargs)`` is the float64 reference of ``op`` (its record name,
    ``namespace.name.overload``).  A second reference for the same op is refused."""
    if op.count(".") != 2:
        raise ValueError(f"register_reference: {op!r} is not a 'namespace.name.overload' op name")

    def register(fn: Callable) -> Callable:
        if op in REFERENCES:
            raise ValueError(f"register_reference: {op} already has a float64 reference "
                             f"({REFERENCES[op].__module__}.{REFERENCES[op].__qualname__})")
        REFERENCES[op] = fn
        return fn
    return register


def reference(op: str, func) -> Callable:
    """What run-ut's benchmark runs for ``op``: its registered reference, else the op itself."""
    return REFERENCES.get(op, func)


def register_defined(op: str, where: str) -> Callable:
    """Decorator: ``fn(*args, **kwargs)`` (the op's benchmark arguments) returns ``{output name:
    bool tensor}``, the elements ``op`` writes; ``where`` says where the others lie.  Why: an op
    may leave part of its output uninitialised (``_grouped_mm``'s rows past the last group), and
    run-ut must judge only the written part, never memory's leftovers against the benchmark."""
    if op.count(".") != 2:
        raise ValueError(f"register_defined: {op!r} is not a 'namespace.name.overload' op name")

    def register(fn: Callable) -> Callable:
        if op in DEFINED:
            raise ValueError(f"register_defined: {op} already says which elements it writes")
        DEFINED[op] = (fn, where)
        return fn
    return register


def defined_elements(op: str, args, kwargs) -> tuple[dict[str, torch.Tensor], str]:
    """({output name: bool mask of the elements ``op`` writes}, where the others lie); empty
    where the op writes every element of its outputs (or says nothing of it)."""
    hit = DEFINED.get(op)
    if hit is None:
        return {}, ""
    fn, where = hit
    return {name: mask for name, mask in fn(*args, **kwargs).items() if not bool(mask.all())}, where


def register_terms(op: str) -> Callable:
    """Decorator: ``fn(*args, **kwargs)`` (the op's float64 benchmark arguments) returns, shaped
    as the op's outputs, each element's sum of |terms|, which run-ut's rounding bound for sums is
    relative to.  Why: by default the op is run on the inputs' absolute values, which gives that
    sum only where each term is a product of inputs; an op that subtracts inputs inside a term
    would get too small a bound, and its correct rounding would be called an error."""
    if op.count(".") != 2:
        raise ValueError(f"register_terms: {op!r} is not a 'namespace.name.overload' op name")

    def register(fn: Callable) -> Callable:
        if op in TERMS:
            raise ValueError(f"register_terms: {op} already has a function of its terms")
        TERMS[op] = fn
        return fn
    return register


@register_terms("aten.native_layer_norm_backward.default")
def layer_norm_backward_terms(grad_out, input, normalized_shape, mean, rstd, weight, bias,  # noqa: ARG001
                              output_mask):  # noqa: ARG001
    """The weight gradient sums g * x_hat over the leading dimensions, the bias gradient g: their
    terms' magnitudes |g| * |x - mean| * rstd and |g| (the input gradient is no such sum: None)."""
    lead = tuple(range(grad_out.dim() - len(normalized_shape)))
    g = grad_out.abs()
    x_hat = ((input - mean) * rstd).abs()
    return None, (g * x_hat).sum(lead), g.sum(lead)


def _bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = [int(e) for e in offs.tolist()]
    return list(zip([0] + ends[:-1], ends))


@register_reference("aten._grouped_mm.default")
def grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):  # noqa: ARG001 - float64 out
    """One matrix product per group, as ``aten._grouped_mm`` defines them: 2-D x 3-D splits the
    rows of ``mat_a`` at ``offs`` (the experts' tokens), 3-D x 2-D the columns of ``mat_b``,
    2-D x 2-D the shared dimension (one output matrix per group), 3-D x 3-D is a batched mm."""
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if not a2 and not b2:
        out = torch.bmm(mat_a, mat_b)
    elif a2 and not b2:
        out = mat_a.new_zeros(mat_a.shape[0], mat_b.shape[-1])
        for g, (s, e) in enumerate(_bounds(offs)):
            out[s:e] = mat_a[s:e] @ mat_b[g]
    elif b2 and not a2:
        out = mat_a.new_zeros(mat_a.shape[1], mat_b.shape[1])
        for g, (s, e) in enumerate(_bounds(offs)):
            out[:, s:e] = mat_a[g] @ mat_b[:, s:e]
    else:
        groups = _bounds(offs)
        out = mat_a.new_zeros(len(groups), mat_a.shape[0], mat_b.shape[1])
        for g, (s, e) in enumerate(groups):
            out[g] = mat_a[:, s:e] @ mat_b[s:e]
    if bias is not None:       # torch's kernels take no bias yet: its layout is not defined
        raise NotImplementedError("a float64 reference of _grouped_mm with bias")
    return out


@register_defined("aten._grouped_mm.default", "outside every group of offs")
def grouped_mm_written(mat_a, mat_b, offs=None, bias=None, out_dtype=None):  # noqa: ARG001
    """The rows (2-D x 3-D) or columns (3-D x 2-D) of the output inside some group of ``offs``:
    the kernel writes only those; past the last offset its output is uninitialised memory (seen
    with offsets that end before the last row: values up to 1e35 there)."""
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if offs is None or a2 == b2:          # batched, or the shared dimension split: all written
        return {}
    length = mat_a.shape[0] if a2 else mat_b.shape[1]
    inside = torch.zeros(length, dtype=torch.bool)
    for s, e in _bounds(offs):
        inside[max(s, 0):max(e, 0)] = True
    shape = (mat_a.shape[0], mat_b.shape[-1]) if a2 else (mat_a.shape[1], mat_b.shape[1])
    mask = inside[:, None].expand(shape) if a2 else inside[None, :].expand(shape)
    return {"output.0": mask.contiguous()}
