"""`trainwatch diagnose JOB [--json]`: what is wrong with a job, in seconds.

Live job: reads every rank's slot straight from shared memory (works while they
hang), captures every rank's stacks with py-spy in parallel, groups them, and
combines both with the job's incidents into one verdict. Finished job: its last
incident. The JSON shape is the contract in DESIGN.md.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from trainwatch import slots, state
from trainwatch.diagnostics import verdict as verdict_mod


def job_is_live(job: dict) -> bool:
    if job.get("status") not in ("running", "starting"):
        return False
    pid = job.get("launcher_pid")
    return bool(pid) and psutil.pid_exists(pid)


def read_ranks(job: dict, job_dir: Path) -> list[dict]:
    """Per-rank telemetry: from the live segment when the job runs, else the last snapshot."""
    rows: list[dict] = []
    path = job.get("slots")
    if job_is_live(job) and path:
        try:
            seg = slots.Segment(path)
        except (OSError, ValueError):
            seg = None
        if seg is not None:
            now = time.monotonic()
            for s in seg.read_all():
                rows.append(
                    {
                        "rank": s.rank,
                        "local_rank": s.local_rank,
                        "node": job.get("node"),
                        "pid": s.pid,
                        "step": s.step,
                        "phase": s.phase,
                        "step_s": s.step_s if s.step_s == s.step_s else None,
                        "last_progress_s": round(max(0.0, now - s.progress_mono), 2),
                        "heartbeat_age_s": round(max(0.0, now - s.heartbeat_mono), 2) if s.heartbeat_mono > 0 else None,
                        "groups": [
                            {"pg": g.pg, "enqueued": g.enqueued, "completed": g.completed, "last_op": g.last_op}
                            for g in s.groups
                        ],
                    }
                )
            seg.close()
    if not rows:
        snap = state.read_json(job_dir / "telemetry.json") or {}
        rows = [dict(r) for r in snap.get("ranks", [])]
    for r in rows:
        g0 = r.get("groups", [None])[0] if r.get("groups") else None
        r["collectives"] = {
            "enqueued": g0["enqueued"] if g0 else None,
            "completed": g0["completed"] if g0 else None,
            "last_op": (g0["last_op"] or None) if g0 else None,
        }
    rows.sort(key=lambda r: r["rank"])
    return rows


def hardware_findings(incidents: list[dict], job_dir: Path) -> list[dict]:
    out = []
    for i in incidents:
        if i.get("kind") in ("xid", "ecc"):
            ev = i.get("evidence") or {}
            out.append(
                {
                    "gpu": ev.get("gpu"),
                    "xid": ev.get("xid"),
                    "meaning": ev.get("meaning") or i.get("summary"),
                    "severity": i.get("severity"),
                    "rank": (i.get("culprit_ranks") or [None])[0],
                    "action": ev.get("action"),
                    "kind": i.get("kind"),
                    "evidence": ev.get("line"),
                }
            )
    return out


def collect(job_name: str, *, native: bool = False, timeout_s: float = 8.0, capture: bool = True) -> dict:
    from trainwatch.diagnostics.capture import capture_all, capture_dir
    from trainwatch.diagnostics.stacks import group_stacks

    job_dir = state.job_dir(job_name)
    job = state.read_job(job_name)
    if job is None:
        known = [j.get("job") for j in state.list_jobs()]
        raise state.StateError(
            f"unknown job {job_name!r}; known jobs: {', '.join(known) if known else 'none'} (see `trainwatch jobs`)"
        )
    incidents = list(state.read_events(job_name))
    live = job_is_live(job)
    ranks = read_ranks(job, job_dir)
    groups: list = []
    capture_info: dict[int, Any] = {}
    if live and capture and ranks:
        pids = {r["rank"]: r["pid"] for r in ranks if r.get("pid")}
        per_rank = max(1.0, min(5.0, timeout_s - 1.0))
        caps = capture_all(pids, native=native, timeout_s=per_rank, out_dir=capture_dir(job_dir, "diagnose"), job=job_name)
        capture_info = caps
        groups = group_stacks({rank: c.stack for rank, c in caps.items()})
    for r in ranks:
        c = capture_info.get(r["rank"])
        if c is not None:
            r["state"] = c.process_state or "gone"
            r["capture_error"] = c.stack.error
        elif live:
            try:
                r["state"] = psutil.Process(r["pid"]).status()
            except (psutil.Error, KeyError, TypeError):
                r["state"] = "gone"
        else:
            r["state"] = "exited"
    hardware = hardware_findings(incidents, job_dir)
    if live:
        v = verdict_mod.decide(ranks, groups, incidents, hardware)
    elif incidents:
        last = next((i for i in reversed(incidents) if i.get("kind") != "restart"), incidents[-1])
        v = verdict_mod._from_incident(last, f"job {job.get('status', 'finished')}; last incident")
    else:
        status = job.get("status", "unknown")
        v = verdict_mod.Verdict(
            "healthy" if status == "succeeded" else "other", [],
            f"job {status} with no incidents", "healthy" if status == "succeeded" else "hang", 0.8, [],
        )
    return {
        "job": job_name,
        "status": "running" if live else job.get("status", "unknown"),
        "verdict": {
            "category": v.category,
            "culprit_ranks": v.culprit_ranks,
            "summary": v.summary,
            "runbook": v.runbook,
            "confidence": v.confidence,
            "evidence": v.evidence,
        },
        "ranks": [
            {
                "rank": r["rank"],
                "node": r.get("node"),
                "pid": r.get("pid"),
                "step": r.get("step"),
                "phase": r.get("phase"),
                "last_progress_s": r.get("last_progress_s"),
                "collectives": r["collectives"],
                "state": r.get("state"),
                "heartbeat_age_s": r.get("heartbeat_age_s"),
                "capture_error": r.get("capture_error"),
            }
            for r in ranks
        ],
        "stack_groups": [
            {
                "ranks": list(g.ranks),
                "frames": list(g.frames),
                "category": g.category,
                "pattern": g.pattern_id,
                "thread": g.thread,
                "error": g.error,
            }
            for g in groups
        ],
        "hardware": [{k: h[k] for k in ("gpu", "xid", "meaning", "severity")} | {"rank": h["rank"]} for h in hardware],
        "incidents": incidents[-20:],
    }


def render(report: dict) -> str:
    v = report["verdict"]
    lines = [
        f"job {report['job']} ({report['status']})",
        f"verdict: {v['category']}"
        + (f" — culprit {', '.join(f'rank {r}' for r in v['culprit_ranks'])}" if v["culprit_ranks"] else "")
        + f" (confidence {v['confidence']:.2f})",
        f"  {v['summary']}",
        f"  runbook: trainwatch runbook {v['runbook']}",
    ]
    for e in v.get("evidence", [])[:6]:
        lines.append(f"  - {e}")
    if report["ranks"]:
        lines.append("")
        lines.append(f"{'RANK':>4} {'NODE':<12} {'PID':>7} {'STEP':>7} {'PHASE':<11} {'IDLE s':>7} {'SEQ enq/done':>13} STATE")
        for r in report["ranks"]:
            c = r["collectives"]
            seq = f"{c['enqueued'] if c['enqueued'] is not None else '-'}/{c['completed'] if c['completed'] is not None else '-'}"
            idle = f"{r['last_progress_s']:.1f}" if r.get("last_progress_s") is not None else "-"
            st = r.get("state") or "-"
            if r.get("capture_error"):
                st += f" (no stack: {r['capture_error']})"
            lines.append(
                f"{r['rank']:>4} {str(r.get('node') or '-')[:12]:<12} {r.get('pid') or '-':>7} {r.get('step', '-'):>7} "
                f"{str(r.get('phase') or '-'):<11} {idle:>7} {seq:>13} {st}"
            )
    for g in report["stack_groups"]:
        lines.append("")
        lines.append(f"stack group: ranks {','.join(map(str, g['ranks']))} — {g['category']}"
                     + (f" [{g['pattern']}]" if g.get("pattern") else "") + (f" thread {g['thread']}" if g.get("thread") else ""))
        if g.get("error"):
            lines.append(f"    (not sampled: {g['error']})")
        for f in g["frames"][:6]:
            lines.append(f"    {f}")
    if report["hardware"]:
        lines.append("")
        for h in report["hardware"]:
            lines.append(f"hardware: GPU {h['gpu']} Xid {h['xid']} ({h['severity']}): {h['meaning']}")
    if report["incidents"]:
        lines.append("")
        lines.append(f"incidents ({len(report['incidents'])} most recent):")
        for i in report["incidents"][-5:]:
            lines.append(f"  {i.get('time', '')} {i.get('kind')}: {i.get('summary', '')}")
    return "\n".join(lines)


def main(job: str, *, as_json: bool = False, native: bool = False, timeout_s: float = 8.0, out=None) -> int:
    out = out or sys.stdout
    try:
        state.check_job_name(job)
        report = collect(job, native=native, timeout_s=timeout_s)
    except state.StateError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(report, indent=2, default=str), file=out)
    else:
        print(render(report), file=out)
    return 0
