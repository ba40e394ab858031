// The module-tree explorer shared by every dispatchprobe report page (compare, run-ut, overflow).
// The page defines PAGE before this script: PAGE.detail(n, rowKey) -> html of a node's detail pane,
// and optionally PAGE.badges(n) -> [badge html], PAGE.flags [{id, label, test(n)}] (extra filters; else D.flags),
// PAGE.empty(n) (whether a node with no levelled op is shown when filtering).
// D (the page's JSON): nodes [{id, name, path, parent, children, c: counts by level, div: marked stages}],
// levels [{name, color}] by severity (highest is worst), mark "first {stage} divergence"-like label.
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
function markLabel(stage) { return D.mark.replace("{stage}", stage); }
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
  for (var s = LV.length - 1; s >= 0; s--) if (n.c[s] && LV[s].short) { cnt = n.c[s] + " " + LV[s].short; break; }
  n.div.forEach(function (s) { b.push('<span class="badge mark">' + esc(markLabel(s)) + "</span>"); });
  b = b.concat(PAGE.badges ? PAGE.badges(n) : []);
  return '<div class="nrow' + (n.div.length ? " marked" : "") + (selected === n.id ? " sel" : "") + '" data-id="' + n.id + '"' +
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
  det.innerHTML = PAGE.detail(N[id], rowKey);
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
// One op's tensors: ``cols`` names, ``rows`` [[cell values]]; a column empty in every row is left out.  Up to
// ``wide`` columns a tensor a row; more are turned (a column per tensor, TENSORS_PER_TABLE a table, its lines
// in blocks of TURNED_ROWS side by side) so that the pane never scrolls sideways.  ``opt.cls(row)``: a row's class; ``opt.note(row)``: html under the row.
var TENSORS_PER_TABLE = 6, TURNED_ROWS = 8;
function tensorTable(cols, rows, wide, opt) {
  opt = opt || {};
  if (!rows.length) return "";
  var keep = [];
  cols.forEach(function (c, i) { if (rows.some(function (r) { return !blank(r[i]); })) keep.push(i); });
  var cls = function (r) { return opt.cls ? opt.cls(r) : ""; }, note = function (r) { return opt.note ? opt.note(r) : ""; };
  if (keep.length <= wide) {
    var h = ['<table class="tensors"><thead><tr>' + keep.map(function (i) { return "<th>" + esc(cols[i]) + "</th>"; }).join("") + "</tr></thead><tbody>"];
    rows.forEach(function (r) {
      h.push('<tr class="' + cls(r) + '">' + keep.map(function (i) { return "<td>" + cell(r[i]) + "</td>"; }).join("") + "</tr>");
      var nt = note(r); if (nt) h.push('<tr class="' + cls(r) + '"><td class="msg" colspan="' + keep.length + '">' + nt + "</td></tr>");
    });
    return h.join("") + "</tbody></table>";
  }
  var out = [];
  for (var at = 0; at < rows.length; at += TENSORS_PER_TABLE) {
    var part = rows.slice(at, at + TENSORS_PER_TABLE), head = "<thead><tr><th>" + esc(cols[keep[0]]) + "</th>" +
      part.map(function (r) { return '<th class="' + cls(r) + '">' + cell(r[keep[0]]) + "</th>"; }).join("") + "</tr></thead>";
    var lines = keep.slice(1).filter(function (i) { return !part.every(function (r) { return blank(r[i]); }); }).map(function (i) {
      return "<tr><th>" + esc(cols[i]) + "</th>" + part.map(function (r) { return '<td class="' + cls(r) + '">' + cell(r[i]) + "</td>"; }).join("") + "</tr>";
    });
    // blocks of TURNED_ROWS lines side by side (as many as the pane's width holds), each with the tensors' header
    var blocks = [];
    for (var b = 0; b < lines.length; b += TURNED_ROWS) blocks.push('<table class="tensors turned">' + head + "<tbody>" + lines.slice(b, b + TURNED_ROWS).join("") + "</tbody></table>");
    out.push('<div class="turned">' + blocks.join("") + "</div>");
    part.forEach(function (r) { var nt = note(r); if (nt) out.push('<p class="msg">' + cell(r[keep[0]]) + ": " + nt + "</p>"); });
  }
  return out.join("");
}
