"""A true device and ops that cannot run: the manifest and run-ut name a device this machine has
(a CUDA build without a GPU is cpu), an unusable ``--device`` is one line and exit 1 before any op
runs, and an op whose replay raises is not judged, never a precision error, in the CSVs, the
summary, the page, the exit code, online run-ut and precision-compare."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from click.testing import CliRunner

from dispatchprobe import DispatchProbe
from dispatchprobe.cli import main
from dispatchprobe.offline.run_ut import exit_code, run_ut, summary_text
from dispatchprobe.torch import tensor_backend as backend, devices, replay

BROKEN = {"on": False}       # the fragile kernel raises while this is set (after recording)


@torch.library.custom_op("dptest_devices::fragile", mutates_args=())
def fragile(x: torch.Tensor) -> torch.Tensor:
    """An op that runs while training and raises where it is replayed (a kernel gone missing)."""
    if BROKEN["on"]:
        raise RuntimeError("fragile kernel lost its library")
    return x * 2 + 1


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("devices") / "run"
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    w = torch.randn(8, 4)
    probe = DispatchProbe(task="tensor", dump_path=str(path))
    with probe:
        torch.nn.functional.gelu(fragile(x) @ w)
    probe.close()
    return str(path)


@pytest.fixture
def broken():
    BROKEN["on"] = True
    try:
        yield
    finally:
        BROKEN["on"] = False


def status(results: pd.DataFrame) -> pd.Series:
    fwd = results["Forward Test Success"]
    return fwd.where(fwd != "", results["Backward Test Success"])


def cli(*args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    return res.exit_code, res.output


def unavailable_kind() -> str:
    """An accelerator type this machine has no device of (cuda on a CPU machine)."""
    return next(k for k in ("cuda", "xpu", "mps") if devices.device_count(k) == 0)


def test_default_device_is_one_this_machine_has(run_dir):
    """The manifest's device and run-ut's default are an accelerator with a device here, else cpu
    (the CUDA wheel on a machine without a GPU reports cuda as built, not as available)."""
    default = backend.accelerator()
    assert default == "cpu" or devices.device_count(default) > 0, default
    assert replay.resolve_device(None).type == default
    with open(f"{run_dir}/manifest.json", encoding="utf-8") as f:
        assert json.load(f)["device"] == default
    code, text = cli("show", run_dir)
    assert code == 0 and f"device {default}" in " ".join(text.split())


def test_unavailable_device_is_one_line_before_any_op(run_dir, tmp_path):
    kind = unavailable_kind()
    code, text = cli("run-ut", run_dir, "--device", kind, "-o", tmp_path / "o", "--no-progress")
    assert code == 1 and text.strip().count("\n") == 0, text
    assert f"--device {kind}: not available on this machine (" in text and "Traceback" not in text
    assert not (tmp_path / "o").exists()          # said before any work: nothing written
    with pytest.raises(ValueError, match=f"--device {kind}:"):
        run_ut(run_dir, tmp_path / "p", device=kind)
    code, text = cli("run-ut", run_dir, "--device", f"{kind}:7", "-o", tmp_path / "o")
    assert code == 1 and text.strip().count("\n") == 0 and f"{kind}:7" in text


def test_op_that_raises_on_replay_is_not_judged(run_dir, tmp_path, broken):
    res = run_ut(run_dir, tmp_path / "ut", progress=False)
    r, st = res.results, status(res.results)
    bad = r["Op"] == "dptest_devices.fragile.default"
    assert bad.sum() == 1 and list(st[bad]) == ["SKIP"], r[["Op", "Forward Test Success", "Message"]]
    assert r.loc[bad, "Message"].iat[0].startswith("could not replay: device run failed: RuntimeError: fragile "
                                                   "kernel lost its library")
    assert "error" not in set(st) and set(st[~bad]) == {"pass"}
    assert set(res.details.loc[res.details["API Name"] == r.loc[bad, "API Name"].iat[0], "Status"]) == {"SKIP"}
    head = summary_text(res).splitlines()
    assert head[0] == f"run-ut: {len(r)} ops: {len(r) - 1} pass, 0 warning, 0 error, 1 not judged", head
    assert head[1].startswith("  1 ops not judged: their replay raised (device run failed: RuntimeError")
    assert exit_code(res) == (0, "")         # the other ops were judged: a pass, with the op named
    page = open(res.report_html, encoding="utf-8").read()
    assert "not judged" in page and "fragile kernel lost its library" in page
    code, text = cli("run-ut", run_dir, "-o", tmp_path / "cli", "--no-progress")
    assert code == 0 and "1 not judged" in text


def test_nothing_judged_exits_1_never_2(run_dir, tmp_path, broken):
    code, text = cli("run-ut", run_dir, "--api", "fragile", "-o", tmp_path / "one", "--no-progress")
    assert code == 1, text
    summary, line = text.strip().splitlines()[0], text.strip().splitlines()[-1]
    assert summary.endswith("0 pass, 0 warning, 0 error, 1 not judged"), text
    assert line.startswith("error: no op was judged: all 1 ops were skipped; 1 of them: could not replay: "), line


def test_online_run_ut_uses_the_same_rule(run_dir, tmp_path, broken):
    """run-ut --follow judges a run as it is written with the same per-op check and exit code."""
    code, text = cli("run-ut", run_dir, "--follow", "-o", tmp_path / "live", "--no-progress")
    assert code == 0 and "1 not judged" in text and " error  " not in text, text
    [csv] = (tmp_path / "live").glob("accuracy_checking_result_*.csv")
    r = pd.read_csv(csv, dtype=str, keep_default_na=False)
    assert list(status(r)[r["Op"] == "dptest_devices.fragile.default"]) == ["SKIP"]
    code, text = cli("run-ut", run_dir, "--follow", "--api", "fragile", "-o", tmp_path / "live1", "--no-progress")
    assert code == 1 and text.strip().splitlines()[-1].startswith("error: no op was judged"), text


def test_precision_compare_does_not_judge_an_op_that_could_not_run(run_dir, tmp_path):
    ref = run_ut(run_dir, tmp_path / "ref", api="fragile", progress=False)
    BROKEN["on"] = True
    try:
        dut = run_ut(run_dir, tmp_path / "dut", api="fragile", progress=False)
    finally:
        BROKEN["on"] = False
    assert list(status(ref.results)) == ["pass"] and list(status(dut.results)) == ["SKIP"]
    code, text = cli("precision-compare", dut.details_csv, ref.details_csv, "-o", tmp_path / "pc")
    assert code == 1, text
    assert "0 error, 1 not judged" in text and text.strip().splitlines()[-1].startswith("error: no op was judged")
