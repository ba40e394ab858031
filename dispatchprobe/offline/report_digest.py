"""What compare's reports keep of its table, fed one step/rank part at a time.

A long run's table grows with its steps (one row per paired tensor), but its reports need neither
the whole table nor more than one part of it at once: the spreadsheet shows at most
``XLSX_MAX_ROWS`` rows and per-stage counts, the page per-module aggregates, at most
``OPS_PER_NODE`` ops per module, one chart point per op of the first ``MAX_CHART_PARTS`` parts and
one heatmap cell per part and module.  :class:`TableDigest` keeps exactly those, so compare's memory
is bounded by one part whatever the run's length; the page and the sheet are the same as from the
whole table (selections are kept as running "best so far", which keeps the overall best).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pandas as pd

from ..records import nonfinite
from ..records.reader import RecordError, load
from ..standards import metrics as M
from ..standards.verdicts import ERROR, NOT_JUDGED, OUT_PRIOR_CONTENTS, UNDEFINED_CONTENTS, WARNING
from .compare.verdict import call_words, place_words
from .page_kit import OPS_PER_NODE, VERDICT_LEVELS, VERDICT_SEVERITY, col, verdict_severity

# columns a chart can show, and whether larger is worse: compare's metric columns and two of its own
CHART_METRICS = M.derived(lambda: {**{m: M.METRICS[m].larger_is_worse for m in M.compare_columns()},
                                   "error": True, "norm_rel_diff": True})
MAX_CHART_PARTS = 64   # step/rank parts charted (the selector lists them)
HEATMAP_MODULES = 60
# Rows in the ``compare`` sheet: every row of runs up to XLSX_MAX_ROWS; of bigger ones the failing rows
# (origin rows, then errors, then warnings, up to XLSX_MAX_ROWS), in execution order.  Why bounded: a
# spreadsheet cell costs ~4 us to write (13k rows x 55 columns took 11 s); compare.csv keeps every row.
XLSX_MAX_ROWS = 4000
MAX_SUSPICIOUS = 2000  # origin rows listed in the page's table
# the explorer's levels by severity (templates/explorer.js): the verdict codes compare's rows carry, ranked
# as on every page (page_kit.VERDICT_LEVELS: "not judged" above pass)
COMPARE_LEVELS = VERDICT_LEVELS
SEVERITY = VERDICT_SEVERITY
_EMPTY = -1   # a row with nothing in it to judge (uninitialised memory): lifts no op above its other rows
ROW_COLS = ["io", "arg", "dtype_a", "dtype_b", "shape_a", "shape_b"] + \
    [f"{s}_{side}" for s in ("max", "min", "mean", "norm") for side in ("a", "b")] + \
    ["nan_a", "nan_b", "inf_a", "inf_b", "checksum_match"]
ROW_METRICS = ["cosine", "max_abs_err", "max_rel_err", "rel_l2_err", "stats_err"]
OP_KEYS = ["step", "rank", "stage", "kind", "seq"]
SUSPICIOUS_COLS = ["step", "rank", "stage", "seq", "seq_b", "kind", "scope", "op_a", "op_b", "call_a", "call_b", "arg",
                   "dtype_a",
                   "dtype_b", "cosine", "max_abs_err", "max_rel_err", "rel_l2_err", "stats_err", "status", "reason"]
_SHEET_RANK = {"error": 1, "warning": 2}
_OP_COLUMNS = OP_KEYS + ["scope", "sev", "nf", "nfm", "nfa", "nfb", "origin", "first", "n"]


def row_severity(table: pd.DataFrame) -> np.ndarray:
    """Each row's level (an index into COMPARE_LEVELS), or ``_EMPTY`` for a value with nothing in it to
    judge: an op's uninitialised buffer says nothing of the runs, so it leaves the op at its other rows'
    level; an op with only such rows is "not judged" (:func:`shown_severity`)."""
    status = table["status"]
    sev = verdict_severity(status)
    if "reason" in table.columns:
        empty = (status == NOT_JUDGED) & table["reason"].astype(str).str.startswith(
            (UNDEFINED_CONTENTS, OUT_PRIOR_CONTENTS))
        sev[empty.to_numpy()] = _EMPTY
    return sev


def shown_severity(sev):
    """Aggregated row levels as the page shows them: an op or module with only empty values is not judged."""
    return np.where(np.asarray(sev) == _EMPTY, SEVERITY[NOT_JUDGED], sev)


def chartable() -> list:
    """The columns a chart or the heatmap may read: the chart metrics and the statistics error."""
    return list(CHART_METRICS) + ["stats_err"]


def worse_high(metric: str) -> bool:
    return bool(CHART_METRICS.get(metric, True))


class TableDigest:
    """What the reports read of compare's table (the reported columns), kept as :meth:`add` is given
    its step/rank parts in execution order.  ``run_a``/``run_b``: the runs' paths, read again for the
    parts whose rows hold nan/inf (:func:`nonfinite_rows`)."""

    def __init__(self, run_a: str | None = None, run_b: str | None = None):
        self.run_a, self.run_b = run_a, run_b
        self.rows = 0                          # rows seen (the next part's first row index)
        self.columns: list = []                # the table's columns, in order (first seen)
        self.by_stage_status: Counter = Counter()
        self.head: list = []                   # every row while the table fits the sheet
        self.sheet: pd.DataFrame | None = None   # its failing rows, best so far (see XLSX_MAX_ROWS)
        self.suspicious: list = []             # origin error outputs, the first MAX_SUSPICIOUS
        self.n_suspicious = 0
        self.scope_sev: Counter = Counter()    # (scope, worst level) -> op calls
        self.scope_nf: Counter = Counter()     # scope -> op calls with nan/inf worth a look
        self.scope_nfm: Counter = Counter()    # scope -> of those, calls that made it
        self.own: Counter = Counter()          # scope -> op calls in it
        self.ops = pd.DataFrame(columns=_OP_COLUMNS)   # op calls the page may embed (best so far per scope)
        self.op_rows = pd.DataFrame()          # their tensors' rows
        self.with_values: set = set()          # chartable columns holding a value
        self.series: dict = {}                 # part -> stage -> chart points (all chartable columns)
        self.charted: list = []                # parts with chart points, in order
        self.cells: list = []                  # heatmap partials: per part, per scope
        self.scope_first: dict = {}            # scope -> first output row's index (module order)

    # ---- feeding ----------------------------------------------------------------------------------
    def add(self, table: pd.DataFrame, marks=()) -> None:
        """One part's rows (execution order).  ``marks``: (step, rank, stage, kind, seq) of the ops
        the verdict may mark in this part (its divergences): kept for the page whatever their rank."""
        if not len(table):
            self.columns = self.columns or list(table.columns)
            return
        offset, self.rows = self.rows, self.rows + len(table)
        table = table.set_axis(pd.RangeIndex(offset, self.rows))
        for c in table.columns:
            if c not in self.columns:
                self.columns.append(c)
        self.by_stage_status.update(table.groupby(["stage", "status"]).size().to_dict())
        self._sheet(table)
        self._suspicious(table)
        ops = op_groups(table, nonfinite_rows(table, self.run_a, self.run_b))
        self._tree(ops)
        self._keep_ops(table, ops, set(marks))
        self.with_values |= {m for m in chartable() if m in table.columns
                             and pd.to_numeric(table[m], errors="coerce").notna().any()}
        self._chart(table)
        self._cells(table)

    def _sheet(self, table: pd.DataFrame) -> None:
        if self.rows <= XLSX_MAX_ROWS:
            self.head.append(table)
        else:
            self.head = []
        rank = table["status"].map(_SHEET_RANK).fillna(9).to_numpy()
        rank = np.where(table["origin"].fillna(False).astype(bool).to_numpy() & (rank == 1), 0, rank)
        failing = table[rank < 9].assign(_rank=rank[rank < 9])
        both = failing if self.sheet is None else pd.concat([self.sheet, failing])
        order = np.argsort(both["_rank"].to_numpy(), kind="stable")[:XLSX_MAX_ROWS]
        self.sheet = both.iloc[np.sort(order)]

    def _suspicious(self, table: pd.DataFrame) -> None:
        sus = table[table["origin"].fillna(False).astype(bool) & (table["io"] == "output") & (table["status"] == "error")]
        room = MAX_SUSPICIOUS - self.n_suspicious
        if len(sus) and room > 0:
            self.suspicious.append(sus[[c for c in SUSPICIOUS_COLS if c in sus.columns]].head(room))
            self.n_suspicious += min(room, len(sus))

    def _tree(self, ops: pd.DataFrame) -> None:
        scope = ops["scope"].fillna("").astype(str)
        self.scope_sev.update(pd.Series(1, index=pd.MultiIndex.from_arrays([scope, ops["sev"]]))
                              .groupby(level=[0, 1]).size().to_dict())
        self.own.update(scope.value_counts().to_dict())
        for field, counter in (("nf", self.scope_nf), ("nfm", self.scope_nfm)):
            counter.update({k: int(v) for k, v in ops.groupby(scope)[field].sum().items() if v})

    def _keep_ops(self, table: pd.DataFrame, ops: pd.DataFrame, marks: set) -> None:
        """The ops the page may embed: per scope the OPS_PER_NODE first by rank (failing and origin ops
        first, then execution order) of every op so far, and the ops the verdict may mark (a mark
        ranks an op first, so the page's choice is among these whatever the marks turn out to be)."""
        ops = ops.assign(skey=ops["scope"].fillna("").astype(str), prio=-(ops["sev"] * 2 + ops["origin"].astype(int) * 4),
                         marked=[k in marks for k in zip(*(ops[c] for c in OP_KEYS))])
        both = pd.concat([self.ops, ops], ignore_index=True) if len(self.ops) else ops
        best = both.sort_values(["prio", "first"], kind="stable").groupby("skey", sort=False).head(OPS_PER_NODE)
        keep = both.loc[both.index.isin(best.index) | both["marked"].astype(bool)].sort_values("first", kind="stable")
        new = keep[keep["first"] >= table.index[0]]
        cols = [c for c in ROW_COLS + ROW_METRICS + ["status", "reason", "origin", "stack", "op_a", "op_b"] + PAIRED_AT
                if c in table.columns]
        rows = table[OP_KEYS + cols].merge(new[OP_KEYS + ["first"]], on=OP_KEYS, how="inner").copy()
        held = self.op_rows[self.op_rows["first"].isin(keep["first"])] if len(self.op_rows) else self.op_rows
        self.op_rows = pd.concat([held, rows], ignore_index=True) if len(held) else rows
        self.ops = keep.reset_index(drop=True)

    def _chart(self, table: pd.DataFrame) -> None:
        t = table[(table["io"] == "output") & (table["kind"] == "op")]
        if not len(t):
            return
        parts = t[["step", "rank"]].drop_duplicates().sort_values(["step", "rank"])
        self.charted += [f"{int(step)}/{int(rank)}" for step, rank in zip(parts["step"], parts["rank"])]
        room = MAX_CHART_PARTS - len(self.series)
        if room <= 0:
            return
        if len(parts) > room:       # points only for the parts charted: a long run's others cost seconds
            last_step, last_rank = parts["step"].iloc[room - 1], parts["rank"].iloc[room - 1]
            t = t[(t["step"] < last_step) | ((t["step"] == last_step) & (t["rank"] <= last_rank))]
        metrics = [m for m in chartable() if m in t.columns]
        self.series.update(chart_series(t, metrics))

    def _cells(self, table: pd.DataFrame) -> None:
        """The heatmap's partials: per part and scope of the output rows, each chartable column's
        worst value, the worst level and the error and warning counts."""
        t = table[table["io"] == "output"]
        if not len(t):
            return
        scope = t["scope"].fillna("").astype(str)
        for s, first in zip(scope, t.index):
            self.scope_first.setdefault(s, first)
        g = pd.DataFrame({"part": t["step"].astype(str) + "/" + t["rank"].astype(str), "scope": scope,
                          "sev": row_severity(t),
                          "err": (t["status"] == ERROR).astype(int), "warn": (t["status"] == WARNING).astype(int),
                          **{f"v_{m}": pd.to_numeric(t[m], errors="coerce") for m in chartable() if m in t.columns}})
        aggs = {"sev": "max", "err": "sum", "warn": "sum",
                **{c: ("max" if worse_high(c[2:]) else "min") for c in g.columns if c.startswith("v_")}}
        cells = g.groupby(["part", "scope"], sort=False).agg(aggs)
        self.cells.append(cells.assign(sev=shown_severity(cells["sev"])))

    # ---- reading ------------------------------------------------------------------------------------
    def sheet_rows(self) -> pd.DataFrame:
        """The rows of the ``compare`` sheet, in execution order."""
        if self.rows <= XLSX_MAX_ROWS:
            return pd.concat(self.head) if self.head else pd.DataFrame(columns=self.columns)
        return self.sheet.drop(columns="_rank")

    def stage_status(self) -> pd.DataFrame:
        """Rows by stage (index) and status (columns)."""
        counts = pd.Series(self.by_stage_status, dtype=np.int64).sort_index().unstack(fill_value=0)
        return counts.rename_axis(index="stage", columns="status")

    def suspicious_rows(self) -> pd.DataFrame:
        if not self.suspicious:
            return pd.DataFrame(columns=[c for c in SUSPICIOUS_COLS if c in self.columns])
        return pd.concat(self.suspicious)

    def chart_metric(self, metric: str) -> str:
        """``metric`` when the records have it (tensor records), else the statistics error, else ``error``."""
        return next((m for m in (metric, "stats_err", "error") if m in self.with_values), metric)

    def chart_metrics(self, metric: str) -> list:
        metrics = [m for m in CHART_METRICS if m in self.with_values]
        return metrics if metric in metrics else [metric] + metrics

    def chart(self, metrics: list) -> tuple[dict, list]:
        """Per charted part and stage, one point per op, with ``metrics``' values."""
        out = {}
        for part, stages in self.series.items():
            out[part] = {stage: {**{k: v for k, v in s.items() if not k.startswith("m_")},
                                 **{m: s.get(f"m_{m}", [None] * len(s["seq"])) for m in metrics}}
                         for stage, s in stages.items()}
        return out, sorted(self.charted, key=lambda p: tuple(int(x) for x in p.split("/")))

    def heatmap(self, metric: str) -> dict | None:
        """Steps/ranks x modules: each cell the worst verdict of the module's op outputs (``sev``, an index
        into COMPARE_LEVELS: the colour), their worst ``metric`` and error/warning counts (the hover).  Scopes
        are cut at the deepest level with at most HEATMAP_MODULES modules; ``<top>``: ops outside every module.
        Colour follows the verdict, not the data's range: runs that pass are drawn pale however close."""
        if not self.cells:
            return None
        scopes = sorted(self.scope_first, key=self.scope_first.get)
        split = [s.split(".") for s in scopes]
        depth = 1
        for d in range(1, max(map(len, split)) + 1):
            if len({".".join(p[:d]) for p in split}) > HEATMAP_MODULES:
                break
            depth = d
        module = {s: (".".join(p[:depth]) or "<top>") for s, p in zip(scopes, split)}
        mods = list(dict.fromkeys(module[s] for s in scopes))
        cells = pd.concat(self.cells).reset_index()
        cells["mod"] = cells["scope"].map(module)
        v = f"v_{metric}"
        if v not in cells.columns:
            cells[v] = np.nan
        agg = cells.groupby(["part", "mod"], sort=False).agg(v=(v, "max" if worse_high(metric) else "min"), sev=("sev", "max"),
                                                              err=("err", "sum"), warn=("warn", "sum"))
        parts = sorted(agg.index.get_level_values(0).unique(), key=lambda p: tuple(int(x) for x in p.split("/")))

        def grid(field, fill=None):
            frame = agg[field].unstack().reindex(index=parts, columns=mods)
            return [col(frame.loc[p].astype(float)) for p in parts] if fill is None else \
                frame.fillna(fill).astype(int).to_numpy().tolist()
        sev = [[None if x is None else int(x) for x in row] for row in grid("sev")]
        return {"modules": mods, "parts": parts, "z": grid("v"), "sev": sev, "errors": grid("err", 0),
                "warnings": grid("warn", 0), "metric": metric}


def digest(table: pd.DataFrame, run_a: str | None = None, run_b: str | None = None, marks=()) -> TableDigest:
    """The digest of a whole table (``marks``: :meth:`TableDigest.add`'s)."""
    d = TableDigest(run_a, run_b)
    d.add(table, marks)
    return d


def op_groups(table: pd.DataFrame, nf: pd.DataFrame) -> pd.DataFrame:
    """One row per compared op/module call: key columns, worst status, origin, nan/inf worth a look
    (``nf``: made from finite values or differing between the runs; ``nfm``: made, ``nfa``/``nfb``: in
    run A/B; see nonfinite_rows), first row index (the table's index)."""
    t = table.assign(_sev=row_severity(table),
                     _nf=nf["differ"].to_numpy() | nf["made_a"].to_numpy() | nf["made_b"].to_numpy(),
                     _nfm=nf["made_a"].to_numpy() | nf["made_b"].to_numpy(), _nfa=nf["made_a"].to_numpy(),
                     _nfb=nf["made_b"].to_numpy(),
                     _org=table["origin"].fillna(False).astype(bool) & (table["status"] == "error"),
                     _i=table.index.to_numpy())
    g = t.groupby(OP_KEYS, sort=False).agg(scope=("scope", "first"), sev=("_sev", "max"), nf=("_nf", "any"),
                                            nfm=("_nfm", "any"), nfa=("_nfa", "any"), nfb=("_nfb", "any"),
                                            origin=("_org", "any"), first=("_i", "min"), n=("_i", "size"))
    g["sev"] = shown_severity(g["sev"])
    return g.reset_index().sort_values("first", kind="stable")


def nonfinite_rows(table: pd.DataFrame, run_a: str | None, run_b: str | None) -> pd.DataFrame:
    """Per row of ``table``: ``differ`` (the runs' nan/inf counts differ) and ``made_a``/``made_b`` (an
    output that run A's / B's op made inf/nan in from finite values, as ``dispatchprobe show`` classifies it:
    records/nonfinite.py).  The rest (a causal mask's -inf written from a constant, inf/nan carried from an
    input, equal in both runs) is intended or a consequence, not badged.  The runs' records are read again
    for the parts and records with nan/inf output only; a run that cannot be read is left unclassified."""
    def count(c):
        return pd.to_numeric(table[c], errors="coerce") if c in table.columns else pd.Series(np.nan, index=table.index)
    nan_a, nan_b, inf_a, inf_b = (count(c) for c in ("nan_a", "nan_b", "inf_a", "inf_b"))
    both = nan_a.notna() & nan_b.notna() & inf_a.notna() & inf_b.notna()
    out = pd.DataFrame({"differ": (both & ((nan_a != nan_b) | (inf_a != inf_b))).to_numpy(bool)}, index=table.index)
    is_out = (table["io"] == "output") if "io" in table.columns else pd.Series(False, index=table.index)
    for side, path, held in (("a", run_a, (nan_a > 0) | (inf_a > 0)), ("b", run_b, (nan_b > 0) | (inf_b > 0))):
        made = np.zeros(len(table), bool)
        rows = table[is_out & held]
        if len(rows) and path:
            by_name, with_ops = _records_by_name(path, set(zip(rows["step"], rows["rank"])))
            for i, key in enumerate(zip(rows["step"], rows["rank"], rows[f"name_{side}"])):
                rec = by_name.get(key)
                made[table.index.get_loc(rows.index[i])] = rec is not None and \
                    nonfinite.origin(rec, key[:2] in with_ops) == nonfinite.MADE
        out[f"made_{side}"] = made
    return out


def _records_by_name(path: str, parts: set) -> tuple[dict, set]:
    """(step, rank, record name) -> record, of run ``path``'s ``parts`` (a run of one part stands for any:
    compare pairs two single parts whatever their steps), and the parts whose ops are recorded (not only
    modules); nothing when the run cannot be read."""
    try:
        run = load(path)
    except (RecordError, OSError):
        return {}, set()
    out, with_ops = {}, set()
    for step, rank in parts:
        part = run.parts.get((int(step), int(rank)))
        if part is None and len(run.parts) == 1:
            part = next(iter(run.parts.values()))
        if part is None:
            continue
        try:
            records = part.records
        except (RecordError, OSError, ValueError):
            continue
        out.update({(step, rank, r.get("name")): r for r in records})
        if any(r.get("kind") == "op" for r in records):
            with_ops.add((step, rank))
    return out, with_ops


def paired_record_words(stage: str, step, rank, seq, seq_b=None, call_a=None, call_b=None) -> str:
    """``call A 6, B 5 (A #15, B #20 in backward, step 1 rank 0)``: a paired record's call and place as
    the verdict's lines name them (:func:`.compare.verdict.call_words`, :func:`.compare.verdict.place_words`),
    run B's beside run A's where they differ, so a page names the pair alike whichever run is A."""
    place = f"({place_words(int(seq), stage, _index(seq_b))}, step {int(step)} rank {int(rank)})"
    call = _index(call_a)
    return place if call is None else f"{call_words(call, _index(call_b))} {place}"


def _index(value) -> int | None:
    """A call index or place from a table cell; None where the table has none."""
    return None if value is None or pd.isna(value) else int(value)


# the columns :func:`paired_record_words` reads beside step, rank, stage and seq
PAIRED_AT = ["seq_b", "call_a", "call_b"]


def chart_series(t: pd.DataFrame, metrics: list) -> dict:
    """Per step/rank part and stage of the op output rows ``t``: one point per op (its outputs' worst
    value of each of ``metrics``, as ``m_<metric>``; ``named``: the op, its scope and where the pair
    sits in both runs, :func:`paired_record_words`)."""
    t = t.assign(_sev=row_severity(t),
                 _org=t["origin"].fillna(False).astype(bool) & (t["status"] == "error"))
    aggs = {m: (m, "max" if worse_high(m) else "min") for m in metrics}
    g = t.groupby(["step", "rank", "stage", "seq"], sort=True).agg(
        scope=("scope", "first"), op=("op_a", "first"), sev=("_sev", "max"), origin=("_org", "any"),
        **{c: (c, "first") for c in PAIRED_AT if c in t.columns},
        **{f"m_{k}": v for k, v in aggs.items()}).reset_index()
    g["sev"] = shown_severity(g["sev"])
    out: dict = {}
    for (step, rank, stage), s in g.groupby(["step", "rank", "stage"], sort=True):
        at = {c: s[c].tolist() if c in s.columns else [None] * len(s) for c in PAIRED_AT}
        named = [f"{op} [{scope or '<top>'}] " + paired_record_words(stage, step, rank, seq, seq_b, call_a, call_b)
                 for op, scope, seq, seq_b, call_a, call_b in zip(s["op"].tolist(), s["scope"].fillna("").tolist(),
                                                                   s["seq"].tolist(), *at.values())]
        out.setdefault(f"{int(step)}/{int(rank)}", {})[stage] = {
            "seq": s["seq"].astype(int).tolist(), "scope": col(s["scope"]), "op": col(s["op"]),
            "named": named, "sev": s["sev"].tolist(), "origin": s["origin"].tolist(),
            **{f"m_{m}": col(pd.to_numeric(s[f"m_{m}"], errors="coerce").astype(float)) for m in metrics}}
    return out
