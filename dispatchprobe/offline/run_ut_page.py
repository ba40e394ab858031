"""run-ut's HTML page: its results as the module tree (the page kit's ``ops_page``)."""

from __future__ import annotations

import os

import numpy as np
import pandas as pd

from ..standards import metrics as M
from ..standards.verdicts import NOT_JUDGED, SKIP
from .page_kit import VERDICT_LEVELS, ops_page, text_number, verdict_severity

# run-ut statuses as levels, ranked and coloured as on every page (page_kit.VERDICT_LEVELS: "not judged"
# above pass); the CSVs' SKIP (not replayed, its replay raised, or nothing compared) reads "not judged"
_SHOWN = {SKIP: NOT_JUDGED}      # CSV status -> the level's name


def run_ut_html(results: pd.DataFrame, details: pd.DataFrame, *, summary: list, records: str, manifest: dict,
                result_csv: str) -> str:
    """run-ut's results by module: each op's status (forward or backward) as its level, the first forward
    and backward error marked, every module holding an error opened; per op its outputs' metrics."""
    fwd, bwd = results["Forward Test Success"], results["Backward Test Success"]
    status = fwd.where(fwd != "", bwd).replace(_SHOWN)
    ops = pd.DataFrame({"step": results["Step"].astype(int), "rank": results["Rank"].astype(int),
                        "stage": results["Stage"], "scope": results["Scope"], "op": results["API Name"],
                        "sev": verdict_severity(status), "mark": status == "error",
                        "status": status, "Category": results["Category"], "Message": results["Message"],
                        "Elapsed (s)": pd.to_numeric(results["Elapsed (s)"], errors="coerce")})
    METRIC_COLUMNS = M.columns()          # run-ut's details columns, from the metric registry
    head = ["Output"] + (["Judged"] if "Judged" in details.columns else []) + ["Device Dtype", "Bench Dtype", "Shape"]
    metric_cols = [c for c in METRIC_COLUMNS if c in details.columns and (details[c] != "").any()]
    row_cols = head + metric_cols + ["Status", "Message"]
    by_op = details.groupby(["Step", "Rank", "API Name"], sort=False).indices
    # the inf/nan filter: ops with an output whose inf/nan pattern differs from the benchmark's
    inf_nan = next((c for c, k in METRIC_COLUMNS.items() if k == "inf_nan_error_rate" and c in details.columns), None)
    flags = []
    if inf_nan:
        bad = details[pd.to_numeric(details[inf_nan], errors="coerce").fillna(0) > 0]
        bad = set(zip(bad["Step"], bad["Rank"], bad["API Name"]))
        flags = [("nf", "inf/nan differs only", "inf/nan",
                  pd.Series([k in bad for k in zip(results["Step"], results["Rank"], results["API Name"])]))]

    def rows_of(labels):
        """Each chosen op's output rows, read from ``details`` in one take."""
        keys = zip(results["Step"][labels], results["Rank"][labels], results["API Name"][labels])
        spans = [(i, by_op.get(k, [])) for i, k in zip(labels, keys)]
        take = details.iloc[np.concatenate([ix for _, ix in spans] + [np.zeros(0, int)])][row_cols]
        take = take.assign(Status=take["Status"].replace(_SHOWN))
        values = take.to_numpy(object).tolist()
        number = [c in metric_cols for c in row_cols]
        out, at = {}, 0
        for i, ix in spans:
            rows = values[at:at + len(ix)]
            at += len(ix)
            out[i] = [[text_number(v) if num else v for v, num in zip(r, number)] for r in rows if r[0] != ""]
        return out

    return ops_page(ops, title="dispatchprobe run-ut", tree_heading="Replayed ops by module", summary=summary,
                    levels=VERDICT_LEVELS, mark="first {stage} error", rows_of=rows_of, message_col="Message", flags=flags,
                    op_cols=["status", "Category", "Message", "Elapsed (s)"], row_cols=row_cols,
                    meta={"records": records, "results": result_csv}, manifest=manifest,
                    full_table=os.path.basename(result_csv),
                    legend="Each op is judged on its own recorded inputs against a float64 benchmark, twice where "
                           "its outputs were saved: run-ut's replay on its device and the outputs the training "
                           "process recorded (column Judged): an error is the op's own, not inherited. An op "
                           "that could not be replayed (its replay raised, a tensor unreadable) is not judged.")


