"""Incident: what a detector found, in one record every consumer understands.

The same class (`trainwatch.records.Incident`, the records layer's) carries
incidents from the slot detectors (hang, collective mismatch, straggler, crash,
loss health) and from elsewhere (GPU XID/ECC events, restarts), so events.jsonl,
the exporter, `diagnose` and the actions read one shape. Here: the names the
detectors use for it, and the rank lists of their summaries.
"""

from __future__ import annotations

from typing import Iterable

from trainwatch.records import SEVERITIES, Incident, jsonable, severity_rank

__all__ = ["SEVERITIES", "Incident", "jsonable", "severity_rank", "describe_ranks", "format_ranks"]


def describe_ranks(ranks: Iterable[int], *, limit: int = 16) -> str:
    """'rank 3' or 'ranks 0,2,5-9' for a summary sentence; long lists are cut."""
    ranks = sorted({int(r) for r in ranks})
    if not ranks:
        return "no rank"
    word = "rank" if len(ranks) == 1 else "ranks"
    return f"{word} {format_ranks(ranks, limit=limit)}"


def format_ranks(ranks: Iterable[int], *, limit: int = 16) -> str:
    """Compact rank list: runs of three or more become 'a-b'; after `limit`
    pieces the rest is counted, so a 4096-rank job still reads in one line."""
    ranks = sorted({int(r) for r in ranks})
    pieces: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        if j - i >= 2:
            pieces.append(f"{ranks[i]}-{ranks[j]}")
        else:
            pieces.extend(str(r) for r in ranks[i : j + 1])
        i = j + 1
    if len(pieces) > limit:
        return ",".join(pieces[:limit]) + f",... ({len(ranks)} ranks)"
    return ",".join(pieces)
