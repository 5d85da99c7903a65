"""Chaos goodput benchmark: how much of a fixed wall time an unmodified DDP job
spends training, under each tool, while faults keep coming.

    python benchmarks/goodput.py [--minutes 10] [--fault-every-s 60] [--seed 0]
                                 [--topologies 1x4 2x2] [--rounds 1] [--compare-venv DIR]
    python benchmarks/goodput.py --smoke   # trainwatch alone, 1 x 2 ranks, 20 s, faults from 4 s (for tests)

The workload is benchmarks/scripts/ddp_resumable.py (no trainwatch import; it
keeps its own checkpoint every --ckpt-every steps and resumes from it), run
for exactly --minutes of wall time per run on 1 node x 4 ranks and 2 nodes x
2 ranks over loopback (c10d rendezvous). Faults come from a seeded Poisson
schedule (one every --fault-every-s on average; the same times and kinds for
every tool): `hang` (a rank sleeps forever in Python), `stopped` (SIGSTOP),
`crash` (SIGKILL) and `collective_skip` (a rank runs one step without DDP's
gradient all-reduce). A fault due while no rank trains (the job is down or
restarting) waits until one does again. Tools, interleaved per topology:

- trainwatch: `trainwatch launch` (defaults; restarts allowed: --max-restarts 1000)
- nvrx-tuned: NVIDIA Resiliency Extension's ft_launcher from a scratch venv
  (--compare-venv, $TRAINWATCH_NVRX_VENV or /tmp/scratch/venv-nvrx; never a
  project dependency) with --ft-rank-heartbeat-timeout 5 and
  --ft-workload-check-interval 1, the script sending a heartbeat per step;
  skipped with a note when absent
- torchrun: `python -m torch.distributed.run --max-restarts 1000`

Goodput is measured the same way for every tool, from the script's own logs:
net progress (the highest step every rank completed, in the lineage the job
ends with: steps lost to a restart and re-run count once) x the fault-free
step time (the mean interval between two consecutive steps of one process,
in the same run, stalls over 3x the median left out) / wall time. Badput from the logs: `startup` (launch to the
first step on every rank), `recompute` (per restart, steps lost x step time)
and `down` (the rest: detection, restarts, time hung, steps computed with
wrong values after an undetected collective skip). trainwatch's own
zero-code account (telemetry.json) is reported beside it, by cause: it runs
from its sidecar's start (a few seconds after the launch) and counts the
recomputed steps of a script that numbers no steps as unknown.

Progress goes to stderr; one JSON line per run; the LAST stdout line is one
JSON object for trainwatch: goodput, steps, badput_s, per-topology figures and
ratio_vs_nvrx_tuned / ratio_vs_torchrun (null when the peer is absent).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from common import BIN, ROOT, SMOKE_HELP, env_for, keep, log, new_home, read_jsonl, reap, session_pids, spawn

SCRIPT = Path(__file__).resolve().parent / "scripts" / "ddp_resumable.py"
NVRX_VENV = os.environ.get("TRAINWATCH_NVRX_VENV", "/tmp/scratch/venv-nvrx")
FAULT_KINDS = ("hang", "stopped", "crash", "collective_skip")
TOOLS = ("trainwatch", "nvrx-tuned", "torchrun")


def schedule(seed: int, seconds: float, mean_s: float, ranks: int, first_s: float = 20.0) -> list[tuple[float, str, int]]:
    """(time after launch, fault kind, rank): a Poisson process of rate 1/mean_s,
    the first fault no earlier than `first_s` (start-up is measured, not faulted)."""
    rng = random.Random(seed)
    out, t = [], first_s
    while True:
        t += rng.expovariate(1.0 / mean_s)
        if t >= seconds - 5:
            return out
        out.append((round(t, 3), rng.choice(FAULT_KINDS), rng.randrange(ranks)))


def free_port() -> int:
    sys.path.insert(0, str(ROOT))
    from trainwatch import netbind

    return netbind.free_port()


def script_args(work: Path, args, nvrx: bool) -> list[str]:
    sa = ["--steps", "1000000000", "--sleep", str(args.sleep), "--ckpt-dir", str(work / "ckpt"),
          "--ckpt-every", str(args.ckpt_every), "--log-dir", str(work / "logs"), "--fault-dir", str(work / "faults")]
    return sa + (["--nvrx"] if nvrx else [])


def commands(tool: str, topo: tuple[int, int], work: Path, args) -> list[tuple[list[str], dict, Path]]:
    """One (command, environment, cwd) per node."""
    nnodes, nproc = topo
    port = free_port()
    out = []
    secret = os.urandom(16).hex()  # a multi-node trainwatch job's store needs a secret, the same on every node
    for node in range(nnodes):
        home = work / f"home{node}"
        home.mkdir()
        multi = ["--nnodes", str(nnodes), "--node-rank", str(node), "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", work.name] if nnodes > 1 else ["--standalone"]
        if tool == "trainwatch":
            cmd = [str(BIN / "trainwatch"), "launch", *multi, "--nproc-per-node", str(nproc), "--max-restarts", "1000",
                   "--job", f"gp-{work.name}", "--node-name", f"n{node}", str(SCRIPT), *script_args(work, args, False)]
            if nnodes == 1:
                cmd.remove("--standalone")
            env = env_for(home)
            env["TRAINWATCH_JOB_SECRET"] = secret
        else:
            env = {k: v for k, v in os.environ.items()
                   if not k.startswith("TRAINWATCH_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
            env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TMPDIR=str(home))
            if tool == "torchrun":
                cmd = [sys.executable, "-m", "torch.distributed.run", *multi, "--nproc-per-node", str(nproc),
                       "--max-restarts", "1000", str(SCRIPT), *script_args(work, args, False)]
            else:
                cmd = [str(args.compare_venv / "bin" / "ft_launcher"), *multi, "--nproc-per-node", str(nproc),
                       "--max-restarts", "1000", "--ft-workload-check-interval", "1",
                       "--ft-rank-heartbeat-timeout", "5", str(SCRIPT), *script_args(work, args, True)]
        out.append((cmd, env, home))
    return out


def live_ranks(work: Path, world: int) -> dict[int, int]:
    """rank -> pid of its newest process (from the script's start records)."""
    newest: dict[int, tuple[float, int]] = {}
    for r in range(world):
        for rec in read_jsonl(work / "logs" / f"rank{r}.jsonl"):
            if rec.get("ev") == "start" and rec["mono"] >= newest.get(r, (-1.0, 0))[0]:
                newest[r] = (rec["mono"], rec["pid"])
    return {r: pid for r, (_, pid) in newest.items()}


def training(work: Path, world: int, since: float) -> bool:
    """Every rank's newest process stepped after `since` (monotonic)."""
    pids = live_ranks(work, world)
    if len(pids) < world:
        return False
    for r, pid in pids.items():
        recs = read_jsonl(work / "logs" / f"rank{r}.jsonl")
        if not any(x.get("ev") == "step" and x["pid"] == pid and x["mono"] > since for x in recs[-50:]):
            return False
    return True


def inject(work: Path, kind: str, rank: int, world: int) -> dict:
    pid = live_ranks(work, world).get(rank)
    if kind in ("hang", "collective_skip"):
        (work / "faults" / f"rank{rank}.{'hang' if kind == 'hang' else 'skip'}").touch()
    elif pid is not None:
        try:
            os.kill(pid, signal.SIGSTOP if kind == "stopped" else signal.SIGKILL)
        except ProcessLookupError:
            pass
    return {"kind": kind, "rank": rank, "pid": pid, "mono": time.monotonic()}


def run(tool: str, topo: tuple[int, int], args, faults: list) -> dict:
    nnodes, nproc = topo
    world = nnodes * nproc
    work = new_home(f"goodput-{tool}")
    (work / "faults").mkdir()
    nodes = commands(tool, topo, work, args)
    t0 = time.monotonic()
    procs = []
    for i, (cmd, env, home) in enumerate(nodes):
        logf = open(work / f"node{i}.log", "w")
        procs.append(spawn(cmd, env=env, cwd=str(ROOT if tool == "trainwatch" else home), stdout=logf,
                           stderr=subprocess.STDOUT))
        logf.close()
    seconds = args.minutes * 60
    fired, pending = [], list(faults)
    last_fault = t0
    while time.monotonic() - t0 < seconds:
        if pending and time.monotonic() - t0 >= pending[0][0] and training(work, world, last_fault):
            at, kind, rank = pending.pop(0)
            f = inject(work, kind, rank % world, world)
            f["due_s"], f["at_s"] = at, round(f["mono"] - t0, 3)
            fired.append(f)
            last_fault = f["mono"]
            log(f"  {f['at_s']:7.1f}s {kind} rank {f['rank']}")
        if any(p.poll() is not None for p in procs) and not any(session_pids(p.pid) for p in procs):
            break  # the job gave up (its restart budget, or it cannot recover)
        time.sleep(0.2)
    t_end = time.monotonic()
    for p in procs:  # the wall time is up: stop it as an operator would
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        for pid in session_pids(p.pid):  # a stopped rank never handles SIGTERM
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    for p in procs:
        reap(p, timeout=20)
    res = measure(work, world, t0, t_end, fired)
    res.update(tool=tool, topology=f"{nnodes}x{nproc}", faults=len(fired),
               fault_kinds={k: sum(1 for f in fired if f["kind"] == k) for k in FAULT_KINDS},
               exited_early=any(p.returncode not in (None, 0, -15) for p in procs) and t_end - t0 < seconds - 1)
    if res["exited_early"]:
        for i in range(len(procs)):
            tail = (work / f"node{i}.log").read_text(errors="replace").strip().splitlines()[-5:]
            log(f"  {tool} node {i} ended after {t_end - t0:.1f} s: " + " | ".join(tail))
    if tool == "trainwatch":
        # node 0 hosts the store: on a multi-node job its sidecar aggregates (jobs/<job>/nodes/n0/)
        job_dir = work / "home0" / "jobs" / f"gp-{work.name}"
        tel = next(iter(sorted(job_dir.rglob("telemetry.json"))), None)
        own = json.loads(tel.read_text()) if tel is not None else {}
        res["trainwatch_account"] = own.get("goodput")
        res["incidents"] = _incident_kinds(next(iter(sorted(job_dir.rglob("events.jsonl"))), job_dir / "events.jsonl"))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        res["dir"] = str(keep(work))
    return res


def _incident_kinds(path: Path) -> dict:
    kinds: dict[str, int] = {}
    for e in read_jsonl(path):
        if e.get("kind") not in (None, "action", "resolved"):
            kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
    return kinds


def measure(work: Path, world: int, t0: float, t_end: float, fired: list[dict] = ()) -> dict:
    """Goodput from the script's logs, the same for every tool.

    A collective skip nobody caught leaves every later step computing with
    wrong values (a gradient all-reduce paired with another step's), and so
    does a restart from a checkpoint written after it: those steps are not
    progress. Net progress then stops at the last step before the skip."""
    recs = {r: [x for x in read_jsonl(work / "logs" / f"rank{r}.jsonl") if x["mono"] <= t_end] for r in range(world)}
    steps = {r: [x for x in v if x["ev"] == "step"] for r, v in recs.items()}
    wall = t_end - t0
    if not all(steps.values()):
        return {"goodput": 0.0, "steps": 0, "wall_s": round(wall, 1), "step_s": None,
                "badput_s": {"startup": round(wall, 1), "recompute": 0.0, "down": 0.0}}
    # Fault-free step time: consecutive steps of one process.
    gaps = []
    for v in steps.values():
        for a, b in zip(v, v[1:]):
            if a["pid"] == b["pid"] and b["step"] == a["step"] + 1:
                gaps.append(b["mono"] - a["mono"])
    # The mean of those gaps, leaving out the stalls (over 3x the median): a
    # loaded machine's jitter is part of training, a hang is not.
    typical = statistics.median(gaps)
    step_s = statistics.fmean(g for g in gaps if g <= 3 * typical)
    # Net progress: the step every rank reached in the lineage the job ends with
    # (its newest process: where it resumed from, and the steps it did since).
    reached = []
    for r in range(world):
        newest = max((x for x in recs[r] if x["ev"] == "start"), key=lambda x: x["mono"])
        mine = [x["step"] for x in steps[r] if x["pid"] == newest["pid"]]
        reached.append(max(mine, default=newest.get("resumed_from", 0)))
    net = min(reached)
    desynced = None
    for f in sorted((f for f in fired if f["kind"] == "collective_skip"), key=lambda f: f["mono"]):
        clean = max((x["step"] for x in steps[f["rank"]] if x["mono"] < f["mono"]), default=0)
        # The first restart after the skip, on every rank: none (nobody caught
        # it), or one that resumed from a checkpoint written after it, leaves
        # the lineage computing with wrong values; later restarts resume from
        # checkpoints of that clean lineage.
        after = [min((x for x in recs[r] if x["ev"] == "start" and x["mono"] > f["mono"]),
                     key=lambda x: x["mono"], default=None) for r in range(world)]
        if any(a is None for a in after) or max(a.get("resumed_from", 0) for a in after) > clean:
            desynced = {"at_s": round(f["mono"] - t0, 1), "clean_step": clean, "steps_not_counted": max(0, net - clean)}
            net = min(net, clean)
            break
    startup = max(min(x["mono"] for x in v) for v in steps.values()) - t0
    starts = sorted((x for x in recs[0] if x["ev"] == "start"), key=lambda x: x["mono"])
    recompute_steps = 0
    for s in starts[1:]:  # every restart of rank 0: the steps it had done past the step it resumed from
        before = [x["step"] for x in steps[0] if x["mono"] < s["mono"]]
        if before:
            recompute_steps += max(0, max(before) - s["resumed_from"])
    productive = net * step_s
    recompute = min(recompute_steps * step_s, max(0.0, wall - productive - startup))
    return {"goodput": round(productive / wall, 4), "steps": net, "wall_s": round(wall, 1),
            "step_s": round(step_s, 4), "restarts": len(starts) - 1, "desynced": desynced,
            "badput_s": {"startup": round(startup, 1), "recompute": round(recompute, 1),
                         "down": round(max(0.0, wall - productive - startup - recompute), 1)}}


def nvrx_available(venv: Path) -> str | None:
    py, ftl = venv / "bin" / "python", venv / "bin" / "ft_launcher"
    if not py.exists() or not ftl.exists():
        return f"{venv} has no bin/python or bin/ft_launcher"
    r = subprocess.run([str(py), "-c", "import nvidia_resiliency_ext.fault_tolerance, torch"],
                       capture_output=True, text=True, timeout=300)
    return None if r.returncode == 0 else f"nvidia_resiliency_ext does not import there: {r.stderr.strip()[-300:]}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="wall time of each run (min)")
    p.add_argument("--fault-every-s", type=float, default=60.0, help="mean time between faults (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--topologies", nargs="+", default=["1x4", "2x2"], help="NODESxRANKS, e.g. 1x4 2x2")
    p.add_argument("--rounds", type=int, default=1, help="runs of every tool per topology, interleaved")
    p.add_argument("--sleep", type=float, default=0.05, help="the script's work per step (s)")
    p.add_argument("--ckpt-every", type=int, default=50, help="the script's checkpoint interval (steps)")
    p.add_argument("--compare-venv", type=Path, default=Path(NVRX_VENV))
    p.add_argument("--tools", nargs="+", default=list(TOOLS), choices=TOOLS)
    p.add_argument("--keep", action="store_true", help="keep each run's directory (logs, homes)")
    p.add_argument("--smoke", action="store_true",
                   help=SMOKE_HELP + "; trainwatch alone (the peers need the NVRx scratch venv and minutes)")
    args = p.parse_args()
    first_s = 20.0
    if args.smoke:  # 20 s of 1 node x 2 ranks, a fault every ~5 s from 4 s on, trainwatch alone
        args.minutes, args.fault_every_s, args.topologies, args.tools, args.rounds = 1 / 3, 5.0, ["1x2"], ["trainwatch"], 1
        first_s = 4.0
    topos = []
    for t in args.topologies:
        try:
            n, r = (int(x) for x in t.split("x"))
        except ValueError:
            raise SystemExit(f"error: --topologies takes NODESxRANKS such as 1x4; got {t!r}") from None
        topos.append((n, r))
    tools = list(args.tools)
    notes = {}
    if args.smoke:
        notes["peers"] = "skipped: --smoke runs trainwatch alone (nvrx-tuned needs its scratch venv, torchrun minutes)"
        log(f"peers {notes['peers']}")
    if "nvrx-tuned" in tools:
        why = nvrx_available(args.compare_venv)
        if why:
            notes["nvrx-tuned"] = f"skipped: {why} (install nvidia-resiliency-ext into a scratch venv there)"
            log(f"nvrx-tuned {notes['nvrx-tuned']}")
            tools.remove("nvrx-tuned")
    results: dict[str, list[dict]] = {t: [] for t in tools}
    for topo in topos:
        faults = schedule(args.seed, args.minutes * 60, args.fault_every_s, topo[0] * topo[1], first_s)
        log(f"{topo[0]}x{topo[1]}: {len(faults)} faults scheduled: "
            + ", ".join(f"{t:.0f}s {k} r{r}" for t, k, r in faults))
        for i in range(args.rounds):
            for tool in tools:
                log(f"[{topo[0]}x{topo[1]} round {i + 1}] {tool} for {args.minutes:g} min ...")
                res = run(tool, topo, args, faults)
                res["round"] = i
                results[tool].append(res)
                log(f"  goodput {res['goodput']:.3f}, {res['steps']} steps, badput {res['badput_s']}"
                    + (f", trainwatch's own account {res.get('trainwatch_account', {}).get('ratio')}"
                       if tool == "trainwatch" and res.get("trainwatch_account") else ""))
                print(json.dumps(res), flush=True)

    def summary(tool: str) -> dict | None:
        runs = results.get(tool) or []
        if not runs:
            return None
        wall = sum(r["wall_s"] for r in runs)
        return {"goodput": round(sum(r["goodput"] * r["wall_s"] for r in runs) / wall, 4),
                "steps": sum(r["steps"] for r in runs),
                "badput_s": {k: round(sum(r["badput_s"][k] for r in runs), 1) for k in ("startup", "recompute", "down")},
                "by_topology": {f"{r['topology']}#{r['round']}": {"goodput": r["goodput"], "steps": r["steps"]}
                                for r in runs}}

    ours = summary("trainwatch") or {"goodput": None, "steps": None, "badput_s": None}
    peers = {t: summary(t) for t in TOOLS if t != "trainwatch"}

    def ratio(peer: dict | None) -> float | None:
        if not peer or not ours.get("goodput") or not peer["goodput"]:
            return None
        return round(ours["goodput"] / peer["goodput"], 3)

    own = [r.get("trainwatch_account") for r in results.get("trainwatch", []) if r.get("trainwatch_account")]
    print(json.dumps({
        "tool": "trainwatch", **ours,
        "badput_s_by_cause": {c: round(sum(a["badput_s"].get(c, 0.0) for a in own), 1)
                              for c in (own[0]["badput_s"] if own else {})},
        "trainwatch_goodput_own_account": (round(sum(a["ratio"] * a["wall_s"] for a in own)
                                                 / sum(a["wall_s"] for a in own), 4) if own else None),
        "ratio_vs_nvrx_tuned": ratio(peers.get("nvrx-tuned")),
        "ratio_vs_torchrun": ratio(peers.get("torchrun")),
        "peers": peers, "notes": notes, "minutes": args.minutes, "fault_every_s": args.fault_every_s,
        "seed": args.seed, "topologies": args.topologies,
    }))


if __name__ == "__main__":
    import common

    common.main(main)
