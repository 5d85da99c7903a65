"""Grouping stacks: ranks that wait in the same place, the odd one out, explain findings.

`group_stacks` puts ranks whose interesting thread (chosen by the hang catalog)
waits in the same place together, so a 64-rank hang reads as "63 ranks in
all_reduce, rank 17 in the data loader". `odd_one_out` names the small group
when one group clearly dominates. `stack_findings` is the `trainwatch explain`
view of a stack text.

Everything here is pure: processes in, frozen dataclasses or plain dicts out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from trainwatch.diagnostics import catalog
from trainwatch.diagnostics.collective_ops import collective_op
from trainwatch.diagnostics.stack_parsers import parse_stack_text
from trainwatch.diagnostics.stacks import ProcessStack, ThreadStack, is_address


@dataclass(frozen=True, slots=True)
class StackGroup:
    """Processes whose interesting thread waits in the same place."""

    ranks: tuple[int, ...]
    """Keys (ranks, or pids when ranks are unknown) of the processes in the group, sorted."""
    frames: tuple[str, ...]
    """Top frames of the representative stack, innermost first, as `func (file:line)`."""
    category: str
    """Stack category (see catalog.CATEGORIES); `other` when nothing matched."""
    pattern_id: str | None
    """Catalog pattern that matched the representative thread; None if none did."""
    thread: str | None
    """Name (or id) of the representative thread that was chosen as interesting."""
    error: str | None = None
    """For processes that could not be sampled: the reason; None otherwise."""
    evidence: str | None = None
    """The frame that matched the pattern (or the innermost frame), as `func (file:line)`."""
    op: str | None = None
    """Collective op the stack shows (`all_reduce`, `barrier`, ...); None if none."""
    exception: str | None = None
    """Exception line that ended the representative traceback; None for live samples."""


# ---------------------------------------------------------------------------
# Signatures and grouping

# Frames outside the user's program: launchers and thread bootstrap. Dropping them
# from the outer end lets ranks started by torchrun, mp.spawn or a plain `python`
# group together.
_LAUNCHER = re.compile(
    r"(?:^|/)(?:runpy\.py|<frozen runpy>|threading\.py|multiprocessing/|"
    r"torch/multiprocessing/spawn\.py|torch/distributed/elastic/multiprocessing/)"
)
_NATIVE_ENTRY = re.compile(r"^(?:_start|__libc_start_main\w*|__libc_start_call_main|Py_BytesMain|Py_RunMain|"
                           r"main|start_thread|clone3?|__clone3?)$")

TOP_FRAMES = 12
"""Frames shown per stack group: enough to see the call site above library internals."""


def basename(path: str) -> str:
    """Last path component; used by signatures so install prefixes never split groups."""
    return path.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]


def short_function(function: str) -> str:
    """`Thread.run` -> `run`: py-spy >= 0.4 qualifies names, older versions do not."""
    if "::" in function or "(" in function:
        return function  # C++ symbols keep their namespaces
    return function.rsplit(".", 1)[-1]


def signature(thread: ThreadStack) -> tuple[tuple[str, str], ...]:
    """What makes two stacks "the same place": (function, file basename) pairs, innermost first.

    Line numbers and native addresses are ignored (ranks in different loop
    iterations, or different builds, still match) and launcher frames below the
    user's entry point are collapsed.
    """
    frames = [f for f in thread.frames if not is_address(f)]
    while frames and (_LAUNCHER.search(frames[-1].file) or _NATIVE_ENTRY.match(frames[-1].function)):
        frames.pop()
    return tuple((short_function(f.function), basename(f.file)) for f in frames)


STOPPED_ERROR = "process is stopped"
"""How a capture reports a rank in state T (SIGSTOP, job control, a debugger):
its group's category is `stopped`."""


def group_stacks(stacks: Mapping[int, ProcessStack]) -> list[StackGroup]:
    """Group processes (keyed by rank, or pid) by where their interesting thread waits.

    Largest group first; ties go to the group with the lowest key. Processes
    that could not be sampled form groups of their own (category `other`), one
    per distinct error.
    """
    buckets: dict[tuple, list[tuple[int, ProcessStack, ThreadStack | None, Any]]] = {}
    for key in sorted(stacks):
        proc = stacks[key]
        if proc.error:
            buckets.setdefault(("error", proc.error), []).append((key, proc, None, None))
            continue
        thread, match = catalog.interesting_thread(proc)
        sig = signature(thread) if thread is not None else ()
        buckets.setdefault(("stack", sig), []).append((key, proc, thread, match))

    groups = []
    for (kind, _), members in buckets.items():
        keys = tuple(m[0] for m in members)
        _, proc, thread, match = members[0]
        if kind == "error":
            category = "stopped" if proc.error.startswith(STOPPED_ERROR) else "other"
            groups.append(StackGroup(keys, (), category, None, None, error=proc.error, evidence=proc.error))
            continue
        frames = tuple(f.describe() for f in thread.frames if not is_address(f))[:TOP_FRAMES] if thread else ()
        if match is not None:
            evidence = match.frame.describe()
        else:
            evidence = frames[0] if frames else None
        groups.append(StackGroup(
            ranks=keys,
            frames=frames,
            category=match.pattern.category if match else "other",
            pattern_id=match.pattern.id if match else None,
            thread=(thread.thread_name or thread.thread_id) if thread else None,
            evidence=evidence,
            # A rank blocked on the device is in no collective, whatever queued the kernels it waits for.
            op=collective_op(thread) if thread and (match is None or match.pattern.category != "cuda_sync") else None,
            exception=thread.exception if thread else None,
        ))
    groups.sort(key=lambda g: (-len(g.ranks), g.ranks))
    return groups


def odd_one_out(groups: Iterable[StackGroup]) -> StackGroup | None:
    """The smallest group when one group clearly dominates; None when nothing stands out.

    "Clearly dominates": the largest group holds more than half of all
    processes and is strictly larger than every other group. Among several
    equally small groups the one with the lowest key is returned, so the
    answer is deterministic.
    """
    groups = sorted(groups, key=lambda g: (-len(g.ranks), g.ranks))
    if len(groups) < 2:
        return None
    total = sum(len(g.ranks) for g in groups)
    largest, rest = groups[0], groups[1:]
    if 2 * len(largest.ranks) <= total or len(largest.ranks) == len(rest[0].ranks):
        return None
    return min(rest, key=lambda g: (len(g.ranks), g.ranks))


# ---------------------------------------------------------------------------
# explain: stack findings

# Hang categories (ranks blocked on peers or on the device; the whole job is
# stalled) are "high". Data, checkpoint and compile waits usually mean one slow
# node or filesystem and often clear on their own: "medium". A stack that
# matched nothing tells the reader little: "info". A process that could not be
# sampled at all is itself suspicious: "medium".
SEVERITY = {
    "collective_wait": "high",
    "moe_all_to_all": "high",
    "barrier": "high",
    "gc_collect": "high",
    "cuda_sync": "high",
    "dataloader": "medium",
    "checkpoint_io": "medium",
    "compile_lock": "medium",
    "other": "info",
}
UNSAMPLED_SEVERITY = "medium"
FALLBACK_RUNBOOK = "hang"
"""Runbook for live stacks that matched no pattern: the generic hang checklist."""
CRASH_RUNBOOK = "crash"
"""Runbook for tracebacks that matched no pattern and end in an exception: a crash, not a hang."""


def stack_findings(text: str) -> list[dict[str, Any]]:
    """`trainwatch explain` findings for a stack text: one per category of processes.

    Keys follow DESIGN.md's `explain --json` shape. `rank` is set when the
    category holds exactly one process whose rank the text names; `ranks` lists
    the ranks in the category (pids instead when the text has several processes
    but names no ranks); absent facts are None.
    """
    processes = parse_stack_text(text)
    if not processes:
        return []
    keyed, key_kind = _key_processes(processes)
    by_category: dict[str, list[StackGroup]] = {}
    for group in group_stacks(keyed):
        by_category.setdefault(group.category if not group.error else "unsampled", []).append(group)

    findings = []
    for category, groups in by_category.items():
        lead = groups[0]
        keys = sorted(k for g in groups for k in g.ranks)
        ranks: list[int] | None = None
        if key_kind == "rank" or (key_kind == "pid" and len(processes) > 1):
            ranks = keys
        pattern = catalog.pattern_by_id(lead.pattern_id) if lead.pattern_id else None
        findings.append({
            "kind": "stack",
            "category": "other" if category == "unsampled" else category,
            "op": lead.op,
            "xid": None,
            "pci": None,
            "seq": None,
            "timeout_ms": None,
            "rank": keys[0] if key_kind == "rank" and len(keys) == 1 else None,
            "ranks": ranks,
            "severity": UNSAMPLED_SEVERITY if category == "unsampled" else SEVERITY.get(category, "info"),
            "runbook": pattern.runbook if pattern else (CRASH_RUNBOOK if lead.exception else FALLBACK_RUNBOOK),
            "evidence": lead.evidence or _fallback_evidence(lead, text),
        })
    return findings


def _fallback_evidence(group: StackGroup, text: str) -> str:
    """Evidence for a group no frame revealed: its innermost frames, else the dump's first line,
    so that every finding still shows what it was read from."""
    if group.frames:
        return " <- ".join(group.frames[:3])
    if group.error or group.exception:
        return str(group.error or group.exception)
    return next((line.strip() for line in text.splitlines() if line.strip() and not line.startswith("# source:")),
                "")[:240]


def _key_processes(processes: list[ProcessStack]) -> tuple[dict[int, ProcessStack], str]:
    """Key processes by rank when every one has a rank, else by pid, else by position."""
    if all(p.rank is not None for p in processes) and len({p.rank for p in processes}) == len(processes):
        return {p.rank: p for p in processes}, "rank"  # type: ignore[misc]
    if all(p.pid is not None for p in processes) and len({p.pid for p in processes}) == len(processes):
        return {p.pid: p for p in processes}, "pid"  # type: ignore[misc]
    return dict(enumerate(processes)), "index"
