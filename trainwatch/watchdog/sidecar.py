"""The node sidecar: reads every rank's slot several times a second, runs the
detectors, records incidents and serves metrics. One process per node, started
by `trainwatch launch`; it never touches the ranks except to read their slots,
sample their stacks with py-spy, or ask them (through the slot) for a checkpoint.

The tick only detects. An incident is printed and recorded the moment it is
found; capturing stacks, the verdict, the emergency checkpoint and the restart
request run on the responder's thread, so detection, the history and the
exporter never freeze behind a capture.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable, Iterator

from trainwatch import kinds, procctl, rankrow, records, slots, state
from trainwatch.diagnostics.goodput import Goodput
from trainwatch.watchdog import cadence, otel, thresholds
from trainwatch.watchdog.config import SidecarConfig
from trainwatch.watchdog.detectors import default_detectors
from trainwatch.watchdog.detectors.base import RankExit, TickView, rank_exit_from_line as _rank_exit
from trainwatch.watchdog.engine import DetectorEngine
from trainwatch.watchdog.aggregates import PhaseClock
from trainwatch.watchdog.exporter import StepHistogram, TrainwatchCollector, serve_metrics
from trainwatch.watchdog.hardware import HardwareMonitor
from trainwatch.watchdog.history import HistoryWriter
from trainwatch.watchdog.incident import Incident
from trainwatch.jobstore import JobStore, RecordSeal, read_secret
from trainwatch.usage import printable
from trainwatch.watchdog.inprocess import recovered_by
from trainwatch.watchdog.jobwide import JobWideNode, job_scope
from trainwatch.watchdog.goodput import GoodputFeed
from trainwatch.watchdog.recovery import RestartTracker
from trainwatch.watchdog.responder import Responder, ResponderContext, Response, RestartGate, generation_of
from trainwatch.watchdog.revisions import Revisions
from trainwatch.watchdog.writer import BackgroundWriter, TickGate, snapshot_job, submit_writes

log = logging.getLogger("trainwatch.sidecar")


class Sidecar:
    def __init__(
        self,
        job: str, segment_path: str, *, node: str | None = None, config: SidecarConfig | None = None,
        clock: Callable[[], float] = time.monotonic, detectors: list | None = None, out=None, respond: bool = False,
        tracer: Any = None, run: str = "", launcher_pid: int | None = None, jobstore: JobStore | None = None,
        aggregate: bool = False,
    ):
        self.job = job
        self.run_id = run
        self.launcher_pid = launcher_pid
        self.orphaned = threading.Event()
        """Set when the launcher died (the kernel's parent-death signal)."""
        self.node = node or socket.gethostname()
        self.config = config or SidecarConfig()
        self.segment = slots.Segment(segment_path)
        self.clock = clock
        self.out = out if out is not None else sys.stdout
        self.dir = state.JobDir(job)
        self.last_table = None
        self.last_restarting = False
        """Whether the agent was restarting the workers as of the last read (control/restarting)."""
        self._full_table = None
        self._reads = 0
        self._incident_seq = 0
        self.last_nodes: list[str] = []
        self.incident_counts: dict[str, int] = {}
        self.incidents: list[Incident] = []
        self.open: dict[str, Incident] = {}
        """Open incidents (by id), until resolved."""
        self._open_keys: dict[str, str] = {}
        """Engine key -> id of the open incident this node's engine raised."""
        self.step_hist = StepHistogram()
        self.phase_clock = PhaseClock()
        self.exits_read = 0  # bytes of control/exits.jsonl read so far
        self.last_exits: list[RankExit] = []
        self.states = procctl.ProcessStates()
        self._hardware: list = []
        detectors = detectors if detectors is not None else default_detectors(self.config.detectors)
        self.thresholds = thresholds.Persisted(self.dir.thresholds_file, detectors, clock)  # learnt, kept across runs
        # Multi-node: this node watches its own ranks; the job-scope detectors
        # run once for the whole job, on the aggregator (trainwatch.watchdog.jobwide).
        self.jobwide = JobWideNode(self, jobstore, aggregate, detectors) if jobstore is not None else None
        if jobstore is not None:
            detectors = job_scope(detectors, aggregator=False)
        self.engine = DetectorEngine(detectors, config=self.config.engine)
        self.tracer = tracer
        self.recovery = RestartTracker(self.dir, clock)
        self.goodput = GoodputFeed(clock)  # where the job's wall time went, from this sidecar's start
        self.gate = RestartGate(self.config.actions, clock, launcher_pid)
        self.responder: Responder | None = None
        self.revisions = Revisions(self)  # what the stacks revised of an open incident
        if respond:
            self.responder = Responder(self.config.actions, ResponderContext(
                job=self.dir, segment=self.segment, node=self.node, run=run, incidents=lambda: list(self.open.values()),
                thresholds=self.thresholds_in_force,
                add_timings=self.goodput.timings_to(self.recovery.add_timings), out=self.out, tracer=tracer,
                single_node=self.jobwide is None, recovered=recovered_by(self.gate, self.goodput, self.recovery),
                revised=self.revisions.add, withdrawn=self.revisions.withdrawn))
        # ~1 sample/s of every rank for `trainwatch report`; bounded in size.
        self.history = HistoryWriter(self.dir.history_file(self.node), clock=clock)
        self.tick_gate = TickGate()  # the writer thread gives way while a tick runs

    # ---- what the exporter reads ------------------------------------------------------

    def job_metrics(self) -> Iterator:
        return self.jobwide.job_metrics() if self.jobwide is not None else iter(())

    def straggler_ratios(self) -> dict[int, float]:
        det = self.engine.detector("straggler")
        return det.current_ratios() if det is not None else {}

    def restarts(self) -> int:
        restarts = (self.dir.read_job() or {}).get("restarts", 0)
        return restarts if isinstance(restarts, int) else 0

    def preempted(self) -> dict | None:
        return (self.dir.read_job() or {}).get("preempted")  # trainwatch_preempted: the launcher's record

    def hardware_metrics(self) -> Iterator:
        for source in self._hardware:
            yield from source.metrics(self.job, self.node)

    def add_hardware(self, source: Any) -> None:
        self._hardware.append(source)

    # ---- one round ------------------------------------------------------------------

    def read(self):
        table = self.segment.read_table(previous=self._full_table)
        self._full_table = table
        self._reads += 1
        self.segment.acknowledge_read(table)
        alive = table["pid"] > 0
        live = table if alive.all() else table[alive]  # every slot written: no second copy
        self.last_table = live
        self.last_nodes = [self.node] * len(live)
        self.step_hist.observe(live)
        self.phase_clock.observe(live, self.clock())
        if len(live):
            self.goodput.read(live, self.segment.nslots)
            restart = self.recovery.observe(live)
            if restart is not None:
                self.record_recovery(restart)
        return live

    def rows(self) -> list:
        """The last read as RankRows (the one decoder every reader shares)."""
        if self.last_table is None:
            return []
        return rankrow.decode(self.last_table, self.clock(), self.last_nodes)

    def snapshot(self) -> list[dict]:
        """Per-rank view of the last read, JSON-ready (for telemetry.json and diagnose)."""
        return rankrow.rows_json(self.rows())

    def write_snapshot(self) -> None:
        """telemetry.json from the last read, written now (the loop writes it on its writer thread)."""
        self.snapshot_job()()

    def snapshot_job(self) -> Callable[[], None]:
        return snapshot_job(self)

    def thresholds_in_force(self) -> dict:
        """The hang thresholds the detector holds now (floor, k and each rank's
        step-time threshold), so `diagnose` judges with the same numbers."""
        det = self.engine.detector("hang")
        if det is None and self.jobwide is not None and self.jobwide.aggregator is not None:
            det = self.jobwide.aggregator.engine.detector("hang")
        table = self.last_table
        if det is None or table is None or not hasattr(det, "thresholds_in_force"):
            return {}
        try:  # the responder's thread asks too: a round that races the tick's growth says nothing
            return {"hang": det.thresholds_in_force(table["rank"])}
        except (IndexError, ValueError):
            return {}

    def goodput_now(self) -> Goodput | None:
        """The job's goodput so far; None on a node that does not aggregate a multi-node job (counted once)."""
        return self.goodput.account() if self.jobwide is None or self.jobwide.aggregator is not None else None

    def read_exits(self) -> list[RankExit]:
        """Rank exits the agent reported since the last read (control/exits.jsonl)."""
        path = self.dir.exits_file
        try:
            if os.stat(path).st_size <= self.exits_read:
                return []
            with open(path, "rb") as f:
                f.seek(self.exits_read)
                data = f.read()
        except OSError:
            return []
        # Only whole lines: a line being written is read next time.
        end = data.rfind(b"\n") + 1
        self.exits_read += end
        exits = []
        for line in data[:end].splitlines():
            exit_ = _rank_exit(line, self.node, self.run_id)
            if exit_ is not None:
                exits.append(exit_)
        return exits

    def tick(self) -> list:
        # Looked at before the read: when it says no restart, the read holds the new workers' slots.
        self.last_restarting = self.dir.restarting_file.exists()
        table = self.read()
        self.last_exits = self.read_exits()
        view = TickView(now=self.clock(), table=table, nodes=self.last_nodes, proc_state=self.states,
                        exits=self.last_exits)
        # Hardware faults (NVML, kernel log) go through the engine too: one lifecycle for every incident.
        extra = [i for source in self._hardware for i in source.poll_incidents(self)]
        quiet = {"a restart under way": kinds.RESTART_QUIET} if self.last_restarting else None
        new = list(self.engine.tick(view, extra=extra, causes=quiet))
        for incident in new:
            self.emit(incident)
        self.revisions.apply()
        for res in self.engine.take_resolved():
            self.resolve(self._open_keys.pop(res.incident.key, None), res.duration_s, res.count, res.reason)
        if self.jobwide is not None:
            self.jobwide.round(bool(new))
        return new

    def record_recovery(self, restart: Incident) -> dict:
        """A restarted worker group is back to training: an action of the incident
        it restarted for (not an incident of its own), recorded and said once."""
        restart.id = f"{self.node}-{os.getpid()}-restart-{restart.evidence.get('restart')}"
        restart.node, restart.job = self.node, self.job
        cause = restart.evidence.get("cause_id")
        if cause:
            restart.incident = str(cause)
        record = restart.to_json()
        self.dir.append_event(record)
        self.incidents.append(restart)
        self.goodput.recovered(restart, str(cause) if cause else None)
        about = f" after {restart.evidence.get('cause')} {cause}" if cause else ""
        print(f"[trainwatch] RECOVERED{about}: {record.get('summary', '')}", file=self.out, flush=True)
        return record

    def resolve(self, incident_id: str | None, duration_s: float, count: int, reason: str) -> None:
        """An open incident is over: recorded (a `resolved` record naming it) and said."""
        incident = self.open.pop(incident_id, None) if incident_id else None
        if incident is None:
            return
        self.goodput.resolved(incident_id)
        self.dir.append_event({"kind": "resolved", "incident": incident_id, "time": time.time(),
                               "duration_s": round(duration_s, 3), "count": count, "reason": reason})
        print(f"[trainwatch] RESOLVED {incident.kind} {incident_id} after {duration_s:.1f}s ({reason})",
              file=self.out, flush=True)

    def open_incidents(self) -> list[Incident]:
        """Open incidents this node counts (for trainwatch_incident_open): a job
        incident is counted by the aggregator's node alone, so it pages once."""
        counted = self.jobwide is None or self.jobwide.aggregator is not None
        return [i for i in self.open.values() if counted or i.scope != "job"]

    def emit(self, incident: Incident) -> dict:
        """Record, print and hand on an incident, at once: the response follows."""
        self._incident_seq += 1
        if incident.id is None:
            incident.id = f"{self.node}-{os.getpid()}-{self._incident_seq}"
        if incident.opened_time is None:
            incident.opened_time = time.time()
        incident.node = self.node if incident.node is None else incident.node
        incident.job = self.job if incident.job is None else incident.job
        record = incident.to_json()
        table = self.last_table
        generation = generation_of(table)
        restart, why = self.revisions.gate(incident, record, table, generation)
        if restart or why:
            incident.restart = records.RestartDecision(restart, why or None)
            record = incident.to_json()
        if restart or (record.get("kind") == "crash" and not self.recovery.has_fault()):
            self.recovery.note_fault(record, table)
        elif record.get("kind") == "loss_nan" and not self.recovery.has_fault():
            self.recovery.note_fault(record, table, tentative=True)  # the trainer's --nan-policy fail stops it
        self.dir.append_event(record)
        # A job incident taken from the store carries the aggregator's clock.
        self.goodput.opened(incident, table, incident.scope == "job" and (
            self.jobwide is None or self.jobwide.aggregator is None))
        kind = incident.kind
        # A job incident is counted by the aggregator's node alone: alerts on the
        # counters fire once per job, not once per node that took it.
        if incident.scope != "job" or self.jobwide is None or self.jobwide.aggregator is not None:
            self.incident_counts[kind] = self.incident_counts.get(kind, 0) + 1
        self.open[incident.id] = incident
        if incident.scope != "job":
            self._open_keys[incident.key] = incident.id
        self.incidents.append(incident)
        culprits = ",".join(str(r) for r in incident.culprit_ranks) or "-"
        if incident.scope == "job" and incident.nodes:
            culprits += f" on node {','.join(incident.nodes)}"
        # Summaries carry what ranks and logs said (op names, errors): never raw to the terminal.
        print(printable(f"[trainwatch] INCIDENT {kind} culprit rank(s) {culprits}: {incident.summary}"
                        + (f" (runbook: trainwatch runbook {incident.runbook})" if incident.runbook else "")
                        + f" [{incident.id}]", newlines=False), file=self.out, flush=True)
        if why:
            print(printable(f"[trainwatch] {why}", newlines=False), file=self.out, flush=True)
        span = self.tracer.start(record) if self.tracer is not None else None
        if self.responder is not None:
            self.responder.submit(Response(record, restart, generation, span))
        elif span is not None:
            self.tracer.finish(span, {})
        return record

    def run(self, stop: threading.Event, writer: BackgroundWriter | None = None) -> None:
        # One bad round is logged and never ends the loop. Files are written on the
        # writer thread: at thousands of ranks they take longer than a tick.
        writer = writer if writer is not None else BackgroundWriter()
        # What exists now lives as long as the process: the cycle collector need not walk
        # it again (at thousands of ranks a full collection is a pause of hundreds of ms).
        gc.freeze()
        interval_s = self.config.tick_s
        rounds = cadence.Cadence(interval_s, self.config.quiet_ticks)
        next_at = time.monotonic()
        last_snapshot = -float("inf")
        while not stop.is_set():
            if self.launcher_pid and not procctl.parent_alive(self.launcher_pid):
                # The launcher died without stopping us: its metrics would go
                # stale and its restart requests nobody's. Stop.
                print("[trainwatch] the launcher is gone; the sidecar stops", file=self.out, flush=True)
                break
            try:
                if rounds.due(lambda: cadence.between(self)):
                    self.tick_started(time.monotonic())
                    with self.tick_gate.ticking():
                        self.tick()
                    rounds.busy = cadence.following(self, rounds)
                    due = time.monotonic() - last_snapshot >= writer.spacing("snapshot", self.config.snapshot_s)
                    submit_writes(self, writer, snapshot=due)
                    if due:
                        last_snapshot = time.monotonic()
            except Exception:
                log.exception("trainwatch sidecar: tick failed")
            next_at += rounds.interval()
            delay = next_at - time.monotonic()
            if delay < 0:
                next_at = time.monotonic()
                delay = 0
            stop.wait(delay)
        try:  # one last round (exits reported as the job ended), then the final state
            self.tick()
            for incident_id, record in list(self.open.items()):
                if record.scope == "job" and (self.jobwide is None or self.jobwide.aggregator is None):
                    continue  # the aggregator's node closes job incidents
                opened = record.opened_time
                self.resolve(incident_id, time.time() - opened if opened is not None else 0.0, 1, "the job ended")
            submit_writes(self, writer, snapshot=True, force=True)
            if not writer.close():
                log.warning("trainwatch sidecar: the final snapshot was still being written when it stopped")
            if (goodput := self.goodput_now()) is not None and goodput.wall_s > 0:
                print(f"[trainwatch] {goodput.line()}", file=self.out, flush=True)
            self.thresholds.maybe_save(force=True)
            launcher_alive = not self.orphaned.is_set() and (
                not self.launcher_pid or procctl.parent_alive(self.launcher_pid))
            if self.jobwide is not None and not self.jobwide.store_failed and launcher_alive:
                self.jobwide.publish(final=True)  # a node that ends is not a node lost (one whose launcher died is)
        except Exception:
            log.exception("trainwatch sidecar: final snapshot failed")
        if self.responder is not None:
            self.responder.close()

    def tick_started(self, at: float) -> None:
        """Called at the start of every round of run() (its monotonic time); a hook for measuring the period."""

    def close(self) -> None:
        self.states.close()
        for source in self._hardware:
            try:
                source.close()
            except Exception:
                pass
        if self.tracer is not None:
            self.tracer.shutdown()


def start_metrics_server(sidecar: Sidecar, host: str, port: int) -> str | None:
    server = serve_metrics(TrainwatchCollector(sidecar), host, port)
    return f"{host}:{server.server_port}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="trainwatch-sidecar")
    p.add_argument("--job", required=True)
    p.add_argument("--slots", required=True)
    p.add_argument("--node", default=socket.gethostname())
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.add_argument("--metrics-port", type=int, default=-1, help="-1 disables the exporter; 0 picks a free port")
    p.add_argument("--config", default=None, help="the SidecarConfig JSON the launcher wrote")
    p.add_argument("--run", default="", help="the run's id: only its records are read")
    p.add_argument("--launcher-pid", type=int, default=None, help="stop when this parent is gone")
    p.add_argument("--store", default=None, help="HOST:PORT of the rendezvous store (multi-node job)")
    p.add_argument("--store-namespace", default="", help="the job's rendezvous id (same on every node)")
    p.add_argument("--aggregate", action="store_true", help="run the job-wide detectors (the rendezvous host)")
    p.add_argument("--job-secret-file", default=None, help="the job's secret: seals trainwatch's store records")
    args = p.parse_args(argv)
    if args.launcher_pid:
        # SIGHUP, not SIGTERM: the launcher stops us with SIGTERM when the job
        # ends; its death (whatever its threads still do) must read differently.
        procctl.die_with_parent(signal.SIGHUP, args.launcher_pid)
    logging.basicConfig(level=logging.WARNING, format="[trainwatch-sidecar] %(levelname)s %(message)s")
    try:
        config = SidecarConfig.read(args.config) if args.config else SidecarConfig()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    stop = threading.Event()
    orphaned = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: (orphaned.set(), stop.set()))

    tracer = otel.IncidentTracer.from_env(job=args.job, node=args.node)
    jobstore = None
    if args.store:
        try:
            seal = RecordSeal(read_secret(secret_file=args.job_secret_file, environ={}))
            jobstore = JobStore(args.store, args.store_namespace or args.job, seal=seal)
            jobstore.register(args.node)
        except Exception as e:
            print(f"[trainwatch] job-wide view off: cannot reach the rendezvous store {args.store} ({e}); "
                  "this node watches its own ranks only", flush=True)
            jobstore = None
    sidecar = Sidecar(args.job, args.slots, node=args.node, config=config, respond=True, tracer=tracer, run=args.run,
                      launcher_pid=args.launcher_pid, jobstore=jobstore, aggregate=args.aggregate)
    try:  # NVML and the kernel log; injected Xid/ECC faults come in as a fake GPU
        sidecar.add_hardware(HardwareMonitor.for_job(sidecar.config, sidecar.segment.nslots))
    except Exception:  # hardware checks are an extra; never let them stop the watchdog
        log.exception("trainwatch: hardware checks off")
    address = None
    if args.metrics_port >= 0:
        try:
            address = start_metrics_server(sidecar, args.metrics_host, args.metrics_port)
        except OSError as e:
            print(f"[trainwatch] metrics exporter off: cannot bind {args.metrics_host}:{args.metrics_port} "
                  f"({e.strerror})", flush=True)
    state.write_json_atomic(sidecar.dir.sidecar_file,
                            {"pid": os.getpid(), "metrics": address, "node": args.node, "started": time.time()})
    sidecar.orphaned = orphaned
    sidecar.run(stop)
    sidecar.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
