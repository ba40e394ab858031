"""An op that picks elements of an input (an embedding's rows, a gather, a top-k) is never named on
statistics alone beside an input that differs: the picked elements' statistics may move far more than
the whole input's (the rows an optimizer step changed are the rows the next step's batch reads).  A
wrong backward kernel (``silu_backward`` 30% too large, in a tiny ``transformers`` Llama) moves step
0's gradients and so step 1's parameters: the forward line says the inputs differ at step 1 and come
from step 0's backward divergence, which the backward line names; neither the embedding nor a
within-tolerance difference of step 0 takes its place, whichever run is A."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from compare_helpers import record_adamw_steps, tiny_llama, wrong_silu_backward

from dispatchprobe.cli import main

transformers = pytest.importorskip("transformers")


def _record(path, planted: bool, checkpointed: bool = False):
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    return record_adamw_steps(path, tiny_llama(checkpointed), lambda m: m(input_ids=ids, labels=ids).loss,
                              plant="silu_backward" if planted else None, kernel=wrong_silu_backward)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("selected")
    return {name: _record(root / name, planted, checkpointed) for name, planted, checkpointed in
            (("clean", False, False), ("planted", True, False), ("planted-checkpointed", True, True))}


@pytest.mark.parametrize("planted", ["planted", "planted-checkpointed"])
def test_a_backward_kernel_is_the_source_of_the_next_steps_inputs(runs, planted):
    for a, b in ((runs[planted], runs["clean"]), (runs["clean"], runs[planted])):
        got = CliRunner().invoke(main, ["compare", str(a), str(b)])
        assert got.exit_code == 2, got.output
        lines = got.output.splitlines()
        assert any(line.startswith("first backward divergence: aten.silu_backward.default") for line in lines), \
            got.output
        assert "first forward divergence" not in got.output, got.output
        forward = next(line for line in lines if line.startswith("the runs differ already at their inputs"))
        assert "step 1 rank 0" in forward, got.output
        assert "they come from step 0: first backward divergence: aten.silu_backward.default" in got.output, \
            got.output
