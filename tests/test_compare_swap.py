"""A tensor row's verdict does not depend on which run is A: a difference right at float32's 0.001
line (two elements of 1000 off by 1.0010005 relative to run B's, 0.9995e-3 relative to run A's)
counted as failing relative to one run's values and passing relative to the other's, an error one
way round (exit 2) and a warning the other (exit 0).  Errors are now relative to the smaller of the
two values, the worse of the two directions, whichever run is A."""

from __future__ import annotations

import numpy as np
import torch
from click.testing import CliRunner
from torch import nn

from dispatchprobe import DispatchProbe, compare
from dispatchprobe.cli import main
from dispatchprobe.standards import metrics as M, verdicts as V

SIZE, OFF, FACTOR = 1000, 2, 1.0010005   # 0.2 % of the elements at the line: the 0.999 ratio decides


class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(SIZE))

    def forward(self, x):
        return x * self.w


def _record(path, scaled: bool):
    model = _Scale()
    if scaled:
        with torch.no_grad():
            model.w[:OFF] = FACTOR
    x = 1.0 + torch.rand(SIZE, generator=torch.Generator().manual_seed(0))   # away from zero: relative errors count
    probe = DispatchProbe(task="tensor", dump_path=str(path))
    with probe:
        model(x).sum().backward()
    probe.close()
    return path / "step0" / "rank0"


def test_row_at_the_tolerance_line_judged_the_same_both_ways(tmp_path):
    a, b = _record(tmp_path / "scaled", True), _record(tmp_path / "plain", False)
    tables = {"ab": compare(a, b).table, "ba": compare(b, a).table}
    rows = {k: t[(t.op_a == "aten.mul.Tensor") & (t.io == "output")].iloc[0] for k, t in tables.items()}
    # the scaled elements are more than 0.001 off relative to the smaller value, either way round
    assert rows["ab"].status == rows["ba"].status == V.ERROR, {k: (r.status, r.reason) for k, r in rows.items()}
    assert rows["ab"].reason == rows["ba"].reason and "one_thousandth ratio 0.998000" in rows["ab"].reason
    for metric in ("one_thousandth", "one_ten_thousandth", "max_rel_err", "rel_l2_err", "cosine", "max_abs_err"):
        assert np.isclose(rows["ab"][metric], rows["ba"][metric], rtol=1e-12, atol=0), metric
    # every row, and so the exit code, the same whichever run is A
    for col in ("status", "reason"):
        assert tables["ab"][col].tolist() == tables["ba"][col].tolist(), col
    codes = [CliRunner().invoke(main, ["compare", str(x), str(y)]).exit_code for x, y in ((a, b), (b, a))]
    assert codes == [2, 2], codes


def test_symmetric_metrics_are_the_worse_direction():
    """compare_arrays(symmetric=True) swaps into itself, and each ratio is the share of elements within
    the tolerance both ways; without it (run-ut: a reference side) the expected side's values count."""
    rng = np.random.default_rng(1)
    e = rng.uniform(0.5, 2.0, 4096) * rng.choice([-1.0, 1.0], 4096)
    a = e * (1 + rng.uniform(-2e-3, 2e-3, e.size))
    ab = M.compare_arrays(a, e, "float32", symmetric=True)
    ba = M.compare_arrays(e, a, "float32", symmetric=True)
    for name in ("one_thousandth", "one_ten_thousandth", "one_hundredth", "max_rel_err", "mean_rel_err",
                 "rel_l2_err", "cosine", "max_abs_err", "rmse", "ulp_max"):
        assert np.isclose(ab[name], ba[name], rtol=1e-12, atol=0), name
    rel = np.abs(a - e) / np.minimum(np.abs(a), np.abs(e))
    assert ab["one_thousandth"] == np.count_nonzero(rel <= 1e-3) / e.size
    assert ab["rel_l2_err"] == max(M.compare_arrays(a, e, "float32")["rel_l2_err"],
                                   M.compare_arrays(e, a, "float32")["rel_l2_err"])
    plain = M.compare_arrays(a, e, "float32")
    assert plain["one_thousandth"] == np.count_nonzero(np.abs(a - e) / np.abs(e) <= 1e-3) / e.size
    # 0.9995e-3 below e is within 0.001 of e, 1.0005e-3 of itself: outside it both ways
    low = np.ones(8) * (1 - 0.9995e-3)
    assert M.compare_arrays(low, np.ones(8), "float32")["one_thousandth"] == 1.0
    assert M.compare_arrays(low, np.ones(8), "float32", symmetric=True)["one_thousandth"] == 0.0


def test_runs_of_other_parallelism_judge_a_pair_the_same_both_ways():
    """compare across parallelism (offline/compare/parallel.py) scores an assembled pair the same
    with the runs swapped: on tensors, the row at the 0.001 line above (an error both ways; relative
    to run B's values alone it was an error one way and a warning the other), and on statistics alone
    (relative to the larger error of the two directions)."""
    from dispatchprobe.offline.compare.parallel import Value, score
    from dispatchprobe.standards import statistics as S

    x = 1.0 + np.random.default_rng(0).random(SIZE).astype(np.float32)
    y = x.copy()
    y[:OFF] *= np.float32(FACTOR)

    def value(arr, stats):
        return Value(arr.shape, "float32", stats, arr)

    def stats(arr):
        return {"max": float(arr.max()), "min": float(arr.min()), "mean": float(arr.mean(dtype=np.float64)),
                "norm": float(np.linalg.norm(arr.astype(np.float64))), "nan": 0, "inf": 0}

    ab, ba = score(value(y, None), value(x, None)), score(value(x, None), value(y, None))
    assert ab["status"] == ba["status"] == V.ERROR and ab["reason"] == ba["reason"], (ab, ba)
    assert ab["rel_l2_err"] == ba["rel_l2_err"] and ab["max_abs_err"] == ba["max_abs_err"]
    # statistics only: a max moved by 1e-3 of the other run's magnitude, judged from either side alike
    big = x.copy()
    big[np.argmax(big)] *= np.float32(1.001)
    ab, ba = (score(Value(x.shape, "float32", stats(p), None), Value(x.shape, "float32", stats(q), None))
              for p, q in ((big, x), (x, big)))
    assert (ab["status"], ab["reason"], ab["stats_err"]) == (ba["status"], ba["reason"], ba["stats_err"]), (ab, ba)
    assert ab["stats_err"] == max(S.stats_error({k: np.array([v]) for k, v in stats(big).items()},
                                                {k: np.array([v]) for k, v in stats(x).items()})[0],
                                  S.stats_error({k: np.array([v]) for k, v in stats(x).items()},
                                                {k: np.array([v]) for k, v in stats(big).items()})[0])
