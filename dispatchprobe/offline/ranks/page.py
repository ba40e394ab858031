"""The ``ranks`` explorer page: every checked collective call, replica drift and inf/nan start as
the module tree (the page kit of the other reports), each with its tensors on every rank."""

from __future__ import annotations

import pandas as pd

from ..page_kit import cell, ops_page

LEVELS = [{"name": "agree", "short": "agree", "color": "#3a9d5d"},
          {"name": "not judged", "short": "not judged", "color": "#8a9ba8"},
          {"name": "inf/nan received", "short": "received", "color": "#7a3cbd"},
          {"name": "differs", "short": "differs", "color": "#d9363e"}]
_SEV = {"agree": 0, "not judged": 1, "inf/nan received": 2, "inf/nan came in": 3, "differs": 3, "inf/nan origin": 3}
OP_COLS = ["check", "status", "ranks", "group", "seq", "kind", "arg", "size", "detail"]
ROW_COLS = ["rank", "io", "arg", "dtype", "shape", "max", "min", "mean", "norm", "nan", "inf"]
LEGEND = ("Collective calls are joined across the ranks of their group by sequence number and checked against "
          "their semantics; replicas are values a set of ranks must hold equal (parameters on the ranks joined by "
          "data-parallel groups, a DTensor's shard on the ranks holding that shard, results of "
          "all-reduce/all-gather/broadcast on their group, what ops compute from them only); inf/nan rows say where "
          "each rank's first inf/nan came from.  An op lists its tensors on every rank.")


def ranks_html(run, table: pd.DataFrame, verdict) -> str:
    ops = table.assign(sev=table["status"].map(_SEV).fillna(1).astype(int),
                       mark=table["status"].isin(["differs", "inf/nan origin"]),
                       rank=table["rank"].astype(int),
                       seq=[None if pd.isna(v) else int(v) for v in table["seq"]]).reset_index(drop=True)
    ranks = sorted({r for _, r in run.parts})

    def rows_of(labels):
        out = {}
        for i in labels:
            step, name = int(ops.at[i, "step"]), ops.at[i, "name"]
            rows = []
            for r in ranks:
                part = run.parts.get((step, r))
                if part is None:
                    continue
                t = part.tensors
                t = t[t["name"] == name]
                rows += [[r] + [cell(v) for v in x] for x in
                         t[["io", "arg", "dtype", "shape", "max", "min", "mean", "norm", "nan", "inf"]]
                         .itertuples(index=False)]
            out[i] = rows
        return out

    return ops_page(ops, title="dispatchprobe ranks", tree_heading="Collectives, replicas and inf/nan across ranks: "
                    "module tree", summary=verdict.lines, levels=LEVELS, mark="first {stage} finding",
                    op_cols=OP_COLS, row_cols=ROW_COLS, rows_of=rows_of, meta={"run": run.path},
                    manifest=run.manifest or {}, full_table="ranks.csv", legend=LEGEND, message_col="detail")
