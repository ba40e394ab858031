"""Online run-ut: recorded outputs judged beside the replay (offline, --follow, network), a
planted kernel wrong only in the training process caught in every mode."""

from __future__ import annotations

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
