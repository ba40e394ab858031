"""run-ut and precision-compare: planted wrong kernel, random mode, resume after SIGKILL,
parallel workers, torchrun sharding, CLI errors."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest
import torch

from dispatchprobe import DispatchProbe
from dispatchprobe.models import TinyTransformer, lm_batch, lm_loss
from dispatchprobe.offline.precision_compare import precision_compare
from dispatchprobe.offline.run_ut import TIMING_COLUMNS, run_ut
from dispatchprobe.standards.verdicts import judge, judge_benchmark, judge_compare, shortcut_limit


def record(path, dtype=torch.float32, task="tensor"):
    torch.manual_seed(0)
    model = TinyTransformer().to(dtype)
    probe = DispatchProbe(task=task, dump_path=str(path), model=model)
    tokens, targets = lm_batch()
    with probe:
        lm_loss(model, tokens, targets).backward()
    probe.step()
    probe.close()
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ut_records")
    return {"f32": record(root / "f32"), "bf16": record(root / "bf16", torch.bfloat16),
            "stats": record(root / "stats", task="statistics")}


def wrong_gelu(x, approximate="none"):
    """gelu with 1e-2 relative error in fp32/bf16 (a dtype-specific kernel bug); float64 -- the
    benchmark -- stays right."""
    if x.dtype == torch.float64:
        return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    y = x.float()
    return (0.5 * y * (1 + torch.erf(y / math.sqrt(2))) * (1 + 1e-2)).to(x.dtype)


@pytest.fixture
def planted_gelu():
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("gelu", wrong_gelu, "CPU")
    try:
        yield
    finally:
        lib._destroy()      # at once: a dropped Library lives until collected, its kernels with it
    x = torch.randn(8)
    assert torch.equal(torch.ops.aten.gelu.default(x), torch.nn.functional.gelu(x))


VERDICT_COLUMNS = ["Step", "Rank", "API Name", "Output", "Category", "Bench Dtype", "Device Dtype", "Shape", "Status"]


def verdict_rows(details: pd.DataFrame) -> set:
    """Detail rows without the metric values (which move in the last bits with the thread count)."""
    return set(map(tuple, details[VERDICT_COLUMNS].values.tolist()))


def status(results: pd.DataFrame) -> pd.Series:
    fwd, bwd = results["Forward Test Success"], results["Backward Test Success"]
    return fwd.where(fwd != "", bwd)


def _diagnosis(res, failing) -> str:
    """What a reader of a failed run needs: the failing rows with their metrics and the torch
    settings that change float32 matmuls (this check has failed intermittently under load)."""
    b = torch.backends
    flags = {"threads": torch.get_num_threads(), "deterministic": torch.are_deterministic_algorithms_enabled(),
             "fp32_precision": getattr(b, "fp32_precision", None),
             "mkldnn.matmul": getattr(b.mkldnn.matmul, "fp32_precision", None) if hasattr(b.mkldnn, "matmul") else None,
             "flush_denormal_probe": float(torch.tensor([1e-40]) * 1) == 0.0}
    names = set(res.results.loc[failing, "API Name"])
    d = res.details[res.details["API Name"].isin(names)]
    cols = [c for c in ("API Name", "Output", "Shape", "Cosine", "Max Abs Err", "Max Rel Err", "ULP Max", "Status", "Message")
            if c in d.columns]
    return f"{flags}\n{d[cols].head(8).to_string()}"


def rows(df: pd.DataFrame) -> set:
    return set(map(tuple, df.drop(columns=[c for c in TIMING_COLUMNS if c in df.columns]).values.tolist()))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_planted_kernel_flagged_clean_ops_pass(runs, tmp_path, planted_gelu, dtype):
    res = run_ut(runs[dtype], tmp_path / "bad")
    r = res.results
    st = status(r)
    is_gelu = r["Op"] == "aten.gelu.default"
    assert is_gelu.sum() == 2 and (st[is_gelu] == "error").all()
    assert not (st[~is_gelu] == "error").any(), _diagnosis(res, (st == "error") & ~is_gelu)
    if dtype == "f32":   # clean fp32 ops: zero errors and zero warnings
        assert set(st[~is_gelu]) <= {"pass", "SKIP"}
    skipped = r[st == "SKIP"]
    assert (skipped["Message"] != "").all()                    # never silently
    assert not skipped["Message"].str.startswith("could not replay").any(), skipped["Message"].head(3).tolist()
    assert os.path.basename(res.result_csv).startswith("accuracy_checking_result_")
    d = res.details
    assert {"Cosine", "Max Abs Err", "ULP Mean", "Status", "Bench Dtype", "Device Dtype"} <= set(d.columns)
    assert (d[d["Output"] != ""]["Bench Dtype"] == "float64").mean() > 0.8   # dtype arguments keep theirs


def gelu_backward_30_percent_high(grad, x, approximate="none"):
    """gelu's gradient 30 % too large in fp32/bf16, right in float64 (the benchmark).  The model's
    gelu gradients are below 1e-3: every error is under msprobe's absolute 0.001 shortcut."""
    y = x.double()
    exact = grad.double() * (0.5 * (1 + torch.erf(y / math.sqrt(2))) + y * torch.exp(-0.5 * y * y) / math.sqrt(2 * math.pi))
    return (exact if x.dtype == torch.float64 else exact * 1.3).to(x.dtype)


@pytest.fixture
def planted_gelu_backward():
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("gelu_backward", gelu_backward_30_percent_high, "CPU")
    try:
        yield
    finally:
        lib._destroy()


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_small_magnitude_planted_kernel_flagged(runs, tmp_path, planted_gelu_backward, dtype):
    """A wrong kernel whose outputs are small is an error: the absolute-error shortcut is scaled by
    the benchmark's magnitude, and clean ops stay free of errors."""
    res = run_ut(runs[dtype], tmp_path / "bad")
    st, op = status(res.results), res.results["Op"]
    bad = op == "aten.gelu_backward.default"
    assert bad.sum() == 2 and (st[bad] == "error").all(), _diagnosis(res, bad)
    assert not (st[~bad] == "error").any(), _diagnosis(res, (st == "error") & ~bad)
    max_abs = res.details.loc[res.details["API Name"].str.startswith("aten.gelu_backward"), "Max Abs Err"].astype(float)
    assert 0 < max_abs.max() < 1e-3       # what the unscaled shortcut passed


def test_small_float16_outputs_not_passed_by_the_shortcut(tmp_path, planted_gelu_backward):
    """float16 gradients of O(1e-4) made 30 % too large: their errors (2e-5) are under fp16's smallest
    normal (6.1e-5) but above the absolute tolerance of small values (1e-5), so the shortcut does
    not pass them; the tiers, relative to fp16's small value 1e-3, see them."""
    torch.manual_seed(0)
    model = TinyTransformer().to(torch.float16)
    probe = DispatchProbe(task="tensor", dump_path=str(tmp_path / "f16"), model=model)
    tokens, targets = lm_batch()
    with probe:
        (lm_loss(model, tokens, targets) * 0.1).backward()
    probe.step()
    probe.close()
    res = run_ut(str(tmp_path / "f16"), tmp_path / "bad")
    st, op = status(res.results), res.results["Op"]
    bad = op == "aten.gelu_backward.default"
    assert bad.sum() == 2 and (st[bad] != "pass").all(), _diagnosis(res, bad)
    assert not (st[~bad] == "error").any(), _diagnosis(res, (st == "error") & ~bad)
    max_abs = res.details.loc[res.details["API Name"].str.startswith("aten.gelu_backward"), "Max Abs Err"].astype(float)
    assert 1e-5 < max_abs.max() < 2.0 ** -14    # under the smallest normal, over small values' tolerance


def test_absolute_shortcut_scales_with_magnitude_down_to_the_smallest_normal():
    """One rule for run-ut and compare: the 0.001 shortcut times the expected magnitude below 1,
    never below the dtype's smallest normal (an output that underflows to zero is not an error)
    nor above the absolute tolerance of small values."""
    assert shortcut_limit("float32", 7e-4) == pytest.approx(7e-7)
    assert shortcut_limit("float32", 5.0) == shortcut_limit("float32", None) == 0.001
    assert shortcut_limit("float16", 1e-3) == 1e-5         # small values' absolute tolerance (under 2**-14)
    assert shortcut_limit("bfloat16", 1e-36) == 2.0 ** -126
    wrong = {"cosine": 1.0, "max_abs_err": 2.2e-4, "one_hundredth": 0.2, "one_thousandth": 0.0,
             "one_ten_thousandth": 0.0}
    assert judge_benchmark(wrong, "float32")[0] == "pass"          # msprobe's absolute shortcut
    assert judge_benchmark(wrong, "float32", magnitude=7e-4)[0] == "error"
    assert judge_compare(wrong, "float32", 7e-4) == judge_benchmark(wrong, "float32", magnitude=7e-4)
    flushed = {"cosine": float("nan"), "max_abs_err": 9.5e-41, "one_hundredth": 0.0, "one_thousandth": 0.0,
               "one_ten_thousandth": 0.0}
    assert judge_benchmark(flushed, "float32", magnitude=9.5e-41) == ("pass", "")
    flushed["max_abs_err"] = 1e-37
    assert judge_benchmark(flushed, "float32", magnitude=1e-37)[0] == "error"


def test_mixed_precision_output_judged_at_its_lowest_input_precision():
    """An fp32 output computed from bf16 inputs is held to bf16's tiers (as compare judges it)."""
    m = {"cosine": 1.0, "max_abs_err": 0.05, "one_hundredth": 0.995, "one_thousandth": 0.5,
         "one_ten_thousandth": 0.1}
    assert judge("benchmark", m, "float32", input_dtypes=["float32"])[0] == "error"
    assert judge("benchmark", m, "float32", input_dtypes=["bfloat16", "float32", "int64"])[0] == "warning"


def test_parallel_workers_save_error_data(runs, tmp_path, planted_gelu):
    bad = run_ut(runs["f32"], tmp_path / "bad", jobs=2, save_error_data=True)   # forked workers inherit the kernel
    saved = os.listdir(tmp_path / "bad" / "error_data")
    assert len(saved) == 2 and all("gelu" in f for f in saved)
    from safetensors.torch import load_file
    data = load_file(str(tmp_path / "bad" / "error_data" / sorted(saved)[0]))
    assert {"input.0", "output.0.device", "output.0.bench"} <= set(data)
    assert (status(bad.results) == "error").sum() == 2, _diagnosis(bad, status(bad.results) == "error")


def test_three_way(runs, tmp_path):
    clean_dir = tmp_path / "clean"
    run_ut(runs["f32"], clean_dir)                        # the reference device: correct kernels
    lib = torch.library.Library("aten", "IMPL")           # the device under test: a wrong gelu
    lib.impl("gelu", wrong_gelu, "CPU")
    try:
        bad = run_ut(runs["f32"], tmp_path / "bad")
    finally:
        lib._destroy()      # at once: a dropped Library lives until collected, its kernels with it
    results, details, res_path, det_path = precision_compare(bad.details_csv, str(clean_dir), tmp_path / "pc")
    st = status(results)
    gelu = results["API Name"].str.startswith("aten.gelu.default")
    assert (st[gelu] == "error").all() and gelu.sum() == 2
    assert set(st[~gelu]) <= {"pass", "SKIP"}, results[~gelu & ~st.isin(["pass", "SKIP"])]
    assert os.path.basename(res_path).startswith("api_precision_compare_result_")
    assert os.path.basename(det_path).startswith("api_precision_compare_details_")
    assert {"RMSE Ratio", "Max Rel Err Verdict", "ULP Verdict", "Status"} <= set(details.columns)


def test_jobs_and_filter_duplicates(runs, tmp_path):
    one = run_ut(runs["f32"], tmp_path / "j1")
    two = run_ut(runs["f32"], tmp_path / "j2", jobs=2)
    assert rows(one.results) == rows(two.results)
    assert verdict_rows(one.details) == verdict_rows(two.details)
    dedup = run_ut(runs["f32"], tmp_path / "dd", filter_duplicates=True)
    msgs = dedup.results["Message"]
    assert msgs.str.startswith("duplicate of").sum() > 0
    assert len(dedup.results) == len(one.results)


def test_random_mode_on_statistics_records(runs, tmp_path):
    res = run_ut(runs["stats"], tmp_path / "rnd", random=True)
    st = status(res.results)
    assert len(res.results) > 100
    replayable = st != "SKIP"
    assert replayable.sum() >= len(st) - 8
    assert set(st[replayable]) <= {"pass", "warning", "error"}
    skipped = res.results[~replayable]
    assert skipped["Message"].str.contains("integer-only|random op|nothing to check").all(), skipped
    # without --random, statistics records are skipped with the reason
    plain = run_ut(runs["stats"], tmp_path / "plain", api="aten.mm")
    assert (status(plain.results) == "SKIP").all()
    assert plain.results["Message"].str.contains("--random").all()


SLOW = """
import time, dispatchprobe.offline.run_ut as m
_orig = m.check_op
def slow(*a):
    time.sleep(0.03)
    return _orig(*a)
m.check_op = slow
"""


def test_resume_after_sigkill(runs, tmp_path):
    (tmp_path / "slowdown.py").write_text(SLOW)
    out = tmp_path / "killed"
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen([sys.executable, "-m", "dispatchprobe.cli", "run-ut", runs["f32"], "-o", str(out),
                             "--import", "slowdown"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    result = None
    while time.time() < deadline:
        found = list(out.glob("accuracy_checking_result_*.csv")) if out.exists() else []
        if found and found[0].read_text().count("\n") > 30:
            result = found[0]
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert result is not None
    with open(result, "a") as f:
        f.write("0,0,aten.torn")             # a torn last line
    n_before = result.read_text().count("\n") - 1
    full = run_ut(runs["f32"], tmp_path / "full")
    assert n_before < len(full.results)
    resumed = run_ut(runs["f32"], resume=str(result))
    assert resumed.replayed == len(full.results) - n_before
    assert rows(resumed.results) == rows(full.results)
    assert len(resumed.results) == len(full.results)          # no duplicate rows
    assert rows(resumed.details) == rows(full.details) and len(resumed.details) == len(full.details)


def free_port() -> int:
    """A port no other test session on this machine holds (a fixed one collided)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_two_ranks_merge(runs, tmp_path):
    single = run_ut(runs["f32"], tmp_path / "single")
    out = tmp_path / "dist"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "dispatchprobe.cli", "run-ut", runs["f32"], "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-2000:]
    files = sorted(os.listdir(out))
    # merged and rank 0's page; the rank journals are gone
    assert [f.split("_")[2] for f in files] == ["details", "options", "report", "result"], files
    merged = pd.read_csv(out / [f for f in files if "result" in f][0], dtype=str, keep_default_na=False)
    details = pd.read_csv(out / [f for f in files if "details" in f][0], dtype=str, keep_default_na=False)
    assert list(merged["API Name"]) == list(single.results["API Name"])
    assert rows(merged) == rows(single.results)
    assert verdict_rows(details) == verdict_rows(single.details)
    from html_check import page_data
    root = next(n for n in page_data((out / next(f for f in files if "report" in f)).read_text())["nodes"] if n["parent"] is None)
    assert sum(root["c"]) == len(merged)                       # the page holds both ranks' ops


def test_cli_errors(runs, tmp_path):
    from click.testing import CliRunner
    from dispatchprobe.cli import main

    def cli(*args):
        res = CliRunner().invoke(main, list(args))
        return res.exit_code, res.output
    code, text = cli("run-ut", str(tmp_path / "nope"), "-o", str(tmp_path / "o"))
    assert code == 1 and text.strip().count("\n") == 0 and "nope" in text
    code, text = cli("run-ut", runs["f32"], "--resume", str(tmp_path / "x.csv"))
    assert code == 1 and "accuracy_checking_result_" in text
    code, text = cli("run-ut", runs["f32"], "--device", "nosuchdevice", "-o", str(tmp_path / "o"))
    assert code == 1 and text.strip().count("\n") == 0
    code, text = cli("precision-compare", str(tmp_path / "a.csv"), str(tmp_path / "b.csv"))
    assert code == 1 and text.strip().count("\n") == 0
    code, text = cli("run-ut", runs["f32"], "--import", "no_such_module_xyz", "-o", str(tmp_path / "o"))
    assert code == 1 and "no_such_module_xyz" in text
    code, text = cli("run-ut", runs["f32"], "-o", str(tmp_path / "ok"), "--api", "aten.mm", "--no-progress")
    assert code == 0 and "pass" in text


NO_TORCH = """
import sys
sys.modules["torch"] = None                       # any import of torch now fails
import numpy as np
from safetensors.numpy import save_file
from dispatchprobe.offline.replayer import Output, Replayed, Replayer, ReplayError, Skip
from dispatchprobe.offline.run_ut import run_ut
from dispatchprobe.records.format import walk

def replay(record, part, device, random=False, keep_data=False):   # device: the recorded outputs, mm's off by 1 %
    if record["op"] == "aten.gelu.default":
        raise ReplayError("planted failure")
    outs = walk(record, inputs=False)
    if not outs:
        raise Skip("no output tensor")
    res = Replayed()
    for _, arg, spec in outs:
        b = np.asarray(part.tensor(spec["data"]))
        b = b.astype(np.float64) if b.dtype.kind == "f" else b
        d = b * 1.01 if record["op"] == "aten.mm.default" and b.dtype.kind == "f" else b
        res.outputs.append(Output(arg, d, b, spec["dtype"], str(b.dtype), tuple(spec["shape"])))
        if keep_data:
            res.data[arg + ".device"] = d
    return res

fake = Replayer("numpy", replay=replay, resolve_device=lambda name: name or "host", tensor_source=lambda part: part,
                set_threads=lambda n: 1, save_error_data=lambda path, data, meta: save_file(data, path, meta),
                distributed=lambda: None)
run_ut(sys.argv[1], sys.argv[2], jobs=2, save_error_data=True, replayer=fake, progress=False)
assert not [m for m in sys.modules if m.startswith("dispatchprobe.torch")]
"""


def test_driver_runs_without_torch(runs, tmp_path):
    """A framework plugs in only its replay: the driver, workers and CSVs need no torch."""
    out = tmp_path / "np"
    done = subprocess.run([sys.executable, "-c", NO_TORCH, runs["f32"], str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    r, d = (pd.read_csv(next(out.glob(f"accuracy_checking_{kind}_*.csv")), dtype=str, keep_default_na=False)
            for kind in ("result", "details"))
    st = status(r)
    assert set(st) == {"pass", "error", "SKIP"} and (st == "pass").sum() > 50
    assert (st[r["Op"] == "aten.mm.default"] == "error").all()
    gelu = r[r["Op"] == "aten.gelu.default"]      # its replay raised: not judged, never an error
    assert len(gelu) == 2 and (status(gelu) == "SKIP").all()
    assert (gelu["Message"] == "could not replay: planted failure").all()
    assert len(os.listdir(out / "error_data")) == (r["Op"] == "aten.mm.default").sum()
    assert set(d["Status"]) == {"pass", "error", "SKIP"} and (d["Cosine"] != "").any()


def test_unknown_framework(runs, tmp_path):
    import json
    import shutil
    from click.testing import CliRunner
    from dispatchprobe.cli import main
    path = shutil.copytree(runs["stats"], tmp_path / "ms")
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps(dict(manifest, framework="nosuchframework")))
    with pytest.raises(ValueError, match="framework 'nosuchframework'"):
        run_ut(path, tmp_path / "o")
    res = CliRunner().invoke(main, ["run-ut", str(path), "-o", str(tmp_path / "o")])
    assert res.exit_code == 1 and res.output.strip().count("\n") == 0 and "nosuchframework" in res.output


def test_documented_python_api_works_twice(runs, tmp_path):
    """``dispatchprobe.run_ut`` stays the function however often it is used (the run-ut module
    once shadowed it after its first import)."""
    import dispatchprobe
    first = dispatchprobe.run_ut(runs["stats"], tmp_path / "one", api="aten.mm")
    second = dispatchprobe.run_ut(runs["stats"], tmp_path / "two", api="aten.mm")
    assert callable(dispatchprobe.run_ut)
    assert len(first.results) == len(second.results) > 0


def test_complex_outputs_judged_as_complex_and_saved(tmp_path):
    """A complex op is judged by its values (not bitwise against complex128); its error data,
    complex included, is saved as (re, im) pairs."""
    def wrong_polar(r, theta):
        out = torch.complex(r * torch.cos(theta), r * torch.sin(theta))
        return out if r.dtype == torch.float64 else out * (1 + 1e-2)

    torch.manual_seed(0)
    r, theta, x = torch.rand(64) + 0.5, torch.randn(64), torch.randn(32)
    probe = DispatchProbe(task="tensor", dump_path=str(tmp_path / "rec"))
    with probe:
        torch.fft.fft(x)
        torch.polar(r, theta)
    probe.close()
    clean = run_ut(str(tmp_path / "rec"), tmp_path / "clean")
    assert set(status(clean.results)) == {"pass"}, clean.results
    assert set(clean.details["Category"]) == {"benchmark"}          # complex64: not binary
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("polar", wrong_polar, "CPU")
    try:
        bad = run_ut(str(tmp_path / "rec"), tmp_path / "bad", save_error_data=True)
    finally:
        lib._destroy()      # at once: a dropped Library lives until collected, its kernels with it
    st = status(bad.results)
    assert list(st[bad.results["Op"] == "aten.polar.default"]) == ["error"] and (st == "error").sum() == 1
    from safetensors import safe_open
    [saved] = os.listdir(tmp_path / "bad" / "error_data")
    with safe_open(str(tmp_path / "bad" / "error_data" / saved), framework="pt") as f:
        assert set(f.metadata()["complex"].split(",")) == {"output.0.device", "output.0.bench", "output.0.recorded"}
        assert f.get_tensor("output.0.bench").shape == (64, 2)
