"""The watchdog's settings: one typed config for the sidecar, stated once.

Every threshold of every detector, the engine's de-duplication, the response
policy (capture, emergency checkpoint, restart) and the sidecar's intervals
live in `SidecarConfig`. `trainwatch launch` generates its watchdog flags from
these fields (`--hang-floor-s`, `--no-live-counts`, `--emergency-timeout-s`,
...), writes the resulting config into the job's control directory as JSON
(dataclasses, not a hand-built dict), and the sidecar reads it back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from trainwatch import flags
from trainwatch.watchdog.detectors import DetectorsConfig
from trainwatch.watchdog.engine import EngineConfig
from trainwatch.watchdog.responder import ActionPolicy

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
    """Seconds between detector rounds (~7 a second): hang thresholds are seconds, and
    at 8 ranks a round costs ~1 ms of CPU, so the watchdog stays under 1% of a core."""
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
        from trainwatch.watchdog.aggregates import check_detail

        check_detail(self.metrics_detail)

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


def launch_flags() -> list[flags.Flag]:
    """The watchdog flags `trainwatch launch` accepts, generated from SidecarConfig."""
    return flags.config_flags(SidecarConfig, FLAG_PREFIXES)
