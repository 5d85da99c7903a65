"""The watchdog's settings: one typed config for the sidecar, stated once.

Every threshold of every detector (`detectorconfig`), the engine's
de-duplication, the response policy (capture, emergency checkpoint, restart)
and the sidecar's intervals live in `SidecarConfig`. `trainwatch launch`
generates its watchdog flags from these fields (`--hang-floor-s`,
`--no-live-counts`, `--emergency-timeout-s`, ...), writes the resulting config
into the job's control directory as JSON (dataclasses, not a hand-built dict),
and the sidecar reads it back. Nothing here imports the sidecar's machinery
(detectors, engine, responder, exporter): the launcher reads this module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from trainwatch import flags, kinds
from trainwatch.watchdog.detectorconfig import DetectorsConfig
from trainwatch.watchdog.incident import SEVERITIES

# Flag prefix of each section (path in SidecarConfig -> prefix).
FLAG_PREFIXES = {
    ("detectors", "hang"): "hang-",
    ("detectors", "collective_mismatch"): "mismatch-",
    ("detectors", "straggler"): "straggler-",
    ("detectors", "loss_health"): "loss-",
    ("detectors", "training_health"): "health-",
    ("detectors", "loss_trend"): "trend-",
    ("detectors", "step_time"): "step-time-",
    ("detectors", "exits"): "exit-",
    ("detectors", "process_state"): "process-",
    ("detectors",): "detectors-",
}
FLAG_ALIASES = {
    "--no-mismatch-live-counts": "--no-live-counts",
    "--emergency-timeout-s": "--emergency-timeout",
}


METRICS_DETAILS = ("rank", "node", "job")
"""What `--metrics-detail` may say (see SidecarConfig.metrics_detail)."""


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """Settings of the detector engine."""

    rearm_s: float = 60.0
    """An open incident whose condition nobody has reported for this long is
    resolved; reported again later, it is a new incident (s)."""


RESTART_KINDS = kinds.RESTART_KINDS - {"crash"}
"""Incidents the sidecar restarts the job for. Crashes restart through
torchelastic directly (the agent sees the exit); stragglers and loss
incidents only alert: restarting would not fix them and would lose work."""


@dataclass(kw_only=True, slots=True)
class ActionPolicy:
    """Which incidents restart the job, and how long captures and checkpoints may take."""

    restart: bool = True
    """Restart the job on hangs, mismatches and critical GPU faults; off = alert only."""
    restart_kinds: frozenset = field(default_factory=lambda: RESTART_KINDS)
    """Incident kinds that lead to an emergency checkpoint and a restart (names)."""
    capture: bool = True
    """Capture every rank's stacks on hang and mismatch incidents."""
    capture_timeout_s: float = 5.0
    """Hard bound on one rank's py-spy dump (s)."""
    emergency_timeout_s: float = 10.0
    """How long ranks that registered state get to write their emergency checkpoint (s)."""
    min_severity_restart: str = "high"
    """Hardware incidents below this severity (info, low, medium, high, critical) only alert."""
    in_process: bool = True
    """Recover inside the running ranks (a re-formed process group, the staged state restored from memory)
    before restarting on a collective mismatch, where every rank offers it (the integrated trainer on gloo)."""
    in_process_timeout_s: float = 10.0
    """How long the ranks get to recover in their own processes before the process restart (s)."""

    def __post_init__(self) -> None:
        if self.min_severity_restart not in SEVERITIES:
            raise ValueError(f"--min-severity-restart must be one of {', '.join(SEVERITIES)}; "
                             f"got {self.min_severity_restart!r}")


@dataclass(kw_only=True, slots=True)
class SidecarConfig:
    """Everything the node sidecar does and how fast."""

    detectors: DetectorsConfig = field(default_factory=DetectorsConfig)
    """Thresholds of every detector."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """How detections become incidents (de-duplication, re-arming)."""
    actions: ActionPolicy = field(default_factory=ActionPolicy)
    """What happens on an incident: capture, emergency checkpoint, restart."""
    tick_s: float = 0.15
    """Seconds between detector rounds while something develops (~7 a second): hang
    thresholds are seconds; a round at 8 ranks costs 1-3 ms of CPU (more on a machine
    whose caches the ranks keep busy)."""
    quiet_ticks: int = 4
    """While the job is healthy (nothing open, no detector following anything) a round runs
    every this many ticks, with one glance halfway at the agent's exit records and the ranks'
    process states (a round follows at once when it shows something); 1: a round every tick.
    At 8 ranks this keeps the watchdog under 1% of a core (trainwatch/watchdog/cadence.py) (ticks)."""
    snapshot_s: float = 2.0
    """Seconds between telemetry.json snapshots (what `diagnose` reads once a job ended)."""
    metrics_detail: str = "rank"
    """What the Prometheus exporter sends: rank (a handful of per-rank series, node and job aggregates),
    node (aggregates only) or job (job aggregates, counters and GPUs); series per rank are what a scrape
    of thousands of ranks pays for."""
    kernel_log: str | None = field(default=None, metadata={"flag": False})
    """A file followed as the kernel log instead of /dev/kmsg (`--kernel-log`)."""
    faults: list = field(default_factory=list, metadata={"flag": False})
    """Hardware faults to inject (`--inject xid/ecc`): the sidecar plays the GPU's part."""

    def __post_init__(self) -> None:
        if self.metrics_detail not in METRICS_DETAILS:
            raise ValueError(f"--metrics-detail must be one of {', '.join(METRICS_DETAILS)}; "
                             f"got {self.metrics_detail!r}")
        flags.check_ranges(self, RANGES, _option)

    def to_json(self) -> dict:
        return flags.to_json(self)

    @classmethod
    def from_json(cls, data: dict) -> SidecarConfig:
        return flags.from_json(cls, data)

    def write(self, path: Path) -> None:
        from trainwatch import state

        state.write_json_atomic(path, self.to_json())

    @classmethod
    def read(cls, path: Path) -> SidecarConfig:
        """The config the launcher wrote; ValueError naming the file when it is not one."""
        try:
            return cls.from_json(json.loads(Path(path).read_bytes()))
        except RecursionError:
            raise ValueError(f"{path}: not a trainwatch sidecar config (nested too deep)") from None
        except (OSError, ValueError, TypeError) as e:
            reason = repr(str(e))[1:-1]  # one line: a field name read from the file may hold a newline
            raise ValueError(f"{path}: not a trainwatch sidecar config ({reason})") from None


_R = flags.Range
_ANY, _POSITIVE, _COUNT, _FRACTION = _R(), _R(low_open=True), _R(low=1), _R(high=1)
RANGES: dict[str, flags.Range] = {
    # Where every numeric setting of SidecarConfig may lie (dotted path): one
    # table, checked alike for a flag, a TRAINWATCH_* variable, the config file
    # and the JSON the sidecar reads. A period or timeout of 0 is a busy loop or
    # an action that can never finish; a window of 0 judges nothing.
    "tick_s": _R(low=0.01, high=60), "snapshot_s": _R(low=0.1, high=3600), "quiet_ticks": _COUNT,
    "engine.rearm_s": _POSITIVE,
    "actions.capture_timeout_s": _POSITIVE, "actions.emergency_timeout_s": _POSITIVE,
    "actions.in_process_timeout_s": _POSITIVE,
    "detectors.exits.collateral_s": _ANY,
    "detectors.process_state.confirm_s": _ANY,
    "detectors.hang.floor_s": _POSITIVE, "detectors.hang.k": _POSITIVE, "detectors.hang.history": _COUNT,
    "detectors.hang.warmup_s": _ANY, "detectors.hang.busy_grace_s": _POSITIVE, "detectors.hang.slow_phase_s": _ANY, "detectors.hang.busy_s": _ANY,
    "detectors.hang.active_cpu": _ANY, "detectors.hang.active_io_bytes_s": _ANY,
    "detectors.hang.heartbeat_stale_s": _POSITIVE, "detectors.hang.phase_factor": _ANY,
    "detectors.hang.phase_min_samples": _ANY, "detectors.hang.phase_history": _COUNT,
    "detectors.hang.steady_floor_s": _ANY, "detectors.hang.steady_min_steps": _COUNT,
    "detectors.hang.other_work_late_s": _ANY,
    "detectors.collective_mismatch.persist_steps": _COUNT, "detectors.collective_mismatch.stall_s": _POSITIVE,
    "detectors.collective_mismatch.stall_factor": _ANY, "detectors.collective_mismatch.settle_s": _ANY,
    "detectors.collective_mismatch.settle_rounds": _ANY, "detectors.collective_mismatch.round_min_s": _ANY,
    "detectors.collective_mismatch.heartbeat_stale_s": _POSITIVE,
    "detectors.straggler.window": _COUNT, "detectors.straggler.min_steps": _COUNT,
    "detectors.straggler.ratio": _POSITIVE, "detectors.straggler.z": _ANY, "detectors.straggler.persist": _COUNT,
    "detectors.straggler.persist_s": _ANY, "detectors.straggler.min_excess_s": _ANY,
    "detectors.straggler.arrival_window": _COUNT, "detectors.straggler.arrival_min_collectives": _COUNT,
    "detectors.straggler.arrival_min_lateness_s": _ANY, "detectors.straggler.arrival_last_fraction": _FRACTION,
    "detectors.loss_health.history": _COUNT, "detectors.loss_health.min_steps": _ANY,
    "detectors.loss_health.spike_mad_k": _ANY, "detectors.loss_health.spike_factor": _ANY,
    "detectors.loss_health.grad_norm_floor": _ANY, "detectors.loss_health.grad_norm_factor": _ANY,
    "detectors.training_health.dead_grad_steps": _COUNT,
    "detectors.training_health.vanishing_frac": _R(low_open=True, high=1, high_open=True),
    "detectors.training_health.vanishing_steps": _COUNT, "detectors.training_health.lr_grace_steps": _ANY,
    "detectors.training_health.lr_zero_steps": _COUNT, "detectors.training_health.lr_max_ratio": _ANY,
    "detectors.training_health.lr_max_min_steps": _ANY, "detectors.training_health.scale_halvings": _COUNT,
    "detectors.training_health.scale_window_steps": _COUNT, "detectors.training_health.scale_grace_steps": _ANY,
    "detectors.training_health.scale_floor": _ANY,
    "detectors.loss_trend.window_steps": _COUNT, "detectors.loss_trend.points": _R(low=4),
    "detectors.loss_trend.rise_frac": _ANY, "detectors.loss_trend.min_tau": _FRACTION,
    "detectors.loss_trend.plateau_window_steps": _ANY, "detectors.loss_trend.plateau_frac": _ANY,
    "detectors.loss_trend.max_ranks_per_tick": _COUNT,
    "detectors.step_time.history": _R(low=2), "detectors.step_time.min_samples": _ANY,
    "detectors.step_time.factor": _ANY, "detectors.step_time.min_excess_s": _ANY,
    "detectors.step_time.hold_s": _ANY, "detectors.step_time.stall_grace_s": _ANY,
    "detectors.step_time.node_grace_s": _ANY, "detectors.step_time.stall_min_excess_s": _ANY,
}


def launch_flags() -> list[flags.Flag]:
    """The watchdog flags `trainwatch launch` accepts, generated from SidecarConfig."""
    return flags.config_flags(SidecarConfig, FLAG_PREFIXES, ranges=RANGES)


def _option(dotted: str) -> str:
    """A setting's flag, by dotted path (to name it in an error)."""
    return next((f.option for f in launch_flags() if ".".join(f.path) == dotted), dotted)
