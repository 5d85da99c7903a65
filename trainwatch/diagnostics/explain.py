"""`trainwatch explain`: verdicts from text a cluster already produced.

Each input (a training log, a py-spy dump or faulthandler traceback, a
kernel log) goes through every parser; whatever they recognise becomes a
finding of the `explain --json` shape. Inputs are compared with each other
too, so one log per rank is enough to name the rank that fell behind.

`explain_inputs` is pure (bytes in, dict out); the command that reads files
and prints is trainwatch.views.explain.
"""

from __future__ import annotations

import re
from typing import Callable

from trainwatch.diagnostics.boxed_text import unbox
from trainwatch.diagnostics.cues import cue_findings
from trainwatch.diagnostics.findings import FINDING_KEYS
from trainwatch.diagnostics.kernel_log import xid_findings
from trainwatch.diagnostics.logparse import ParsedLog, parse_log, rank_from_name, unexplained_exception
from trainwatch.diagnostics.prose import prose_hang
from trainwatch.diagnostics.rank_comparison import collapse_ranks, mismatch_findings
from trainwatch.diagnostics.stack_groups import stack_findings

# How much of an input decides whether it is text; logs are large and the
# first 64 KiB say enough.
_SNIFF_BYTES = 64 * 1024
# Control bytes other than whitespace, backspace and ESC (colour codes) make
# a file binary past this share.
_MAX_CONTROL_SHARE = 0.10
_TEXT_CONTROLS = {8, 9, 10, 12, 13, 27}
_SOURCE_LINE = re.compile(r"^# source:.*$", re.MULTILINE)
_EVIDENCE_CHARS = 240


def decode_input(name: str, data: bytes) -> tuple[str | None, str | None]:
    """(text, None) for a readable input, (None, reason) for one to skip."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        # Windows tools write UTF-16 logs; their NUL bytes are not binary.
        text = data.decode("utf-16", errors="replace")
        return (text, None) if text.strip() else (None, f"{name}: empty file, skipped")
    if not data.strip():
        return None, f"{name}: empty file, skipped"
    if data.startswith(b"\x1f\x8b"):
        return None, f"{name}: compressed file, skipped (decompress it first)"
    sample = data[:_SNIFF_BYTES]
    controls = sum(1 for byte in sample if byte < 32 and byte not in _TEXT_CONTROLS)
    if b"\x00" in sample or controls > _MAX_CONTROL_SHARE * len(sample):
        return None, f"{name}: binary file, skipped"
    return data.decode("utf-8", errors="replace"), None


def _parse_safely(label: str, parse: Callable[[str], list[dict]], name: str, text: str,
                  errors: list[str]) -> list[dict]:
    """Findings of one parser; a parser that raises becomes one line in `errors`.

    Every input goes through every parser, so one parser's bug on one input
    must not hide the other parsers' findings.
    """
    try:
        return [dict(f) for f in parse(text)]
    except Exception as e:
        errors.append(f"{name}: {label} parser failed ({type(e).__name__}: {e})")
        return []


def _normalize(finding: dict, file_rank: int | None) -> dict:
    """Every contract key present; the file's rank when the finding names none."""
    for key in FINDING_KEYS:
        finding.setdefault(key, None)
    if file_rank is not None and finding["rank"] is None and not finding["ranks"]:
        finding["rank"] = file_rank
        finding["ranks"] = [file_rank]
    return finding


def explain_inputs(inputs: list[tuple[str, bytes]]) -> dict:
    """`{"findings": [...], "errors": [...]}` for (name, content) pairs.

    A name like `rank3.log` gives its findings rank 3 when the text itself
    names none. Unreadable inputs (empty, binary, compressed) add a line to
    "errors" and no findings.
    """
    findings: list[dict] = []
    errors: list[str] = []
    points: list[dict] = []
    for name, data in inputs:
        text, problem = decode_input(name, data)
        if text is None:
            errors.append(problem)
            continue
        # Frames drawn around a traceback or dump (rich, pasted panels) hide it from every reader.
        text = unbox(_SOURCE_LINE.sub("", text))
        file_rank = rank_from_name(name)
        try:
            parsed = parse_log(text, source=name)
        except Exception as e:  # noqa: BLE001 - one reader's bug on one input must not cost the others
            errors.append(f"{name}: log parser failed ({type(e).__name__}: {e})")
            parsed = ParsedLog()
        points += parsed.points
        hardware = _parse_safely("kernel_log", xid_findings, name, text, errors)
        stacks = _parse_safely("stacks", stack_findings, name, text, errors)
        if parsed.findings:
            # A log's own error lines already explain it; the traceback that
            # printed them only adds an uninformative "other" stack.
            stacks = [f for f in stacks if f.get("category") != "other"]
        # Hardware findings go first (an Xid often explains everything after
        # it), then the log's errors, then stacks.
        # An Xid's kernel log already accounts for the tasks it blocked or the process it killed.
        errors_read = [f for f in parsed.findings if not (hardware and f.get("kernel_event"))]
        batch = hardware + errors_read + stacks
        if all(f.get("category") == "other" for f in batch):
            # Nothing known explains it (or only as `other`): a hang the text describes in words,
            # else the area whose words it speaks (low), then the exception it ended on, if any.
            batch = (prose_hang(text) or cue_findings(text)) + (batch or unexplained_exception(text))
        elif {f.get("category") for f in batch} == {"child_failed"}:
            # A launcher reporting a failed worker beside the exception the worker raised: that
            # exception is the more specific cause, as `other` when no rule names it.
            said = [f["evidence"] or "" for f in batch]
            batch += [f for f in unexplained_exception(text, launcher=False)
                      if not any(f["evidence"] in s or s in f["evidence"] for s in said)]
        findings += [_normalize(f, file_rank) for f in batch]
    # The same error printed in several rank files is one finding with
    # several ranks; stack and Xid findings pass through as their parsers made them.
    return {"findings": mismatch_findings(points) + collapse_ranks(findings), "errors": errors}


def _line(label: str, value: object) -> str:
    """One indented "label value" row of a finding block."""
    return f"  {label:<9} {value}\n"


def _short(text: str) -> str:
    """Evidence on one line, cut to a screen width."""
    first = " ".join(str(text).split())
    return first if len(first) <= _EVIDENCE_CHARS else first[:_EVIDENCE_CHARS - 3] + "..."


def _facts(finding: dict) -> str:
    """The finding's extra facts (beyond the contract keys) as "key=value, ..."."""
    shown = []
    for key, value in finding.items():
        if key in FINDING_KEYS or value is None or value == [] or isinstance(value, dict):
            continue
        if isinstance(value, list) and any(isinstance(v, dict) for v in value):
            continue  # structured detail (e.g. `behind`) stays in the JSON output
        shown.append(f"{key}={value}")
    return _short(", ".join(shown))


def render_report(report: dict) -> str:
    """The human-readable report: one block per finding, then skipped inputs."""
    findings, errors = report["findings"], report.get("errors") or []
    if not findings:
        out = "no known failure signature found\n"
    else:
        out = f"{len(findings)} finding{'s' if len(findings) != 1 else ''}\n"
    for f in findings:
        out += f"\n{f['category']} ({f['kind']}, severity {f['severity']})\n"
        ranks = f.get("ranks") or ([f["rank"]] if f.get("rank") is not None else None)
        if ranks:
            out += _line("ranks:", ", ".join(str(r) for r in ranks))
        if f.get("op") is not None or f.get("seq") is not None:
            out += _line("op/seq:", f"{f.get('op') or '?'} / {f.get('seq') if f.get('seq') is not None else '?'}")
        if f.get("timeout_ms") is not None:
            out += _line("timeout:", f"{f['timeout_ms']} ms")
        if f.get("xid") is not None or f.get("pci") is not None:
            out += _line("gpu:", f"Xid {f.get('xid') if f.get('xid') is not None else '?'} at {f.get('pci') or '?'}")
        facts = _facts(f)
        if facts:
            out += _line("facts:", facts)
        if f.get("runbook"):
            out += _line("runbook:", f"trainwatch runbook {f['runbook']}")
        if f.get("evidence"):
            out += _line("evidence:", _short(f["evidence"]))
    for error in errors:
        out += f"\nskipped: {error}\n"
    return out
