"""Offline compare of two runs: align op by op, compute the metrics, name the first divergence.

Runs on numpy + pandas only (DESIGN invariant 1): this module, ``align``, ``report``, ``reader``
and ``standards`` never import torch.  Every metric, statistic and verdict comes from
``dispatchprobe.standards`` (invariant 2); the metric columns derive from its registry
(invariant 8).  Run A is the run under test ("actual"), run B the benchmark ("expected").

    >>> table, verdict = dispatchprobe.compare("runs/npu", "runs/cpu")
    >>> print(verdict)
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pandas as pd

from ..standards import metrics as M, statistics as S, verdicts as V
from ..standards.loader import is_float, standard
from ..core import op_traits
from .align import Mapping, align
from ..records.reader import Part, RecordError, load, no_gc, tensor_list

STATS = S.KEYS
# the metrics compare shows (registry order; rel_l2_err also holds a binary row's mismatch rate)
TENSOR_METRICS = M.derived(M.compare_columns)
# CSV columns, in order (documented in docs/compare.md); stats_err and error are compare's own
COLUMNS = M.derived(lambda: ["step", "rank", "stage", "kind", "seq", "scope", "op_a", "op_b", "name_a", "name_b",
                             "call_a", "call_b", "match", "io", "arg", "dtype_a", "dtype_b", "shape_a", "shape_b"]
                    + [f"{s}_{side}" for s in STATS for side in ("a", "b")] + ["nan_a", "nan_b", "inf_a", "inf_b"]
                    + [f"{s}_diff" for s in STATS] + [f"{s}_rel_diff" for s in STATS] + ["checksum_match"]
                    + M.compare_columns() + ["stats_err", "error", "status", "reason", "origin", "stack"])
UNMATCHED_COLUMNS = ["step", "rank", "side", "stage", "kind", "seq", "scope", "op", "name", "call", "is_cast"]
# the metrics compare computes: its columns and what its verdicts read; and their values on equal tensors
_COMPUTED = M.derived(lambda: set(M.compare_columns()) | set(V.COMPARE_READS))
_PERFECT = M.derived(lambda: {m: M.METRICS[m].perfect for m in _COMPUTED})
# the per-tensor row built by compare_parts, before the statistics columns
_ROW_FIELDS = ("stage", "kind", "seq", "scope", "op_a", "op_b", "name_a", "name_b", "call_a", "call_b", "match",
               "io", "arg", "dtype_a", "dtype_b", "shape_a", "shape_b", "nan_a", "nan_b", "inf_a", "inf_b",
               "checksum_a", "checksum_b", "data_a", "data_b", "stack", "uid")
_FLOAT_FIELDS = frozenset(f"{s}_{side}" for s in STATS for side in ("a", "b"))


@dataclass
class Divergence:
    """The first op (or smallest module) whose own error crosses the line, in one stage."""

    stage: str
    step: int
    rank: int
    seq: int
    scope: str
    op: str
    name: str
    call: int
    kind: str
    failed: str                  # the reasons (failed metrics) of its failing outputs
    metrics: dict = field(default_factory=dict)
    stack: list = field(default_factory=list)
    module: str | None = None    # smallest module whose output differs and whose inputs agree

    def describe(self) -> str:
        lines = [f"first {self.stage} divergence: {self.op} [{self.scope or '<top>'}] call {self.call} "
                 f"(#{self.seq} in {self.stage}, step {self.step} rank {self.rank}): {self.failed}"]
        if self.module and self.module != self.scope:
            lines.append(f"  smallest module whose output differs: {self.module}")
        lines += [f"  at {frame}" for frame in self.stack[-4:]]
        return "\n".join(lines)


@dataclass
class Verdict:
    """What compare concluded; ``str()`` gives the terminal summary."""

    a: str
    b: str
    forward: Divergence | None
    backward: Divergence | None
    counts: dict
    unmatched: pd.DataFrame
    problems: list
    parts: list
    report: str | None = None

    @property
    def passed(self) -> bool:
        return self.counts.get("error", 0) == 0

    @property
    def compared(self) -> int:
        return int(sum(self.counts.values()))

    def __str__(self) -> str:
        lines = [f"compared {self.compared} tensors in {len(self.parts)} step/rank part(s): "
                 + ", ".join(f"{k} {self.counts.get(k, 0)}" for k in ("pass", "warning", "error"))]
        for div, stage in ((self.forward, "forward"), (self.backward, "backward")):
            lines.append(div.describe() if div else f"no {stage} divergence")
        compute = self.unmatched[~self.unmatched["is_cast"]] if len(self.unmatched) else self.unmatched
        if len(self.unmatched):
            lines.append(f"unmatched records: {len(self.unmatched)} ({len(compute)} compute ops or modules, "
                         f"{len(self.unmatched) - len(compute)} casts)")
        lines += [f"warning: {p}" for p in self.problems[:5]]
        if len(self.problems) > 5:
            lines.append(f"warning: ... {len(self.problems) - 5} more problems (see the report)")
        if self.report:
            lines.append(f"report: {self.report}")
        return "\n".join(lines)


class Result(NamedTuple):
    """``(table, verdict)``; unpack it or use ``.table`` / ``.verdict``."""

    table: pd.DataFrame
    verdict: Verdict


# ---- one step/rank part -------------------------------------------------------------------------
def _pair_tensors(ra: dict, rb: dict, same_op: bool):
    ta = tensor_list(ra)
    tb = tensor_list(rb)
    if same_op and len(ta) == len(tb) and all(x[1] == y[1] for x, y in zip(ta, tb)):
        for (io, arg, sa), (_, _, sb) in zip(ta, tb):  # the usual case: the same arguments in order
            yield io, arg, sa, sb
    elif same_op:
        by_arg = {arg: (io, spec) for io, arg, spec in tb}
        for io, arg, spec in ta:
            hit = by_arg.get(arg)
            if hit is not None:
                yield io, arg, spec, hit[1]
    else:  # substituted kernel: pair outputs in order
        oa = [(arg, s) for io, arg, s in ta if io == "output"]
        ob = [s for io, arg, s in tb if io == "output"]
        for (arg, sa), sb in zip(oa, ob):
            yield "output", arg, sa, sb


def _frames(part: Part, record: dict) -> list:
    try:
        return list(part.stacks.get(record.get("stack"), []))
    except Exception:  # a stacks file we cannot read must not stop a compare
        return []


def compare_parts(part_a: Part, part_b: Part, match: str = "fuzzy", mapping: Mapping | None = None,
                  tensors: bool = True) -> tuple[pd.DataFrame, pd.DataFrame, list]:
    """Compare one step/rank part against another: (rows, unmatched records, problems)."""
    with no_gc():
        return _compare_parts(part_a, part_b, match, mapping or Mapping(), tensors)


def _compare_parts(part_a: Part, part_b: Part, match: str, mapping: Mapping, tensors: bool):
    recs_a, recs_b = part_a.records, part_b.records
    problems = list(part_a.problems) + list(part_b.problems)
    al = align(recs_a, recs_b, match=match, mapping=mapping)
    step, rank = part_a.step, part_a.rank

    # sequence numbers per stage, in A's (and B's) execution order
    def seqs(recs):
        counters, out = {}, []
        for r in recs:
            c = counters.get(r["stage"], 0)
            out.append(c)
            counters[r["stage"]] = c + 1
        return out
    seq_a, seq_b = seqs(recs_a), seqs(recs_b)

    rows = []
    append = rows.append
    empty: dict = {}
    for i, j, how in al.pairs:
        ra, rb = recs_a[i], recs_b[j]
        same = mapping.op(ra["op"]) == rb["op"] or how == "module"
        stack = None
        head = (ra["stage"], ra["kind"], seq_a[i], ra["scope"], ra["op"], rb["op"], ra["name"], rb["name"],
                ra["call"], rb["call"], how)
        overwritten = op_traits.overwrites_first_input(ra["op"])
        for io, arg, sa, sb in _pair_tensors(ra, rb, same):
            if overwritten and arg == "input.0":
                continue  # the destination's old (often uninitialised) content is not an input
            if stack is None:
                frames = _frames(part_a, ra) if ra.get("stack") is not None else []
                stack = " | ".join(frames[-3:]) if frames else ""
            sta, stb = sa.get("stats") or empty, sb.get("stats") or empty
            append(head + (io, arg, sa["dtype"], sb["dtype"], tuple(sa["shape"]), tuple(sb["shape"]),
                           sta.get("nan"), stb.get("nan"), sta.get("inf"), stb.get("inf"),
                           sa.get("checksum"), sb.get("checksum"), sa.get("data"), sb.get("data"), stack, i,
                           sta.get("max"), stb.get("max"), sta.get("min"), stb.get("min"),
                           sta.get("mean"), stb.get("mean"), sta.get("norm"), stb.get("norm")))
    names = _ROW_FIELDS + tuple(f"{s}_{side}" for s in STATS for side in ("a", "b"))
    columns = list(zip(*rows)) if rows else [()] * len(names)
    del rows
    data = {}
    for name, col in zip(names, columns):
        if name in _FLOAT_FIELDS:  # None -> nan; numbers and "inf"/"nan" strings -> float, as float() does
            data[name] = np.array(col, dtype=np.float64)
        else:
            data[name] = list(col)
    del columns
    df = pd.DataFrame(data)
    df.insert(0, "rank", rank)
    df.insert(0, "step", step)

    rows = []
    for side, idx, recs, seq in (("a", al.only_a, recs_a, seq_a), ("b", al.only_b, recs_b, seq_b)):
        for i in idx:
            r = recs[i]
            rows.append((step, rank, side, r["stage"], r["kind"], seq[i], r["scope"], r["op"], r["name"], r["call"],
                         op_traits.is_cast(r["op"])))
    unmatched = pd.DataFrame(rows, columns=UNMATCHED_COLUMNS)
    if recs_a and recs_b and not al.pairs:
        problems.append(f"step {step} rank {rank}: no record of {part_a.path} could be aligned with "
                        f"{part_b.path} (different models?)")
    elif len(unmatched) and (~unmatched["is_cast"]).any():
        hint = " (different models or options?)" if len(unmatched) > 0.2 * (len(recs_a) + len(recs_b)) else ""
        problems.append(f"step {step} rank {rank}: {int((~unmatched['is_cast']).sum())} of "
                        f"{len(recs_a) + len(recs_b)} records could not be aligned{hint}; listed in unmatched.csv")
    df = _score(df, part_a, part_b, tensors, problems)
    return df, unmatched, problems


def _score(df: pd.DataFrame, part_a: Part, part_b: Part, tensors: bool, problems: list) -> pd.DataFrame:
    """Add the metric and verdict columns to the paired rows (vectorised where the metric allows)."""
    n = len(df)
    sa = {s: df[f"{s}_a"].to_numpy(np.float64) for s in STATS}
    sb = {s: df[f"{s}_b"].to_numpy(np.float64) for s in STATS}
    for k, v in S.compare_stats_columns(sa, sb).items():
        df[k] = v
    stats_err = S.stats_error(sa, sb)
    df["stats_err"] = stats_err
    dtype_a = df["dtype_a"].to_numpy(object)
    dtype_b = df["dtype_b"].to_numpy(object)
    # per distinct (dtype_a, dtype_b) pair, not per row
    pair_codes, pair_uniques = S.factorize(list(zip(dtype_a, dtype_b)))
    judge_dtype = np.array([V.lower_precision(x, y) for x, y in pair_uniques], dtype=object)[pair_codes] if n else \
        np.zeros(0, object)
    # cross-precision part: some float tensor is held in different dtypes on the two sides
    mixed = [V.lower_precision(x, y) for x, y in set(zip(dtype_a, dtype_b)) if x != y and is_float(x) and is_float(y)]
    cross = functools.reduce(V.lower_precision, mixed) if mixed else None
    if cross is not None:
        judge_dtype = np.array([cross if is_float(d) else d for d in judge_dtype], dtype=object)
    nonfinite = ((df["nan_a"].fillna(0).to_numpy() != df["nan_b"].fillna(0).to_numpy())
                 | (df["inf_a"].fillna(0).to_numpy() != df["inf_b"].fillna(0).to_numpy()))
    status, reason = S.judge_stats_columns(stats_err, judge_dtype, nonfinite)
    ca, cb = df["checksum_a"].to_numpy(object), df["checksum_b"].to_numpy(object)
    has_ck = ~pd.isna(ca) & ~pd.isna(cb) if n else np.zeros(0, dtype=bool)
    ck_equal = has_ck & (ca == cb) & (dtype_a == dtype_b)
    df["checksum_match"] = np.where(has_ck, np.where(ck_equal, "equal", "unequal"), "")
    status = np.where(ck_equal, V.PASS, status).astype(object)
    reason = np.where(ck_equal, "", np.where(has_ck & (status != V.PASS), reason + "; checksum unequal", reason)
                      ).astype(object)
    error = stats_err.copy()
    for m in TENSOR_METRICS:
        df[m] = np.nan

    if tensors and n:
        da, db = df["data_a"].to_numpy(object), df["data_b"].to_numpy(object)
        rows = np.flatnonzero(~pd.isna(da) & ~pd.isna(db))
        shapes_ok = [int(np.prod(df["shape_a"].iat[r])) == int(np.prod(df["shape_b"].iat[r])) for r in rows]
        rows = rows[np.array(shapes_ok, dtype=bool)] if len(rows) else rows
        if len(rows):
            results = _tensor_metrics(part_a, part_b, da[rows], db[rows], judge_dtype[rows],
                                      df["dtype_a"].to_numpy(object)[rows], problems)
            scale = np.fmax(np.abs(sb["max"][rows]), np.abs(sb["min"][rows]))
            norm_b = sb["norm"][rows]
            mvals = {m: np.full(len(rows), np.nan) for m in TENSOR_METRICS}
            rel_l2 = mvals["rel_l2_err"]
            for k, (r, res) in enumerate(zip(rows, results)):
                if res is None:
                    continue
                met, kind = res
                for m in TENSOR_METRICS:
                    if m in met:
                        mvals[m][k] = met[m]
                if kind == "binary":
                    mism = met["binary_mismatch"]
                    status[r] = V.ERROR if mism > 0 else V.PASS
                    reason[r] = f"{mism:.2%} of elements differ" if mism > 0 else ""
                    rel_l2[k] = mism
                    continue
                if cross is not None:
                    st, why = V.judge_cross_precision(met, cross)
                else:
                    st, why = V.judge_compare(met, judge_dtype[r], float(scale[k]) if np.isfinite(scale[k]) else 1.0)
                status[r], reason[r] = st, why
                rel_l2[k] = math.inf if met.get("inf_nan_mismatch") else met["rel_l2_err"]
            for m in TENSOR_METRICS:
                df.loc[df.index[rows], m] = mvals[m]
            error[rows] = np.where(np.isnan(rel_l2), error[rows], rel_l2)
    df["error"] = error
    df["status"] = status
    df["reason"] = reason
    df["origin"] = _origins(df)
    return df


def _tensor_metrics(part_a: Part, part_b: Part, keys_a, keys_b, judge_dtypes, dtypes_a, problems):
    """Metrics for each (key_a, key_b); each distinct pair computed once; tensors loaded in chunks."""
    out = [None] * len(keys_a)
    todo: dict = {}
    for k, pair in enumerate(zip(keys_a, keys_b, judge_dtypes)):
        todo.setdefault(pair, []).append(k)
    pairs = list(todo)
    workers = min(_threads(), len(pairs))
    with ThreadPoolExecutor(max_workers=workers) if workers > 1 else contextlib.nullcontext() as pool:
        _metrics_chunks(part_a, part_b, pairs, todo, out, problems, pool)
    return out


def _threads() -> int:
    """Threads for the tensor metrics: ``DISPATCHPROBE_THREADS``, else 1 (the metrics are many
    short numpy calls on cache-sized blocks, holding the GIL between them: threads contend).
    Parts (steps, ranks) still run in parallel processes (``-j``)."""
    env = os.environ.get("DISPATCHPROBE_THREADS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    return 1


def _metrics_chunks(part_a, part_b, pairs, todo, out, problems, pool):
    start = 0
    while start < len(pairs):
        chunk = pairs[start:start + 512]
        start += len(chunk)
        try:
            ta = part_a.tensors_of({p[0] for p in chunk})
            tb = part_b.tensors_of({p[1] for p in chunk})
        except RecordError as exc:
            problems.append(str(exc))
            ta, tb = {}, {}
            for p in chunk:  # fall back to one at a time: keep what can be read
                try:
                    ta[p[0]] = part_a.tensor(p[0])
                    tb[p[1]] = part_b.tensor(p[1])
                except RecordError:
                    pass
        def one(p, ta=ta, tb=tb):
            a, b = ta.get(p[0]), tb.get(p[1])
            return None if a is None or b is None else _metrics_of(a, b, p[2])
        # numpy releases the GIL in the element-wise passes: threads use every core
        for p, res in zip(chunk, pool.map(one, chunk) if pool else map(one, chunk)):
            if res is None:
                continue
            for k in todo[p]:
                out[k] = res
        del ta, tb, one


def _metrics_of(a: np.ndarray, b: np.ndarray, dtype: str):
    if not is_float(dtype) or a.dtype.kind not in "fc" or b.dtype.kind not in "fc":
        return {"binary_mismatch": M.binary_mismatch(a, b), "elements": int(a.size)}, "binary"
    if a.dtype == b.dtype and a.shape == b.shape and _same_bytes(a, b):
        return {**_PERFECT, "elements": int(a.size)}, "float"
    return M.compare_arrays(a, b, dtype, only=_COMPUTED), "float"


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-identical tensors (the common case between two runs): a memcmp when both are plain
    contiguous arrays, else an element-wise pass.  Values equal but not bitwise (-0.0, nan
    payloads) simply go through the metrics, which find them perfect."""
    if a.flags.c_contiguous and b.flags.c_contiguous:
        return memoryview(a).cast("B") == memoryview(b).cast("B")
    return bool(np.array_equal(a, b))


def _origins(df: pd.DataFrame) -> np.ndarray:
    """Per row: does its op introduce the error?  Yes when one of its outputs is an error and the
    worst output relative error exceeds ``origin_amplification`` times the worst input's (inputs that
    agree exactly give 0, so any failing output qualifies).  Inherited errors (inputs already as far
    off as the outputs) do not qualify, in forward or backward."""
    n = len(df)
    if not n:
        return np.zeros(0, dtype=bool)
    amp = float(standard("compare_standards").get("origin_amplification", 10.0))
    uid = df["uid"].to_numpy()
    is_out = (df["io"] == "output").to_numpy()
    status = df["status"].to_numpy(object)
    err = df["error"].to_numpy(np.float64)
    err = np.where(np.isnan(err), 0.0, err)
    key = pd.Series(uid)
    in_err = pd.Series(np.where(is_out, 0.0, err)).groupby(key).transform("max").to_numpy()
    out_bad = is_out & (status == V.ERROR)
    op_out_bad = pd.Series(out_bad).groupby(key).transform("any").to_numpy()
    out_err = pd.Series(np.where(out_bad, err, 0.0)).groupby(key).transform("max").to_numpy()
    return op_out_bad & (out_err > amp * in_err)


# ---- whole runs ----------------------------------------------------------------------------------
def _worker(args):
    path_a, key_a, path_b, key_b, match, mapping, tensors = args
    return compare_parts(Part(path_a, *key_a), Part(path_b, *key_b), match=match, mapping=mapping, tensors=tensors)


def _first(df: pd.DataFrame, stage: str) -> Divergence | None:
    sel = df[(df["stage"] == stage) & df["origin"] & (df["io"] == "output") & (df["status"] == V.ERROR)]
    if not len(sel):
        return None
    ops = sel[sel["kind"] == "op"]
    mods = sel[sel["kind"] == "module"]
    module = None
    if not len(ops):  # no op pairs: the smallest (deepest) origin module of the first part with one
        m0 = mods.sort_values(["step", "rank", "seq"]).iloc[0]
        same = mods[(mods["step"] == m0["step"]) & (mods["rank"] == m0["rank"])]
        module = max(same["scope"], key=lambda s: s.count("."))
    pick = ops if len(ops) else mods
    row = pick.sort_values(["step", "rank", "seq"]).iloc[0]
    rows = pick[(pick["step"] == row["step"]) & (pick["rank"] == row["rank"]) & (pick["uid"] == row["uid"])]
    failed = "; ".join(f"{r.arg}: {r.reason}" for r in rows.itertuples() if r.reason) or "outputs differ"
    met = {m: row[m] for m in [*TENSOR_METRICS, "stats_err"] if pd.notna(row[m])}
    stack = [f for f in str(row["stack"] or "").split(" | ") if f]
    if module is None and row["kind"] == "op":
        mods_all = df[(df["kind"] == "module") & (df["stage"] == stage) & (df["io"] == "output")
                      & (df["status"] == V.ERROR) & (df["step"] == row["step"]) & (df["rank"] == row["rank"])]
        scopes = [s for s in mods_all["scope"].unique() if row["scope"] == s or row["scope"].startswith(s + ".")]
        module = max(scopes, key=lambda s: s.count(".")) if scopes else None
    return Divergence(stage=stage, step=int(row["step"]), rank=int(row["rank"]), seq=int(row["seq"]),
                      scope=row["scope"], op=row["op_a"], name=row["name_a"], call=int(row["call_a"]),
                      kind=row["kind"], failed=failed, metrics=met, stack=stack, module=module)


def compare(a, b, *, match: str = "fuzzy", mapping: str | Mapping | None = None, out: str | None = None,
            jobs: int = 1, progress: bool = False, tensors: bool = True, metric: str = "cosine") -> Result:
    """Compare run (or step/rank folder) ``a`` (under test) against ``b`` (benchmark).

    Returns ``(table, verdict)``: one row per compared tensor (columns in docs/compare.md) and a
    :class:`Verdict`.  With ``out``, writes ``compare.csv``, ``compare.xlsx``, ``unmatched.csv``
    and ``compare.html`` there.  Raises :class:`RecordError` when nothing could be compared.
    """
    if match not in ("fuzzy", "exact"):
        raise ValueError(f"--match must be 'fuzzy' or 'exact', not {match!r}")
    if not isinstance(mapping, Mapping):
        mapping = Mapping.load(mapping)
    run_a, run_b = load(a), load(b)
    problems: list[str] = []
    if len(run_a.parts) == 1 and len(run_b.parts) == 1:
        jobs_list = [(next(iter(run_a.parts)), next(iter(run_b.parts)))]
    else:
        common = sorted(set(run_a.parts) & set(run_b.parts))
        for key in sorted(set(run_a.parts) - set(run_b.parts)):
            problems.append(f"step {key[0]} rank {key[1]}: only in {run_a.path}; not compared")
        for key in sorted(set(run_b.parts) - set(run_a.parts)):
            problems.append(f"step {key[0]} rank {key[1]}: only in {run_b.path}; not compared")
        jobs_list = [(k, k) for k in common]
    if not jobs_list:
        raise RecordError(f"{run_a.path} and {run_b.path} have no step/rank in common "
                          f"({sorted(run_a.parts)} vs {sorted(run_b.parts)})")
    tasks = [(run_a.parts[ka].path, ka, run_b.parts[kb].path, kb, match, mapping, tensors) for ka, kb in jobs_list]
    tables, unmatched = [], []
    for df, um, probs in _run_tasks(tasks, jobs, progress):
        tables.append(df)
        unmatched.append(um)
        problems.extend(probs)
    table = pd.concat(tables, ignore_index=True) if tables else pd.DataFrame(columns=COLUMNS)
    um = pd.concat(unmatched, ignore_index=True) if unmatched else pd.DataFrame(columns=UNMATCHED_COLUMNS)
    um["is_cast"] = um["is_cast"].astype(bool)
    if jobs_list[0][0] != jobs_list[0][1] and len(jobs_list) == 1:
        table["step"], table["rank"] = jobs_list[0][0]
    fwd = _first(table, "forward") if len(table) else None
    bwd = _first(table, "backward") if len(table) else None
    counts = {k: int(v) for k, v in table["status"].value_counts().items()} if len(table) else {}
    verdict = Verdict(a=str(run_a.path), b=str(run_b.path), forward=fwd, backward=bwd, counts=counts, unmatched=um,
                      problems=problems, parts=[k for k, _ in jobs_list])
    table = table.drop(columns=["uid", "data_a", "data_b", "checksum_a", "checksum_b"], errors="ignore")
    table = table[[c for c in COLUMNS if c in table.columns]]
    if out:
        from .report import write_reports
        verdict.report = write_reports(out, table, verdict, run_a.manifest, run_b.manifest, metric=metric)
    if not len(table):
        why = problems[-1] if problems else "no tensor could be paired"
        raise RecordError(f"nothing could be compared: {why}"
                          + (f" (partial report: {verdict.report})" if verdict.report else ""))
    return Result(table, verdict)


def _run_tasks(tasks, jobs: int, progress: bool):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    bar = tqdm(total=len(tasks), desc="compare", unit="part", disable=not progress or tqdm is None,
               leave=False) if tqdm else None
    results = [None] * len(tasks)
    if jobs > 1 and len(tasks) > 1:
        with ProcessPoolExecutor(max_workers=min(jobs, len(tasks))) as pool:
            futures = {pool.submit(_worker, t): k for k, t in enumerate(tasks)}
            for fut in as_completed(futures):
                results[futures[fut]] = fut.result()
                if bar:
                    bar.update()
    else:
        for k, t in enumerate(tasks):
            results[k] = _worker(t)
            if bar:
                bar.update()
    if bar:
        bar.close()
    return results
