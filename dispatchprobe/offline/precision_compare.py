"""``precision-compare``: the three-way verdict of two run-ut outputs (no torch).

The device under test (DUT) and a reference device (REF) have each been judged against the
same float64 benchmark by ``run-ut``; this pairs their ``accuracy_checking_details`` rows by
(step, rank, API name, output) and judges the DUT's errors against the REF's with
:func:`dispatchprobe.standards.verdicts.judge_three_way`.  Writes ``api_precision_compare_result_{ts}.csv``
(per op) and ``api_precision_compare_details_{ts}.csv`` (per output); see docs/run-ut.md.
"""

from __future__ import annotations

import glob
import os
import time

import pandas as pd

from ..records.reader import RecordError
from ..standards import metrics
from ..standards.verdicts import BENCHMARK_RATIOS, ERROR, NOT_JUDGED, PASS, SKIP, WARNING, judge_three_way, worst
from ..records.writer import write_csv

_KEY = ["Step", "Rank", "API Name", "Output"]
_METRICS = metrics.derived(metrics.columns)  # run-ut's details column -> metric key
_RATIO_NAMES = {k: metrics.METRICS[k].column.removesuffix(" Rate") for k in BENCHMARK_RATIOS}  # "RMSE Ratio"
DETAIL_COLUMNS = (_KEY + ["Category", "Device Dtype"]
                  + [c for k in BENCHMARK_RATIOS for c in (f"{_RATIO_NAMES[k]} Ratio", f"{_RATIO_NAMES[k]} Verdict")]
                  + ["Inf/Nan Error Rate", "Inf/Nan Verdict", "Rel Err Error Rate", "Rel Err Verdict",
                     "Abs Err Error Rate", "Abs Err Verdict", "Binary Mismatch Rate", "Binary Mismatch Verdict",
                     "ULP Mean", "ULP Over Threshold", "ULP Over Threshold Ratio", "ULP Verdict",
                     "One Thousandth", "One Thousandth Verdict", "Status", "Message"])
RESULT_COLUMNS = ["Step", "Rank", "API Name", "Forward Test Success", "Backward Test Success", "Message"]


def _details_path(path: str) -> str:
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "accuracy_checking_details_*.csv")))
        if not files:
            raise RecordError(f"{path}: no accuracy_checking_details_*.csv in this directory")
        return files[-1]
    if not os.path.isfile(path):
        raise RecordError(f"{path}: no such run-ut details file")
    return path


def _read(path: str) -> pd.DataFrame:
    try:
        df = pd.read_csv(path, dtype=str, keep_default_na=False)
    except (pd.errors.ParserError, UnicodeDecodeError, pd.errors.EmptyDataError) as exc:
        raise RecordError(f"{path}: not a run-ut details CSV ({' '.join(str(exc).split())[:120]})") from None
    missing = [c for c in _KEY + ["Category", "Device Dtype", "Status"] + list(_METRICS) if c not in df.columns]
    if missing:
        raise RecordError(f"{path}: not a run-ut details CSV (missing columns {missing[:4]})")
    if "Judged" in df.columns:     # the devices' replays are compared; recorded outputs are the training's
        df = df[df["Judged"] != "recorded"].reset_index(drop=True)
    return df


def _num(v):
    try:
        return float(v)
    except (TypeError, ValueError):  # "" or None: no value
        return None


def _fmt(v) -> str:
    return "" if v is None else repr(v) if isinstance(v, float) else str(v)


def precision_compare(dut: str, ref: str, out_dir: str = ".") -> tuple[pd.DataFrame, pd.DataFrame, str, str]:
    """Judge the device under test (``dut`` details CSV or run-ut output dir) against the
    reference (``ref``).  Returns (result table, details table, result path, details path)."""
    dut_path, ref_path = _details_path(dut), _details_path(ref)
    d, r = _read(dut_path), _read(ref_path)
    ref_rows = {tuple(row[k] for k in _KEY): row for row in r.to_dict("records")}
    details, per_op, order = [], {}, []
    for row in d.to_dict("records"):
        key = tuple(row[k] for k in _KEY)
        op_key = key[:3]
        if op_key not in per_op:
            per_op[op_key] = []
            order.append((op_key, row["API Name"].endswith(".backward")))
        other = ref_rows.get(key)
        cols: dict = {}
        if row["Status"] == SKIP or row["Output"] == "":   # not judged there (its replay may have raised): nor here
            status, message = SKIP, row.get("Message", "") or "not replayed"
        elif other is None:
            status, message = SKIP, f"no reference row for {key[2]} {key[3]} in {ref_path}"
        elif other["Status"] == SKIP or other["Output"] == "":
            status, message = SKIP, f"the reference did not replay it: {other.get('Message', '')}"
        else:
            dm = {k: v for c, k in _METRICS.items() if (v := _num(row[c])) is not None}
            rm = {k: v for c, k in _METRICS.items() if (v := _num(other[c])) is not None}
            status, cols, message = judge_three_way(row["Category"], dm, rm, row["Device Dtype"])
        per_op[op_key].append((status, message, row["Output"]))
        out = {c: "" for c in DETAIL_COLUMNS}
        out.update({k: row[k] for k in _KEY + ["Category", "Device Dtype"]})
        for k in BENCHMARK_RATIOS:
            out[f"{_RATIO_NAMES[k]} Ratio"] = _fmt(cols.get(f"{k}_ratio"))
            out[f"{_RATIO_NAMES[k]} Verdict"] = cols.get(f"{k}_verdict", "")
        for col, key_, vkey in (("Inf/Nan Error Rate", "inf_nan_error_rate", "Inf/Nan Verdict"),
                                ("Rel Err Error Rate", "rel_err_error_rate", "Rel Err Verdict"),
                                ("Abs Err Error Rate", "abs_err_error_rate", "Abs Err Verdict"),
                                ("Binary Mismatch Rate", "binary_mismatch", "Binary Mismatch Verdict")):
            out[col] = row.get(col, "")
            out[vkey] = cols.get(f"{key_}_verdict", "")
        out["ULP Mean"], out["ULP Over Threshold"] = row.get("ULP Mean", ""), row.get("ULP Over Threshold", "")
        out["ULP Over Threshold Ratio"] = _fmt(cols.get("ulp_over_threshold_ratio"))
        out["ULP Verdict"] = cols.get("ulp_verdict", "")
        out["One Thousandth"] = row.get("One Thousandth", "")
        out["One Thousandth Verdict"] = cols.get("one_thousandth_verdict", "")
        out["Status"], out["Message"] = status, message
        details.append([out[c] for c in DETAIL_COLUMNS])
    results = []
    for op_key, backward in order:
        entries = per_op[op_key]
        statuses = [s for s, _, _ in entries]
        status = SKIP if all(s == SKIP for s in statuses) else worst(s for s in statuses if s != SKIP)
        msg = "; ".join(f"{o}: {m}" if o else m for s, m, o in entries if m and s in (ERROR, WARNING, SKIP))
        results.append(list(op_key) + (["", status] if backward else [status, ""]) + [msg])
    ts = time.strftime("%Y%m%d%H%M%S")
    os.makedirs(out_dir, exist_ok=True)
    res_path = os.path.join(out_dir, f"api_precision_compare_result_{ts}.csv")
    det_path = os.path.join(out_dir, f"api_precision_compare_details_{ts}.csv")
    write_csv(det_path, DETAIL_COLUMNS, details)
    write_csv(res_path, RESULT_COLUMNS, results)
    return (pd.DataFrame(results, columns=RESULT_COLUMNS), pd.DataFrame(details, columns=DETAIL_COLUMNS),
            res_path, det_path)


def exit_code(results: pd.DataFrame) -> tuple[int, str]:
    """(exit code, the line that says why, or ""): 2 when some op is an error, 1 when no op was
    judged (every op SKIP on either side), else 0."""
    status = _status(results)
    if (status == ERROR).any():
        return 2, ""
    if not status.isin([PASS, WARNING]).any():
        return 1, f"no op was judged: none of the {len(results)} ops has outputs both run-ut runs judged"
    return 0, ""


def _status(results: pd.DataFrame) -> pd.Series:
    return results["Forward Test Success"].where(results["Forward Test Success"] != "", results["Backward Test Success"])


def summary_text(results: pd.DataFrame) -> str:
    status = _status(results)
    counts = status.value_counts().to_dict()
    lines = [f"precision-compare: {len(results)} ops: " +
             ", ".join(f"{counts.get(k, 0)} {label}" for k, label in
                       ((PASS, PASS), (WARNING, WARNING), (ERROR, ERROR), (SKIP, NOT_JUDGED)))]
    for _, row in results[status == ERROR].head(20).iterrows():
        lines.append(f"  error  {row['API Name']}  {row['Message'][:160]}")
    return "\n".join(lines)
