"""Findings: the `explain --json` shape every parser reports in.

A finding is a plain dict that carries FINDING_KEYS, in this order, then any
extra facts its parser read (`pending_work`, `exit_code`, ...). The log, stack
and kernel-log parsers all produce it; `trainwatch explain` merges and prints
them. A fact the input does not state stays None.

Log errors (kind "error") take their severity and runbook from
ERROR_CATEGORIES, so one table says how bad each error is and what to read.
"""

from __future__ import annotations

from trainwatch import kinds

# Keys every finding carries, in this order (the explain contract).
FINDING_KEYS = (
    "kind", "category", "op", "xid", "pci", "seq", "timeout_ms",
    "rank", "ranks", "severity", "runbook", "evidence",
)

# category -> (severity, runbook id). Severities use the project scale
# (xid.SEVERITY_ORDER): "high" = the whole job stalls or aborts, "medium" =
# one process failed and the GPU is fine, "critical" = GPU memory cannot be
# trusted and the node needs attention before a restart helps.
def _as_kind(kind: str) -> tuple[str, str]:
    """A category that is an incident kind: the kind's own severity and runbook (kinds.py)."""
    return kinds.KINDS[kind].severity, kinds.KINDS[kind].runbook


ERROR_CATEGORIES: dict[str, tuple[str, str]] = {
    "collective_timeout": ("high", "collective-timeout"),
    "collective_mismatch": _as_kind("collective_mismatch"),
    "heartbeat_timeout": ("high", "heartbeat-timeout"),
    "nccl_error": ("high", "nccl-error"),
    "cuda_error": ("medium", "cuda-error"),
    "illegal_memory_access": ("medium", "illegal-memory-access"),
    "ecc": _as_kind("ecc"),
    "oom": ("medium", "oom"),
    "child_failed": ("medium", "child-failed"),
    "dataloader_worker_killed": ("medium", "dataloader-worker-killed"),
    # A data loader's own time-out: the loop waited longer for a batch than it allows.
    "dataloader": ("medium", "dataloader-stall"),
    # Loss health read from framework log lines (loss_health.py); the same incident
    # kinds and runbooks as the live detectors. A collapse below scale 1 is "high".
    "loss_nan": _as_kind("loss_nan"),
    "loss_scale_collapse": _as_kind("loss_scale_collapse"),
    # Start-up waits a log states: a rank waiting at the store barrier for peers that have not
    # arrived, a build of a C++/CUDA extension blocked by another's (or a dead one's) lock file.
    "barrier": ("medium", "barrier-hang"),
    "compile_lock": ("medium", "cpp-extension-lock"),
    # A Python exception none of the above names, read only when nothing else explains the text.
    "other": ("low", "python-exception"),
}

NON_FACT_KEYS = frozenset({"kind", "evidence", "severity", "runbook", "rank", "ranks", "_role"})
"""Keys that describe a finding rather than state a fact about the failure.
`_role` is the log parser's internal mark (finding, support or hint) while it merges lines."""


def error_finding(category: str, evidence: str) -> dict:
    """A finding of kind "error" with every contract key, facts unknown."""
    severity, runbook = ERROR_CATEGORIES[category]
    finding = dict.fromkeys(FINDING_KEYS)
    finding.update(kind="error", category=category, severity=severity, runbook=runbook, evidence=evidence)
    return finding


def in_contract_order(finding: dict) -> dict:
    """Contract keys first, then extra facts; internal keys removed."""
    finding.pop("_role", None)
    ordered = {key: finding.get(key) for key in FINDING_KEYS}
    ordered.update((k, v) for k, v in finding.items() if k not in ordered)
    return ordered
