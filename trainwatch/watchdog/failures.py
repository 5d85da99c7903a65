"""Whether a restart can fix a failed worker group.

A rank whose program raised records the exception (type, the message's last
line, the user's file:line, the step) in the job's errors file just before it
exits (trainwatch.rank.bootstrap, the trainer). The agent reads the records of
the failed generation before it restarts:

- an exception before the rank's first step (an ImportError, a SyntaxError, a
  missing file, a bad argument, a port in use) fails the same way on every
  attempt: it is deterministic;
- so is the same exception type and message at the same step as in the
  generation before: the restart replayed it;
- lost peers, connection and store errors, timeouts and out-of-memory are
  transient: they keep the restart budget, as do deaths by signal (no record).

Deterministic failures are not restarted: the job exits as torchrun would,
and the summary quotes the exception's last line with its rank and file:line.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from trainwatch import state

TRANSIENT_TYPES = frozenset({
    "DistNetworkError", "DistStoreError", "DistBackendError", "TimeoutError", "ConnectionError",
    "ConnectionResetError", "ConnectionRefusedError", "ConnectionAbortedError", "BrokenPipeError",
    "OutOfMemoryError", "ChildFailedError",
})
"""Exception types a restart can fix (a peer or the network failed, memory was short once)."""
TRANSIENT_MARKERS = (
    "Connection closed by peer", "Connection reset by peer", "Connection refused", "Broken pipe", "timed out",
    "Timed out", "timeout", "communicator was aborted", "NCCL Error", "ncclSystemError", "ncclRemoteError",
    "remote process exited", "network error", "out of memory", "Socket Timeout", "ECONNRESET", "ECONNREFUSED",
)
"""Words of a transient failure in an exception's message, whatever its type."""
DETERMINISTIC_MARKERS = ("EADDRINUSE", "address already in use", "Address already in use")
"""Words that make a failure deterministic even in a transient type: a port in use stays in use."""
MAX_BYTES = 4 << 20
"""The most of the errors file read (each rank writes one line per failure)."""


@dataclass(frozen=True, slots=True)
class RankFailure:
    """One rank's recorded exception."""

    rank: int
    """Global rank."""
    generation: int
    """Worker generation (0: the first start, one more per restart)."""
    step: int
    """The last step the rank finished (0: none)."""
    stepped: bool
    """Whether the rank finished any step in this generation."""
    type: str
    """The exception's class name."""
    message: str
    """The last line of its message."""
    where: str
    """The user's file:line it was raised from ('' when unknown)."""

    @classmethod
    def from_json(cls, data: object) -> RankFailure | None:
        """A record of the errors file, or None for anything of another shape."""
        if not isinstance(data, dict):
            return None
        ints = [data.get(k) for k in ("rank", "generation", "step")]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints):
            return None
        text = [data.get(k) for k in ("type", "message", "where")]
        if not all(isinstance(v, str) for v in text) or not isinstance(data.get("stepped"), bool):
            return None
        return cls(rank=ints[0], generation=ints[1], step=ints[2], stepped=data["stepped"], type=text[0][:200],
                   message=text[1][:1000], where=text[2][:500])

    @property
    def line(self) -> str:
        """The exception's last line as Python prints it."""
        return f"{self.type}: {self.message}" if self.message else self.type

    def describe(self) -> str:
        return f"rank {self.rank}" + (f" ({self.where})" if self.where else "") + f": {self.line}"

    @property
    def transient(self) -> bool:
        text = f"{self.type}: {self.message}"
        if any(m in text for m in DETERMINISTIC_MARKERS):
            return False
        return self.type in TRANSIENT_TYPES or any(m in text for m in TRANSIENT_MARKERS)


def read_failures(path: Path, run: str) -> list[RankFailure]:
    """Every record of run `run` in the errors file, in order; lines that do not parse are skipped."""
    try:
        raw = Path(path).read_bytes()[:MAX_BYTES]
    except OSError:
        return []
    out = []
    for line in raw.decode("utf-8", "replace").splitlines():
        try:
            data = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(data, dict) and data.get("run") == run and (rec := RankFailure.from_json(data)):
            out.append(rec)
    return out


def deterministic(failures: list[RankFailure], generation: int) -> tuple[RankFailure, str] | None:
    """(the failure, why) when generation `generation` failed in a way a restart
    replays; None when a restart may fix it (or nothing was recorded)."""
    current = [f for f in failures if f.generation == generation]
    earlier = {(f.type, f.message, f.step) for f in failures if f.generation < generation}
    for f in current:
        if f.transient or f.type == NONFINITE_END:
            continue
        if not f.stepped:
            return f, "before its first step"
        if (f.type, f.message, f.step) in earlier:
            return f, f"again at step {f.step} after a restart"
    return None


NONFINITE_END = "NonFiniteEnd"
"""A rank's record that its last reported loss or grad norm was NaN/inf (written as it exits)."""


def nonfinite_end(job_dir: state.JobDir, table, nslots: int, run: str) -> str | None:
    """Why a job that exited 0 did not succeed: a rank whose last reported loss
    is NaN/inf, as the rank recorded on exit or a loss_nan incident of this run
    said (a slot's NaN alone may be a loss never reported). None when every
    last loss is finite."""
    bad = {int(table["rank"][i]): (float(table["loss"][i]), int(table["step"][i]))
           for i in range(nslots) if table["pid"][i] > 0 and table["step"][i] > 0
           and not math.isfinite(float(table["loss"][i]))}
    live = [int(table["restart"][i]) for i in range(nslots) if table["pid"][i] > 0]
    last = max(live, default=0)  # an earlier worker generation's end does not count
    named = {f.rank for f in read_failures(job_dir.errors_file, run) if f.type == NONFINITE_END
             and f.generation == last}
    start = state.finite_number((job_dir.read_job() or {}).get("start_time")) or 0.0
    for incident in job_dir.incidents() if bad else ():
        if incident.get("kind") == "loss_nan" and _when(incident.get("time")) >= start:
            named.update(r for r in incident.get("culprit_ranks") or [] if isinstance(r, int) and r in bad)
    if not named:
        return None
    rank = min(named)
    loss, step = bad.get(rank, (math.nan, 0))
    return f"rank {rank}'s last reported loss is {loss} (step {step}; loss_nan)"


def _when(iso: object) -> float:
    from datetime import datetime

    try:
        return datetime.fromisoformat(str(iso)).timestamp()
    except ValueError:
        return 0.0
