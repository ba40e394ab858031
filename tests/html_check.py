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
// the heat map's cells as drawn: the luminance of the worst and of the best cell (each part x module)
function heatCells(done) {
  var el = document.getElementById("heatmap"), img = el && el.querySelector("image"), H = D.heat;
  if (!img || !H) return done(null);
  var pic = new Image();
  pic.onload = function () {
    var c = document.createElement("canvas"); c.width = pic.width; c.height = pic.height;
    var g = c.getContext("2d"); g.drawImage(pic, 0, 0);
    var hi = D.worse_high[H.metric], cells = [];
    H.z.forEach(function (row, i) { row.forEach(function (v, j) {
      if (typeof v !== "number") return;
      var px = g.getImageData(Math.floor((j + 0.5) * pic.width / H.modules.length), Math.floor((i + 0.5) * pic.height / H.parts.length), 1, 1).data;
      cells.push({v: v, module: H.modules[j], lum: 0.299 * px[0] + 0.587 * px[1] + 0.114 * px[2]});
    }); });
    cells.sort(function (a, b) { return hi ? b.v - a.v : a.v - b.v; });     // worst first
    done({worst: cells[0], best: cells[cells.length - 1], modules: H.modules});
  };
  pic.src = img.getAttribute("href") || img.getAttribute("xlink:href");
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
               return [r.querySelector(".name").textContent, Array.prototype.map.call(r.querySelectorAll(".badge"), function (b) { return b.textContent; })]; })};
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


def counts(text: str) -> dict:
    """'23 error, 0 warning, 295 pass ...' -> {'error': 23, 'warning': 0, 'pass': 295}."""
    return {name: int(n) for n, name in re.findall(r"(\d+) ([a-zA-Z/][\w/ ]*?)(?=,|$| ops)", text)}
