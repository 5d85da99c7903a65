"""When the sidecar runs a detector round.

A round (read every slot, run every detector) costs 1-3 ms of CPU at 8 ranks,
and every wake-up of the sidecar on a machine whose caches the ranks keep busy
costs a cold start of its own: seven rounds a second were 2% of a core, most
of it spent finding that nothing happened. So the rounds follow the job: one
every tick (`tick_s`) while something develops or is being learnt, one every
`quiet_ticks` ticks while the job is healthy. Halfway between two quiet rounds
the sidecar glances at what must never wait (the agent's exit records, a
restart beginning, a rank process stopped or a zombie: a stat and a pread per
rank) and runs the round at once when it shows something.

Every tick while: an incident is open or waiting to be resolved; a detector
is busy (a rank past half its hang threshold, a state or a timer to confirm, a
straggler's streak, a disagreement in the collective counts; a baseline still
being learnt from the steps the rounds see: the job's steady hang threshold,
a rank's loss and step-time history); a restart is under way or exits were
just reported; a rank has not been seen stepping yet.

What a quiet round may see later than a busy one: a fault with no warning
sign before it (a NaN, an Xid, the first disagreeing collective count), by at
most (quiet_ticks - 1) ticks; an exit or a stopped rank by at most a glance's
half interval less a tick. A hang is never among them: a rank's detector
turns busy at half its threshold, well before the round that names it.

What a quiet round sees less of: the steps of a fast job. A rank keeps its
peaks (loss, grad norm, step time) until a round has read them; the straggler
detector keeps each step's compute time and the published collective arrivals
at the glance (`Detector.sample`); the other histories hold the steps the
rounds see, as they do of any job whose steps are shorter than a tick.

A multi-node job keeps the fast cadence on every node: the aggregator judges
each node's ranks from the summaries its rounds publish.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

from trainwatch.watchdog.detectors.base import TickView, grow

_FAULT_STATES = ("stopped", "zombie")


class Cadence:
    """Which ticks run a round, and how far apart the ticks are; told after each
    round whether the next must follow at once."""

    def __init__(self, tick_s: float, quiet_ticks: int):
        self.tick_s = tick_s
        self.quiet_ticks = max(1, int(quiet_ticks))
        self.busy = True
        """Set after every round (`following()`); the first rounds come every tick."""
        self._glanced = False
        self._step = np.zeros(0, dtype=np.int64)

    def interval(self) -> float:
        """Seconds to the next tick: tick_s while busy; while quiet, half the
        quiet interval (a glance halfway, then the round). Every wake-up costs
        a cold start on a busy machine, so quiet ticks are few."""
        return self.tick_s if self.busy or self.quiet_ticks == 1 else self.tick_s * self.quiet_ticks / 2

    def due(self, between: Callable[[], bool]) -> bool:
        """Whether this tick runs a round: busy, the glance was last tick, or this glance saw something."""
        if self.busy or self._glanced or self.quiet_ticks == 1 or between():
            self._glanced = False
            return True
        self._glanced = True
        return False

    def fast(self, table: np.ndarray) -> bool:
        """After a round over `table`: whether the rounds must come every tick
        because some rank has not been seen stepping yet (its start sets floors
        and baselines), or none has attached yet."""
        if not len(table):
            return True
        ranks = table["rank"]
        self._step = grow(self._step, int(ranks.max()) + 1, 0)
        new = bool((table["step"] < 1).any() or (self._step[ranks] < 1).any())
        self._step[ranks] = table["step"]
        return new


def following(sc: Any, rounds: Cadence) -> bool:
    """After a round: whether the next rounds must come every tick."""
    fast = rounds.fast(sc.last_table) if sc.last_table is not None else False
    return (fast or sc.jobwide is not None or bool(sc.open) or sc.last_restarting or bool(sc.last_exits)
            or sc.engine.busy())


def between(sc: Any) -> bool:
    """A tick without a round: True when the glance says one must run now; else the
    detectors keep their samples of the slots (read, not acknowledged: a rank's peaks
    stay for the round)."""
    if glance(sc):
        return True
    table = sc.segment.read_table()  # a row torn right now reads empty: sampled next tick
    live = table[table["pid"] > 0]
    sc.engine.sample(TickView(now=sc.clock(), table=live, nodes=[sc.node] * len(live)))
    return False


def glance(sc: Any) -> bool:
    """Between quiet rounds: whether something happened that a round must see now.
    Reads no slot and runs no detector."""
    if sc.dir.restarting_file.exists():
        return True
    try:
        if os.stat(sc.dir.exits_file).st_size > sc.exits_read:
            return True
    except OSError:
        pass
    table = sc.last_table
    if table is None or sc.states is None:
        return False
    return any(sc.states(pid) in _FAULT_STATES for pid in set(table["pid"].tolist()))
