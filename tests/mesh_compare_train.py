""":class:`InputMLP` trained on one global batch as 1 process or on a 2x2 mesh (FSDP2 over ``dp``,
tensor parallelism over ``tp``: ``block.up`` column-wise, ``block.down`` row-wise), recorded for
``test_compare_mesh.py``:

    python mesh_compare_train.py single OUT [RUN ...]
    torchrun --nproc-per-node 4 mesh_compare_train.py fsdp_tp OUT [RUN ...]
    torchrun --nproc-per-node 8 mesh_compare_train.py hsdp_tp OUT [RUN ...]

Every run starts from the same weights and sees the same 8 samples per step; the two ranks of one
tensor-parallel group take the same half of them.  ``hsdp_tp`` is the 2x2x2 mesh (HSDP replicated over
``replicate``, sharded over ``shard``, tensor parallelism over ``tp``): each of its 4 shares takes a
quarter of the batch, in the order of the data-parallel dimensions flattened.  RUN ``clean`` records as is; ``tanh1`` gives
rank 1 alone a wrong tanh kernel (``torch.library`` overrides aten::tanh on CPU with tanh x1.01), in
the layer before the tensor-parallel block, where rank 1 and its tensor-parallel peer rank 0 compute
on equal inputs; ``relu1`` a wrong relu (x1.01) on rank 1 alone, inside the block, where each rank
computes its own columns.  ``gated`` trains :class:`ResidualGatedMLP` instead (Llama's MLP, ``gate``
and ``up`` column-wise, with a residual around it), ``gatedgelu1`` with a wrong gelu (x1.01) on rank
1 alone, before the block.  Each run is recorded with the statistics and the tensor task
(``OUT/RUN/{statistics,tensor}``).
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist

from dispatchprobe import DispatchProbe

from parallel_models import MESHES, InputMLP, ResidualGatedMLP, parallelize_nd, run_and_end

STEPS = 2
BATCH = 8


WRONG_KERNELS = {"tanh1": ("tanh", lambda x: (1 - 2 / (torch.exp(2 * x) + 1)) * 1.01),
                 "relu1": ("relu", lambda x: torch.clamp_min(x, 0) * 1.01),
                 "gatedgelu1": ("gelu", lambda x, approximate="none": x * 0.5 * (1 + torch.erf(x * 0.7071067811865476))
                                * 1.01)}


def wrong_kernel(run: str) -> torch.library.Library:
    """The op of ``run`` on CPU replaced by its result x1.01 until the library returned is destroyed."""
    op, kernel = WRONG_KERNELS[run]
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():       # torch warns that a registered kernel is overridden: the point
        warnings.simplefilter("ignore", UserWarning)
        lib.impl(op, kernel, "CPU")
    return lib


def build(kind: str, run: str):
    """The model and the share of the batch this process takes: (model, index, count)."""
    torch.manual_seed(0)
    model = ResidualGatedMLP() if run.startswith("gated") else InputMLP()
    if kind == "single":
        return model, 0, 1
    from torch.distributed.device_mesh import init_device_mesh
    shape, names = MESHES[kind]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    # the share of the batch: the rank in the data-parallel dimensions flattened row-major (torchtitan's
    # split: HSDP's replicate x shard mesh gives replicate * shards + shard)
    dp = [d for d in names if d != "tp"]
    coordinate = dict(zip(names, mesh.get_coordinate()))
    share, shares = 0, 1
    for d in dp:
        share, shares = share * mesh[d].size() + coordinate[d], shares * mesh[d].size()
    return parallelize_nd(model, kind, mesh), share, shares


def train(kind: str, out: str, run: str, task: str) -> None:
    rank = dist.get_rank() if kind != "single" else 0
    kernel = wrong_kernel(run) if run in WRONG_KERNELS and rank == 1 else None
    try:
        model, share, shares = build(kind, run)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(1)
        probe = DispatchProbe(task=task, dump_path=os.path.join(out, run, task))
        size = BATCH // shares
        for _ in range(STEPS):
            x = torch.randn(BATCH, 8, generator=gen)[share * size:(share + 1) * size]
            probe.start()
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            probe.step()
        probe.close()
    finally:
        if kernel is not None:
            kernel._destroy()


def main() -> None:
    kind, out = sys.argv[1], sys.argv[2]
    if kind != "single":
        dist.init_process_group("gloo")
    for run in sys.argv[3:] or ("clean",):
        for task in ("statistics", "tensor"):
            train(kind, out, run, task)
    if kind != "single":
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    run_and_end(main)
