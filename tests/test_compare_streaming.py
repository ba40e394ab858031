"""compare reports part by part: what the CLI runs (``keep_table=False``) holds one step/rank part's rows
at a time, and its reports and verdict are those of the whole table.

The reports' bounded selections (the spreadsheet's failing rows, the page's ops per module, its charted
parts, its heatmap) are kept as running "best so far" over the parts; here they are checked against the
same selections made directly on the whole table, with the bounds made small so that every selection
drops rows."""

from __future__ import annotations

import gc
import os
import weakref

import numpy as np
import pandas as pd
import pytest
import torch

from compare_helpers import record_adamw_steps, tiny_llama, wrong_silu_backward
from dispatchprobe.offline import report as R
from dispatchprobe.offline import report_digest as D
from dispatchprobe.offline.compare import compare, driver


def _loss(model):
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    return model(input_ids=tokens, labels=tokens).loss


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three AdamW steps of a tiny Llama, clean and with a wrong silu backward (30% too large)."""
    root = tmp_path_factory.mktemp("streaming")
    clean = record_adamw_steps(root / "clean", tiny_llama(), _loss, steps=3)
    bad = record_adamw_steps(root / "bad", tiny_llama(), _loss, steps=3, plant="silu_backward",
                             kernel=wrong_silu_backward)
    return str(clean), str(bad)


def _files(folder) -> dict:
    return {name: open(os.path.join(folder, name), "rb").read()
            for name in ("compare.csv", "unmatched.csv", "pairing.csv", "compare.html")}


@pytest.mark.parametrize("chunk", [1, driver.CHUNK_ROWS])
@pytest.mark.parametrize("order", ["bad-clean", "clean-bad"])
def test_reports_without_the_table_are_the_same(runs, tmp_path, monkeypatch, order, chunk):
    """The same reports whether the parts are digested one at a time or together."""
    monkeypatch.setattr(driver, "CHUNK_ROWS", chunk)
    a, b = runs if order == "clean-bad" else runs[::-1]
    table, kept = compare(a, b, out=str(tmp_path / "kept"))
    empty, streamed = compare(a, b, out=str(tmp_path / "streamed"), keep_table=False)
    assert not kept.passed and kept.backward is not None and "silu_backward" in kept.backward.op
    assert str(streamed).replace("streamed", "kept") == str(kept)     # the report's folder named last
    assert len(empty) == 0 and len(table) == kept.compared > 0
    assert _files(tmp_path / "kept") == _files(tmp_path / "streamed")
    csv = pd.read_csv(tmp_path / "streamed" / "compare.csv")
    assert len(csv) == len(table) and list(csv.columns) == list(table.columns)
    assert sorted(set(csv["step"])) == [0, 1, 2]


def test_one_part_held_at_a_time(runs, tmp_path, monkeypatch):
    """Without the table, a part's rows are dropped once reported: when a part is reported, the
    tables of the parts before it are gone (the sheet keeps whole parts only while the table fits it;
    a chunk of one row: each part written and digested as it comes)."""
    monkeypatch.setattr(D, "XLSX_MAX_ROWS", 10)
    monkeypatch.setattr(driver, "CHUNK_ROWS", 1)
    alive, seen = [], []
    worker = driver._worker

    def watched(*args, **kwargs):
        res = worker(*args, **kwargs)
        column = res.rows["norm_a"].to_numpy() if res.arrays is None else res.arrays["norm_a"]
        while isinstance(column.base, np.ndarray):     # the memory a reported table would share
            column = column.base
        alive.append(weakref.ref(column))
        return res
    add = R.ReportWriter.add

    def counting(self, table, marks=()):
        gc.collect()
        seen.append(sum(ref() is not None for ref in alive[:-1]))
        return add(self, table, marks)
    monkeypatch.setattr(driver, "_worker", watched)
    monkeypatch.setattr(R.ReportWriter, "add", counting)
    compare(*runs, out=str(tmp_path / "r"), keep_table=False)
    assert len(seen) == 3 and seen == [0, 0, 0]
    seen.clear(), alive.clear()
    compare(*runs, out=str(tmp_path / "k"))
    assert seen == [0, 1, 2]        # the table kept: every earlier part held


@pytest.fixture
def small_bounds(monkeypatch):
    """Bounds small enough that each selection drops rows of these runs; each part digested alone."""
    monkeypatch.setattr(driver, "CHUNK_ROWS", 1)
    monkeypatch.setattr(D, "XLSX_MAX_ROWS", 40)
    monkeypatch.setattr(R, "XLSX_MAX_ROWS", 40)
    monkeypatch.setattr(D, "OPS_PER_NODE", 3)
    monkeypatch.setattr(R, "OPS_PER_NODE", 3)
    monkeypatch.setattr(D, "MAX_CHART_PARTS", 2)
    monkeypatch.setattr(D, "MAX_SUSPICIOUS", 5)


@pytest.mark.parametrize("order", ["bad-clean", "clean-bad"])
def test_selections_match_the_whole_table(runs, small_bounds, tmp_path, monkeypatch, order):
    """What compare's reports select from the parts as they come, against the whole table."""
    a, b = runs[::-1] if order == "bad-clean" else runs
    table, verdict = compare(a, b)
    digests = []
    finish = R.ReportWriter.finish
    monkeypatch.setattr(R.ReportWriter, "finish", lambda self, *args: digests.append(self.digest) or finish(self, *args))
    compare(a, b, out=str(tmp_path), keep_table=False)
    digest = digests[0]
    assert len(table[["step", "rank"]].drop_duplicates()) == 3 and digest.rows == len(table)

    # the sheet: origin error rows, then errors, then warnings, the first 40, in execution order
    rank = table["status"].map({"error": 1, "warning": 2}).fillna(9).to_numpy()
    rank = np.where(table["origin"].fillna(False).astype(bool).to_numpy() & (rank == 1), 0, rank)
    order = np.argsort(rank, kind="stable")[:40]
    expected = table.iloc[np.sort(order[rank[order] < 9])]
    assert (rank < 9).sum() > 40
    pd.testing.assert_frame_equal(digest.sheet_rows().reset_index(drop=True), expected.reset_index(drop=True))
    pd.testing.assert_frame_equal(digest.stage_status(), table.groupby(["stage", "status"]).size().unstack(fill_value=0))

    # the page's ops: per module the 3 first by (marked, worst level, origin), then execution order
    data = R.page_data(digest, verdict, "cosine")
    marks = {tuple(v["key"]) for v in data["divs"].values()}
    assert marks
    ops = D.op_groups(table.reset_index(drop=True), D.nonfinite_rows(table.reset_index(drop=True), verdict.a, verdict.b))
    keys = list(zip(*(ops[c] for c in D.OP_KEYS)))
    ops = ops.assign(skey=ops["scope"].fillna("").astype(str),
                     prio=-(ops["sev"] * 2 + ops["origin"].astype(int) * 4) - [10 * (k in marks) for k in keys])
    chosen = ops.sort_values(["prio", "first"], kind="stable").groupby("skey", sort=False).head(3)
    assert len(chosen) < len(ops)
    expect = {(int(s), int(r), st, k, int(q)) for s, r, st, k, q in zip(*(chosen[c] for c in D.OP_KEYS))}
    assert {tuple(op["k"]) for op in data["ops"]} == expect
    assert sum(len(op["rows"]) for op in data["ops"]) == int(chosen["n"].sum())

    # charts: the first two parts; the heatmap's cells: worst level and counts per part and module
    assert list(data["series"]) == ["0/0", "1/0"] and data["parts"] == ["0/0", "1/0", "2/0"]
    heat = data["heat"]
    out = table[table["io"] == "output"]
    depth = max(len(m.split(".")) for m in heat["modules"] if m != "<top>")
    mod = out["scope"].fillna("").astype(str).str.split(".").str[:depth].str.join(".")
    for i, part in enumerate(heat["parts"]):
        step, rank_ = map(int, part.split("/"))
        here = out[(out["step"] == step) & (out["rank"] == rank_)]
        for j, module in enumerate(heat["modules"]):
            cell = here[mod.loc[here.index].replace("", "<top>") == module]
            assert heat["errors"][i][j] == int((cell["status"] == "error").sum())
            assert heat["warnings"][i][j] == int((cell["status"] == "warning").sum())
    sus = digest.suspicious_rows()
    assert len(sus) == min(5, int((table["origin"].astype(bool) & (table["io"] == "output")
                                   & (table["status"] == "error")).sum()))


def test_a_later_part_with_a_new_column_widens_the_csv(tmp_path):
    """compare.csv holds every column any part has (what joining the parts' tables gives)."""
    first = pd.DataFrame({"step": [0, 0], "rank": [0, 0], "status": ["pass", "error"]})
    second = pd.DataFrame({"step": [1], "rank": [0], "status": ["pass"], "cosine": [0.5]})
    writer = R.ReportWriter(str(tmp_path))
    writer._append(first)
    writer._append(second)
    writer._file.close()
    written = pd.read_csv(str(tmp_path / "compare.csv.tmp"))
    pd.testing.assert_frame_equal(written, pd.concat([first, second], ignore_index=True))
