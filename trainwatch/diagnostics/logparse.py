"""Read PyTorch, NCCL, CUDA and torchelastic error messages out of log text.

`error_findings(text)` turns a training log into findings of the
`explain --json` shape (kind "error"): the message forms of log_rules.py are
found line by line, the lines of one event are merged into one finding, and
the same error printed by several ranks becomes one finding with several
ranks. `parse_log` also returns the collective progress numbers each rank
printed, which rank_comparison.py compares across ranks.

Everything here is a pure function of the text. A fact the text does not
state stays None; nothing is inferred from defaults or typical values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from trainwatch.diagnostics.desync_reports import desync_reports
from trainwatch.diagnostics.findings import NON_FACT_KEYS, error_finding, in_contract_order
from trainwatch.diagnostics.log_rules import RULES, LineRule, may_hold_message, signal_name
from trainwatch.diagnostics.loss_health import loss_health_findings
from trainwatch.diagnostics.rank_comparison import collapse_ranks, mismatch_findings

# Rank attribution, strongest first. torch's "[rank3]:" prefix is the global
# rank; "[Rank 3]" is the process-group rank, equal to the global rank for the
# default group, which is what "[PG 0 ...]" / "(default_pg)" say.
_RANK_PREFIX = re.compile(r"\[rank(\d{1,9})\]")
_RANK_KV = re.compile(r"\brank=(\d{1,9})\b")
_RANK_TAG = re.compile(r"\[(?P<pg>PG[^\]]*?\s)?Rank\s*(?P<rank>\d{1,9})\]")
_DEFAULT_PG = re.compile(r"^PG\s*(?:ID\s*)?0\b|default_pg")
_PG = re.compile(r"\[PG\s*(?:ID\s*)?(?P<id>\d+)(?:\s*PG\s*GUID\s*(?P<guid>\d+))?")
_NAME_RANK = re.compile(r"(?i)(?<![a-z])rank[-_]?(\d{1,9})(?!\d)")
_SOURCE_LINE = re.compile(r"^\s*# source:")
_LAST_ERROR = re.compile(r"Last error:\s*(?P<msg>.*)$")

# torchelastic's ChildFailedError summary, one "key : value" per line.
_FAIL_RANK = re.compile(r"^\s*rank\s*:\s*(?P<rank>\d{1,9})\s*\(local_rank:\s*(?P<local>\d{1,9})\)")
_FAIL_EXIT = re.compile(r"^\s*exitcode\s*:\s*(?P<exit>-?\d{1,12})\s*\(pid:\s*(?P<pid>\d{1,12})\)")
_FAIL_HOST = re.compile(r"^\s*host\s*:\s*(?P<host>\S+)")
_FAIL_FILE = re.compile(r"^\s*error_file\s*:\s*(?P<file>\S.*?)\s*$")
_FAIL_TRACE = re.compile(r"^\s*traceback\s*:\s*Signal\s*(?P<num>\d+)\s*\((?P<name>SIG\w+)\)")
_FAIL_HEADER = re.compile(r"^\s*(?P<kind>Failures|Root Cause)\b")
_FAIL_ENTRY = re.compile(r"^\s*\[\d+\]:\s*$")
_FAIL_BORDER = re.compile(r"^\s*(?:={20,}|-{20,})\s*$")


@dataclass(slots=True)
class ParsedLog:
    """What one text holds: error findings and per-rank collective progress."""

    findings: list[dict] = field(default_factory=list)
    """Merged error findings, in the explain shape."""
    points: list[dict] = field(default_factory=list)
    """Per-rank progress points, input to mismatch_findings."""


def rank_from_name(name: str | None) -> int | None:
    """The rank a file name states ("rank3.log", "logs/rank_03.txt"), else None."""
    if not name:
        return None
    base = re.split(r"[\\/]", name)[-1]
    m = _NAME_RANK.search(base)
    return int(m.group(1)) if m else None


def line_rank(line: str) -> int | None:
    """The global rank a log line states, else None (never the PG-local rank)."""
    for pattern in (_RANK_PREFIX, _RANK_KV):
        m = pattern.search(line)
        if m:
            return int(m.group(1))
    m = _RANK_TAG.search(line)
    if m and (m.group("pg") is None or _DEFAULT_PG.search(m.group("pg"))):
        return int(m.group("rank"))
    return None


def line_pg(line: str) -> str | None:
    """The process group a line names: its GUID when printed, else its id."""
    m = _PG.search(line)
    if not m:
        return None
    return m.group("guid") or m.group("id")


def _wrapped_message(line: str, lines: list[str], i: int) -> bool:
    """A line as wide as a terminal whose end, joined to the next line's start, may hold a
    message: the wrap split its key word ("failed: RE" / "SOURCE_EXHAUSTED: ...")."""
    return len(line) >= _TERMINAL_WIDTH and i + 1 < len(lines) and may_hold_message(line[-40:] + lines[i + 1][:80].lstrip())


_TERMINAL_WIDTH = 79
"""The narrowest line a terminal or log viewer wraps at."""


def _search(rule: LineRule, line: str, joined: str) -> tuple[re.Match[str], str] | None:
    """Match a rule on a line, or on `joined`: the line with the next two appended.

    Joining repairs messages a terminal or an issue tracker wrapped, even in
    mid-word ("OpTy" / "pe=BROADCAST"). A joined match must start on the line
    and cross its end, so each message is found once, on its first line.
    """
    m = rule.pattern.search(line)
    if m:
        return m, line.strip()
    head = len(line.rstrip())
    m = rule.pattern.search(joined)
    if not m or m.start() >= head or m.end() <= head:
        return None
    return m, joined[:m.end()].strip()


def _line_findings(lines: list[str]) -> list[dict]:
    """Findings (with internal `_role`) from every rule on every line."""
    found: list[dict] = []
    for i, line in enumerate(lines):
        if not line or not (may_hold_message(line) or _wrapped_message(line, lines, i)):
            continue
        joined = line.rstrip() + "".join(following.strip() for following in lines[i + 1:i + 3])
        lower = joined.lower()
        families: set[str] = set()
        for rule in RULES:
            if rule.needle not in lower or (rule.family and rule.family in families):
                continue
            hit = _search(rule, line, joined)
            if hit is None:
                continue
            m, evidence = hit
            if rule.family:
                families.add(rule.family)
            try:
                facts = rule.read(m)
            except (ValueError, OverflowError):
                continue  # a number too long to be one: the line is not the message it resembles
            finding = error_finding(rule.category, evidence)
            if rule.runbook:
                finding["runbook"] = rule.runbook
            finding.update(facts)
            if finding["ranks"]:
                # The message names the ranks it is about; the rank that printed it is a detail.
                finding["reported_by"] = line_rank(line)
            elif "rank" not in facts:  # else the message names the rank it is about
                finding["rank"] = line_rank(line)
            pg = line_pg(line)
            if pg is not None:
                finding["pg"] = pg
            if finding.pop("source_local", False) and finding["rank"] is not None:
                finding["source_rank"] = finding["rank"]
            finding["_role"] = rule.role
            found.append(finding)
        found.extend(_last_error(lines, i))
    return found


def _last_error(lines: list[str], i: int) -> list[dict]:
    """NCCL's "Last error:" detail, as a support finding for the NCCL error above it."""
    m = _LAST_ERROR.search(lines[i])
    if not m:
        return []
    message = m.group("msg").strip()
    if not message and i + 1 < len(lines):
        # The detail sits on the next line, behind the same log prefix; a blank
        # next line means NCCL had no detail to give.
        prefix, following = lines[i][:m.start()], lines[i + 1]
        if prefix.strip() and following.startswith(prefix):
            following = following[len(prefix):]
        message = re.sub(r"^\s*\[rank\d+\]:\s*", "", following).strip()
    # A log squashed onto one line separates its lines by runs of spaces.
    message = re.split(r"\s{3,}", message)[0][:300]
    if not message:
        return []
    finding = error_finding("nccl_error", lines[i].strip())
    finding.update(last_error=message, rank=line_rank(lines[i]), _role="support")
    return [finding]


def _child_failures(lines: list[str]) -> list[dict]:
    """One child_failed finding per entry of a ChildFailedError summary.

    Each entry remembers the lines of its embedded traceback (`_block`), so a
    finding read from them can be named as the failure's cause (`_name_causes`).
    """
    found: list[dict] = []
    current: dict | None = None
    root_cause = False
    host = None
    for i, line in enumerate(lines):
        header = _FAIL_HEADER.match(line)
        if header or _FAIL_BORDER.match(line):
            root_cause = bool(header) and header.group("kind") == "Root Cause"
            current, host = None, None
            continue
        if _FAIL_ENTRY.match(line):
            current, host = None, None
            continue
        if current is not None:
            current["_block"].append(i)
        m = _FAIL_HOST.match(line)
        if m:
            host = m.group("host")
            continue
        m = _FAIL_RANK.match(line)
        if m:
            current = error_finding("child_failed", line.strip())
            current.update(rank=int(m.group("rank")), local_rank=int(m.group("local")),
                           root_cause=root_cause, _role="finding", _block=[])
            if host:
                current["host"] = host
            found.append(current)
            continue
        if current is None:
            continue
        m = _FAIL_EXIT.match(line)
        if m:
            exit_code = int(m.group("exit"))
            current.update(exit_code=exit_code, pid=int(m.group("pid")),
                           signal=signal_name(-exit_code) if exit_code < 0 else None)
            current["evidence"] += "; " + line.strip()
            continue
        m = _FAIL_FILE.match(line)
        if m and m.group("file") != "<N/A>":
            current["error_file"] = m.group("file")
            continue
        m = _FAIL_TRACE.match(line)
        if m:
            current["signal"] = m.group("name")
            current["evidence"] += "; " + line.strip()
    return found


# How many earlier findings of a category a new line may join (merge_events).
_LOOK_BACK = 64


def _compatible(a: dict, b: dict) -> bool:
    """True when two findings can be one event: no fact differs."""
    if a["category"] != b["category"]:
        return False
    if a["rank"] is not None and b["rank"] is not None and a["rank"] != b["rank"]:
        return False
    for key in (a.keys() | b.keys()) - NON_FACT_KEYS:
        if a.get(key) is not None and b.get(key) is not None and a[key] != b[key]:
            return False
    return True


def _absorb(into: dict, other: dict) -> None:
    """Fill the unknown facts of `into` from `other`."""
    for key, value in other.items():
        if key in ("evidence", "_role"):
            continue
        if into.get(key) is None and value is not None:
            into[key] = value
    if into["_role"] != "finding" and other["_role"] == "finding":
        into["_role"] = "finding"
        into["evidence"] = other["evidence"]


def merge_events(findings: list[dict]) -> list[dict]:
    """Join the lines of one event (one rank, no conflicting fact) into one finding.

    A multi-line message ("NCCL error in: ..." then "ncclSystemError: ...")
    or a timeout plus its "last enqueued" line becomes one finding. Support
    findings that joined nothing are dropped.
    """
    merged: list[dict] = []
    recent: dict[str, list[dict]] = {}  # category -> its latest merged findings
    for finding in findings:
        # The lines of one event sit close together, even with 16 ranks
        # interleaved; a bounded look-back keeps huge logs linear.
        candidates = recent.setdefault(finding["category"], [])
        target = next((m for m in reversed(candidates[-_LOOK_BACK:]) if _compatible(m, finding)), None)
        if target is None:
            target = dict(finding)
            merged.append(target)
            candidates.append(target)
        else:
            _absorb(target, finding)
    return [m for m in merged if m.get("_role", "finding") != "support"]


_HINT_SPECIFIC = {"cuda_error": frozenset({"cuda_error", "illegal_memory_access", "ecc", "oom"})}
"""Hint category -> the findings that make it redundant; any other finding where not listed."""


def _drop_hints(findings: list[dict]) -> list[dict]:
    """Drop a bare hint ("CUDA kernel errors might be asynchronously reported", "Some
    NCCL operations have failed or timed out") when the text names the failure itself."""
    named = [f["category"] for f in findings if f.get("_role") != "hint"]
    return [f for f in findings if not (f.get("_role") == "hint" and any(
        c in _HINT_SPECIFIC.get(f["category"], c) for c in named))]


def _points(raw: list[dict], events: list[dict]) -> list[dict]:
    """Per-rank collective progress: last-enqueued counters and timed-out SeqNums.

    Counters come from every line that printed them (before merging, so lines
    that joined no finding still count); SeqNums from the merged timeouts,
    which by then know their process group from the "at work" line.
    """
    points = [
        {"metric": "last_enqueued", "rank": f["rank"], "pg": f.get("pg"), "value": f["last_enqueued"],
         "op": None, "evidence": f["evidence"]}
        for f in raw if f.get("last_enqueued") is not None
    ]
    points += [
        {"metric": "timeout_seq", "rank": f["rank"], "pg": f.get("pg"), "value": f["seq"],
         "op": f["op"], "numel_in": f.get("numel_in"), "evidence": f["evidence"]}
        for f in events
        if f["category"] == "collective_timeout" and f.get("transport") == "nccl" and f["seq"] is not None
    ]
    return [p for p in points if p["rank"] is not None]


def _name_causes(events: list[dict], lines: list[str]) -> list[dict]:
    """A child failure whose embedded traceback carries another known error (a
    collective mismatch, an OOM) failed because of it: it gets `cause` (that
    error's category) and goes after every other finding, as the secondary one."""
    for child in (f for f in events if f["category"] == "child_failed"):
        block = [lines[i] for i in child.pop("_block", None) or ()]
        causes = [f["category"] for f in _line_findings(block) + desync_reports(block, line_rank)
                  if f["category"] != "child_failed" and f["_role"] != "hint"]
        if causes:
            child["cause"] = causes[0]
    return [f for f in events if "cause" not in f] + [f for f in events if "cause" in f]


# A terminal UI (a tmux pane, a rich box) closes each line with a border after padding.
_BOX_BORDERS = frozenset("x\u2502|\u2503")


def _unbox(line: str) -> str:
    """The line without a carriage return or a box border drawn after its padding.

    Done by hand: a regex anchored at the end rescans every run of spaces (quadratic).
    """
    line = line.rstrip("\r")
    end = line.rstrip()
    if end and end[-1] in _BOX_BORDERS and end[:-1].endswith("  "):
        return end[:-1].rstrip()
    return line


def parse_log(text: str, source: str | None = None) -> ParsedLog:
    """Error findings and progress points of one text; `source` is its file name."""
    lines = ["" if _SOURCE_LINE.match(line) else _unbox(line) for line in text.splitlines()]
    file_rank = rank_from_name(source)
    raw = (_line_findings(lines) + desync_reports(lines, line_rank) + _child_failures(lines)
           + loss_health_findings(lines))
    if file_rank is not None:
        for finding in raw:
            if finding["rank"] is None and not finding["ranks"]:
                finding["rank"] = file_rank
    events = _name_causes(_drop_hints(merge_events(raw)), lines)
    points = _points(raw, events)
    return ParsedLog(findings=[in_contract_order(f) for f in collapse_ranks(events)], points=points)


# "TypeError: ...", "torch.distributed.DistBackendError: ...": a dotted exception class and its message.
_EXCEPTION = re.compile(r"(?<![\w.])(?:[A-Za-z_]\w{0,40}\.){0,8}(?P<cls>[A-Z]\w{0,60}?(?:Error|Exception))\s*:\s*\S"
                        # ... or the raise statement a traceback quotes: 'raise RuntimeError("...")'.
                        r"|\braise\s+(?:[A-Za-z_]\w{0,40}\.){0,8}(?P<raised>[A-Z]\w{0,60}?(?:Error|Exception))\s*\(")


_LAUNCHER_EXCEPTIONS = re.compile(r"ChildFailedError|Process(?:Raised|Exited)Exception|CalledProcessError"
                                  r"|SignalException|WorkerGroupFailureException|ActorDiedError|RayActorError"
                                  r"|WorkerCrashedError")
"""What launchers raise about a worker that failed: the launcher's report, not the worker's error."""


def unexplained_exception(text: str, launcher: bool = True) -> list[dict]:
    """An `other` finding for the last Python exception in a text that nothing else
    explains (a script's own bug, a version or configuration error); [] without one.
    `launcher=False` passes over the exceptions launchers raise about their workers."""
    last = None
    for line in text.splitlines():
        if ("Error" in line or "Exception" in line) and (m := _EXCEPTION.search(line)) \
                and (launcher or not _LAUNCHER_EXCEPTIONS.search(m.group(0))):
            last = line
    if last is None:
        return []
    finding = error_finding("other", last.strip()[:400])
    m = _EXCEPTION.search(last)
    finding["exception"] = m.group("cls") or m.group("raised")
    return [in_contract_order(finding)]


def error_findings(text: str, source: str | None = None) -> list[dict]:
    """Findings (kind "error") for every known failure message in `text`,
    plus a collective_mismatch finding when its ranks disagree on progress."""
    parsed = parse_log(text, source)
    return mismatch_findings(parsed.points) + parsed.findings
