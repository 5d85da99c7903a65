"""The watchdog's detectors, registered in one place.

Adding a detector: write its module (a `Detector` subclass and its config
dataclass), add a config field to `DetectorsConfig` and a line to `REGISTRY`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from trainwatch.watchdog.detectors.base import Detector, RankExit, TickView
from trainwatch.watchdog.detectors.exits import ExitConfig, ExitDetector
from trainwatch.watchdog.detectors.hang import HangConfig, HangDetector
from trainwatch.watchdog.detectors.loss import LossHealthConfig, LossHealthDetector
from trainwatch.watchdog.detectors.mismatch import CollectiveMismatchConfig, CollectiveMismatchDetector
from trainwatch.watchdog.detectors.process import ProcessStateConfig, ProcessStateDetector
from trainwatch.watchdog.detectors.steptime import StepTimeConfig, StepTimeDetector
from trainwatch.watchdog.detectors.straggler import StragglerConfig, StragglerDetector
from trainwatch.watchdog.detectors.training import TrainingHealthConfig, TrainingHealthDetector
from trainwatch.watchdog.detectors.trend import LossTrendConfig, LossTrendDetector


@dataclass(kw_only=True, slots=True)
class DetectorsConfig:
    """Configuration of every registered detector."""

    exits: ExitConfig = field(default_factory=ExitConfig)
    """Crash detection from rank exits."""
    process_state: ProcessStateConfig = field(default_factory=ProcessStateConfig)
    """Stopped and zombie rank processes, from the kernel's process state."""
    hang: HangConfig = field(default_factory=HangConfig)
    """Hang detection from step progress and heartbeats."""
    collective_mismatch: CollectiveMismatchConfig = field(default_factory=CollectiveMismatchConfig)
    """Collective desync detection from collective counts and sequence numbers."""
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    """Straggler detection from per-rank compute time."""
    loss_health: LossHealthConfig = field(default_factory=LossHealthConfig)
    """NaN, loss spike and grad explosion detection."""
    training_health: TrainingHealthConfig = field(default_factory=TrainingHealthConfig)
    """Dead and vanishing gradients, a stuck learning rate, a collapsing fp16 loss scale."""
    loss_trend: LossTrendConfig = field(default_factory=LossTrendConfig)
    """A rising loss or a loss plateau, from a robust fit over a long window."""
    step_time: StepTimeConfig = field(default_factory=StepTimeConfig)
    """Step time spikes, attributed to a phase and split into culprits and ranks that waited."""
    disabled: tuple[str, ...] = ()
    """Detector names to leave out (names as in REGISTRY)."""


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
