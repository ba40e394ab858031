"""2-rank FSDP2 training of :class:`parallel_models.MLP` with AdamW, recorded for
``test_fsdp2_precision_compare.py``:

    torchrun --nproc-per-node 2 fsdp2_precision_train.py OUT [RUN ...]

Every run starts from the same weights and sees the same 8 samples a step, each rank 4 of them,
for 3 steps, recorded with the statistics task.  RUN ``fp32`` trains in float32; ``bf16`` computes
in bfloat16 (``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``: FSDP2 casts the
parameters with a ``_foreach_copy_`` into its all-gather buffer); ``bf16kernel1`` as ``bf16`` with
a wrong relu kernel on rank 1 (relu x1.05, ``torch.library`` on CPU: no op of its own),
``bf16kernel`` with it on every rank, ``bf16gelu1`` and ``bf16silu1`` with a gelu or silu x1.05 on
rank 1.  AdamW's normalised updates carry bfloat16's rounding into the next steps' values: the
float32 and bfloat16 runs' optimizer states part past tolerance within the 3 steps, while no op
computes wrongly.
"""

from __future__ import annotations

import os
import sys

import torch

from dispatchprobe import DispatchProbe

from torch import nn

from parallel_models import MLP, fsdp2, mixed_precision_policy, run_and_end, wrong_kernel

STEPS = 3
BATCH = 8


class GeluMLP(MLP):
    """An :class:`MLP` after a layer of its own and a gelu (``pre``), with a silu on its output."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(8, 8)

    def forward(self, x):
        return nn.functional.silu(super().forward(nn.functional.gelu(self.pre(x))))


# RUN -> (the op given a wrong kernel, the ranks it is wrong on: None for every rank)
PLANTED = {"bf16kernel1": ("relu", {1}), "bf16kernel": ("relu", None), "bf16gelu1": ("gelu", {1}),
           "bf16silu1": ("silu", {1})}


def shard(model: GeluMLP, options: dict) -> nn.Module:
    """FSDP2 over every rank: each layer, then the root, each given ``options`` (a ``mp_policy``)."""
    fully_shard = fsdp2()
    for layer in (model.pre, model.up, model.down):
        fully_shard(layer, **options)
    return fully_shard(model, **options)


def train(out: str, run: str) -> None:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    op, ranks = PLANTED.get(run, (None, set()))
    kernel = wrong_kernel(op) if op is not None and (ranks is None or rank in ranks) else None
    try:
        torch.manual_seed(0)
        options = {}
        if run.startswith("bf16"):
            options["mp_policy"] = mixed_precision_policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = shard(GeluMLP(), options)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(1)
        probe = DispatchProbe(task="statistics", dump_path=os.path.join(out, run))
        share = BATCH // world
        for _ in range(STEPS):
            x = torch.randn(BATCH, 8, generator=gen)[rank * share:(rank + 1) * share]
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
    out = sys.argv[1]
    torch.distributed.init_process_group("gloo")
    for run in sys.argv[2:] or ("fp32",):
        train(out, run)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run_and_end(main)
