"""Acceptance tests of `dispatchprobe compare` (issue #3)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from dispatchprobe.cli import main
from dispatchprobe.offline.compare import compare

sys.path.insert(0, os.path.dirname(__file__))
from compare_helpers import record  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cmp")
    return {
        "clean": record(root / "clean", steps=2),
        "clean2": record(root / "clean2", steps=2),
        "bad": record(root / "bad", plant=True, steps=1),
        "bf16": record(root / "bf16", autocast=True, steps=1),
        "stats": record(root / "stats", task="statistics", steps=1),
        "other": record(root / "other", steps=1, model_kw={"layers": 1, "dim": 32}),
        "root": root,
    }


def test_planted_softmax_is_first_divergence(runs):
    table, verdict = compare(runs["clean"] / "step0" / "rank0", runs["bad"] / "step0" / "rank0")
    f, b = verdict.forward, verdict.backward
    assert (f.op, f.scope, f.call) == ("aten._softmax.default", "TinyTransformer.layers.1.attn", 1)
    assert (b.op, b.scope) == ("aten._softmax_backward_data.default", "TinyTransformer.layers.1.attn")
    assert "one_thousandth" in f.failed
    # nothing before the planted op diverges
    fwd = table[(table.stage == "forward") & (table.kind == "op")]
    assert (fwd[fwd.seq < f.seq].status != "error").all()
    assert not verdict.passed


def test_identical_runs_pass_whole_run(runs):
    table, verdict = compare(runs["clean"], runs["clean2"], jobs=2)
    assert set(table.step) == {0, 1}
    assert (table.status == "pass").all()
    assert verdict.forward is None and verdict.backward is None and verdict.passed
    # AccumulateGrad sometimes steals the gradient instead of copying it (capture-side, varies by run)
    assert set(verdict.unmatched.op) <= {"aten.copy_.default"}


def test_identical_single_part_and_exact_match(runs):
    table, verdict = compare(runs["clean"] / "step1" / "rank0", runs["clean2"] / "step1" / "rank0", match="exact")
    compute = table[table.op_a != "aten.copy_.default"]  # copy_ call indices shift when AccumulateGrad steals
    assert len(compute) > 100 and (compute.status == "pass").all()
    assert set(table.step) == {1}


def test_bf16_autocast_aligns_without_dtype_errors(runs):
    table, verdict = compare(runs["bf16"] / "step0" / "rank0", runs["clean"] / "step0" / "rank0")
    compute = verdict.unmatched[~verdict.unmatched.is_cast]
    assert len(compute) == 0, compute[["side", "stage", "op", "scope"]].to_string()
    mixed = table[table.dtype_a != table.dtype_b]
    assert len(mixed) > 50 and set(mixed.dtype_a) == {"bfloat16"}
    assert (table.status != "error").all(), table[table.status == "error"][["op_a", "arg", "reason"]].to_string()


def test_statistics_compare(runs):
    table, verdict = compare(runs["stats"], runs["clean"] / "step0" / "rank0")
    assert len(table) > 100 and (table.status == "pass").all()
    assert table.cosine.isna().all()  # statistics only on one side: no tensor metrics
    t2, _ = compare(runs["clean"] / "step0" / "rank0", runs["bad"] / "step0" / "rank0", tensors=False)
    assert set(t2.status) >= {"pass", "warning"} or "error" in set(t2.status)
    assert t2.cosine.isna().all()   # tensors=False (--stats-only): no saved tensor is read


def test_mapping_renames_scopes(runs, tmp_path):
    # rename layers.1 -> layers.9 on a copy of B, map it back with the mapping file
    b = tmp_path / "renamed"
    shutil.copytree(runs["clean2"] / "step0" / "rank0", b / "step0" / "rank0")
    ops = b / "step0" / "rank0" / "ops.jsonl"
    ops.write_text(ops.read_text().replace("TinyTransformer.layers.1", "TinyTransformer.layers.9"))
    src = runs["clean"] / "step0" / "rank0"
    _, v1 = compare(src, b / "step0" / "rank0")
    assert len(v1.unmatched) > 0
    mapping = tmp_path / "map.yaml"
    mapping.write_text("scopes:\n  TinyTransformer.layers.1: TinyTransformer.layers.9\n")
    table, v2 = compare(src, b / "step0" / "rank0", mapping=str(mapping))
    assert set(v2.unmatched.op) <= {"aten.copy_.default"} and (table.status == "pass").all()


def test_cli_reports_and_exit_codes(runs, tmp_path):
    out = tmp_path / "report"
    res = CliRunner().invoke(main, ["compare", str(runs["clean"] / "step0" / "rank0"),
                                    str(runs["bad"] / "step0" / "rank0"), "-o", str(out)])
    assert res.exit_code == 2, res.output
    assert "first forward divergence: aten._softmax.default [TinyTransformer.layers.1.attn] call 1" in res.output
    assert "first backward divergence: aten._softmax_backward_data.default" in res.output
    assert f"report: {out}" in res.output
    for name in ("compare.csv", "compare.xlsx", "compare.html", "unmatched.csv"):
        assert (out / name).stat().st_size > 0
    res = CliRunner().invoke(main, ["compare", str(runs["clean"]), str(runs["clean2"]), "-j", "2"])
    assert res.exit_code == 0, res.output


def test_bad_input(runs, tmp_path):
    runner = CliRunner()
    res = runner.invoke(main, ["compare", str(tmp_path / "missing"), str(runs["clean"])])
    assert res.exit_code == 1 and res.output.count("\n") == 1 and "no such records directory" in res.output
    # truncated side: cut ops.jsonl mid-line
    trunc = tmp_path / "trunc"
    shutil.copytree(runs["clean2"] / "step0" / "rank0", trunc / "step0" / "rank0")
    ops = trunc / "step0" / "rank0" / "ops.jsonl"
    data = ops.read_bytes()
    ops.write_bytes(data[: len(data) // 2])
    res = runner.invoke(main, ["compare", str(runs["clean"] / "step0" / "rank0"), str(trunc / "step0" / "rank0"),
                               "-o", str(tmp_path / "rep")])
    assert res.exit_code == 0, res.output  # what was recorded agrees
    assert "incomplete" in res.output and "unmatched records" in res.output
    # different models: partial report, saying what could not be aligned; nothing compared -> exit 1
    res = runner.invoke(main, ["compare", str(runs["other"]), str(runs["clean"] / "step0" / "rank0"),
                               "-o", str(tmp_path / "rep2")])
    assert res.exit_code != 0
    assert "could not be aligned" in res.output
    assert (tmp_path / "rep2" / "unmatched.csv").stat().st_size > 0
    # nothing in common: one-line error, exit 1
    other = tmp_path / "elsewhere"
    shutil.copytree(runs["clean"] / "step0", other / "step5")
    shutil.copy(runs["clean"] / "manifest.json", other / "manifest.json")
    res = runner.invoke(main, ["compare", str(other), str(runs["clean"])])
    assert res.exit_code == 1 and res.output.count("\n") == 1 and "no step/rank in common" in res.output
    # bad mapping file
    bad_map = tmp_path / "m.yaml"
    bad_map.write_text("nonsense: 1\n")
    res = runner.invoke(main, ["compare", str(runs["clean"]), str(runs["clean2"]), "--mapping", str(bad_map)])
    assert res.exit_code == 1 and res.output.startswith("error:") and res.output.count("\n") == 1


def test_compare_without_torch(runs, tmp_path):
    code = ("import sys; sys.modules['torch'] = None\n"
            "from dispatchprobe import compare\n"
            f"t, v = compare({str(runs['clean'] / 'step0' / 'rank0')!r}, {str(runs['bad'] / 'step0' / 'rank0')!r},"
            f" out={str(tmp_path / 'r')!r})\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
            "print(v.forward.op, v.backward.op)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "aten._softmax.default aten._softmax_backward_data.default" in res.stdout


def test_first_divergence_vs_clean_is_symmetric(runs):
    _, v = compare(runs["bad"] / "step0" / "rank0", runs["clean"] / "step0" / "rank0")
    assert v.forward.op == "aten._softmax.default" and v.forward.scope == "TinyTransformer.layers.1.attn"
