"""Training steps of a small MLP on 2 gloo ranks, unprobed and under each task; run by
``test_distributed.py`` as ``torchrun --nproc-per-node 2 distributed_train.py {ddp,fsdp,tp} OUT [RUN ...]``.

For each task the same steps run from the same initial weights without and with the probe;
every loss, gradient and parameter must be bit-identical.  Each rank writes what it saw to
``OUT/result{rank}.json`` (the test reads the records themselves).  RUNs name the probed runs
(default: one per task); ``tensor-a`` is a ``tensor`` run recorded in ``OUT/tensor-a``.  A run
named ``*-fix`` is free_benchmark's ``fix``, which replaces outputs: its steps are close, not
equal, and each rank reports its final parameters (replicas must stay equal across ranks).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from dispatchprobe import DispatchProbe
from parallel_models import MLP, RootMLP, parallelize, run_and_end

TASKS = {
    "statistics": {},
    "tensor": {},
    "overflow": {"overflow": {"overflow_nums": -1}},
    "free_benchmark": {"free_benchmark": {"handler_type": "check", "pert_mode": "add_noise"}},
}
# DDP only: fix replaces op outputs (float64 re-runs cast back), so the steps are close, not equal
FIX = {"free_benchmark": {"handler_type": "fix", "pert_mode": "improve_precision", "widen_float32": True}}
STEPS = 2


def build(kind: str, mesh):
    if kind not in ("ddp", "fsdp", "tp"):
        raise SystemExit(f"unknown parallelism {kind}")
    torch.manual_seed(0)
    return parallelize(RootMLP() if kind == "fsdp" else MLP(), kind, mesh)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def train(kind: str, mesh, probe: DispatchProbe | None) -> list[torch.Tensor]:
    model = build(kind, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    seen = []
    for _ in range(STEPS):
        x = torch.randn(4, 8, generator=gen)
        if probe is not None:
            probe.start()
        loss = model(x).pow(2).mean()
        loss.backward()
        seen += [loss.detach().clone()] + [local(p.grad).clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        if probe is not None:
            probe.step()
    seen += [local(p.detach()).clone() for p in model.parameters()]
    return seen


def main() -> None:
    kind, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),))
    result = {}
    reference = train(kind, mesh, None)
    for run in sys.argv[3:] or TASKS:
        task = run.split("-")[0]
        extra = FIX if run.endswith("-fix") else TASKS[task]
        probe = DispatchProbe(task=task, dump_path=os.path.join(out, run), **extra)
        try:
            probed = train(kind, mesh, probe)
            probe.close()
            same = len(probed) == len(reference) and all(
                a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in zip(probed, reference))
            result[run] = {"identical": same}
            if run.endswith("-fix"):
                result[run]["close"] = all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(probed, reference))
                result[run]["params"] = [x.flatten().tolist() for x in probed[-len(list(MLP().parameters())):]]
        except Exception as exc:  # reported to the test, which prints it
            import traceback
            result[run] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
    with open(os.path.join(out, f"result{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_and_end(main)
