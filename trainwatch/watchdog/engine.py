"""The detector engine: runs every detector once per sidecar tick and turns
their findings into incidents with a lifecycle.

Detectors may report a fault on every tick they see it; the engine makes one
incident of it, in the manner of Alertmanager and Kubernetes events: the first
report opens it (the incident is returned to act on), reports while it is
open only count and refresh it, and it is resolved once its condition is over
(`take_resolved()` hands those out with how long they lasted and how often
they were seen). When a condition is over depends on its kind
(`trainwatch.kinds`): a hang, crash or mismatch once nobody reports it and the
ranks it named made progress (a new episode of the same key after that is a
new incident); a straggler or a NaN streak, whose ranks keep stepping, once
nobody has reported it for `rearm_s`. A restarted culprit (a new process)
always ends the old incident.

A crash mutes hangs and collective mismatches until training progresses
again: the peers of a dead rank stall because of it, and one restart fixes
both. A collective mismatch and a hang mute each other the same way: ranks
that desynchronised end up stuck in collectives, and a rank stuck elsewhere
leaves its peers parked at other operations; either way it is one fault,
reported once.

One failing detector never costs the round: its exception is logged and the
other detectors still run, the same way the sidecar loop around `tick()`
survives a bad round. One engine watches one job.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from trainwatch import kinds, slots
from trainwatch.watchdog.config import EngineConfig
from trainwatch.watchdog.detectors.base import Detector, StepChanges, StepTracker, TickView, grow
from trainwatch.watchdog.incident import Incident

MUTES = kinds.MUTES
"""Incident kinds that an earlier incident explains until training progresses again."""
_PRIORITY = {kind: i for i, kind in enumerate([*MUTES, *kinds.OPEN_MUTES])}
_OPEN_MUTED = frozenset().union(*kinds.OPEN_MUTES.values())


@dataclass(slots=True)
class _Seen:
    absent_since: float | None
    """Monotonic time the key stopped being reported; None while it is reported."""
    steps: dict[int, tuple[int, int]] = field(default_factory=dict)
    """(pid, step) of the culprit ranks when it last fired (rank -1: the job's lowest step)."""
    detected: float = -1.0
    """detected_mono of the incident last admitted: a detector that hands back the
    same detection after a gap is not a new fault."""
    incident: Incident | None = None
    """The open incident."""
    count: int = 1
    """Ticks it was reported in while open."""
    last_seen: float = 0.0
    """Monotonic time of the last report."""
    waits: bool = False
    """Revised by the stacks, its restart held back: the next report of its
    new kind (past that kind's threshold) confirms it (`take_confirmed`)."""


@dataclass(frozen=True, slots=True)
class Resolved:
    """An incident whose condition is over."""

    incident: Incident
    """The incident as it opened."""
    resolved_mono: float
    """When the engine saw it was over (monotonic s)."""
    last_seen_mono: float
    """Its last report (monotonic s)."""
    count: int
    """Ticks it was reported in while open."""
    reason: str
    """Why it is over, in words."""
    training_again: bool = False
    """Over because its ranks train again (progress, or a restarted generation),
    not because it was no longer seen."""

    @property
    def duration_s(self) -> float:
        """From the fault to training again (a hang is reported once, then its
        ranks are restarted: its last report says nothing of how long training
        stood still), or to its last report for a condition that went away."""
        end = self.resolved_mono if self.training_again else self.last_seen_mono
        return max(0.0, end - self.incident.detected_mono)


@dataclass(slots=True)
class _Episode:
    since: float
    step: np.ndarray
    pid: np.ndarray


class DetectorEngine:
    """Runs detectors each tick; returns de-duplicated incidents."""

    def __init__(
        self,
        detectors: Iterable[Detector],
        *,
        config: EngineConfig | None = None,
        log: logging.Logger = logging.getLogger("trainwatch.watchdog.engine"),
    ):
        self.detectors = list(detectors)
        self.config = config or EngineConfig()
        self.log = log
        self.failures: dict[str, int] = {}
        """Number of rounds each detector failed in (by detector name)."""
        self._seen: dict[str, _Seen] = {}
        self._episodes: dict[str, _Episode] = {}
        self._resolved: list[Resolved] = []
        self._confirmed: list[Incident] = []
        self._aliases: dict[str, str] = {}
        """Key an incident was detected under -> the key the stacks revised it to."""
        self._steps = StepTracker()  # one for every detector: each round works it out once

    def busy(self) -> bool:
        """Whether the next rounds should come at the fast cadence: an incident
        open or waiting to be resolved, a mute episode, or a detector busy."""
        return bool(self._seen or self._episodes) or any(det.busy for det in self.detectors)

    def open_incidents(self) -> list[Incident]:
        """Incidents whose condition is not over, oldest first."""
        return [s.incident for s in self._seen.values() if s.incident is not None]

    def take_resolved(self) -> list[Resolved]:
        """Incidents resolved since the last call, oldest first."""
        out, self._resolved = self._resolved, []
        return out

    def take_confirmed(self) -> list[Incident]:
        """Revised incidents whose held-back restart is now due, oldest first."""
        out, self._confirmed = self._confirmed, []
        return out

    def revised(self, old_key: str, incident: Incident, from_kind: str, waits: bool) -> None:
        """The stacks revised an open incident (`incident`, already revised in
        place) from `from_kind`: its detector's reports stay the same incident,
        what the old kind muted is live again, and with `waits` the first report
        of its new kind asks for the restart held back."""
        seen = self._seen.pop(old_key, None)
        if seen is None or incident.key in self._seen:
            if seen is not None:
                self._seen[old_key] = seen
            return
        seen.waits = waits
        self._seen[incident.key] = seen
        self._aliases[old_key] = incident.key
        self._episodes.pop(from_kind, None)

    def detector(self, name: str) -> Detector | None:
        """The running detector of that name (e.g. 'straggler' for its ratios)."""
        return next((d for d in self.detectors if d.name == name), None)

    def sample(self, view: TickView) -> None:
        """A tick without a round: each detector keeps the samples the next round would miss."""
        for det in self.detectors:
            try:
                det.sample(view)
            except Exception:
                self.log.exception("detector %s failed to sample; the other detectors still ran", det.name)

    def tick(self, view: TickView, extra: Iterable[Incident] = (),
             causes: dict[str, Iterable[str]] | None = None) -> list[Incident]:
        """Run one round over `view`; return the incidents newly opened (to act
        on now). `extra`: incidents found outside the detectors this round
        (hardware events), which share the same lifecycle. `causes`: what is
        known this round from outside the detectors to explain incidents of
        the kinds it names (a restart under way, a node's open crash): those
        are muted this round, never opened."""
        if view.steps is None:
            advanced, restarted = self._steps.update(view.table)
            view.steps = StepChanges(advanced, restarted, self._steps.first)
        found: list[Incident] = []
        for inc in extra:
            if not inc.detected_mono:
                inc.detected_mono = view.now
            found.append(inc)
        for det in self.detectors:
            name = det.name or type(det).__name__
            try:
                got = det.check(view)
            except Exception:
                self.failures[name] = self.failures.get(name, 0) + 1
                self.log.exception("detector %s failed this round; the other detectors still ran", name)
                continue
            for inc in got or ():
                if not inc.detected_mono:
                    inc.detected_mono = view.now
                found.append(inc)

        self._end_episodes_on_progress(view)
        # Causes first (crash, then mismatch), so the hangs they cause in the
        # same tick are muted.
        found.sort(key=lambda inc: _PRIORITY.get(inc.kind, len(_PRIORITY)))
        emitted: list[Incident] = []
        reported: set[str] = set()
        kept: set[str] = set()  # revised incidents still reported under the key they were detected by
        for inc in found:
            if (alias := self._aliases.get(inc.key)) in self._seen:
                kept.add(alias)
                continue
            if inc.key in reported:
                continue
            reported.add(inc.key)
            cause = next((k for k, muted in MUTES.items() if inc.kind in muted and k in self._episodes), None)
            if cause is None and causes:
                cause = next((c for c, muted in causes.items() if inc.kind in muted), None)
            if cause is None and inc.kind in _OPEN_MUTED:
                open_kinds = {s.incident.kind for s in self._seen.values() if s.incident is not None}
                cause = next((k for k, muted in kinds.OPEN_MUTES.items() if inc.kind in muted and k in open_kinds),
                             None)
            if cause is not None:
                self.log.debug("muted %s after a %s: %s", inc.key, cause, inc.summary)
                continue
            if inc.kind in MUTES and inc.kind not in self._episodes:
                self._start_episode(inc.kind, view)
            if self._admit(inc, view):
                emitted.append(inc)

        now = view.now
        for key in list(self._seen):
            seen = self._seen[key]
            if key in reported or key in kept:
                continue
            if seen.absent_since is None:
                seen.absent_since = now
            why = self._over(seen, view)
            if why is not None:
                del self._seen[key]
                self._aliases = {k: v for k, v in self._aliases.items() if v != key}
                if seen.incident is not None:
                    progress = now - seen.absent_since < self.config.rearm_s  # else: not seen for the hold time
                    self._resolved.append(Resolved(seen.incident, now, seen.last_seen, seen.count, why, progress))
        return emitted

    # ---- lifecycle ------------------------------------------------------------------

    def _admit(self, inc: Incident, view: TickView) -> bool:
        """True when `inc` opens a new incident; False when it is the open one again."""
        seen = self._seen.get(inc.key)
        if seen is not None and inc.detected_mono == seen.detected:
            seen.absent_since, seen.last_seen = None, view.now
            return False  # the same detection handed back: not a new fault
        if seen is not None:
            now_steps = self._steps_of(inc, view)
            restarted = _new_process(seen.steps, now_steps)
            moved_on = (_is_progress_kind(inc.kind) and seen.absent_since is not None
                        and _advanced(seen.steps, now_steps))
            if not (restarted or moved_on):
                seen.absent_since, seen.last_seen = None, view.now
                seen.count += 1
                if seen.waits and seen.incident is not None:
                    seen.waits = False  # its own detector calls it now: the restart held back is due
                    self._confirmed.append(seen.incident)
                return False  # still the same fault: counted, not raised again
            # The old fault is over (its culprits restarted, or got going and
            # stalled anew): resolved, and this is a new incident.
            if seen.incident is not None:
                self._resolved.append(Resolved(seen.incident, view.now, seen.last_seen, seen.count,
                                               "its ranks restarted" if restarted else "its ranks made progress",
                                               True))
        self._seen[inc.key] = _Seen(absent_since=None, steps=self._steps_of(inc, view), detected=inc.detected_mono,
                                    incident=inc, last_seen=view.now, waits=inc.evidence.get("provisional") is True)
        return True

    def _over(self, seen: _Seen, view: TickView) -> str | None:
        """Why an open incident that was not reported this tick is over; None while it is not."""
        absent = view.now - seen.absent_since
        inc = seen.incident
        if inc is not None and _is_progress_kind(inc.kind):
            now_steps = self._steps_of(inc, view)
            if _new_process(seen.steps, now_steps):
                return "its ranks restarted"
            if _advanced(seen.steps, now_steps):
                return "its ranks made progress"
            if now_steps:
                return None  # its ranks are here and have not stepped: the fault lasts, reported or not
        return f"not seen for {absent:.0f}s" if absent >= self.config.rearm_s else None

    @staticmethod
    def _steps_of(inc: Incident, view: TickView) -> dict[int, tuple[int, int]]:
        t = view.table
        if len(t) == 0:
            return {}
        ranks = inc.culprit_ranks or inc.victims
        if not ranks:
            return {-1: (0, int(t["step"].min()))}
        rows = np.nonzero(np.isin(t["rank"], ranks))[0]
        return dict(zip(t["rank"][rows].tolist(), zip(t["pid"][rows].tolist(), t["step"][rows].tolist())))

    # ---- episodes: a cause mutes its consequences -------------------------------------------------------------

    def _start_episode(self, kind: str, view: TickView) -> None:
        t = view.table
        size = int(t["rank"].max()) + 1 if len(t) else 0
        step = np.full(size, -1, dtype=np.int64)
        pid = np.zeros(size, dtype=np.int64)
        step[t["rank"]] = t["step"]
        pid[t["rank"]] = t["pid"]
        self._episodes[kind] = _Episode(since=view.now, step=step, pid=pid)

    def _end_episodes_on_progress(self, view: TickView) -> None:
        for kind, ep in list(self._episodes.items()):
            if self._progressed(ep, view):
                self.log.debug("training progressed after the %s; muted detections are live again", kind)
                del self._episodes[kind]

    @staticmethod
    def _progressed(ep: _Episode, view: TickView) -> bool:
        t = view.table
        if len(t) == 0:
            return False
        size = int(t["rank"].max()) + 1
        ep.step = grow(ep.step, size, -1)
        ep.pid = grow(ep.pid, size, 0)
        ranks = t["rank"]
        # A step completed after the crash, by a survivor (step moved past its
        # step at the crash) or by a restarted process (new pid; its
        # progress_mono equals its start time until its first step ends).
        progress = t["progress_mono"]
        moved = (t["step"] > ep.step[ranks]) | (t["pid"] != ep.pid[ranks])
        done = moved & (t["step"] >= 1) & (progress > ep.since) & (progress > t["start_mono"])
        return bool(done.any())


def _is_progress_kind(kind: str) -> bool:
    spec = kinds.spec(kind)
    return spec is None or spec.resolution is kinds.Resolution.PROGRESS


def _new_process(before: dict[int, tuple[int, int]], now: dict[int, tuple[int, int]]) -> bool:
    """True when every culprit still present is a new process (a restart) that has
    trained: a restarted job is over its fault once it steps again, not when its
    processes start (the incident stays open through rendezvous and loading)."""
    common = [r for r in now if r in before and r >= 0]
    return bool(common) and all(now[r][0] != before[r][0] and now[r][1] > 0 for r in common)


def _advanced(before: dict[int, tuple[int, int]], now: dict[int, tuple[int, int]]) -> bool:
    """True when every culprit still present moved on since the last firing:
    a later step, or a new process that has stepped (a restart may resume at
    an earlier step)."""
    common = [r for r in now if r in before]
    return bool(common) and all(now[r][1] > (0 if now[r][0] != before[r][0] else before[r][1]) for r in common)


# ---- benchmark ----------------------------------------------------------------------


class _SyntheticJob:
    """A healthy job of `nranks` ranks in which every rank finishes one step
    per tick: the heaviest steady load on the detectors (every rank's history
    changes every tick)."""

    def __init__(self, nranks: int, *, tick_s: float = 0.1, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.tick_s = tick_s
        self.now = 1000.0
        t = np.zeros(nranks, dtype=slots.slot_dtype())
        r = np.arange(nranks)
        t["pid"] = 10_000 + r
        t["rank"] = r
        t["local_rank"] = r % 8
        t["world_size"] = nranks
        t["start_mono"] = self.now - 60.0
        t["progress_mono"] = self.now
        t["phase"] = slots.PHASE_CODES["data"]
        t["fr_ok"] = 1
        t["ngroups"] = 1
        t["loss"] = np.nan
        t["grad_norm"] = np.nan
        t["step_s"] = np.nan
        t["compute_s"] = np.nan
        for name in ("data_s", "backward_s", "optimizer_s", "peak_step_s", "peak_data_s", "peak_backward_s",
                     "peak_optimizer_s"):
            t[name] = np.nan
        t["loss_scale"] = 65536.0
        self.table = t
        self.nodes = [f"node{i // 8}" for i in range(nranks)]

    def advance(self) -> TickView:
        t, rng, n = self.table, self.rng, len(self.table)
        self.now += self.tick_s
        t["step"] += 1
        step = t["step"]
        t["loss"] = 2.0 + 3.0 * np.exp(-step / 400.0) + rng.normal(0, 0.05, n)
        t["grad_norm"] = np.abs(rng.normal(1.0, 0.2, n))
        t["step_s"] = self.tick_s * (1 + rng.normal(0, 0.02, n))
        t["compute_s"] = t["step_s"] * 0.6 * (1 + rng.normal(0, 0.02, n))
        t["lr"] = 1e-3 * np.minimum(1.0, step / 100.0) * (0.5 + 0.5 * np.cos(step / 5000.0))
        t["zero_grad_frac"] = rng.uniform(0.0, 0.02, n)
        t["data_s"], t["backward_s"], t["optimizer_s"] = 0.1 * t["step_s"], 0.4 * t["step_s"], 0.1 * t["step_s"]
        t["progress_mono"] = self.now - rng.uniform(0, 0.05, n)
        t["phase_mono"] = t["progress_mono"] + 0.001
        t["py_collectives"] += 2
        slot = step % slots.RING
        ring = t["ring"]
        rows = np.arange(n)
        ring["step"][rows, slot] = step
        ring["colls"][rows, slot] = 2 * step
        ring["seq"][rows, slot] = 3 * step
        t["cpu_s"] += self.tick_s * 0.9
        g = t["groups"]
        g["enqueued"][:, 0] += 3
        g["completed"][:, 0] = g["enqueued"][:, 0]
        g["last_op"][:, 0] = b"allreduce"
        t["heartbeat_mono"] = self.now - rng.uniform(0, 0.2, n)
        t["sampled_step"] = step
        return TickView(now=self.now, table=t.copy(), nodes=self.nodes)


def benchmark_tick(nranks: int = 4096, ticks: int = 50, *, detectors: list[Detector] | None = None) -> float:
    """Median wall time in ms of one engine tick over a healthy synthetic job
    of `nranks` ranks whose histories are already full."""
    from trainwatch.watchdog.detectors import default_detectors

    engine = DetectorEngine(detectors if detectors is not None else default_detectors())
    job = _SyntheticJob(nranks)
    for _ in range(60):  # fill the 50-step histories first
        engine.tick(job.advance())
    times = []
    for _ in range(ticks):
        view = job.advance()
        start = time.perf_counter()
        engine.tick(view)
        times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times)
