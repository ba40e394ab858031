"""A plain training loop with dispatchprobe around each step.

    python examples/train_loop.py --task statistics --out runs/example
    dispatchprobe show runs/example
"""

from __future__ import annotations

import argparse

import torch

from dispatchprobe import DispatchProbe
from dispatchprobe.models import TinyTransformer, lm_batch, lm_loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", default="statistics", choices=["statistics", "tensor", "overflow", "free_benchmark"])
    parser.add_argument("--out", default="runs/example")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--bf16", action="store_true", help="train under bfloat16 autocast")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = TinyTransformer(dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # step=[1, 3]: record only steps 1 and 3; the probe costs nothing on the others
    probe = DispatchProbe(task=args.task, dump_path=args.out, level="mix", step=[1, 3], stack=True, model=model)

    for step in range(args.steps):
        tokens, targets = lm_batch(seed=step)
        with probe:                                   # forward AND backward are recorded
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                loss = lm_loss(model, tokens, targets)
            loss.backward()
        opt.step()                                    # the optimizer runs outside the probe
        opt.zero_grad()
        probe.step()
        print(f"step {step} loss {loss.item():.4f}")
    probe.close()
    print(f"records in {args.out}: try `dispatchprobe show {args.out}`")


if __name__ == "__main__":
    main()
