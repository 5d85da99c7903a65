(function () {
  "use strict";
  var errors = [];
  function fail(msg) {
    errors.push(String(msg));
    var box = document.getElementById("errors");
    box.style.display = "block";
    box.textContent = "Rendering errors:\n" + errors.join("\n");
    document.body.setAttribute("data-errors", String(errors.length));
  }
  window.addEventListener("error", function (e) { fail(e.message || "script error"); });

  var NS = "http://www.w3.org/2000/svg";
  var PALETTE = ["#2f6fc6", "#c77800", "#2f8f46", "#c62f2f", "#7b4fc6", "#1f9aa8", "#b0487d", "#6b7785",
                 "#8c6d1f", "#3f51b5", "#d35400", "#16a085"];
  var KIND_COLOR = { restart: "#2f6fc6", straggler: "#c77800", loss_spike: "#c77800", grad_explosion: "#c77800" };
  var data = JSON.parse(document.getElementById("tw-data").textContent);
  var t0 = data.start, t1 = Math.max(data.end, data.start + 1);
  var tip = document.getElementById("tip");
  var drawn = 0;

  function el(name, attrs, parent) {
    var node = document.createElementNS(NS, name);
    for (var k in attrs) node.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(node);
    return node;
  }
  function text(parent, x, y, str, attrs) {
    var node = el("text", Object.assign({ x: x, y: y }, attrs || {}), parent);
    node.textContent = str;
    return node;
  }
  function color(i) { return PALETTE[i % PALETTE.length]; }
  function kindColor(kind) { return KIND_COLOR[kind] || "#c62f2f"; }
  function elapsed(t) {
    var s = Math.max(0, Math.round(t - t0)), h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60);
    s = s % 60;
    return (h ? h + ":" + String(m).padStart(2, "0") : String(m)) + ":" + String(s).padStart(2, "0");
  }
  function fmt(v) {
    if (v === null || v === undefined) return "-";
    var a = Math.abs(v);
    if (a !== 0 && (a < 0.001 || a >= 1e5)) return v.toExponential(2);
    return String(Math.round(v * 1000) / 1000);
  }
  function niceTicks(lo, hi, n) {
    if (!(hi > lo)) { hi = lo + 1; }
    var span = hi - lo, step = Math.pow(10, Math.floor(Math.log10(span / n)));
    var err = span / n / step;
    if (err >= 7.5) step *= 10; else if (err >= 3.5) step *= 5; else if (err >= 1.5) step *= 2;
    var out = [];
    for (var v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(v);
    return out;
  }
  function timeTicks() {
    var span = t1 - t0, steps = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400];
    var step = steps.find(function (s) { return span / s <= 8; }) || 86400;
    var out = [];
    for (var v = 0; v <= span + 1e-9; v += step) out.push(t0 + v);
    return out;
  }
  function showTip(evt, str) {
    tip.textContent = str;
    tip.style.display = "block";
    tip.style.left = Math.min(evt.clientX + 14, window.innerWidth - 260) + "px";
    tip.style.top = (evt.clientY + 14) + "px";
  }
  function hideTip() { tip.style.display = "none"; }
  function empty(host, msg) {
    var div = document.createElement("div");
    div.className = "empty";
    div.textContent = msg;
    host.appendChild(div);
  }
  function markers() {
    return data.events.map(function (e) {
      return { t: e.t, color: kindColor(e.kind), dash: e.kind === "restart" ? "5 3" : "",
               label: e.kind + (e.culprits.length ? " (rank " + e.culprits.join(",") + ")" : "") };
    });
  }

  // A time-series chart: one line per rank, gaps where a value is missing,
  // incidents and restarts as vertical lines, a hover readout. opts.wide: the
  // full-width layout (same x scale as the incident timeline); opts.robust:
  // the y axis ends at 3x the 90th percentile, so one slow warm-up step does
  // not flatten the rest (lines are clipped at the top, and the axis says so).
  function lineChart(id, field, unit, opts) {
    opts = opts || {};
    var host = document.getElementById(id);
    var ranks = Object.keys(data.series);
    var lines = ranks.map(function (r, i) {
      var s = data.series[r];
      var pts = [];
      for (var j = 0; j < s.t.length; j++) pts.push([s.t[j], s[field][j]]);
      return { rank: r, color: color(i), pts: pts };
    });
    var values = [];
    lines.forEach(function (l) { l.pts.forEach(function (p) { if (typeof p[1] === "number") values.push(p[1]); }); });
    if (!values.length) { empty(host, "no samples yet"); return; }
    var W = 640, H = 260, L = 58, R = 12, T = 10, B = 28;
    if (opts.wide) { W = 1200; H = 190; L = 130; R = 16; }
    var lo = Math.min.apply(null, values), hi = Math.max.apply(null, values), clipped = false;
    if (opts.robust && values.length >= 5) {
      var sorted = values.slice().sort(function (a, b) { return a - b; });
      var cap = 3 * sorted[Math.floor(0.9 * (sorted.length - 1))];
      if (cap > 0 && cap < hi) { hi = cap; clipped = true; }
    }
    if (lo > 0 && lo < hi * 0.5) lo = 0;
    if (hi === lo) { hi = lo + (Math.abs(lo) || 1) * 0.1; lo = lo - (hi - lo); }
    var yt = niceTicks(lo, hi, 5);
    if (yt.length > 1 && yt[yt.length - 1] < hi) yt.push(yt[yt.length - 1] + (yt[1] - yt[0]));  // a gridline above the top value
    lo = Math.min(lo, yt[0]); hi = Math.max(hi, yt[yt.length - 1]);
    function X(t) { return L + (t - t0) / (t1 - t0) * (W - L - R); }
    function Y(v) { return T + (1 - (v - lo) / (hi - lo)) * (H - T - B); }
    var svg = el("svg", { viewBox: "0 0 " + W + " " + H, role: "img", "class": "plot", "data-series": String(lines.length) }, host);
    // Lines stay inside the plot area (clipped values, samples before the job's start).
    var clip = "clip-" + id;
    el("rect", { x: L, y: T - 1, width: W - L - R, height: H - T - B + 2 }, el("clipPath", { id: clip }, el("defs", {}, svg)));
    var grid = el("g", { "class": "grid" }, svg), axis = el("g", { "class": "axis" }, svg);
    yt.forEach(function (v) {
      el("line", { x1: L, x2: W - R, y1: Y(v), y2: Y(v) }, grid);
      text(axis, L - 6, Y(v) + 4, fmt(v), { "text-anchor": "end" });
    });
    timeTicks().forEach(function (t) {
      el("line", { x1: X(t), x2: X(t), y1: H - B, y2: H - B + 4 }, axis);
      text(axis, X(t), H - B + 16, elapsed(t), { "text-anchor": "middle" });
    });
    el("line", { x1: L, x2: W - R, y1: H - B, y2: H - B }, axis);
    if (unit) text(axis, 4, T + 8, unit, {});
    if (clipped) text(axis, W - R, T + 8, "clipped above " + fmt(hi), { "text-anchor": "end" });
    markers().forEach(function (m) {
      var line = el("line", { x1: X(m.t), x2: X(m.t), y1: T, y2: H - B, stroke: m.color, "stroke-width": 1.5,
                              "stroke-dasharray": m.dash, opacity: 0.8, "class": "marker" }, svg);
      el("title", {}, line).textContent = m.label + " at +" + elapsed(m.t);
    });
    var npts = 0;
    lines.forEach(function (l) {
      var d = "", run = [];
      function flush() {  // a lone sample between gaps is a dot, not an invisible zero-length line
        if (run.length === 1) el("circle", { cx: run[0][0], cy: run[0][1], r: 2.2, fill: l.color, "clip-path": "url(#" + clip + ")" }, svg);
        run = [];
      }
      l.pts.forEach(function (p) {
        if (typeof p[1] !== "number") { flush(); return; }
        var x = X(p[0]), y = Y(p[1]);
        d += (run.length ? "L" : "M") + x.toFixed(1) + "," + y.toFixed(1);
        run.push([x, y]);
        npts++;
      });
      flush();
      if (d) el("path", { d: d, fill: "none", stroke: l.color, "stroke-width": 1.6, "class": "series", "data-rank": l.rank,
                          "clip-path": "url(#" + clip + ")" }, svg);
    });
    svg.setAttribute("data-points", String(npts));
    var cursor = el("line", { y1: T, y2: H - B, stroke: "#1d232b", "stroke-width": 0.6, visibility: "hidden" }, svg);
    svg.addEventListener("mousemove", function (evt) {
      var box = svg.getBoundingClientRect();
      var t = t0 + ((evt.clientX - box.left) / box.width * W - L) / (W - L - R) * (t1 - t0);
      if (t < t0 || t > t1) { hideTip(); cursor.setAttribute("visibility", "hidden"); return; }
      cursor.setAttribute("x1", X(t)); cursor.setAttribute("x2", X(t)); cursor.setAttribute("visibility", "visible");
      var rows = ["+" + elapsed(t)];
      lines.forEach(function (l) {
        var best = -1, phases = data.series[l.rank].phase;
        l.pts.forEach(function (p, j) { if (best < 0 || Math.abs(p[0] - t) < Math.abs(l.pts[best][0] - t)) best = j; });
        if (best >= 0) rows.push("rank " + l.rank + ": " + fmt(l.pts[best][1]) + (unit && unit !== "step" ? " " + unit : "") +
                                 "  (" + phases[best] + ")");
      });
      showTip(evt, rows.join("\n"));
    });
    svg.addEventListener("mouseleave", function () { hideTip(); cursor.setAttribute("visibility", "hidden"); });
    var legend = document.createElement("div");
    legend.className = "legend";
    lines.forEach(function (l) {
      var s = document.createElement("span");
      s.style.setProperty("--c", l.color);
      s.textContent = "rank " + l.rank;
      legend.appendChild(s);
    });
    host.appendChild(legend);
    drawn++;
  }

  // Incidents on one time axis, one lane per kind, plus a table with verdicts.
  function timeline() {
    var host = document.getElementById("timeline");
    var W = 1200, kinds = [];
    data.events.forEach(function (e) { if (kinds.indexOf(e.kind) < 0) kinds.push(e.kind); });
    var lane = 22, L = 130, R = 16, T = 8, B = 26, H = T + B + Math.max(1, kinds.length) * lane;
    function X(t) { return L + (t - t0) / (t1 - t0) * (W - L - R); }
    var svg = el("svg", { viewBox: "0 0 " + W + " " + H, role: "img", "class": "plot" }, host);
    var axis = el("g", { "class": "axis" }, svg);
    timeTicks().forEach(function (t) {
      el("line", { x1: X(t), x2: X(t), y1: T, y2: H - B + 4 }, axis);
      text(axis, X(t), H - B + 16, elapsed(t), { "text-anchor": "middle" });
    });
    kinds.forEach(function (k, i) { text(axis, L - 8, T + i * lane + 15, k, { "text-anchor": "end" }); });
    if (!kinds.length) text(axis, W / 2, T + 15, "no incidents", { "text-anchor": "middle" });
    var n = 0;
    data.events.forEach(function (e) {
      var y = T + kinds.indexOf(e.kind) * lane + 11;
      var dot = el("circle", { cx: X(e.t), cy: y, r: 6, fill: kindColor(e.kind), "class": "incident" }, svg);
      el("title", {}, dot).textContent = e.kind + " at +" + elapsed(e.t) + ": " + e.summary;
      n++;
    });
    svg.setAttribute("data-points", String(n));
    drawn++;
    var box = document.getElementById("incidents");
    if (!data.events.length) return;
    var table = document.createElement("table");
    var head = table.insertRow();
    ["time", "kind", "culprit ranks", "what happened", "status", "runbook", "id"].forEach(function (h) {
      var th = document.createElement("th"); th.textContent = h; head.appendChild(th);
    });
    data.events.forEach(function (e) {
      var row = table.insertRow();
      row.insertCell().textContent = "+" + elapsed(e.t);
      var badge = document.createElement("span");
      badge.className = "kind k-" + e.kind;
      badge.textContent = e.kind;
      row.insertCell().appendChild(badge);
      row.insertCell().textContent = e.culprits.join(", ") || "-";
      row.insertCell().textContent = e.summary;
      row.insertCell().textContent = e.status === "resolved" && e.duration_s !== null
        ? "resolved after " + e.duration_s.toFixed(1) + " s" : (e.status || "");
      row.insertCell().textContent = e.runbook ? "trainwatch runbook " + e.runbook : "";
      row.insertCell().textContent = e.id || "";
    });
    box.appendChild(table);
  }

  // Slowest ranks first: bar = median compute slowdown ratio over the job
  // (median step time where no ratio was measured), label = the numbers.
  function slowest() {
    var host = document.getElementById("slowest");
    var rows = data.slowest;
    if (!rows.length) { empty(host, "no step times yet"); return; }
    var byRatio = rows.some(function (r) { return r.ratio !== null; });
    function value(r) { return byRatio ? (r.ratio || 0) : r.median_step_s; }
    var W = 1200, bar = 20, L = 80, R = 440, T = 6, H = T * 2 + rows.length * bar;
    var hi = Math.max.apply(null, rows.map(value)) || 1;
    var svg = el("svg", { viewBox: "0 0 " + W + " " + H, role: "img", "class": "plot" }, host);
    var axis = el("g", { "class": "axis" }, svg);
    rows.forEach(function (r, i) {
      var y = T + i * bar, w = Math.max(1, value(r) / hi * (W - L - R));
      var slow = r.ratio !== null && r.ratio >= 1.5;
      text(axis, L - 8, y + 14, "rank " + r.rank, { "text-anchor": "end" });
      var rect = el("rect", { x: L, y: y + 3, width: w, height: bar - 6, rx: 2, fill: slow ? "#c77800" : "#2f6fc6", "class": "bar" }, svg);
      var label = (r.ratio !== null ? "slowdown " + r.ratio.toFixed(2) + "x (peak " + r.max_ratio.toFixed(2) + "x), " : "") +
                  "step " + fmt(r.median_step_s) + " s median, " + fmt(r.p90_step_s) + " s p90";
      el("title", {}, rect).textContent = "rank " + r.rank + ": " + label;
      text(axis, L + w + 8, y + 14, label, {});
    });
    svg.setAttribute("data-points", String(rows.length));
    drawn++;
  }

  [["loss", "loss", ""], ["steptime", "step_s", "s", { robust: true }], ["progress", "step", "step"],
   ["ratio", "ratio", "x"], ["age", "age_s", "s", { wide: true }]].forEach(function (c) {
    try { lineChart(c[0], c[1], c[2], c[3]); } catch (e) { fail(c[0] + ": " + e.message); }
  });
  try { timeline(); } catch (e) { fail("timeline: " + e.message); }
  try { slowest(); } catch (e) { fail("slowest: " + e.message); }
  document.body.setAttribute("data-rendered", String(drawn));
})();
