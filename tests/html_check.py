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
  var hl = document.querySelectorAll("#detail .hl"), det = document.getElementById("detail"), tooWide = [];
  // the detail pane scrolls down, never sideways: nothing in it wider than the pane
  det.querySelectorAll("*").forEach(function (el) {
    var r = el.getBoundingClientRect();
    if (r.width && r.right > det.getBoundingClientRect().left + det.clientWidth + 1) tooWide.push(el.tagName + "." + el.className);
  });
  var res = {page: document.documentElement.scrollWidth, client: w, wide: wide.slice(0, 5), marks: marks,
             rows: hl.length, row_text: Array.prototype.map.call(hl, function (r) { return r.textContent; }).join(" | "),
             detail: (document.querySelector("#detail .path") || {}).textContent || "",
             detail_overflow: det.scrollWidth - det.clientWidth, detail_wide: tooWide.slice(0, 5),
             tree_rows: document.querySelectorAll("#tree .nrow").length,
             plots: document.querySelectorAll(".js-plotly-plot .main-svg").length};
  // what a person gets from the tree's search (the first mark's module name) and from keeping only the
  // worst level's filter checked
  var names = function () { return Array.prototype.map.call(document.querySelectorAll("#tree .nrow .name"), function (e) { return e.textContent; }); };
  var first = marks.forward || marks.backward, q = document.getElementById("search");
  if (first) { q.value = first.name; q.dispatchEvent(new Event("input")); res.search = names(); q.value = ""; q.dispatchEvent(new Event("input")); }
  document.querySelectorAll(".vf").forEach(function (c, i) { if (i > 0) { c.checked = false; c.dispatchEvent(new Event("change")); } });
  res.worst_only = names();
  var pre = document.createElement("pre"); pre.id = "layout-check"; pre.textContent = JSON.stringify(res);
  document.body.appendChild(pre);
}, 1500);
</script></body>"""


def _browser(tmp_path) -> list:
    return [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={tmp_path / 'ud'}", "--window-size=1400,900", "--virtual-time-budget=10000"]


def screenshot(page, tmp_path) -> bytes:
    """A PNG of ``page`` as a person opens it."""
    shot = tmp_path / "shot.png"
    subprocess.run(_browser(tmp_path) + [f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=120)
    return shot.read_bytes()


def layout(page, tmp_path) -> dict:
    """The page's layout and explorer state after its scripts ran: ``page``/``client`` widths, ``wide``
    (elements past the right edge), ``detail_overflow``/``detail_wide`` (how far and what runs past the
    detail pane's width), ``marks`` per stage (marked, visible in the tree, selected, badge text),
    highlighted ops in the detail pane (``rows``, ``row_text``), the selected node's path, tree rows and
    drawn plots; then the tree's module names after searching the first mark's name (``search``) and
    with only the worst level's filter checked (``worst_only``)."""
    checked = tmp_path / ("checked-" + page.name)
    checked.write_text(page.read_text().replace("</body>", _LAYOUT_CHECK))
    dom = subprocess.run(_browser(tmp_path) + ["--dump-dom", checked.as_uri()], capture_output=True, text=True,
                         timeout=120).stdout
    m = re.search(r'<pre id="layout-check">(.*?)</pre>', dom)
    assert m, dom[-2000:]
    return json.loads(m.group(1).replace("&quot;", '"').replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&"))


def page_data(page: str) -> dict:
    """The JSON a report page embeds (what its scripts draw)."""
    m = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', page, re.S)
    return json.loads(m.group(1).replace("<\\/", "</"))


def assert_fits(res: dict) -> None:
    """Nothing wider than the page (wide tables scroll inside their own box), and nothing wider than the
    detail pane (an op's columns wrap or turn instead)."""
    assert res["page"] <= res["client"] and not res["wide"], res
    assert res["detail_overflow"] <= 0 and not res["detail_wide"], res
