"""Recovery benchmark: a hung rank, recovered by trainwatch (optionally next to NVIDIA's ft_launcher).

    python benchmarks/recovery.py [--ranks 4] [--where dataloader] [--step 100]
    python benchmarks/recovery.py --script [PATH] [--ranks 2] [--step 150]
    python benchmarks/recovery.py --script [PATH] --compare [--compare-venv DIR] [--repeat N]
    python benchmarks/recovery.py --in-process N [--ranks 4] [--step 100]
    python benchmarks/recovery.py --smoke    # default mode, 2 ranks of the tiny model, 16 steps (for tests)

Default mode: runs the integrated trainer's default job twice: once
uninterrupted, once with a hang injected (`--inject hang:where=...`) into one
rank (--rank, default min(2, ranks-1)). trainwatch must detect it, checkpoint
every rank that can still write, restart the worker group through torchelastic
and finish with the same final weights, bit for bit. recovery_s runs from the
moment the fault began (recorded by the faulting rank) to the first step
completed after the restart.

--script [PATH]: the same for an unmodified DDP/gloo script (no trainwatch
import; default benchmarks/scripts/ddp_resumable.py, whose flags a PATH must
accept): it saves its own checkpoint every --ckpt-every steps and resumes from
it; one rank sleeps forever before --step (default 150) on the first attempt
only. Fault time, every completed step and every start come from the script's
own per-rank log; detection and the culprit from trainwatch's hang incident;
the breakdown from its restart incident (events.jsonl, restart-timing.json).
recovery_s: fault -> every rank of the restarted group has completed a step.
steps_lost: last step completed before the fault - step resumed from.
bitwise_equal: final weights against an uninterrupted run of the script.

--compare: also runs NVIDIA Resiliency Extension's ft_launcher on the same
script and hang from a scratch venv (--compare-venv, or $TRAINWATCH_NVRX_VENV,
default /tmp/scratch/venv-nvrx; never a project dependency), interleaved:
trainwatch, nvrx-tuned, nvrx-learnt, trainwatch, ... The script then sends a
heartbeat after every step (--nvrx). nvrx-tuned: --ft-rank-heartbeat-timeout 5
--ft-workload-check-interval 1. nvrx-learnt: check interval 1, heartbeat
timeouts learnt with calculate_and_set_hb_timeouts() after 2/3 of the steps
before the hang, kept in the script's checkpoint. NVRx's first sign of the hang
is the rank monitor's "Did not get ... heartbeat" log line (it SIGKILLs the
rank right after); its culprit is named when only the hung rank's monitor
timed out. One JSON line per tool per run.

--in-process N: the integrated trainer with a collective mismatch (a rank
skips one collective at --step), N runs: recovered inside the running ranks
(no process restart)? fault to detection, detection to the first new step,
fault to the first new step (medians), the fallback rate, and bitwise_equal
against an uninterrupted run.

--fail-fast: errors a restart cannot fix, side by side with plain torchrun
(--standalone, the same script, interleaved, --repeat N): a missing module
(-m no_such_module), a script raising ValueError after init_process_group,
and a --master-port that is already in use. One JSON line per case: seconds
to exit for each tool, the ratio trainwatch/torchrun (goal <= 1.2), and
trainwatch's restarts (goal 0). Then the preemption row: SIGTERM to the
launcher of the integrated trainer (2 ranks) once it trained 20 steps;
checkpoint_s is the emergency checkpoint of every rank, exit_s SIGTERM to exit,
next to the same stop with --preempt-signals none.

Every run has its own TRAINWATCH_HOME (or scratch dir, TMPDIR for ft_launcher's
sockets) and job name; nothing of a run (process, slot segment) outlives it.
Progress goes to stderr; the LAST stdout line is one JSON object (trainwatch's).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import uuid
from datetime import datetime
from pathlib import Path

import torch
from common import (SMOKE_HELP, events, faults_fired, finish, job_json, keep, launch, log, new_home, read_jsonl, reap,
                    spawn)

TORCHRUN_ALONE = (
    "plain torchrun waits in the hung all_reduce until gloo's 30 min timeout (NCCL: 10 min), then fails; "
    "with --max-restarts it restarts from the last checkpoint the script itself saved (here every 50 steps), "
    "and on torch 2.13 a gloo worker group restarted by torchrun fails in connectFullMesh (stale rendezvous store)"
)
DEFAULT_SCRIPT = Path(__file__).resolve().parent / "scripts" / "ddp_resumable.py"
NVRX_VENV = os.environ.get("TRAINWATCH_NVRX_VENV", "/tmp/scratch/venv-nvrx")
RUN_TIMEOUT = 900


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


# ---- default mode: the integrated trainer ------------------------------------------


def final_weights(home, job):
    from trainwatch.checkpoint import find_latest, load_checkpoint

    info = find_latest(home / "jobs" / job / "checkpoints")
    return (info.step if info else None), (load_checkpoint(info)["model"] if info else None)


def run(home, job, ranks, *extra):
    proc = launch(home, "--nproc-per-node", str(ranks), "--job", job, *extra)
    out = finish(proc, RUN_TIMEOUT)
    reap(proc, home, job)
    return proc.returncode, out


def reference(args):
    """(final step, final weights) of an uninterrupted run of the default job."""
    log(f"uninterrupted default job on {args.ranks} ranks ...")
    ref_home, ref_job = new_home("recovery-ref"), uid("ref")
    code, out = run(ref_home, ref_job, args.ranks, *args.trainer)
    if code != 0:
        raise SystemExit(f"reference run failed:\n{out[-3000:]}")
    ref_step, ref = final_weights(ref_home, ref_job)
    log(f"  done at step {ref_step}")
    return ref_step, ref


def integrated(args) -> None:
    ref_step, ref = reference(args)

    spec = f"hang:where={args.where},rank={args.rank},step={args.step}"
    log(f"default job with --inject {spec} ...")
    home, job = new_home("recovery"), uid("hung")
    code, out = run(home, job, args.ranks, "--inject", spec, *args.trainer)
    restarts = [e for e in events(home, job) if e["kind"] == "restart"]
    step, weights = final_weights(home, job)
    recovered = code == 0 and bool(restarts) and step == ref_step
    bitwise = bool(recovered and weights is not None and weights.keys() == ref.keys()
                   and all(torch.equal(weights[k], ref[k]) for k in ref))
    ev = restarts[0]["evidence"] if restarts else {}
    fired = faults_fired(home, job)
    first_new_step = None
    if restarts and fired:
        # The restart incident is emitted at the first step after the restart.
        first_new_step = restarts[0]["detected_mono"]
    recovery_s = round(first_new_step - fired[0]["mono"], 3) if first_new_step and fired else ev.get("recovery_s")
    breakdown = ev.get("breakdown", {})
    if fired and breakdown.get("detect_s") is not None:
        hang = next((e for e in events(home, job) if e["kind"] in ("hang", "collective_mismatch")), None)
        if hang:
            breakdown["detect_s"] = round(hang["detected_mono"] - fired[0]["mono"], 3)
    for k, v in breakdown.items():
        log(f"  {k:<14} {v}")
    log(f"  recovered={recovered} bitwise_equal={bitwise} steps_lost={ev.get('steps_lost')} "
        f"recovery_s={recovery_s} restarts={job_json(home, job).get('restarts')}")
    print(json.dumps({
        "recovered": recovered,
        "bitwise_equal": bitwise,
        "steps_lost": ev.get("steps_lost"),
        "recovery_s": recovery_s,
        "breakdown": breakdown,
        "fault": spec,
        "ranks": args.ranks,
        "torchrun_alone": TORCHRUN_ALONE,
    }))


def in_process(args) -> None:
    """--in-process N: a collective mismatch (the faulting rank skips one
    collective) recovered inside the running ranks, N times: fault to detection,
    detection to the first new step, fault to the first new step, the fallback
    rate (runs that needed a process restart) and the final weights against an
    uninterrupted run."""
    ref_step, ref = reference(args)
    spec = f"hang:where=collective_skip,rank={args.rank},step={args.step}"
    rows = []
    for i in range(args.in_process):
        home, job = new_home("inproc"), uid("inproc")
        code, out = run(home, job, args.ranks, "--inject", spec, *args.trainer)
        evs = [json.loads(line) for line in (home / "jobs" / job / "events.jsonl").read_text().splitlines()]
        fired = faults_fired(home, job)
        inc = next((e for e in evs if e["kind"] == "collective_mismatch"), None)
        act = next((e["in_process"] for e in evs if e["kind"] == "action" and "in_process" in e), None)
        back = next((e for e in evs if e["kind"] == "resolved" and inc and e.get("incident") == inc["id"]), None)
        step, weights = final_weights(home, job)
        row = {"ok": bool(act and act.get("ok")), "restarts": job_json(home, job).get("restarts"),
               "bitwise_equal": bool(code == 0 and step == ref_step and weights is not None
                                     and all(torch.equal(weights[k], ref[k]) for k in ref)),
               "in_process_s": act.get("seconds") if act else None}
        if fired and inc:
            row["detect_s"] = round(inc["detected_mono"] - fired[0]["mono"], 3)
        if fired and back:
            # The resolution (its ranks' first new step) is stamped in wall time, as the fault is.
            row["fault_to_step_s"] = round(back["time"] - fired[0]["wall"], 3)
            if "detect_s" in row:
                row["detect_to_step_s"] = round(row["fault_to_step_s"] - row["detect_s"], 3)
        log(f"  run {i + 1}: {row}")
        rows.append(row)

    def median(key):
        vals = sorted(r[key] for r in rows if r.get(key) is not None)
        return vals[len(vals) // 2] if vals else None

    print(json.dumps({
        "in_process": {"kinds": ["collective_mismatch"], "runs": len(rows),
                       "recovered_in_process": sum(r["ok"] for r in rows),
                       "fallback_rate": round(sum(not r["ok"] for r in rows) / max(1, len(rows)), 3),
                       "bitwise_equal": all(r["bitwise_equal"] for r in rows),
                       "detect_s": median("detect_s"), "detect_to_step_s": median("detect_to_step_s"),
                       "fault_to_step_s": median("fault_to_step_s"), "in_process_s": median("in_process_s")},
        "fault": spec, "ranks": args.ranks, "rows": rows,
    }))


# ---- script mode: an unmodified DDP script ---------------------------------------


def script_args(args, work: Path, hang: bool, nvrx: str | None = None) -> list[str]:
    sa = ["--steps", str(args.steps), "--ckpt-dir", str(work / "ckpt"), "--ckpt-every", str(args.ckpt_every),
          "--log-dir", str(work / "logs"), "--out", str(work / "final.pt")]
    if hang:
        sa += ["--hang-at", str(args.step), "--hang-rank", str(args.rank), "--hang-marker", str(work / "hang-once")]
    if nvrx:
        sa.append("--nvrx")
    if nvrx == "learnt":
        sa += ["--nvrx-learn-at", str(learn_at(args))]
    return sa


def learn_at(args) -> int:
    return max(1, min(args.step - 1, args.step * 2 // 3))


def script_log(work: Path, ranks: int, clock: str) -> dict:
    """What the script's own per-rank logs say about a run, times on `clock`
    ('mono' or 'wall'): the fault, the first step of the restarted group, steps lost."""
    recs = [r for i in range(ranks) for r in read_jsonl(work / "logs" / f"rank{i}.jsonl")]
    starts = [r for r in recs if r["ev"] == "start"]
    hang = next((r for r in recs if r["ev"] == "hang"), None)
    finished = sum(1 for r in recs if r["ev"] == "end") == ranks
    res = {"hang": hang, "finished": finished, "starts_per_rank": max((sum(1 for s in starts if s["rank"] == i)
                                                                       for i in range(ranks)), default=0)}
    if hang is None:
        return res
    t0 = hang[clock]
    after = [s for s in starts if s[clock] > t0]
    first_gen = min((s["restart"] for s in after), default=None)
    new_pids = {s["pid"] for s in after if s["restart"] == first_gen}  # the first group started after the fault
    later_pids = {s["pid"] for s in after} - new_pids
    old_steps = [r["step"] for r in recs if r["ev"] == "step" and r["pid"] not in new_pids | later_pids]
    resumed = [s["resumed_from"] for s in starts if s["pid"] in new_pids]
    firsts = []
    for i in range(ranks):
        mine = [r[clock] for r in recs if r["ev"] == "step" and r["rank"] == i and r["pid"] in new_pids]
        firsts.append(min(mine) if mine else None)
    res["fault"] = t0
    res["last_step_before"] = max(old_steps, default=None)
    res["resumed_from"] = min(resumed) if resumed else None
    res["steps_lost"] = (res["last_step_before"] - res["resumed_from"]
                         if res["last_step_before"] is not None and res["resumed_from"] is not None else None)
    res["new_started"] = max((s[clock] for s in starts if s["pid"] in new_pids), default=None)
    res["first_new_step"] = max(firsts) if firsts and None not in firsts else None
    learnt = [r for r in recs
              if r["ev"] in ("start", "nvrx_learnt") and (r.get("nvrx_timeouts") or {}).get("calculated")]
    if learnt:
        res["nvrx_timeouts"] = learnt[-1]["nvrx_timeouts"]
    return res


def bitwise(work: Path, ref) -> tuple[bool | None, str | None]:
    path = work / "final.pt"
    if ref is None:
        return None, "no reference weights (the uninterrupted run wrote no --out file)"
    if not path.exists():
        return None, "the script wrote no final weights (--out)"
    w = torch.load(path, weights_only=True)
    return bool(w.keys() == ref.keys() and all(torch.equal(w[k], ref[k]) for k in ref)), None


def _d(a, b):
    return None if a is None or b is None else round(b - a, 3)


def tw_script_run(args, label: str, hang: bool, ref=None) -> dict:
    home, job = new_home(f"recovery-{label}"), uid(label)
    work = home / "work"
    work.mkdir()
    proc = launch(home, "--nproc-per-node", str(args.ranks), "--job", job, str(args.script),
                  *script_args(args, work, hang))
    out = finish(proc, args.timeout)
    (work / "launcher.log").write_text(out)
    reap(proc, home, job)
    res = {"home": str(home), "job": job, "code": proc.returncode}
    if not hang:
        if proc.returncode != 0:
            keep(home)
            raise SystemExit(f"reference run failed (log {work / 'launcher.log'}):\n{out[-3000:]}")
        return res
    sl = script_log(work, args.ranks, "mono")
    incidents = events(home, job)
    hang_inc = next((e for e in incidents if e["kind"] in ("hang", "collective_mismatch")), None)
    restart = next((e for e in incidents if e["kind"] == "restart"), None)
    ev = restart["evidence"] if restart else {}
    breakdown = dict(ev.get("breakdown") or {})
    if hang_inc and sl.get("fault") is not None and "detect_s" in breakdown:
        breakdown["detect_s"] = _d(sl["fault"], hang_inc["detected_mono"])
    recovery_s = _d(sl.get("fault"), sl.get("first_new_step"))
    parts = [v for v in breakdown.values() if isinstance(v, (int, float))]
    eq, why = bitwise(work, ref)
    culprits = hang_inc.get("culprit_ranks") if hang_inc else None
    timing_file = home / "jobs" / job / "control" / "restart-timing.json"
    timing = json.loads(timing_file.read_text()) if timing_file.exists() else None
    res.update({
        "recovered": proc.returncode == 0 and sl["finished"] and sl.get("first_new_step") is not None,
        "restarts": job_json(home, job).get("restarts"),
        "first_sign_s": _d(sl.get("fault"), hang_inc["detected_mono"]) if hang_inc else None,
        "first_new_step_s": recovery_s,
        "recovery_s": recovery_s,
        "trainwatch_recovery_s": ev.get("recovery_s"),
        "breakdown": breakdown,
        "unaccounted_s": round(recovery_s - sum(parts), 3) if recovery_s is not None and parts else None,
        "culprit_ranks": culprits,
        "names_culprit": culprits == [args.rank],
        "steps_lost": sl.get("steps_lost"),
        "last_step_before": sl.get("last_step_before"),
        "resumed_from": sl.get("resumed_from"),
        "bitwise_equal": eq,
        "restart_timing": timing,
        # load_s split by the script's own start record (process group up, checkpoint loaded, DDP built)
        "load_split": {"workers_started_to_script_ready_s": _d((timing or {}).get("workers_started"),
                                                               sl.get("new_started")),
                       "script_ready_to_first_step_s": _d(sl.get("new_started"), sl.get("first_new_step"))},
    })
    if why:
        res["bitwise_reason"] = why
    if not res["recovered"]:
        keep(home)  # its path is in the log line: what went wrong is in it
    return res


_STAMP = r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]"
_TIMEOUT = re.compile(_STAMP + r" \[WARNING\] \[RankMonServer\d+@[^\]]*:(\d+)\] "
                      r"(Did not get (?:initial|subsequent) heartbeat|Section '|Was out of section)")
_JOINED = re.compile(_STAMP + r" .*has joined round (\d+) of the rendezvous")
_UNHEALTHY = re.compile(_STAMP + r" .*Worker group (?:UNHEALTHY|FAILED)")


def _wall(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def nvrx_available(venv: Path) -> str | None:
    """None when ft_launcher and nvidia_resiliency_ext are usable from `venv`, else why not."""
    py, ftl = venv / "bin" / "python", venv / "bin" / "ft_launcher"
    if not py.exists() or not ftl.exists():
        return f"{venv} has no bin/python or bin/ft_launcher"
    r = subprocess.run([str(py), "-c", "import nvidia_resiliency_ext.fault_tolerance, torch"],
                       capture_output=True, text=True, timeout=300)
    return None if r.returncode == 0 else f"nvidia_resiliency_ext does not import there: {r.stderr.strip()[-300:]}"


def nvrx_run(args, variant: str, ref) -> dict:
    work = new_home(f"nvrx-{variant}")
    tmp = work / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TRAINWATCH_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TMPDIR=str(tmp))
    ft = ["--ft-workload-check-interval", "1"]
    if variant == "tuned":
        ft += ["--ft-rank-heartbeat-timeout", "5"]
    cmd = [str(args.compare_venv / "bin" / "ft_launcher"), "--standalone", "--nproc-per-node", str(args.ranks),
           "--max-restarts", "3", *ft, str(args.script), *script_args(args, work, True, nvrx=variant)]
    proc = spawn(cmd, env=env, cwd=str(work), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = finish(proc, args.timeout)
    (work / "launcher.log").write_text(out)
    reap(proc)
    sl = script_log(work, args.ranks, "wall")
    fault, new_started = sl.get("fault"), sl.get("new_started")
    timeouts = [(_wall(m[1]), int(m[2])) for m in _TIMEOUT.finditer(out)]
    if fault is not None:
        # The timeouts that caused the restart: after the fault, before the new group started.
        timeouts = [(t, r) for t, r in timeouts if t >= fault - 0.002 and (new_started is None or t < new_started)]
    first_sign = min((t for t, _ in timeouts), default=None)
    culprits = sorted({r for _, r in timeouts})
    unhealthy = next((_wall(m[1]) for m in _UNHEALTHY.finditer(out)
                      if fault is None or _wall(m[1]) >= fault - 0.002), None)
    joined = next((_wall(m[1]) for m in _JOINED.finditer(out) if int(m[2]) >= 1), None)
    eq, why = bitwise(work, ref)
    rec = {
        "recovered": proc.returncode == 0 and sl["finished"] and sl.get("first_new_step") is not None,
        "restarts": max(0, sl["starts_per_rank"] - 1),
        "first_sign_s": _d(fault, first_sign),
        "first_sign_from": "rank monitor's heartbeat timeout log line (it SIGKILLs that rank right after)",
        "first_new_step_s": _d(fault, sl.get("first_new_step")),
        "breakdown": {"detect_s": _d(fault, first_sign), "kill_to_unhealthy_s": _d(first_sign, unhealthy),
                      "teardown_rendezvous_s": _d(unhealthy, joined), "start_s": _d(joined, new_started),
                      "first_step_s": _d(new_started, sl.get("first_new_step"))},
        "culprit_ranks": culprits,
        "names_culprit": culprits == [args.rank],
        "first_timed_out_rank": min(timeouts)[1] if timeouts else None,
        "steps_lost": sl.get("steps_lost"),
        "bitwise_equal": eq,
        "code": proc.returncode,
        "dir": str(work),
    }
    if variant == "learnt":
        rec["learnt_timeouts"] = sl.get("nvrx_timeouts")
    if why:
        rec["bitwise_reason"] = why
    if not rec["recovered"]:
        keep(work)
        log(f"  nvrx-{variant} did not recover (exit {proc.returncode}); log {work / 'launcher.log'}")
    shutil.rmtree(tmp, ignore_errors=True)  # ft_launcher's IPC sockets, torchelastic's log dir
    return rec


def line(tool: str, i: int, args, r: dict) -> dict:
    keys = ("recovered", "restarts", "first_sign_s", "first_sign_from", "first_new_step_s", "names_culprit",
            "culprit_ranks", "first_timed_out_rank", "steps_lost", "bitwise_equal", "bitwise_reason", "breakdown",
            "learnt_timeouts")
    return {"tool": tool, "run": i, "ranks": args.ranks, "hang_rank": args.rank, "hang_step": args.step,
            **{k: r[k] for k in keys if k in r}}


def script_mode(args) -> None:
    args.script = Path(args.script).resolve()
    fault = (f"rank {args.rank} of {args.ranks} sleeps forever before step {args.step} (first attempt only); "
             f"script {args.script.name} checkpoints every {args.ckpt_every} steps")
    compare = []
    if args.compare:
        why = nvrx_available(args.compare_venv)
        if why:
            log(f"--compare: skipping nvidia-resiliency-ext: {why}")
        else:
            compare = ["tuned", "learnt"]

    log(f"uninterrupted {args.script.name} on {args.ranks} ranks under trainwatch ...")
    ref_run = tw_script_run(args, "script-ref", hang=False)
    ref_path = Path(ref_run["home"]) / "work" / "final.pt"
    ref = torch.load(ref_path, weights_only=True) if ref_path.exists() else None

    tw_runs = []
    for i in range(args.repeat):
        log(f"[{i + 1}/{args.repeat}] trainwatch: {fault} ...")
        r = tw_script_run(args, "script-hung", hang=True, ref=ref)
        log(f"  recovered={r['recovered']} first_sign_s={r['first_sign_s']} recovery_s={r['recovery_s']} "
            f"culprit={r['culprit_ranks']} steps_lost={r['steps_lost']} bitwise_equal={r['bitwise_equal']} "
            f"(home {r['home']})")
        tw_runs.append(r)
        if compare:
            print(json.dumps(line("trainwatch", i, args, r)), flush=True)
        for variant in compare:
            log(f"[{i + 1}/{args.repeat}] nvrx-{variant}: ft_launcher, same script and hang ...")
            n = nvrx_run(args, variant, ref)
            log(f"  recovered={n['recovered']} first_sign_s={n['first_sign_s']} "
                f"first_new_step_s={n['first_new_step_s']} culprit={n['culprit_ranks']} "
                f"steps_lost={n['steps_lost']} bitwise_equal={n['bitwise_equal']}"
                + (f" learnt={n['learnt_timeouts']}" if n.get("learnt_timeouts") else ""))
            print(json.dumps(line(f"nvrx-{variant}", i, args, n)), flush=True)

    done = [r for r in tw_runs if r["recovery_s"] is not None]
    best = sorted(done, key=lambda r: r["recovery_s"])[len(done) // 2] if done else tw_runs[-1]
    for k, v in best["breakdown"].items():
        log(f"  {k:<14} {v}")
    summary = {
        "tool": "trainwatch",
        "mode": "script",
        "recovered": best["recovered"],
        "bitwise_equal": best["bitwise_equal"],
        "steps_lost": best["steps_lost"],
        "recovery_s": best["recovery_s"],
        "breakdown": best["breakdown"],
        "unaccounted_s": best["unaccounted_s"],
        "load_split": best["load_split"],
        "first_sign_s": best["first_sign_s"],
        "names_culprit": best["names_culprit"],
        "restarts": best["restarts"],
        "restart_timing": best["restart_timing"],
        "fault": fault,
        "script": str(args.script),
        "ranks": args.ranks,
    }
    if "bitwise_reason" in best:
        summary["bitwise_reason"] = best["bitwise_reason"]
    if args.repeat > 1:
        summary["recovery_s_runs"] = [r["recovery_s"] for r in tw_runs]
    print(json.dumps(summary))


FAIL_CASES = ("no_such_module", "valueerror_step0", "busy_master_port")


def _timed(cmd: list[str], home: Path, timeout: float) -> tuple[float, int, str]:
    """Seconds from start to exit of `cmd`, its exit code and output; nothing of it is left."""
    import time

    t0 = time.monotonic()
    proc = spawn(cmd, home, cwd=str(home), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = finish(proc, timeout)
    seconds = round(time.monotonic() - t0, 2)
    reap(proc)
    return seconds, proc.returncode, out


def fail_fast(args) -> None:
    import socket
    import sys

    work = new_home("failfast")
    bad = work / "bad_config.py"
    bad.write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\n"
                   "raise ValueError('width 5 is not divisible by 2')\n")
    busy = socket.socket()
    busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    busy.bind(("0.0.0.0", 0))
    busy.listen()
    port = str(busy.getsockname()[1])
    entry = {"no_such_module": ["-m", "no_such_module"], "valueerror_step0": [str(bad)],
             "busy_master_port": ["--master-port", port, str(bad)]}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    try:
        for case in FAIL_CASES:
            rows: dict[str, list] = {"trainwatch": [], "torchrun": []}
            restarts = []
            for i in range(args.repeat):
                home = new_home("failfast")
                job = uid(case.replace("_", "-"))
                s_tw, rc_tw, out = _timed([str(Path(sys.executable).parent / "trainwatch"), "launch",
                                           "--nproc-per-node", "2", "--job", job, *entry[case]], home, args.timeout)
                restarts.append((job_json(home, job) or {}).get("restarts"))
                rows["trainwatch"].append((s_tw, rc_tw))
                standalone = [] if case == "busy_master_port" else ["--standalone"]
                s_tr, rc_tr, _ = _timed([*torchrun, *standalone, *entry[case]], home, args.timeout)
                rows["torchrun"].append((s_tr, rc_tr))
                log(f"{case} #{i + 1}: trainwatch {s_tw}s (exit {rc_tw}), torchrun {s_tr}s (exit {rc_tr})")
                shutil.rmtree(home, ignore_errors=True)
            tw_s = sorted(s for s, _ in rows["trainwatch"])[len(rows["trainwatch"]) // 2]
            tr_s = sorted(s for s, _ in rows["torchrun"])[len(rows["torchrun"]) // 2]
            print(json.dumps({"case": case, "trainwatch_exit_s": tw_s, "torchrun_exit_s": tr_s,
                              "ratio": round(tw_s / tr_s, 2) if tr_s else None, "goal_ratio": 1.2,
                              "trainwatch_restarts": restarts, "exit_codes": {k: [c for _, c in v]
                                                                              for k, v in rows.items()}}),
                  flush=True)
    finally:
        busy.close()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(preempt_row(args)), flush=True)


def preempt_row(args) -> dict:
    """SIGTERM to the launcher of the integrated trainer at step ~20: seconds to
    the checkpoint of every rank and to exit, against the same stop without it."""
    import signal
    import time

    out: dict = {"case": "preempt_sigterm"}
    for label, extra in (("checkpoint", []), ("no_checkpoint", ["--preempt-signals", "none"])):
        home = new_home("preempt")
        job = uid("preempt")
        proc = launch(home, "--nproc-per-node", "2", "--job", job, *extra, "-m", "trainwatch.trainer",
                      "--model-size", "tiny", "--max-steps", "100000", "--log-interval", "20")
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "step 20/" in line:
                break
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        text = finish(proc, args.timeout)
        exit_s = round(time.monotonic() - t0, 2)
        rec = job_json(home, job) or {}
        if label == "checkpoint":
            ck = (rec.get("preempted") or {}).get("checkpoint") or {}
            out.update(checkpoint_s=ck.get("seconds"), step=ck.get("step"), ranks_written=len(ck.get("written") or {}),
                       exit_s=exit_s, exit_code=proc.returncode)
            log(text[-600:])
        else:
            out.update(exit_s_without=exit_s, exit_code_without=proc.returncode)
        reap(proc, home, job)
        shutil.rmtree(home, ignore_errors=True)
    out["exit_ratio"] = round(out["exit_s"] / out["exit_s_without"], 2) if out.get("exit_s_without") else None
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--where", default="dataloader",
                   help="default mode: hang kind (compute, gc, dataloader, checkpoint, collective_skip)")
    p.add_argument("--step", type=int, help="the step the fault hits (default 100; --script: 150)")
    p.add_argument("--rank", type=int, help="the faulting rank (default min(2, ranks-1))")
    p.add_argument("--script", nargs="?", const=str(DEFAULT_SCRIPT), metavar="PATH",
                   help=f"an unmodified DDP script instead of the integrated trainer (default {DEFAULT_SCRIPT.name})")
    p.add_argument("--steps", type=int, default=200, help="--script: steps the script trains")
    p.add_argument("--ckpt-every", type=int, default=10, help="--script: the script's own checkpoint interval")
    p.add_argument("--compare", action="store_true", help="--script: also run NVRx's ft_launcher (implies --script)")
    p.add_argument("--compare-venv", type=Path, default=Path(NVRX_VENV),
                   help="venv with nvidia-resiliency-ext (default $TRAINWATCH_NVRX_VENV or /tmp/scratch/venv-nvrx)")
    p.add_argument("--repeat", type=int, default=1, help="--script: hung runs per tool (interleaved)")
    p.add_argument("--timeout", type=float, default=RUN_TIMEOUT, help="seconds one run may take before it is killed")
    p.add_argument("--fail-fast", action="store_true",
                   help="deterministic errors vs torchrun (time to exit) and the preemption checkpoint row")
    p.add_argument("--in-process", type=int, metavar="N", default=0,
                   help="a collective mismatch recovered inside the running ranks, N runs (integrated trainer)")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; the default mode")
    args = p.parse_args()
    args.trainer = []  # the default job's command line: the integrated trainer's defaults
    if args.smoke:
        args.ranks, args.rank, args.step, args.script, args.fail_fast, args.in_process = 2, 1, 8, None, False, 0
        args.trainer = ["-m", "trainwatch.trainer", "--model-size", "tiny", "--max-steps", "16", "--ckpt-interval", "4",
                        "--log-interval", "100"]
    if args.fail_fast:
        fail_fast(args)
        return
    if args.compare and args.script is None:
        args.script = str(DEFAULT_SCRIPT)
    if args.rank is None:
        args.rank = min(2, args.ranks - 1)
    if not 0 <= args.rank < args.ranks:
        p.error(f"--rank {args.rank} is not a rank of {args.ranks}")
    if args.script is None:
        args.step = 100 if args.step is None else args.step
        in_process(args) if args.in_process > 0 else integrated(args)
    else:
        args.step = 150 if args.step is None else args.step
        if not 1 < args.step <= args.steps:
            p.error(f"--step {args.step} must be in 2..--steps ({args.steps})")
        script_mode(args)


if __name__ == "__main__":
    import common

    common.main(main)
