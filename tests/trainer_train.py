"""A tiny Llama (random init, no downloads) trained by ``transformers.Trainer`` with gradient
accumulation, with and without ``DispatchProbeCallback``: imported by tests/test_trainer_callback.py,
and run under ``torchrun`` (2 gloo ranks) as ``trainer_train.py OUT``, which trains once without the
callback and then once per run in RUNS, and writes ``result{rank}.json`` saying whether each probed
training ended with the unprobed parameters bit for bit."""

from __future__ import annotations

import json
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from dispatchprobe import DispatchProbeCallback

STEPS, MICRO_STEPS, BATCH, SEQ, VOCAB = 3, 2, 2, 8, 64
# the runs the torchrun script makes: name -> DispatchProbeCallback keys
RUNS = {"a": {"task": "statistics"}, "b": {"task": "statistics"}, "grad": {"task": "grad_probe"}}


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ)
    return LlamaForCausalLM(config)


def dataset(n: int = 32) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def train(out: str, callbacks=(), plant=None, batch: int = BATCH) -> list[torch.Tensor]:
    """``STEPS`` optimizer steps of ``MICRO_STEPS`` micro-batches of ``batch`` samples per process each;
    the final parameters.  ``plant(model)``: a change made to the model before training (the tests'
    planted bug)."""
    model = tiny_llama()
    if plant is not None:
        plant(model)
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=MICRO_STEPS,
                             max_steps=STEPS, learning_rate=1e-2, use_cpu=True, report_to=[], save_strategy="no",
                             logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0,
                             ddp_backend="gloo" if "LOCAL_RANK" in os.environ else None)
    Trainer(model=model, args=args, train_dataset=dataset(), callbacks=list(callbacks)).train()
    return [p.detach().clone() for p in model.parameters()]


def main() -> None:
    out = sys.argv[1]
    reference = train(os.path.join(out, "trainer"))
    rank = torch.distributed.get_rank()
    result = {}
    for name, keys in RUNS.items():
        probed = train(os.path.join(out, "trainer"), [DispatchProbeCallback(dump_path=os.path.join(out, name), **keys)])
        result[name] = {"identical": all(torch.equal(a, b) for a, b in zip(probed, reference))}
    with open(os.path.join(out, f"result{rank}.json"), "w") as f:
        json.dump(result, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from parallel_models import run_and_end
    run_and_end(main)
