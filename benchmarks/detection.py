"""Detection benchmark: the fault matrix, false incidents, watchdog cost.

    python benchmarks/detection.py [--ranks 4] [--timeout 90]
    python benchmarks/detection.py --smoke   # every part once, 2 ranks, a few steps (for tests)

For every fault kind a real 4-rank job of the integrated trainer runs with the
fault injected inside one rank (alert-only mode). Latency runs from the moment
the fault really began (recorded by the faulting process, CLOCK_MONOTONIC) to
the incident (the sidecar's detection time, same clock). `diagnose --json` is
polled every 0.5 s from the start to 10 s after the detection:
incidents_per_fault counts the incidents of the fault's kind (goal 1.0) and
verdict_agrees the share of polls after the detection, while the incident is
open, whose verdict names the incident's culprit and kind (goal 1.0; healthy_before_detection counts polls
between the fault and its detection that said `healthy`). Then: a healthy
200-step run with checkpoints and a slow first step (false incidents); the
client corpus (tests/clients/: Fabric, Lightning, accelerate, FSDP, pipeline,
eval loops, RL rollouts, ...) run healthy and unmodified, twice, beside a
CPU-hog process (false_incidents_clients: incidents of every kind, alert-only
ones included; goal 0); hang_in_validating_script_s, a compute hang in an
unmodified script that validates every 10 steps (goal <= 2 x hang_steady_s);
hang_steady_s, the same hang at step 60 of an unmodified script of steady
0.1 s steps (goal <= 2 s: the job's own steady threshold); stopped, exited
and zombie (goal <= 1 s); the sidecar's CPU use at 8 ranks, and one
detector round over 4096 synthetic ranks.

Progress goes to stderr; the LAST stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import uuid

import psutil

from common import (BIN, ROOT, SMOKE_HELP, env_for, events, faults_fired, job_json, launch, log, new_home, run_command,
                    stop, wait_for)

CULPRIT = 2
TRAINER = ["-m", "trainwatch.trainer", "--model-size", "tiny", "--max-steps", "100000", "--log-interval", "100000"]

# name -> (inject spec, expected incident kind, what plain torchrun does with the same fault)
GLOO_TIMEOUT = "hangs until gloo's 30 min collective timeout, then fails with no culprit named"
FAULTS = {
    "hang_compute": (f"hang:where=compute,rank={CULPRIT},step=8", "hang", GLOO_TIMEOUT),
    # The same compute hang in an unmodified script that validates every 10 steps (FAULT_WORKLOAD):
    # the validation steps must not inflate the training-step threshold (goal <= 2x hang_compute).
    "hang_in_validating_script": (f"hang:where=compute,rank={CULPRIT},step=45", "hang", GLOO_TIMEOUT),
    # A hang on a steady 100 ms-step job, past the steps that make its own threshold (goal <= 2 s).
    "hang_steady": (f"hang:where=compute,rank={CULPRIT},step=60", "hang", GLOO_TIMEOUT),
    "hang_gc": (f"hang:where=gc,rank={CULPRIT},step=8", "hang", GLOO_TIMEOUT),
    "hang_dataloader": (f"hang:where=dataloader,rank={CULPRIT},step=8", "hang", GLOO_TIMEOUT),
    "hang_checkpoint": (f"hang:where=checkpoint,rank={CULPRIT},step=8", "hang", GLOO_TIMEOUT),
    "collective_skip": (f"hang:where=collective_skip,rank={CULPRIT},step=8", "collective_mismatch",
                        "no error: later all_reduces pair with the wrong step's partner (silently wrong values) "
                        "until a rank exits; then 'Connection closed by peer'"),
    "crash": (f"crash:rank={CULPRIT},step=8", "crash",
              "notices the exit within its 0.1 s monitor interval; the peers' gloo errors follow"),
    # A rank that can never step again, seen in its process state (goal: 1 s or less).
    "stopped": (f"stop:rank={CULPRIT},step=8", "hang", GLOO_TIMEOUT),
    "exited": (f"crash:code=1,rank={CULPRIT},step=8", "crash",
               "notices the exit within its 0.1 s monitor interval; the peers' gloo errors follow"),
    "zombie": (f"zombie:rank={CULPRIT},step=8", "crash",
               "nothing: the process is alive to torchrun's poll; the peers wait in gloo for 30 min"),
    "straggler": (f"straggler:delay=0.3,rank={CULPRIT},step=5", "straggler", "nothing: the job just runs slower"),
    # The same straggler in an unmodified DDP script (FAULT_WORKLOAD): found by collective arrival order.
    "straggler_zero_code": (f"straggler:delay=0.3,rank={CULPRIT},step=30", "straggler",
                            "nothing: the job just runs slower"),
    "nan": (f"nan:rank={CULPRIT},step=30", "loss_nan", "nothing: training continues on NaN weights"),
    "spike": (f"spike:rank={CULPRIT},step=60", "loss_spike", "nothing"),
    "xid79": (f"xid:code=79,rank={CULPRIT},step=5", "xid", "nothing until the job hangs or crashes"),
    "ecc": (f"ecc:rank={CULPRIT},step=5", "ecc", "nothing"),
    # Training health (alerts only). lr_stuck needs 20 steps at 0; GradScaler's first 100 steps set no
    # reference for a fall; the loss trend runs with a 100-step window here (FAULT_FLAGS).
    "lr_zero": (f"lr:value=0,rank={CULPRIT},step=30", "lr_stuck", "nothing: the rank trains with a learning rate of 0"),
    "dead_grad": (f"dead_grad:rank={CULPRIT},step=30", "dead_grad", "nothing: the model stops learning"),
    "scale_collapse": (f"scale_collapse:rank={CULPRIT},step=150", "loss_scale_collapse",
                       "nothing: every step is skipped while the scale halves towards 0"),
    "loss_rise": (f"loss_rise:rank={CULPRIT},step=120,rate=0.02", "loss_trend", "nothing"),
    "slow_step": (f"slow_step:where=data,delay=1.5,rank={CULPRIT},step=150", "step_time_spike",
                  "nothing: one step 1.5 s slower, every rank waiting for it"),
}

FAULT_FLAGS = {"loss_rise": ["--trend-window-steps", "100"]}
"""Extra watchdog flags of a fault's run (documented launch flags, not code changes)."""
FAULT_WORKLOAD = {
    "straggler_zero_code": [str(ROOT / "tests" / "scripts" / "plain_ddp.py"), "--steps", "100000"],
    # 2 s validation passes (4 batches of 0.5 s) every 10 steps of ~0.05 s.
    # Steps of 0.1 s (a sleep) and nothing else: no validation pass in 100000 steps.
    "hang_steady": [str(ROOT / "tests" / "clients" / "ddp_validation.py"), "--steps", "100000",
                    "--val-every", "1000000", "--sleep", "0.1"],
    "hang_in_validating_script": [str(ROOT / "tests" / "clients" / "ddp_validation.py"), "--steps", "100000",
                                  "--val-every", "10", "--val-sleep", "0.5", "--sleep", "0.05"],
}
"""Faults run in another workload than the integrated trainer (TRAINER)."""


def diagnose(home, job: str) -> dict | None:
    try:
        r = run_command([str(BIN / "trainwatch"), "diagnose", job, "--json", "--timeout", "4"], home, timeout=60)
    except subprocess.TimeoutExpired:
        return None
    try:
        return json.loads(r.stdout) if r.returncode == 0 else None
    except ValueError:
        return None


def names(verdict: dict, incident: dict) -> bool:
    """The verdict tells the incident's story: its culprits, and its kind (or the
    category or runbook the incident carries)."""
    return (verdict.get("culprit_ranks") == incident.get("culprit_ranks")
            and (verdict.get("category") in (incident.get("kind"), incident.get("category"))
                 or verdict.get("runbook") == incident.get("runbook")))


def run_fault(name: str, spec: str, kind: str, ranks: int, timeout: float, *, culprit: int = CULPRIT,
              workload: list[str] | None = None, on_detected=None, observe_s: float = 10.0,
              poll: bool = True) -> dict:
    """One fault in a real job: detected?, the right culprit?, latency. `workload`
    replaces the job's command line; `on_detected(home, job)` runs while the job
    still runs, once the incident is in (its answer is the result's "extra").
    With `poll`, `diagnose` is polled from the start until `observe_s` after the
    detection: the incidents of the kind are counted (goal 1) and the polls
    whose verdict names the incident (goal 1.0 after detection; none `healthy`
    between the fault and its detection)."""
    home = new_home(name)
    klog = home / "kern.log"
    klog.write_text("")
    fault, name = name, f"{name.replace('_', '-')}-{uuid.uuid4().hex[:6]}"  # the job: a name of its own
    proc = launch(home, "--nproc-per-node", str(ranks), "--job", name, "--no-restart", "--inject", spec,
                  "--kernel-log", str(klog), *FAULT_FLAGS.get(fault, []),
                  *(workload or FAULT_WORKLOAD.get(fault, TRAINER)))
    extra = None
    polls: list[tuple[float, dict]] = []
    found, deadline, seen_at = [], time.monotonic() + timeout, None
    try:
        while time.monotonic() < deadline:
            if poll:
                asked = time.time()
                report = diagnose(home, name)
                if report is not None:
                    polls.append((asked, report))
            found = [e for e in events(home, name) if e["kind"] == kind]
            if found and seen_at is None:
                seen_at = time.monotonic()
            if seen_at is not None and (not poll or time.monotonic() - seen_at >= observe_s):
                break
            time.sleep(0.5 if poll else 0.1)
        fired = faults_fired(home, name)
        found = [e for e in events(home, name) if e["kind"] == kind]
        if found and on_detected is not None:
            extra = on_detected(home, name)
    finally:
        stop(proc)
    result = {"detected": bool(found), "culprit_ok": False, "latency_s": None, "incidents_per_fault": len(found),
              "verdict_agrees": None, "healthy_before_detection": None}
    if extra is not None:
        result["extra"] = extra
    if found:
        incident = found[0]
        result["culprit_ranks"] = incident["culprit_ranks"]
        result["culprit_ok"] = incident["culprit_ranks"] == [culprit]
        if fired:
            result["latency_s"] = round(incident["detected_mono"] - fired[0]["mono"], 3)
            fired_wall = fired[0].get("wall")
            if isinstance(fired_wall, (int, float)):
                before = [r for t, r in polls if fired_wall <= t < incident["opened_time"]]
                result["healthy_before_detection"] = sum(r["verdict"]["category"] == "healthy" for r in before)
        # While the incident is open: once resolved (a loss scale that recovered,
        # the job that ended), `healthy` or the job's end is the right answer.
        closed = incident.get("resolved_time") if isinstance(incident.get("resolved_time"), (int, float)) else None
        after = [r for t, r in polls if t >= incident.get("opened_time", 0) + 1.0 and (closed is None or t < closed)]
        if after:
            result["verdict_agrees"] = round(sum(names(r["verdict"], incident) for r in after) / len(after), 3)
        result["summary"] = incident["summary"][:200]
    return result


def healthy_run(ranks: int, steps: int = 200, ckpt_interval: int = 20, slow_s: float = 3.0) -> int:
    home = new_home("healthy")
    job = f"healthy-{uuid.uuid4().hex[:6]}"
    proc = launch(home, "--nproc-per-node", str(ranks), "--job", job,
                  "--inject", f"hang:where=compute,seconds={slow_s},rank=1,step=1",  # a slow first step on one rank
                  "-m", "trainwatch.trainer", "--model-size", "tiny", "--max-steps", str(steps), "--ckpt-interval",
                  str(ckpt_interval), "--log-interval", "100000")
    proc.communicate(timeout=600)
    found = events(home, job)
    for e in found:
        log(f"  FALSE incident: {e['kind']}: {e['summary']}")
    return len(found)


def client_runs(rounds: int, only: dict | None = None, hog: bool = True) -> dict:
    """Every client script (or those of `only`: script -> its arguments), healthy
    and unmodified, `rounds` times, with one process spinning on a core beside
    it (`hog`): incidents and restarts per script."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_clients_e2e import CLIENTS, SLOW_EVAL

    from common import spawn

    clients = {s: (c[0], only[s], *c[2:]) for s, c in CLIENTS.items() if s in only} if only else CLIENTS
    spinner = spawn([sys.executable, "-c", "while True: pass"]) if hog else None
    per_script: dict[str, dict] = {}
    try:
        for r in range(rounds):
            for script, (ranks, args, _inject, _culprit) in clients.items():
                home = new_home("client")
                job = f"{script[:-3].replace('_', '-')}-{uuid.uuid4().hex[:6]}"
                t0 = time.monotonic()
                proc = launch(home, "--nproc-per-node", str(ranks), "--job", job,
                              str(ROOT / "tests" / "clients" / script), *args, *SLOW_EVAL.get(script, []))
                try:
                    out = proc.communicate(timeout=600)[0] or ""
                except subprocess.TimeoutExpired:
                    out = stop(proc)
                found = events(home, job)
                restarts = job_json(home, job).get("restarts", 0)
                row = per_script.setdefault(script, {"incidents": 0, "restarts": 0, "exit_codes": [], "wall_s": []})
                row["incidents"] += len(found)
                row["restarts"] += restarts
                row["exit_codes"].append(proc.returncode)
                row["wall_s"].append(round(time.monotonic() - t0, 1))
                for e in found:
                    log(f"  FALSE incident in {script}: {e['kind']}: {e['summary']}")
                log(f"  round {r + 1} {script}: rc={proc.returncode} incidents={len(found)} restarts={restarts} "
                    f"({row['wall_s'][-1]}s)" + ("" if proc.returncode == 0 else f"\n{out[-1500:]}"))
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    return per_script


def sidecar_cpu_fraction(ranks: int, seconds: float = 20.0) -> float:
    home = new_home("cpu")
    job = f"cpu-{uuid.uuid4().hex[:6]}"
    proc = launch(home, "--nproc-per-node", str(ranks), "--job", job, *TRAINER)
    try:
        # Steady state: once every rank has stepped (start-up imports are not the watchdog's cost).
        def stepping():
            try:
                tel = json.loads((home / "jobs" / job / "telemetry.json").read_text())["ranks"]
            except (OSError, ValueError, KeyError):
                return False
            return len(tel) == ranks and all(r["step"] >= 3 for r in tel)

        wait_for(stepping, 180)
        sidecar = psutil.Process(job_json(home, job)["sidecar_pid"])
        c0, t0 = sum(sidecar.cpu_times()[:2]), time.monotonic()
        time.sleep(seconds)  # a measurement window, not a synchronisation
        c1, t1 = sum(sidecar.cpu_times()[:2]), time.monotonic()
    finally:
        stop(proc)
    return (c1 - c0) / (t1 - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for each incident")
    p.add_argument("--only", nargs="*", help="run only these faults")
    p.add_argument("--skip-healthy", action="store_true", help="skip the healthy run and the CPU measurement")
    p.add_argument("--client-rounds", type=int, default=2, help="healthy runs of each client script (0 = skip)")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = p.parse_args()
    unknown = [n for n in args.only or () if n not in FAULTS]
    if unknown:
        p.error(f"--only: unknown fault {', '.join(unknown)}; the faults are {', '.join(FAULTS)}")
    # --smoke: one fault row (a crash at step 3 of 2 ranks, diagnose polled for 1 s after it), a healthy
    # run of 6 steps, the CPU of a 1-rank job's sidecar over 1 s, one client script of 10 steps once
    # (no CPU hog), a tick of 64 ranks.
    smoke = args.smoke
    if smoke:
        args.ranks, args.only, args.timeout, args.client_rounds = 2, ["crash"], 60.0, 1
    culprit = min(CULPRIT, args.ranks - 1)
    faults = {}
    for name, (spec, kind, torchrun) in FAULTS.items():
        if args.only and name not in args.only:
            continue
        spec = spec.replace(f"rank={CULPRIT}", f"rank={culprit}").replace("step=8", "step=3" if smoke else "step=8")
        log(f"fault {name}: --inject {spec} (expect {kind}) ...")
        r = run_fault(name, spec, kind, args.ranks, args.timeout, culprit=culprit, observe_s=1.0 if smoke else 10.0)
        r["torchrun_alone"] = torchrun
        faults[name] = r
        log(f"  detected={r['detected']} culprit_ok={r['culprit_ok']} latency={r['latency_s']}s "
            f"incidents={r['incidents_per_fault']} verdict_agrees={r['verdict_agrees']} "
            f"healthy_before={r['healthy_before_detection']}")
    false_incidents, cpu = None, None
    if not args.skip_healthy:
        log("healthy run (checkpoints, a slow first step) ...")
        false_incidents = healthy_run(args.ranks, *((6, 3, 0.5) if smoke else ()))
        log(f"  false incidents: {false_incidents}")
        log("sidecar CPU at 8 ranks ..." if not smoke else "sidecar CPU at 1 rank ...")
        cpu = sidecar_cpu_fraction(1, 1.0) if smoke else sidecar_cpu_fraction(8)
        log(f"  watchdog_cpu_fraction = {cpu:.4f}")
    clients = None
    if args.client_rounds > 0:
        log(f"client corpus, healthy, {args.client_rounds} round(s) beside a CPU hog ...")
        clients = client_runs(args.client_rounds, {"ddp_metric_allreduce.py": ["--steps", "10"]} if smoke else None,
                              hog=not smoke)
        total = sum(c["incidents"] for c in clients.values())
        log(f"  false_incidents_clients = {total}")
    from trainwatch.watchdog.engine import benchmark_tick

    tick = benchmark_tick(64, 5) if smoke else benchmark_tick(4096, 50)
    log(f"  tick_ms_{64 if smoke else 4096}_ranks = {tick:.2f}")
    detected = [f for f in faults.values() if f["detected"]]
    judged = [f for f in detected if f["verdict_agrees"] is not None]  # polled while the incident was open
    print(json.dumps({
        "faults": faults,
        "incidents_per_fault": None if not detected else round(
            sum(f["incidents_per_fault"] for f in detected) / len(detected), 3),
        "verdict_agrees": None if not judged else round(sum(f["verdict_agrees"] for f in judged) / len(judged), 3),
        "hang_in_validating_script_s": faults.get("hang_in_validating_script", {}).get("latency_s"),
        "hang_steady_s": faults.get("hang_steady", faults.get("hang_compute", {})).get("latency_s"),
        "false_incidents": false_incidents,
        "false_incidents_clients": None if clients is None else sum(c["incidents"] for c in clients.values()),
        "restarts_clients": None if clients is None else sum(c["restarts"] for c in clients.values()),
        "clients": clients,
        "watchdog_cpu_fraction": None if cpu is None else round(cpu, 4),
        "tick_ms_4096_ranks": round(tick, 3),
    }))


if __name__ == "__main__":
    import common

    common.main(main)
