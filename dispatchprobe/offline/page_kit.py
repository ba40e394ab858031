"""The page kit every HTML report is built with: the module tree (``scope_tree``, ``up``), the
op pages (``ops_page``: run-ut, overflow, free benchmark), the colours of the verdict codes
(``verdict_levels``) and their one ranking (``VERDICT_LEVELS``, ``verdict_severity``), template filling and cell formatting.
No torch (docs/architecture.md: the offline side reads only records)."""

from __future__ import annotations

import html
import json
import os
import re

import numpy as np
import pandas as pd

from ..standards.verdicts import ERROR, NOT_JUDGED, PASS, SKIP, WARNING

# ---- colours: a page colours what the verdict says, never the data's own range ---------------------------
# per verdict code: the dot/marker colour, the fill of a heat-map cell (pale for a pass, so a pass is never
# drawn dark or red; darker is worse) and the short label of a tree count badge
_VERDICT_STYLE = {NOT_JUDGED: ("#bbb", "#e4e4e4", ""), SKIP: ("#bbb", "#e4e4e4", ""),
                  PASS: ("#3fa34d", "#d5eed8", ""), WARNING: ("#f0b429", "#f3b63a", "warn"),
                  ERROR: ("#d9363e", "#a3161f", "err")}


def verdict_levels(codes) -> list:
    """The explorer's levels (templates/explorer.js) of verdict ``codes`` from the best to the worst:
    name (the code as the terminal and the CSVs say it), short count label, colour and heat-map fill."""
    return [{"name": c, "short": _VERDICT_STYLE[c][2], "color": _VERDICT_STYLE[c][0], "fill": _VERDICT_STYLE[c][1]}
            for c in codes]


# ---- ranking: every page that shows verdicts ranks them so, from the best to the worst ------------------
# "not judged" ranks above pass: a page never says more than the verdict, so a module holding an op the
# rules could not judge (compare's "not judged", run-ut's SKIP) is never drawn as agreeing.
VERDICT_LEVELS = verdict_levels([PASS, NOT_JUDGED, WARNING, ERROR])
VERDICT_SEVERITY = {lv["name"]: i for i, lv in enumerate(VERDICT_LEVELS)}
_STATUS_LEVEL = {**VERDICT_SEVERITY, SKIP: VERDICT_SEVERITY[NOT_JUDGED]}    # SKIP: run-ut's CSV word for it


def verdict_severity(status: pd.Series) -> np.ndarray:
    """Each verdict's level (an index into VERDICT_LEVELS); a status no rule gave (empty, unknown) is
    not judged, never a pass."""
    return status.map(_STATUS_LEVEL).fillna(VERDICT_SEVERITY[NOT_JUDGED]).to_numpy(dtype=np.int64, copy=True)


def num(v):
    if v is None or v is pd.NA:
        return None
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float):
        return v if v - v == 0 else (None if v != v else ("inf" if v > 0 else "-inf"))
    return v


def cell(v):
    """A spreadsheet cell: numbers as :func:`num` gives them, sequences and others as text."""
    v = num(v)
    if v is None or isinstance(v, (str, bool, int, float)):
        return v
    return str(list(v)) if isinstance(v, (tuple, list)) else str(v)


def cells(s: pd.Series) -> list:
    """A column as cell values: numbers, bools, strings; None for a missing value, 'inf'/'nan' as text."""
    if pd.api.types.is_bool_dtype(s) and not s.hasnans:
        return s.tolist()
    if pd.api.types.is_integer_dtype(s) and not s.hasnans:
        return s.tolist()
    if pd.api.types.is_numeric_dtype(s) and not pd.api.types.is_bool_dtype(s):
        return [None if x != x else x if x - x == 0 else str(x) for x in s.to_numpy(np.float64).tolist()]
    return [cell(v) for v in s.tolist()]


def col(s: pd.Series) -> list:
    """A column as JSON values (non-finite floats as null / 'inf')."""
    if pd.api.types.is_float_dtype(s):
        return [None if x != x else x if x - x == 0 else ("inf" if x > 0 else "-inf") for x in s.tolist()]
    if pd.api.types.is_bool_dtype(s) or pd.api.types.is_integer_dtype(s):
        return s.tolist()
    return [cell(v) for v in s.tolist()]


def scope_tree(paths, levels: int, **fields) -> tuple[list, dict]:
    """The module tree of dotted scopes (ancestors included, '' is ``<top>``) as the explorer's nodes:
    per node ``c`` (op counts by level), ``div`` (marked stages), ``own`` (ops directly in it), ``ops``
    (embedded op indexes) and a fresh copy of each of ``fields``; returns (nodes, index by path)."""
    nodes, index = [], {}

    def node(path):
        path = path or "<top>"
        if path in index:
            return index[path]
        parent = node(path.rsplit(".", 1)[0] if "." in path else "<top>") if path != "<top>" else None
        n = {"id": len(nodes), "name": path.rsplit(".", 1)[-1], "path": path, "parent": parent["id"] if parent else None,
             "children": [], "c": [0] * levels, "div": [], "own": 0, "ops": [],
             **{k: (list(v) if isinstance(v, list) else v) for k, v in fields.items()}}
        nodes.append(n)
        index[path] = n
        if parent:
            parent["children"].append(n["id"])
        return n

    node("<top>")
    for p in sorted(paths):
        node(p)
    return nodes, index


def up(nodes: list, n: dict, fn) -> None:
    """Apply ``fn`` to node ``n`` and each of its ancestors (subtree aggregates)."""
    while n is not None:
        fn(n)
        n = nodes[n["parent"]] if n["parent"] is not None else None


def lines(lines) -> str:
    return "".join(f"<li>{html.escape(line)}</li>" for line in lines)


def meta_rows(meta: dict, manifests: dict) -> str:
    """The run metadata table: ``meta`` and each run's manifest (``tag`` -> manifest), configs folded."""
    meta, configs = dict(meta), []
    for tag, m in manifests.items():
        prefix = f"{tag} " if tag else ""
        for k in ("framework", "framework_version", "device", "started_at", "host"):
            if m.get(k) is not None:
                meta[prefix + k] = m[k]
        if isinstance(m.get("config"), dict):
            configs.append((prefix + "config", json.dumps(m["config"], default=str, indent=1)))
    rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>" for k, v in meta.items())
    return rows + "".join(f"<tr><th>{html.escape(k)}</th><td><details><summary>{len(v.splitlines())} lines</summary>"
                          f"<pre>{html.escape(v)}</pre></details></td></tr>" for k, v in configs)


def fill(template: str, data: dict, **fills) -> str:
    """A page from ``templates/``: ``{{name}}`` slots filled, the explorer's markup, style and script
    (``explorer.html/css/js``) and the page's JSON (``data``) inlined."""
    here = os.path.join(os.path.dirname(__file__), "templates")
    for part in ("html", "css", "js"):
        with open(os.path.join(here, f"explorer.{part}"), encoding="utf-8") as fh:
            fills[f"explorer_{part}"] = fh.read()
    fills["data"] = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    with open(os.path.join(here, template), encoding="utf-8") as fh:
        page = fh.read()
    return re.sub(r"\{\{(\w+)\}\}", lambda m: fills[m.group(1)], page)


OPS_PER_NODE = 40
# ---- op pages: run-ut results and overflow runs as the module tree (templates/ops.html) ---------------
def ops_page(ops: pd.DataFrame, *, title: str, tree_heading: str, summary: list, levels: list, mark: str,
             op_cols: list, row_cols: list, rows_of, meta: dict, manifest: dict, full_table: str, legend: str,
             message_col: str = "", fold_col: str = "", flags: list = ()) -> str:
    """One self-contained page: ``ops`` (one row per op: step, rank, stage, scope, op, sev -- an index into
    ``levels`` --, mark -- bool, the first marked op of each stage is marked in the tree --, and
    ``op_cols``) grouped by module scope, each node coloured by its worst level; per node at most
    OPS_PER_NODE ops are embedded (worst and marked first), each with ``rows_of(op row labels)`` ->
    {label: [[row_cols values]]} (its tensors).  ``message_col`` (an op or row column) is shown as a line of
    text, ``fold_col`` (an op column: a stack) folded.  ``flags``: (field, filter label, badge, bool per op):
    node[field] counts the flagged ops beneath it (a filter and a badge in the tree)."""
    ops = ops.reset_index(drop=True)
    scope = ops["scope"].fillna("").astype(str)
    nodes, index = scope_tree(set(scope), len(levels), **{f[0]: 0 for f in flags})
    for (sc, sev), cnt in ops.groupby([scope, "sev"]).size().items():
        up(nodes, index[sc or "<top>"], lambda n: n["c"].__setitem__(int(sev), n["c"][int(sev)] + int(cnt)))
    for field, _, _, hit in flags:
        for sc, cnt in scope[hit.to_numpy(bool)].value_counts().items():
            up(nodes, index[sc or "<top>"], lambda n: n.__setitem__(field, n[field] + int(cnt)))
    for sc, cnt in scope.value_counts().items():
        index[sc or "<top>"]["own"] = int(cnt)
    key = [[int(s), int(r), str(st), "op", i] for i, (s, r, st) in enumerate(zip(ops["step"], ops["rank"], ops["stage"]))]
    marks = {}
    for i in np.flatnonzero(ops["mark"].to_numpy(bool)):
        stage = str(ops.at[i, "stage"])
        if stage not in marks:
            n = index[scope[i] or "<top>"]
            n["div"].append(stage)
            marks[stage] = {"node": n["id"], "key": key[i], "i": int(i),
                            "text": f"{mark.replace('{stage}', stage)}: {ops.at[i, 'op']} (step {key[i][0]} rank {key[i][1]})"}
    prio = -(ops["sev"].astype(int) * 2) - 10 * ops.index.isin([m["i"] for m in marks.values()])
    chosen = (ops.assign(_p=prio, _s=scope).sort_values(["_p"], kind="stable").groupby("_s", sort=False)
              .head(OPS_PER_NODE).sort_index())
    rows = rows_of(chosen.index) if len(chosen) else {}
    cells = {c: col(chosen[c]) for c in op_cols}
    out = []
    for j, i in enumerate(chosen.index):
        index[scope[i] or "<top>"]["ops"].append(len(out))
        out.append({"k": key[i], "op": cell(ops.at[i, "op"]), "sev": int(ops.at[i, "sev"]),
                    "cells": [cells[c][j] for c in op_cols], "rows": rows.get(i, [])})
    worst = int(ops["sev"].max()) if len(ops) else len(levels) - 1      # the worst level present
    first = next((m for m in marks.values()), None)
    if first is None and (ops["sev"] == worst).any():
        i = int(np.argmax(ops["sev"].to_numpy() == worst))
        first = {"node": index[scope[i] or "<top>"]["id"], "key": key[i]}
    data = {"nodes": nodes, "levels": levels, "mark": mark, "full_table": full_table, "ops": out, "op_cols": op_cols,
            "row_cols": row_cols, "message_col": message_col, "fold_col": fold_col,
            "flags": [{"field": f, "label": label, "badge": badge} for f, label, badge, _ in flags],
            "marks": {s: {k: v for k, v in m.items() if k != "i"} for s, m in marks.items()},
            "first": first and {"node": first["node"], "key": first["key"]},
            "expand": sorted({index[sc or "<top>"]["id"] for sc in scope[ops["sev"] == worst]})}
    return fill("ops.html", data, title=html.escape(title), tree_heading=html.escape(tree_heading),
                 summary=lines(summary), legend=legend, meta=meta_rows(meta, {"": manifest}))


def text_number(text: str):
    """A CSV cell as the page's JSON value: a number ('inf' for infinities), None when empty or nan."""
    try:
        return num(float(text))
    except ValueError:
        return text or None


