"""The one XID table: NVIDIA driver error code -> meaning, severity, action.

The NVIDIA driver reports GPU faults as numbered "Xid" events in the kernel
log (and through NVML). A number alone says little to someone on call, so this
table turns it into what a training job cares about: how bad it is, whose
fault it probably is, and what to do next.

Severity is graded by the impact on a running training job:

  info      nothing to do; the line only explains other lines
  low       worth recording; the job normally keeps running
  medium    one process or the job failed; the GPU itself is fine
  high      the GPU must be reset (or the link repaired) before reuse
  critical  the GPU is gone or its memory is untrustworthy; node-level action

Actions, from cheapest to most expensive:

  check_application  the code running on the GPU is the likely culprit
  restart_job        restart the job; nothing is wrong with the hardware
  reset_gpu          reset the GPU (or reboot, where reset is not possible)
  reboot_node        reboot the machine
  drain_node         take the machine out of service for inspection/repair

Meanings paraphrase NVIDIA's public Xid catalogue and GPU debug guidelines.
Codes not listed here still resolve (see ``lookup``): an unknown Xid is a
fact worth reporting, never a reason to crash.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

SEVERITY_ORDER: tuple[str, ...] = ("info", "low", "medium", "high", "critical")
"""Severities from least to most severe; index = rank."""

ACTIONS: tuple[str, ...] = (
    "check_application",
    "restart_job",
    "reset_gpu",
    "reboot_node",
    "drain_node",
)
"""Every action a table row may name, cheapest first."""

ECC_CODES: frozenset[int] = frozenset({48, 63, 64, 92, 94, 95, 140, 171, 172})
"""Codes about GPU memory ECC errors; they get the ECC runbook, not the generic one."""
ECC_RUNBOOK = "gpu-ecc"
"""Runbook for an Xid in ECC_CODES."""
XID_RUNBOOK = "gpu-xid"
"""Runbook for every other Xid and for NVSwitch SXids."""


@dataclass(frozen=True, slots=True)
class XidInfo:
    """What one Xid code means for a training job."""

    code: int
    """The Xid number as printed by the driver."""
    name: str
    """Short name (close to NVIDIA's mnemonic) for dashboards and logs."""
    meaning: str
    """One or two sentences, in plain words, of what happened."""
    severity: str
    """One of SEVERITY_ORDER."""
    action: str
    """One of ACTIONS: what an operator should do first."""
    app_caused: bool = False
    """True when the usual cause is a bug in the application, not the hardware."""
    consequence: bool = False
    """True when the event is a follow-on of another fault, so never a root cause."""


def _x(code: int, name: str, severity: str, action: str, meaning: str, *,
       app: bool = False, follows: bool = False) -> XidInfo:
    return XidInfo(code, name, meaning, severity, action, app, follows)


_ROWS: tuple[XidInfo, ...] = (
    _x(8, "GPU stopped processing", "medium", "restart_job",
       "A channel stopped making progress and the driver timed it out; the "
       "work on that channel is lost."),
    _x(13, "Graphics engine exception", "medium", "check_application",
       "A kernel faulted on the GPU: usually an out-of-bounds access, an "
       "illegal instruction or a misaligned address in application code.",
       app=True),
    _x(31, "GPU memory page fault", "medium", "check_application",
       "The GPU's MMU saw an access to an address that is not mapped; almost "
       "always an application bug (illegal address), rarely driver or hardware.",
       app=True),
    _x(32, "Corrupted push buffer stream", "medium", "restart_job",
       "The DMA engine that feeds commands over PCIe reported corrupted "
       "input; points at PCIe link quality more than at the application."),
    _x(38, "Driver firmware error", "low", "restart_job",
       "A firmware watchdog on the GPU's context-switch engine fired; usually "
       "transient, investigate if it repeats."),
    _x(43, "GPU stopped processing (application fault)", "low",
       "check_application",
       "An application hit a fault and its GPU channel was torn down; the GPU "
       "itself stays healthy.", app=True),
    _x(45, "Preemptive cleanup", "info", "restart_job",
       "The driver killed the GPU work of a process that was ending or was "
       "hit by an earlier error; it follows another Xid (or a Ctrl-C/kill).",
       follows=True),
    _x(46, "GPU stopped processing (timeout)", "high", "reset_gpu",
       "The GPU stopped responding to work and timed out; it needs a reset."),
    _x(48, "Double-bit ECC error", "critical", "reset_gpu",
       "An uncorrectable (double-bit) error was found in GPU memory; data the "
       "job read may be wrong, and the GPU needs a reset or the node a reboot."),
    _x(56, "Display engine error", "low", "restart_job",
       "The display engine reported an error; irrelevant to compute unless "
       "it repeats alongside other faults."),
    _x(57, "Video memory interface error", "high", "reset_gpu",
       "Programming the video memory interface (link training) failed; a "
       "hardware-side fault in the memory path."),
    _x(61, "Internal micro-controller breakpoint", "medium", "reset_gpu",
       "An on-GPU micro-controller hit a breakpoint or warning; reset the GPU "
       "if work stalls."),
    _x(62, "Internal micro-controller halt", "high", "reset_gpu",
       "An on-GPU micro-controller halted; the GPU needs a reset."),
    _x(63, "Row remapping / page retirement event", "low", "reset_gpu",
       "The GPU recorded a memory row (or page) to be replaced after an ECC "
       "error; the repair takes effect at the next GPU reset."),
    _x(64, "Row remapping failure", "critical", "drain_node",
       "The GPU could not remap a failing memory row (spare rows exhausted or "
       "remap failed); the memory is degrading and the GPU is an RMA candidate."),
    _x(68, "Video decoder exception", "medium", "restart_job",
       "The NVDEC video decoder engine raised an exception."),
    _x(69, "Graphics engine class error", "medium", "check_application",
       "The graphics engine rejected a command class or method; usually a "
       "software problem.", app=True),
    _x(74, "NVLink error", "high", "reset_gpu",
       "A problem on an NVLink connection to another GPU or NVSwitch; the link "
       "or the device at its far end is faulty. Needs a GPU reset or reboot."),
    _x(79, "GPU has fallen off the bus", "critical", "reboot_node",
       "The driver can no longer reach the GPU over PCIe (link down, power or "
       "hardware failure); only a node reboot brings it back."),
    _x(92, "High single-bit ECC error rate", "low", "reset_gpu",
       "Corrected memory errors are arriving unusually fast; the memory is "
       "degrading. Watch it and reset the GPU at a convenient time."),
    _x(94, "Contained ECC error", "high", "restart_job",
       "An uncorrectable memory error was contained to one application, which "
       "was stopped; other work is unaffected. Reset the GPU when convenient."),
    _x(95, "Uncontained ECC error", "critical", "reset_gpu",
       "An uncorrectable memory error could not be contained and may have hit "
       "every process on the GPU; the GPU must be reset before reuse."),
    _x(109, "Context switch timeout", "high", "reset_gpu",
       "The GPU failed to switch between contexts in time; reset the GPU."),
    _x(110, "Security fault", "critical", "drain_node",
       "The GPU's security engine faulted; rare outside hardware failure. Cold "
       "reset, then inspect the hardware if it repeats."),
    _x(119, "GSP RPC timeout", "high", "reset_gpu",
       "The GPU System Processor (firmware co-processor) did not answer a "
       "driver request in time; the GPU usually needs a reset (or a power cycle)."),
    _x(120, "GSP error", "high", "reset_gpu",
       "Code running on the GPU System Processor failed; reset the GPU and "
       "check the driver version if it repeats."),
    _x(121, "C2C link corrected errors", "low", "reset_gpu",
       "Corrected errors on the chip-to-chip link to a Grace CPU; no impact "
       "now, reset at a service window to retrain the link."),
    _x(122, "SPI PMU RPC read failure", "medium", "reset_gpu",
       "Reading the GPU's SPI flash through its power micro-controller failed."),
    _x(123, "SPI PMU RPC write failure", "medium", "reset_gpu",
       "Writing the GPU's SPI flash through its power micro-controller failed."),
    _x(136, "Link training failed", "high", "reset_gpu",
       "A link failed to train; check link signal integrity after a reset."),
    _x(137, "NVLink privilege error", "medium", "check_application",
       "An illegal peer-to-peer access over NVLink was blocked by the remote "
       "MMU; usually an application bug.", app=True),
    _x(138, "DLA engine error", "low", "restart_job",
       "The deep-learning accelerator engine reported an error."),
    _x(139, "Optical flow engine error", "medium", "restart_job",
       "The second optical flow accelerator raised an exception."),
    _x(140, "Unrecovered ECC error", "critical", "reset_gpu",
       "Uncorrectable memory errors arrived in a way that stopped the driver "
       "from retiring the bad memory; reset the GPU, replace it if it repeats."),
    _x(141, "CUDA fast path error", "low", "restart_job",
       "An error on the CUDA fast submission path."),
    _x(142, "Video encoder error", "low", "restart_job",
       "The fourth NVENC video encoder raised an exception."),
    _x(143, "GPU initialization error", "high", "reset_gpu",
       "The GPU failed to initialize; reset it, inspect the hardware if the "
       "failure persists."),
    _x(144, "NVLink SAW error", "high", "reset_gpu",
       "An NVLink error in the SAW unit; fatal forms need a GPU reset and may "
       "come with memory errors on this GPU."),
    _x(145, "NVLink RLW error", "high", "reset_gpu",
       "An NVLink error in the RLW unit; fatal forms need a GPU reset and kill "
       "the GPU work that used the link."),
    _x(146, "NVLink TLW error", "high", "reset_gpu",
       "An NVLink error in the TLW unit; fatal forms need a GPU reset."),
    _x(147, "NVLink TREX error", "medium", "reset_gpu",
       "An NVLink error in the TREX unit; usually non-fatal."),
    _x(148, "NVLink power control error", "medium", "reset_gpu",
       "An NVLink power-control error; usually non-fatal."),
    _x(149, "NVLink NETIR error", "high", "reset_gpu",
       "A fatal NVLink network-interface (NETIR) error or link-down event; "
       "traffic over the link may be lost, reset the GPU."),
    _x(150, "NVLink MSE error", "high", "reset_gpu",
       "An error in the NVLink management engine; reset the GPU."),
    _x(154, "GPU recovery action changed", "info", "reset_gpu",
       "Summarizes the recovery that other Xids need (none, drain, GPU reset "
       "or node reboot); read its text, it explains another fault.",
       follows=True),
    _x(155, "NVLink software-defined error", "medium", "reset_gpu",
       "An NVLink went down on purpose (flagged intentional, e.g. sleep); "
       "reset the GPU to bring the link back."),
    _x(158, "GPU fatal timeout", "high", "reset_gpu",
       "The GPU hit a fatal timeout; it needs a reset."),
    _x(171, "Uncorrectable DRAM error", "critical", "reset_gpu",
       "Detail for a double-bit error: the uncorrectable error is in DRAM."),
    _x(172, "Uncorrectable SRAM error", "critical", "reset_gpu",
       "Detail for a double-bit error: the uncorrectable error is in on-chip SRAM."),
)

XID_TABLE: dict[int, XidInfo] = {row.code: row for row in _ROWS}
"""The one table, keyed by Xid code."""


def lookup(code: int) -> XidInfo:
    """Return the table row for ``code``; unknown codes get a medium 'unknown Xid' row."""
    info = XID_TABLE.get(code)
    if info is not None:
        return info
    # An unknown code is still a GPU fault report; medium keeps it visible
    # without claiming the GPU is lost.
    return XidInfo(code, "unknown Xid",
                   f"Xid {code} is not in trainwatch's table; see NVIDIA's Xid catalogue.",
                   "medium", "restart_job")


# How a driver line states its own fatality: "Nonfatal", "Non-fatal", "non fatal", "not fatal"
# (the unit recovered), or "Fatal", "Uncorrectable", "Uncorrected" (it did not). The negative
# forms are searched first: "Nonfatal" contains "fatal" and "Uncorrectable" "correctable".
# Letters only bound the words: driver mnemonics glue them with underscores ("NVLINK_FATAL").
_NONFATAL_WORDING = re.compile(r"(?i)(?<![a-z])(?:non[\s_-]?fatal|not\s+fatal)(?![a-z])")
_FATAL_WORDING = re.compile(r"(?i)(?<![a-z])(?:fatal|uncorrect(?:able|ed))(?![a-z])")
STATED_NONFATAL_SEVERITY = "low"
"""What an event whose line calls itself non-fatal is: worth recording, the job keeps running."""
STATED_NONFATAL_ACTION = "restart_job"
"""What to do about it: nothing beyond a restart should the job have failed anyway."""
STATED_FATAL_SEVERITY = "high"
"""What an event whose line calls itself fatal or uncorrectable is at least: a reset is due."""


def stated_fatality(text: str) -> str | None:
    """"nonfatal" / "fatal" when the driver's line states which it is, else None.

    NVLink Xids (144-150) and NVSwitch SXids share one number for fatal and
    non-fatal forms of an error; only the line's own wording tells them apart.
    """
    if _NONFATAL_WORDING.search(text):
        return "nonfatal"
    if _FATAL_WORDING.search(text):
        return "fatal"
    return None


def sxid_info(code: int, text: str) -> XidInfo:
    """Describe an NVSwitch SXid; severity follows the fatal/non-fatal wording of its line."""
    stated = stated_fatality(text)
    if stated == "nonfatal":
        return XidInfo(code, "NVSwitch non-fatal SXid",
                       "A non-fatal NVSwitch error; traffic continues.",
                       STATED_NONFATAL_SEVERITY, STATED_NONFATAL_ACTION)
    if stated == "fatal":
        # Fatal SXids stall NVLink traffic through the switch; NVIDIA's fabric
        # guidance is to reset the GPUs and switches together.
        return XidInfo(code, "NVSwitch fatal SXid",
                       "A fatal NVSwitch error; NVLink traffic through the switch "
                       "stalls and the GPUs and switches need a reset.",
                       "high", "reboot_node")
    return XidInfo(code, "NVSwitch SXid",
                   "An NVSwitch error; see the Fabric Manager guide for this code.",
                   "medium", "reset_gpu")


def severity_rank(severity: str) -> int:
    """Rank of a severity in SEVERITY_ORDER (unknown strings rank as 'medium')."""
    if severity in SEVERITY_ORDER:
        return SEVERITY_ORDER.index(severity)
    return SEVERITY_ORDER.index("medium")


def most_severe(codes: Iterable[int]) -> int | None:
    """The code with the highest severity; ties go to the earliest. None if empty."""
    best: int | None = None
    best_rank = -1
    for code in codes:
        rank = severity_rank(lookup(code).severity)
        if rank > best_rank:
            best, best_rank = code, rank
    return best


def root_cause(codes: Iterable[int]) -> int | None:
    """The earliest code that is not a known consequence of another fault, or None."""
    for code in codes:
        if not lookup(code).consequence:
            return code
    return None
