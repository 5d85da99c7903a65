"""Multi-node benchmark: two `trainwatch launch` agents on this machine as two
nodes, and the job-wide view at scale.

    python benchmarks/multinode.py [--skip-e2e]
    python benchmarks/multinode.py --smoke   # 2 nodes x 1 rank, short runs, 8 nodes / 64 ranks at scale (for tests)

1. A hang on node 1, rank 3 of a 2 x 2-rank job of the integrated trainer
   (per-node homes, one c10d rendezvous on loopback): is the culprit named
   once for the job, with its node; does `diagnose` on node 0 see every rank;
   does the job recover, every node resuming from the same step?
2. Node loss: node 1's whole process tree SIGKILLed; seconds until node 0
   records `node_lost` naming it.
3. Scale: synthetic summaries of 128 nodes x 8 ranks published through a real
   TCPStore on loopback; one job-wide refresh (read every summary, rebase,
   join, run the job-scope detectors) timed on 1024 ranks.
4. One whole sidecar round (read the segment, the step histogram, the
   detectors) on a real 4096-slot segment.

Progress goes to stderr; the LAST stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

import numpy as np

from trainwatch import netbind

from common import (BIN, SMOKE_HELP, env_for, events as incidents, log, new_home, reap_home, run_command, spawn,
                    wait_for)

TRAINER = ["-m", "trainwatch.trainer", "--model-size", "tiny", "--log-interval", "20"]


def free_port() -> int:
    return netbind.free_port()


def listening(port: int) -> bool:
    return netbind.is_listening("127.0.0.1", port)


def start_nodes(root: Path, job: str, port: int, *args: str, nproc: int = 2) -> tuple[list[Path], list[subprocess.Popen]]:
    homes, procs = [], []
    secret = os.urandom(16).hex()  # the job secret, the same on both nodes
    for i in range(2):
        home = root / f"node{i}"
        home.mkdir(parents=True)
        cmd = [str(BIN / "trainwatch"), "launch", "--nnodes", "2", "--node-rank", str(i), "--nproc-per-node", str(nproc),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", job, "--job", job,
               "--node-name", f"n{i}", "--metrics-port", "0", *args]
        log_file = open(root / f"node{i}.log", "w")
        # Each node in its own home; the secret as `launch` reads it, from the environment.
        procs.append(spawn(cmd, home, env=env_for(home, TRAINWATCH_JOB_SECRET=secret), stdout=log_file,
                           stderr=subprocess.STDOUT))
        log_file.close()
        homes.append(home)
        if i == 0:
            wait_for(lambda: listening(port), 120)
    return homes, procs


def stop(procs: list[subprocess.Popen], homes: list[Path]) -> None:
    """Kill both nodes outright, then reap what their launchers could not clean
    (slot segments, scrape targets), as `trainwatch jobs` would."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
    for home in homes:
        wait_for(lambda: reap_home(home), 10, 0.2)


def diagnose_ranks(home: Path, job: str) -> list[dict]:
    try:
        r = run_command([str(BIN / "trainwatch"), "diagnose", job, "--json"], home, timeout=120)
    except subprocess.TimeoutExpired:
        return []
    try:
        return json.loads(r.stdout)["ranks"] if r.returncode == 0 else []
    except (ValueError, KeyError):
        return []


def hang_scenario(root: Path, nproc: int = 2, steps: tuple[int, int, int] = (25, 60, 10)) -> dict:
    """A hang in the last rank of node 1 at step steps[0] of steps[1] (checkpoints every steps[2])."""
    job = f"mn-{uuid.uuid4().hex[:6]}"
    culprit, world = 2 * nproc - 1, 2 * nproc
    homes, procs = start_nodes(root / "hang", job, free_port(), "--inject",
                               f"hang:rank={culprit},step={steps[0]},where=compute", *TRAINER, "--max-steps",
                               str(steps[1]), "--ckpt-interval", str(steps[2]), nproc=nproc)
    try:
        ranks = wait_for(lambda: (lambda r: r if len(r) == world else None)(diagnose_ranks(homes[0], job)), 120,
                         0.5) or []
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        stop(procs, homes)
    hangs = [e for h in homes for e in incidents(h, job) if e["kind"] == "hang"]
    restarts = [e for h in homes for e in incidents(h, job) if e["kind"] == "restart"]
    resumed = {(e.get("evidence") or {}).get("resumed_from_step") for e in restarts}
    return {
        "culprit_ok": bool(hangs) and all(e.get("culprit_ranks") == [culprit] and e.get("nodes") == ["n1"]
                                          for e in hangs),
        "diagnose_sees_all_ranks": {(r.get("rank"), r.get("node")) for r in ranks}
        == {(k, f"n{k // nproc}") for k in range(world)},
        "recovered": codes == [0, 0],
        "incidents_per_fault": len({e["id"] for e in hangs}),
        "same_resume_step": len(resumed) == 1 and None not in resumed,
    }


def node_lost_scenario(root: Path, nproc: int = 2, wait_exit: bool = True) -> float | None:
    """Seconds from node 1's SIGKILL to node 0's node_lost incident; with `wait_exit`
    node 0 is then left to end on its own (its rendezvous timeout), else stopped."""
    job = f"mn-{uuid.uuid4().hex[:6]}"
    homes, procs = start_nodes(root / "lost", job, free_port(), "--rdzv-timeout", "10", *TRAINER,
                               "--max-steps", "100000", "--ckpt-interval", "50", nproc=nproc)
    try:
        if not wait_for(lambda: len(diagnose_ranks(homes[0], job)) == 2 * nproc, 120, 0.5):
            return None
        os.killpg(procs[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        found = wait_for(lambda: [e for e in incidents(homes[0], job) if e["kind"] == "node_lost"], 60, 0.05)
        took = time.monotonic() - t0 if found else None
        if wait_exit:
            procs[0].wait(timeout=180)
        return took
    finally:
        stop(procs, homes)


def aggregate_ms(nodes: int = 128, per_node: int = 8, rounds: int = 20) -> float:
    """One job-wide refresh over `nodes` summaries published to a real TCPStore."""
    from trainwatch import netbind
    from trainwatch.watchdog.detectors import default_detectors
    from trainwatch.watchdog.engine import DetectorEngine
    from trainwatch.jobstore import JobStore
    from trainwatch.watchdog.jobwide import Aggregator, decode_summary, encode_summary, job_scope

    server = netbind.bound_store("127.0.0.1", 0, timeout=timedelta(seconds=30))
    endpoint = f"127.0.0.1:{server.port}"
    publisher = JobStore(endpoint, "bench")
    reader = JobStore(endpoint, "bench")
    names = [f"node{i:03d}" for i in range(nodes)]
    for name in names:
        publisher.register(name)
    from trainwatch.watchdog.engine import _SyntheticJob

    job = _SyntheticJob(nodes * per_node)
    agg = Aggregator(DetectorEngine(job_scope(default_detectors(), aggregator=True)))
    times = []
    for r in range(rounds + 5):
        view = job.advance()
        for i, name in enumerate(names):
            publisher.publish(name, encode_summary(name, r + 1, view.now, view.table[i * per_node:(i + 1) * per_node]))
        t0 = time.perf_counter()
        summaries = [s for s in map(decode_summary, reader.summaries(reader.nodes())) if s is not None]
        agg.tick(summaries)
        if r >= 5:
            times.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(times), 2)


def sidecar_round_ms(nranks: int = 4096, rounds: int = 30) -> float:
    """One sidecar round on a real segment: read + histogram + detectors."""
    from trainwatch import slots
    from trainwatch.watchdog.engine import _SyntheticJob
    from trainwatch.watchdog.sidecar import Sidecar

    home = new_home("round")
    os.environ["TRAINWATCH_HOME"] = str(home)
    path = str(home / "seg.slots")
    slots.create_segment(path, nranks)
    job = _SyntheticJob(nranks)
    clock = {"now": job.now}
    sidecar = Sidecar(f"round-{uuid.uuid4().hex[:6]}", path, node="bench", clock=lambda: clock["now"],
                      out=open(os.devnull, "w"))
    raw = np.frombuffer(sidecar.segment.buf, dtype=slots.slot_dtype(), count=nranks, offset=slots.HEADER_SIZE)
    times = []
    try:
        for r in range(rounds + 60):
            view = job.advance()
            clock["now"] = view.now
            raw[:] = view.table
            t0 = time.perf_counter()
            sidecar.tick()
            if r >= 60:
                times.append((time.perf_counter() - t0) * 1000)
    finally:
        del raw
        sidecar.segment.close()
        shutil.rmtree(home, ignore_errors=True)
    return round(statistics.median(times), 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--skip-e2e", action="store_true", help="only the scale measurements")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = p.parse_args()
    # --smoke: 2 nodes x 1 rank, the hang at step 6 of 14 (checkpoints every 3); 8 nodes x 8 ranks
    # through the store, 3 rounds; a sidecar round over 64 ranks.
    nproc = 1 if args.smoke else 2
    out = {"nodes": 2, "culprit_ok": None, "diagnose_sees_all_ranks": None, "recovered": None,
           "incidents_per_fault": None, "same_resume_step": None, "node_lost_s": None}
    root = new_home("multinode")
    try:
        if not args.skip_e2e:
            log(f"hang on node 1 rank {2 * nproc - 1} (2 nodes x {nproc} ranks) ...")
            out.update(hang_scenario(root, nproc, (6, 14, 3) if args.smoke else (25, 60, 10)))
            log(f"  {out}")
            log("node 1 SIGKILLed ...")
            lost = node_lost_scenario(root, nproc, wait_exit=not args.smoke)
            out["node_lost_s"] = round(lost, 2) if lost is not None else None
            log(f"  node_lost after {out['node_lost_s']} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    log("job-wide refresh, 128 nodes x 8 ranks through a TCPStore ...")
    out["aggregate_ms_1024_ranks"] = aggregate_ms(8, 8, 3) if args.smoke else aggregate_ms()
    log("sidecar round at 4096 ranks ...")
    out["sidecar_round_ms_4096_ranks"] = sidecar_round_ms(64, 3) if args.smoke else sidecar_round_ms()
    print(json.dumps(out))


if __name__ == "__main__":
    import common

    common.main(main)
