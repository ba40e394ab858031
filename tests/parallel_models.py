"""The small models the torchrun training scripts share, how each parallelism wraps them, and how
a script ends."""

from __future__ import annotations

import os
import sys

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


def run_and_end(main) -> None:
    """Run a torchrun script's ``main`` (which closes its probes, writes its results and destroys
    the process group), then end the process without torch's C++ teardown: after gloo and DTensor
    were used, that teardown sometimes aborts a rank whose work is done ("terminate called without
    an active exception", no Python frame left), measured without any probe too (1 run in 30 of
    plain tensor-parallel training on a loaded 2-core machine).  The tests judge the scripts'
    records and results, which are on disk by then; an exception still fails the run."""
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
