"""The small models the torchrun training scripts share, how each parallelism wraps them, and how
a script ends."""

from __future__ import annotations

import os
import sys
import warnings

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


def fsdp2():
    """FSDP2's ``fully_shard`` (public from torch 2.6; torch 2.5 has it in ``_composable``)."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def mixed_precision_policy(**options):
    """FSDP2's ``MixedPrecisionPolicy(**options)`` (public from torch 2.6; torch 2.5 has it in ``_composable``)."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy
    except ImportError:
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(**options)


def parallelize(model: nn.Module, kind: str, mesh=None, **shard_options) -> nn.Module:
    """``model`` under DDP (``ddp``), FSDP2 (``fsdp``: each layer and the root, ``shard_options``
    given to each ``fully_shard``: a ``mp_policy``) or tensor parallelism (``tp``: up column-wise,
    down row-wise) over ``mesh`` (default: every rank); any other kind leaves it as it is (one process)."""
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if kind in ("fsdp", "tp") and mesh is None:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if kind == "fsdp":
        fully_shard = fsdp2()
        fully_shard(model.up, mesh=mesh, **shard_options)
        fully_shard(model.down, mesh=mesh, **shard_options)
        return fully_shard(model, mesh=mesh, **shard_options)
    if kind == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        return parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


class InputMLP(nn.Module):
    """An :class:`MLP` after a layer of its own (``pre``): the tensor-parallel block's input then
    needs a gradient, so tensor parallelism all-reduces that gradient in the backward too (over its
    group, next to data parallelism's gradient reductions over another)."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.block = MLP()

    def forward(self, x):
        return self.block(torch.tanh(self.pre(x)))


class GatedBlock(nn.Module):
    """Llama's MLP: ``down(silu(gate(x)) * up(x))``, no biases."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 16, bias=False)
        self.up = nn.Linear(8, 16, bias=False)
        self.down = nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


class ResidualGatedMLP(nn.Module):
    """A :class:`GatedBlock` with a residual around it, after a layer of its own and a gelu
    (``pre``), then a relu: the block's input gradient sums three terms (the residual's, ``gate``'s
    and ``up``'s), which autograd adds in the order they arrive, and under tensor parallelism
    ``gate``'s and ``up``'s arrive after their all-reduces."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.block = GatedBlock()

    def forward(self, x):
        h = nn.functional.gelu(self.pre(x))
        return torch.relu(h + self.block(h))


# N-D device meshes: layout -> (mesh shape, dimension names); as many ranks as the mesh holds
MESHES = {"fsdp_tp": ((2, 2), ("dp", "tp")), "hsdp": ((2, 2), ("replicate", "shard")),
          "hsdp_tp": ((2, 2, 2), ("replicate", "shard", "tp"))}


def parallelize_nd(model: InputMLP | ResidualGatedMLP, layout: str, mesh) -> nn.Module:
    """``model`` on an N-D mesh (:data:`MESHES`): ``fsdp_tp`` FSDP2 over ``dp`` and tensor parallelism
    (``block.up`` and ``block.gate`` column-wise, ``block.down`` row-wise) over ``tp``; ``hsdp`` FSDP2
    replicated over ``replicate`` and sharded over ``shard``; ``hsdp_tp`` both, on a 3-D mesh."""
    fully_shard = fsdp2()
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    if "tp" in mesh.mesh_dim_names:
        plan = {name: ColwiseParallel() for name in ("gate", "up") if hasattr(model.block, name)}
        parallelize_module(model.block, mesh["tp"], {**plan, "down": RowwiseParallel()})
    dp = mesh[tuple(d for d in mesh.mesh_dim_names if d != "tp")] if mesh.ndim > 1 else mesh
    # a Llama MLP is sharded whole, as a transformer's layers are; the others layer by layer
    for layer in (model.pre, *((model.block,) if isinstance(model, ResidualGatedMLP) else model.block.children())):
        fully_shard(layer, mesh=dp)
    return fully_shard(model, mesh=dp)


# kernels 5 % off (activations, a linear layer's addmm), computed with other ops (which the probe does not
# see: they run inside the kernel)
WRONG_KERNELS = {
    "relu": lambda x: torch.clamp_min(x, 0) * 1.05,
    "gelu": lambda x, approximate="none": x * 0.5 * (1 + torch.erf(x * 0.7071067811865476)) * 1.05,
    "silu": lambda x: x * torch.sigmoid(x) * 1.05,
    "threshold_backward": lambda grad, x, threshold: torch.where(x > threshold, grad, 0) * 1.05,   # relu's backward
    "addmm": lambda bias, x, w, beta=1, alpha=1: (beta * bias + alpha * (x @ w)) * 1.05,
}


def wrong_kernel(op: str) -> torch.library.Library:
    """aten::``op`` on CPU replaced by the op x1.05 (:data:`WRONG_KERNELS`) until the library
    returned is destroyed."""
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():       # torch warns that a registered kernel is overridden: the point
        warnings.simplefilter("ignore", UserWarning)
        lib.impl(op, WRONG_KERNELS[op], "CPU")
    return lib


def wrong_relu_kernel() -> torch.library.Library:
    """aten::relu on CPU replaced by relu x1.05 until the library returned is destroyed."""
    return wrong_kernel("relu")


def record_runs(script, kind: str, out, *runs: str, env: dict | None = None, ranks: int = 2) -> None:
    """Run a torchrun training script of the tests: ``script kind out runs...`` in one process for
    ``kind`` "single", else under ``torchrun`` with ``ranks`` gloo ranks on loopback; fails the test
    with the script's stderr where it fails."""
    import subprocess
    launch = [sys.executable] if kind == "single" else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    proc = subprocess.run([*launch, str(script), kind, str(out), *runs], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]


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
