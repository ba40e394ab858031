"""A value the cancellation rule passed hands on its difference as what reads it measures it.

A matrix product whose terms cancel (the LM head's gradient of the hidden states: softmax minus
one-hot, summed over the vocabulary) passes by the cancellation rule, its ``error`` taken relative
to its terms; the records reading it measure the same value relative to itself, some hundred
times larger.  Between runs of two torch versions (statistics below a floor count as equal) a
forward kernel 10-30% off then had the backward named at an op that only passes the gradient on:
torch 2.5's ``slice_backward`` of HF's full ``hidden_states[:, slice(0, None), :]``, which 2.13
does not run ("first backward divergence: aten.slice_backward.default ... present only in run A
(prime suspect)"), or, with no such op, the RMSNorm's multiply by its weight of ones.  Both orders.

The 2.5 run's op sequence is imitated in one torch: an identity whose backward is that
``slice_backward``, on the LM head's input in one run only."""

from __future__ import annotations

import pytest
import torch

from compare_helpers import planted_kernel, tiny_llama
from dispatchprobe import DispatchProbe
from dispatchprobe.offline.compare.driver import compare_parts
from dispatchprobe.records.reader import load


class _FullSliceBackward(torch.autograd.Function):
    """The identity, its backward torch 2.5's ``slice_backward`` of a full slice of dim 1."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.ops.aten.slice_backward.default(grad, list(grad.shape), 1, 0, grad.shape[1], 1)


def _record(path, *, sliced: bool, silu_factor: float | None, shape: tuple, seed: int):
    """One statistics step of the tiny Llama; ``silu_factor``: aten silu that many times too large."""
    model = tiny_llama()
    if sliced:
        model.lm_head.register_forward_pre_hook(lambda mod, args: (_FullSliceBackward.apply(args[0]),))
    ids = torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(seed))
    with planted_kernel("silu" if silu_factor else None, lambda x: x * torch.sigmoid(x) * silu_factor):
        probe = DispatchProbe(task="statistics", dump_path=str(path))
        with probe:
            model(input_ids=ids, labels=ids).loss.backward()
        probe.close()
    return load(path).part(0, 0)


@pytest.mark.parametrize("shape, seed, factor", [((4, 32), 2, 1.1), ((2, 16), 2, 1.1), ((4, 32), 123, 1.3)])
@pytest.mark.parametrize("sliced_in", ["wrong run", "clean run", "neither"])
def test_a_forward_kernel_is_not_blamed_on_the_backward(tmp_path, shape, seed, factor, sliced_in):
    wrong = _record(tmp_path / "wrong", sliced=sliced_in == "wrong run", silu_factor=factor, shape=shape, seed=seed)
    clean = _record(tmp_path / "clean", sliced=sliced_in == "clean run", silu_factor=None, shape=shape, seed=seed)
    for a, b in ((wrong, clean), (clean, wrong)):
        found = {d.stage: d for d in compare_parts(a, b).divergences}     # kernels=False: two torch versions
        assert (found["forward"].cause, found["forward"].op) == ("op", "aten.silu.default"), found
        assert found["backward"].cause == "inherited", found["backward"]
