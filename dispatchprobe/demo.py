"""The built-in demo: record a few training steps of a tiny transformer (model and data generated
here, no downloads), then summarise them.  Each inline check's demo has something to find: the
overflow demo an attention that overflows float16, the free-benchmark demo a bfloat16 kernel."""

from __future__ import annotations

import torch

from .models import TinyTransformer, lm_batch, lm_loss
from .offline.summary import demo_report
from .core.overflow import OverflowDetected
from .torch.capture import DispatchProbe

# the overflow demo's query and key weights, grown this many times larger (as weights grow in a run
# that diverges): in float16 the attention scores q @ k^T pass 65504 from finite inputs
QK_GROWTH = 150.0


def demo_model(task: str) -> TinyTransformer:
    """The tiny transformer as each demo trains it: bfloat16 for free_benchmark (improve_precision
    re-runs 16-bit ops in float32), float16 with large query/key weights for overflow."""
    torch.manual_seed(0)
    model = TinyTransformer()
    if task == "free_benchmark":
        model = model.to(torch.bfloat16)
    elif task == "overflow":
        model = model.half()
        with torch.no_grad():
            for layer in model.layers:
                qkv = layer.attn.qkv.weight
                qkv[: 2 * qkv.shape[0] // 3].mul_(QK_GROWTH)     # rows of q and k; v unchanged
    return model


def run_demo(dump_path: str = "runs/demo", task: str = "tensor", steps: int = 2) -> str:
    model = demo_model(task)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # the demo owns its output folder: a second demo replaces the first one's records
    probe = DispatchProbe(task=task, dump_path=dump_path, level="mix", model=model, overwrite=True)
    if task == "overflow":
        print(f"float16 training, the attention's query/key weights x{QK_GROWTH:g}: its scores overflow float16")
    for step in range(steps):
        tokens, targets = lm_batch(seed=step)
        try:
            with probe:
                loss = lm_loss(model, tokens, targets)
                loss.backward()
        except OverflowDetected as exc:      # overflow_nums=1: training stops at the first critical op
            print(f"step {step}: {exc}")
            print("training stopped there (overflow_nums=1; -1 would check on)")
            break
        opt.step()
        opt.zero_grad()
        probe.step()
        print(f"step {step}: loss {loss.item():.4f}")
    probe.close()
    counts = probe.summary() if task in ("overflow", "free_benchmark") else None
    print(demo_report(dump_path, task, counts, example_op="aten.mm"))
    return dump_path


if __name__ == "__main__":
    run_demo()
