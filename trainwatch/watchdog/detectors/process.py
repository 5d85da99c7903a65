"""Rank processes that will never step again, read from the kernel's process
state instead of waited out.

A stopped rank (`/proc` state T: SIGSTOP, job control) and a zombie (state Z:
it exited, or its main thread ended while other threads run on, and nobody
reaped it) are visible the moment they happen, while the hang detector needs
its floor (5 s) of no progress to call them. Each tick this detector reads the
state of every local rank's pid once (a few microseconds each) and reports a rank
seen in one of these states for `confirm_s`: a stopped rank as a `hang` (key
`hang:<ranks>`, the same as the hang detector's, so its later report of the
same stall is the same incident), a zombie as a `crash` (key
`crash:<rank>@<pid>`, the same as the exit detector's when the exit arrives).
A rank that exited is reported by the exit detector from the agent's exit
record; one whose slot says it finished (`done`) is never a fault.

Only the node's own sidecar runs it: the pids of other nodes mean nothing
here (the view of a multi-node aggregator has no process probe).
"""

from __future__ import annotations

import numpy as np

from trainwatch import slots
from trainwatch.watchdog.detectorconfig import ProcessStateConfig
from trainwatch.watchdog.detectors.base import Detector, TickView, phase_name
from trainwatch.watchdog.incident import Incident, describe_ranks

_DONE = slots.PHASE_CODES["done"]
_FAULT_STATES = ("stopped", "zombie")


class ProcessStateDetector(Detector):
    """Reports ranks whose process is stopped (a `hang`) or a zombie (a `crash`)."""

    name = "process_state"

    def __init__(self, config: ProcessStateConfig | None = None):
        self.config = config or ProcessStateConfig()
        self._since: dict[tuple[int, str], float] = {}
        """(pid, state) -> when this detector first saw the pid in that state (monotonic s)."""
        self._reported: set[tuple[int, str]] = set()

    def check(self, view: TickView) -> list[Incident]:
        probe = view.proc_state
        t = view.table
        if probe is None or not len(t):
            self._since.clear()
            self.busy = False
            return []
        now = view.now
        seen: dict[tuple[int, str], float] = {}
        rows: dict[str, list[int]] = {s: [] for s in _FAULT_STATES}
        live = np.nonzero(t["phase"] != _DONE)[0]
        # Each process read once a tick, whatever number of slots name it.
        slots_of: dict[int, list[int]] = {}
        for row, pid in zip(live.tolist(), t["pid"][live].tolist()):
            slots_of.setdefault(pid, []).append(row)
        for pid, pid_rows in sorted(slots_of.items()):
            state = probe(pid)
            if state not in _FAULT_STATES:
                continue
            key = (pid, state)
            seen[key] = self._since.get(key, now)
            if now - seen[key] >= self.config.confirm_s - 1e-9 and key not in self._reported:
                rows[state].extend(pid_rows)
        self._since = seen
        self.busy = bool(seen)  # a state to confirm, or one reported and still there
        self._reported &= set(seen)  # a pid that left the state may enter it again
        out = []
        if rows["stopped"]:
            out.append(self._stopped(view, rows["stopped"]))
        out.extend(self._zombie(view, r) for r in rows["zombie"])
        for state, found in rows.items():
            self._reported.update((int(t["pid"][r]), state) for r in found)
        return out

    def _facts(self, view: TickView, r: int, state: str) -> dict:
        t = view.table
        return {"pid": int(t["pid"][r]), "state": state, "step": int(t["step"][r]),
                "phase": phase_name(t["phase"][r]), "node": view.nodes[r] if view.nodes else "",
                "for_s": round(view.now - self._since[(int(t["pid"][r]), state)], 3)}

    def _stopped(self, view: TickView, rows: list[int]) -> Incident:
        t = view.table
        ranks = sorted(int(t["rank"][r]) for r in rows)
        others = sorted(int(x) for x in t["rank"] if int(x) not in ranks)
        pids = ",".join(str(int(t["pid"][r])) for r in rows)
        one = len(ranks) == 1
        text = (f"hang: {describe_ranks(ranks)} (pid{'' if one else 's'} {pids}) {'is' if one else 'are'} stopped "
                f"(process state T: SIGSTOP or job control) at step {int(t['step'][rows].max())}; it runs no "
                f"further and its peers wait for it")
        return Incident(
            kind="hang", culprit_ranks=ranks, victims=others, summary=text, runbook="stopped",
            category="stopped",
            evidence={"pattern": "stopped", "source": "process_state", "step": int(t["step"][rows].max()),
                      "culprits": {int(t["rank"][r]): self._facts(view, r, "stopped") for r in rows}},
            key="hang:" + ",".join(map(str, ranks)), detected_mono=view.now)

    def _zombie(self, view: TickView, r: int) -> Incident:
        t = view.table
        rank, pid = int(t["rank"][r]), int(t["pid"][r])
        text = (f"crash: rank {rank} (pid {pid}) is a zombie (process state Z: it exited, or its main thread "
                f"ended while other threads run on) at step {int(t['step'][r])}, without finishing")
        return Incident(
            kind="crash", culprit_ranks=[rank], summary=text,
            category="child_failed",
            evidence={"source": "process_state", "exits": [{"rank": rank, "pid": pid, "node": view.nodes[r]
                                                             if view.nodes else "", "state": "zombie"}],
                      "culprits": {rank: self._facts(view, r, "zombie")}},
            key=f"crash:{rank}@{pid}", detected_mono=view.now)
