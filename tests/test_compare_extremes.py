"""An activation's own difference measured at its recorded extremes (``offline/compare/extremes.py``):
a kernel a few percent off is found whatever its inputs differ by, a bfloat16 kernel's rounding
against a float32 one is not, and the answer is the same whichever run is A."""

from __future__ import annotations

import pytest
import torch

from dispatchprobe.offline.compare.extremes import own_difference


def _record(op: str, **kwargs) -> dict:
    return {"op": op, "kwargs": {k: {"type": "str", "value": v} for k, v in kwargs.items()}}


def _extremes(t_a: torch.Tensor, t_b: torch.Tensor) -> dict:
    return {"max": (t_a.max().item(), t_b.max().item()), "min": (t_a.min().item(), t_b.min().item())}


def _judged(op: str, x32: torch.Tensor, kernel_a, kernel_b=None, **kwargs):
    """Run A computes ``op`` in bfloat16 with ``kernel_a``, run B in float32 with torch's; both
    orders must agree, and the verdict is returned."""
    fn = getattr(torch.nn.functional, op, None) or getattr(torch, op)
    x16 = (x32 * 1.003).bfloat16()                 # inputs that already differ, by more than rounding
    y16 = kernel_a(x16.float()).bfloat16()
    y32 = (kernel_b or (lambda x: fn(x, **kwargs)))(x32)
    rec = _record(f"aten.{op}.default", **kwargs)
    got = own_difference(rec, rec, _extremes(x16, x32), _extremes(y16, y32), ("bfloat16", "float32"))
    swapped = own_difference(rec, rec, _extremes(x32, x16), _extremes(y32, y16), ("float32", "bfloat16"))
    assert got == swapped
    return got


X = torch.linspace(-3.0, 2.5, 97)


@pytest.mark.parametrize("op, kwargs", [("relu", {}), ("gelu", {}), ("gelu", {"approximate": "tanh"}), ("silu", {}),
                                        ("sigmoid", {}), ("tanh", {})])
def test_a_correct_bfloat16_kernel_adds_nothing_at_its_extremes(op, kwargs):
    fn = getattr(torch.nn.functional, op, None) or getattr(torch, op)
    assert _judged(op, X, lambda x: fn(x, **kwargs), **kwargs) is False


@pytest.mark.parametrize("op", ["relu", "gelu", "silu", "sigmoid", "tanh"])
def test_a_kernel_five_percent_off_is_its_own_difference(op):
    fn = getattr(torch.nn.functional, op, None) or getattr(torch, op)
    assert _judged(op, X, lambda x: fn(x) * 1.05) is True


def test_only_the_extremes_an_activation_maps_are_judged():
    """gelu and silu map the largest value only, and only where it is not negative: below, their
    minimum lies between the input's extremes."""
    x = torch.linspace(-3.0, -0.5, 11)
    rec = _record("aten.gelu.default")
    wrong = torch.nn.functional.gelu(x) * 1.05
    assert own_difference(rec, rec, _extremes(x, x), _extremes(wrong, torch.nn.functional.gelu(x)),
                          ("float32", "float32")) is None
    assert own_difference(_record("aten.mul.Tensor"), _record("aten.mul.Tensor"), _extremes(x, x), _extremes(x, x),
                          ("float32", "float32")) is None


def test_two_float32_kernels_differing_by_their_approximation_add_nothing():
    """One run's kernel approximating erf to 1e-6 (another device's), the other's exact: no finding."""
    x = torch.linspace(-2.0, 3.0, 41, dtype=torch.float64)
    rec = _record("aten.gelu.default")
    exact = torch.nn.functional.gelu(x)
    approx = exact * (1 + 1e-6)
    assert own_difference(rec, rec, _extremes(x, x), _extremes(approx, exact), ("float32", "float32")) is False
