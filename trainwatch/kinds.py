"""Every incident kind, declared once: what it is called, how bad it is, which
runbook it points to, what trainwatch does about it, whether it pages, what it
explains away, and when it is over.

The detectors (an incident's default severity and runbook), the engine (mutes
and resolution), the responder (capture, restart), the exporter (series that
start at 0), the job-wide aggregator (job-scope kinds), `diagnose`'s verdict
(runbooks, alert-only kinds) and the Prometheus alert rules with their promtool
tests (generated: `trainwatch dashboards`) all read this table: adding a kind
is one entry here and the detector that raises it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Response(enum.Enum):
    """What the sidecar does about an incident of a kind, beyond recording it."""

    ALERT = "alert"
    """Say it, record it, export it; the job keeps running."""
    CAPTURE = "capture"
    """Also capture every rank's stacks and give a verdict (no restart)."""
    RESTART = "restart"
    """Capture where it helps, emergency checkpoint, restart the worker group."""


class Alert(enum.Enum):
    """How an incident of a kind reaches a person through Prometheus: the
    alert rule's `severity` label, which Alertmanager routes."""

    PAGE = "critical"
    """Someone acts now: the job stopped, restarts, or trains on garbage."""
    TICKET = "warning"
    """Someone looks during working hours: the job trains on, maybe wastefully."""


class Resolution(enum.Enum):
    """When an open incident is over."""

    PROGRESS = "progress"
    """A fault that stops training (a hang, a crash, a lost node): over once the
    condition is no longer reported and the ranks it named made progress (a
    later step, or new processes after a restart)."""
    ABSENCE = "absence"
    """A condition of a job that keeps training (a straggler, a NaN streak):
    over once it has not been reported for the engine's hold time. The ranks
    stepping on is not the end of it."""


@dataclass(frozen=True, slots=True)
class KindSpec:
    """One incident kind."""

    name: str
    """The incident's `kind` (events.jsonl, metrics' `kind` label)."""
    severity: str
    """Its usual severity (info, low, medium, high, critical); a detector may say more or less for one incident."""
    runbook: str
    """Runbook id (`trainwatch runbook ID`)."""
    response: Response
    """What the sidecar does about it."""
    resolution: Resolution
    """When an open incident of this kind is over."""
    alert: Alert
    """Page or ticket: the `severity` label of the alert rule that fires while one is open."""
    mutes: frozenset = frozenset()
    """Kinds this one explains until training progresses again (one fault, one incident)."""
    capture: bool = False
    """Capture every rank's stacks and give a verdict when it opens."""
    job_scope: bool = False
    """Raised once for the whole job by the aggregator of a multi-node job."""
    in_process: bool = False
    """The fault leaves every rank process alive and responsive: recovering inside them (a re-formed
    process group, the staged state from memory) is tried before a process restart."""
    hardware: bool = False
    """Raised by the hardware monitor from the GPU's own reports (NVML, kernel log), not from the
    ranks' slots; the Xid table may rate one incident above or below `severity`."""
    restart_quiet: bool = False
    """Never judged while a worker group is being restarted: until the new workers start, the
    slots hold the stopped workers' last words (old steps, silent heartbeats), which say nothing
    about the job's progress."""
    alert_rule: str = ""
    """The alert rule that pages it from its own series instead of the open incident (a GPU fault
    pages on its per-GPU error counters, which name the GPU and the Xid); empty: a rule on
    `trainwatch_incident_open` pages it."""


_P, _A = Resolution.PROGRESS, Resolution.ABSENCE
_PAGE, _TICKET = Alert.PAGE, Alert.TICKET
KINDS: dict[str, KindSpec] = {k.name: k for k in (
    KindSpec("crash", "critical", "crash", Response.RESTART, _P, _PAGE,
             mutes=frozenset({"hang", "collective_mismatch"})),
    KindSpec("collective_mismatch", "high", "collective-mismatch", Response.RESTART, _P, _PAGE,
             mutes=frozenset({"hang"}), capture=True, job_scope=True, in_process=True, restart_quiet=True),
    # A rank stuck outside its collectives leaves its peers parked at other
    # operations: that is the same stall, not a second fault.
    KindSpec("hang", "high", "hang", Response.RESTART, _P, _PAGE, mutes=frozenset({"collective_mismatch"}),
             capture=True, job_scope=True, restart_quiet=True),
    KindSpec("node_lost", "critical", "node-lost", Response.RESTART, _P, _PAGE, job_scope=True),
    KindSpec("xid", "high", "gpu-xid", Response.RESTART, _P, _PAGE, hardware=True,
             alert_rule="TrainwatchGpuXidCritical"),
    KindSpec("ecc", "critical", "gpu-ecc", Response.RESTART, _P, _PAGE, hardware=True,
             alert_rule="TrainwatchGpuEccUncorrected"),
    KindSpec("straggler", "medium", "straggler", Response.ALERT, _A, _TICKET, job_scope=True, restart_quiet=True),
    # A NaN loss is the one training-health fault that pages: every step from
    # here on is wasted, and the checkpoint to return to ages.
    KindSpec("loss_nan", "critical", "loss-nan", Response.ALERT, _A, _PAGE),
    KindSpec("loss_spike", "medium", "loss-spike", Response.ALERT, _A, _TICKET),
    KindSpec("grad_explosion", "high", "grad-explosion", Response.ALERT, _A, _TICKET),
    KindSpec("dead_grad", "high", "dead-grad", Response.ALERT, _A, _TICKET),
    # Every step skipped while the fp16 scale halves: the gradients read zero
    # for as long as it lasts; that is the collapse, not a second fault.
    KindSpec("loss_scale_collapse", "medium", "loss-scale-collapse", Response.ALERT, _A, _TICKET,
             mutes=frozenset({"vanishing_grad"})),
    KindSpec("vanishing_grad", "medium", "vanishing-grad", Response.ALERT, _A, _TICKET),
    KindSpec("lr_stuck", "medium", "lr-stuck", Response.ALERT, _A, _TICKET),
    KindSpec("loss_trend", "medium", "loss-trend", Response.ALERT, _A, _TICKET),
    KindSpec("step_time_spike", "medium", "step-time-spike", Response.ALERT, _A, _TICKET),
)}
"""Every incident kind. Order: causes before their consequences (a crash
before the hang it causes), so the engine mutes what a cause explains."""

MUTES = {k.name: k.mutes for k in KINDS.values() if k.mutes and k.resolution is Resolution.PROGRESS}
"""Kind -> the kinds an incident of it explains until training progresses again."""
OPEN_MUTES = {k.name: k.mutes for k in KINDS.values() if k.mutes and k.resolution is Resolution.ABSENCE}
"""Kind -> the kinds it explains for as long as an incident of it is open
(its condition persists while training goes on)."""
CAPTURE_KINDS = frozenset(k.name for k in KINDS.values() if k.capture)
RESTART_KINDS = frozenset(k.name for k in KINDS.values() if k.response is Response.RESTART)
IN_PROCESS_KINDS = frozenset(k.name for k in KINDS.values() if k.in_process)
ALERT_ONLY_KINDS = tuple(k.name for k in KINDS.values() if k.response is Response.ALERT)
JOB_SCOPE_KINDS = tuple(k.name for k in KINDS.values() if k.job_scope)
HARDWARE_KINDS = frozenset(k.name for k in KINDS.values() if k.hardware)
PAGE_KINDS = tuple(k.name for k in KINDS.values() if k.alert is Alert.PAGE)
"""Kinds that page: the faults that stop, restart or spoil a job, newest first in a report's verdict."""
RESTART_QUIET = frozenset(k.name for k in KINDS.values() if k.restart_quiet)
"""Kinds never judged while a worker group is being restarted (KindSpec.restart_quiet)."""


def spec(kind: str) -> KindSpec | None:
    """The declaration of `kind`; None for a record that is not an incident (a restart, an action)."""
    return KINDS.get(kind)


def runbook_of(kind: str, default: str = "hang") -> str:
    k = KINDS.get(kind)
    return k.runbook if k is not None else default
