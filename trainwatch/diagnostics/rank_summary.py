"""`trainwatch diagnose` for a large job: the ranks worth reading, and how the
rest spread.

A 4096-rank job's full table is megabytes of JSON and thousands of terminal
lines that say "healthy" almost everywhere. Above SUMMARY_ABOVE ranks the
report's `ranks` keeps the culprits, the ranks that stand out and one rank
per stack group, and `ranks_summary` counts and spreads the rest. Pure:
report dict in, report dict out.
"""

from __future__ import annotations

SUMMARY_ABOVE = 64
"""Above this many ranks, `ranks` lists only the ranks worth reading (see
summarise()); `--all-ranks` lists every one."""
WORST = 8
"""Ranks taken from each end that matters (longest without progress, lowest step)."""


def summarise(report: dict, limit: int = SUMMARY_ABOVE) -> dict:
    """A large job's report with `ranks` cut to the culprits, the ranks that
    stand out (longest without progress, lowest step, not sampled or not
    running) and one rank of each stack group, plus `ranks_summary`: how many
    ranks there are and how they spread (phases, states, steps, idle times).
    Every other key is unchanged. A job of `limit` ranks or fewer is returned as is."""
    ranks = report["ranks"]
    if len(ranks) <= limit:
        return report
    keep = set(report["verdict"]["culprit_ranks"] or [])
    keep |= {g["ranks"][0] for g in report["stack_groups"] if g["ranks"]}
    keep |= {r["rank"] for r in ranks if r.get("capture_error")
             or r.get("state") not in (None, "running", "sleeping", "remote", "exited", "idle")}

    def idle(r: dict) -> float:
        return r["last_progress_s"] if isinstance(r.get("last_progress_s"), (int, float)) else -1.0

    def step(r: dict) -> float:
        return r["step"] if isinstance(r.get("step"), int) else float("inf")

    keep |= {r["rank"] for r in sorted(ranks, key=idle, reverse=True)[:WORST]}
    keep |= {r["rank"] for r in sorted(ranks, key=step)[:WORST]}
    shown = [r for r in ranks if r["rank"] in keep][:limit]
    summary = {
        "total": len(ranks),
        "shown": len(shown),
        "nodes": len({r.get("node") for r in ranks}),
        "phases": _counts(r.get("phase") for r in ranks),
        "states": _counts(r.get("state") for r in ranks),
        "step": _spread([r["step"] for r in ranks if isinstance(r.get("step"), int)]),
        "last_progress_s": _spread([idle(r) for r in ranks if idle(r) >= 0]),
        "how": f"ranks lists the culprits and the ranks that stand out; `--all-ranks` lists all {len(ranks)}",
    }
    return {**report, "ranks": shown, "ranks_summary": summary}


def _counts(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _spread(values: list) -> dict | None:
    if not values:
        return None
    values = sorted(values)

    def q(p: float):
        return values[min(len(values) - 1, int(p * (len(values) - 1) + 0.5))]

    return {"min": values[0], "median": q(0.5), "p99": q(0.99), "max": values[-1]}
