"""A rank process that ended: the record the launcher's agent appends to the
job's exits.jsonl for each rank exit, and the sidecar's reader of it (what its
exit detector and the engine see). Both processes use it, so it lives apart
from the detectors.
"""

from __future__ import annotations

import dataclasses
import json
import signal as _signal
from dataclasses import dataclass

from trainwatch import codec


@dataclass(frozen=True, slots=True)
class RankExit:
    """A rank process that ended, as seen by the launcher or sidecar."""

    rank: int
    """Global rank."""
    local_rank: int
    """Rank index on its node."""
    pid: int
    """Process id of the exited rank."""
    exitcode: int
    """Exit status; negative -N when killed by signal N (torchelastic's convention)."""
    signal_name: str | None = None
    """'SIGSEGV' etc. when killed by a signal, else None."""
    node: str = ""
    """Node label of the rank."""
    first: bool = False
    """True when the launcher saw this rank dead while its peers still ran: the root cause."""
    early: bool = False
    """Exited with code 0 before it finished (its exit hooks never ran, as after
    os._exit(0)) while its peers still ran: they fail or stall for want of it."""
    peer_lost: bool = False
    """Its recorded error says another rank went away (a connection closed by
    its peer, an aborted communicator): a victim of that rank, here or on
    another node, not a fault of its own."""
    policy_stop: bool = False
    """It stopped on purpose, by the job's own policy (the trainer's
    --nan-policy fail after a non-finite loss): an action of that incident."""

    @classmethod
    def from_exitcode(cls, *, rank: int, local_rank: int, pid: int, exitcode: int, node: str = "") -> RankExit:
        """Build from a raw exit status, naming the signal for negative codes."""
        name = None
        if exitcode < 0:
            try:
                name = _signal.Signals(-exitcode).name
            except ValueError:
                name = f"signal {-exitcode}"
        return cls(rank=rank, local_rank=local_rank, pid=pid, exitcode=exitcode, signal_name=name, node=node)

    @property
    def failed(self) -> bool:
        return self.exitcode != 0 or self.signal_name is not None or self.early


def rank_exit_from_line(line: bytes, node: str, run: str = "") -> RankExit | None:
    """One line of exits.jsonl (the agent's record of a rank exit) as a RankExit;
    None for a line of the wrong shape or of another run."""
    try:
        e = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(e, dict) or (run and e.get("run") != run):
        return None
    found = codec.decode(RankExit, e)
    if found is not None and not isinstance(e.get("node"), str):
        found = dataclasses.replace(found, node=node)
    return found
