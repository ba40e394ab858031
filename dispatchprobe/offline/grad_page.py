"""The grad probe's pages, plain HTML in the explorer's style (no script needed): compare's heat map
of direction similarity, parameters x steps (templates/grad_compare.html), and one run's gradient
norm over the steps, a line per selected parameter (templates/grad_norms.html)."""

from __future__ import annotations

import html
import math

import pandas as pd

from ..standards.loader import standard
from ..standards.verdicts import ERROR, NOT_JUDGED
from .page_kit import VERDICT_LEVELS, VERDICT_SEVERITY, fill, lines, meta_rows, num

# the heat fills of compare's page: an error's, and "not judged"'s (grey, never the white of agreement)
_FLAGGED, _NOT_JUDGED = (VERDICT_LEVELS[VERDICT_SEVERITY[v]]["fill"] for v in (ERROR, NOT_JUDGED))
_AGREE = "hsl(50, 90%, 100%)"                        # a similarity of 1 (white)


def _colour(sim, flagged: bool, checksum: str = "") -> str:
    """A flagged cell in the error's fill; any other pale, white at 1 to light yellow at the first
    step's limit and below: a lower similarity the rule does not flag is a hint, never drawn as a fault.
    Without a similarity (L0: checksums only) an equal checksum is white; a gradient nothing compared
    (checksums not comparable, shapes that differ) is "not judged"'s grey, never drawn as agreeing."""
    if flagged:
        return _FLAGGED
    if sim != sim:
        return _AGREE if checksum == "equal" else _NOT_JUDGED
    lim = standard("compare_standards")["grad_probe"]["first_step_min"]
    low = min(max((1.0 - sim) / (1.0 - lim), 0.0), 1.0)
    return f"hsl(50, 90%, {100 - 12 * low:.0f}%)"


def _cell(row) -> str:
    sim = row["similarity"]
    tip = f"{row['param']} step {row['step']}: similarity {sim:.6f}"
    if row.get("checksum"):
        tip += f", checksum {row['checksum']}"
    if row["param"] != "summary":
        tip += f"\nnorm A {row['norm_a']} B {row['norm_b']}\nmax A {row['max_a']} B {row['max_b']}" \
               f"\nmin A {row['min_a']} B {row['min_b']}"
        if row["flag"]:
            tip += f"\nflagged: {row['flag']}"
    text = "" if sim != sim else f"{sim:.4f}"
    cls = "s flag" if row["flag"] else "s"
    bg = _colour(sim, bool(row["flag"]), str(row.get("checksum") or ""))
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
    flagged = table[(table["flag"] != "") & (table["param"] != "summary")]["param"].unique().tolist()
    norms = ""
    if flagged:      # how each flagged parameter's gradient norm went in both runs
        rows = table[table["param"].isin(flagged)]
        both = pd.concat([rows.assign(parameter=rows["param"] + f" ({side})", norm=rows[f"norm_{side.lower()}"],
                                      order=rows["param"].map(flagged.index) * 2 + k)
                          for k, side in enumerate("AB")]).sort_values(["order", "step"], kind="stable")
        both = both[["parameter", "step", "norm"]]
        norms = ('<h2>Gradient norm of the flagged parameters, A (solid) and B (dashed)</h2><div class="scroll">'
                 + norm_chart(both, _paired_style) + legend_table(both, _paired_style) + "</div>")
    data = {"columns": list(table.columns),
            "rows": [[num(v) if not isinstance(v, str) else v for v in r] for r in table.itertuples(index=False)]}
    return fill("grad_compare.html", data, title=html.escape(f"grad compare: {verdict.a} vs {verdict.b}"),
                summary=lines(str(verdict).splitlines()), heatmap=head + "".join(body), norms=norms,
                rule=html.escape(f"below {rule['first_step_min']} at the first step, or a drop of more than "
                                 f"{rule['max_drop']} from the step before"),
                csv="grad_compare.csv", meta=meta_rows({}, {"A": manifest_a, "B": manifest_b}))


# ---- one grad-probe run: each selected parameter's gradient norm over the steps (``show --html``) ------
_PALETTE = ["#1f6feb", "#d9363e", "#2da44e", "#e8702a", "#7a3cbd", "#0b8a8a", "#b8860b", "#c2185b", "#5d6b7a",
            "#6f42c1"]
_W, _H, _LEFT, _RIGHT, _TOP, _BOTTOM = 760, 340, 70, 16, 12, 36


def _style(i: int) -> tuple[str, str]:
    """The i-th parameter's colour and dash: past the palette's ten colours lines are dashed, then dotted."""
    return _PALETTE[i % len(_PALETTE)], ("", "6 3", "2 2")[(i // len(_PALETTE)) % 3]


def _paired_style(i: int) -> tuple[str, str]:
    """Compare's lines, A and B of each parameter in turn: one colour per parameter, B dashed."""
    return _PALETTE[(i // 2) % len(_PALETTE)], ("", "6 3")[i % 2]


def _swatch(i: int, style=_style) -> str:
    colour, dash = style(i)
    return (f'<svg width="26" height="8"><line x1="0" y1="4" x2="26" y2="4" stroke="{colour}" stroke-width="2" '
            f'stroke-dasharray="{dash}"/></svg>')


def _y_scale(norms: list[float]):
    """norm -> pixel row: log10 where every finite norm is positive and they span over two decades
    (parameters' norms often do), else linear; the axis label says which."""
    finite = [v for v in norms if math.isfinite(v)]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    log = bool(finite) and lo > 0 and hi / lo > 100
    f = math.log10 if log else (lambda v: v)
    a, b = f(lo), f(hi)
    if a == b:
        a, b = a - (abs(a) or 1) * 0.5, b + (abs(b) or 1) * 0.5
    span = _H - _TOP - _BOTTOM
    return (lambda v: _TOP + span * (1 - (f(v) - a) / (b - a))), log, lo, hi


def norm_chart(rows: pd.DataFrame, style=_style) -> str:
    """An SVG line per parameter (``parameter``, ``step``, ``norm`` rows): its gradient norm at each
    step. A non-finite norm is a red cross on the top edge, never a point on the scale."""
    steps = sorted(rows["step"].unique().tolist())
    x_of = {s: _LEFT + (_W - _LEFT - _RIGHT) * (i / (len(steps) - 1) if len(steps) > 1 else 0.5)
            for i, s in enumerate(steps)}
    y_of, log, lo, hi = _y_scale([float(v) for v in rows["norm"]])
    out = [f'<svg id="norms" xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" '
           f'viewBox="0 0 {_W} {_H}" font-size="11" font-family="system-ui, sans-serif">',
           f'<rect x="{_LEFT}" y="{_TOP}" width="{_W - _LEFT - _RIGHT}" height="{_H - _TOP - _BOTTOM}" '
           'fill="none" stroke="#ccc"/>']
    for v in sorted({lo, hi}):
        out.append(f'<text x="{_LEFT - 4}" y="{y_of(v) + 4:.1f}" text-anchor="end">{num_text(v)}</text>')
    for s in steps[:: max(1, len(steps) // 12)]:
        out.append(f'<text x="{x_of[s]:.1f}" y="{_H - _BOTTOM + 14}" text-anchor="middle">{s}</text>')
    out.append(f'<text x="{(_W + _LEFT) / 2:.0f}" y="{_H - 4}" text-anchor="middle">step</text>')
    out.append(f'<text x="12" y="{_H / 2:.0f}" transform="rotate(-90 12 {_H / 2:.0f})" text-anchor="middle">'
               f'gradient norm{" (log scale)" if log else ""}</text>')
    for i, (name, group) in enumerate(rows.groupby("parameter", sort=False)):
        colour, dash = style(i)
        points, marks = [], []
        for step, norm in sorted(zip(group["step"], group["norm"].astype(float))):
            tip = html.escape(f"{name} step {step}: norm {norm}")
            if math.isfinite(norm):
                points.append(f"{x_of[step]:.1f},{y_of(norm):.1f}")
                marks.append(f'<circle cx="{x_of[step]:.1f}" cy="{y_of(norm):.1f}" r="2.5" fill="{colour}">'
                             f'<title>{tip}</title></circle>')
            else:
                marks.append(f'<text class="nonfinite" x="{x_of[step]:.1f}" y="{_TOP + 10}" fill="#d9363e" '
                             f'text-anchor="middle">&#x2715;<title>{tip}</title></text>')
        label = html.escape(name)
        out.append(f'<g class="param" data-param="{label}"><title>{label}</title>'
                   f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" stroke-dasharray="{dash}" points="{" ".join(points)}"/>'
                   + "".join(marks) + "</g>")
    out.append("</svg>")
    return "".join(out)


def num_text(v: float) -> str:
    return f"{v:.4g}"


def legend_table(rows: pd.DataFrame, style=_style) -> str:
    """A row per line of :func:`norm_chart`: its swatch, parameter, first, last and largest finite
    norm, and how many of its steps had a non-finite one."""
    legend = []
    for i, (name, group) in enumerate(rows.groupby("parameter", sort=False)):
        norms = group.sort_values("step")["norm"].astype(float)
        finite = norms[norms.map(math.isfinite)]
        legend.append(f'<tr><td>{_swatch(i, style)}</td><th class="p">{html.escape(name)}</th>'
                      f'<td>{num_text(norms.iloc[0])}</td><td>{num_text(norms.iloc[-1])}</td>'
                      f'<td>{num_text(finite.max()) if len(finite) else "-"}</td><td>{len(norms) - len(finite)}</td></tr>')
    head = "<tr><th></th><th>parameter</th><th>first norm</th><th>last norm</th><th>largest</th><th>non-finite</th></tr>"
    return f'<table class="legend">{head}{"".join(legend)}</table>'


def norms_page(rows: pd.DataFrame, manifest: dict, run_path: str, pattern: str | None) -> str:
    """``dispatchprobe show RUN --html``, a grad-probe run: the chart of the selected parameters' norms
    and a legend row per parameter (its colour, first, last and largest norm)."""
    chosen = f"parameters matching {pattern!r}" if pattern else "every parameter"
    summary = [f"{run_path}: {chosen}: {rows['parameter'].nunique()} parameter(s), "
               f"{rows['step'].nunique()} step(s)"]
    data = {"columns": [str(c) for c in rows.columns],
            "rows": [[v if isinstance(v, str) else num(v) if not isinstance(v, tuple) else list(v) for v in r]
                     for r in rows.itertuples(index=False)]}
    return fill("grad_norms.html", data, title=html.escape(f"gradient norms: {run_path}"), summary=lines(summary),
                chart=norm_chart(rows), legend=legend_table(rows), meta=meta_rows({}, {"": manifest}))
