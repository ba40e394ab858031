"""Two training steps of a small MLP on 2 gloo ranks under the statistics and tensor tasks, with a
fault planted on rank 1 if asked; run by ``test_ranks.py`` as
``torchrun --nproc-per-node 2 ranks_train.py {ddp,fsdp,tp} OUT [PLANT ...]``, and on N-D device meshes
(``parallel_models.MESHES``: 4 ranks on 2-D meshes, 8 on the 3-D one) as ``torchrun --nproc-per-node N
ranks_train.py nd OUT LAYOUT-PLANT ...`` (``fsdp_tp-clean``, ``hsdp-nudge``, ...).

PLANT: ``clean`` (none), ``calls`` (no model: each kind of collective called directly), ``nudge`` (one weight moved on rank 1 after DDP's initial broadcast),
``hook`` (a DDP comm hook that scales rank 1's reduced bucket by 1.001), ``inf`` (rank 1's batch
scaled so that the loss overflows to inf there, from finite values), ``relu1`` (tensor parallelism:
relu x1.05 on rank 1, on its column shards of ``up``'s output); on N-D meshes ``nudge`` moves one
element of rank 3's local shard of ``block.up.weight`` before the first step (a shard its replicas
hold equal).  Each plant's records go to ``OUT/{plant}/{statistics,tensor}`` (one launch, several
runs)."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from dispatchprobe import DispatchProbe
from parallel_models import MESHES, MLP, InputMLP, parallelize, parallelize_nd, run_and_end, wrong_kernel

STEPS = 2


def _scaled_hook(state, bucket):
    """Averages the bucket like DDP's default hook, then scales rank 1's result by 1.001."""
    scale = (1.0 + 1e-3 * dist.get_rank()) / dist.get_world_size()
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].mul_(scale))


def build(kind: str, mesh, plant: str):
    if kind not in ("ddp", "fsdp", "tp"):
        raise SystemExit(f"unknown parallelism {kind}")
    torch.manual_seed(0)
    model = parallelize(MLP(), kind, mesh)
    if kind == "ddp":
        if plant == "nudge" and dist.get_rank() == 1:
            with torch.no_grad():
                model.module.up.weight[0, 0] += 1e-3
        if plant == "hook":
            model.register_comm_hook(None, _scaled_hook)
    return model


def collectives(probe: DispatchProbe) -> None:
    """Each kind of collective on data that differs by rank, eager and functional, sync and async."""
    import torch.distributed._functional_collectives as fc
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(STEPS):
        x = torch.randn(6, generator=gen)
        probe.start()
        dist.all_reduce(x.clone(), op=dist.ReduceOp.MAX)
        dist.all_reduce(x.clone(), async_op=True).wait()
        dist.all_gather_into_tensor(torch.empty(12), x)
        dist.reduce_scatter_tensor(torch.empty(3), x.clone())
        dist.broadcast(x.clone(), src=1)
        (fc.all_reduce(x, "avg", dist.group.WORLD) * 1).sum()
        (fc.all_gather_tensor(x, 0, dist.group.WORLD) * 1).sum()
        probe.step()


def train(kind: str, mesh, probe: DispatchProbe, plant: str) -> None:
    if plant == "calls":
        return collectives(probe)
    model = build(kind, mesh, plant)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # TP ranks see one batch (the model's input is replicated); DDP and FSDP2 ranks each their own
    gen = torch.Generator().manual_seed(1 + (0 if kind == "tp" else dist.get_rank()))
    batches = [torch.randn(4, 8, generator=gen) for _ in range(STEPS)]
    if plant == "inf" and dist.get_rank() == 1:
        batches[0] = batches[0] * 1e30          # the loss's square overflows float32 on rank 1 only
    wrong = wrong_kernel("relu") if plant == "relu1" and dist.get_rank() == 1 else None
    try:
        _train(model, opt, probe, batches)
    finally:
        if wrong is not None:
            wrong._destroy()


def _train(model, opt, probe: DispatchProbe, batches: list) -> None:
    """One recorded step per batch: the loss is the output's mean square."""
    for x in batches:
        probe.start()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        probe.step()


def train_nd(layout: str, probe: DispatchProbe, plant: str) -> None:
    """Two steps of :class:`InputMLP` on the N-D mesh of ``layout``; the ranks that differ only in
    their tensor-parallel coordinate see one batch, the data-parallel ones each their own."""
    from torch.distributed.device_mesh import init_device_mesh
    shape, names = MESHES[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(0)
    model = parallelize_nd(InputMLP(), layout, mesh)
    if plant == "nudge" and dist.get_rank() == 3:
        with torch.no_grad():
            model.block.up.weight.to_local()[0, 0] += 1e-3
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    coordinate = [c for c, name in zip(mesh.get_coordinate(), names) if name != "tp"]
    gen = torch.Generator().manual_seed(1 + sum(c * 10 ** i for i, c in enumerate(coordinate)))
    _train(model, opt, probe, [torch.randn(4, 8, generator=gen) for _ in range(STEPS)])


def main() -> None:
    kind, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    if kind == "nd":
        for plant in sys.argv[3:]:
            layout, _, how = plant.partition("-")
            for task in ("statistics", "tensor"):
                probe = DispatchProbe(task=task, dump_path=os.path.join(out, plant, task))
                train_nd(layout, probe, how)
                probe.close()
        dist.barrier()
        dist.destroy_process_group()
        return
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),),
                                                          mesh_dim_names=("tp",) if kind == "tp" else ("dp",))
    for plant in sys.argv[3:] or ["clean"]:
        for task in ("statistics", "tensor"):
            probe = DispatchProbe(task=task, dump_path=os.path.join(out, plant, task))
            train(kind, mesh, probe, plant)
            probe.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_and_end(main)
