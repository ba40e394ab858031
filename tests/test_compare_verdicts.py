"""compare always names where two runs part (issue 12): the op whose own error crosses the line,
an op present in one run only, inputs/parameters that already differ, or runs that do not align;
for statistics records and tensor records alike."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
from click.testing import CliRunner

from dispatchprobe.cli import main
from dispatchprobe.offline.compare import NOT_JUDGED, RunsDoNotAlign, compare

sys.path.insert(0, os.path.dirname(__file__))
from compare_helpers import in_bfloat16, record, record_net, scaled_gelu  # noqa: E402

TASKS = ("statistics", "tensor")
LN = "aten.native_layer_norm.default"


def _eps(model):
    model.enc.layers[1].norm2.eps = 1e-2


def _hook(model):
    model.mlp[0].register_forward_hook(lambda m, args, out: out * 1.01)


def _prehook(model):
    model.head.register_forward_pre_hook(lambda m, args: (args[0] * 1.01,))


def _bug(model):
    return scaled_gelu(0.02)


def _bug_bf16(model):
    in_bfloat16(model.head)
    return scaled_gelu(0.02)


def _bf16(model):
    in_bfloat16(model.head)


@pytest.fixture(scope="module", params=TASKS)
def runs(request, tmp_path_factory):
    task = request.param
    root = tmp_path_factory.mktemp(f"verdicts-{task}")
    made = {name: record_net(root / name, task=task, steps=steps, seed=seed, setup=setup)
            for name, steps, seed, setup in (("clean", 2, 0, None), ("eps", 1, 0, _eps), ("hook", 1, 0, _hook), ("prehook", 1, 0, _prehook),
                                             ("bug", 1, 0, _bug), ("bug_bf16", 1, 0, _bug_bf16),
                                             ("bf16", 1, 0, _bf16), ("seed1", 1, 1, None))}
    made["task"], made["root"] = task, root
    return made


def part(run, step=0):
    return run / f"step{step}" / "rank0"


def _cli(a, b):
    return CliRunner().invoke(main, ["compare", str(a), str(b)])


def test_case1_warning_origin_is_named(runs):
    """A changed layer-norm eps: its own output moves (a warning in statistics), the errors come later."""
    table, v = compare(part(runs["eps"]), part(runs["clean"]))
    f = v.forward
    assert (f.cause, f.op, f.scope) == ("op", LN, "Net.enc.layers.1.norm2"), v
    assert v.backward is not None and v.backward.cause in ("op", "inherited"), v
    # nothing before it differs
    fwd = table[(table.stage == "forward") & (table.kind == "op")]
    assert (fwd[fwd.seq < f.seq].status == "pass").all()
    res = _cli(part(runs["eps"]), part(runs["clean"]))
    assert res.exit_code == 2 and "no forward divergence" not in res.output
    assert f"first forward divergence: {LN} [Net.enc.layers.1.norm2]" in res.output


def test_case2_op_in_one_run_only_is_prime_suspect(runs):
    """A hook scaling mlp.0's output adds an aten.mul to run A only."""
    table, v = compare(part(runs["hook"]), part(runs["clean"]))
    f = v.forward
    assert (f.cause, f.side, f.op) == ("unmatched", "a", "aten.mul.Tensor"), v
    assert f.scope == "Net.mlp.0", v            # the hooked module, not its parent
    res = _cli(part(runs["hook"]), part(runs["clean"]))
    assert res.exit_code == 2
    assert "first forward divergence: aten.mul.Tensor" in res.output and "present only in run A" in res.output
    # the other way round: the op is in run B only
    _, v = compare(part(runs["clean"]), part(runs["hook"]))
    assert (v.forward.cause, v.forward.side, v.forward.op) == ("unmatched", "b", "aten.mul.Tensor"), v
    # a pre-hook scaling head's input: the same, named head
    _, v = compare(part(runs["prehook"]), part(runs["clean"]))
    assert (v.forward.cause, v.forward.op, v.forward.scope) == ("unmatched", "aten.mul.Tensor", "Net.head"), v
    assert "Net.head" in _cli(part(runs["prehook"]), part(runs["clean"])).output


def test_case3_tolerance_is_per_pair(runs):
    """A 2 % gelu bug upstream of a bf16 head: the fp32 rows keep fp32 tolerance."""
    _, alone = compare(part(runs["bug"]), part(runs["clean"]))
    table, v = compare(part(runs["bug_bf16"]), part(runs["clean"]))
    for verdict in (alone, v):
        f = verdict.forward
        assert (f.cause, f.op, f.scope) == ("op", "aten.gelu.default", "Net.mlp.1"), verdict
    gelu = table[(table.op_a == "aten.gelu.default") & (table.io == "output") & (table.stage == "forward")]
    assert (gelu.status == "error").all()
    # the bf16 layer alone is healthy: judged cross-precision, no error
    t2, v2 = compare(part(runs["bf16"]), part(runs["clean"]))
    assert v2.passed and v2.forward is None, v2
    mixed = t2[t2.dtype_a != t2.dtype_b]
    assert len(mixed) and set(mixed.dtype_a) == {"bfloat16"}


def test_case4_inputs_differ(runs):
    """Different weights, and step 0 of one run against step 1 of another."""
    for a, b in ((part(runs["seed1"]), part(runs["clean"])), (part(runs["clean"]), part(runs["clean"], 1))):
        _, v = compare(a, b)
        assert v.forward.cause == "inputs" and v.inputs_differ, v
        assert v.forward.scope == "Net.mlp.0" and v.forward.seq <= 3, v
        # no backward op named on statistics alone after inputs that differ
        assert v.backward is None or not (v.backward.cause == "op" and v.backward.approximate), v
        res = _cli(a, b)
        assert res.exit_code == 2 and "the runs differ already at their inputs/parameters: first seen at" in res.output
        assert "no forward divergence" not in res.output and "no backward divergence" not in res.output


def test_case5_unrelated_models_do_not_align(runs, tmp_path):
    other = record(tmp_path / "tiny", task=runs["task"])
    with pytest.raises(RunsDoNotAlign, match="do not align"):
        compare(part(runs["clean"]), part(other))
    res = _cli(part(runs["clean"]), part(other))
    assert res.exit_code == 1 and res.output.count("\n") == 1, res.output
    assert res.output.startswith("error: the runs do not align")


def test_agreeing_runs_say_so(runs):
    _, v = compare(part(runs["clean"]), part(runs["clean"]))
    assert v.passed and v.forward is None and v.backward is None
    assert "the runs agree: A and B are the same records" in str(v)   # one folder read twice


def test_never_no_divergence_beside_errors(runs):
    for name in ("eps", "hook", "bug", "bug_bf16", "seed1", "bf16"):
        table, v = compare(part(runs[name]), part(runs["clean"]))
        for stage in ("forward", "backward"):
            errors = ((table.stage == stage) & (table.status == "error")).any()
            assert (getattr(v, stage) is not None) == errors, (name, stage, str(v))
            assert (f"no {stage} divergence" in str(v)) == (not errors)
        assert ("the runs agree" in str(v)) == v.passed


def _mark_undefined(src, dst, op: str):
    """Copy a part, change the first ``op`` output's statistics and flag it undefined when asked."""
    shutil.copytree(src, dst)
    ops = dst / "ops.jsonl"
    lines = ops.read_text().splitlines()
    for k, line in enumerate(lines):
        rec = json.loads(line)
        if rec["op"] == op and rec["stage"] == "forward":
            spec = rec["outputs"][0]
            spec["stats"] = dict(spec["stats"], max=spec["stats"]["max"] * 3 + 1, norm=spec["stats"]["norm"] * 2)
            spec.pop("data", None)
            lines[k] = json.dumps(rec)
            return ops, lines, k
    raise AssertionError(f"no {op} record")


def test_undefined_values_are_not_judged(runs, tmp_path):
    src = part(runs["clean"])
    ops, lines, k = _mark_undefined(src, tmp_path / "changed", "aten.gelu.default")
    ops.write_text("\n".join(lines) + "\n")
    table, v = compare(tmp_path / "changed", src)
    assert not v.passed   # the changed statistics are an error ...
    rec = json.loads(lines[k])
    rec["outputs"][0]["undefined"] = True
    lines[k] = json.dumps(rec)
    ops.write_text("\n".join(lines) + "\n")
    table, v = compare(tmp_path / "changed", src)   # ... unless the value is undefined
    assert v.passed and v.forward is None, v
    row = table[(table.op_a == "aten.gelu.default") & (table.arg == "output.0") & (table.stage == "forward")]
    assert list(row.status) == [NOT_JUDGED] and "undefined" in row.reason.iat[0] and "run A" in row.reason.iat[0]
    assert v.counts[NOT_JUDGED] == 1 and "not judged 1" in str(v)
    res = CliRunner().invoke(main, ["compare", str(tmp_path / "changed"), str(src), "-o", str(tmp_path / "rep")])
    assert res.exit_code == 0, res.output
    assert NOT_JUDGED in (tmp_path / "rep" / "compare.csv").read_text()


def test_other_data_leaves_a_statistics_backward_unjudged(tmp_path):
    """Two runs of one tiny Llama on different batches, statistics records: the forward says the inputs
    differ; the backward names no op on statistics alone (nll_loss's gradient has the same statistics
    for any targets, so the op after it looks like the origin), whichever run is A."""
    sys.path.insert(0, os.path.dirname(__file__))
    from compare_helpers import record_tiny, tiny_model
    model, block, inputs = tiny_model("llama")
    batches = {"a": inputs(0), "b": inputs(7)}       # drawn outside the probe: data, not a random op's draws
    a = record_tiny(model, block, lambda step: batches["a"], tmp_path / "a", task="statistics", steps=1)
    b = record_tiny(model, block, lambda step: batches["b"], tmp_path / "b", task="statistics", steps=1)
    for x, y in ((a, b), (b, a)):
        _, v = compare(x, y)
        assert v.forward.cause == "inputs", str(v)
        assert v.backward is not None and v.backward.cause == "after_inputs", str(v)
        res = _cli(x, y)
        assert res.exit_code == 2 and "backward: not judged" in res.output and "first backward divergence" \
            not in res.output, res.output
