"""Synthetic slot tables for detector tests: the same numpy rows the sidecar
reads from shared memory, built by hand so tests choose every time and value."""

from __future__ import annotations

import math

import numpy as np

from trainwatch import slots
from trainwatch.watchdog.detectors.base import RankExit, TickView

_GROUP_FIELDS = ("pg", "enqueued", "completed", "last_op")
HEALTH_FIELDS = ("lr", "loss_scale", "zero_grad_frac", "data_s", "backward_s", "optimizer_s", "peak_step_s",
                 "peak_data_s", "peak_backward_s", "peak_optimizer_s")


def make_table(
    n: int,
    *,
    now: float = 100.0,
    step: int = 10,
    step_s: float = 1.0,
    compute_s: float = 0.6,
    phase: str = "data",
    loss: float = 2.0,
    grad_norm: float = 1.0,
    py_collectives: int | None = None,
    enqueued: int | None = None,
    start_mono: float = 0.0,
) -> np.ndarray:
    """`n` healthy ranks that all completed `step` just now (at `now`)."""
    t = np.zeros(n, dtype=slots.slot_dtype())
    r = np.arange(n)
    t["pid"] = 1000 + r
    t["rank"] = r
    t["local_rank"] = r
    t["world_size"] = n
    t["step_source"] = slots.STEP_REPORTED  # as the trainer API publishes: every loss rule applies
    t["step"] = step
    t["loss"] = loss
    t["grad_norm"] = grad_norm
    t["step_s"] = step_s
    t["compute_s"] = compute_s
    t["start_mono"] = start_mono
    t["progress_mono"] = now if step > 0 else start_mono
    t["phase"] = slots.PHASE_CODES[phase]
    t["phase_mono"] = t["progress_mono"]
    t["py_collectives"] = 2 * step if py_collectives is None else py_collectives
    t["heartbeat_mono"] = now
    t["fr_ok"] = 1
    t["sampled_step"] = step
    t["ngroups"] = 1
    t["io_bytes"] = -1
    t["cpu_s"] = np.nan
    for name in HEALTH_FIELDS:  # not reported, as a rank that publishes none of them
        t[name] = np.nan
    if step > 0:
        set_ring(t, step, colls=t["py_collectives"], seq=3 * step)
    seq = 3 * step if enqueued is None else enqueued
    t["groups"]["pg"][:, 0] = 0
    t["groups"]["enqueued"][:, 0] = seq
    t["groups"]["completed"][:, 0] = seq
    t["groups"]["last_op"][:, 0] = b"allreduce"
    return t


def set_ring(table: np.ndarray, step, *, colls, seq, ranks=None) -> np.ndarray:
    """Record the end-of-step counts of `step` in the rows of `ranks` (all by default)."""
    rows = np.arange(len(table)) if ranks is None else np.nonzero(np.isin(table["rank"], ranks))[0]
    slot = int(step) % slots.RING
    ring = table["ring"]
    ring["step"][rows, slot] = step
    ring["colls"][rows, slot] = np.broadcast_to(colls, len(table))[rows] if np.ndim(colls) else colls
    ring["seq"][rows, slot] = np.broadcast_to(seq, len(table))[rows] if np.ndim(seq) else seq
    return table


def set_rows(table: np.ndarray, ranks, *, group: int = 0, **fields) -> np.ndarray:
    """Set fields of the rows of `ranks` (an int or a list). `phase` takes a
    name; pg/enqueued/completed/last_op set collective group `group`."""
    ranks = [ranks] if isinstance(ranks, (int, np.integer)) else list(ranks)
    rows = np.nonzero(np.isin(table["rank"], ranks))[0]
    for name, value in fields.items():
        if name == "phase" and isinstance(value, str):
            value = slots.PHASE_CODES[value]
        if name in _GROUP_FIELDS:
            if name == "last_op" and isinstance(value, str):
                value = value.encode()
            table["groups"][name][rows, group] = value
            table["ngroups"][rows] = np.maximum(table["ngroups"][rows], group + 1)
        else:
            table[name][rows] = value
    return table


def view(table: np.ndarray, now: float, *, nodes=None, exits=()) -> TickView:
    """A tick view of a copy of `table` (detectors may keep references)."""
    return TickView.from_table(now, table.copy(), nodes, exits)


def rank_exit(rank: int, exitcode: int, *, pid: int | None = None, node: str = "node0") -> RankExit:
    return RankExit.from_exitcode(rank=rank, local_rank=rank, pid=pid or 1000 + rank, exitcode=exitcode, node=node)


class SyncJob:
    """A synchronous job advanced step by step: every call to `step()` makes
    the chosen ranks finish one more step `dt` seconds after the previous one."""

    def __init__(self, n: int, *, now: float = 0.0, step_s: float = 1.0, compute_s: float = 0.6):
        self.table = make_table(n, now=now, step=0, step_s=math.nan, compute_s=math.nan, phase="init",
                                loss=math.nan, grad_norm=math.nan, start_mono=now)
        self.now = now
        self.step_s = step_s
        self.compute_s = compute_s

    def step(self, *, dt: float | None = None, ranks=None, compute=None, loss=None, grad_norm=None,
             phase: str = "data") -> TickView:
        dt = self.step_s if dt is None else dt
        self.now += dt
        t = self.table
        rows = np.arange(len(t)) if ranks is None else np.nonzero(np.isin(t["rank"], list(ranks)))[0]
        t["step"][rows] += 1
        t["step_s"][rows] = dt
        t["compute_s"][rows] = self.compute_s if compute is None else np.broadcast_to(compute, len(t))[rows]
        if loss is not None:
            t["loss"][rows] = np.broadcast_to(loss, len(t))[rows]
        if grad_norm is not None:
            t["grad_norm"][rows] = np.broadcast_to(grad_norm, len(t))[rows]
        t["progress_mono"][rows] = self.now
        t["phase"][rows] = slots.PHASE_CODES[phase]
        t["phase_mono"][rows] = self.now
        t["py_collectives"][rows] += 2
        t["groups"]["enqueued"][rows, 0] += 3
        t["groups"]["completed"][rows, 0] = t["groups"]["enqueued"][rows, 0]
        for r in rows:
            set_ring(t, t["step"][r], colls=t["py_collectives"][r], seq=t["groups"]["enqueued"][r, 0],
                     ranks=[t["rank"][r]])
        t["heartbeat_mono"] = self.now
        t["sampled_step"][rows] = t["step"][rows]
        return view(t, self.now)

    def at(self, now: float, *, heartbeat: bool = True, exits=()) -> TickView:
        """The table as seen at a later time without new steps (heartbeats go on)."""
        if heartbeat:
            self.table["heartbeat_mono"] = now
        return view(self.table, now, exits=exits)


# Phases of one step in TimelineJob: (phase, seconds, collectives issued in it).
STEP_PLAN = (("data", 0.2, 0), ("forward", 0.2, 0), ("backward", 0.3, 1), ("collective", 0.1, 1), ("optimizer", 0.2, 0))


class TimelineJob:
    """Ranks running STEP_PLAN continuously, each shifted by its own offset, so
    a tick at any time sees them at different steps and phases, publishing as
    the trainer API does: the collective count at every phase change and step
    end, the collective itself counted when its phase ends."""

    def __init__(self, offsets, *, skip: tuple[int, int] | None = None):
        self.offsets = list(offsets)
        self.skip = skip  # (rank, step): from that step on the rank skips its 'collective' call
        self.step_s = sum(p[1] for p in STEP_PLAN)
        self.per_step = sum(p[2] for p in STEP_PLAN)
        self.table = make_table(len(self.offsets), step=0, phase="init", start_mono=0.0)

    def _count(self, rank: int, completed_steps: int) -> int:
        count = self.per_step * completed_steps
        if self.skip and rank == self.skip[0] and completed_steps >= self.skip[1]:
            count -= completed_steps - self.skip[1] + 1
        return count

    def at(self, now: float) -> TickView:
        t = self.table
        for rank, off in enumerate(self.offsets):
            u = max(0.0, now - off)
            done = int(u // self.step_s)
            into = u - done * self.step_s
            step_end = off + done * self.step_s
            count = self._count(rank, done)
            elapsed = 0.0
            phase, phase_start = STEP_PLAN[0][0], step_end
            for name, secs, colls in STEP_PLAN:
                if into < elapsed + secs:
                    phase, phase_start = name, step_end + elapsed
                    break
                skipped = self.skip and rank == self.skip[0] and done + 1 >= self.skip[1] and name == "collective"
                count += 0 if skipped else colls
                elapsed += secs
            # The phase-change publish happens when the phase starts; the first
            # phase starts 10 ms after the step ends, so right after a step
            # end the row still holds the exact end-of-step count.
            if phase == STEP_PLAN[0][0] and into < 0.01:
                phase, phase_start = "optimizer", step_end - STEP_PLAN[-1][1]
            t["step"][rank] = done
            t["progress_mono"][rank] = step_end if done else 0.0
            t["phase"][rank] = slots.PHASE_CODES[phase]
            t["phase_mono"][rank] = phase_start
            t["py_collectives"][rank] = count
            t["step_s"][rank] = self.step_s
            t["heartbeat_mono"][rank] = now
            t["groups"]["enqueued"][rank, 0] = count
            for s in range(max(1, done - slots.RING + 1), done + 1):  # the slot's ring of step ends
                set_ring(t, s, colls=self._count(rank, s), seq=-1, ranks=[rank])
        return view(t, now)
