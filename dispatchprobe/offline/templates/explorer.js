// The module-tree explorer shared by every dispatchprobe report page (compare, run-ut, overflow).
// The page defines PAGE before this script: PAGE.detail(n, rowKey) -> html of a node's detail pane,
// and optionally PAGE.badges(n) -> [badge html], PAGE.flags [{id, label, test(n)}] (extra filters; else D.flags),
// PAGE.empty(n) (whether a node with no levelled op is shown when filtering).
// D (the page's JSON): nodes [{id, name, path, parent, children, c: counts by level, div: marked stages}],
// levels [{name, color}] by severity (highest is worst), mark "first {stage} error"-like label; a page whose
// marks have words of their own gives them as D.divs[stage].label, a quiet one (a departure within tolerance:
// the runs pass, or values differing by random draws: no precision verdict) with D.divs[stage].quiet.
var D = JSON.parse(document.getElementById("report-data").textContent);
var N = D.nodes, LV = D.levels, expanded = {}, selected = null;
// D.flags [{field, label, badge}] (pages without their own): a filter "label" and a badge on nodes with n[field] > 0
if (!PAGE.flags && D.flags) {
  PAGE.flags = D.flags.map(function (f) { return {id: "f-" + f.field, label: f.label, test: function (n) { return n[f.field] > 0; }}; });
  PAGE.badges = function (n) { return D.flags.filter(function (f) { return n[f.field] > 0; }).map(function (f) { return '<span class="badge">' + esc(f.badge) + "</span>"; }); };
}
function worst(n) { for (var s = LV.length - 1; s >= 0; s--) if (n.c[s]) return s; return -1; }
function fmt(v) {
  if (v === null || v === undefined) return "";
  if (typeof v === "number") { if (Number.isInteger(v)) return String(v); return String(Number(v.toPrecision(6))); }
  if (Array.isArray(v)) return "[" + v.join(", ") + "]";
  return String(v);
}
function esc(s) { return fmt(s).replace(/[&<>"]/g, function (c) { return {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]; }); }
function opKey(k) { return k.join("-"); }
function markLabel(stage) { var d = (D.divs || {})[stage]; return d && d.label ? d.label : D.mark.replace("{stage}", stage); }
function markQuiet(stage) { var d = (D.divs || {})[stage]; return !!(d && d.quiet); }
// text as html in which no number breaks over two lines (at the minus of 9.55e-07)
var NUMBER = /[-+]?\d[\d.]*(?:e[-+]?\d+)?/g;
function keepNumbers(text) { return esc(text).replace(NUMBER, '<span class="nw">$&</span>'); }
function markBadge(stage, text) { return '<span class="badge mark' + (markQuiet(stage) ? " quiet" : "") + '">' + keepNumbers(text) + "</span>"; }
// the page's summary lines (the terminal's words) likewise
document.querySelectorAll("#summary li").forEach(function (li) { li.innerHTML = keepNumbers(li.textContent); });
function levelDot(s) { return '<span class="dot" style="background:' + (s >= 0 ? LV[s].color : "#fff") + '" title="' + (s >= 0 ? LV[s].name : "nothing judged") + '"></span>'; }
function levelCounts(n) { return LV.map(function (l, i) { return n.c[i] + " " + l.name; }).reverse().join(", "); }

(function buildTools() {
  var t = document.getElementById("tools"), h = ['<input type="search" id="search" placeholder="search modules (name or path)">'];
  for (var s = LV.length - 1; s >= 0; s--) h.push('<label><input type="checkbox" class="vf" value="' + s + '" checked> ' + esc(LV[s].name) + "</label>");
  (PAGE.flags || []).forEach(function (f) { h.push('<label><input type="checkbox" id="' + f.id + '"> ' + esc(f.label) + "</label>"); });
  t.innerHTML = h.join("");
  var legend = document.getElementById("legend");
  if (legend) legend.insertAdjacentHTML("afterbegin", "Dot: the worst beneath the module (" + LV.map(function (l, i) { return levelDot(i) + " " + esc(l.name); }).reverse().join(", ") + "). ");
})();
function filters() {
  var vs = {}; document.querySelectorAll(".vf").forEach(function (c) { if (c.checked) vs[c.value] = 1; });
  return {q: document.getElementById("search").value.trim().toLowerCase(), vs: vs,
          flags: (PAGE.flags || []).filter(function (f) { return document.getElementById(f.id).checked; })};
}
function passes(n, f) {
  var w = worst(n), ok = w < 0 ? !!(PAGE.empty && PAGE.empty(n)) : !!f.vs[w];
  if (!ok && w >= 0) { for (var s in f.vs) if (n.c[s]) { ok = true; break; } }
  if (f.flags.some(function (fl) { return !fl.test(n); })) return false;
  if (f.q && n.path.toLowerCase().indexOf(f.q) < 0) return false;
  return ok;
}
function active(f) { return f.q || f.flags.length || Object.keys(f.vs).length < LV.length; }
function visibleSet(f) {
  var vis = {};
  N.forEach(function (n) { if (passes(n, f)) { for (var m = n; m; m = m.parent === null ? null : N[m.parent]) vis[m.id] = 1; } });
  return vis;
}
function nodeRow(n) {
  var w = worst(n), b = [], cnt = "";
  // the count of the worst level beneath that has a short label (levels such as pass or SKIP have none)
  for (var s = LV.length - 1; s >= 0; s--) if (n.c[s] && LV[s].short) { cnt = n.c[s] + " " + LV[s].short + (n.c[s] === 1 ? " op" : " ops"); break; }
  n.div.forEach(function (s) { b.push(markBadge(s, markLabel(s))); });
  var quiet = n.div.length && n.div.every(markQuiet);
  b = b.concat(PAGE.badges ? PAGE.badges(n) : []);
  return '<div class="nrow' + (n.div.length ? " marked" : "") + (quiet ? " quiet" : "") + (selected === n.id ? " sel" : "") + '" data-id="' + n.id + '"' +
    (n.div.length ? ' id="mark-' + n.div[0] + '"' : "") + ' title="' + esc(n.path) + '">' +
    '<span class="tw">' + (n.children.length ? (expanded[n.id] ? "&#9662;" : "&#9656;") : "") + "</span>" +
    levelDot(w) + '<span class="name">' + esc(n.name) + "</span>" + (cnt ? '<span class="badge">' + cnt + "</span>" : "") + b.join("") + "</div>";
}
function renderTree() {
  var f = filters(), vis = active(f) ? visibleSet(f) : null;
  function sub(ids) {
    var h = [];
    ids.forEach(function (id) {
      var n = N[id]; if (vis && !vis[id]) return;
      var open = expanded[id] || (vis && f.q && n.children.some(function (c) { return vis[c]; }));
      h.push("<li>" + nodeRow(n) + (open && n.children.length ? "<ul>" + sub(n.children) + "</ul>" : "") + "</li>");
    });
    return h.join("");
  }
  var roots = N.filter(function (n) { return n.parent === null; }).map(function (n) { return n.id; });
  // a <top> root without its own ops only holds the model: show its children
  if (roots.length === 1 && !N[roots[0]].own && !(N[roots[0]].um || []).length) roots = N[roots[0]].children;
  document.getElementById("tree").innerHTML = "<ul>" + sub(roots) + "</ul>";
}
function expandTo(id) { for (var m = N[id]; m; m = m.parent === null ? null : N[m.parent]) { if (m.id !== id) expanded[m.id] = true; } }
function nodeOfScope(scope) {
  var best = null;
  N.forEach(function (n) { if (n.path === (scope || "<top>")) best = n.id; });
  return best;
}
// show node ``id`` selected in the tree and its ops in the detail pane; ``rowKey``: the op row to highlight
function select(id, rowKey) {
  selected = id; expandTo(id); renderTree();
  var det = document.getElementById("detail");
  TABLES = [];
  det.innerHTML = PAGE.detail(N[id], rowKey);
  fitTables(det);
  if (rowKey) {
    var op = document.getElementById("op-" + rowKey);
    // scrolled to only when not in view (the node's heading stays when its first op is the one)
    if (op) {
      op.classList.add("hl");
      var r = op.getBoundingClientRect(), d = det.getBoundingClientRect();
      if (r.bottom > d.bottom || r.top < d.top) det.scrollTop += r.top - d.top - 8;
    }
    else det.insertAdjacentHTML("afterbegin", '<p class="note">op #' + rowKey.split("-")[4] + " is not among the embedded ops: see " + esc(D.full_table) + "</p>");
  }
  var nr = document.querySelector('.nrow[data-id="' + id + '"]');
  if (nr) { var t = document.getElementById("tree"); t.scrollTop = nr.offsetTop - t.offsetTop - t.clientHeight / 3; }
}
document.getElementById("tree").addEventListener("click", function (e) {
  var r = e.target.closest(".nrow"); if (!r) return;
  var id = +r.getAttribute("data-id");
  if (e.target.classList.contains("tw")) { expanded[id] = !expanded[id]; renderTree(); return; }
  if (selected === id && N[id].children.length) expanded[id] = !expanded[id];
  select(id);
});
document.getElementById("search").addEventListener("input", renderTree);
// another window width: the selected module's cards laid out again for it (its scroll position kept)
var relayout = null;
window.addEventListener("resize", function () {
  clearTimeout(relayout);
  relayout = setTimeout(function () {
    if (selected === null) return;
    var det = document.getElementById("detail"), top = det.scrollTop;
    TABLES = []; det.innerHTML = PAGE.detail(N[selected]); fitTables(det); det.scrollTop = top;
  }, 150);
});
(PAGE.flags || []).forEach(function (f) { document.getElementById(f.id).addEventListener("input", renderTree); });
document.querySelectorAll(".vf").forEach(function (c) { c.addEventListener("change", renderTree); });
// open the roots and every marked node; select ``first`` ({node, key}) if given
function startTree(first) {
  N.forEach(function (n) { if (n.parent === null) expanded[n.id] = true; if (n.div.length) expandTo(n.id); });
  if (first) select(first.node, first.key ? opKey(first.key) : null); else renderTree();
}

// ---- a node's ops in the detail pane, one card per op (every page) ----
// An op's card: a head line (``title`` html, then ``fields`` [[name, value]] with a value), its tensors as a
// table (tensorTable) and ``more`` html.  ``key``: the op's key (click-to-row highlights the card); ``level``:
// its index in D.levels (the card's edge colour).
function opCard(key, level, title, fields, table, more) {
  var kv = fields.filter(function (f) { return !blank(f[1]); }).map(function (f) {
    return '<span class="kv"><span class="k">' + esc(f[0]) + "</span> " + esc(f[1]) + "</span>"; });
  return '<div class="op ' + LV[level].name.replace(/\W/g, "-") + '" style="border-left-color:' + LV[level].color + '" data-op="' + key +
    '" id="op-' + key + '"><div class="ophead">' + title + " " + kv.join(" ") +
    "</div>" + table + (more || "") + "</div>";
}
function blank(v) { return v === null || v === undefined || v === "" || (typeof v === "object" && !Array.isArray(v) && blank(v.a) && blank(v.b)); }
// a cell: a value, or {a, b} (two runs: A above B)
function cell(v) { return v && typeof v === "object" && !Array.isArray(v) ? "<div>" + esc(v.a) + "</div><div>" + esc(v.b) + "</div>" : esc(v); }
// One op's tensors: ``cols`` names, ``rows`` [[cell values]]; a column empty in every row is left out.  No
// number or dtype ever wraps: up to ``wide`` columns a tensor a row, turned (a column per tensor, its lines in
// blocks of TURNED_ROWS side by side) past that, and turned with fewer tensors a table when the pane is too
// narrow (fitTables, after the cards are in the page).  ``opt.cls(row)``: a row's class; ``opt.note(row)``:
// html under the row.
var TENSORS_PER_TABLE = 6, TURNED_ROWS = 8, TABLES = [];
function tensorTable(cols, rows, wide, opt) {
  opt = opt || {};
  if (!rows.length) return "";
  var keep = [];
  cols.forEach(function (c, i) { if (rows.some(function (r) { return !blank(r[i]); })) keep.push(i); });
  var t = {cols: cols, rows: rows, keep: keep, opt: opt};
  TABLES.push(t);
  return '<div class="tt" data-tt="' + (TABLES.length - 1) + '">' + (keep.length <= wide ? wideTable(t) : turnedTable(t, TENSORS_PER_TABLE)) + "</div>";
}
function rowClass(t, r) { return t.opt.cls ? t.opt.cls(r) : ""; }
function rowNote(t, r) { return t.opt.note ? t.opt.note(r) : ""; }
function wideTable(t) {
  var keep = t.keep, cols = t.cols;
  var h = ['<table class="tensors"><thead><tr>' + keep.map(function (i) { return "<th>" + esc(cols[i]) + "</th>"; }).join("") + "</tr></thead><tbody>"];
  t.rows.forEach(function (r) {
    h.push('<tr class="' + rowClass(t, r) + '">' + keep.map(function (i) { return "<td>" + cell(r[i]) + "</td>"; }).join("") + "</tr>");
    var nt = rowNote(t, r); if (nt) h.push('<tr class="' + rowClass(t, r) + '"><td class="msg" colspan="' + keep.length + '">' + nt + "</td></tr>");
  });
  return h.join("") + "</tbody></table>";
}
function turnedTable(t, per) {
  var keep = t.keep, cols = t.cols, out = [];
  for (var at = 0; at < t.rows.length; at += per) {
    var part = t.rows.slice(at, at + per), head = "<thead><tr><th>" + esc(cols[keep[0]]) + "</th>" +
      part.map(function (r) { return '<th class="' + rowClass(t, r) + '">' + cell(r[keep[0]]) + "</th>"; }).join("") + "</tr></thead>";
    var lines = keep.slice(1).filter(function (i) { return !part.every(function (r) { return blank(r[i]); }); }).map(function (i) {
      return "<tr><th>" + esc(cols[i]) + "</th>" + part.map(function (r) { return '<td class="' + rowClass(t, r) + '">' + cell(r[i]) + "</td>"; }).join("") + "</tr>";
    });
    // a long list of lines in even blocks of about TURNED_ROWS side by side (as many as the pane's width
    // holds), each with the tensors' header
    var blocks = [], size = lines.length > TURNED_ROWS + 4 ? Math.ceil(lines.length / Math.ceil(lines.length / TURNED_ROWS)) : lines.length;
    for (var b = 0; b < lines.length; b += size) blocks.push('<table class="tensors turned">' + head + "<tbody>" + lines.slice(b, b + size).join("") + "</tbody></table>");
    out.push('<div class="turned">' + blocks.join("") + "</div>");
    part.forEach(function (r) { var nt = rowNote(t, r); if (nt) out.push('<p class="msg">' + cell(r[keep[0]]) + ": " + nt + "</p>"); });
  }
  return out.join("");
}
// every tensor table in ``box`` that is wider than its card turned, with fewer tensors a table until it fits;
// one that fits in no form (a single tensor wider than the pane) scrolls in its own box
function fitTables(box) {
  box.querySelectorAll(".tt").forEach(function (el) {
    var t = TABLES[+el.getAttribute("data-tt")];
    for (var per = Math.min(TENSORS_PER_TABLE, t.rows.length); el.scrollWidth > el.clientWidth + 1 && per >= 1; per--) el.innerHTML = turnedTable(t, per);
    if (el.scrollWidth > el.clientWidth + 1) el.classList.add("scroll");
  });
}
