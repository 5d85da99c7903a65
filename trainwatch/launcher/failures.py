"""Whether a restart can fix a failed worker group.

A rank whose program raised records the exception (type, the message's last
line, the user's file:line, the step) in the job's errors file just before it
exits (trainwatch.rank.bootstrap, the trainer). The agent reads the records of
the failed generation before it restarts:

- an exception before the rank's first step (an ImportError, a SyntaxError, a
  missing file, a bad argument, a port in use) fails the same way on every
  attempt: it is deterministic;
- so is the same exception again after a restart: the same type, the same
  message once its volatile parts are masked (addresses, pids, times: see
  `crash_message`) and the same raising file:line (the innermost frame of the
  user's code). The step is left out: a script that resumes from its own
  checkpoint reaches the same line at another step of trainwatch's count
  (which starts at 0 in every process). A record without a file:line (the
  integrated trainer's) is compared by type, message and step instead;
- lost peers, connection and store errors, timeouts and out-of-memory are
  transient: they keep the restart budget, as do deaths by signal (no record).

Deterministic failures are not restarted: the job exits as torchrun would,
and the summary quotes the exception's last line with its rank and file:line.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from trainwatch import codec, state
from trainwatch.codec import check

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
PEER_LOST_MARKERS = (
    "Connection closed by peer", "Connection reset by peer", "Broken pipe", "communicator was aborted",
    "remote process exited", "ncclRemoteError", "NCCL Error 6", "ECONNRESET",
)
"""Words of a collective that failed because another rank (here or on another node) went away:
the rank that says them is a victim of that rank, not a fault of its own."""
POLICY_STOP_TYPES = ("NonFiniteLoss",)
"""Exceptions a rank raises on purpose to stop training by the job's own policy
(the integrated trainer's --nan-policy fail): the stop is an action of the
incident that called for it (loss_nan), not a crash of that rank."""
DETERMINISTIC_MARKERS = ("EADDRINUSE", "address already in use", "Address already in use")
"""Words that make a failure deterministic even in a transient type: a port in use stays in use."""
MAX_BYTES = 4 << 20
"""The most of the errors file read (each rank writes one line per failure)."""


@dataclass(frozen=True, slots=True)
class RankFailure:
    """One rank's recorded exception."""

    rank: int = field(metadata=check(min=0))
    """Global rank."""
    generation: int = field(metadata=check(min=0))
    """Worker generation (0: the first start, one more per restart)."""
    step: int = field(metadata=check(min=0))
    """The last step the rank finished (0: none)."""
    stepped: bool
    """Whether the rank finished any step in this generation."""
    type: str = field(metadata=check(max_len=200))
    """The exception's class name."""
    message: str = field(metadata=check(max_len=1000))
    """The last line of its message."""
    where: str = field(metadata=check(max_len=500))
    """The user's file:line it was raised from ('' when unknown)."""

    @classmethod
    def from_json(cls, data: object) -> RankFailure | None:
        """A record of the errors file, or None for anything of another shape."""
        return codec.decode(cls, data)

    @property
    def identity(self) -> tuple[str, str, str | int]:
        """What makes two records the same crash: (type, masked message, file:line),
        or (type, masked message, step) when the file:line is unknown."""
        return self.type, crash_message(self.message), self.where or self.step

    @property
    def line(self) -> str:
        """The exception's last line as Python prints it."""
        return f"{self.type}: {self.message}" if self.message else self.type

    def describe(self) -> str:
        return f"rank {self.rank}" + (f" ({self.where})" if self.where else "") + f": {self.line}"

    @property
    def peer_lost(self) -> bool:
        """Failed because another rank went away (its connection closed, its communicator aborted)."""
        text = f"{self.type}: {self.message}"
        return any(m in text for m in PEER_LOST_MARKERS)

    @property
    def transient(self) -> bool:
        text = f"{self.type}: {self.message}"
        if any(m in text for m in DETERMINISTIC_MARKERS):
            return False
        return self.type in TRANSIENT_TYPES or any(m in text for m in TRANSIENT_MARKERS)


def peer_lost_ranks(path: Path, run: str, generation: int) -> set[int]:
    """Ranks of generation `generation` whose recorded failure is a lost peer."""
    return {f.rank for f in read_failures(path, run) if f.generation == generation and f.peer_lost}


def exit_causes(path: Path, run: str, generation: int) -> tuple[set[int], set[int]]:
    """(ranks that lost a peer, ranks stopped by the job's own policy) of generation `generation`."""
    found = [f for f in read_failures(path, run) if f.generation == generation]
    return {f.rank for f in found if f.peer_lost}, {f.rank for f in found if f.type in POLICY_STOP_TYPES}


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
    earlier = {f.identity for f in failures if f.generation < generation}
    for f in current:
        if f.transient or f.type == NONFINITE_END:
            continue
        if not f.stepped:
            return f, "before its first step"
        if f.identity in earlier:
            return f, ("again from the same line after a restart" if f.where
                       else f"again at step {f.step} after a restart")
    return None


# Parts of a message that differ between two runs of the same failing line.
# Each pattern is linear (no nested repetition): the message came from a rank.
_VOLATILE = (
    (re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"), "<uuid>"),
    (re.compile(r"\b0x[0-9a-fA-F]+"), "0x<addr>"),
    (re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?"), "<time>"),
    (re.compile(r"\b\d{2}:\d{2}:\d{2}(?:[.,]\d+)?\b"), "<time>"),
    (re.compile(r"\b1\d{9}\.\d+\b"), "<time>"),  # time.time() printed: seconds since 1970, with a fraction
    (re.compile(r"(?i)\b(pid|tid|process|thread)([ :=#]{0,3})\d+"), r"\1\2<n>"),
    (re.compile(r"(\d{1,3}(?:\.\d{1,3}){3}\]?|localhost):\d+"), r"\1:<port>"),
    (re.compile(r"\btmp[a-z0-9_]{8}\b"), "tmp<name>"),  # tempfile's names
)


def crash_message(message: str) -> str:
    """An exception's message with what differs between two runs of the same
    failing line masked: addresses (`<object at 0x7f..>`), pids and thread ids,
    times, uuids, ephemeral ports, temporary file names. Numbers that are the
    program's own (a shape, a step, a rank) stay: they tell failures apart."""
    text = message[:1000]
    for pattern, mask in _VOLATILE:
        text = pattern.sub(mask, text)
    return text


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
        if incident.kind == "loss_nan" and _when(incident.time) >= start:
            named.update(r for r in incident.culprit_ranks if r in bad)
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


STORE_GONE_MARKERS = (
    "Connection refused", "Connection reset", "Broken pipe", "failed to connect", "Failed to connect",
    "connection to the C10d store has failed", "ECONNREFUSED", "ECONNRESET", "Socket closed", "recvValue failed",
)
"""Words of a rendezvous store that no longer answers (its host is gone), not of a wait that ran out."""


def rendezvous_lost(e: BaseException, endpoint: str) -> tuple[bool, str]:
    """Why the nodes did not meet again, in words: (the rendezvous host is gone, what to say)."""
    seen, chain, x = set(), [], e
    while x is not None and id(x) not in seen and len(chain) < 8:
        seen.add(id(x))
        chain.append(f"{type(x).__name__}: {x}")
        x = x.__cause__ or x.__context__
    text = " | ".join(chain)
    if type(e).__name__ != "RendezvousTimeoutError" and (
            type(e).__name__ == "RendezvousConnectionError" or any(m in text for m in STORE_GONE_MARKERS)):
        return True, (f"the rendezvous host {endpoint} no longer answers: the node holding the job's store (node "
                      "rank 0's launcher) was lost, and the other nodes cannot meet again without it; launch the "
                      "job again with --rdzv-endpoint on a live node")
    return False, "a node was lost and no replacement joined within the rendezvous timeout (--rdzv-timeout)"
