"""Crashes: rank processes that exited with an error or were killed.

When one rank fails, the launcher stops the survivors with SIGTERM (then
SIGKILL). Those exits are consequences of the first failure, so within
`collateral_s` of a failure they are listed as its victims instead of being
reported as crashes of their own. A teardown signal with no failure before
it (the OOM killer's SIGKILL, a preemption's SIGTERM) is the fault itself.
"""

from __future__ import annotations

from trainwatch.watchdog.detectorconfig import ExitConfig
from trainwatch.watchdog.detectors.base import Detector, RankExit, TickView
from trainwatch.watchdog.incident import Incident, describe_ranks


class ExitDetector(Detector):
    """Reports a `crash` incident for the rank processes that failed: one per way
    of failing (a signal, an exit code), naming every rank that failed so."""

    name = "exits"

    def __init__(self, config: ExitConfig | None = None):
        self.config = config or ExitConfig()
        self._last_failure: float | None = None

    def check(self, view: TickView) -> list[Incident]:
        failed = [e for e in view.exits if e.failed]
        if not failed:
            return []
        # A rank whose collective failed because a peer went away is that
        # peer's victim: never a culprit, whatever order the exits came in.
        lost = [e for e in failed if e.peer_lost and e.signal_name is None]
        # Ranks that stopped by the job's own policy (a non-finite loss): the
        # loss_nan incident already tells that story; their stop is its action.
        stopped = [e for e in failed if e.policy_stop and e.signal_name is None and e not in lost]
        failed = [e for e in failed if e not in lost and e not in stopped]
        # Nothing here failed of its own (only the launcher's teardown of the
        # rest): the policy stop or the lost contact is all there is to this node's story.
        own = [e for e in failed if e.first or e.signal_name not in self.config.teardown_signals]
        if stopped and not own:
            self._last_failure = view.now
            return []
        recent = self._last_failure is not None and view.now - self._last_failure < self.config.collateral_s
        if (lost and not own) or not failed:
            if recent:
                return []
            self._last_failure = view.now
            return [self._lost_contact(view, lost + failed)]
        found = self._causes(view, failed, recent)
        for inc in found:
            inc.victims = sorted(set(inc.victims) | {e.rank for e in lost})
            if lost:
                inc.summary += f"; {describe_ranks(e.rank for e in lost)} lost contact with it"
        return found

    def _causes(self, view: TickView, failed: list[RankExit], recent: bool) -> list[Incident]:
        teardown = [e for e in failed if e.signal_name in self.config.teardown_signals]
        primary = [e for e in failed if e.signal_name not in self.config.teardown_signals]
        if any(e.first for e in failed):
            # The launcher saw these die while their peers still ran.
            primary = [e for e in failed if e.first]
            teardown = [e for e in failed if not e.first]
        elif not primary and len({e.signal_name for e in teardown}) > 1:
            # One batch with SIGKILL and SIGTERM: the launcher SIGTERMs the
            # survivors, so the odd one out is the fault.
            stop = self.config.teardown_signals[0]
            primary = [e for e in teardown if e.signal_name != stop]
            teardown = [e for e in teardown if e.signal_name == stop]
        if primary:
            self._last_failure = view.now
            victims = [e.rank for e in teardown]
            # Ranks that ended the same way at once (every rank raising the same
            # error before its first step) are one fault: one incident naming them all.
            alike: dict[tuple, list[RankExit]] = {}
            for e in primary:
                alike.setdefault((e.signal_name, e.exitcode, e.early), []).append(e)
            return [self._crash(view, group, victims) for group in alike.values()]
        if recent:
            return []
        self._last_failure = view.now
        return [self._crash(view, teardown, [])]

    def _lost_contact(self, view: TickView, exits: list[RankExit]) -> Incident:
        """Only victims failed here: the rank they lost is elsewhere (another
        node, whose watchdog or the job's aggregator names it)."""
        inc = self._crash(view, exits, [])
        nodes = sorted({e.node for e in exits if e.node})
        inc.culprit_ranks, inc.victims = [], sorted(e.rank for e in exits)
        inc.summary = (f"crash: {describe_ranks(inc.victims)}{' on ' + ','.join(nodes) if nodes else ''} lost "
                       f"contact with a peer that went away (its connection closed): the fault is not here; the "
                       f"rank or node that failed first is the cause (see its node's incidents, or node_lost)")
        inc.evidence["peer_lost"] = True
        inc.key = "peer_lost:" + inc.key
        return inc

    def _crash(self, view: TickView, exits: list[RankExit], victims: list[int]) -> Incident:
        first = exits[0]
        where = f"pid {first.pid}" if len(exits) == 1 else "pids " + ",".join(str(e.pid) for e in exits)
        nodes = sorted({e.node for e in exits if e.node})
        if nodes:
            where += f" on {','.join(nodes)}"
        if first.signal_name:
            how = f"{'was' if len(exits) == 1 else 'were'} killed by {first.signal_name}"
        elif first.early:
            how = (f"exited with code 0 before finishing (its exit hooks never ran: os._exit?) while its peers "
                   f"still trained")
        else:
            how = f"exited with code {first.exitcode}"
        text = f"crash: {describe_ranks(e.rank for e in exits)} ({where}) {how}"
        if victims:
            text += f"; {describe_ranks(victims)} stopped as a consequence"
        return Incident(
            kind="crash",
            culprit_ranks=[e.rank for e in exits],
            victims=victims,
            summary=text,
            category="child_failed",
            evidence={
                "exits": [
                    {"rank": e.rank, "local_rank": e.local_rank, "node": e.node, "pid": e.pid,
                     "exitcode": e.exitcode, "signal": e.signal_name}
                    for e in exits
                ],
            },
            key="crash:" + ",".join(f"{e.rank}@{e.pid}" for e in exits),
            detected_mono=view.now,
        )
