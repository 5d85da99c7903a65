"""Read NVIDIA GPU faults (Xid, NVSwitch SXid, GSP timeouts) out of kernel-log text.

Kernel logs reach us in many wrappings: plain ``dmesg`` (``[12345.678901]``),
``dmesg -T`` (``[Mon Nov 23 07:55:06 2026]``), syslog/journalctl
(``Nov 23 07:55:06 host kernel: ...``), ISO-stamped dmesg or journal lines,
``/dev/kmsg`` records (``4,1234,5678901,-;...``), and lines pasted with no
prefix at all. The driver's message inside is what matters, so each line is
searched for the message and the prefix only supplies a timestamp.

Everything here is pure: text in, frozen data out. Absent facts stay None;
nothing (a year, a PCI function, a pid) is guessed.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from trainwatch.diagnostics.xid import (
    ACTIONS,
    ECC_CODES,
    ECC_RUNBOOK,
    STATED_FATAL_SEVERITY,
    STATED_NONFATAL_ACTION,
    STATED_NONFATAL_SEVERITY,
    XID_RUNBOOK,
    lookup,
    severity_rank,
    stated_fatality,
    sxid_info,
)

GPU_LOST_XID = 79
"""The Xid a 'fallen off the bus' message means even when it carries no number."""
GSP_TIMEOUT_XID = 119
"""The Xid a GSP RPC timeout message means even when it carries no number."""


@dataclass(frozen=True, slots=True)
class XidEvent:
    """One GPU fault report found in a kernel log (or delivered by NVML)."""

    code: int
    """Xid number (or SXid number when ``is_sxid``)."""
    pci: str | None
    """PCI address as logged, normalized to lower case (``0000:3b:00`` or ``0000:3b:00.0``)."""
    pid: int | None
    """Process id the driver blamed, when it printed a numeric one."""
    process: str | None
    """Process name the driver blamed, when it printed one."""
    text: str
    """The log line (continuation lines joined) the event was read from."""
    severity: str
    """One of xid.SEVERITY_ORDER."""
    action: str
    """One of xid.ACTIONS: what to do first."""
    line_no: int | None
    """1-based line number in the parsed text; None when not from text."""
    timestamp: str | None
    """Timestamp exactly as the log printed it (kmsg microseconds shown as seconds)."""
    is_sxid: bool = False
    """True for NVSwitch SXid events, whose numbers are not Xid numbers."""
    recovery_action: str | None = None
    """Recovery the driver asked for (e.g. 'GPU Reset Required'), as printed."""
    caused_by: int | None = None
    """The Xid the driver says this one follows from ('... caused by previous Xid 149');
    the event's severity and action are then that Xid's."""


@dataclass(frozen=True, slots=True)
class BurstSummary:
    """What a group of events adds up to."""

    root_cause: XidEvent | None
    """Earliest event that is not a known consequence of another fault."""
    most_severe: XidEvent | None
    """Event with the highest severity; ties go to the earliest."""
    events: tuple[XidEvent, ...]
    """All events, in log order."""
    root_cause_xid: int | None = None
    """Xid number of the root cause: root_cause's, or else the Xid the earliest
    follow-on names as its cause (its own line may be out of the excerpt)."""


# --- line prefixes -----------------------------------------------------------
# Prefixes can stack (a syslog line often carries a dmesg stamp too), so they
# are peeled off repeatedly; the first timestamp seen is kept.
_ISO = r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?"
_PREFIXES: tuple[re.Pattern[str], ...] = (
    # Talos/remote syslog: "10.0.0.1: kern: warning: [2026-04-22T21:25:20.45Z]: "
    re.compile(r"^\S+:\s+kern:\s+\w+:\s+\[(?P<ts>[^\]]+)\]:\s*"),
    # dmesg --decode --time-format=iso: "kern  :err   : 2025-01-25T10:34:54,85+00:00 "
    re.compile(rf"^kern\s*:\s*\w+\s*:\s*(?P<ts>{_ISO})\s+"),
    # journalctl -o short-iso / RFC 3339 syslog
    re.compile(rf"^(?P<ts>{_ISO})\s+(?:(?:\S+\s+)?kernel:\s*)?"),
    # classic syslog / journalctl: "Nov 23 07:55:06 host kernel: " (host optional)
    re.compile(r"^(?P<ts>[^\W\d_]{3}\s+\d{1,2}\s+\d{2}:\d{2}:\d{2})\s+(?:\S+\s+)?kernel:\s*"),
    # dmesg -T: "[Mon Nov 23 07:55:06 2026] "
    re.compile(r"^\[(?P<ts>[A-Z][a-z]{2} [A-Z][a-z]{2}\s+\d{1,2} \d{2}:\d{2}:\d{2} \d{4})\]\s*"),
    # dmesg: "[12345.678901] "
    re.compile(r"^\[\s*(?P<ts>\d+\.\d+)\]\s*"),
    # newer kernels tag the printing thread/cpu: "[ T1946] "
    re.compile(r"^\[\s*[TC]\d+\]\s*"),
    # /dev/kmsg: "prio,seq,usec,flags;message"
    re.compile(r"^\d+,\d+,(?P<usec>\d{1,20}),[^;]*;"),
    # journalctl -k --no-hostname -o cat style leftovers
    re.compile(r"^kernel:\s*"),
)

_XID_RE = re.compile(r"\bXid\s*\((?P<where>[^)]*)\):\s*(?P<code>\d{1,9})(?!\d)(?P<rest>.*)")
# NVML's event as GPU health tools log it (the k8s device plugin, DCGM wrappers):
# "XidCriticalError: Xid=48 on Device=GPU-7540a9b3-..., the device will go unhealthy."
_NVML_XID_RE = re.compile(r"\bXid\s*=\s*(?P<code>\d{1,9})(?!\d)")
# "SXid" has no word boundary before its "X", so _XID_RE never matches it.
_SXID_RE = re.compile(r"\bSXid\s*\((?P<where>[^)]*)\):\s*(?P<code>\d{1,9})(?!\d)(?P<rest>.*)")
_PCI_RE = re.compile(
    r"(?<![0-9A-Fa-f])([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?)\b"
)
_FALLEN_RE = re.compile(r"fallen off the bus", re.IGNORECASE)
_GSP_TIMEOUT_RE = re.compile(
    r"GSP RPC timeout"
    r"|Timeout (?:after \S+ )?(?:of )?waiting for RPC (?:response )?from (?:GPU\d+ )?GSP"
    r"|\bGSP Timeout\b",
    re.IGNORECASE,
)
# Follow-on Xids (45, 43, ...) name the fault they clean up after: "... Ch 00000001 caused
# by previous Xid 149", "(caused by previous Xid 79)".
_CAUSED_BY_RE = re.compile(
    r"\bcaused\s+by\s+(?:the\s+|a\s+)?(?:previous\s+|prior\s+|earlier\s+)?Xid\s*[:#]?\s*(\d{1,5})\b", re.IGNORECASE)
# khungtaskd: "INFO: task python:4321 blocked for more than 120 seconds."
_HUNG_TASK_RE = re.compile(
    r"\btask\s+(?P<name>\S+?):(?P<pid>\d{1,12})\s+blocked\s+for\s+more\s+than\s+(?P<secs>\d{1,9})\s+seconds")
HUNG_TASK_SEVERITY = "high"
"""What an Xid followed by kernel tasks blocked in uninterruptible sleep is at least: the driver
(or the GPU behind it) no longer answers, and only a reset or reboot frees the tasks."""
_PID_RE = re.compile(r"\bpid=([^,;\s]*)")
_NAME_RE = re.compile(r"\bname=([^,;]*)")
# Xid 154 prints "... changed from 0x0 (None) to 0x2 (Node Reboot Required)";
# the target is what matters.
_RECOVERY_TARGET_RE = re.compile(r"\bto 0x[0-9A-Fa-f]+ \(([^)]+)\)")
_RECOVERY_TEXT_RE = re.compile(
    r"GPU Reset Required|Node Reboot Required|Drain and Reset(?: Recommended)?|Drain P2P",
    re.IGNORECASE,
)
_UNKNOWN_VALUES = frozenset({"", "<unknown>", "unknown", "n/a"})

# Driver-requested recovery -> (our action, the severity it implies).
_RECOVERY: dict[str, tuple[str | None, str]] = {
    "none": (None, "info"),
    "drain p2p": ("drain_node", "medium"),
    "gpu reset required": ("reset_gpu", "high"),
    "drain and reset": ("drain_node", "high"),
    "drain and reset recommended": ("drain_node", "high"),
    "node reboot required": ("reboot_node", "critical"),
}


# --- small pure helpers ------------------------------------------------------

def normalize_pci(raw: str | None) -> str | None:
    """Lower-case a PCI address, drop a 'PCI:' prefix and shorten an 8-digit zero domain.

    ``PCI:0000:3B:00`` -> ``0000:3b:00``; ``00000000:3B:00.0`` -> ``0000:3b:00.0``.
    Returns None when ``raw`` holds no PCI address.
    """
    if not raw:
        return None
    match = _PCI_RE.search(raw)
    if match is None:
        return None
    domain, rest = match.group(1).lower().split(":", 1)
    # NVML prints an 8-digit domain, the kernel log a 4-digit one; keep one form.
    if len(domain) > 4 and domain[:-4].strip("0") == "":
        domain = domain[-4:]
    return f"{domain}:{rest}"


def pci_key(pci: str | None) -> str | None:
    """Domain:bus:device of a PCI address, so ``0000:3b:00`` matches ``0000:3b:00.0``."""
    normalized = normalize_pci(pci)
    if normalized is None:
        return None
    return normalized.split(".", 1)[0]


def _strip_prefixes(line: str) -> tuple[str | None, str]:
    """Peel known log prefixes off ``line``; return (first timestamp, message)."""
    body = line.strip()
    timestamp: str | None = None
    peeled = True
    while peeled:
        peeled = False
        for pattern in _PREFIXES:
            match = pattern.match(body)
            if match is None or match.end() == 0:
                continue
            if timestamp is None:
                groups = match.groupdict()
                if groups.get("ts"):
                    timestamp = groups["ts"].strip()
                elif groups.get("usec"):
                    usec = int(groups["usec"])
                    timestamp = f"{usec // 1_000_000}.{usec % 1_000_000:06d}"
            body = body[match.end():]
            peeled = True
            break
    return timestamp, body


def _field(pattern: re.Pattern[str], text: str) -> str | None:
    match = pattern.search(text)
    if match is None:
        return None
    value = match.group(1).strip().strip("'\"").strip()
    return None if value.lower() in _UNKNOWN_VALUES else value


def _recovery_action(text: str) -> str | None:
    target = _RECOVERY_TARGET_RE.search(text)
    if target is not None:
        return target.group(1).strip()
    match = _RECOVERY_TEXT_RE.search(text)
    return match.group(0) if match is not None else None


def _has_event(text: str) -> bool:
    return bool(_XID_RE.search(text) or _SXID_RE.search(text) or _NVML_XID_RE.search(text))


def _records(text: str) -> Iterator[tuple[int, str]]:
    """Yield (first line number, record) with continuation lines joined.

    The driver sometimes splits one message over several lines; the later
    lines start with blanks and 'NVRM:' and carry no timestamp of their own.
    """
    start: int | None = None
    parts: list[str] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if raw.startswith("# ") or not stripped:
            if parts and start is not None:
                yield start, " ".join(parts)
            start, parts = None, []
            continue
        continues = (
            parts
            and raw[:1].isspace()
            and stripped.startswith("NVRM:")
            and not _has_event(stripped)
            and not _has_event(parts[0])
        )
        if continues:
            parts.append(stripped)
            continue
        if parts and start is not None:
            yield start, " ".join(parts)
        start, parts = number, [raw.rstrip()]
    if parts and start is not None:
        yield start, " ".join(parts)


def _event(code: int, *, pci: str | None, pid: int | None, process: str | None,
           record: str, line_no: int, timestamp: str | None,
           is_sxid: bool = False, caused_by: int | None = None) -> XidEvent:
    info = sxid_info(code, record) if is_sxid else lookup(code)
    severity, action = info.severity, info.action
    cause = lookup(caused_by) if caused_by is not None else None
    if cause is not None and severity_rank(cause.severity) >= severity_rank(severity):
        # A follow-on is as bad as the fault it follows, and needs what that fault needs.
        severity, action = cause.severity, cause.action
    stated = None if is_sxid else stated_fatality(record)  # sxid_info already read the wording
    if stated == "nonfatal":
        # One number covers fatal and non-fatal forms (NVLink Xids 144-150); the line's own
        # word beats the table's default, which has to assume the worse form.
        severity, action = STATED_NONFATAL_SEVERITY, STATED_NONFATAL_ACTION
    elif stated == "fatal" and severity_rank(severity) < severity_rank(STATED_FATAL_SEVERITY):
        severity = STATED_FATAL_SEVERITY
        action = action if ACTIONS.index(action) >= ACTIONS.index("reset_gpu") else "reset_gpu"
    recovery = _recovery_action(record)
    if recovery is not None:
        # The driver's own recovery request beats the table's generic advice.
        implied_action, implied_severity = _RECOVERY.get(recovery.lower(), (None, "info"))
        if implied_action is not None:
            action = implied_action
        if severity_rank(implied_severity) > severity_rank(severity):
            severity = implied_severity
    return XidEvent(code, pci, pid, process, record.strip(), severity, action,
                    line_no, timestamp, is_sxid, recovery, caused_by)


def _parse_record(line_no: int, record: str) -> tuple[XidEvent, bool] | None:
    """Return (event, implied) for one record, or None when it reports no fault.

    ``implied`` marks events inferred from wording ('fallen off the bus', GSP
    timeouts) rather than read from a numbered Xid line.
    """
    timestamp, body = _strip_prefixes(record)
    sxid = _SXID_RE.search(body)
    if sxid is not None:
        return _event(int(sxid.group("code")), pci=normalize_pci(sxid.group("where")),
                      pid=None, process=None, record=record, line_no=line_no,
                      timestamp=timestamp, is_sxid=True), False
    xid = _XID_RE.search(body)
    if xid is not None:
        rest = xid.group("rest")
        pid_text = _field(_PID_RE, rest)
        pid = int(pid_text) if pid_text is not None and pid_text.isdigit() and len(pid_text) <= 12 else None
        cause = _CAUSED_BY_RE.search(rest)
        code = int(xid.group("code"))
        caused_by = int(cause.group(1)) if cause is not None and int(cause.group(1)) != code else None
        return _event(code, pci=normalize_pci(xid.group("where")),
                      pid=pid, process=_field(_NAME_RE, rest), record=record,
                      line_no=line_no, timestamp=timestamp, caused_by=caused_by), False
    nvml = _NVML_XID_RE.search(body)
    if nvml is not None:
        return _event(int(nvml.group("code")), pci=None, pid=None, process=None, record=record,
                      line_no=line_no, timestamp=timestamp), False
    if _FALLEN_RE.search(body):
        return _event(GPU_LOST_XID, pci=normalize_pci(body), pid=None, process=None,
                      record=record, line_no=line_no, timestamp=timestamp), True
    if _GSP_TIMEOUT_RE.search(body):
        return _event(GSP_TIMEOUT_XID, pci=normalize_pci(body), pid=None, process=None,
                      record=record, line_no=line_no, timestamp=timestamp), True
    return None


def _same_gpu(a: str | None, b: str | None) -> bool:
    # An address-less message cannot be told apart from any GPU's, so it matches.
    return a is None or b is None or pci_key(a) == pci_key(b)


def _drop_echoes(found: Sequence[tuple[XidEvent, bool]]) -> list[XidEvent]:
    """Keep an inferred event only when no numbered line already reports it.

    The driver prints 'GPU has fallen off the bus' next to 'Xid ...: 79' and
    often repeats it; counting each echo would invent extra faults.
    """
    explicit = [event for event, implied in found if not implied]
    inferred: list[XidEvent] = []
    kept: list[XidEvent] = []
    for event, implied in found:
        if implied:
            echoes = [other for other in (*explicit, *inferred)
                      if other.code == event.code and not other.is_sxid
                      and _same_gpu(other.pci, event.pci)]
            if echoes:
                continue
            inferred.append(event)
        kept.append(event)
    return kept


# --- public API --------------------------------------------------------------

def parse_kernel_log(text: str) -> list[XidEvent]:
    """All GPU fault events in ``text``, in log order. Lines starting with '# ' are ignored."""
    found: list[tuple[XidEvent, bool]] = []
    for line_no, record in _records(text):
        parsed = _parse_record(line_no, record)
        if parsed is not None:
            found.append(parsed)
    return _drop_echoes(found)


def _is_consequence(event: XidEvent) -> bool:
    return not event.is_sxid and lookup(event.code).consequence


def summarize(events: Sequence[XidEvent]) -> BurstSummary:
    """Root cause (earliest non-consequence) and most severe event (ties -> earliest)."""
    root = next((event for event in events if not _is_consequence(event)), None)
    worst: XidEvent | None = None
    for event in events:
        if worst is None or severity_rank(event.severity) > severity_rank(worst.severity):
            worst = event
    root_xid = root.code if root is not None else next((e.caused_by for e in events if e.caused_by is not None), None)
    return BurstSummary(root, worst, tuple(events), root_xid)


def hung_tasks(text: str) -> list[tuple[int, str, int, str]]:
    """(line number, task name, seconds, the line) of every blocked-task report, in log order."""
    found = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if "blocked" not in raw:
            continue
        m = _HUNG_TASK_RE.search(raw)
        if m:
            found.append((number, m.group("name"), int(m.group("secs")), _strip_prefixes(raw)[1].strip()))
    return found


def _apply_consequences(findings: list[dict], first_line: dict[int, int], tasks: list[tuple[int, str, int, str]]) -> None:
    """Grade an Xid by what followed it: tasks blocked in the kernel after it mean the
    GPU or its driver stopped answering, whatever the number alone suggests."""
    for finding in findings:
        after = [t for t in tasks if t[0] > (first_line.get(id(finding)) or 0)]
        if not after:
            continue
        finding["blocked_tasks"] = sorted({t[1] for t in after})
        finding["blocked_s"] = max(t[2] for t in after)
        finding["evidence"] += "\n" + after[0][3]
        if severity_rank(finding["severity"]) < severity_rank(HUNG_TASK_SEVERITY):
            finding["severity"] = HUNG_TASK_SEVERITY
            finding["severity_from"] = "blocked kernel tasks after the Xid"
            if finding["action"] not in ACTIONS or ACTIONS.index(finding["action"]) < ACTIONS.index("reboot_node"):
                # Tasks stuck in the driver usually keep a GPU reset from completing.
                finding["action"] = "reboot_node"


def xid_findings(text: str) -> list[dict]:
    """Findings in ``explain --json`` shape: one per distinct (code, GPU), in log order.

    A burst repeats the same Xid dozens of times on one GPU; one finding with
    a count and the first line as evidence reads better than dozens. Kernel
    tasks blocked after an Xid raise its severity (`_apply_consequences`).
    """
    findings: list[dict] = []
    by_key: dict[tuple[bool, int, str | None], dict] = {}
    first_line: dict[int, int] = {}
    for event in parse_kernel_log(text):
        key = (event.is_sxid, event.code, pci_key(event.pci))
        finding = by_key.get(key)
        if finding is not None:
            finding["count"] += 1
            if severity_rank(event.severity) > severity_rank(finding["severity"]):
                finding["severity"] = event.severity
                finding["action"] = event.action
            if finding["caused_by_xid"] is None:
                finding["caused_by_xid"] = event.caused_by
            continue
        info = sxid_info(event.code, event.text) if event.is_sxid else lookup(event.code)
        ecc = not event.is_sxid and event.code in ECC_CODES
        finding = {
            "kind": "xid",
            "category": "ecc" if ecc else "xid",
            "op": None,
            "xid": None if event.is_sxid else event.code,
            "pci": event.pci,
            "seq": None,
            "timeout_ms": None,
            "rank": None,
            "ranks": None,
            "severity": event.severity,
            "runbook": ECC_RUNBOOK if ecc else XID_RUNBOOK,
            "evidence": event.text,
            "action": event.action,
            "meaning": info.meaning,
            "sxid": event.code if event.is_sxid else None,
            "recovery_action": event.recovery_action,
            "caused_by_xid": event.caused_by,
            "count": 1,
        }
        by_key[key] = finding
        first_line[id(finding)] = event.line_no
        findings.append(finding)
    if findings:
        _apply_consequences(findings, first_line, hung_tasks(text))
    return findings

