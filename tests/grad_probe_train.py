"""A small MLP trained 3 steps under the grad probe, in one process or on 2 gloo ranks; run by
``test_grad_probe.py`` as ``grad_probe_train.py single OUT`` or
``torchrun --nproc-per-node 2 grad_probe_train.py {ddp,fsdp,tp} OUT``.

Every run sees the same global batch: DDP and FSDP2 ranks take their half of it (their mean
losses' gradients, averaged over the ranks, are the single process's), tensor parallel ranks all
of it.  The probe records into ``OUT/{kind}`` (``OUT/{kind}-rank1``: a second probe recording
rank 1 only, whose rank 0 still joins the reductions of sharded gradients).  Each rank writes
``OUT/result-{kind}{rank}.json``: whether the probed steps were bit-identical to unprobed ones.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from dispatchprobe import DispatchProbe
from parallel_models import RootMLP, parallelize, run_and_end

STEPS = 3


def build(kind: str, mesh):
    torch.manual_seed(0)
    return parallelize(RootMLP(), kind, mesh)


def train(kind: str, mesh, out: str | None) -> list[torch.Tensor]:
    model = build(kind, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probes = []
    if out is not None:
        probes.append(DispatchProbe(task="grad_probe", dump_path=os.path.join(out, kind), grad_level="L2",
                                    model=model))
        if kind != "single":
            probes.append(DispatchProbe(task="grad_probe", dump_path=os.path.join(out, f"{kind}-rank1"),
                                        grad_level="L1", rank=[1], model=model))
    gen = torch.Generator().manual_seed(1)
    rank, world = (dist.get_rank(), dist.get_world_size()) if kind != "single" else (0, 1)
    for _ in range(STEPS):
        x = torch.randn(8, 8, generator=gen)
        if kind in ("ddp", "fsdp"):
            x = x.chunk(world)[rank]
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    for p in probes:
        p.close()
    return [(p.to_local() if hasattr(p, "to_local") else p).detach().clone() for p in model.parameters()]


def main() -> None:
    kind, out = sys.argv[1], sys.argv[2]
    if kind == "single":
        train(kind, None, out)
        return
    dist.init_process_group("gloo")
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),))
    reference = train(kind, mesh, None)
    probed = train(kind, mesh, out)
    same = all(torch.equal(a, b) for a, b in zip(reference, probed))
    with open(os.path.join(out, f"result-{kind}{dist.get_rank()}.json"), "w") as f:
        json.dump({"identical": same}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_and_end(main)
