"""`trainwatch report JOB [--out FILE.html]`: one self-contained HTML page of a job.

For people without Grafana: loss and step time per rank over time, the
incidents on a timeline with their verdicts, restarts, and the slowest ranks.
It reads only the job directory (job.json, events.jsonl, the sidecar's
history/ and telemetry.json), so it works for a running job, a finished one,
and one copied off a cluster. The page needs no network: CSS, the data (JSON)
and a small SVG plotting script are inline.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import re
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from trainwatch import state
from trainwatch.watchdog import history

MAX_POINTS = 2000
"""Per rank and series on the page; longer histories are thinned evenly."""
VERDICT_KINDS = ("hang", "collective_mismatch", "crash", "xid", "ecc", "loss_nan")


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _event_time(event: dict) -> float | None:
    try:
        return datetime.fromisoformat(str(event.get("time"))).timestamp()
    except ValueError:
        return None


def _thin(series: dict[str, list], limit: int = MAX_POINTS) -> dict[str, list]:
    n = len(series["t"])
    if n <= limit:
        return series
    idx = sorted({round(i * (n - 1) / (limit - 1)) for i in range(limit)})
    return {k: [v[i] for i in idx] for k, v in series.items()}


def _slowest(series: dict[int, dict[str, list]]) -> list[dict]:
    rows = []
    for rank, s in series.items():
        times = [x for x in s["step_s"] if isinstance(x, (int, float)) and math.isfinite(x) and x > 0]
        ratios = [x for x in s["ratio"] if isinstance(x, (int, float))]
        if not times:
            continue
        rows.append({
            "rank": rank,
            "median_step_s": round(statistics.median(times), 6),
            "p90_step_s": round(sorted(times)[int(0.9 * (len(times) - 1))], 6),
            "ratio": round(statistics.median(ratios), 3) if ratios else None,
            "max_ratio": round(max(ratios), 3) if ratios else None,
        })
    # Synchronous ranks share one step time (everyone waits for the slowest),
    # so rank by the compute slowdown ratio, the straggler's own signal.
    rows.sort(key=lambda r: (-(r["ratio"] or 0), -r["median_step_s"], r["rank"]))
    return rows


def _last_verdict(events: list[dict]) -> dict | None:
    """The newest fault that stopped or restarted the job; failing that the
    newest alert (a straggler, a loss spike); restarts are outcomes, not verdicts."""
    for kinds in (VERDICT_KINDS, None):
        for e in reversed(events):
            if e["kind"] != "restart" and (kinds is None or e["kind"] in kinds):
                return e
    return None


def collect(job: str, now: float | None = None) -> dict[str, Any]:
    """Everything the page shows, as plain JSON-able data. LookupError: no such job."""
    d = state.job_dir(job)
    record = state.read_json(d / "job.json")
    if record is None:
        raise LookupError(job)
    now = time.time() if now is None else now
    events = []
    for e in state.read_events(job):
        t = _event_time(e)
        if t is None:
            continue
        events.append({
            "t": t,
            "kind": str(e.get("kind", "unknown")),
            "culprits": [r for r in e.get("culprit_ranks") or [] if isinstance(r, int)],
            "summary": str(e.get("summary") or ""),
            "runbook": str(e.get("runbook") or ""),
            "category": str(e.get("category") or ""),
            "severity": str(e.get("severity") or ""),
        })
    events.sort(key=lambda e: e["t"])
    nsamples, series = history.read_history(d)
    first = [s["t"][0] for s in series.values() if s["t"]]
    last = [s["t"][-1] for s in series.values() if s["t"]]
    # The time axis spans the job and everything recorded about it (a job
    # relaunched under the same name keeps its earlier history and events).
    start = min([float(record.get("start_time") or now)] + first + [e["t"] for e in events[:1]])
    end = float(record.get("end_time") or 0) or max(last + [start])
    status = state.live_status(record)
    if status == "running":
        end = max(end, now)
    end = max([end] + last + [e["t"] for e in events[-1:]])
    kinds: dict[str, int] = {}
    for e in events:
        kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
    steps = [x for s in series.values() for x in s["step"] if x is not None]
    if not steps:
        telemetry = state.read_json(d / "telemetry.json") or {}
        steps = [r.get("step") or 0 for r in telemetry.get("ranks") or [] if isinstance(r, dict)]
    return {
        "job": job,
        "status": status,
        "entrypoint": str(record.get("entrypoint") or ""),
        "ranks": sorted(series) or list(range(int(record.get("world_size") or record.get("nproc_per_node") or 0))),
        "start": start,
        "end": end,
        "steps": max(steps) if steps else 0,
        "restarts": int(record.get("restarts") or kinds.get("restart", 0)),
        "kinds": dict(sorted(kinds.items())),
        "verdict": _last_verdict(events),
        "events": events,
        "series": {str(rank): _thin(s) for rank, s in series.items()},
        "slowest": _slowest(series),
        "samples": nsamples,
        "generated": now,
    }


def _fmt_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else f"{m}m {s:02d}s"


def render(data: dict[str, Any]) -> str:
    esc = html.escape
    started = datetime.fromtimestamp(data["start"]).strftime("%Y-%m-%d %H:%M:%S")
    kinds = ", ".join(f"{esc(k)} {n}" for k, n in data["kinds"].items()) or "none"
    verdict = data["verdict"]
    if verdict is not None:
        culprits = ", ".join(str(r) for r in verdict["culprits"]) or "-"
        runbook = f' &middot; runbook: <code>trainwatch runbook {esc(verdict["runbook"])}</code>' if verdict["runbook"] else ""
        verdict_html = (f'<span class="kind k-{esc(verdict["kind"])}">{esc(verdict["kind"])}</span> '
                        f'culprit rank(s) {esc(culprits)}: {esc(verdict["summary"])}{runbook}')
    else:
        verdict_html = "no incidents"
    facts = [
        ("status", f'<span class="status s-{esc(data["status"])}">{esc(data["status"])}</span>'),
        ("started", esc(started)),
        ("duration", esc(_fmt_duration(data["end"] - data["start"]))),
        ("ranks", str(len(data["ranks"]))),
        ("steps reached", str(data["steps"])),
        ("restarts", str(data["restarts"])),
        ("incidents", kinds),
    ]
    facts_html = "".join(f"<div><dt>{k}</dt><dd>{v}</dd></div>" for k, v in facts)
    # JSON inside <script>: "<" escaped so no text can close the tag.
    payload = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c")
    values = {
        "TITLE": esc(f"trainwatch report: {data['job']}"),
        "JOB": esc(data["job"]),
        "ENTRY": esc(data["entrypoint"]),
        "FACTS": facts_html,
        "VERDICT": verdict_html,
        "GENERATED": esc(datetime.fromtimestamp(data["generated"]).strftime("%Y-%m-%d %H:%M:%S")),
        "STYLE": _STYLE,
        "SCRIPT": _SCRIPT,
        "DATA": payload,
    }
    # One pass: text inserted for one placeholder is never scanned for another.
    return re.sub(r"\{\{([A-Z]+)\}\}", lambda m: values[m.group(1)], _PAGE)


def _sanitize(value: Any) -> Any:
    """NaN/Inf are not JSON: the page shows them as gaps."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _sanitize(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_sanitize(v) for v in value]
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, like every trainwatch error; not argparse's usage block
        raise SystemExit(_fail(f"{message} (usage: trainwatch report JOB [--out FILE.html])"))


def main(argv: list[str]) -> int:
    p = _Parser(prog="trainwatch report", description="Write one self-contained HTML page of a job.")
    p.add_argument("job")
    p.add_argument("--out", type=Path, default=None, help="HTML file to write (default: jobs/<job>/report.html)")
    args = p.parse_args(argv)
    try:
        data = collect(args.job)
        out = args.out if args.out is not None else state.job_dir(args.job) / "report.html"
    except state.StateError as e:
        return _fail(str(e))
    except LookupError:
        known = [j.get("job") for j in state.list_jobs()][-5:]
        return _fail(f"unknown job {args.job!r} under {state.home() / 'jobs'}; known jobs: "
                     f"{', '.join(map(str, known)) if known else 'none'} (see `trainwatch jobs`; "
                     "set TRAINWATCH_HOME if the job ran elsewhere)")
    if out.is_dir():
        return _fail(f"--out {out} is a directory; give a file name such as {out / 'report.html'}")
    try:
        # The default lives in the private state directory; a chosen --out
        # file is the user's, with their umask.
        state.write_atomic(out, render(_sanitize(data)), mode=0o600 if args.out is None else 0o666)
    except OSError as e:
        return _fail(f"cannot write {out} ({e.strerror or e}); pick a writable --out path")
    points = sum(len(s["t"]) for s in data["series"].values())
    print(f"wrote {out} ({len(data['ranks'])} ranks, {data['samples']} samples, {points} points, "
          f"{len(data['events'])} incidents)")
    return 0


_STYLE = """
:root { --fg:#1d232b; --muted:#5d6875; --line:#d8dde3; --bg:#f6f7f9; --card:#fff; }
* { box-sizing: border-box; }
body { margin:0; font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif; color:var(--fg); background:var(--bg); }
header { padding:18px 28px 8px; }
h1 { margin:0 0 2px; font-size:22px; }
h2 { margin:0 0 8px; font-size:15px; }
.muted { color:var(--muted); }
code { font:12.5px ui-monospace,SFMono-Regular,Menlo,monospace; background:#eef1f4; padding:1px 4px; border-radius:3px; }
dl { display:flex; flex-wrap:wrap; gap:6px 28px; margin:12px 0 6px; }
dl div { min-width:90px; } dt { color:var(--muted); font-size:12px; } dd { margin:0; font-weight:600; }
.verdict { margin:6px 0 0; padding:8px 12px; background:var(--card); border:1px solid var(--line); border-radius:6px; }
main { display:grid; grid-template-columns:repeat(auto-fit,minmax(560px,1fr)); gap:16px; padding:12px 28px 28px; }
section { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:12px 14px; min-width:0; }
section.wide { grid-column:1/-1; }
.chart svg { width:100%; height:auto; display:block; }
.axis text, .legend text { font-size:11px; fill:var(--muted); }
.axis line, .grid line { stroke:var(--line); }
.legend { display:flex; flex-wrap:wrap; gap:4px 12px; font-size:12px; margin-top:4px; }
.legend span::before { content:""; display:inline-block; width:10px; height:3px; margin-right:5px; vertical-align:middle; background:var(--c); }
.tip { position:fixed; pointer-events:none; background:#1d232b; color:#fff; padding:6px 8px; border-radius:4px; font-size:12px; display:none; white-space:pre; z-index:9; }
.empty { color:var(--muted); padding:24px 0; text-align:center; }
table { border-collapse:collapse; width:100%; font-size:13px; }
th, td { text-align:left; padding:5px 8px; border-bottom:1px solid var(--line); vertical-align:top; }
th { color:var(--muted); font-weight:600; }
.kind { display:inline-block; padding:0 6px; border-radius:3px; color:#fff; background:#6b7785; font-size:12px; }
.k-hang,.k-collective_mismatch,.k-crash,.k-xid,.k-ecc,.k-loss_nan { background:#c62f2f; }
.k-straggler,.k-loss_spike,.k-grad_explosion { background:#c77800; }
.k-restart { background:#2f6fc6; }
.status { padding:0 6px; border-radius:3px; background:#6b7785; color:#fff; }
.s-succeeded { background:#2f8f46; } .s-running { background:#2f6fc6; } .s-failed,.s-lost { background:#c62f2f; }
#errors { display:none; margin:0 28px; padding:8px 12px; background:#fde8e8; border:1px solid #c62f2f; border-radius:6px; white-space:pre-wrap; }
"""

_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{{TITLE}}</title>
<style>{{STYLE}}</style>
</head>
<body data-rendered="0" data-errors="0">
<header>
<h1>trainwatch report: {{JOB}}</h1>
<div class="muted"><code>{{ENTRY}}</code> &middot; generated {{GENERATED}}</div>
<dl>{{FACTS}}</dl>
<div class="verdict"><strong>Last verdict:</strong> {{VERDICT}}</div>
</header>
<div id="errors"></div>
<main>
<section><h2>Loss per rank</h2><div class="chart" id="loss"></div></section>
<section><h2>Step time per rank</h2><div class="chart" id="steptime"></div></section>
<section><h2>Progress: step per rank</h2><div class="chart" id="progress"></div></section>
<section><h2>Straggler slowdown ratio (compute time / group median)</h2><div class="chart" id="ratio"></div></section>
<section class="wide"><h2>Seconds since each rank's last progress (a hang is a rising ramp)</h2><div class="chart" id="age"></div></section>
<section class="wide"><h2>Incidents and restarts</h2><div class="chart" id="timeline"></div><div id="incidents"></div></section>
<section class="wide"><h2>Slowest ranks (compute slowdown vs the group median)</h2><div class="chart" id="slowest"></div></section>
</main>
<div class="tip" id="tip"></div>
<script type="application/json" id="tw-data">{{DATA}}</script>
<script>{{SCRIPT}}</script>
</body>
</html>
"""

_SCRIPT = r"""
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
    ["time", "kind", "culprit ranks", "what happened", "runbook"].forEach(function (h) {
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
      row.insertCell().textContent = e.runbook ? "trainwatch runbook " + e.runbook : "";
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
"""
