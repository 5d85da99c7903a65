"""The launcher's agent: torchelastic's LocalElasticAgent plus trainwatch's hooks.

Subclassing (rather than wrapping) torchelastic keeps its rendezvous, restart
budget and worker shutdown semantics; we only add: fresh telemetry slots per
start, pid bookkeeping in job.json, exit reports for the sidecar, a supervised
sidecar, and sidecar-requested restarts through torchelastic's own restart path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import logging
import os
import signal
import socket
import sys
import time
from typing import Any, Callable, Iterator

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from trainwatch import codec, env, messages, records, slots, state
from trainwatch.records import JobStatus
from trainwatch.diagnostics import preemption
from trainwatch.launcher import failures, warmstart
from trainwatch.launcher.backoff import Backoff, BackoffDecision, Cause, crash_cause, incident_cause
from trainwatch.watchdog.checkpointing import request_emergency_checkpoint
from trainwatch.watchdog.rankexit import RankExit
from trainwatch.usage import printable

log = logging.getLogger("trainwatch")

USAGE_EXIT = 2
"""Exit code of a worker that cannot go on as set up (trainwatch's and argparse's usage errors)."""
TEARDOWN_S = 5.0
"""Grace a worker gets after SIGTERM before SIGKILL (torchelastic waits 30 s). Its
state was already saved by the emergency checkpoint; waiting longer only delays
the restart."""
_SHUTDOWN_TAKES_TIMEOUT = "timeout" in inspect.signature(LocalElasticAgent._shutdown).parameters
"""torch 2.13's agent takes a teardown grace; some other releases (2.11) do not."""


@contextlib.contextmanager
def held_signals(signals: frozenset[int] | set[int]) -> Iterator[list[int]]:
    """Hold `signals` while the block runs: each one that comes is noted in the
    list yielded, not acted on; the handlers before are back afterwards. Off
    the main thread (where handlers cannot be set) it holds nothing."""
    during: list[int] = []
    before = {}
    try:
        for sig in signals:
            before[sig] = signal.signal(sig, lambda signum, _frame: during.append(signum))
    except ValueError:
        pass
    try:
        yield during
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


class TrainwatchAgent(LocalElasticAgent):
    def __init__(self, *args: Any, job: str, segment: slots.Segment, run_id: str = "", sidecar: Any = None,
                 on_event: Callable[[str, dict], None] | None = None, emergency_timeout_s: float = 10.0,
                 zygote: warmstart.Zygote | None = None, preempt_signals: frozenset = frozenset(),
                 preempt_grace_s: float = 30.0, node: str | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.job = job
        self.run_id = run_id
        self.segment = segment
        self.sidecar = sidecar
        self.node = node or socket.gethostname()
        """This node's name (`--node-name`, else the hostname): in job.json, exits and crash texts."""
        self._on_event = on_event or (lambda kind, data: None)
        self.restart_count = 0
        self.dir = state.JobDir(job)
        self.backoff = Backoff()
        self._failed = False
        self._cause: Cause | None = None
        """Whether the running worker group failed (else a restart is torchelastic's, for a node that
        joins), and of what (for the backoff; None: unknown)."""
        self.emergency_timeout_s = emergency_timeout_s
        self._survivors_saved = -1
        self._usage_failures = 0
        self._first_failed: set[int] = set()
        self._early_exits: set[int] = set()
        """Local ranks that exited 0 without finishing while their peers ran (see _checkpoint_survivors)."""
        self._reported_early: set[int] = set()
        """Pids of failed workers already written to exits.jsonl (before the survivors' checkpoint)."""
        self.zygote = zygote
        """Warm start: workers are forked from it (None: fresh interpreters, as torchrun)."""
        self.preempt_signals = preempt_signals
        """Signals that mean preemption: checkpoint every rank before stopping (signal numbers)."""
        self.preempt_grace_s = preempt_grace_s
        self.preempted: dict | None = None
        """What the preemption checkpoint did (None: not preempted)."""
        self.fatal: tuple[failures.RankFailure, str] | None = None
        """The deterministic failure that ended the job (not restarted), and why it is one."""

    # ---- worker lifecycle ---------------------------------------------------------

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        # A restarted worker must not inherit its predecessor's step or phase.
        for i in range(self.segment.nslots):
            self.segment.clear(i)
        self._early_exits = set()
        if self.zygote is not None and not self.zygote.alive():
            print("[trainwatch] the warm-start process exited; starting a new one", flush=True)
            self.zygote = warmstart.Zygote(self.zygote.preload, self.zygote.entry, self.zygote.job)
            self.zygote.start()
        try:
            with warmstart.using(self.zygote):
                pids = super()._start_workers(worker_group)
            self.backoff.workers_started()
        finally:
            self._restarting(False)  # the slots were cleared: the sidecar reads only the new workers from here
        ranks = [
            {
                "rank": w.global_rank,
                "local_rank": w.local_rank,
                "node": self.node,
                "pid": pids.get(w.local_rank),
            }
            for w in worker_group.workers
        ]
        self.dir.update_job(
            status=JobStatus.RUNNING,
            ranks=ranks,
            world_size=worker_group.workers[0].world_size if worker_group.workers else 0,
            restarts=self.restart_count,
            workers_started_time=time.time(),
        )
        self._on_event("workers_started", {"ranks": ranks})
        return pids

    def _restarting(self, on: bool) -> None:
        """Tell the sidecar a restart is under way, from the teardown until the
        new workers started (control/restarting): meanwhile the slots hold the
        stopped workers' last words and the job-scope detectors judge nothing."""
        try:
            if on:
                self.dir.restarting_file.touch(mode=0o600)
            else:
                self.dir.restarting_file.unlink(missing_ok=True)
        except OSError:
            pass

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        # Only torchelastic's own handling of a signal to the launcher is a
        # preemption (a restart stops its workers with SIGTERM too).
        handling = sys.exc_info()[1]
        if type(handling).__name__ == "SignalException" and int(death_sig) in self.preempt_signals \
                and self.preempted is None:
            self._checkpoint_for_preemption(signal.Signals(death_sig))
        # A stopped worker (SIGSTOP, a debugger, job control) never handles
        # SIGTERM; continue it first so it can exit within the grace.
        for pid in self._worker_pids():
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
        if _SHUTDOWN_TAKES_TIMEOUT:
            super()._shutdown(death_sig, min(timeout, TEARDOWN_S))
            return
        # A torch whose agent closes its workers with its own fixed grace:
        # close them with ours first; its own close then finds them gone.
        pcontext = getattr(self, "_pcontext", None)
        if pcontext is not None:
            pcontext.close(death_sig, min(timeout, TEARDOWN_S))
        super()._shutdown(death_sig)

    def _checkpoint_for_preemption(self, sig: signal.Signals) -> None:
        """A scheduler's notice (SIGTERM, Slurm's SIGUSR1): every rank that
        registered state writes the state of its last step, within the grace,
        before any rank is signalled. Ranks without state are said, not waited for."""
        from trainwatch.watchdog.checkpointing import describe

        t0 = time.monotonic()
        print(f"[trainwatch] {sig.name}: preemption; asking every rank for an emergency checkpoint "
              f"(grace {self.preempt_grace_s:g}s)", flush=True)
        self.dir.update_job(status=JobStatus.STOPPING)
        handlers = getattr(getattr(self, "_pcontext", None), "subprocess_handlers", None) or {}

        def running(local_rank: int) -> bool:
            handler = handlers.get(local_rank)
            return handler is None or handler.proc.poll() is None

        signalled = time.time()
        # A second notice (schedulers repeat SIGTERM; a person presses Ctrl-C)
        # must not cut the checkpoint short: it is held, and the stop goes on after.
        with held_signals(self.preempt_signals | {int(signal.SIGINT)}) as during:
            try:
                result = request_emergency_checkpoint(self.segment, self.preempt_grace_s, alive=running)
            except Exception as e:  # the stop goes on whatever the checkpoint did
                result = {"requested": [], "no_state": [], "written": {}, "failed": {}, "step": None,
                          "seconds": round(time.monotonic() - t0, 3), "skipped": f"{type(e).__name__}: {e}"}
        said = describe(result)
        if result.get("no_state") and not result.get("written"):
            said += ("; nothing was saved: the script registers no state (tw.register_state), so its work since "
                     "its own last checkpoint is lost")
        if during:
            print(f"[trainwatch] preemption: {len(during)} more stop signal(s) held until the checkpoint was done",
                  flush=True)
        print(f"[trainwatch] preemption: {said}", flush=True)
        self.preempted = preemption.record(sig.name, result, said, time.monotonic() - t0, signalled, len(during))
        self.dir.update_job(preempted=self.preempted)  # diagnose and the metrics say it while the job stops
        self._on_event("preempted", self.preempted)

    def _worker_pids(self) -> list[int]:
        pcontext = getattr(self, "_pcontext", None)
        if pcontext is None:
            return []
        try:
            return [int(p) for p in pcontext.pids().values() if p]
        except Exception:
            return []

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        """torchelastic's own restart (stop, re-rendezvous, start), timed for the
        sidecar's recovery breakdown, with backoff so a job caught in a crash
        loop does not flap (`launcher.backoff`); the console says why it waits or not."""
        decision = (self.backoff.next(self._cause, self._slot_steps()[0]) if self._failed else BackoffDecision(
            0.0, False, "no failure on this node: the nodes meet again (another node restarts or joins)"))
        self._failed, self._cause, backoff = False, None, decision.wait_s
        self.restart_count += 1
        os.environ[env.GENERATION] = str(self.restart_count)  # the workers started below inherit it
        print(printable(f"[trainwatch] restarting worker group (restart {self.restart_count}/"
                        f"{worker_group.spec.max_restarts}, {decision.describe()})", newlines=False), flush=True)
        t0 = time.monotonic()
        self._restarting(True)
        self.dir.update_job(status=JobStatus.RESTARTING)
        self._stop_workers(worker_group)
        t1 = time.monotonic()
        if backoff:
            time.sleep(backoff)
        worker_group.state = WorkerState.STOPPED
        self._initialize_workers(worker_group)  # rendezvous + start, as torchelastic does
        t2 = time.monotonic()
        state.write_json_atomic(
            self.dir.restart_timing_file,
            {"restart": self.restart_count, "stop_begin": t0, "stop_end": t1, "backoff_s": backoff,
             "backoff_reason": decision.reason,
             "workers_started": t2, "rendezvous_s": round(t2 - t1 - backoff, 3),
             "warm": bool(warmstart.timings.get("warm")), "start_s": warmstart.timings.get("start_s")},
        )
        self._on_event("restarted", {"restart": self.restart_count})

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        self._checkpoint_survivors()
        result = super()._monitor_workers(worker_group)
        if self.sidecar is not None:
            self.sidecar.ensure_running()
        if result.state == WorkerState.FAILED:
            self._report_exits(worker_group, result)
            self._failed, self._cause = True, self._crash_cause(result)
            self._stop_on_deterministic_error()
            self._stop_on_repeated_usage_error(result)
        elif result.state == WorkerState.HEALTHY:
            request = self._take_restart_request()
            if request is not None:
                log.warning("trainwatch: restarting worker group: %s", request.reason)
                self._failed, self._cause = True, incident_cause(request.kind, self._slot_steps()[1])
                self._on_event("restart_requested", codec.encode(request))
                return RunResult(state=WorkerState.UNHEALTHY)
        return result

    def _slot_steps(self) -> tuple[bool, dict[int, int]]:
        """(whether any rank of the running worker group completed a step, each
        rank's last step), from the slots, which hold them until the next start."""
        try:
            table = self.segment.read_table()
        except (OSError, ValueError):
            return True, {}  # unknown: never a reason to wait
        rows = table[(table["pid"] > 0) & (table["restart"] == self.restart_count)]
        return bool((rows["first_step"] > 0).any()), {int(r): int(s) for r, s in zip(rows["rank"], rows["step"])}

    def _crash_cause(self, result: RunResult) -> Cause | None:
        """The cause of this crash (backoff.crash_cause) from the ranks that failed first."""
        first = {rank: f.exitcode for rank, f in result.failures.items() if f.local_rank in self._first_failed}
        first = first or {rank: f.exitcode for rank, f in result.failures.items()}
        recorded = [f for f in failures.read_failures(self.dir.errors_file, self.run_id)
                    if f.generation == self.restart_count]
        return crash_cause(recorded, first, self._slot_steps()[1])

    def _stop_on_deterministic_error(self) -> None:
        """A rank's exception that a restart would replay (see launcher.failures):
        no restart, one line naming it."""
        found = failures.deterministic(failures.read_failures(self.dir.errors_file, self.run_id), self.restart_count)
        if found is None:
            return
        self.fatal = found
        failure, why = found
        if self._remaining_restarts > 0:
            print(f"[trainwatch] not restarting: {failure.describe()} ({why}; a restart would fail the same way)",
                  flush=True)
        self._remaining_restarts = 0

    def _stop_on_repeated_usage_error(self, result: RunResult) -> None:
        """A worker that exits with code 2 says the job cannot go on as set up
        (a bad flag, a full disk, a checkpoint that does not fit): restarting
        replays it. It gets one restart (the cause may have been transient),
        never a second into the same failure."""
        # The ranks that failed first say why; the others fail because a peer left.
        codes = ({f.exitcode for f in result.failures.values() if f.local_rank in self._first_failed}
                 or {f.exitcode for f in result.failures.values()})
        if codes != {USAGE_EXIT}:
            return
        if self._usage_failures and self._remaining_restarts > 0:
            usage = sorted(r for r, f in result.failures.items() if f.exitcode == USAGE_EXIT)
            print(f"[trainwatch] rank{'s' if len(usage) > 1 else ''} {','.join(map(str, usage))} failed with exit code "
                  f"{USAGE_EXIT} again after a restart (their own error line above says why); not restarting "
                  "into the same failure", flush=True)
            self._remaining_restarts = 0
        self._usage_failures += 1

    def _finished(self, local_rank: int) -> bool:
        """Whether a rank's slot says it finished (its exit hooks set phase 'done')."""
        try:
            table = self.segment.read_table()
        except (OSError, ValueError):
            return True
        rows = table[(table["local_rank"] == local_rank) & (table["pid"] > 0)]
        return not len(rows) or bool((rows["phase"] == slots.PHASE_CODES["done"]).all())

    def _report_exits(self, worker_group: WorkerGroup, result: RunResult) -> None:
        by_rank = {w.global_rank: w for w in worker_group.workers}
        lines = []
        for w in worker_group.workers:
            if w.local_rank in self._early_exits and w.global_rank not in result.failures:
                line = exit_line(w.global_rank, w.local_rank, w.id or 0, 0, node=self.node, run=self.run_id,
                                 first=True)
                lines.append(line | {"early": True})
        for rank, failure in result.failures.items():
            worker = by_rank.get(rank)
            local_rank = worker.local_rank if worker else failure.local_rank
            lines.append(exit_line(rank, local_rank, failure.pid, failure.exitcode, node=self.node, run=self.run_id,
                                   first=local_rank in self._first_failed))
        mark_peer_lost(lines, self.dir.errors_file, self.run_id, self.restart_count)
        for line in lines:
            if line["pid"] not in self._reported_early:
                state.append_line(self.dir.exits_file, json.dumps(line))
        self._on_event("workers_failed", {"exits": lines})

    def _checkpoint_survivors(self) -> None:
        """When a rank has died, torchelastic's next poll stops every worker. Before
        that, ask the survivors (through their slots) to write the state they staged
        at their last step, so the restart loses nothing."""
        if self._survivors_saved == self.restart_count:
            return
        handlers = getattr(self._pcontext, "subprocess_handlers", None) or {}
        try:
            codes = {lr: h.proc.poll() for lr, h in handlers.items()}
        except AttributeError:  # a torch without subprocess handlers: nothing to do early
            return
        alive_now = [lr for lr, code in codes.items() if code is None]
        failed_now = any(code not in (None, 0) for code in codes.values())
        for lr, code in codes.items():
            # Exit 0 with its exit hooks never run (os._exit(0)) while peers still
            # train (or fail for want of it, both seen in one poll): the peers
            # will fail or stall because of it.
            if code == 0 and (alive_now or failed_now) and lr not in self._early_exits and not self._finished(lr):
                self._early_exits.add(lr)
        if not failed_now:
            return
        self._survivors_saved = self.restart_count
        # Dead while the others still run: the root cause, whatever follows (a
        # rank that left early before them is the cause of their failure).
        failed = {lr for lr, code in codes.items() if code not in (None, 0)}
        self._first_failed = self._early_exits or failed
        # Said at once, before the survivors' checkpoint (seconds): the sidecar
        # records the crash now, not when torchelastic's poll reports it; a rank
        # that left early is said first, so its peers' failures read as its victims.
        by_local = {w.local_rank: w for w in self._worker_group.workers}
        early_lines = []
        for lr in sorted(self._early_exits) + sorted(failed):
            worker, pid = by_local.get(lr), getattr(handlers[lr].proc, "pid", None)
            if worker is not None and isinstance(pid, int) and pid not in self._reported_early:
                self._reported_early.add(pid)
                line = exit_line(worker.global_rank, lr, pid, codes[lr], node=self.node, run=self.run_id,
                                 first=lr in self._first_failed)
                if lr in self._early_exits:
                    line["early"] = True
                early_lines.append(line)
        mark_peer_lost(early_lines, self.dir.errors_file, self.run_id, self.restart_count)
        for line in early_lines:
            state.append_line(self.dir.exits_file, json.dumps(line))
        alive = [lr for lr, code in codes.items() if code is None]
        if not alive:
            return
        def running(local_rank: int) -> bool:
            return handlers[local_rank].proc.poll() is None

        # Only survivors that registered state are asked (none: back at once);
        # one that exits while waited on is waited on no longer.
        result = request_emergency_checkpoint(self.segment, self.emergency_timeout_s, local_ranks=alive,
                                              alive=running)
        # Every rank asked failed to write: each said why in its own line already.
        said = result.get("failed") and not result.get("written") and set(result["failed"].values()) == {"write failed"}
        if result["requested"] and not said:
            from trainwatch.watchdog.checkpointing import describe

            print(printable(f"[trainwatch] survivors: {describe(result)}", newlines=False), flush=True)
        self._on_event("survivors_checkpointed", result)

    def _take_restart_request(self) -> messages.RestartRequest | None:
        if not self.dir.restart_request_file.exists():
            return None
        raw = state.read_json(self.dir.restart_request_file)
        try:
            os.unlink(self.dir.restart_request_file)  # taken once, read or not
        except OSError:
            pass
        request = codec.decode(messages.RestartRequest, raw)
        if raw is None:
            return None
        if request is None:
            log.warning("trainwatch: ignoring a restart request that is not one (%s)",
                        printable(str(raw)[:200], newlines=False))
        elif request.run != self.run_id:
            log.warning("trainwatch: ignoring a restart request of another run of this job (%s)", request.reason)
        elif request.generation != self.restart_count:
            log.warning("trainwatch: ignoring a restart request for an earlier worker group (%s)", request.reason)
        else:
            return request
        return None


def exit_line(rank: int, local_rank: int, pid: int, exitcode: int, *, node: str, run: str, first: bool) -> dict:
    """One record of exits.jsonl (what the sidecar's exit detector reads): a RankExit, with its run and time."""
    record = dataclasses.replace(RankExit.from_exitcode(rank=rank, local_rank=local_rank, pid=pid,
                                                        exitcode=int(exitcode), node=node), first=first)
    return codec.encode(record) | {"run": run, "time": time.time()}


def mark_peer_lost(lines: list[dict], errors_file, run: str, generation: int) -> None:
    """Exits whose rank recorded a lost peer as its error: victims, not culprits;
    exits by the job's own policy (a non-finite loss): that incident's action,
    not a crash (exits.py)."""
    failing = [line for line in lines if isinstance(line.get("exitcode"), int) and line["exitcode"] > 0]
    if not failing:
        return
    lost, stopped = failures.exit_causes(errors_file, run, generation)
    for line in failing:
        if line["rank"] in lost:
            line["peer_lost"] = True
        elif line["rank"] in stopped:
            line["policy_stop"] = True
