"""A tiny transformers model (Llama config, random init) trained two steps under a probe, for the
online run-ut tests; ``--plant`` makes silu 1 % wrong in this process only (a kernel the checker
never runs).  Run as a script by the tests that need a separate training process."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import warnings

import torch


def wrong_silu(x):
    """silu 1 % too large outside float64 (the benchmark stays right)."""
    y = x.double()
    y = y * torch.sigmoid(y)
    return y.to(x.dtype) if x.dtype == torch.float64 else (y * 1.01).to(x.dtype)


@contextlib.contextmanager
def planted_silu(on: bool = True, key: str = "CPU"):
    """The wrong silu for aten.silu on ``key`` (CPU, CUDA) while inside (this process only)."""
    if not on:
        yield
        return
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():        # torch warns that a CPU kernel is overridden: that is the point
        warnings.simplefilter("ignore")
        lib.impl("silu", wrong_silu, key)
    try:
        yield
    finally:
        lib._destroy()


def model_and_batches(steps: int = 2):
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    return model, [torch.randint(0, 64, (2, 8), generator=g) for _ in range(steps)]


def train(probe, steps: int = 2, plant: bool = False, device: str = "cpu") -> list[float]:
    """``steps`` AdamW steps of the tiny model under ``probe`` (closed at the end); the losses."""
    model, batches = model_and_batches(steps)
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    with planted_silu(plant, "CUDA" if device.startswith("cuda") else "CPU"):
        for ids in batches:
            ids = ids.to(device)
            with probe:
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
            opt.step()
            opt.zero_grad()
            probe.step()
            losses.append(float(loss.detach()))
        probe.close()
    return losses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("config", help="the probe's keyword arguments as JSON")
    ap.add_argument("--plant", action="store_true")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds to wait after each step (a slow loop)")
    args = ap.parse_args(argv)
    from dispatchprobe import DispatchProbe
    probe = DispatchProbe(**json.loads(args.config))
    if args.sleep:
        orig = probe.step

        def slow_step():
            orig()
            import time
            time.sleep(args.sleep)
        probe.step = slow_step
    losses = train(probe, args.steps, args.plant, args.device)
    print("losses", losses, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
