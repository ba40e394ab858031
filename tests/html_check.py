"""What a person sees in a dispatchprobe report page: rendered in headless Chromium at 1400 px, the
layout and the explorer's state read back from the DOM (shared by the report tests)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest


def chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


# In CI the README's test command installs Chromium, so a missing browser there is a failure.
needs_chromium = pytest.mark.skipif(chromium() is None and not os.environ.get("CI"),
                                    reason="no chromium on this machine (the README's test command installs it): "
                                           "HTML checked structurally only")

# Runs after the page's own scripts: what a person sees, written into the DOM for --dump-dom.
_LAYOUT_CHECK = """<script>
// every number and dtype in ``box`` (plots aside) whose text runs over more than one line: "where: text"
var WRAP_TOKEN = /[-+]?\\d[\\d.]*(?:e[-+]?\\d+)?|\\b(?:b?float|u?int|complex)\\d+\\b/g;
function wrappedTokens(box, where) {
  var out = [], walk = document.createTreeWalker(box, NodeFilter.SHOW_TEXT), t;
  while ((t = walk.nextNode())) {
    if (!t.parentElement || t.parentElement.closest("script, style, .js-plotly-plot")) continue;
    var m; WRAP_TOKEN.lastIndex = 0;
    while ((m = WRAP_TOKEN.exec(t.data))) {
      var r = document.createRange(); r.setStart(t, m.index); r.setEnd(t, m.index + m[0].length);
      var tops = {}; Array.prototype.forEach.call(r.getClientRects(), function (c) { if (c.width) tops[Math.round(c.top)] = 1; });
      if (Object.keys(tops).length > 1) out.push(where + ": " + m[0]);
    }
  }
  return out;
}
// the heat map's cells as drawn: each cell's level (D.heat.sev), metric value and colour, and the worst and
// best cell (by level, then by the metric)
function heatCells(done) {
  var el = document.getElementById("heatmap"), img = el && el.querySelector("image"), H = D.heat;
  if (!img || !H) return done(null);
  var pic = new Image();
  pic.onload = function () {
    var c = document.createElement("canvas"); c.width = pic.width; c.height = pic.height;
    var g = c.getContext("2d"); g.drawImage(pic, 0, 0);
    var hi = D.worse_high[H.metric], cells = [];
    H.z.forEach(function (row, i) { row.forEach(function (v, j) {
      var sev = H.sev ? H.sev[i][j] : null;
      if (typeof v !== "number" && sev === null) return;
      var px = g.getImageData(Math.floor((j + 0.5) * pic.width / H.modules.length), Math.floor((i + 0.5) * pic.height / H.parts.length), 1, 1).data;
      cells.push({v: v, sev: sev, module: H.modules[j], rgb: [px[0], px[1], px[2]], lum: 0.299 * px[0] + 0.587 * px[1] + 0.114 * px[2]});
    }); });
    var key = function (x) { return typeof x.v === "number" ? (hi ? x.v : -x.v) : -Infinity; };
    cells.sort(function (a, b) { return ((b.sev || 0) - (a.sev || 0)) || (key(b) - key(a)); });     // worst first
    done({worst: cells[0], best: cells[cells.length - 1], modules: H.modules, cells: cells});
  };
  pic.src = img.getAttribute("href") || img.getAttribute("xlink:href");
}
// every plot's tick labels and axis titles as drawn: text, and whether it lies inside the plot's own box
// (a label past the box's edge is cut off: "9999999995" for 0.9999999995)
function axisTexts() {
  var out = [];
  document.querySelectorAll(".js-plotly-plot").forEach(function (plot) {
    var svg = plot.querySelector(".main-svg"); if (!svg) return;
    var box = svg.getBoundingClientRect();
    plot.querySelectorAll(".xtick text, .ytick text, .g-xtitle text, .g-ytitle text, .cbaxis text, .cbtitle text").forEach(function (t) {
      var r = t.getBoundingClientRect(); if (!r.width) return;
      var axis = t.closest(".xtick, .g-xtitle") ? "x" : t.closest(".ytick, .g-ytitle") ? "y" : "colorbar";
      out.push({plot: plot.id, axis: axis, title: !!t.closest(".g-xtitle, .g-ytitle, .cbtitle"), text: t.textContent,
                inside: r.left >= box.left - 0.5 && r.right <= box.right + 0.5 && r.top >= box.top - 0.5 && r.bottom <= box.bottom + 0.5});
    });
  });
  return out;
}
setTimeout(function () {
  var w = document.documentElement.clientWidth, wide = [], marks = {};
  document.querySelectorAll("body *").forEach(function (el) {
    if (el.closest(".scroll, #tree, #detail, .js-plotly-plot") && !el.matches(".scroll, #tree, #detail, .js-plotly-plot")) return;
    var r = el.getBoundingClientRect();
    if (r.width && r.right > w + 1) wide.push(el.tagName + "#" + el.id + "." + el.className);
  });
  var tree = document.getElementById("tree").getBoundingClientRect();
  ["forward", "backward"].forEach(function (stage) {
    var d = document.getElementById("mark-" + stage), r = d && d.getBoundingClientRect();
    if (d) marks[stage] = {marked: d.classList.contains("marked") && !!d.querySelector(".badge.mark"),
                           badge: d.querySelector(".badge.mark").textContent, name: d.querySelector(".name").textContent,
                           quiet: d.classList.contains("quiet"), badge_bg: getComputedStyle(d.querySelector(".badge.mark")).backgroundColor,
                           visible: r.height > 0 && r.top >= tree.top && r.bottom <= tree.bottom,
                           selected: d.classList.contains("sel")};
  });
  var hl = document.querySelectorAll("#detail .hl"), det = document.getElementById("detail");
  // the detail pane scrolls down, never sideways: nothing in it wider than the pane
  function tooWide() {
    var out = [], right = det.getBoundingClientRect().left + det.clientWidth + 1;
    det.querySelectorAll("*").forEach(function (el) {
      if (el.closest("#detail .scroll") && !el.matches(".scroll")) return;     // a table that scrolls in its own box
      var r = el.getBoundingClientRect();
      if (r.width && r.right > right) out.push(el.tagName + "." + el.className);
    });
    return out;
  }
  var res = {page: document.documentElement.scrollWidth, client: w, wide: wide.slice(0, 5), marks: marks,
             rows: hl.length, row_text: Array.prototype.map.call(hl, function (r) { return r.textContent; }).join(" | "),
             detail: (document.querySelector("#detail .path") || {}).textContent || "",
             detail_overflow: det.scrollWidth - det.clientWidth, detail_wide: tooWide().slice(0, 5),
             tree_rows: document.querySelectorAll("#tree .nrow").length,
             plots: document.querySelectorAll(".js-plotly-plot .main-svg").length,
             summary: document.getElementById("summary").textContent,
             units: (document.getElementById("units") || {}).textContent || "",
             badges: Array.prototype.map.call(document.querySelectorAll("#tree .nrow"), function (r) {
               return [r.querySelector(".name").textContent, Array.prototype.map.call(r.querySelectorAll(".badge"), function (b) { return b.textContent; })]; }),
             // every badge shown in the tree and the detail pane as opened: its text and background colour
             badge_colors: Array.prototype.map.call(document.querySelectorAll("#tree .badge, #detail .badge"), function (b) {
               return [b.textContent, getComputedStyle(b).backgroundColor]; }),
             annotations: Array.prototype.map.call(document.querySelectorAll(".js-plotly-plot .annotation-text"), function (a) {
               return a.textContent; }),
             axes: axisTexts()};
  // what a person gets from the tree's search (the first mark's module name) and from keeping only the
  // worst level's filter checked
  var names = function () { return Array.prototype.map.call(document.querySelectorAll("#tree .nrow .name"), function (e) { return e.textContent; }); };
  var first = marks.forward || marks.backward, q = document.getElementById("search");
  if (first) { q.value = first.name; q.dispatchEvent(new Event("input")); res.search = names(); q.value = ""; q.dispatchEvent(new Event("input")); }
  document.querySelectorAll(".vf").forEach(function (c, i) { if (i > 0) { c.checked = false; c.dispatchEvent(new Event("change")); } });
  res.worst_only = names();
  // every module's cards (up to 30 modules), each laid out in the pane: no number or dtype wraps, nothing
  // wider than the pane; then the whole tree's counts as the root's detail line says them
  res.wrapped = wrappedTokens(document.body, "page");
  res.cards_wide = [];
  N.filter(function (n) { return n.ops.length; }).slice(0, 30).forEach(function (n) {
    select(n.id);
    res.wrapped = res.wrapped.concat(wrappedTokens(det, n.path));
    tooWide().slice(0, 2).forEach(function (x) { res.cards_wide.push(n.path + ": " + x); });
  });
  select(N[0].id);
  res.root_counts = det.querySelector("p").textContent;
  heatCells(function (h) {
    res.heat = h;
    var pre = document.createElement("pre"); pre.id = "layout-check"; pre.textContent = JSON.stringify(res);
    document.body.appendChild(pre);
  });
}, 1500);
</script></body>"""


# the widths every page is checked at: a desktop window and a narrow one (a laptop's half screen)
WIDTHS = (1400, 1000)


def _browser(tmp_path, width: int = 1400, height: int = 900) -> list:
    return [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={tmp_path / 'ud'}", f"--window-size={width},{height}", "--virtual-time-budget=10000"]


def screenshot(page, tmp_path, width: int = 1400, height: int = 900) -> bytes:
    """A PNG of ``page`` as a person opens it in a ``width`` x ``height`` window."""
    shot = tmp_path / "shot.png"
    subprocess.run(_browser(tmp_path, width, height) + [f"--screenshot={shot}", page.as_uri()], capture_output=True,
                   timeout=120)
    return shot.read_bytes()


def layout(page, tmp_path, width: int = 1400) -> dict:
    """The page's layout and explorer state after its scripts ran: ``page``/``client`` widths, ``wide``
    (elements past the right edge), ``detail_overflow``/``detail_wide`` (how far and what runs past the
    detail pane's width), ``marks`` per stage (marked, visible in the tree, selected, badge text),
    highlighted ops in the detail pane (``rows``, ``row_text``), the selected node's path, tree rows and
    drawn plots, the heading (``summary``, ``units``) and each tree row's badges; then the tree's module
    names after searching the first mark's name (``search``) and with only the worst level's filter
    checked (``worst_only``); numbers and dtypes drawn over two lines anywhere on the page or in any
    module's cards (``wrapped``), cards wider than the pane (``cards_wide``), the root's counts line
    (``root_counts``), and the heat map's worst and best cells as drawn (``heat``: value, module,
    luminance).  ``width``: the window's width in px."""
    checked = tmp_path / ("checked-" + page.name)
    checked.write_text(page.read_text().replace("</body>", _LAYOUT_CHECK))
    dom = subprocess.run(_browser(tmp_path, width) + ["--dump-dom", checked.as_uri()], capture_output=True, text=True,
                         timeout=120).stdout
    m = re.search(r'<pre id="layout-check">(.*?)</pre>', dom)
    assert m, dom[-2000:]
    return json.loads(m.group(1).replace("&quot;", '"').replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&"))


_CELLS_CHECK = """<script>
var out = Array.prototype.map.call(document.querySelectorAll("table.heat td.s"), function (td) {
  return {flag: td.classList.contains("flag"), text: td.textContent, bg: getComputedStyle(td).backgroundColor,
          color: getComputedStyle(td).color, param: td.parentNode.querySelector("th").textContent}; });
var pre = document.createElement("pre"); pre.id = "cells-check"; pre.textContent = JSON.stringify(out);
document.body.appendChild(pre);
</script></body>"""


def heat_cells(page, tmp_path) -> list:
    """The grad compare page's heat-map cells as drawn: per cell whether it is flagged, its text, parameter
    and computed background and text colours."""
    checked = tmp_path / ("cells-" + page.name)
    checked.write_text(page.read_text().replace("</body>", _CELLS_CHECK))
    dom = subprocess.run(_browser(tmp_path) + ["--dump-dom", checked.as_uri()], capture_output=True, text=True,
                         timeout=120).stdout
    m = re.search(r'<pre id="cells-check">(.*?)</pre>', dom, re.S)
    assert m, dom[-2000:]
    return json.loads(m.group(1).replace("&quot;", '"').replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&"))


def luminance(colour) -> float:
    r, g, b = rgb(colour) if isinstance(colour, str) else colour
    return 0.299 * r + 0.587 * g + 0.114 * b


def page_data(page: str) -> dict:
    """The JSON a report page embeds (what its scripts draw)."""
    m = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', page, re.S)
    return json.loads(m.group(1).replace("<\\/", "</"))


def assert_fits(res: dict) -> None:
    """Nothing wider than the page (wide tables scroll inside their own box), nothing wider than the
    detail pane in any module's cards (an op's tensors turn instead), and no number or dtype drawn over
    two lines."""
    assert res["page"] <= res["client"] and not res["wide"], res
    assert res["detail_overflow"] <= 0 and not res["detail_wide"] and not res["cards_wide"], res
    assert not res["wrapped"], res["wrapped"][:20]


def rgb(css: str) -> tuple:
    """'rgb(217, 54, 62)' (a computed colour), '#d9363e' or '#eee' -> (r, g, b)."""
    if css.startswith("#"):
        hexa = css[1:] if len(css) == 7 else "".join(c * 2 for c in css[1:4])
        return tuple(int(hexa[i:i + 2], 16) for i in (0, 2, 4))
    return tuple(int(float(x)) for x in re.findall(r"[\d.]+", css)[:3])


def is_red(colour) -> bool:
    """A colour a person reads as red (an error's badge, #d9363e), from a css string or (r, g, b)."""
    import colorsys
    h, lightness, s = colorsys.rgb_to_hls(*(c / 255 for c in (rgb(colour) if isinstance(colour, str) else colour)))
    return (h < 15 / 360 or h > 345 / 360) and s > 0.4 and 0.2 < lightness < 0.75


def cut_labels(res: dict) -> list:
    """Tick labels and axis titles drawn past their plot's box (cut off where the page shows them)."""
    return [f"{t['plot']} {t['axis']}: {t['text']}" for t in res["axes"] if not t["inside"]]


def counts(text: str) -> dict:
    """'23 error, 0 warning, 295 pass ...' -> {'error': 23, 'warning': 0, 'pass': 295}."""
    return {name: int(n) for n, name in re.findall(r"(\d+) ([a-zA-Z/][\w/ ]*?)(?=,|$| ops)", text)}
