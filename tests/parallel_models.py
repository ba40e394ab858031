"""The small models the torchrun training scripts share, and how each parallelism wraps them."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class RootMLP(MLP):
    """FSDP2: the root holds a parameter of its own, whose gradient the root's post-backward
    reduce-scatters (its input needs no gradient, so that runs in FSDP's end-of-backward callback)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        return super().forward(x) * self.scale


def parallelize(model: nn.Module, kind: str, mesh=None) -> nn.Module:
    """``model`` under DDP (``ddp``), FSDP2 (``fsdp``: each layer and the root) or tensor parallelism
    (``tp``: up column-wise, down row-wise) over ``mesh`` (default: every rank); any other kind
    leaves it as it is (one process)."""
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if kind in ("fsdp", "tp") and mesh is None:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard
        fully_shard(model.up, mesh=mesh)
        fully_shard(model.down, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    if kind == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        return parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model
