"""The grad compare's page: a heat map of direction similarity, parameters x steps, as plain
HTML cells in the explorer's style (templates/grad_compare.html; no script needed)."""

from __future__ import annotations

import html

import pandas as pd

from ..standards.loader import standard
from ..standards.verdicts import ERROR
from .page_kit import fill, lines, meta_rows, num, verdict_levels

_FLAGGED = verdict_levels([ERROR])[0]["fill"]      # the error's heat fill, as on compare's page


def _colour(sim, flagged: bool) -> str:
    """A flagged cell in the error's fill; any other pale, white at 1 to light yellow at the first
    step's limit and below: a lower similarity the rule does not flag is a hint, never drawn as a fault."""
    if sim != sim:
        return "#eee"
    if flagged:
        return _FLAGGED
    lim = standard("compare_standards")["grad_probe"]["first_step_min"]
    low = min(max((1.0 - sim) / (1.0 - lim), 0.0), 1.0)
    return f"hsl(50, 90%, {100 - 12 * low:.0f}%)"


def _cell(row) -> str:
    sim = row["similarity"]
    tip = f"{row['param']} step {row['step']}: similarity {sim:.6f}"
    if row["param"] != "summary":
        tip += f"\nnorm A {row['norm_a']} B {row['norm_b']}\nmax A {row['max_a']} B {row['max_b']}" \
               f"\nmin A {row['min_a']} B {row['min_b']}"
        if row["flag"]:
            tip += f"\nflagged: {row['flag']}"
    text = "" if sim != sim else f"{sim:.4f}"
    cls = "s flag" if row["flag"] else "s"
    bg = _colour(sim, bool(row["flag"]))
    return f'<td class="{cls}" style="background:{bg}" title="{html.escape(tip)}">{text}</td>'


def heat_map_page(table: pd.DataFrame, verdict, manifest_a: dict, manifest_b: dict) -> str:
    steps = sorted(table["step"].unique().tolist())
    head = "<tr><th>parameter</th>" + "".join(f"<th>step {s}</th>" for s in steps) + "</tr>"
    body = []
    for name, rows in table.groupby("param", sort=False):
        by_step = {r["step"]: r for _, r in rows.iterrows()}
        cells = "".join(_cell(by_step[s]) if s in by_step else "<td></td>" for s in steps)
        cls = ' class="sum"' if name == "summary" else ""
        label = "summary (weighted)" if name == "summary" else name
        body.append(f'<tr{cls}><th class="p">{html.escape(label)}</th>{cells}</tr>')
    rule = standard("compare_standards")["grad_probe"]
    data = {"columns": list(table.columns),
            "rows": [[num(v) if not isinstance(v, str) else v for v in r] for r in table.itertuples(index=False)]}
    return fill("grad_compare.html", data, title=html.escape(f"grad compare: {verdict.a} vs {verdict.b}"),
                summary=lines(str(verdict).splitlines()), heatmap=head + "".join(body),
                rule=html.escape(f"below {rule['first_step_min']} at the first step, or a drop of more than "
                                 f"{rule['max_drop']} from the step before"),
                csv="grad_compare.csv", meta=meta_rows({}, {"A": manifest_a, "B": manifest_b}))
