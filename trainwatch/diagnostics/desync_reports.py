"""Desync reports: the messages in which torch itself names ranks that disagree.

Two message forms say which ranks left the collective schedule, unlike a
timeout, which only says that one rank waited:

- ProcessGroupWrapper (TORCH_DISTRIBUTED_DEBUG=DETAIL) compares each
  collective's fingerprint across ranks before running it: "Detected mismatch
  between collectives on ranks. Rank 1 is running collective:
  CollectiveFingerPrint(SequenceNumber=485, OpType=ALLREDUCE, ...), but Rank 0
  is running collective: CollectiveFingerPrint(SequenceNumber=485,
  OpType=BROADCAST, ...)". `fingerprint_facts` reads one such line.
- ProcessGroupNCCL's desync report (TORCH_NCCL_DESYNC_DEBUG=1), printed over
  several lines after a timeout: "[0] Timeout at collective: ALLREDUCE, #2",
  then "[1] joined but didn't finish collective #2 (count from 1)", "[2, 3]
  finished collective #2, but didn't join collective #3 (count from 1)" or
  "ranks [5] are the lagging ranks that caused this timeout". `desync_reports`
  reads those blocks.

Both become collective_mismatch findings whose `ranks` are the ranks the
message names and whose `per_rank` list keeps what it says of each. Pure
functions of the text; nothing is inferred that the message does not state.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from trainwatch.diagnostics.findings import error_finding

# A fingerprint nests parentheses three deep: CollectiveFingerPrint(... TensorOptions(dtype=float (default) ...)).
# A log cut mid-fingerprint still names its op, so the outer closing parenthesis is optional.
_INSIDE = r"(?:[^()]|\((?:[^()]|\([^()]*\))*\))*"
_FINGERPRINT = r"(?:CollectiveFingerPrint\s*\(" + _INSIDE + r"\)?|[A-Za-z_]\w*)"
FINGERPRINT_MISMATCH = re.compile(
    r"Detected\s*mismatch\s*between\s*collectives\s*on\s*ranks\.?\s*"
    r"Rank\s*(?P<r1>\d{1,9})\s*is\s*running\s*(?:inconsistent\s*)?(?:collective\s*:?\s*)?(?P<fp1>" + _FINGERPRINT + ")"
    r"(?:\s*,?\s*but\s*Rank\s*(?P<r2>\d{1,9})\s*is\s*running\s*(?:collective\s*:?\s*)?(?P<fp2>" + _FINGERPRINT + "))?"
)
_SEQ = re.compile(r"SequenceNumber\s*=\s*(\d{1,18})(?!\d)")
_OP = re.compile(r"OpType\s*=\s*(\w+)")

_RANK_LIST = r"(?P<ranks>\d{1,9}(?:\s*,\s*\d{1,9})*)(?!\d)"
_TIMEOUT_AT = re.compile(r"\[(?P<me>\d{1,9})\]\s*Timeout at collective:\s*(?P<op>[^,\s]+)\s*,\s*"
                         r"#(?P<seq>\d{1,18})(?!\d)")
_JOINED = re.compile(r"\[" + _RANK_LIST + r"\]\s*joined but didn't finish collective #(?P<seq>\d{1,18})(?!\d)")
_FINISHED = re.compile(r"\[" + _RANK_LIST + r"\]\s*finished collective #(?P<seq>\d{1,18}),\s*"
                       r"but didn't join collective #(?P<next>\d{1,18})")
_NEVER_JOINED = re.compile(r"ranks\s*\[" + _RANK_LIST + r"\]\s*are the lagging ranks that caused this timeout")


def _fingerprint(rank: str, text: str | None) -> dict:
    """{rank, seq, op} of one side of a fingerprint mismatch; absent facts are None."""
    side: dict = {"rank": int(rank), "seq": None, "op": None}
    if not text:
        return side
    seq, op = _SEQ.search(text), _OP.search(text)
    side["seq"] = int(seq.group(1)) if seq else None
    if op:
        side["op"] = op.group(1)
    elif not text.startswith("CollectiveFingerPrint"):
        side["op"] = text  # older torch named only the op: "... but Rank 0 is running collective: REDUCE"
    return side


def fingerprint_facts(m: re.Match[str]) -> dict:
    """Facts of a ProcessGroupWrapper fingerprint mismatch, the same whichever rank printed it:
    every named rank's op and sequence number (`per_rank`, by rank), and the op and
    sequence number when the ranks agree on them."""
    sides = [_fingerprint(m.group("r1"), m.group("fp1"))]
    if m.group("r2") is not None and int(m.group("r2")) != sides[0]["rank"]:
        sides.append(_fingerprint(m.group("r2"), m.group("fp2")))
    sides.sort(key=lambda side: side["rank"])
    ops = {side["op"] for side in sides}
    seqs = {side["seq"] for side in sides}
    ranks = [side["rank"] for side in sides]
    return {
        "op": ops.pop() if len(ops) == 1 else None,
        "seq": seqs.pop() if len(seqs) == 1 else None,
        "ranks": ranks,
        "rank": ranks[0] if len(ranks) == 1 else None,
        "per_rank": sides,
        "mismatch": " vs ".join(
            f"rank {side['rank']} {side['op'] or '?'} #{side['seq'] if side['seq'] is not None else '?'}"
            for side in sides),
    }


def _ranks(text: str) -> list[int]:
    return [int(r) for r in re.findall(r"\d+", text)]


def desync_reports(lines: list[str], line_rank: Callable[[str], int | None]) -> list[dict]:
    """One collective_mismatch finding per NCCL desync report that names lagging ranks.

    A report starts at its "Timeout at collective" line; the lines naming
    lagging ranks that follow (from the same rank, when lines carry a rank
    prefix) belong to it. A report that names no rank adds nothing.
    """
    reports: list[dict] = []
    open_report: dict[int | None, dict] = {}  # the report each printing rank is in
    for line in lines:
        if "collective" not in line and "lagging" not in line:
            continue
        printer = line_rank(line)
        m = _TIMEOUT_AT.search(line)
        if m:
            report = error_finding("collective_mismatch", line[m.start():].strip())
            report.update(op=m.group("op"), seq=int(m.group("seq")), per_rank=[], _role="finding",
                          reported_by=printer if printer is not None else int(m.group("me")))
            open_report[printer] = report
            reports.append(report)
            continue
        found = [(m, "joined, not finished") for m in _JOINED.finditer(line)]
        found += [(m, "finished, next not joined") for m in _FINISHED.finditer(line)]
        found += [(m, "never joined") for m in _NEVER_JOINED.finditer(line)]
        if not found:
            continue
        said = line[min(m.start() for m, _ in found):].strip()
        report = open_report.get(printer)
        if report is None:
            report = error_finding("collective_mismatch", said)
            report.update(per_rank=[], _role="finding", reported_by=printer)
            open_report[printer] = report
            reports.append(report)
        elif not report["per_rank"]:
            report["evidence"] += "; " + said  # the first line that names ranks
        for m, state in found:
            seq = int(m.group("seq")) if "seq" in m.groupdict() else None
            report["per_rank"] += [{"rank": r, "seq": seq, "state": state} for r in _ranks(m.group("ranks"))]
            if report["seq"] is None:
                report["seq"] = seq
    out = []
    for report in reports:
        ranks = sorted({side["rank"] for side in report["per_rank"]})
        if ranks:
            report.update(ranks=ranks, rank=ranks[0] if len(ranks) == 1 else None)
            out.append(report)
    return out
