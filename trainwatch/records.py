"""The records of a job's events.jsonl, typed as their readers use them.

events.jsonl is append-only: an incident when it is detected, then records that
name it by id as things happen to it: `action` (what the responder did:
stacks, verdict, checkpoint, restart request), `resolved` (its condition is
over: when, after how long, how often it was seen) and `restart` (the worker
group it restarted is training again). `merge_events` folds them into one
record per incident, so the console, `diagnose`, the report and the exporter
tell the same story. Anything of the wrong type reads as missing, never as a
traceback: the file may have been written by another version or by hand.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any


class JobStatus(str, enum.Enum):
    """job.json's `status`: written by the launcher and its agent only, through
    these names. A reader of a status it does not know (a newer writer's) shows
    it as written."""

    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    LOST = "lost"
    """Set by a reader: the launcher died without saying how the run ended."""

    def __str__(self) -> str:
        return self.value


LIVE_STATUSES = (JobStatus.STARTING.value, JobStatus.RUNNING.value, JobStatus.RESTARTING.value)
"""Statuses of a run whose launcher is (or should be) alive."""


# ---- messages between trainwatch's own processes (read with trainwatch.codec) ----------


@dataclasses.dataclass(slots=True)
class RestartRequest:
    """The sidecar's request that the agent restart the worker group
    (control/restart-request.json)."""

    run: str
    """The launcher run it is for: another run's request is ignored."""
    generation: int
    """The worker group it is about: a request that arrives after the agent
    restarted for another reason must not restart again."""
    reason: str = "sidecar request"
    kind: str | None = None
    incident: str | None = None
    """The id of the incident the restart is an action of."""
    time: float = 0.0


@dataclasses.dataclass(slots=True)
class ZygoteReady:
    """The warm-start process is up, with the entry's imports preloaded."""

    pid: int
    preloaded: list[str] = dataclasses.field(default_factory=list)
    import_s: float = 0.0
    cuda_initialized: bool = False
    op: str = "ready"


@dataclasses.dataclass(slots=True)
class ZygoteFork:
    """The agent asks the warm-start process for one worker."""

    id: int
    args: list[str]
    env: dict[str, str]
    cwd: str
    stdout: str | None = None
    stderr: str | None = None
    op: str = "fork"


@dataclasses.dataclass(slots=True)
class ZygoteForked:
    """The answer to a fork: the worker's pid, or why there is none."""

    id: int
    pid: int | None = None
    error: str | None = None
    op: str = "forked"


@dataclasses.dataclass(slots=True)
class ZygoteExit:
    """A forked worker exited (its exit code as os.waitstatus_to_exitcode gives it)."""

    pid: int
    code: int
    op: str = "exit"


ZYGOTE_MESSAGES = {"ready": ZygoteReady, "fork": ZygoteFork, "forked": ZygoteForked, "exit": ZygoteExit}
"""The warm-start protocol's messages by their `op` (one JSON object a line)."""


def is_int(value: Any) -> bool:
    """An integer read from JSON (true and false are not numbers)."""
    return isinstance(value, int) and not isinstance(value, bool)


def finite_number(value: Any) -> float | None:
    """value as a finite float, None when it is not a number (or NaN, infinite, too large)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


_INCIDENT_TEXT = ("time", "summary", "runbook", "category", "severity", "node", "job", "key", "status", "resolution",
                  "incident")
_VERDICT_TEXT = ("category", "summary", "runbook")


def _rank_list(record: dict, key: str) -> None:
    if key in record:
        if isinstance(record[key], list):
            record[key] = [r for r in record[key] if is_int(r)]
        else:
            del record[key]


def _drop_wrong(record: dict, keys: tuple[str, ...], kind: type) -> None:
    for key in keys:
        if record.get(key) is not None and not isinstance(record[key], kind):
            del record[key]


def typed_incident(record: dict) -> dict:
    """An events.jsonl incident as its readers use it: a field of the wrong type
    (a culprit list that is a string, evidence that is a number) reads as missing."""
    _drop_wrong(record, _INCIDENT_TEXT, str)
    _drop_wrong(record, ("evidence", "restart", "verdict"), dict)
    _rank_list(record, "culprit_ranks")
    _rank_list(record, "victims")
    verdict = record.get("verdict")
    if isinstance(verdict, dict):
        _drop_wrong(verdict, _VERDICT_TEXT, str)
        _rank_list(verdict, "culprit_ranks")
        if "confidence" in verdict and finite_number(verdict["confidence"]) is None:
            del verdict["confidence"]
        if "evidence" in verdict:
            evidence = verdict["evidence"]
            verdict["evidence"] = [e for e in evidence if isinstance(e, str)] if isinstance(evidence, list) else []
    return record




def merge_events(events: list[dict]) -> list[dict]:
    """Incidents (and restart records) oldest first, each with the records that
    name it merged in: an `action`'s results, a `resolved` record's status,
    time, duration and count. An incident with no `resolved` record is
    `open`."""
    out: list[dict] = []
    by_id: dict[str, dict] = {}
    for record in events:
        if not isinstance(record.get("kind"), str):
            continue
        if record["kind"] == "action":
            target = by_id.get(str(record.get("incident")))
            if target is not None:
                target.update({k: v for k, v in record.items() if k not in ("kind", "incident", "time", "id")})
                verdict = record.get("verdict")
                if isinstance(verdict, dict) and isinstance(verdict.get("runbook"), str):
                    # The capture's verdict refines where the incident points:
                    # every reader then names the same runbook.
                    target["runbook"] = verdict["runbook"]
            continue
        if record["kind"] == "resolved":
            target = by_id.get(str(record.get("incident")))
            if target is not None:
                target.update(status="resolved", resolved_time=record.get("time"),
                              duration_s=finite_number(record.get("duration_s")),
                              count=record.get("count") if is_int(record.get("count")) else None,
                              resolution=record.get("reason") if isinstance(record.get("reason"), str) else None)
            continue
        if record.get("id") is not None:
            if str(record["id"]) in by_id:
                continue  # a job incident that every node of a shared home recorded
            by_id[str(record["id"])] = record
        if record["kind"] != "restart":
            record["status"] = "open"  # until a `resolved` record names it
        out.append(record)
    return [typed_incident(record) for record in out]
