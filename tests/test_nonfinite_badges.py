"""compare.html's inf/nan badges on the tiny transformer (its causal mask is masked_fill(mask, -inf)):
two identical runs show none; a gelu kernel planted in run B to make inf from finite inputs is badged
on its module (and its ancestors) only as "made", its op card says so, and the counts agree with
compare.csv and with ``dispatchprobe show``'s classification."""

from __future__ import annotations

import contextlib
import os
import sys

import pandas as pd
import pytest
import torch
from torch.nn import functional as F

from dispatchprobe import compare, load
from dispatchprobe.records import nonfinite
from dispatchprobe.offline.summary import summarize

sys.path.insert(0, os.path.dirname(__file__))
from compare_helpers import record  # noqa: E402
from html_check import layout, needs_chromium, page_data  # noqa: E402

PLANTED = "TinyTransformer.layers.0.mlp"


@contextlib.contextmanager
def inf_gelu():
    """aten::gelu on CPU that writes +inf into its output's first element: inf from finite inputs."""
    lib = torch.library.Library("aten", "IMPL")

    def gelu(x, approximate="none"):
        y = x * 0.5 * (1.0 + torch.erf(x / 2 ** 0.5))
        y.view(-1)[0] = float("inf")
        return y

    lib.impl("gelu", gelu, "CPU")
    try:
        yield
    finally:
        lib._destroy()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("nf")
    a, a2 = record(root / "a", task="statistics"), record(root / "a2", task="statistics")
    with inf_gelu():
        b = record(root / "b", task="statistics")
    same = compare(a, a2, out=str(root / "same"))
    planted = compare(a, b, out=str(root / "planted"))
    return root, a, b, same, planted


def node(data, path):
    return next(n for n in data["nodes"] if n["path"] == path)


def test_identical_runs_with_a_causal_mask_have_no_badge(runs):
    root, a, _, (table, _), _ = runs
    masked = table[table["op_a"].astype(str).str.startswith("aten.masked_fill") & (table["io"] == "output")
                   & (table["stage"] == "forward")]
    assert len(masked) and (masked["inf_a"] > 0).all()         # the mask's -inf is in both runs' records
    assert (table[["inf_a", "inf_b"]].fillna(0) > 0).any(axis=1).sum() > len(masked)   # and carried further
    data = page_data(open(root / "same" / "compare.html").read())
    assert all(n["nf"] == 0 and n["nfm"] == 0 for n in data["nodes"])
    assert not any(op["nf"] for op in data["ops"])
    # `show` classifies the same records the same way: the mask written from a constant, nothing made
    text = summarize(load(a))
    assert "none made from finite values" in text and "written from an inf/nan constant" in text


def test_planted_inf_is_badged_where_it_is_made(runs):
    root, _, b, _, (table, _) = runs
    data = page_data(open(root / "planted" / "compare.html").read())
    made = [n["path"] for n in data["nodes"] if n["nfm"] and not any(data["nodes"][c]["nfm"] for c in n["children"])]
    assert made == [PLANTED]
    assert all(n["nfm"] == 1 for n in data["nodes"] if PLANTED.startswith(n["path"]) or n["path"] == "<top>")
    gelu = [data["ops"][i] for i in node(data, PLANTED)["ops"] if data["ops"][i]["op_a"] == "aten.gelu.default"]
    assert [o["nf"] for o in gelu] == ["inf/nan made here from finite values (run B)"]
    # the badge counts agree with compare.csv: op calls whose inf/nan counts differ, or made (the gelu)
    csv = pd.read_csv(root / "planted" / "compare.csv")
    differ = (csv["nan_a"] != csv["nan_b"]) | (csv["inf_a"] != csv["inf_b"])
    ops = csv.assign(differ=differ).groupby(["step", "rank", "stage", "kind", "seq"])["differ"].any()
    root_node = next(n for n in data["nodes"] if n["parent"] is None)
    assert root_node["nf"] == int(ops.sum()) > 1
    # run B's own records: the one record that made inf from finite values is the gelu
    recs = [r for r in load(b).part(0, 0).records if nonfinite.made(r, ops_recorded=True)]
    assert [(r["op"], r["scope"]) for r in recs] == [("aten.gelu.default", PLANTED)]
    assert "1 made from finite values" in summarize(load(b))


@needs_chromium
def test_badges_in_headless_chromium(runs, tmp_path):
    root = runs[0]
    same = layout(root / "same" / "compare.html", tmp_path)
    assert not any("inf/nan" in b for _, badges in same["badges"] for b in badges), same["badges"]
    (tmp_path / "p").mkdir()
    planted = layout(root / "planted" / "compare.html", tmp_path / "p")
    badges = dict(planted["badges"])
    assert "1 inf/nan made" in badges["layers"] or "1 inf/nan made" in badges["0"], planted["badges"]
