"""One rank as every reader sees it: the single decoder of a slot table.

The sidecar's snapshot (telemetry.json), the exporter, the history, `diagnose`
and the verdict all read ranks through `decode()`, so a slot field is turned
into a number in one place, and a field added to the slot layout is added here
once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

from trainwatch import codec, slots


@dataclass(frozen=True, slots=True)
class RankRow:
    """One consistent read of one rank. Durations are seconds before `now`."""

    rank: int
    local_rank: int = 0
    node: str = ""
    pid: int = 0
    restart: int = 0
    """The worker group generation (torchelastic's restart count) this process belongs to."""
    step: int = 0
    """Last completed step (0: none yet)."""
    step_source: str = "counted"
    """'reported' (the script's own step numbers, trainer API) or 'counted'
    (optimizer steps trainwatch counted since this process started)."""
    loss: float | None = None
    grad_norm: float | None = None
    step_s: float | None = None
    """Duration of the last step."""
    compute_s: float | None = None
    phase: str = "init"
    last_progress_s: float = 0.0
    """Since the last progress of any kind: a step, a batch, an eval forward."""
    last_step_s: float = 0.0
    """Since the last completed step (or the process start before the first)."""
    phase_s: float = 0.0
    """Time in the current phase."""
    heartbeat_age_s: float | None = None
    """Since the rank's background thread last ran (None before its first beat)."""
    cpu_s: float | None = None
    """Process CPU time at the last heartbeat."""
    py_collectives: int = 0
    batches: int = 0
    groups: tuple[slots.CollectiveGroup, ...] = field(default_factory=tuple)
    lr: float | None = None
    """Learning rate of the optimizer's first param group at the last step."""
    loss_scale: float | None = None
    """GradScaler's loss scale (fp16 mixed precision) at the last step."""
    zero_grad_frac: float | None = None
    """Fraction of gradient elements exactly zero at the last step."""
    phase_times: dict[str, float] = field(default_factory=dict)
    """Seconds of the last step spent in 'data', 'backward' and 'optimizer' (those known)."""
    state: str | None = None
    """What `diagnose` (or a capture) saw of the process: its state (running,
    sleeping, stopped, zombie, gone), `remote` (another node's rank), `exited`
    (a finished job); None: not looked at. Not in telemetry.json."""
    capture_error: str | None = None
    """Why py-spy could not sample it, if it was asked to. Not in telemetry.json."""

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
        out = codec.encode(self) | {"collectives": self.collectives}
        for name in ("state", "capture_error"):  # what diagnose saw, only where it looked
            if out[name] is None:
                del out[name]
        return out


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


PAUSE_EVERY = 256
"""Rows decoded (or encoded) between two calls of a `pause` callback."""


def decode(table, now: float, nodes: Sequence[str] | str = "",
           pause: Callable[[], object] | None = None) -> list[RankRow]:
    """Live rows (pid > 0) of a slot table as RankRows, sorted by rank.
    pause: called every PAUSE_EVERY rows (a writer thread giving way to the
    sidecar's detection loop)."""
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
        if pause is not None and i and not i % PAUSE_EVERY:
            pause()
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


def rows_json(rows: Iterable[RankRow], pause: Callable[[], object] | None = None) -> list[dict]:
    out = []
    for i, r in enumerate(rows):
        if pause is not None and i and not i % PAUSE_EVERY:
            pause()
        out.append(r.to_json())
    return out


def from_json(d: Any) -> RankRow | None:
    """A RankRow from telemetry.json (written by a sidecar, read by anyone):
    None for a record without an integer rank; wrong-typed fields read as
    unknown (their defaults)."""
    row = codec.decode(RankRow, d)
    if row is None:
        return None
    times = {p: v for p, v in row.phase_times.items() if p in PHASE_TIMES}
    if len(row.groups) > slots.MAX_GROUPS or len(times) != len(row.phase_times):
        row = replace(row, groups=row.groups[: slots.MAX_GROUPS], phase_times=times)
    return row


def rows_from_json(data: Any) -> list[RankRow]:
    """The valid rank records of a telemetry.json `ranks` list."""
    rows = [from_json(d) for d in data] if isinstance(data, list) else []
    return [r for r in rows if r is not None]
