"""A tiny ``transformers`` Llama in bfloat16 trained with AdamW, as 2-rank FSDP2 or as one process,
recorded for ``test_fsdp2_bf16_compare.py``:

    python fsdp2_bf16_train.py single OUT [RUN ...]
    torchrun --nproc-per-node 2 fsdp2_bf16_train.py fsdp OUT [RUN ...]

Every run starts from the same weights (``model.to(torch.bfloat16)``) and sees the same 4
sequences a step, each rank 2 of them (FSDP2 averages the ranks' gradients, as one process's mean
over the whole batch), for 2 steps, recorded with the statistics task.  FSDP2 shards each decoder
layer and the root.  RUN ``bf16`` trains as is; ``silu1`` gives rank 1 (in one process: the
process) a wrong silu kernel at step 1 only (silu x1.01, ``torch.library`` on CPU: no op of its
own); ``scaler`` scales the loss with ``torch.amp.GradScaler`` (under FSDP2 its found-inf check
all-reduces a one-element flag over the ranks, outside the backward).  The reduce-scatter sums the
gradients in another order than one process's backward, so the parameters differ by bfloat16's
rounding after step 0's update, and AdamW carries that into step 1.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

from dispatchprobe import DispatchProbe

from compare_helpers import tiny_llama
from parallel_models import fsdp2, run_and_end

STEPS = 2
BATCH, SEQ = 4, 8


def wrong_silu() -> torch.library.Library:
    """aten::silu on CPU replaced by silu x1.01 until the library returned is destroyed."""
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():       # torch warns that a registered kernel is overridden: the point
        warnings.simplefilter("ignore", UserWarning)
        lib.impl("silu", lambda x: x * torch.sigmoid(x) * 1.01, "CPU")
    return lib


def train(kind: str, out: str, run: str) -> None:
    rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if kind != "single" else (0, 1)
    model = tiny_llama().to(torch.bfloat16)
    if kind != "single":
        fully_shard = fsdp2()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4) if run == "scaler" else None
    gen = torch.Generator().manual_seed(1)
    probe = DispatchProbe(task="statistics", dump_path=os.path.join(out, run))
    share = BATCH // world
    for step in range(STEPS):
        ids = torch.randint(0, 128, (BATCH, SEQ), generator=gen)[rank * share:(rank + 1) * share]
        kernel = wrong_silu() if run == "silu1" and step == 1 and rank == world - 1 else None
        try:
            probe.start()
            loss = model(input_ids=ids, labels=ids).loss
            (scaler.scale(loss) if scaler else loss).backward()
        finally:
            if kernel is not None:
                kernel._destroy()
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        probe.step()
    probe.close()


def main() -> None:
    kind, out = sys.argv[1], sys.argv[2]
    if kind != "single":
        torch.distributed.init_process_group("gloo")
    for run in sys.argv[3:] or ("bf16",):
        train(kind, out, run)
    if kind != "single":
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run_and_end(main)
