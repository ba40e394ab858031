"""One model trained on one global batch, as 1 process or as 2-rank DDP / FSDP2, recorded for
``test_distributed_compare.py``:

    python distributed_compare_train.py single OUT [RUN ...]
    torchrun --nproc-per-node 2 distributed_compare_train.py {ddp,fsdp,tp} OUT [RUN ...]

Every run starts from the same weights and sees the same 8 samples per step; a rank of W takes
its 8/W of them (tensor parallel: all of them).  RUN ``clean`` records as is; ``planted`` scales the output of ``up`` by 1.001
(a forward hook), the planted change compare must name, and ``planted1`` on rank 1 only (one bad
device); ``kernel1`` gives rank 1 a wrong relu kernel (``torch.library`` overrides aten::relu on CPU
with relu x1.05 for that run: no op of its own, rank 0 sees it only through the collectives);
``mixed`` trains an MLP after a layer with buffers (DDP's own ``cat`` before the model's) and a
row index made from the batch's size; ``stats`` records as ``clean`` with the
statistics task (no tensors saved), ``bf16`` too with FSDP2 computing in bfloat16 and reducing the
gradients in float32 (``MixedPrecisionPolicy``), ``bf16kernel1`` as ``bf16`` with ``kernel1``'s
relu; ``outside`` runs the optimizer outside the probe (its ops unrecorded) and ``optimizer``
does too, giving ``up``'s parameters a learning rate 1.1 times as large (a change no op record
shows).  ``uneven`` (tensors), ``unevenstats`` (statistics) and ``unevenkernel1`` (``kernel1``'s
relu) take a global batch of 5 samples, split 3 and 2 over 2 ranks: DDP averages the shares'
gradients alike, so the parameters' gradients are not one process's by design.  ``divided`` divides
the loss by 2 as gradient accumulation does (``loss / accumulation_steps``); ``dividedkernel1`` as
``divided`` with ``kernel1``'s relu, ``dividedbackward1`` with a wrong relu backward on rank 1
(``threshold_backward`` x1.05).  ``xent`` trains on a cross-entropy loss (a mean ``nll_loss`` over
random targets, as a language model's), ``xentbackward1`` with ``dividedbackward1``'s relu backward.
``fp16overflow`` (statistics) trains under float16 autocast with a ``GradScaler`` starting at 2**19, whose
scaled gradients overflow float16 at step 0, so it skips that update (backing off to 2**9, not at step 1);
``bf16autocast`` (statistics) under
bfloat16 autocast.  ``sampled`` splits each step's batch as ``DistributedSampler`` does (rank k of W
takes samples k, k+W, ...) instead of in blocks, ``sampledkernel1`` with ``kernel1``'s relu.
``extraaddmm`` (one process) calls an unused ``addmm`` before the model and has every ``addmm`` 5%
too large: its model's ``addmm`` records are one call later than another run's.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

from dispatchprobe import DispatchProbe

from parallel_models import MLP, mixed_precision_policy, parallelize, run_and_end, wrong_kernel, wrong_relu_kernel

STEPS = 2
BATCH = 8
UNEVEN = (3, 2)     # the shares of the ``uneven`` runs' global batch, rank by rank


class Mix(nn.Module):
    """Scales and shifts half the features each by buffers (DDP broadcasts buffers before each
    forward: a ``cat`` of its own at the root), then adds a parity of the row index, made from the
    batch's size (``arange``: each rank its own share's)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("gain", torch.linspace(0.5, 1.5, 4))
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, 4))

    def forward(self, x):
        parity = (torch.arange(x.shape[0]) % 2).to(x.dtype)[:, None]
        return torch.cat([x[:, :4] * self.gain, x[:, 4:] + self.shift], dim=1) + 1e-3 * parity


class MixMLP(MLP):
    def __init__(self):
        super().__init__()
        self.mix = Mix()

    def forward(self, x):
        return super().forward(self.mix(x))


def build(kind: str, run: str = "clean"):
    torch.manual_seed(0)
    model = MixMLP() if run == "mixed" else MLP()
    if run.startswith("bf16"):
        return parallelize(model, kind, mp_policy=mixed_precision_policy(param_dtype=torch.bfloat16,
                                                                         reduce_dtype=torch.float32))
    return parallelize(model, kind)


def train(kind: str, out: str, run: str, task: str = "tensor") -> None:
    rank = torch.distributed.get_rank() if kind != "single" else 0
    kernel = None
    if run in ("kernel1", "bf16kernel1", "unevenkernel1", "dividedkernel1", "sampledkernel1") and rank == 1:
        kernel = wrong_relu_kernel()
    elif run in ("dividedbackward1", "xentbackward1") and rank == 1:
        kernel = wrong_kernel("threshold_backward")
    elif run == "extraaddmm":
        kernel = wrong_kernel("addmm")
    try:
        _train(kind, out, run, task)
    finally:
        if kernel is not None:
            kernel._destroy()


def _train(kind: str, out: str, run: str, task: str) -> None:
    model = build(kind, run)
    inner = model.module if kind == "ddp" else model
    rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if kind != "single" else (0, 1)
    if run == "planted" or (run == "planted1" and rank == 1):
        inner.up.register_forward_hook(lambda mod, args, output: output * 1.001)
    if run == "optimizer":     # up's parameters take a step 1.1 times as long
        up = {id(p) for p in inner.up.parameters()}
        opt = torch.optim.SGD([{"params": [p for p in model.parameters() if id(p) in up], "lr": 0.11},
                               {"params": [p for p in model.parameters() if id(p) not in up]}], lr=0.1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    probe = DispatchProbe(task=task, dump_path=os.path.join(out, run))
    # starting at 2**19 the scaled gradients overflow float16; backing off to 2**9, the next step's do not
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 19, backoff_factor=2.0 ** -10) if run == "fp16overflow" \
        else None
    autocast = {"fp16overflow": torch.float16, "bf16autocast": torch.bfloat16}.get(run)
    for _ in range(STEPS):
        sizes = UNEVEN if run.startswith("uneven") else (BATCH // world,) * world
        x = _share(torch.randn(sum(sizes), 8, generator=gen), kind, rank, sizes, run.startswith("sampled"))
        probe.start()
        if run == "extraaddmm":
            torch.addmm(torch.zeros(3), torch.ones(2, 5), torch.ones(5, 3))
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            if run.startswith("xent"):
                targets = _share(torch.randint(0, 8, (sum(sizes),), generator=gen), kind, rank, sizes, False)
                loss = nn.functional.cross_entropy(model(x), targets)
            else:
                loss = model(x).pow(2).mean()
        if run.startswith("divided"):
            loss = loss / 2
        (scaler.scale(loss) if scaler else loss).backward()
        if run in ("outside", "optimizer"):
            probe.stop()       # the optimizer's ops unrecorded; its parameter records still written
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        probe.step()
    probe.close()


def _share(batch: torch.Tensor, kind: str, rank: int, sizes: tuple, in_turn: bool) -> torch.Tensor:
    """This rank's share of the global batch (``sizes``: the shares, rank by rank; ``in_turn``: every
    W-th sample from the rank's own, as ``DistributedSampler`` splits a dataset): all of it for one
    process and for tensor parallelism."""
    if kind in ("single", "tp"):
        return batch
    if in_turn:
        return batch[rank::len(sizes)]
    return batch[sum(sizes[:rank]):sum(sizes[:rank + 1])]


def main() -> None:
    kind, out = sys.argv[1], sys.argv[2]
    if kind != "single":
        torch.distributed.init_process_group("gloo")
    for run in sys.argv[3:] or ("clean",):
        train(kind, out, run, task="statistics" if run in ("stats", "bf16", "bf16kernel1", "unevenstats", "fp16overflow",
                                                               "bf16autocast") else "tensor")
    if kind != "single":
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run_and_end(main)
