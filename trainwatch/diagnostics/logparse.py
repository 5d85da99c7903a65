"""Read PyTorch, NCCL, CUDA and torchelastic error messages out of log text.

`error_findings(text)` turns a training log into findings of the
`explain --json` shape (kind "error"). `parse_log` also returns the
collective progress numbers each rank printed, and `mismatch_findings`
compares them across ranks the way NCCL RAS does ("3 ranks reached
SeqNum 8242; rank 5 only 8241"): the ranks behind are the culprits.

Everything here is a pure function of the text. A fact the text does not
state stays None; nothing is inferred from defaults or typical values.
"""

from __future__ import annotations

import re
import signal as _signal
from dataclasses import dataclass, field
from typing import Callable

# Keys every finding carries, in this order (the explain contract).
FINDING_KEYS = (
    "kind", "category", "op", "xid", "pci", "seq", "timeout_ms",
    "rank", "ranks", "severity", "runbook", "evidence",
)

# category -> (severity, runbook id). Severities use the project scale
# (xid.SEVERITY_ORDER): "high" = the whole job stalls or aborts, "medium" =
# one process failed and the GPU is fine, "critical" = GPU memory cannot be
# trusted and the node needs attention before a restart helps.
CATEGORIES: dict[str, tuple[str, str]] = {
    "collective_timeout": ("high", "collective-timeout"),
    "collective_mismatch": ("high", "collective-mismatch"),
    "heartbeat_timeout": ("high", "heartbeat-timeout"),
    "watchdog_stuck": ("high", "watchdog-stuck"),
    "nccl_error": ("high", "nccl-error"),
    "cuda_error": ("medium", "cuda-error"),
    "illegal_memory_access": ("medium", "illegal-memory-access"),
    "ecc": ("critical", "gpu-ecc"),
    "oom": ("medium", "oom"),
    "child_failed": ("medium", "child-failed"),
    "dataloader_worker_killed": ("medium", "dataloader-worker-killed"),
}

# NCCL's one-line descriptions (ncclGetErrorString) -> the ncclResult_t name.
NCCL_DESCRIPTIONS = {
    "unhandled system error": "ncclSystemError",
    "internal error": "ncclInternalError",
    "remote process exited or there was a network error": "ncclRemoteError",
    "unhandled cuda error": "ncclUnhandledCudaError",
    "invalid usage": "ncclInvalidUsage",
    "invalid argument": "ncclInvalidArgument",
}

# strsignal() texts that Python prints for a killed worker -> signal names.
SIGNAL_TEXTS = {
    "killed": "SIGKILL",
    "terminated": "SIGTERM",
    "aborted": "SIGABRT",
    "segmentation fault": "SIGSEGV",
    "bus error": "SIGBUS",
    "interrupt": "SIGINT",
    "floating point exception": "SIGFPE",
    "illegal instruction": "SIGILL",
}

_UNITS = {"b": 1, "bytes": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def _words(phrase: str) -> str:
    """Regex for a phrase whose spaces may be lost or doubled.

    Terminals and issue trackers wrap long messages; joining the pieces back
    drops or doubles the space at the break, so every word gap is optional.
    """
    return r"\s*".join(re.escape(word) for word in phrase.split())


_SIZE = r"[\d.]+\s*(?:[KMGT]i?B|bytes|B)"
_INT = r"-?\d+"
_WORK = r"WorkNCCL\s*\((?P<body>(?:[^()]|\(\s*ms\s*\))*)\)"
# "unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.18.1"
_NCCL_DESC = r"(?P<desc>[^,(]+?)\s*(?=[,(]|$)(?:\([^)]*\))?(?:\s*,\s*NCCL\s*version\s*(?P<ver>[\w.+-]+))?"


@dataclass(frozen=True, slots=True)
class LineRule:
    """One message form: the regex that finds it and how to read its facts."""

    name: str
    """Short id naming the message form in the table."""
    needle: str
    """Lower-case word every instance contains; without it the regex is not tried."""
    category: str
    """Error category the message proves."""
    pattern: re.Pattern[str]
    """Compiled regex; its named groups carry the facts."""
    read: Callable[[re.Match[str]], dict]
    """Match -> facts (finding fields and extra keys)."""
    role: str = "finding"
    """"finding"; "support" (only adds facts to a finding); "hint" (dropped beside a specific CUDA finding)."""
    family: str = ""
    """Rules of one family are exclusive on a line: the first listed wins."""


def _kv(body: str) -> dict[str, str]:
    """Key=value pairs of a WorkNCCL(...) body; Timeout(ms)=N is read as Timeout."""
    return {k: v for k, v in re.findall(r"(\w+)\s*(?:\(\s*ms\s*\))?\s*=\s*(-?\w+)", body)}


def _int(value: str | None) -> int | None:
    """int() that passes None through."""
    return None if value is None else int(value)


def _work(m: re.Match[str]) -> dict:
    """Facts of a WorkNCCL(SeqNum=..., OpType=..., Timeout(ms)=...) record."""
    kv = _kv(m.group("body"))
    facts = {
        "seq": _int(kv.get("SeqNum")),
        "op": kv.get("OpType"),
        "timeout_ms": _int(kv.get("Timeout")),
        "transport": "nccl",
    }
    # NumelIn/NumelOut exist since torch 2.2; a mismatch between ranks is a
    # classic desync sign, so keep them when present.
    if "NumelIn" in kv:
        facts["numel_in"] = int(kv["NumelIn"])
    if "NumelOut" in kv:
        facts["numel_out"] = int(kv["NumelOut"])
    return facts


def _progress(m: re.Match[str]) -> dict:
    """Facts of a "... at work: N, last enqueued ...: E, last completed ...: C" line."""
    facts = {
        "last_enqueued": int(m.group("enq")),
        "last_completed": int(m.group("comp")),
        "transport": "nccl",
    }
    if m.groupdict().get("seq") is not None:
        facts["seq"] = int(m.group("seq"))
    return facts


def _heartbeat(m: re.Match[str]) -> dict:
    """Facts of the heartbeat monitor's own time-out line."""
    pending = m.group("pending")
    return {} if pending is None else {"pending_work": int(pending)}


def _dump_signal(m: re.Match[str]) -> dict:
    """Facts of "Received a dump signal due to a collective timeout from ..."."""
    facts: dict = {}
    if m.group("src") is not None:
        facts["source_rank"] = int(m.group("src"))
    elif m.group("local"):
        facts["source_local"] = True  # resolved to this line's rank later
    if m.group("enq") is not None:
        facts["last_enqueued"] = int(m.group("enq"))
        facts["last_completed"] = int(m.group("comp"))
    return facts


def _stuck(m: re.Match[str]) -> dict:
    """The heartbeat timeout the watchdog exceeded, in ms."""
    return {"timeout_ms": int(m.group("secs")) * 1000}


def _nccl_line(m: re.Match[str]) -> dict:
    """Facts of "NCCL error in: FILE:LINE, DESCRIPTION, NCCL version V"."""
    desc = " ".join(m.group("desc").lower().split())
    code = next((c for d, c in NCCL_DESCRIPTIONS.items() if desc.startswith(d)), None)
    facts: dict = {"nccl_code": code}
    if m.group("ver"):
        facts["nccl_version"] = m.group("ver").rstrip(".")
    return facts


def _nccl_async(m: re.Match[str]) -> dict:
    """A collective that raised an async NCCL error: the work record plus the code."""
    return {**_work(m), **_nccl_line(m)}


def _nccl_code(m: re.Match[str]) -> dict:
    """Facts of an "ncclSystemError: ..." line."""
    return {"nccl_code": m.group("code")}


def _nothing(m: re.Match[str]) -> dict:
    """A message whose only fact is its category."""
    return {}


def _cuda_message(m: re.Match[str]) -> dict:
    """The text after "CUDA error:", without the hints torch appends."""
    message = m.group("msg").strip().rstrip(".").strip()
    return {"cuda_message": message} if message else {}


def to_bytes(size: str) -> int | None:
    """'2.00 GiB' -> 2147483648; None when the unit is unknown."""
    m = re.fullmatch(r"([\d.]+)\s*([A-Za-z]+)", size.strip())
    if not m or m.group(2).lower() not in _UNITS:
        return None
    return round(float(m.group(1)) * _UNITS[m.group(2).lower()])


_OOM_DETAILS = (
    re.compile(r"Tried\s*to\s*allocate\s*(?P<requested>" + _SIZE + ")"),
    # torch >= 2.1: "GPU 0 has a total capacity of 79.15 GiB of which 1.23 GiB is free"
    # (2.1 spelled it "capacty").
    re.compile(r"GPU\s*(?P<gpu>\d+)\s*has\s*a\s*total\s*capac(?:i)?ty\s*of\s*(?P<total>" + _SIZE
               + r")\s*of\s*which\s*(?P<free>" + _SIZE + r")\s*is\s*free"),
    # torch < 2.1: "(GPU 0; 14.76 GiB total capacity; 8.77 GiB already allocated; 19.75 MiB free; ...)"
    re.compile(r"\(GPU\s*(?P<gpu>\d+);\s*(?P<total>" + _SIZE + r")\s*total\s*capacity;\s*"
               r"(?P<allocated>" + _SIZE + r")\s*already\s*allocated;\s*(?P<free>" + _SIZE + r")\s*free"),
)


def _oom(m: re.Match[str]) -> dict:
    """Requested / total / free bytes and the GPU index of a CUDA OOM message."""
    facts: dict = {}
    line = m.string[m.start():]
    for detail in _OOM_DETAILS:
        found = detail.search(line)
        if not found:
            continue
        for key, value in found.groupdict().items():
            if value is None:
                continue
            facts["gpu" if key == "gpu" else f"{key}_bytes"] = int(value) if key == "gpu" else to_bytes(value)
    return facts


def _elastic_failed(m: re.Match[str]) -> dict:
    """Facts of the agent's "failed (exitcode: -9) local_rank: 3 (pid: 1234)" line."""
    exit_code = int(m.group("exit"))
    return {
        "exit_code": exit_code,
        "signal": signal_name(-exit_code) if exit_code < 0 else None,
        "local_rank": int(m.group("local")),
        "pid": int(m.group("pid")),
    }


def _dataloader(m: re.Match[str]) -> dict:
    """Facts of a "DataLoader worker (pid N) is killed by signal: Killed." line."""
    pids = [int(p) for p in re.findall(r"\d+", m.group("pids") or "")]
    facts: dict = {"pids": pids or None}
    if m.group("sig") is not None:
        facts["signal"] = SIGNAL_TEXTS.get(m.group("sig").strip().lower())
    if m.group("exit") is not None:
        facts["exit_code"] = int(m.group("exit"))
    return facts


def _bus_error(m: re.Match[str]) -> dict:
    """torch names SIGBUS in a worker when /dev/shm runs out."""
    return {"signal": "SIGBUS"}


def _gloo_timeout(m: re.Match[str]) -> dict:
    """Facts of gloo's "Timed out waiting 1800000ms for recv operation"."""
    return {"timeout_ms": int(m.group("ms")), "transport": "gloo"}


def _gloo_peer(m: re.Match[str]) -> dict:
    """Facts of gloo's "Connection closed by peer [host]:port" line."""
    peer = m.group("peer1") or m.group("peer2")
    return {"transport": "gloo", "peer": peer}


def signal_name(number: int) -> str | None:
    """9 -> 'SIGKILL'; None for numbers this platform does not know."""
    try:
        return _signal.Signals(number).name
    except ValueError:
        return None


# The one table of message forms. Order matters inside a family only.
RULES: tuple[LineRule, ...] = (
    # -- collective timeouts -------------------------------------------------
    LineRule("nccl-watchdog-timeout", "caught", "collective_timeout", re.compile(
        r"[Cc]aught\s*collective\s*operation\s*timeout\s*:?\s*" + _WORK), _work),
    LineRule("nccl-blocking-wait", "blocking", "collective_timeout", re.compile(
        r"Work\s*" + _WORK + r"\s*" + _words("timed out in blocking wait")), _work),
    LineRule("nccl-timeout-at-work", "enqueued", "collective_timeout", re.compile(
        _words("Timeout at NCCL work:") + r"\s*(?P<seq>" + _INT + r"),\s*" + _words("last enqueued NCCL work:")
        + r"\s*(?P<enq>" + _INT + r"),\s*" + _words("last completed NCCL work:") + r"\s*(?P<comp>" + _INT + ")"),
        _progress, family="progress"),
    # "Exception (either an error or timeout)": an error or a timeout, so it
    # only adds numbers to a timeout finding and never makes one by itself.
    LineRule("nccl-exception-at-work", "enqueued", "collective_timeout", re.compile(
        _words("detected by watchdog at work:") + r"\s*(?P<seq>" + _INT + r"),\s*"
        + _words("last enqueued NCCL work:") + r"\s*(?P<enq>" + _INT + r"),\s*"
        + _words("last completed NCCL work:") + r"\s*(?P<comp>" + _INT + ")"), _progress, role="support",
        family="progress"),
    LineRule("nccl-failure-at-work", "enqueued", "collective_timeout", re.compile(
        _words("failure detected by watchdog at work sequence id:") + r"\s*(?P<seq>" + _INT + r")\s*"
        + _words("PG status: last enqueued work:") + r"\s*(?P<enq>" + _INT + r"),\s*"
        + _words("last completed work:") + r"\s*(?P<comp>" + _INT + ")"), _progress, role="support",
        family="progress"),
    LineRule("gloo-timeout", "gloo", "collective_timeout", re.compile(
        r"gloo[^\]\s]*\]\s*" + _words("Timed out waiting") + r"\s*(?P<ms>\d+)\s*ms\s*for\s*(?:recv|send)\s*operation"),
        _gloo_timeout),
    LineRule("gloo-peer-lost", "gloo", "collective_timeout", re.compile(
        r"gloo[^\]\s]*\]\s*(?:Read\s*error\s*(?P<peer1>\[[^\]]*\]:\d+)\s*:\s*)?"
        r"Connection\s*(?:closed|reset)\s*by\s*peer"
        r"(?:\s*(?P<peer2>\[[^\]]*\]:\d+))?"), _gloo_peer),
    # -- heartbeat monitor / watchdog ------------------------------------------
    LineRule("heartbeat-monitor", "heartbeat", "heartbeat_timeout", re.compile(
        _words("Heartbeat monitor timed out!") + r"(?:.*?workMetaList_\.size\(\)\s*=\s*(?P<pending>\d+))?"),
        _heartbeat),
    LineRule("dump-signal", "dump", "heartbeat_timeout", re.compile(
        _words("Received a dump signal due to a collective timeout from") + r"\s*(?:(?P<local>"
        + _words("this local rank") + r")|rank\s*(?P<src>\d+))"
        + r"(?:.*?" + _words("Last enqueued NCCL work:") + r"\s*(?P<enq>" + _INT + r"),\s*"
        + _words("last completed NCCL work:") + r"\s*(?P<comp>" + _INT + "))?"), _dump_signal, family="progress"),
    # Any other line with both counters (a flight-recorder summary, a custom
    # print): no finding of its own, but a progress point for the comparison.
    LineRule("nccl-progress", "enqueued", "collective_timeout", re.compile(
        r"(?i)" + _words("last enqueued") + r"\s*(?:NCCL\s*)?work:\s*(?P<enq>" + _INT + r"),\s*"
        + _words("last completed") + r"\s*(?:NCCL\s*)?work:\s*(?P<comp>" + _INT + ")"), _progress, role="support",
        family="progress"),
    LineRule("timeout-signal", "received", "heartbeat_timeout", re.compile(
        r"Received\s*a\s*(?:" + _words("global timeout from another rank") + "|"
        + _words("timeout signal from this local rank") + ")"), _nothing),
    LineRule("watchdog-stuck", "stuck", "watchdog_stuck", re.compile(
        r"(?i)(?:ProcessGroupNCCL'\s*s\s*)?watchdog\s*got\s*stuck\s*for\s*(?P<secs>\d+)\s*seconds"), _stuck),
    # -- NCCL errors ---------------------------------------------------------------
    LineRule("nccl-async-error", "async", "nccl_error", re.compile(
        r"Collective\s*" + _WORK + r"\s*" + _words("raised the following async exception:")
        + r"\s*NCCL\s*error\s*:\s*" + _NCCL_DESC),
        _nccl_async, family="nccl-text"),
    LineRule("nccl-error-in", "nccl", "nccl_error", re.compile(
        r"NCCL\s*error\s*(?:in\s*:\s*[^,\s]+\s*,|:)\s*" + _NCCL_DESC), _nccl_line, family="nccl-text"),
    LineRule("nccl-code", "nccl", "nccl_error", re.compile(
        r"\b(?P<code>nccl(?:UnhandledCudaError|SystemError|InternalError|InvalidArgument|InvalidUsage"
        r"|RemoteError))\s*:"),
        _nccl_code),
    # -- CUDA: one finding per line, most specific first -------------------------
    LineRule("cuda-ecc", "ecc", "ecc", re.compile(
        _words("uncorrectable ECC error encountered") + r"|CUDA_ERROR_ECC_UNCORRECTABLE|cudaErrorECCUncorrectable"),
        _nothing, family="cuda"),
    LineRule("cuda-illegal-address", "illegal", "illegal_memory_access", re.compile(
        _words("illegal memory access was encountered") + r"|cudaErrorIllegalAddress|CUDA_ERROR_ILLEGAL_ADDRESS"),
        _nothing, family="cuda"),
    LineRule("cuda-error-oom", "memory", "oom", re.compile(r"CUDA\s*error\s*:\s*out\s*of\s*memory"),
             _nothing, family="cuda"),
    LineRule("cuda-error", "cuda", "cuda_error", re.compile(
        r"CUDA\s*error\s*:\s*(?P<msg>.+?)\s*"
        r"(?:CUDA\s*kernel\s*errors|Search\s*for\s*`|Compile\s*with\s*`|'?,\s*please|$)"),
        _cuda_message, family="cuda"),
    LineRule("cuda-async-hint", "asynchronously", "cuda_error", re.compile(
        _words("CUDA kernel errors might be asynchronously reported")), _nothing, role="hint"),
    # -- memory --------------------------------------------------------------------
    LineRule("cuda-oom", "memory", "oom", re.compile(
        r"OutOfMemoryError\s*:\s*(?=\S)|CUDA\s*out\s*of\s*memory\."), _oom),
    # -- processes -------------------------------------------------------------------
    LineRule("elastic-failed", "exitcode", "child_failed", re.compile(
        r"failed\s*\(exitcode:\s*(?P<exit>-?\d+)\)\s*local_rank:\s*(?P<local>\d+)\s*\(pid:\s*(?P<pid>\d+)\)"),
        _elastic_failed),
    LineRule("dataloader-killed", "dataloader", "dataloader_worker_killed", re.compile(
        r"DataLoader\s*worker\s*(?:\(pid(?:\(s\))?\s*(?P<pids>\d[\d,\s]*)\)\s*)?"
        r"(?:is\s*killed\s*by\s*signal\s*:\s*(?P<sig>[A-Za-z ]+)|exited\s*unexpectedly"
        r"(?:\s*with\s*exit\s*code\s*(?P<exit>-?\d+))?)"), _dataloader),
    LineRule("dataloader-bus-error", "bus", "dataloader_worker_killed", re.compile(
        _words("Unexpected bus error encountered in worker")), _bus_error),
)

# Cheap pre-filter: a line containing none of these (lower-cased) words
# cannot start a message in RULES, so the rule loop and the wrap-joining skip
# it. Plain substrings, because "NCCL INFO" chatter fills real logs and a
# regex test per line would cost more than the parsing.
_ANCHOR_WORDS = (
    "watchdog", "heartbeat", "signal", "timeout", "timed out", "collective", "enqueued", "either an",
    "error", "ncclinvalid", "ecc", "memory", "dataloader", "exitcode", "gloo", "processgroupnccl'",
)


def _anchored(line: str) -> bool:
    """True when a line may hold (the start of) a known message."""
    lower = line.lower()
    return any(word in lower for word in _ANCHOR_WORDS)


# Rank attribution, strongest first. torch's "[rank3]:" prefix is the global
# rank; "[Rank 3]" is the process-group rank, equal to the global rank for the
# default group, which is what "[PG 0 ...]" / "(default_pg)" say.
_RANK_PREFIX = re.compile(r"\[rank(\d+)\]")
_RANK_KV = re.compile(r"\brank=(\d+)\b")
_RANK_TAG = re.compile(r"\[(?P<pg>PG[^\]]*?\s)?Rank\s*(?P<rank>\d+)\]")
_DEFAULT_PG = re.compile(r"^PG\s*(?:ID\s*)?0\b|default_pg")
_PG = re.compile(r"\[PG\s*(?:ID\s*)?(?P<id>\d+)(?:\s*PG\s*GUID\s*(?P<guid>\d+))?")
_NAME_RANK = re.compile(r"(?i)(?<![a-z])rank[-_]?(\d+)(?!\d)")
_SOURCE_LINE = re.compile(r"^\s*# source:")
_LAST_ERROR = re.compile(r"Last error:\s*(?P<msg>.*)$")

# torchelastic's ChildFailedError summary, one "key : value" per line.
_FAIL_RANK = re.compile(r"^\s*rank\s*:\s*(?P<rank>\d+)\s*\(local_rank:\s*(?P<local>\d+)\)")
_FAIL_EXIT = re.compile(r"^\s*exitcode\s*:\s*(?P<exit>-?\d+)\s*\(pid:\s*(?P<pid>\d+)\)")
_FAIL_HOST = re.compile(r"^\s*host\s*:\s*(?P<host>\S+)")
_FAIL_FILE = re.compile(r"^\s*error_file\s*:\s*(?P<file>\S.*?)\s*$")
_FAIL_TRACE = re.compile(r"^\s*traceback\s*:\s*Signal\s*(?P<num>\d+)\s*\((?P<name>SIG\w+)\)")
_FAIL_HEADER = re.compile(r"^\s*(?P<kind>Failures|Root Cause)\b")
_FAIL_ENTRY = re.compile(r"^\s*\[\d+\]:\s*$")


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


def _blank(category: str, evidence: str) -> dict:
    """A finding with every contract key, facts unknown."""
    severity, runbook = CATEGORIES[category]
    finding = dict.fromkeys(FINDING_KEYS)
    finding.update(kind="error", category=category, severity=severity, runbook=runbook, evidence=evidence)
    return finding


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
        if not line or not _anchored(line):
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
            finding = _blank(rule.category, evidence)
            finding.update(rule.read(m))
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
    finding = _blank("nccl_error", lines[i].strip())
    finding.update(last_error=message, rank=line_rank(lines[i]), _role="support")
    return [finding]


def _child_failures(lines: list[str]) -> list[dict]:
    """One child_failed finding per entry of a ChildFailedError summary."""
    found: list[dict] = []
    current: dict | None = None
    root_cause = False
    host = None
    for line in lines:
        header = _FAIL_HEADER.match(line)
        if header:
            root_cause = header.group("kind") == "Root Cause"
            current, host = None, None
            continue
        if _FAIL_ENTRY.match(line):
            current, host = None, None
            continue
        m = _FAIL_HOST.match(line)
        if m:
            host = m.group("host")
            continue
        m = _FAIL_RANK.match(line)
        if m:
            current = _blank("child_failed", line.strip())
            current.update(rank=int(m.group("rank")), local_rank=int(m.group("local")),
                           root_cause=root_cause, _role="finding")
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

# Keys that describe a finding rather than state a fact about the failure.
_META = {"kind", "evidence", "severity", "runbook", "rank", "ranks", "_role"}


def _compatible(a: dict, b: dict) -> bool:
    """True when two findings can be one event: no fact differs."""
    if a["category"] != b["category"]:
        return False
    if a["rank"] is not None and b["rank"] is not None and a["rank"] != b["rank"]:
        return False
    for key in (a.keys() | b.keys()) - _META:
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


def _drop_hints(findings: list[dict]) -> list[dict]:
    """Drop the bare "CUDA kernel errors might be asynchronously reported" finding
    when the text names the CUDA error itself."""
    specific = {"cuda_error", "illegal_memory_access", "ecc", "oom"}
    has_specific = any(f["category"] in specific and f.get("_role") != "hint" for f in findings)
    return [f for f in findings if not (f.get("_role") == "hint" and has_specific)]


# Facts one rank reports about itself. Ranks that agree on everything else
# are one finding; these stay only where every rank printed the same value.
_DETAIL = {"last_enqueued", "last_completed", "pg", "pid", "host", "local_rank", "pending_work", "last_error"}


def collapse_ranks(findings: list[dict]) -> list[dict]:
    """One finding per distinct fact set; `ranks` lists every rank that printed it.

    Eight ranks printing the same timeout become one finding with eight ranks;
    `rank` stays set only when exactly one rank is involved.
    """
    groups: dict[tuple, list[dict]] = {}
    for finding in findings:
        if finding.get("kind") != "error":
            # Stack and Xid findings are grouped by their own parsers.
            groups[("own", id(finding))] = [finding]
            continue
        key = tuple(sorted((k, repr(v)) for k, v in finding.items() if k not in _META | _DETAIL))
        groups.setdefault(key, []).append(finding)
    out = []
    for members in groups.values():
        if members[0].get("kind") != "error":
            out.append(members[0])
            continue
        merged = dict(members[0])
        ranks: set[int] = set()
        for member in members:
            ranks.update(member.get("ranks") or [])
            if member.get("rank") is not None:
                ranks.add(member["rank"])
        for key in _DETAIL:
            values = [repr(m.get(key)) for m in members]
            if key in merged and len(set(values)) > 1:
                merged[key] = None
        merged["ranks"] = sorted(ranks) or None
        merged["rank"] = merged["ranks"][0] if len(ranks) == 1 else None
        out.append(merged)
    return out


def _finish(finding: dict) -> dict:
    """Contract keys first, then extra facts; internal keys removed."""
    finding.pop("_role", None)
    ordered = {key: finding.get(key) for key in FINDING_KEYS}
    ordered.update((k, v) for k, v in finding.items() if k not in ordered)
    return ordered


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
         "op": f["op"], "evidence": f["evidence"]}
        for f in events
        if f["category"] == "collective_timeout" and f.get("transport") == "nccl" and f["seq"] is not None
    ]
    return [p for p in points if p["rank"] is not None]


def parse_log(text: str, source: str | None = None) -> ParsedLog:
    """Error findings and progress points of one text; `source` is its file name."""
    lines = ["" if _SOURCE_LINE.match(line) else line.rstrip("\r") for line in text.splitlines()]
    file_rank = rank_from_name(source)
    raw = _line_findings(lines) + _child_failures(lines)
    if file_rank is not None:
        for finding in raw:
            if finding["rank"] is None:
                finding["rank"] = file_rank
    events = _drop_hints(merge_events(raw))
    points = _points(raw, events)
    return ParsedLog(findings=[_finish(f) for f in collapse_ranks(events)], points=points)


def error_findings(text: str, source: str | None = None) -> list[dict]:
    """Findings (kind "error") for every known failure message in `text`,
    plus a collective_mismatch finding when its ranks disagree on progress."""
    parsed = parse_log(text, source)
    return mismatch_findings(parsed.points) + parsed.findings


def _per_rank(points: list[dict], take_max: bool) -> dict[int, int] | None:
    """rank -> value; None when a rank reports several values and `take_max` is off."""
    values: dict[int, set[int]] = {}
    for p in points:
        values.setdefault(p["rank"], set()).add(p["value"])
    if not take_max and any(len(v) > 1 for v in values.values()):
        return None
    return {rank: max(v) for rank, v in values.items()}


def _groups(points: list[dict], metric: str) -> list[tuple[str | None, dict[int, int], str | None]]:
    """(process group, rank -> value, op) for each comparable set of points."""
    chosen = [p for p in points if p["metric"] == metric]
    out = []
    if metric == "last_enqueued":
        # Enqueued counters only grow, so a rank's latest (largest) value in a
        # known group is its progress; without a group, several values may be
        # several groups, and comparing them would invent a desync.
        for pg in dict.fromkeys(p["pg"] for p in chosen):
            per_rank = _per_rank([p for p in chosen if p["pg"] == pg], take_max=pg is not None)
            if per_rank:
                out.append((pg, per_rank, None))
        return out
    # Timed-out SeqNums: compare within a group when every point names one;
    # otherwise only when the points cannot belong to different groups
    # (one value per rank, one op, at most one named group).
    if chosen and all(p["pg"] is not None for p in chosen):
        buckets = {pg: [p for p in chosen if p["pg"] == pg] for pg in dict.fromkeys(p["pg"] for p in chosen)}
    else:
        buckets = {None: chosen}
    for pg, bucket in buckets.items():
        ops = {p["op"] for p in bucket if p["op"]}
        pgs = {p["pg"] for p in bucket if p["pg"] is not None}
        per_rank = _per_rank(bucket, take_max=False)
        if per_rank and len(ops) <= 1 and len(pgs) <= 1:
            out.append((pg if pg is not None else next(iter(pgs), None), per_rank, next(iter(ops), None)))
    return out


def _rank_list(ranks: list[int]) -> str:
    """[5] -> 'rank 5'; [5, 6] -> 'ranks 5, 6'."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def mismatch_findings(points: list[dict]) -> list[dict]:
    """collective_mismatch findings where the ranks of one group disagree on progress.

    The highest sequence number is where the group got to; every rank below
    it has not launched (or not reached) that collective and is behind.
    """
    out: list[dict] = []
    reported: set[frozenset[int]] = set()
    for metric in ("last_enqueued", "timeout_seq"):
        for pg, per_rank, op in _groups(points, metric):
            if len(per_rank) < 2 or len(set(per_rank.values())) < 2:
                continue
            top = max(per_rank.values())
            leaders = sorted(r for r, v in per_rank.items() if v == top)
            behind = sorted((r for r, v in per_rank.items() if v < top), key=lambda r: (per_rank[r], r))
            if frozenset(behind) in reported:
                continue
            reported.add(frozenset(behind))
            by_value: dict[int, list[int]] = {}
            for r in behind:
                by_value.setdefault(per_rank[r], []).append(r)
            lag = "; ".join(f"{_rank_list(sorted(rs))} only {v}" for v, rs in sorted(by_value.items(), reverse=True))
            count = f"{len(leaders)} rank{'s' if len(leaders) > 1 else ''}"
            evidence = f"{count} reached SeqNum {top}; {lag}"
            if metric == "last_enqueued":
                evidence = f"{count} enqueued up to SeqNum {top}; {lag}"
            if op is None:
                # The enqueued counters carry no op; a rank that timed out
                # at the leading SeqNum of the same group names it.
                ops = {p["op"] for p in points if p["metric"] == "timeout_seq" and p["value"] == top
                       and p["op"] and p["pg"] in (pg, None)}
                op = ops.pop() if len(ops) == 1 else None
            finding = _blank("collective_mismatch", evidence)
            lagging = sorted(behind)
            finding.update(
                op=op, seq=top, ranks=lagging, rank=lagging[0] if len(lagging) == 1 else None,
                pg=pg, metric=metric, leading_ranks=leaders,
                behind=[{"rank": r, "seq": per_rank[r]} for r in lagging],
            )
            out.append(_finish(finding))
    return out
