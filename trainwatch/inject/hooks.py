"""Fault hooks: where an injected fault (`trainwatch launch --inject`) happens
inside a rank. The rank calls these at its fault points; the default object
does nothing, so production code never branches on "is injection on", and the
real faults (trainwatch.inject.faults) are passed in, never patched onto the
telemetry handle."""

from __future__ import annotations

from typing import Any


class FaultHooks:
    """No faults: every hook is a no-op."""

    def fault_point(self, tw: Any, where: str) -> None:
        """At 'data', 'forward', 'checkpoint', 'step_end' and 'emergency_write'; inside
        the backward and optimizer phases at 'backward' and 'optimizer'."""

    def skip_collective(self, tw: Any) -> bool:
        """True when this rank should silently skip its next all-reduce."""
        return False

    def perturb_loss(self, tw: Any, loss: Any) -> Any:
        """The loss, or a NaN/spiked/rising copy of it (before backward)."""
        return loss

    def after_backward(self, tw: Any, params: Any) -> None:
        """After backward, before anything reads the gradients (clipping, the
        optimizer): params is an iterable of parameters, or a callable returning one
        (called only when a fault needs them)."""

    def before_unscale(self, tw: Any, params: Any) -> None:
        """Just before a GradScaler checks the gradients for inf/NaN (unscale_)."""

    def before_optimizer(self, tw: Any, optimizer: Any) -> None:
        """Just before optimizer.step(), after any LR scheduler set the LR."""

    def wants(self, kind: str, where: str | None = None) -> bool:
        """True when a fault of this kind (and hang location) is armed here."""
        return False

    def unfired(self) -> list:
        """Armed faults that have not fired yet (said at exit, never dropped silently)."""
        return []

    def not_replayed(self) -> list:
        """Data faults of an earlier worker generation whose data window this run did not train again."""
        return []


NO_FAULTS = FaultHooks()
