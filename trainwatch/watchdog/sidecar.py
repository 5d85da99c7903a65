"""The node sidecar: reads every rank's slot ~10x a second, runs the detectors,
records incidents and serves metrics. One process per node, started by
`trainwatch launch`; it never touches the ranks except to read their slots,
sample their stacks with py-spy, or ask them (through the slot) for a checkpoint.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from trainwatch import rankrow, slots, state

log = logging.getLogger("trainwatch.sidecar")

TICK_INTERVAL_S = 0.15
"""Seconds between detector rounds (~7 a second). Hang thresholds are seconds,
so a shorter interval buys little latency; at 8 ranks a round costs ~1 ms of
CPU, and this keeps the watchdog under 1% of a core."""
SNAPSHOT_INTERVAL_S = 2.0
"""Seconds between telemetry.json snapshots (what `diagnose` reads for a finished job)."""


def _delta(a, b) -> float | None:
    if a is None or b is None:
        return None
    return round(max(0.0, float(b) - float(a)), 3)


class Sidecar:
    def __init__(
        self,
        job: str,
        segment_path: str,
        *,
        node: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        detectors: list | None = None,
        out=None,
        actions: Any = None,
    ):
        self.job = job
        self.node = node or socket.gethostname()
        self.segment = slots.Segment(segment_path)
        self.clock = clock
        self.out = out if out is not None else sys.stdout
        self.job_dir = state.job_dir(job)
        self.last_table = None
        self._full_table = None
        self._reads = 0
        self._restart_seen = 0
        self._last_step = 0
        self._fault: dict | None = None
        self._gen_ready: float | None = None
        self.last_nodes: list[str] = []
        self.incident_counts: dict[str, int] = {}
        self.incidents: list[dict] = []
        from trainwatch.watchdog.exporter import StepHistogram

        self.step_hist = StepHistogram()
        self._exits_offset = 0
        self._exits_path = self.job_dir / "control" / "exits.jsonl"
        self._hardware: list = []
        self.engine = self._make_engine(detectors)
        self.actions = actions
        self.tracer = None
        from trainwatch.watchdog.history import HistoryWriter, history_path

        # ~1 sample/s of every rank for `trainwatch report`; bounded in size.
        self.history = HistoryWriter(history_path(self.job_dir, self.node), clock=clock)

    # ---- wiring -------------------------------------------------------------------

    def _make_engine(self, detectors: list | None):
        try:
            from trainwatch.watchdog.detectors import default_detectors
            from trainwatch.watchdog.engine import DetectorEngine
        except ImportError:  # detectors not installed: telemetry and metrics only
            return None
        return DetectorEngine(detectors if detectors is not None else default_detectors())

    def straggler_ratios(self) -> dict[int, float]:
        if self.engine is None:
            return {}
        for det in self.engine.detectors:
            fn = getattr(det, "current_ratios", None)
            if fn is not None:
                return fn()
        return {}

    def restarts(self) -> int:
        rec = state.read_json(self.job_dir / "job.json") or {}
        return int(rec.get("restarts", 0) or 0)

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
        self.segment.acknowledge_read(self._reads)
        live = table[table["pid"] > 0]
        if len(live):
            self._track_restarts(live)
        self.last_table = live
        self.last_nodes = [self.node] * len(live)
        self.step_hist.observe(live)
        return live

    # ---- recovery accounting -------------------------------------------------------

    def _track_restarts(self, live) -> None:
        restart = int(live["restart"].max())
        old = live[live["restart"] < restart]
        if restart == self._restart_seen:
            self._last_step = max(self._last_step, int(live["step"].max()))
            return
        new = live[live["restart"] == restart]
        if self._gen_ready is None and not len(old) and (new["phase"] != slots.PHASE_CODES["init"]).all():
            # Every new rank is past start-up (imports, checkpoint load, process group).
            self._gen_ready = self.clock()
        # The new worker group has recovered once every rank finished a step.
        if len(old) or not (new["progress_mono"] > new["start_mono"]).all():
            return
        self._restart_seen = restart
        first_step_done = float(new["progress_mono"].max())
        started = float(new["start_mono"].min())
        timing = state.read_json(self.job_dir / "control" / "restart-timing.json") or {}
        fault = self._fault or {}
        t_fault = fault.get("fault_mono", fault.get("detected_mono"))
        requested = fault.get("requested_mono") or timing.get("stop_begin")
        breakdown = {
            "detect_s": _delta(t_fault, fault.get("detected_mono")),
            "capture_s": fault.get("capture_s", 0.0),
            "checkpoint_s": fault.get("checkpoint_s", 0.0),
            "teardown_s": _delta(requested, timing.get("stop_end")),
            "rendezvous_s": timing.get("rendezvous_s"),
            "load_s": _delta(timing.get("workers_started"), self._gen_ready or started),
            "first_step_s": _delta(self._gen_ready or started, first_step_done),
        }
        recovery_s = _delta(t_fault, first_step_done)
        parts = ", ".join(f"{k[:-2]} {v:.1f}s" for k, v in breakdown.items() if v is not None)
        if (new["step_source"] == slots.STEP_REPORTED).all():
            # The script numbers its steps: its first step after the restart
            # says where it resumed.
            resumed_at = int(new["first_step"][new["first_step"] > 0].min(initial=int(new["step"].min()))) - 1
            lost = max(0, self._last_step - resumed_at)
            where = f"resumed from step {resumed_at} (lost {lost} step{'s' if lost != 1 else ''})"
        else:
            # Zero-code steps are counted from 0 in every new process: where the
            # script resumed is its own checkpoint's business, unknown here.
            resumed_at, lost = None, None
            where = ("the script restarted from its own checkpoint, if it keeps one "
                     "(trainwatch counts its steps from 0 in every new process)")
        from trainwatch.watchdog.incident import Incident

        self.emit(
            Incident(
                kind="restart",
                culprit_ranks=fault.get("culprit_ranks") or [],
                summary=f"restart {restart}: {where}"
                + (f", back to training {recovery_s:.1f}s after the fault" if recovery_s is not None else "")
                + (f" ({parts})" if parts else ""),
                severity="info",
                runbook=None,
                evidence={"restart": restart, "resumed_from_step": resumed_at, "last_step_before": self._last_step,
                          "steps_lost": lost, "recovery_s": recovery_s, "breakdown": breakdown,
                          "cause": fault.get("kind")},
                key=f"restart:{restart}",
                detected_mono=self.clock(),
            )
        )
        self._fault = None
        self._gen_ready = None
        self._last_step = int(new["step"].max())

    def note_fault(self, record: dict, **times: float) -> None:
        """Remember the fault a restart will recover from (for the restart's breakdown)."""
        fault = {"kind": record.get("kind"), "culprit_ranks": record.get("culprit_ranks") or [],
                 "detected_mono": record.get("detected_mono")}
        table = self.last_table
        culprits = set(fault["culprit_ranks"])
        if table is not None and culprits and len(table):
            rows = table[np.isin(table["rank"], list(culprits))]
            if len(rows):
                # The fault began when the culprit last made progress.
                fault["fault_mono"] = float(rows["progress_mono"].min())
        fault.update(times)
        self._fault = fault

    def rows(self) -> list:
        """The last read as RankRows (the one decoder every reader shares)."""
        if self.last_table is None:
            return []
        return rankrow.decode(self.last_table, self.clock(), self.last_nodes)

    def snapshot(self) -> list[dict]:
        """Per-rank view of the last read, JSON-ready (for telemetry.json and diagnose)."""
        return rankrow.rows_json(self.rows())

    def write_snapshot(self) -> None:
        state.write_json_atomic(
            self.job_dir / "telemetry.json", {"node": self.node, "time": time.time(), "ranks": self.snapshot()},
            durable=False,
        )

    def read_exits(self) -> list:
        path = self._exits_path
        try:
            if os.stat(path).st_size <= self._exits_offset:
                return []
            with open(path) as f:
                f.seek(self._exits_offset)
                data = f.read()
                self._exits_offset = f.tell()
        except OSError:
            return []
        exits = []
        for line in data.splitlines():
            try:
                exits.append(json.loads(line))
            except ValueError:
                continue
        return exits

    def tick(self) -> list:
        table = self.read()
        exits = self.read_exits()
        new: list = []
        if self.engine is not None:
            from trainwatch.watchdog.detectors.base import RankExit, TickView

            view = TickView(
                now=self.clock(),
                table=table,
                nodes=self.last_nodes,
                proc_state=process_state,
                exits=[
                    RankExit(
                        rank=e.get("rank"),
                        local_rank=e.get("local_rank"),
                        pid=e.get("pid"),
                        exitcode=e.get("exitcode"),
                        signal_name=e.get("signal_name"),
                        node=e.get("node", self.node),
                        first=bool(e.get("first")),
                    )
                    for e in exits
                ],
            )
            new = list(self.engine.tick(view))
        for source in self._hardware:
            new.extend(source.poll_incidents(self))
        for incident in new:
            self.emit(incident)
        return new

    def emit(self, incident: Any) -> dict:
        record = incident.to_json() if hasattr(incident, "to_json") else dict(incident)
        record.setdefault("time", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        record.setdefault("node", self.node)
        record.setdefault("job", self.job)
        if self.actions is not None:
            try:
                record.update(self.actions.handle(self, incident, record) or {})
            except Exception:
                log.exception("trainwatch: action for %s failed", record.get("kind"))
        if record.get("kind") == "crash" and self._fault is None:
            self.note_fault(record)
        state.append_event(self.job, record)
        kind = record.get("kind", "unknown")
        self.incident_counts[kind] = self.incident_counts.get(kind, 0) + 1
        self.incidents.append(record)
        culprits = ",".join(str(r) for r in record.get("culprit_ranks") or []) or "-"
        print(
            f"[trainwatch] INCIDENT {kind} culprit rank(s) {culprits}: {record.get('summary', '')}"
            + (f" (runbook: trainwatch runbook {record['runbook']})" if record.get("runbook") else ""),
            file=self.out,
            flush=True,
        )
        why = (record.get("restart") or {}).get("why")
        if why:
            print(f"[trainwatch] {why}", file=self.out, flush=True)
        if self.tracer is not None:
            self.tracer.incident(record)
        return record

    def run(self, stop: threading.Event, interval_s: float = TICK_INTERVAL_S) -> None:
        # One bad round is logged and never ends the loop: a watchdog that dies
        # on the first odd slot is worse than none.
        next_at = time.monotonic()
        last_snapshot = 0.0
        while not stop.is_set():
            try:
                self.tick()
                self.history.maybe_sample(self.last_table, self.straggler_ratios)
                if time.monotonic() - last_snapshot >= SNAPSHOT_INTERVAL_S:
                    self.write_snapshot()
                    last_snapshot = time.monotonic()
            except Exception:
                log.exception("trainwatch sidecar: tick failed")
            next_at += interval_s
            delay = next_at - time.monotonic()
            if delay < 0:
                next_at = time.monotonic()
                delay = 0
            stop.wait(delay)
        try:  # one last round (exits reported as the job ended), then the final state
            self.tick()
            self.history.maybe_sample(self.last_table, self.straggler_ratios, force=True)
            self.write_snapshot()
        except Exception:
            log.exception("trainwatch sidecar: final snapshot failed")


def process_state(pid: int) -> str | None:
    """'stopped' for a process in state T/t (SIGSTOP, job control, a debugger),
    'running', 'sleeping', 'disk-sleep' or 'zombie' otherwise; None when gone."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            raw = f.read()
        code = raw[raw.rindex(b")") + 2: raw.rindex(b")") + 3]
    except (OSError, ValueError):
        return None
    return {b"T": "stopped", b"t": "tracing-stop", b"R": "running", b"S": "sleeping", b"D": "disk-sleep",
            b"Z": "zombie"}.get(code, "other")


def start_metrics_server(sidecar: Sidecar, host: str, port: int) -> str | None:
    from prometheus_client import CollectorRegistry, start_http_server

    from trainwatch.watchdog.exporter import TrainwatchCollector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(TrainwatchCollector(sidecar))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return f"{host}:{server.server_port}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="trainwatch-sidecar")
    p.add_argument("--job", required=True)
    p.add_argument("--slots", required=True)
    p.add_argument("--node", default=socket.gethostname())
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.add_argument("--metrics-port", type=int, default=-1, help="-1 disables the exporter; 0 picks a free port")
    p.add_argument("--config", default=None, help="JSON file with sidecar options written by the launcher")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="[trainwatch-sidecar] %(levelname)s %(message)s")
    config = json.loads(Path(args.config).read_text()) if args.config else {}

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    sidecar = Sidecar(args.job, args.slots, node=args.node)
    from trainwatch.watchdog import plugins

    plugins.configure(sidecar, config)
    address = None
    if args.metrics_port >= 0:
        try:
            address = start_metrics_server(sidecar, args.metrics_host, args.metrics_port)
        except OSError as e:
            print(f"[trainwatch] metrics exporter off: cannot bind {args.metrics_host}:{args.metrics_port} ({e.strerror})", flush=True)
    state.write_json_atomic(
        state.job_dir(args.job) / "sidecar.json",
        {"pid": os.getpid(), "metrics": address, "node": args.node, "started": time.time()},
    )
    sidecar.run(stop)
    plugins.shutdown(sidecar)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
