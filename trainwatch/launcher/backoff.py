"""How long to wait before a restart, and why: backoff is for crash loops only.

A restart waits only while the job is in a loop: the worker group failed
again without completing a step since the last restart (the restart did not
get training going), or it failed of the same cause again (`Cause`) within
`SAME_CAUSE_WINDOW_S` of its start. A fault after which training resumed and
completed steps, of another cause or after a longer stretch, is restarted at
once and starts the ladder over: spaced faults that each recovered cost no
deliberate waiting. In a loop the waits are 0 (the first restart), then 2, 4,
8, 16 s, and `max_s` (30 s) for every later one.

The agent gives the cause and whether steps were completed (its slots);
everything here is data in, data out, with an injectable clock.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from trainwatch.launcher.failures import NONFINITE_END, RankFailure

SAME_CAUSE_WINDOW_S = 60.0
"""A failure of the same cause as the last one is a loop when its worker group ran less than this (s);
after a longer stretch of training it is a spaced fault that recovered."""


@dataclass(frozen=True, slots=True)
class Cause:
    """What a worker group failed of, as compared between two restarts."""

    key: tuple
    """Equal keys: the same cause (see the constructors below)."""
    words: str
    """How the console names it ("ValueError at train.py:40")."""


def crash_cause(records: Iterable[RankFailure], exitcodes: dict[int, int], steps: dict[int, int]) -> Cause | None:
    """The cause of a crashed worker group: the exceptions its ranks recorded
    (`RankFailure.identity`: type, masked message, file:line), victims of a lost
    peer aside; else how the first failed ranks exited (exit code or signal, at
    which step: a death by signal says nothing more). `exitcodes`: global rank
    -> exit code of the ranks that failed first; `steps`: global rank -> the
    last step its slot shows."""
    records = list(records)
    own = sorted((f for f in records if not f.peer_lost and f.type != NONFINITE_END), key=lambda f: f.rank)
    if own:
        first = own[0]
        return Cause(("exception", frozenset(f.identity for f in own)),
                     f"{first.type} at {os.path.basename(first.where)}" if first.where
                     else f"{first.type} at step {first.step}")
    # A rank that lost its peer only echoes the death: whether it had exited by the
    # time the failure was seen is a race, so it is no part of the cause.
    victims = {f.rank for f in records if f.peer_lost}
    exitcodes = {rank: code for rank, code in exitcodes.items() if rank not in victims} or exitcodes
    if not exitcodes:
        return None
    exits = tuple(sorted((rank, code, steps.get(rank, 0)) for rank, code in exitcodes.items()))
    rank, code, step = exits[0]
    return Cause(("exit", exits), f"rank {rank} {_exit_words(code)} at step {step}")


def incident_cause(kind: str | None, steps: dict[int, int]) -> Cause:
    """The cause of a restart the sidecar asked for: the incident's kind at the
    group's lowest step (a hang replayed at the same point is the same cause;
    one hundred steps further on it is another fault)."""
    step = min(steps.values(), default=0)
    return Cause(("incident", kind or "", step), f"{kind or 'incident'} at step {step}")


def _exit_words(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


@dataclass(frozen=True, slots=True)
class BackoffDecision:
    """The wait before one restart, with its reason for the console."""

    wait_s: float
    """Seconds to wait before starting the new workers (0: none)."""
    loop: bool
    """Whether this failure continues a crash loop (see the module's docstring)."""
    reason: str
    """Why it waits or does not, in words."""

    def describe(self) -> str:
        return (f"after {self.wait_s:.0f}s backoff: " if self.wait_s else "no backoff: ") + self.reason


class Backoff:
    """The backoff ladder of one launcher: where the current loop is, what the
    last failure's cause was, and when the running worker group started."""

    def __init__(self, max_s: float = 30.0, same_cause_window_s: float = SAME_CAUSE_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic):
        self.max_s, self.same_cause_window_s, self.clock = max_s, same_cause_window_s, clock
        self.streak = 0
        """Restarts in the current loop (1: its first, which waits for nothing)."""
        self.started: float | None = None
        """When the running worker group started (the clock's time)."""
        self.last_cause: Cause | None = None
        """The cause of the last failure (None: none yet, or unknown)."""

    def workers_started(self) -> None:
        self.started = self.clock()

    def next(self, cause: Cause | None, progressed: bool) -> BackoffDecision:
        """The wait before the restart that is about to begin. `cause`: what the
        group failed of (None: unknown); `progressed`: whether any of its ranks
        completed a step since it started."""
        ran = self.clock() - self.started if self.started is not None else 0.0
        since = "the last restart" if self.streak else "the start"
        previous, self.last_cause = self.last_cause, cause
        same = cause is not None and cause == previous
        if not progressed:
            why = f"no step completed since {since}"
        elif same and ran < self.same_cause_window_s:
            why = f"the same failure again ({cause.words}) {ran:.0f}s after {since}"
        else:
            why = f"steps completed since {since}"
            if same:
                why += f" (for {ran:.0f}s) before the same failure ({cause.words})"
            elif cause is not None and previous is not None:
                why += f" and a different failure ({cause.words})"
            if self.streak > 1:
                why += "; the backoff ladder starts over"
            self.streak = 1
            return BackoffDecision(0.0, False, why)
        self.streak += 1
        if self.streak == 1:
            return BackoffDecision(0.0, True, f"{why}; the first restart waits for nothing")
        wait = min(self.max_s, 2.0 ** (self.streak - 1))
        return BackoffDecision(wait, True, f"{why} (restarts in this loop: {self.streak})")
