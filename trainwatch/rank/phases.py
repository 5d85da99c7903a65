"""Phases of a step and where its time goes.

`with tw.phase(name)` is a reusable `PhaseScope`. Every phase change (a scope
entered or left, `tw.set_phase`, a wait on peers) charges the time since the
previous change to the phase being left, so time is split between phases
exactly once however scopes nest, and the zero-code hooks' bare
`set_phase("optimizer")` ... `set_phase("compute")` pair counts like a scope.
Time in the `data`, `backward` and `optimizer` phases is summed per step and
published with it (`tw.step()`); a phase the process never entered reads NaN
(not measured), one it skipped in a step 0.0.
"""

from __future__ import annotations

import time
from typing import Any

from trainwatch import slots

TIMED = ("data", "backward", "optimizer")
"""The phases whose time per step is published, in the order of the slot's fields."""

ACC_OF = tuple(TIMED.index(p) if p in TIMED else -1 for p in slots.PHASES)
"""Per phase code: its index in TIMED, -1 for phases not timed."""

monotonic = time.monotonic


def charge(tw: Any, i: int, now: float) -> None:
    """Add the time the rank spent in its current phase (timed phase i) up to now:
    since the phase began, or since the last step ended when that is later.
    (PhaseScope has this inline: it is on every step's path.)"""
    since = tw._phase_since
    tw._acc[i] += now - (since if since > tw._last else tw._last)  # noqa: FURB136 - max() costs a call
    tw._seen[i] = 0.0


class PhaseScope:
    """Context manager for one phase; reused per phase name (no generator per call)."""

    __slots__ = ("active", "code", "name", "prev", "prev_name", "start", "tw", "wait")

    def __init__(self, tw: Any, code: int, name: str):
        self.tw, self.code, self.name = tw, code, name
        self.wait = name in slots.WAIT_PHASES
        self.active = False

    def __enter__(self) -> None:
        tw = self.tw
        self.active = True
        self.prev, self.prev_name = tw._phase, tw._phase_name
        self.start = now = monotonic()
        i = ACC_OF[tw._phase]
        if i >= 0:
            since = tw._phase_since
            tw._acc[i] += now - (since if since > tw._last else tw._last)  # noqa: FURB136 - max() costs a call
            tw._seen[i] = 0.0
        tw._phase, tw._phase_name, tw._phase_since = self.code, self.name, now
        tw._writer.write_phase(self.code, tw._source, now, tw.py_collectives)

    def __exit__(self, *exc: object) -> None:
        tw = self.tw
        now = monotonic()
        if self.wait:
            tw._wait_s += now - self.start
        i = ACC_OF[tw._phase]
        if i >= 0:
            since = tw._phase_since
            tw._acc[i] += now - (since if since > tw._last else tw._last)  # noqa: FURB136 - max() costs a call
            tw._seen[i] = 0.0
        tw._phase, tw._phase_name, tw._phase_since = self.prev, self.prev_name, now
        tw._writer.write_phase(self.prev, tw._source, now, tw.py_collectives)
        self.active = False
