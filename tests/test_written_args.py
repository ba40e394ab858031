"""Arguments an op writes are recorded as the op received them, and run-ut replays from them:
batch norm's running statistics (unmarked in ``native_batch_norm``'s schema), in-place ``self`` and
the optimizers' ``_foreach_*_`` lists.  An ``out=`` argument is a destination: its prior contents
are no input, so it is recorded as undefined."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from dispatchprobe import DispatchProbe, load
from dispatchprobe.offline.run_ut import run_ut


def _train_step(probe=None):
    """One SGD (foreach, momentum) step of Linear -> BatchNorm1d, with a ``torch.add(out=)``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    x = torch.randn(8, 4)
    held = torch.full((3,), 7.0)
    for _ in range(2):                      # step 2: the momentum buffers exist and are updated in place
        ctx = probe if probe is not None else _Null()
        with ctx:
            y = model(x)
            torch.add(y[0].detach(), 1.0, out=held)
            y.square().sum().backward()
            opt.step()
            opt.zero_grad()
        if probe is not None:
            probe.step()
    return model, held


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    path = tmp_path_factory.mktemp("written") / "run"
    probe = DispatchProbe(task="tensor", dump_path=str(path))
    model, held = _train_step(probe)
    probe.close()
    return path, model, held


def _first(records, op, stage="forward"):
    return next(r for r in records if r["op"] == op and r["stage"] == stage)


def test_training_is_unchanged(recorded):
    _, model, held = recorded
    ref, ref_held = _train_step()
    for a, b in zip(model.state_dict().values(), ref.state_dict().values()):
        assert torch.equal(a, b)
    assert torch.equal(held, ref_held)


def test_written_arguments_are_recorded_before_the_write(recorded):
    path, _, _ = recorded
    part = load(path).part(0, 0)
    data = lambda spec: np.asarray(part.tensor(spec["data"]))  # noqa: E731
    bn = _first(part.records, "aten.native_batch_norm.default")
    np.testing.assert_array_equal(data(bn["inputs"][3]), np.zeros(3))      # running_mean as received
    np.testing.assert_array_equal(data(bn["inputs"][4]), np.ones(3))       # running_var
    assert bn["inputs"][3]["stats"]["max"] == 0.0 and bn["inputs"][4]["stats"]["min"] == 1.0
    add_out = _first(part.records, "aten.add.out")
    assert add_out["kwargs"]["out"]["undefined"] is True and "stats" not in add_out["kwargs"]["out"]
    assert not np.any(data(add_out["outputs"][0]) == 7.0)                # the output holds what the op wrote
    # num_batches_tracked.add_(1): in-place self before the write
    inc = _first(part.records, "aten.add_.Tensor")
    assert data(inc["inputs"][0]) == 0 and data(inc["outputs"][0]) == 1
    # the second step's optimizer: momentum_buffer.mul_(0.9), then params.add_(buf, alpha=-lr), lists
    part1 = load(path).part(1, 0)
    tensors = lambda spec: [np.asarray(part1.tensor(s["data"])) for s in spec["value"]]  # noqa: E731
    mul = _first(part1.records, "aten._foreach_mul_.Scalar")
    buffers = [data(r["outputs"][0]) for r in part.records if r["op"] == "aten.clone.default"]  # step 0 made them
    assert len(buffers) == 4
    for received, made in zip(tensors(mul["inputs"][0]), buffers):
        np.testing.assert_array_equal(received, made)                   # not 0.9 times them
    upd = [r for r in part1.records if r["op"] == "aten._foreach_add_.List"][-1]
    params_before = tensors(upd["inputs"][0])
    step0_params = [data(s) for s in _first(part.records, "aten._foreach_add_.List")["inputs"][0]["value"]]
    assert not any(np.array_equal(a, b) for a, b in zip(params_before, step0_params))   # step 0 moved them


def test_run_ut_replays_the_writing_ops(recorded, tmp_path):
    path, _, _ = recorded
    res = run_ut(str(path), str(tmp_path / "ut"), api=r"native_batch_norm\.|add\.out|_foreach_\w+_|add_\.")
    r = res.results
    ops = set(r["Op"])
    assert {"aten.native_batch_norm.default", "aten.add.out", "aten.add_.Tensor"} <= ops, ops
    assert any(o.startswith("aten._foreach_") for o in ops), ops
    status = r["Forward Test Success"].fillna("") + r["Backward Test Success"].fillna("")
    assert set(status) <= {"pass"}, r[status != "pass"][["Op", "Message"]]


_LIB = torch.library.Library("dispatchprobe_test_unseen", "DEF")
_LIB.define("fill_unmarked(Tensor buf, float value) -> ()")      # writes buf; its schema does not say so


def _fill_unmarked(buf, value):
    buf.fill_(value)


_LIB.impl("fill_unmarked", _fill_unmarked, "CPU")


@pytest.mark.parametrize("task", ["statistics", "tensor"])
def test_writes_no_version_counter_sees_are_not_taken_for_old_values(tmp_path, task):
    """A custom op (as FSDP's, or a collective) writing an argument its schema does not mark,
    and batch norm updating its running mean, move no version counter: what was measured or
    saved of that memory before is not reused for what a later op reads."""
    bn = nn.BatchNorm1d(3)
    with DispatchProbe(task=task, dump_path=str(tmp_path)) as probe:
        buf = torch.zeros(4)
        buf.sum()
        torch.ops.dispatchprobe_test_unseen.fill_unmarked(buf, 3.0)
        buf.amax()
        bn.running_mean.sum()
        bn(torch.randn(8, 3) + 5)
        bn.running_mean.amax()
    probe.close()
    part = load(tmp_path).part(step=0, rank=0)
    seen = {r["op"]: r["inputs"][0] for r in part.records if r["op"] in ("aten.amax.default", "aten.sum.default")}
    first = [r["inputs"][0] for r in part.records if r["op"] == "aten.amax.default"]
    assert first[0]["stats"]["max"] == 3.0 and seen["aten.sum.default"]["stats"]["max"] == 0.0
    assert first[1]["stats"]["max"] == pytest.approx(bn.running_mean.max().item())
    if task == "tensor":
        assert (part.tensor(first[0]["data"]) == 3.0).all()
        assert np.allclose(part.tensor(first[1]["data"]), bn.running_mean.numpy())


@pytest.mark.parametrize("task", ["statistics", "tensor"])
def test_outputs_of_writing_ops_hold_the_written_values(tmp_path, task):
    """Autograd moves an in-place op's version counter only after the op returned (the mode runs
    below it): the output of ``add_``, of an ``out=`` op and of the ops that overwrite without
    reading (``copy_``, ``fill_``, ``zero_``: DDP copies each averaged bucket back into a gradient
    it measured before) is measured after the write, not taken from what was measured of that
    memory before (here: ``clone``'s output, 1.0)."""
    x, src = torch.ones(3), torch.full((3,), 5.0)
    with DispatchProbe(task=task, dump_path=str(tmp_path / "r")) as probe:
        y = x.clone()
        y.add_(x)
        torch.mul(x, 3, out=y)
        y.copy_(src)
        y.fill_(7.0)
        y.zero_()
    probe.close()
    part = load(tmp_path / "r").part(0, 0)
    means = {r["op"]: r["outputs"][0]["stats"]["mean"] for r in part.records}
    assert means == {"aten.clone.default": 1.0, "aten.add_.Tensor": 2.0, "aten.mul.out": 3.0,
                     "aten.copy_.default": 5.0, "aten.fill_.Scalar": 7.0, "aten.zero_.default": 0.0}
    if task == "tensor":
        assert [float(part.tensor(r["outputs"][0]["data"]).mean()) for r in part.records] == [1, 2, 3, 5, 7, 0]


def test_statistics_need_no_copy_of_what_an_op_overwrites(tmp_path, monkeypatch):
    """Where records need only statistics, an argument an op is about to overwrite is measured
    before the write instead of copied: the records equal those made from copies (momentum
    buffers, parameters, batch norm's running statistics, an ``out=`` destination)."""
    from dispatchprobe.core.session import ProbeSession
    copies = []
    stand_in = ProbeSession.stand_in_for_written

    def counted(self, t, undefined, copy):
        return stand_in(self, t, undefined, lambda x: copies.append(x.shape) or copy(x))
    monkeypatch.setattr(ProbeSession, "stand_in_for_written", counted)

    records = {}
    for how in ("measured", "copied"):
        probe = DispatchProbe(task="statistics", dump_path=str(tmp_path / how))
        probe._measure_written = how == "measured"
        model, _ = _train_step(probe)
        probe.close()
        records[how] = [r for s in (0, 1) for r in load(tmp_path / how).part(s, 0).records]
        if how == "measured":
            assert copies == []
            ref, _ = _train_step()
            assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))
    assert len(copies) >= 8, copies              # the copying run copied each written argument
    # the same values; the measured argument is described as the op received it (a parameter that
    # requires grad), a copy as what it is (a plain tensor made under no_grad)
    assert _values(records["measured"]) == _values(records["copied"])
    updates = [r for r in records["measured"] if r["op"] == "aten._foreach_add_.List"]
    written = [[a.get("param") and a["requires_grad"] and "stats" in a for a in r["inputs"][0]["value"]]
               for r in updates]
    assert [True] * 4 in written, written        # params.add_(momentum, alpha=-lr): Linear's and BatchNorm's


def _values(obj):
    """``obj`` without the fields that say what kind of tensor an argument was."""
    if isinstance(obj, dict):
        return {k: _values(v) for k, v in obj.items() if k not in ("param", "requires_grad")}
    if isinstance(obj, list):
        return [_values(v) for v in obj]
    return obj


def _reads(monkeypatch) -> list:
    """The shapes of the tensors the probe reads for statistics, as it reads them (every record
    is made by the recorder: ``backend.tensor_stats`` sees every read, ``backend.line_stats``
    those of the records it joins from pieces)."""
    from dispatchprobe.torch import tensor_backend as backend
    reads = []
    measure, line = backend.tensor_stats, backend.line_stats

    def counted(tensors, keys=None):
        reads.extend(tuple(t.shape) for t in tensors)
        return measure(tensors, keys)

    def counted_line(keys):
        stats = line(keys)
        if stats is not None:       # None: nothing the records take (the general path reads them)
            reads.extend(key[1] for key in keys)
        return stats
    monkeypatch.setattr(backend, "tensor_stats", counted)
    monkeypatch.setattr(backend, "line_stats", counted_line)
    return reads


def _read_count(probe, reads: list) -> int:
    return len(reads)


def test_a_chain_of_in_place_writes_reads_each_value_once(tmp_path, monkeypatch):
    """Autograd moves a written tensor's version counter after the op returns: the statistics
    measured of the op's output are carried over to that version, so the next in-place op (an
    optimizer's chain) takes its input from them instead of reading the memory again."""
    reads = _reads(monkeypatch)
    x = torch.arange(6, dtype=torch.float32)
    with DispatchProbe(task="statistics", dump_path=str(tmp_path / "r")) as probe:
        x.mul_(2)           # reads x before and after the write
        x.add_(1)           # its input is mul_'s output: no read; its output: one
        y = x * 3           # x: no read; y: one
    probe.close()
    assert _read_count(probe, reads) == 4, reads
    recs = {r["op"]: r for r in load(tmp_path / "r").part(0, 0).records}
    mean = lambda spec: spec["stats"]["mean"]   # noqa: E731
    assert mean(recs["aten.mul_.Tensor"]["inputs"][0]) == 2.5 and mean(recs["aten.mul_.Tensor"]["outputs"][0]) == 5.0
    assert mean(recs["aten.add_.Tensor"]["inputs"][0]) == 5.0 and mean(recs["aten.add_.Tensor"]["outputs"][0]) == 6.0
    assert mean(recs["aten.mul.Tensor"]["inputs"][0]) == 6.0 and mean(recs["aten.mul.Tensor"]["outputs"][0]) == 18.0
    assert torch.equal(y, (torch.arange(6.0) * 2 + 1) * 3)


def test_a_write_between_two_recorded_ops_is_read_again(tmp_path, monkeypatch):
    """An op the config does not record (here ``sub_``) that writes the tensor moves its counter
    once more: nothing measured before is carried over, the next op reads the new values."""
    reads = _reads(monkeypatch)
    x = torch.arange(6, dtype=torch.float32)
    with DispatchProbe(task="statistics", dump_path=str(tmp_path / "r"), list=["mul", "add"]) as probe:
        x.mul_(2)
        x.sub_(4)           # not recorded: x now holds 2 * arange - 4
        x.add_(1)
    probe.close()
    recs = {r["op"]: r for r in load(tmp_path / "r").part(0, 0).records}
    assert set(recs) == {"aten.mul_.Tensor", "aten.add_.Tensor"}
    assert recs["aten.add_.Tensor"]["inputs"][0]["stats"]["mean"] == 1.0
    assert recs["aten.add_.Tensor"]["outputs"][0]["stats"]["mean"] == 2.0
    assert _read_count(probe, reads) == 4, reads


def test_foreach_ops_returning_nothing_record_what_they_wrote(tmp_path):
    """An in-place ``_foreach_*_`` op returns nothing: its record's outputs are the tensors it wrote,
    after the write, as an in-place op's returned ``self`` is (FSDP2 casts its parameters to
    bfloat16 with ``_foreach_copy_``; without them the copies had no producer, and a compare said the
    runs differ at their inputs).  Its inputs hold the lists as received, but for ``_foreach_copy_``'s
    destinations, which it overwrites unread: recorded as written, as ``copy_``'s destination is."""
    src = [torch.randn(4), torch.randn(2, 3)]
    with DispatchProbe(task="tensor", dump_path=str(tmp_path / "run")):
        dst = [torch.empty(4, dtype=torch.bfloat16), torch.empty(2, 3)]     # as FSDP2's all-gather buffer
        torch._foreach_copy_(dst, src)
        copied = [t.clone() for t in dst]
        torch._foreach_add_(dst, src)
        added = [t.clone() for t in dst]
        torch._foreach_mul_(dst, 2.0)
    part = load(tmp_path / "run").part(0, 0)
    records = {r["op"]: r for r in part.records if r["op"].startswith("aten._foreach")}
    for op, before, after in (("aten._foreach_copy_.default", None, copied),
                              ("aten._foreach_add_.List", copied, added),
                              ("aten._foreach_mul_.Scalar", added, [t.clone() for t in dst])):
        rec = records[op]
        assert rec["output_type"] == "list" and len(rec["outputs"]) == 2, rec
        for spec, want in zip(rec["outputs"], after):
            assert spec["dtype"] == str(want.dtype).removeprefix("torch.") and spec["shape"] == list(want.shape)
            np.testing.assert_array_equal(np.asarray(part.tensor(spec["data"])), want.float().numpy())
        for spec, want in zip(rec["inputs"][0]["value"], before or after):
            np.testing.assert_array_equal(np.asarray(part.tensor(spec["data"])), want.float().numpy())
