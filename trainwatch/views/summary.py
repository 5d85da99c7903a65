"""What a user needs when trainwatch gives up on a job: what happened, how
often, what next. Printed by the launcher at exit."""

from __future__ import annotations

from trainwatch import records, state
from trainwatch.usage import printable


def failure_summary(job: str, restarts: int, max_restarts: int, cause: str | None = None) -> str:
    """What a user needs when trainwatch gives up: what happened, how often, what next.
    cause: the exception that ended it, one line (rank, file:line, its last line)."""
    events = state.JobDir(job).incidents()
    kinds: dict[str, int] = {}
    for e in events:
        kinds[e.kind] = kinds.get(e.kind, 0) + 1
    last = next((e for e in reversed(events) if e.kind != "restart"), None)
    lines = [f"[trainwatch] summary for job {job}:"]
    lines.append(f"  restarts: {restarts} of {max_restarts} allowed"
                 + (" (budget spent)" if max_restarts and restarts >= max_restarts else ""))
    if cause:
        lines.append(f"  error: {cause}")
    lines.append("  incidents: " + (", ".join(f"{k} x{n}" for k, n in sorted(kinds.items())) or "none"))
    if last is not None:
        verdict = last.verdict
        lines.append(f"  last: {records.headline(last.kind, (verdict.summary if verdict else '') or last.summary)}")
        runbook = (verdict.runbook if verdict else None) or last.runbook
        if runbook:
            lines.append(f"  next: trainwatch runbook {runbook}")
    lines.append(f"  details: trainwatch diagnose {job}")
    return printable("\n".join(lines))
