"""The built-in demo: record a few training steps of a tiny transformer (model and data generated
here, no downloads), then summarise them."""

from __future__ import annotations

import os

import torch

from .models import TinyTransformer, lm_batch, lm_loss
from .records.reader import load
from .offline.summary import checks_line, summarize
from .torch.capture import DispatchProbe


def run_demo(dump_path: str = "runs/demo", task: str = "tensor", steps: int = 2) -> str:
    torch.manual_seed(0)
    model = TinyTransformer()
    if task == "free_benchmark":     # improve_precision re-runs 16-bit ops in float32: train in bf16
        model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # the demo owns its output folder: a second demo replaces the first one's records
    probe = DispatchProbe(task=task, dump_path=dump_path, level="mix", model=model, overwrite=True)
    for step in range(steps):
        tokens, targets = lm_batch(seed=step)
        with probe:
            loss = lm_loss(model, tokens, targets)
            loss.backward()
        opt.step()
        opt.zero_grad()
        probe.step()
        print(f"step {step}: loss {loss.item():.4f}")
    probe.close()
    if task in ("overflow", "free_benchmark"):     # records only for what they flag
        counts = probe.summary()
        print(checks_line([counts]))      # the same account as `dispatchprobe show`
        if not counts["flagged"]:
            print(f"\nno op was flagged (records in {os.path.abspath(dump_path)}; "
                  f"see them with: dispatchprobe show {dump_path})")
            return dump_path
    print(summarize(load(dump_path)))
    print(f"\nrecords written to {os.path.abspath(dump_path)}")
    if task in ("overflow", "free_benchmark"):
        print(f"flagged ops: {dump_path}/step*/rank*/{task}.csv;  next: dispatchprobe show {dump_path}")
    else:
        print(f"next: dispatchprobe show {dump_path} --op aten.mm")
    return dump_path


if __name__ == "__main__":
    run_demo()
