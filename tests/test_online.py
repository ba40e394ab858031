"""Online run-ut: recorded outputs judged beside the replay (offline, --follow, network), a
planted kernel wrong only in the training process caught in every mode."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pandas as pd
import pytest

from dispatchprobe import DispatchProbe
from dispatchprobe.offline.run_ut import run_ut

from online_train import train


def status(results: pd.DataFrame) -> pd.Series:
    fwd, bwd = results["Forward Test Success"], results["Backward Test Success"]
    return fwd.where(fwd != "", bwd)


def errors(results: pd.DataFrame) -> set:
    return set(results.loc[status(results) == "error", "Op"])


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory):
    """A tensor run of the tiny Llama whose silu was wrong while it trained (and only then)."""
    path = tmp_path_factory.mktemp("online") / "run"
    train(DispatchProbe(task="tensor", dump_path=str(path)), plant=True)
    return str(path)


def test_offline_run_ut_catches_a_kernel_wrong_only_in_training(planted_run, tmp_path):
    res = run_ut(planted_run, str(tmp_path / "ut"), progress=False)
    r = res.results
    assert errors(r) == {"aten.silu.default"}, r[status(r) == "error"][["API Name", "Message"]].to_string()
    silu = r[r["Op"] == "aten.silu.default"]
    assert len(silu) == 2 and (silu["Judged"] == "replay+recorded").all()
    assert silu["Message"].str.startswith("recorded output.0:").all()
    d = res.details
    rows = d[d["API Name"].isin(silu["API Name"])]
    assert set(zip(rows["Judged"], rows["Status"])) == {("replay", "pass"), ("recorded", "error")}
    assert (r["Judged"].str.contains("recorded") | (status(r) == "SKIP")).mean() > 0.9


# ---- shared storage: run-ut --follow ----------------------------------------------------------
TRAIN = os.path.join(os.path.dirname(__file__), "online_train.py")
CLI = [sys.executable, "-m", "dispatchprobe.cli"]


def verdicts(results: pd.DataFrame) -> set:
    """What must agree between online and offline run-ut: each op's status and what was judged."""
    return set(zip(results["Step"], results["Rank"], results["API Name"], results["Judged"], status(results)))


def read_results(out) -> pd.DataFrame:
    [path] = glob.glob(os.path.join(str(out), "accuracy_checking_result_*.csv"))
    return pd.read_csv(path, dtype=str, keep_default_na=False)


def test_follow_judges_a_run_while_it_is_written(tmp_path):
    run, out = tmp_path / "nfs", tmp_path / "ut_follow"
    checker = subprocess.Popen(CLI + ["run-ut", str(run), "--follow", "-o", str(out)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)       # started first: waits for the run
    config = {"task": "tensor", "online_run_ut": True, "nfs_path": str(run), "dump_path": str(tmp_path / "unused")}
    subprocess.run([sys.executable, TRAIN, json.dumps(config), "--plant", "--sleep", "0.3"], check=True, timeout=300)
    stdout, stderr = checker.communicate(timeout=300)
    assert checker.returncode == 2, stderr[-2000:]            # an error: the planted silu
    online = read_results(out)
    assert errors(online) == {"aten.silu.default"}, online[status(online) == "error"].to_string()
    assert (tmp_path / "nfs" / "rank0.ended").exists() and not (tmp_path / "unused").exists()
    offline = run_ut(str(run), str(tmp_path / "ut_offline"), progress=False).results
    assert verdicts(online) == verdicts(offline) and len(online) == len(offline)
