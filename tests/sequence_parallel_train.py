"""A block under sequence parallelism (2 gloo ranks, ``torchrun``) and the same block as one
process, on one batch, for ``test_compare_sequence_parallel.py``:

    python sequence_parallel_train.py single OUT [RUN ...]
    torchrun --nproc-per-node 2 sequence_parallel_train.py sp OUT [RUN ...]

``sp``: the LayerNorm under ``SequenceParallel`` (each rank its half of the sequence, dim 1), ``up``
column-wise from the sequence shards (all-gathered), ``down`` row-wise back to sequence shards (its
partial sums reduce-scattered), ``head`` column-wise to a replicated output; the LayerNorm's
weights' gradients are Partial DTensors.  RUN ``clean`` (tensors saved), ``stats`` (statistics
task) or ``relu1`` (relu x1.05 on rank 1, inside ``up``'s column shards).
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

from dispatchprobe import DispatchProbe

from parallel_models import run_and_end, wrong_relu_kernel

STEPS = 2
SEQUENCE = 6


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        return self.head(self.down(torch.relu(self.up(self.norm(x)))))


def sequence_parallel(model: Block) -> Block:
    """``model`` under the module's plan over every rank: what compare must join are the sequence
    shards and the partial sums a reduce-scatter (not an all-reduce) adds up."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    return parallelize_module(model, mesh, {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
                                            "down": RowwiseParallel(output_layouts=Shard(1)),
                                            "head": ColwiseParallel(input_layouts=Shard(1),
                                                                    output_layouts=Replicate())})


def train(kind: str, out: str, run: str) -> None:
    torch.manual_seed(0)
    model = sequence_parallel(Block()) if kind == "sp" else Block()
    rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if kind == "sp" else (0, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    probe = DispatchProbe(task="statistics" if run == "stats" else "tensor", dump_path=os.path.join(out, run))
    part = SEQUENCE // world
    for _ in range(STEPS):
        x = torch.randn(4, SEQUENCE, 8, generator=gen)[:, rank * part:(rank + 1) * part]
        probe.start()
        y = model(x)
        loss = (y.full_tensor() if hasattr(y, "full_tensor") else y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        probe.step()
    probe.close()


def main() -> None:
    kind, out = sys.argv[1], sys.argv[2]
    if kind == "sp":
        torch.distributed.init_process_group("gloo")
    for run in sys.argv[3:] or ("clean",):
        kernel = wrong_relu_kernel() if run == "relu1" and kind == "sp" and torch.distributed.get_rank() == 1 else None
        try:
            train(kind, out, run)
        finally:
            if kernel is not None:
                kernel._destroy()
    if kind == "sp":
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run_and_end(main)
