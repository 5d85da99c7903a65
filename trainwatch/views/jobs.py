"""`trainwatch jobs [--json]`: the jobs under $TRAINWATCH_HOME and their status
(a job whose launcher died without saying so shows as `lost`)."""

from __future__ import annotations

import json
import time

from trainwatch import liveness, state
from trainwatch.diagnostics import preemption
from trainwatch.usage import Parser, printable


def _text(value: object, default: str = "") -> str:
    return value if isinstance(value, str) else default


def _started(value: object) -> str:
    start = state.finite_number(value)
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(start)) if start is not None else "-"
    except (OverflowError, OSError, ValueError):  # a time no calendar holds
        return "-"


def _nodes(j: dict) -> str:
    nodes = j.get("nodes") if isinstance(j.get("nodes"), list) else [j.get("node")]
    return ",".join(str(n) for n in nodes if isinstance(n, str)) or "-"


def main(argv: list[str]) -> int:
    p = Parser(prog="trainwatch jobs", usage_hint="usage: trainwatch jobs [--json]")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    jobs = state.list_jobs()
    for j in jobs:
        per_node = j.pop("node_records", None)
        statuses = [liveness.status_of(r) for r in per_node] if per_node else [liveness.status_of(j)]
        j["status"] = next((s for s in statuses if s in liveness.LIVE_STATUSES), statuses[-1])
    if args.json:
        print(json.dumps(jobs, indent=2, default=str))
        return 0
    if not jobs:
        print(printable(f"no jobs under {state.home() / 'jobs'}"))
        return 0
    print(f"{'JOB':<36} {'STATUS':<10} {'RANKS':>5} {'RESTARTS':>8}  {'STARTED':<19}  {'NODES':<16} ENTRYPOINT")
    notes = []
    for j in jobs:
        preempted = preemption.of_job(j) if j["status"] not in liveness.LIVE_STATUSES else None
        if preempted is not None:
            j["status"] = "preempted"
            notes.append(f"{_text(j.get('job'), '?')}: {preemption.line(preempted)}")
        started = _started(j.get("start_time"))
        ranks = j.get("ranks") if isinstance(j.get("ranks"), list) else []
        restarts = j.get("restarts") if state.is_int(j.get("restarts")) else 0
        print(printable(f"{_text(j.get('job'), '?'):<36} {j['status']:<10} {len(ranks):>5} {restarts:>8}  "
                        f"{started:<19}  {_nodes(j):<16} {_text(j.get('entrypoint'))}"))
    for note in notes:
        print(printable(note))
    return 0
