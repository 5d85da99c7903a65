"""The watchdog's detectors, registered in one place.

Adding a detector: write its module (a `Detector` subclass), its config
dataclass in `trainwatch.watchdog.detectorconfig` with a field of
`DetectorsConfig`, and a line to `REGISTRY`.
"""

from __future__ import annotations

from typing import Callable

from trainwatch.watchdog.detectorconfig import (
    CollectiveMismatchConfig,
    DetectorsConfig,
    ExitConfig,
    HangConfig,
    LossHealthConfig,
    LossTrendConfig,
    ProcessStateConfig,
    StepTimeConfig,
    StragglerConfig,
    TrainingHealthConfig,
)
from trainwatch.watchdog.detectors.base import Detector, RankExit, TickView
from trainwatch.watchdog.detectors.exits import ExitDetector
from trainwatch.watchdog.detectors.hang import HangDetector
from trainwatch.watchdog.detectors.loss import LossHealthDetector
from trainwatch.watchdog.detectors.mismatch import CollectiveMismatchDetector
from trainwatch.watchdog.detectors.process import ProcessStateDetector
from trainwatch.watchdog.detectors.steptime import StepTimeDetector
from trainwatch.watchdog.detectors.straggler import StragglerDetector
from trainwatch.watchdog.detectors.training import TrainingHealthDetector
from trainwatch.watchdog.detectors.trend import LossTrendDetector

# name -> factory taking the DetectorsConfig. Order is the order detectors run
# in a tick: crashes first, so the engine can mute their consequences.
REGISTRY: dict[str, Callable[[DetectorsConfig], Detector]] = {
    ExitDetector.name: lambda c: ExitDetector(c.exits),
    ProcessStateDetector.name: lambda c: ProcessStateDetector(c.process_state),
    HangDetector.name: lambda c: HangDetector(c.hang),
    CollectiveMismatchDetector.name: lambda c: CollectiveMismatchDetector(c.collective_mismatch),
    StragglerDetector.name: lambda c: StragglerDetector(c.straggler),
    LossHealthDetector.name: lambda c: LossHealthDetector(c.loss_health),
    TrainingHealthDetector.name: lambda c: TrainingHealthDetector(c.training_health),
    LossTrendDetector.name: lambda c: LossTrendDetector(c.loss_trend, loss_health=c.loss_health.health),
    StepTimeDetector.name: lambda c: StepTimeDetector(c.step_time),
}


def default_detectors(config: DetectorsConfig | None = None) -> list[Detector]:
    """One fresh instance of every registered detector not disabled in `config`."""
    config = config or DetectorsConfig()
    unknown = set(config.disabled) - set(REGISTRY)
    if unknown:
        raise ValueError(
            f"unknown detector name(s) {', '.join(sorted(unknown))} in disabled; valid: {', '.join(REGISTRY)}"
        )
    out = [make(config) for name, make in REGISTRY.items() if name not in config.disabled]
    by_name = {d.name: d for d in out}
    hang, mismatch = by_name.get(HangDetector.name), by_name.get(CollectiveMismatchDetector.name)
    if isinstance(hang, HangDetector) and isinstance(mismatch, CollectiveMismatchDetector):
        # A steady job's parked ranks are compared after its own hang threshold (hang runs first in a tick).
        mismatch.steady_s = lambda: hang.steady.value
    return out


__all__ = [
    "CollectiveMismatchConfig",
    "CollectiveMismatchDetector",
    "Detector",
    "DetectorsConfig",
    "ExitConfig",
    "ExitDetector",
    "HangConfig",
    "HangDetector",
    "LossHealthConfig",
    "LossHealthDetector",
    "LossTrendConfig",
    "LossTrendDetector",
    "ProcessStateConfig",
    "ProcessStateDetector",
    "REGISTRY",
    "RankExit",
    "StepTimeConfig",
    "StepTimeDetector",
    "StragglerConfig",
    "StragglerDetector",
    "TickView",
    "TrainingHealthConfig",
    "TrainingHealthDetector",
    "default_detectors",
]
