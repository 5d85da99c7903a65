"""`trainwatch report JOB [--out FILE.html]`: one self-contained HTML page of a job.

For people without Grafana: loss and step time per rank over time, the
incidents on a timeline with their verdicts, restarts, and the slowest ranks.
It reads only the job directory (job.json, events.jsonl, the sidecar's
history/ and telemetry.json), so it works for a running job, a finished one,
and one copied off a cluster. The page needs no network: CSS, the data (JSON)
and a small SVG plotting script are inline.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
import stat
import statistics
import sys
import time
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import Any

from trainwatch import kinds, liveness, rankrow, records, state
from trainwatch.diagnostics import goodput, preemption
from trainwatch.usage import Parser, fail, printable

MAX_POINTS = 2000
"""Per rank and series on the page; longer histories are thinned evenly."""
VERDICT_KINDS = kinds.PAGE_KINDS
"""The faults a report leads with: the kinds that page (kinds.py)."""
MAX_RANKS = 1 << 20
"""A job.json world size above this is junk, not a job."""


def _event_time(event: records.Incident) -> float | None:
    try:
        return datetime.fromisoformat(event.time).timestamp()
    except (ValueError, OverflowError, OSError):  # not a time, or one no calendar holds
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
    for wanted in (VERDICT_KINDS, None):
        for e in reversed(events):
            if e["kind"] != "restart" and (wanted is None or e["kind"] in wanted):
                return e
    return None


def collect(job: str, now: float | None = None) -> dict[str, Any]:
    """Everything the page shows, as plain JSON-able data. LookupError: no such job."""
    d = state.JobDir.resolve(job)
    record = d.read_job()
    if record is None:
        raise LookupError(job)
    now = time.time() if now is None else now
    events = []
    for e in d.incidents():
        t = _event_time(e)
        if t is None:
            continue
        events.append({
            "t": t,
            "kind": e.kind,
            "culprits": e.culprit_ranks,
            "summary": e.summary,
            "runbook": e.runbook or "",
            "category": e.category or "",
            "severity": e.severity,
            "id": e.id or "",
            # open / resolved, and for how long: the same lifecycle the console and diagnose show
            "status": e.status,
            "duration_s": e.resolution.duration_s if e.resolution is not None else None,
        })
    events.sort(key=lambda e: e["t"])
    nsamples, series = d.read_history(MAX_POINTS)
    first = [s["t"][0] for s in series.values() if s["t"]]
    last = [s["t"][-1] for s in series.values() if s["t"]]
    # The time axis spans the job and everything recorded about it (a job
    # relaunched under the same name keeps its earlier history and events).
    start = min([state.finite_number(record.get("start_time")) or now] + first + [e["t"] for e in events[:1]])
    end = state.finite_number(record.get("end_time")) or max(last + [start])
    status = liveness.status_of(record)
    if status == "running":
        end = max(end, now)
    end = max([end] + last + [e["t"] for e in events[-1:]])
    kinds: dict[str, int] = {}
    for e in events:
        kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
    steps = [x for s in series.values() for x in s["step"] if x is not None]
    if not steps:
        steps = [r.step for r in rankrow.rows_from_json(d.telemetry().get("ranks"))]
    # job.json fields of the wrong type (or absurd size) read as missing.
    world = next((n for n in (record.get("world_size"), record.get("nproc_per_node"))
                  if state.is_int(n) and 0 < n <= MAX_RANKS), 0)
    restarts = record.get("restarts")
    return {
        "job": job,
        "status": status,
        "entrypoint": record["entrypoint"] if isinstance(record.get("entrypoint"), str) else "",
        "ranks": sorted(series) or list(range(world)),
        "start": start,
        "end": end,
        "steps": max(steps) if steps else 0,
        "restarts": restarts if state.is_int(restarts) and restarts > 0 else kinds.get("restart", 0),
        "kinds": dict(sorted(kinds.items())),
        "verdict": _last_verdict(events),
        "events": events,
        "series": {str(rank): _thin(s) for rank, s in series.items()},
        "slowest": _slowest(series),
        "samples": nsamples,
        "goodput": goodput.typed_record(d.telemetry().get("goodput")),
        "preempted": preemption.line(p) if (p := preemption.of_job(record)) is not None else None,
        "generated": now,
    }


def _fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "-"
    seconds = max(0, int(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else f"{m}m {s:02d}s"


def _fmt_time(t: float) -> str:
    try:
        return datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")
    except (ValueError, OverflowError, OSError, TypeError):  # a time no calendar holds
        return "-"


def render(data: dict[str, Any]) -> str:
    def esc(text: str) -> str:  # control characters shown escaped, then HTML-escaped
        return html.escape(printable(text))
    started = _fmt_time(data["start"])
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
        *([("preempted", esc(data["preempted"]))] if data.get("preempted") else []),
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
        "GENERATED": esc(_fmt_time(data["generated"])),
        "STYLE": asset("report.css"),
        "SCRIPT": asset("report.js"),
        "GOODPUT": _goodput_bar(data.get("goodput")),
        "DATA": payload,
    }
    # One pass: text inserted for one placeholder is never scanned for another.
    return re.sub(r"\{\{([A-Z]+)\}\}", lambda m: values[m.group(1)], asset("report.html"))


_BAR_PARTS = (("productive", "productive"), ("startup", "start-up"), ("detection", "detection"),
              ("capture_checkpoint", "capture & checkpoint"), ("restart", "teardown & restart"),
              ("recompute", "recomputed steps"), ("hung", "hung / stalled"))


def _goodput_bar(record: dict | None) -> str:
    """The job's wall time as one stacked bar: productive time and each badput cause."""
    if not record or record["wall_s"] <= 0:
        return '<div class="empty">no goodput recorded (the sidecar writes it while the job runs)</div>'
    wall = record["wall_s"]
    seconds = {"productive": record["productive_s"], **record["badput_s"]}
    parts, legend = [], []
    for key, words in _BAR_PARTS:
        v = max(0.0, seconds.get(key, 0.0))
        if v <= 0:
            continue
        pct = 100.0 * v / wall
        title = html.escape(f"{words}: {v:.1f} s ({pct:.1f}%)")
        parts.append(f'<span class="gp gp-{key}" style="width:{pct:.3f}%" title="{title}"></span>')
        legend.append(f'<label class="gp-key"><i class="gp gp-{key}"></i>{title}</label>')
    return (f'<div class="gp-line">{html.escape(goodput.line_of(record))}</div>'
            f'<div class="gp-bar">{"".join(parts)}</div><div class="legend">{"".join(legend)}</div>')


def asset(name: str) -> str:
    """The page's HTML, CSS and JS, package data edited as what they are."""
    return resources.files("trainwatch.views").joinpath("assets", name).read_text(encoding="utf-8")


def _sanitize(value: Any) -> Any:
    """NaN/Inf are not JSON: the page shows them as gaps."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _sanitize(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_sanitize(v) for v in value]
    return value


def main(argv: list[str]) -> int:
    p = Parser(prog="trainwatch report", description="Write one self-contained HTML page of a job.",
               usage_hint="usage: trainwatch report JOB [--out FILE.html]")
    p.add_argument("job")
    p.add_argument("--out", type=Path, default=None,
                   help="HTML file to write (default: jobs/<job>/report.html; '-': stdout; a symlink: its target)")
    args = p.parse_args(argv)
    try:
        data = collect(args.job)
        out = args.out if args.out is not None else state.JobDir.resolve(args.job).report_file
    except state.StateError as e:
        return fail(str(e))
    except LookupError:
        known = [j.get("job") for j in state.list_jobs()][-5:]
        return fail(f"unknown job {args.job!r} under {state.home() / 'jobs'}; known jobs: "
                     f"{', '.join(map(str, known)) if known else 'none'} (see `trainwatch jobs`; "
                     "set TRAINWATCH_HOME if the job ran elsewhere)")
    # Lone surrogates (a non-UTF-8 command line in job.json) become '?': the page is still written.
    page = render(_sanitize(data)).encode("utf-8", "replace")
    points = sum(len(s["t"]) for s in data["series"].values())
    facts = (f"{len(data['ranks'])} ranks, {data['samples']} samples, {points} points, "
             f"{len(data['events'])} incidents")
    if args.out is not None and str(args.out) == "-":
        sys.stdout.flush()
        stream = getattr(sys.stdout, "buffer", None)
        if stream is not None:
            stream.write(page)
            stream.flush()
        else:
            sys.stdout.write(page.decode("utf-8"))
            sys.stdout.flush()
        print(printable(f"wrote the page to stdout ({facts})"), file=sys.stderr)
        return 0
    try:
        st = out.stat()  # of what the path names, through any symlink
    except FileNotFoundError:
        st = None  # a new file (or a symlink to one)
    except OSError as e:
        return fail(f"cannot write {out} ({e.strerror or e}); pick a writable --out path")
    if st is not None and stat.S_ISDIR(st.st_mode):
        return fail(f"--out {out} is a directory; give a file name such as {out / 'report.html'}")
    if st is not None and stat.S_ISBLK(st.st_mode):
        return fail(f"--out {out} is a block device; give a file name such as report.html")
    if st is not None and not stat.S_ISREG(st.st_mode):
        # A terminal, /dev/stdout, /dev/null, a pipe: written through, never replaced.
        try:
            with open(out, "wb") as f:
                f.write(page)
        except OSError as e:
            return fail(f"cannot write {out} ({e.strerror or e}); pick a writable --out path")
        print(printable(f"wrote {out} ({facts})"), file=sys.stderr)
        return 0
    target, via = out, ""
    if out.is_symlink():
        # Deliberately: the link stays, the file it points to gets the page.
        target, via = Path(os.path.realpath(out)), f" through the symlink {out}"
    try:
        # The default lives in the private state directory; a chosen --out
        # file is the user's, with their umask.
        state.write_atomic(target, page, mode=0o600 if args.out is None else 0o666)
    except OSError as e:
        return fail(f"cannot write {target}{via} ({e.strerror or e}); pick a writable --out path")
    print(printable(f"wrote {target}{via} ({facts})"))
    return 0
