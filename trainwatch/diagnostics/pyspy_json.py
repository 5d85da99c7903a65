"""`py-spy dump --json` output, decoded into the stack model (trainwatch.diagnostics.stacks)."""

from __future__ import annotations

import json
from typing import Any, Mapping

from trainwatch.diagnostics.stacks import Frame, ProcessStack, ThreadStack


def parse_pyspy_json(data: Any, pid: int | None = None, rank: int | None = None) -> list[ProcessStack]:
    """Decoded `py-spy dump --json` output -> processes.

    Accepts a list of thread objects (what py-spy prints), an object mapping
    pid -> thread list, an object `{"pid", "rank", "threads"}` or a list of any
    of these. Junk yields an empty list, never an exception.
    """
    if isinstance(data, dict):
        if "frames" in data:
            return parse_pyspy_json([data], pid=pid, rank=rank)
        if "threads" in data or "error" in data:
            threads = data.get("threads") if isinstance(data.get("threads"), list) else []
            return [ProcessStack(
                pid=_int_or(data.get("pid"), pid),
                rank=_int_or(data.get("rank"), rank),
                command=_str_or_none(data.get("command")),
                threads=tuple(_pyspy_json_thread(t) for t in threads if isinstance(t, dict)),
                error=_str_or_none(data.get("error")),
            )]
        out: list[ProcessStack] = []
        for key, value in data.items():
            out.extend(parse_pyspy_json(value, pid=_int_or(key, pid), rank=rank))
        return out
    if not isinstance(data, list):
        return []
    if any(isinstance(item, list) or (isinstance(item, dict) and "frames" not in item) for item in data):
        out = []
        for item in data:
            out.extend(parse_pyspy_json(item, pid=pid, rank=rank))
        return out
    # A flat list of threads; py-spy stamps each with its pid.
    by_pid: dict[int | None, list[ThreadStack]] = {}
    for item in data:
        if isinstance(item, dict):
            by_pid.setdefault(_int_or(item.get("pid"), pid), []).append(_pyspy_json_thread(item))
    return [ProcessStack(p, rank, None, tuple(threads)) for p, threads in by_pid.items()]


def _pyspy_json_thread(item: Mapping[str, Any]) -> ThreadStack:
    frames = []
    raw_frames = item.get("frames")
    for raw in raw_frames if isinstance(raw_frames, list) else ():
        if not isinstance(raw, dict):
            continue
        line = _int_or(raw.get("line"), None)
        frames.append(Frame(
            function=str(raw.get("name") or "?"),
            file=str(raw.get("filename") or raw.get("short_filename") or ""),
            line=line if line else None,  # py-spy reports native frames as line 0
        ))
    tid = item.get("os_thread_id") or item.get("thread_id")
    return ThreadStack(
        thread_id=None if tid is None else str(tid),
        thread_name=_str_or_none(item.get("thread_name")),
        frames=tuple(frames),
        active=item.get("active") if isinstance(item.get("active"), bool) else None,
        gil=item.get("owns_gil") if isinstance(item.get("owns_gil"), bool) else None,
    )


def _int_or(value: Any, default: int | None) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def decode_json_values(text: str) -> list[Any] | None:
    """Every JSON value in `text` (py-spy dumps may be concatenated); None if not all JSON."""
    decoder = json.JSONDecoder()
    values, pos = [], 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            return values
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        values.append(value)
