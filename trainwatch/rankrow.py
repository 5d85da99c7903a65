"""One rank as every reader sees it: the single decoder of a slot table.

The sidecar's snapshot (telemetry.json), the exporter, the history, `diagnose`
and the verdict all read ranks through `decode()`, so a slot field is turned
into a number in one place, and a field added to the slot layout is added here
once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from trainwatch import slots


@dataclass(frozen=True, slots=True)
class RankRow:
    """One consistent read of one rank. Durations are seconds before `now`."""

    rank: int
    local_rank: int
    node: str
    pid: int
    restart: int
    """The worker group generation (torchelastic's restart count) this process belongs to."""
    step: int
    """Last completed step (0: none yet)."""
    step_source: str
    """'reported' (the script's own step numbers, trainer API) or 'counted'
    (optimizer steps trainwatch counted since this process started)."""
    loss: float | None
    grad_norm: float | None
    step_s: float | None
    """Duration of the last step."""
    compute_s: float | None
    phase: str
    last_progress_s: float
    """Since the last progress of any kind: a step, a batch, an eval forward."""
    last_step_s: float
    """Since the last completed step (or the process start before the first)."""
    phase_s: float
    """Time in the current phase."""
    heartbeat_age_s: float | None
    """Since the rank's background thread last ran (None before its first beat)."""
    cpu_s: float | None
    """Process CPU time at the last heartbeat."""
    py_collectives: int
    batches: int
    groups: tuple[slots.CollectiveGroup, ...] = field(default_factory=tuple)
    lr: float | None = None
    """Learning rate of the optimizer's first param group at the last step."""
    loss_scale: float | None = None
    """GradScaler's loss scale (fp16 mixed precision) at the last step."""
    zero_grad_frac: float | None = None
    """Fraction of gradient elements exactly zero at the last step."""
    phase_times: dict = field(default_factory=dict)
    """Seconds of the last step spent in 'data', 'backward' and 'optimizer' (those known)."""

    @property
    def collectives(self) -> dict:
        """The first process group's sequence numbers (DESIGN.md's `collectives`)."""
        g = self.groups[0] if self.groups else None
        return {
            "enqueued": g.enqueued if g else None,
            "completed": g.completed if g else None,
            "last_op": (g.last_op or None) if g else None,
        }

    def to_json(self) -> dict:
        return {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "node": self.node,
            "pid": self.pid,
            "restart": self.restart,
            "step": self.step,
            "step_source": self.step_source,
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "step_s": self.step_s,
            "compute_s": self.compute_s,
            "phase": self.phase,
            "last_progress_s": self.last_progress_s,
            "last_step_s": self.last_step_s,
            "phase_s": self.phase_s,
            "heartbeat_age_s": self.heartbeat_age_s,
            "cpu_s": self.cpu_s,
            "py_collectives": self.py_collectives,
            "batches": self.batches,
            "collectives": self.collectives,
            "groups": [{"pg": g.pg, "enqueued": g.enqueued, "completed": g.completed, "last_op": g.last_op}
                       for g in self.groups],
            "lr": self.lr,
            "loss_scale": self.loss_scale,
            "zero_grad_frac": self.zero_grad_frac,
            "phase_times": dict(self.phase_times),
        }


PHASE_TIMES = ("data", "backward", "optimizer")
"""Phases whose time per step each rank publishes (slot fields `<phase>_s`)."""


def _finite(x: Any, digits: int | None = None) -> float | None:
    x = float(x)
    if not math.isfinite(x):
        return None
    return round(x, digits) if digits is not None else x


def progress_mono(table):
    """Per row, when the rank last made progress of any kind (step or forward-only)."""
    import numpy as np

    return np.fmax(table["progress_mono"], table["active_mono"])


def decode(table, now: float, nodes: Sequence[str] | str = "") -> list[RankRow]:
    """Live rows (pid > 0) of a slot table as RankRows, sorted by rank."""
    labels = [nodes] * len(table) if isinstance(nodes, str) else list(nodes)
    if not len(table):
        return []
    # Columns as Python lists first: indexing a numpy record field by field
    # costs a microsecond each, which at thousands of ranks is most of a scrape
    # or a snapshot.
    c = {name: table[name].tolist() for name in _COLUMNS}
    progress = progress_mono(table).tolist()
    groups = table["groups"]
    g_pg, g_enq, g_done, g_op = (groups[k].tolist() for k in ("pg", "enqueued", "completed", "last_op"))
    rows = []
    for i, node in enumerate(labels[: len(table)]):
        if c["pid"][i] <= 0:
            continue
        hb = c["heartbeat_mono"][i]
        ngroups = max(0, min(c["ngroups"][i], slots.MAX_GROUPS))
        rows.append(
            RankRow(
                rank=c["rank"][i],
                local_rank=c["local_rank"][i],
                node=node,
                pid=c["pid"][i],
                restart=c["restart"][i],
                step=c["step"][i],
                step_source="reported" if c["step_source"][i] == slots.STEP_REPORTED else "counted",
                loss=_finite(c["loss"][i]),
                grad_norm=_finite(c["grad_norm"][i]),
                step_s=_finite(c["step_s"][i], 6),
                compute_s=_finite(c["compute_s"][i], 6),
                phase=slots.phase_name(c["phase"][i]),
                last_progress_s=round(max(0.0, now - progress[i]), 3),
                last_step_s=round(max(0.0, now - c["progress_mono"][i]), 3),
                phase_s=round(max(0.0, now - c["phase_mono"][i]), 3) if c["phase_mono"][i] > 0 else 0.0,
                heartbeat_age_s=round(max(0.0, now - hb), 3) if hb > 0 else None,
                cpu_s=_finite(c["cpu_s"][i], 3),
                py_collectives=c["py_collectives"][i],
                batches=c["batches"][i],
                groups=tuple(
                    slots.CollectiveGroup(g_pg[i][k], g_enq[i][k], g_done[i][k],
                                          g_op[i][k].rstrip(b"\0").decode("ascii", "replace"))
                    for k in range(ngroups)
                ),
                lr=_finite(c["lr"][i]),
                loss_scale=_finite(c["loss_scale"][i]),
                zero_grad_frac=_finite(c["zero_grad_frac"][i], 6),
                phase_times={p: round(c[p + "_s"][i], 6) for p in PHASE_TIMES if math.isfinite(c[p + "_s"][i])},
            )
        )
    rows.sort(key=lambda r: r.rank)
    return rows


_COLUMNS = ("pid", "rank", "local_rank", "restart", "step", "step_source", "loss", "grad_norm", "step_s",
            "compute_s", "phase", "progress_mono", "phase_mono", "heartbeat_mono", "cpu_s", "py_collectives",
            "batches", "ngroups", "lr", "loss_scale", "zero_grad_frac", *(p + "_s" for p in PHASE_TIMES))


def rows_json(rows: Iterable[RankRow]) -> list[dict]:
    return [r.to_json() for r in rows]


def _get(d: dict, name: str, kind: type | tuple, default: Any = None) -> Any:
    value = d.get(name, default)
    if isinstance(value, bool) and kind is not bool:
        return default
    return value if isinstance(value, kind) else default


def _num(d: dict, name: str, default: float | None = None) -> float | None:
    """A finite number field as a float; NaN, infinities, integers too large for a float read as unknown."""
    value = _get(d, name, (int, float))
    if value is None:
        return default
    try:
        value = float(value)
    except OverflowError:
        return default
    return value if math.isfinite(value) else default


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def from_json(d: Any) -> RankRow | None:
    """A RankRow from telemetry.json (written by a sidecar, read by anyone):
    None for a record of the wrong shape; wrong-typed fields read as unknown."""
    if not isinstance(d, dict) or not _is_int(d.get("rank")):
        return None
    groups = []
    for g in d.get("groups") if isinstance(d.get("groups"), list) else ():
        if isinstance(g, dict) and all(_is_int(g.get(k)) for k in ("pg", "enqueued", "completed")):
            groups.append(slots.CollectiveGroup(g["pg"], g["enqueued"], g["completed"], _get(g, "last_op", str, "")))
    return RankRow(
        rank=d["rank"], local_rank=_get(d, "local_rank", int, 0), node=_get(d, "node", str, ""),
        pid=_get(d, "pid", int, 0), restart=_get(d, "restart", int, 0), step=_get(d, "step", int, 0),
        step_source=_get(d, "step_source", str, "counted"), loss=_num(d, "loss"),
        grad_norm=_num(d, "grad_norm"), step_s=_num(d, "step_s"), compute_s=_num(d, "compute_s"),
        phase=_get(d, "phase", str, "init"), last_progress_s=_num(d, "last_progress_s", 0.0),
        last_step_s=_num(d, "last_step_s", 0.0), phase_s=_num(d, "phase_s", 0.0),
        heartbeat_age_s=_num(d, "heartbeat_age_s"), cpu_s=_num(d, "cpu_s"),
        py_collectives=_get(d, "py_collectives", int, 0), batches=_get(d, "batches", int, 0),
        groups=tuple(groups[: slots.MAX_GROUPS]),
        lr=_num(d, "lr"), loss_scale=_num(d, "loss_scale"), zero_grad_frac=_num(d, "zero_grad_frac"),
        phase_times={p: v for p in PHASE_TIMES
                     if (v := _num(d.get("phase_times") if isinstance(d.get("phase_times"), dict) else {}, p))
                     is not None},
    )


def rows_from_json(data: Any) -> list[dict]:
    """The valid rank records of a telemetry.json `ranks` list, re-encoded."""
    rows = [from_json(d) for d in data] if isinstance(data, list) else []
    return [r.to_json() for r in rows if r is not None]
