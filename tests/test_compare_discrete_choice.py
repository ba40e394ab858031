"""Two runs whose router (a mixture of experts' ``topk``) sends a token to another expert because a
near-tie rounds apart in bfloat16 get no precision verdict past that choice: compare names the
``topk`` whose indices differ while the probabilities it chose from agree within tolerance, judges
nothing computed from it (forward or backward), and exits 1, in either order and with either task.
A wrong kernel still is named where it runs: a planted ``silu`` in the experts, and a ``topk`` that
picks another expert from identical inputs (a discrete answer that is the kernel's own)."""

from __future__ import annotations

import contextlib
import os
import sys

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from torch import nn

from compare_helpers import record_adamw_steps
from html_check import page_data
from dispatchprobe.cli import main
from dispatchprobe.offline.compare import compare
from dispatchprobe.offline.compare.choice import AFTER, MADE

sys.path.insert(0, os.path.dirname(__file__))

EXPERTS, TOP_K, DIM = 4, 2, 16


class TinyMoE(nn.Module):
    """A router picking ``TOP_K`` of ``EXPERTS`` SiLU experts per token (transformers' eager loop:
    ``torch.where`` on the indices, ``index`` the tokens, ``index_add_`` the weighted outputs).  The
    router's rows are nearly equal, so many tokens sit at a near-tie that bfloat16 rounds apart."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        with torch.no_grad():
            base = self.router.weight[0].clone()
            self.router.weight.copy_(base + 1e-3 * torch.randn(EXPERTS, DIM))
        self.up = nn.ModuleList(nn.Linear(DIM, 2 * DIM) for _ in range(EXPERTS))
        self.down = nn.ModuleList(nn.Linear(2 * DIM, DIM) for _ in range(EXPERTS))
        self.head = nn.Linear(DIM, 4)

    def forward(self, x):
        h = self.inp(x).flatten(0, 1)
        probs = F.softmax(self.router(h).float(), dim=-1)
        weights, chosen = torch.topk(probs, TOP_K, dim=-1)
        out = torch.zeros_like(h)
        for e in range(EXPERTS):
            token, slot = torch.where(chosen == e)
            y = self.down[e](F.silu(self.up[e](h[token]))) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return self.head(h + out).view(*x.shape[:-1], -1)


@contextlib.contextmanager
def planted(op: str):
    """A wrong CPU kernel for aten ``op``: ``silu`` 1e-3 off in a sign pattern, or ``topk`` sending the
    first token to the next expert (from the same inputs)."""
    lib = torch.library.Library("aten", "IMPL")
    if op == "silu":
        lib.impl("silu", lambda x: x * torch.sigmoid(x) * (1 + 1e-3 * torch.sign(x)), "CPU")
    else:
        def topk(x, k, dim=-1, largest=True, sorted=True):
            values, indices = torch.sort(x, dim, descending=largest)
            values, indices = values.narrow(dim, 0, k).clone(), indices.narrow(dim, 0, k).clone()
            if x.dim() == 2 and x.shape[-1] == EXPERTS:
                indices[0, 0] = (indices[0, 0] + 1) % EXPERTS
            return values, indices
        lib.impl("topk", topk, "CPU")
    try:
        yield
    finally:
        lib._destroy()


def record(path, *, autocast: bool = False, plant: str = "", task: str = "statistics"):
    """Two AdamW steps of :class:`TinyMoE` (weights and batch from seed 0)."""
    torch.manual_seed(0)
    model = TinyMoE()
    g = torch.Generator().manual_seed(0)
    x, target = torch.randn(4, 16, DIM, generator=g), torch.randn(4, 16, 4, generator=g)
    with planted(plant) if plant else contextlib.nullcontext():
        return record_adamw_steps(path, model, lambda m: F.mse_loss(m(x).float(), target), autocast=autocast,
                                  task=task)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {name: record(root / name, **kw) for name, kw in {
        "fp32": {}, "bf16": {"autocast": True}, "silu": {"plant": "silu"}, "topk": {"plant": "topk"},
        "fp32_t": {"task": "tensor"}, "bf16_t": {"autocast": True, "task": "tensor"}}.items()}


def _router_flipped(table) -> bool:
    """The precondition: some token went to another expert (the topk indices' rows differ, beyond
    what an index may: no tolerance)."""
    rows = table[(table["op_a"] == "aten.topk.default") & (table["arg"] == "output.1") & (table["step"] == 0)]
    return bool((rows["stats_err"] > 0.001).any())


@pytest.mark.parametrize("task", ["statistics", "tensor"])
@pytest.mark.parametrize("swap", [False, True])
def test_a_router_choice_rounded_apart_is_not_judged(runs, task, swap):
    a, b = (runs["fp32"], runs["bf16"]) if task == "statistics" else (runs["fp32_t"], runs["bf16_t"])
    a, b = (b, a) if swap else (a, b)
    table, v = compare(str(a), str(b))
    assert _router_flipped(table)
    fwd = v.forward
    assert fwd.cause == "choice" and fwd.op == "aten.topk.default" and fwd.arg == "output.1", str(v)
    assert fwd.step == 0 and fwd.stage == "forward"
    assert "agree within tolerance" in fwd.failed
    assert v.backward is None or v.backward.cause in ("after_choice", "inherited"), str(v)
    assert v.undecided and not v.passed
    text = str(v)
    assert "not judged" in text and "index_add" not in text.split("\n")[1]
    assert CliRunner().invoke(main, ["compare", str(a), str(b)]).exit_code == 1
    # no row says more than the verdict: the choice and what follows it are not judged, naming it
    choice = table[(table["op_a"] == "aten.topk.default") & (table["arg"] == "output.1") & (table["stats_err"] > 0.001)]
    assert (choice["status"] == "not judged").all() and not choice["origin"].any()
    assert (choice["reason"] == MADE["choice"]).all()
    after = table[table["reason"].str.startswith(AFTER["choice"])]
    assert len(after) and (after["status"] == "not judged").all()
    assert after["reason"].str.contains("aten.topk.default").all()
    assert set(after["step"]) == {0, 1}         # the routed values, then the parameters they moved apart
    assert v.after_choice == len(choice) + len(after) and v.counts["not judged"] >= v.after_choice
    assert "values a discrete choice the runs made differently decides" in text.splitlines()[0]
    assert not (table["status"] == "error").any(), table[table["status"] == "error"][["step", "op_a", "arg", "reason"]]


def test_no_error_row_past_a_choice_on_the_page(runs, tmp_path):
    """The report the CLI writes calls no row past the choice an error: its sheet rows, the compare.csv
    counts and the page's ops carry the verdict's "not judged"."""
    out = tmp_path / "report"
    result = CliRunner().invoke(main, ["compare", str(runs["fp32"]), str(runs["bf16"]), "-o", str(out)])
    assert result.exit_code == 1, result.output
    rows = pd.read_csv(out / "compare.csv")
    assert not (rows["status"] == "error").any() and (rows["status"] == "not judged").any()
    data = page_data((out / "compare.html").read_text())
    error = [lv["name"] for lv in data["levels"]].index("error")
    assert data["ops"] and not any(op["origin"] or op["sev"] == error for op in data["ops"])
    assert not any(node["c"][error] for node in data["nodes"])       # no module counts an error op
    # a module holding an op past the choice is never drawn as agreeing: its dot is "not judged" or worse
    names = [lv["name"] for lv in data["levels"]]
    unjudged = [n for n in data["nodes"] if n["c"][names.index("not judged")]]
    assert any(n["name"] == "head" for n in unjudged), [n["name"] for n in unjudged]
    for node in unjudged:
        worst = max(i for i, c in enumerate(node["c"]) if c)
        assert names[worst] != "pass", (node["name"], node["c"])


@pytest.mark.parametrize("swap", [False, True])
def test_a_wrong_expert_kernel_is_still_named(runs, swap):
    a, b = (runs["fp32"], runs["silu"]) if not swap else (runs["silu"], runs["fp32"])
    _, v = compare(str(a), str(b))
    assert v.forward.cause == "op" and v.forward.op == "aten.silu.default", str(v)
    assert not v.undecided
    assert CliRunner().invoke(main, ["compare", str(a), str(b)]).exit_code == 2


@pytest.mark.parametrize("swap", [False, True])
def test_a_topk_kernel_choosing_wrongly_from_equal_inputs_is_named(runs, swap):
    a, b = (runs["fp32"], runs["topk"]) if not swap else (runs["topk"], runs["fp32"])
    _, v = compare(str(a), str(b))
    assert v.forward.cause == "op" and v.forward.op == "aten.topk.default", str(v)
    assert not v.undecided
    assert CliRunner().invoke(main, ["compare", str(a), str(b)]).exit_code == 2
