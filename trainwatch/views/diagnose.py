"""`trainwatch diagnose JOB [--json]`: what is wrong with a job, in seconds.

Live job: reads every rank's slot straight from shared memory (works while they
hang), captures every rank's stacks with py-spy in parallel, groups them, and
combines both with the job's incidents into one verdict. Finished job: its last
incident. The JSON shape is the contract in DESIGN.md.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any

import psutil

from trainwatch import codec, jobstore, kinds, liveness, rankrow, records, slots, state
from trainwatch.capture import capture_ranks
from trainwatch.diagnostics import goodput, preemption, utilisation
from trainwatch.diagnostics import verdict as verdict_mod
from trainwatch.diagnostics.rank_summary import SUMMARY_ABOVE, summarise
from trainwatch.diagnostics.stack_groups import StackGroup
from trainwatch.usage import Parser, fail, printable


STARTUP_GRACE_S = 120.0
"""How long ranks may start (import, rendezvous, first step) before diagnose
stops saying `starting` and judges their stacks like any other."""


def job_is_live(job: dict) -> bool:
    return liveness.status_of(job) in liveness.LIVE_STATUSES


def read_ranks(job: dict, job_dir: state.JobDir, telemetry: dict | None = None) -> list[rankrow.RankRow]:
    """Per-rank telemetry: from the live segment when the job runs, else the last
    snapshot (`telemetry`: telemetry.json already read)."""
    rows: list[rankrow.RankRow] = []
    path = job.get("slots")
    if job_is_live(job) and isinstance(path, str):
        try:
            seg = slots.Segment(path)
        except (OSError, ValueError):
            seg = None
        if seg is not None:
            node = job.get("node") if isinstance(job.get("node"), str) else ""
            try:
                rows = rankrow.decode(seg.read_table(), time.monotonic(), node)
            finally:
                seg.close()
    telemetry = job_dir.telemetry() if telemetry is None else telemetry
    if not rows:
        rows = rankrow.rows_from_json(telemetry.get("ranks"))
    # A multi-node job: the other nodes' ranks, as the job-wide view last saw them.
    mine = {r.node for r in rows}
    rows += [r for r in rankrow.rows_from_json(telemetry.get("job_ranks")) if r.node not in mine]
    rows.sort(key=lambda r: r.rank)
    return rows


def launch_marker(job_dir: state.JobDir) -> dict | None:
    """The marker of a launcher that is still starting (see JobDir.announce_launch)."""
    rec = state.read_json(job_dir.launch_file)
    if rec is None:
        return None
    return rec if state.pid_alive(rec.get("launcher_pid")) else None


class RemoteCapture:
    """Stacks of a multi-node job's other nodes: each node's sidecar captures its
    own ranks (py-spy only ever sees local pids) and answers through the store."""

    def __init__(self, store: jobstore.JobStore, n: int, nodes: set[str]):
        self.store, self.n, self.nodes = store, n, nodes

    @classmethod
    def ask(cls, job: dict, remote_rows: list[rankrow.RankRow], job_dir: state.JobDir) -> RemoteCapture | None:
        info = job.get("store") if isinstance(job.get("store"), dict) else {}
        nodes = {r.node for r in remote_rows if r.node}
        if not nodes or not isinstance(info.get("endpoint"), str) or not isinstance(info.get("namespace"), str):
            return None
        try:
            # The launcher's copy of the job secret; else the caller's environment.
            secret_file = str(job_dir.store_key_file) if job_dir.store_key_file.is_file() else None
            secret = jobstore.read_secret(secret_file=secret_file)
        except jobstore.SecretError:
            secret = None
        if info.get("sealed") is True and secret is None:
            return None  # the other nodes would not take an unsealed request
        try:
            store = jobstore.JobStore(info["endpoint"], info["namespace"], timeout_s=3.0,
                                      seal=jobstore.RecordSeal(secret if info.get("sealed") is True else None))
            return cls(store, store.request_capture(str(job.get("node"))), nodes)
        except Exception:  # the rendezvous store is gone: this node's stacks only
            return None

    def collect(self, deadline: float) -> list[StackGroup]:
        got: dict[str, list] = {}
        while time.monotonic() < deadline:
            try:
                got = self.store.stacks(self.n, sorted(self.nodes))
            except Exception:
                break
            if set(got) >= self.nodes:
                break
            time.sleep(0.1)
        out = []
        for groups in got.values():
            for g in groups:
                try:
                    out.append(StackGroup(**{**g, "ranks": tuple(g["ranks"]), "frames": tuple(g["frames"])}))
                except (KeyError, TypeError):
                    continue  # a record of another shape: left out
        return out


def merge_groups(groups: list[StackGroup]) -> list[StackGroup]:
    """Groups from several nodes waiting in the same place become one."""
    merged: dict[tuple, StackGroup] = {}
    for g in groups:
        key = (g.frames, g.category, g.pattern_id, g.error)
        if key in merged:
            merged[key] = dataclasses.replace(merged[key], ranks=tuple(sorted(set(merged[key].ranks) | set(g.ranks))))
        else:
            merged[key] = g
    return sorted(merged.values(), key=lambda g: (-len(g.ranks), g.ranks))


def phase_of_job(job: dict, ranks: list[rankrow.RankRow], live: bool) -> str:
    """running, starting (ranks importing, no step yet), restarting, finished
    (every rank done while the launcher wraps up), or job.json's status."""
    if not live:
        return job["status"] if isinstance(job.get("status"), str) else "unknown"
    if job.get("status") == "restarting":
        return "restarting"
    expected = len(job.get("ranks") or []) if isinstance(job.get("ranks"), list) else 0
    expected = expected or (job.get("nproc_per_node") if isinstance(job.get("nproc_per_node"), int) else 0)
    if ranks and all(r.phase == "done" for r in ranks):
        return "finished"
    started = time.time() - (_num(job.get("workers_started_time")) or _num(job.get("start_time")) or time.time())
    young = started < STARTUP_GRACE_S
    if young and (len(ranks) < expected or not ranks or all(r.step == 0 and not r.batches for r in ranks)):
        # New workers after a restart are still the restart: its cause is the verdict.
        return "restarting" if _num(job.get("restarts")) > 0 else "starting"
    return "running"


def hardware_findings(incidents: list[records.Incident]) -> list[records.HardwareFinding]:
    return [records.HardwareFinding.of(i) for i in incidents if i.kind in kinds.HARDWARE_KINDS]


def _starting_report(job_name: str, marker: dict) -> dict:
    age = max(0.0, time.time() - (_num(marker.get("start_time")) or time.time()))
    v = verdict_mod.Verdict("starting", [], f"the launcher (pid {marker['launcher_pid']}) started {age:.0f}s ago "
                            "and is setting up; ranks are not running yet", "starting", 0.9, [])
    return _report(job_name, "starting", v, [], [], [], [], utilisation.gpu_utilisation(
        [], [], skip=utilisation.not_judged("starting", v.category)))


def collect(job_name: str, *, native: bool = False, timeout_s: float = 8.0, capture: bool = True,
            node: str | None = None) -> dict:
    job_dir = state.JobDir.resolve(job_name)
    job = job_dir.read_job()
    marker = launch_marker(job_dir)
    if marker is not None and (job is None or _num(job.get("start_time")) < _num(marker.get("start_time"))):
        return _starting_report(job_name, marker)
    if job is None:
        known = [j.get("job") for j in state.list_jobs()]
        raise state.StateError(
            f"unknown job {job_name!r}; known jobs: {', '.join(known) if known else 'none'} (see `trainwatch jobs`)"
        )
    job["status"] = liveness.status(job_dir, job)  # a run whose launcher died is `lost` (and reaped)
    incidents = job_dir.incidents()
    live = job_is_live(job)
    telemetry = job_dir.telemetry()  # read once: at 4096 ranks it is megabytes
    ranks = read_ranks(job, job_dir, telemetry)
    if node is not None:
        ranks = [r for r in ranks if r.node == node]
    status = phase_of_job(job, ranks, live)
    groups: list = []
    # Start-up stacks (imports, rendezvous) and finished ranks say nothing about a hang.
    if live and capture and ranks and status == "running":
        per_rank = max(1.0, min(5.0, timeout_s - 1.0))
        here = job.get("node") if isinstance(job.get("node"), str) else None
        local = [r for r in ranks if here is None or r.node in (here, "")]  # py-spy: our own pids only
        remote = RemoteCapture.ask(job, [r for r in ranks if r not in local], job_dir)
        groups, _where, _failed, seen = capture_ranks(local, job=job_dir, label="diagnose", timeout_s=per_rank,
                                                      native=native, budget_s=per_rank)
        if remote is not None:
            groups = merge_groups(groups + remote.collect(deadline=time.monotonic() + per_rank + 2.0))
        captured = {r.rank: r for r in seen}
        ranks = [captured.get(r.rank, r) for r in ranks]
    ranks = [r if r.state is not None else dataclasses.replace(r, state=_process_state(r, job, live)) for r in ranks]
    hardware = hardware_findings(incidents)
    v = _verdict(job, status, live, ranks, groups, incidents, hardware, telemetry.get("thresholds"))
    samples, no_samples, simulated = utilisation.samples_from_telemetry(telemetry)
    gpu = utilisation.gpu_utilisation(ranks, samples, no_samples=no_samples, simulated=simulated,
                                      skip=utilisation.not_judged(status, v.category))
    report = _report(job_name, "running" if status == "running" else status, v, ranks, groups, hardware, incidents,
                     gpu)
    # Productive time over wall time and badput by cause, as the sidecar last counted it.
    report["goodput"] = goodput.typed_record(telemetry.get("goodput"))
    preempted = preemption.of_job(job)
    report["preempted"] = codec.encode(preempted) if preempted is not None else None
    return report


def _process_state(row: rankrow.RankRow, job: dict, live: bool) -> str:
    """What the rank's process is doing now: `remote` (another node's), `exited` (a finished job)."""
    if not live:
        return "exited"
    if row.node not in (job.get("node"), ""):
        return "remote"
    try:
        return psutil.Process(row.pid).status()
    except (psutil.Error, TypeError, ValueError):
        return "gone"


def _num(value: Any) -> float:
    return state.finite_number(value) or 0.0


def _verdict(job, status, live, ranks, groups, incidents, hardware, thresholds=None) -> verdict_mod.Verdict:
    if status == "starting":
        attached = len(ranks)
        expected = len(job["ranks"]) if isinstance(job.get("ranks"), list) and job["ranks"] else (
            job.get("nproc_per_node") or attached)
        return verdict_mod.Verdict(
            "starting", [], f"ranks are starting ({attached} of {expected} attached, none past its first step): "
            "importing, forming the process group or loading a checkpoint; no verdict on start-up stacks",
            "starting", 0.9, [])
    if status == "restarting":
        cause = _restart_cause(incidents)
        if cause is not None:
            return verdict_mod.from_incident(cause, "restarting after")
        return verdict_mod.Verdict("other", [], "the worker group is restarting", "restart-loop", 0.5, [])
    if status in ("finished", "succeeded"):
        faults = [i for i in incidents if i.kind != "restart"]
        note = f" ({len(faults)} incident(s) along the way; see incidents)" if faults else ""
        return verdict_mod.Verdict("finished", [], f"job finished normally{note}", "finished", 0.95, [])
    preempted = preemption.of_job(job)
    if preempted is not None and not live:
        return preemption.verdict(preempted, str(job.get("job") or ""))
    if live:
        return verdict_mod.decide(ranks, groups, incidents, hardware, thresholds)
    if incidents:
        last = next((i for i in reversed(incidents) if i.kind != "restart"), incidents[-1])
        return verdict_mod.from_incident(last, f"job {job.get('status', 'finished')}; last incident")
    return verdict_mod.Verdict("other", [], f"job {status} with no incidents recorded", "hang", 0.3, [])


def _restart_cause(incidents: list[records.Incident]) -> records.Incident | None:
    """The incident the current restart is for: the last one that asked for a
    restart, or the last crash (torchelastic restarts those by itself)."""
    for i in reversed(incidents):
        if i.kind == "restart":
            return None
        if i.restart_requested or i.kind == "crash":
            return i
    return None


def _report(job_name, status, v, ranks, groups, hardware, incidents, gpu: dict) -> dict:
    return {
        "job": job_name,
        "status": status,
        "verdict": {
            "category": v.category,
            "culprit_ranks": v.culprit_ranks,
            "summary": v.summary,
            "runbook": v.runbook,
            "confidence": v.confidence,
            "evidence": v.evidence,
        },
        "ranks": [
            {
                "rank": r.rank,
                "node": r.node,
                "pid": r.pid,
                "step": r.step,
                "phase": r.phase,
                "last_progress_s": r.last_progress_s,
                "collectives": r.collectives,
                "loss": r.loss,
                "grad_norm": r.grad_norm,
                "step_s": r.step_s,
                "step_source": r.step_source,
                "batches": r.batches,
                "state": r.state,
                "heartbeat_age_s": r.heartbeat_age_s,
                "capture_error": r.capture_error,
            }
            for r in ranks
        ],
        "stack_groups": [
            {
                "ranks": list(g.ranks),
                "frames": list(g.frames),
                "category": g.category,
                "pattern": g.pattern_id,
                "thread": g.thread,
                "error": g.error,
            }
            for g in groups
        ],
        "hardware": [{"gpu": h.gpu, "xid": h.xid, "meaning": h.meaning, "severity": h.severity, "rank": h.rank}
                     for h in hardware],
        "incidents": [i.view() for i in incidents[-20:]],
        "goodput": None,
        **gpu,
    }


def render(report: dict) -> str:
    v = report["verdict"]
    lines = [
        f"job {report['job']} ({report['status']}" + (", preempted" if report.get("preempted") else "") + ")",
        f"verdict: {v['category']}"
        + (f" — culprit {', '.join(f'rank {r}' for r in v['culprit_ranks'])}" if v["culprit_ranks"] else "")
        + f" (confidence {v['confidence']:.2f})",
        f"  {v['summary']}",
        f"  runbook: trainwatch runbook {v['runbook']}",
    ]
    for e in v.get("evidence", [])[:6]:
        lines.append(f"  - {e}")
    if report["ranks"]:
        lines.append("")
        lines.append(f"{'RANK':>4} {'NODE':<12} {'PID':>7} {'STEP':>7} {'LOSS':>9} {'PHASE':<11} {'IDLE s':>7} "
                     f"{'SEQ enq/done':>13} STATE")
        for r in report["ranks"]:
            c = r["collectives"]
            seq = f"{c['enqueued'] if c['enqueued'] is not None else '-'}/{c['completed'] if c['completed'] is not None else '-'}"
            idle = f"{r['last_progress_s']:.1f}" if r.get("last_progress_s") is not None else "-"
            st = r.get("state") or "-"
            if r.get("capture_error"):
                st += f" (no stack: {r['capture_error']})"
            loss = f"{r['loss']:.4g}" if isinstance(r.get("loss"), (int, float)) else "-"
            lines.append(
                f"{r['rank']:>4} {str(r.get('node') or '-')[:12]:<12} {r.get('pid') or '-':>7} {r.get('step', '-'):>7} "
                f"{loss:>9} {str(r.get('phase') or '-'):<11} {idle:>7} {seq:>13} {st}"
            )
    summary = report.get("ranks_summary")
    if summary:
        steps, idle = summary.get("step") or {}, summary.get("last_progress_s") or {}
        lines.append(f"  ... {summary['shown']} of {summary['total']} ranks on {summary['nodes']} node(s) shown "
                     f"(`--all-ranks` for every one); steps {steps.get('min', '-')}..{steps.get('max', '-')}, "
                     f"idle s median {idle.get('median', '-')} max {idle.get('max', '-')}; phases "
                     + ", ".join(f"{k} {v}" for k, v in list(summary["phases"].items())[:5]))
    for g in report["stack_groups"]:
        lines.append("")
        lines.append(f"stack group: ranks {','.join(map(str, g['ranks']))} — {g['category']}"
                     + (f" [{g['pattern']}]" if g.get("pattern") else "") + (f" thread {g['thread']}" if g.get("thread") else ""))
        if g.get("error"):
            lines.append(f"    (not sampled: {g['error']})")
        for f in g["frames"][:6]:
            lines.append(f"    {f}")
    if report["hardware"]:
        lines.append("")
        for h in report["hardware"]:
            lines.append(f"hardware: GPU {h['gpu']} Xid {h['xid']} ({h['severity']}): {h['meaning']}")
    gpu_lines = utilisation.render_lines(report.get("gpu_utilisation"))
    if gpu_lines:
        lines.append("")
        lines.extend(gpu_lines)
    if report.get("goodput"):
        lines.append("")
        lines.append(goodput.line_of(report["goodput"]))
    if report["incidents"]:
        lines.append("")
        lines.append(f"incidents ({len(report['incidents'])} most recent):")
        for i in report["incidents"][-5:]:
            lines.append(f"  {i.get('time', '')} {records.headline(str(i.get('kind')), str(i.get('summary') or ''))}")
    return "\n".join(lines)


def main(argv: list[str], out=None) -> int:
    p = Parser(prog="trainwatch diagnose", usage_hint="usage: trainwatch diagnose JOB [--json] [--all-ranks]")
    p.add_argument("job")
    p.add_argument("--json", action="store_true")
    p.add_argument("--native", action="store_true", help="include native frames (slower)")
    p.add_argument("--timeout", type=float, default=8.0, help="overall time budget in seconds")
    p.add_argument("--node", default=None, help="only the ranks of this node (a multi-node job)")
    p.add_argument("--all-ranks", action="store_true",
                   help=f"list every rank (default above {SUMMARY_ABOVE} ranks: the culprits and the ranks that "
                   "stand out, with a summary of the rest)")
    args = p.parse_args(argv)
    if not 1.0 <= args.timeout <= 3600:
        return fail(f"--timeout must be between 1 and 3600 seconds; got {args.timeout}")
    out = out or sys.stdout
    as_json = args.json
    try:
        report = collect(args.job, native=args.native, timeout_s=args.timeout, node=args.node)
    except state.StateError as e:
        return fail(str(e))
    if not args.all_ranks:
        report = summarise(report)
    if as_json:
        print(json.dumps(report, indent=2, default=str), file=out)
    else:
        print(printable(render(report)), file=out)
    return 0
