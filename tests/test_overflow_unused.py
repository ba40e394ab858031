"""task="overflow": an inf/nan is an overflow only where the program uses it.

T5's relative-position buckets take log(0) on purpose and cast the -inf to integers that
torch.where then replaces: such a value is *discarded* (counted, listed in overflow.json, never
raised), while a log(0) that reaches the loss is still named at the log."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from torch import nn

from dispatchprobe import DispatchProbe
from dispatchprobe.core.overflow import OverflowDetected
from compare_helpers import tiny_model


def part(path, step=0) -> dict:
    folder = path / f"step{step}" / "rank0"
    rows = list(csv.DictReader(open(folder / "overflow.csv"))) if (folder / "overflow.csv").exists() else []
    summary = json.loads((folder / "overflow.json").read_text()) if (folder / "overflow.json").exists() else None
    return {"rows": rows, "summary": summary}


def positions() -> torch.Tensor:
    """Data (no gradient) with a zero in it: its log is -inf there, as T5's relative positions."""
    return torch.tensor([[0.0, 1.0, 2.0, 3.0]]).expand(2, 4)


def masked_by_where(h):
    return torch.where(positions() > 0, h, 0.0)


def masked_by_masked_fill(h):
    return h.masked_fill(positions() == 0, 0.0)


def clamped(h):
    return h.clamp(min=-10.0)


def cast_to_integers_then_where(h):
    """T5's pattern: the -inf becomes an undefined integer, which where replaces."""
    buckets = (h * 4).to(torch.long)
    return torch.where(positions() > 0, buckets, 0).float()


@pytest.mark.parametrize("defer", [False, True])
@pytest.mark.parametrize("mask", [masked_by_where, masked_by_masked_fill, clamped, cast_to_integers_then_where])
def test_an_inf_masked_before_use_is_not_an_overflow(tmp_path, mask, defer):
    torch.manual_seed(0)
    net, x = nn.Linear(4, 4), torch.randn(2, 4)
    probe = DispatchProbe(task="overflow", dump_path=str(tmp_path), model=net)
    probe.handlers[0].defer = defer
    with probe:                                         # raises at a critical op (overflow_nums=1)
        loss = (net(x) * mask(torch.log(positions()))).sum()
        loss.backward()
    probe.close()
    assert torch.isfinite(loss) and torch.isfinite(net.weight.grad).all()
    got = part(tmp_path)
    assert not [r for r in got["rows"] if r["class"] in ("critical", "propagated")]
    assert got["summary"]["counts"]["discarded"] == 1 and probe.summary()["flagged"] == 0
    discarded = got["summary"]["discarded"][0]
    assert (discarded["op"], discarded["stage"], discarded["inf"]) == ("aten.log.default", "forward", 2)
    if not defer:     # the readers are named as the ops run (the accelerator path learns of them later)
        assert discarded["read_by"], discarded


@pytest.mark.parametrize("defer", [False, True])
def test_log_of_zero_reaching_the_loss_is_named_at_the_log(tmp_path, defer):
    torch.manual_seed(0)
    net, x = nn.Linear(4, 4), torch.randn(2, 4)
    probe = DispatchProbe(task="overflow", dump_path=str(tmp_path), model=net)
    probe.handlers[0].defer = defer
    reached = False
    with pytest.raises(OverflowDetected, match=r"overflow in aten\.log\.default \(forward"):
        with probe:
            loss = (net(x) * torch.log(positions()) / 4).sum()
            reached = True
            loss.backward()
    probe.close()
    # the mul differentiates the -inf into the training's values: in use there, raised at once on CPU
    # (the accelerator path raises where it reads its checks back, at the end of the block)
    assert reached == defer
    got = part(tmp_path)
    critical = [r for r in got["rows"] if r["class"] == "critical"]
    assert [(r["op"], r["stage"]) for r in critical][:1] == [("aten.log.default", "forward")]
    assert critical[0]["replay"] == "inherent" and "test_overflow_unused.py" in critical[0]["stack"]
    passed_on = [r["op"] for r in got["rows"] if r["class"] == "propagated" and r["stage"] == "forward"]
    assert passed_on[:1] == ["aten.mul.Tensor"]
    assert got["summary"]["counts"]["discarded"] == 0


def test_ops_that_carry_a_held_inf_on_are_reported_with_it(tmp_path):
    """Outside autograd the -inf is held through the ops that keep it; once in use, the op that
    made it is named first and those ops follow as propagated rows."""
    probe = DispatchProbe(task="overflow", dump_path=str(tmp_path), overflow_nums=-1)
    with probe:
        kept = (torch.log(positions()) * 2 - 1).sum()
    probe.close()
    assert torch.isinf(kept)
    got = part(tmp_path)
    assert [(r["class"], r["op"]) for r in got["rows"]] == [
        ("critical", "aten.log.default"), ("propagated", "aten.mul.Tensor"), ("propagated", "aten.sub.Tensor"),
        ("propagated", "aten.sum.default")]


def test_one_reader_that_keeps_it_is_enough(tmp_path):
    """The same -inf masked on one path and kept on another: in use."""
    probe = DispatchProbe(task="overflow", dump_path=str(tmp_path), overflow_nums=-1)
    with probe:
        h = torch.log(positions())
        kept = masked_by_where(h).sum() + h.sum()
    probe.close()
    assert torch.isinf(kept)
    got = part(tmp_path)
    assert [r["op"] for r in got["rows"] if r["class"] == "critical"] == ["aten.log.default"]
    assert got["summary"]["counts"]["discarded"] == 0


@pytest.mark.parametrize("defer", [False, True])
def test_an_inf_freed_unread_is_reported(tmp_path, defer):
    """No op masked it, yet it is gone: it may have been read where no op shows it (``.item()``)."""
    probe = DispatchProbe(task="overflow", dump_path=str(tmp_path))
    probe.handlers[0].defer = defer
    read = []
    with pytest.raises(OverflowDetected, match=r"aten\.log\.default"):
        with probe:
            read.append(torch.log(positions()).sum().item())
    probe.close()
    assert read == [float("-inf")]


def test_an_overflow_written_into_a_parameter_is_in_use(tmp_path):
    """An in-place op's output is the parameter itself, which outlives the block."""
    weight = torch.full((4,), 100.0).half()
    probe = DispatchProbe(task="overflow", dump_path=str(tmp_path), overflow_nums=-1)
    with probe:
        weight.mul_(torch.tensor(1000.0).half())
    probe.close()
    assert [r["op"] for r in part(tmp_path)["rows"] if r["class"] == "critical"] == ["aten.mul_.Tensor"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tiny_t5_trains_without_overflow(tmp_path, dtype):
    """T5's log(0) in every attention's relative-position buckets is discarded in each step."""
    model, _, inputs = tiny_model("t5")
    model = model.to(dtype).train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    probe = DispatchProbe(task="overflow", dump_path=str(tmp_path), model=model)
    for step in range(2):
        with probe:                                     # raised at the log before (overflow_nums=1)
            loss = model(**inputs(step)).loss
            loss.backward()
        opt.step()
        opt.zero_grad()
        probe.step()
    probe.close()
    assert torch.isfinite(loss)
    for step in range(2):
        got = part(tmp_path, step)
        assert not [r for r in got["rows"] if r["class"] == "critical"]
        discarded = got["summary"]["discarded"]
        assert {d["op"] for d in discarded} == {"aten.log.default"} and len(discarded) == 2   # encoder, decoder
        assert all("aten._to_copy.default -> int64" in d["read_by"] for d in discarded)
    assert probe.summary()["flagged"] == 0 and probe.summary()["discarded"] == 4


def test_a_held_overflow_stops_the_optimizer_before_it_steps(tmp_path):
    """Held past its op, a used overflow is still raised before the optimizer applies it."""
    torch.manual_seed(0)
    net, x = nn.Linear(4, 4), torch.randn(2, 4)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    before = net.weight.detach().clone()
    probe = DispatchProbe(task="overflow", dump_path=str(tmp_path), model=net)
    stepped = False
    with pytest.raises(OverflowDetected, match=r"aten\.log\.default \(forward"):
        with probe:
            (net(x) * torch.log(positions())).sum().backward()
            opt.step()
            stepped = True
    probe.close()
    assert not stepped and torch.equal(net.weight, before)
