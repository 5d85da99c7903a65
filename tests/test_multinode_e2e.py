"""Multi-node jobs on one machine: two `trainwatch launch` agents as two
nodes (their own TRAINWATCH_HOME and node name, one c10d rendezvous on
loopback), watched by one job-wide watchdog through the rendezvous store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from trainwatch import netbind
from util import BIN, ROOT, env_for, events, reap, wait_for

pytestmark = pytest.mark.slow

TRAINER = ["-m", "trainwatch.trainer", "--model-size", "tiny", "--log-interval", "20"]


def free_port() -> int:
    return netbind.free_port()


def listening(port: int) -> bool:
    return netbind.is_listening("127.0.0.1", port)


class Nodes:
    """N agents of one job, each node with its own home."""

    def __init__(self, tmp_path: Path, n: int = 2, shared_home: bool = False):
        self.job = f"mn-{uuid.uuid4().hex[:8]}"
        self.secret = uuid.uuid4().hex  # the job secret every node is given (TRAINWATCH_JOB_SECRET)
        self.port = free_port()
        self.homes = [tmp_path / ("home" if shared_home else f"home{i}") for i in range(n)]
        self.procs: list[subprocess.Popen] = []
        self.logs = [tmp_path / f"node{i}.log" for i in range(n)]

    def start(self, *args: str, **launch) -> None:
        for i, home in enumerate(self.homes):
            home.mkdir(exist_ok=True)
            cmd = [str(BIN / "trainwatch"), "launch", "--nnodes", str(len(self.homes)), "--node-rank", str(i),
                   "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}",
                   "--rdzv-id", self.job, "--job", self.job, "--node-name", f"n{i}", "--metrics-port", "0", *args]
            with open(self.logs[i], "w") as log:
                self.procs.append(subprocess.Popen(cmd, env=env_for(home, TRAINWATCH_JOB_SECRET=self.secret), stdout=log, stderr=subprocess.STDOUT,
                                                   cwd=str(ROOT), start_new_session=True))
            if i == 0:  # node 0 hosts the rendezvous store, as the endpoint's machine would
                wait_for(lambda: listening(self.port), 120, interval=0.1, what="node 0's rendezvous store")

    def wait(self, timeout: float = 300) -> list[int]:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        return [p.returncode for p in self.procs]

    def log(self, i: int) -> str:
        return self.logs[i].read_text(errors="replace")

    def stop(self) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        for home in set(self.homes):
            if home.exists():
                reap(home)


@pytest.fixture(params=["per-node homes", "shared home"])
def nodes(request, tmp_path):
    n = Nodes(tmp_path, shared_home=request.param == "shared home")
    yield n
    n.stop()


def node_job(home: Path, job: str, node: str) -> dict:
    from trainwatch import state

    return state.JobDir.resolve(job, root=home, node=node).read_job() or {}


def diagnose(home: Path, job: str) -> dict:
    r = subprocess.run([str(BIN / "trainwatch"), "diagnose", job, "--json"], env=env_for(home), capture_output=True,
                       text=True, timeout=120, cwd=str(ROOT))
    if r.returncode == 2 and "unknown job" in r.stderr:
        return {"ranks": []}  # not started yet
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_a_hang_on_one_node_is_one_job_incident_and_every_node_resumes_from_one_step(nodes):
    nodes.start("--inject", "hang:rank=3,step=25,where=compute", *TRAINER, "--max-steps", "60",
                "--ckpt-interval", "10")
    # Any node sees every rank of the job, each with its node.
    seen = wait_for(lambda: (d := diagnose(nodes.homes[0], nodes.job)) and len(d["ranks"]) == 4 and d,
                    120, interval=0.5, what="node 0 to list all four ranks")
    assert {(r["rank"], r["node"]) for r in seen["ranks"]} == {(0, "n0"), (1, "n0"), (2, "n1"), (3, "n1")}
    # ... and every rank's stack: node 1's sidecar captures its own ranks and answers through the store.
    stacks = wait_for(lambda: (d := diagnose(nodes.homes[0], nodes.job)) and d["status"] == "running"
                      and {r for g in d["stack_groups"] for r in g["ranks"]} == {0, 1, 2, 3} and d,
                      90, interval=0.5, what="diagnose on node 0 to show the stacks of all four ranks")
    assert all(g["frames"] or g["error"] for g in stacks["stack_groups"])
    # Job-level series come from the aggregator (node 0) alone: one alert per job.
    pages = [urllib.request.urlopen(f"http://{node_job(h, nodes.job, f'n{i}')['metrics']}/metrics", timeout=10)
             .read().decode() for i, h in enumerate(nodes.homes)]
    assert f'trainwatch_job_nodes{{trainwatch_job="{nodes.job}"}} 2.0' in pages[0] and f'trainwatch_job_ranks{{trainwatch_job="{nodes.job}"}} 4.0' in pages[0]
    assert "trainwatch_job_nodes" not in pages[1]
    codes = nodes.wait()
    assert codes == [0, 0], nodes.log(0)[-3000:] + nodes.log(1)[-3000:]
    homes = sorted(set(nodes.homes))
    hangs = [e for home in homes for e in events(home, nodes.job) if e.kind == "hang"]
    assert len({e.id for e in hangs}) == 1, hangs  # one incident for the job, recorded on each node
    assert all(e.culprit_ranks == [3] and e.nodes == ["n1"] for e in hangs), hangs
    assert "culprit rank(s) 3 on node n1" in nodes.log(0)
    restarts = [e for home in homes for e in events(home, nodes.job) if e.kind == "restart"]
    assert len({e.evidence["resumed_from_step"] for e in restarts}) == 1, restarts  # the same step everywhere
    assert [node_job(h, nodes.job, f"n{i}")["restarts"] for i, h in enumerate(nodes.homes)] == [1, 1]
    listing = subprocess.run([str(BIN / "trainwatch"), "jobs", "--json"], env=env_for(nodes.homes[0]),
                             capture_output=True, text=True, timeout=60)
    entries = [j for j in json.loads(listing.stdout) if j["job"] == nodes.job]
    assert len(entries) == 1  # the job once, with the nodes that keep records in this home
    assert entries[0]["nodes"] == (["n0", "n1"] if len(homes) == 1 else ["n0"])
    assert "Traceback" not in nodes.log(0) + nodes.log(1)


@pytest.mark.parametrize("kill", ["node", "launcher"])
def test_a_lost_node_is_named_and_the_survivor_stops_cleanly(nodes, kill):
    nodes.start("--rdzv-timeout", "10", *TRAINER, "--max-steps", "100000", "--ckpt-interval", "50")
    wait_for(lambda: len(diagnose(nodes.homes[0], nodes.job)["ranks"]) == 4, 120, interval=0.5,
             what="both nodes training")
    victim = nodes.procs[1]
    if kill == "node":
        os.killpg(victim.pid, signal.SIGKILL)
    else:
        victim.send_signal(signal.SIGKILL)  # its ranks and sidecar die with it
    t0 = time.monotonic()
    lost = wait_for(lambda: [e for e in events(nodes.homes[0], nodes.job) if e.kind == "node_lost"], 60,
                    what="node_lost on node 0")
    took = time.monotonic() - t0
    assert lost[0].nodes == ["n1"] and lost[0].culprit_ranks == [2, 3], lost
    # The survivors' lost connections are victims of the lost node, never culprits.
    crashes = [e for e in events(nodes.homes[0], nodes.job) if e.kind == "crash"]
    assert not [e for e in crashes if set(e.culprit_ranks or []) & {0, 1}], crashes
    assert took < 15, took  # the hang threshold (5 s) plus the summary interval, with room for a busy machine
    code = nodes.procs[0].wait(timeout=180)
    out = nodes.log(0)
    assert code != 0 and "succeeded" not in out, out[-3000:]
    assert "the nodes did not meet again" in out and "Traceback" not in out, out[-3000:]
    assert node_job(nodes.homes[0], nodes.job, "n0")["status"] == "failed"


def test_diagnose_on_node_0_names_the_culprit_on_node_1(tmp_path):
    nodes = Nodes(tmp_path)
    try:
        nodes.start("--no-restart", "--inject", "hang:rank=3,step=15,where=compute", *TRAINER, "--max-steps", "100000")
        wait_for(lambda: [e for e in events(nodes.homes[0], nodes.job) if e.kind == "hang"], 120,
                 what="the job's hang incident on node 0")
        report = diagnose(nodes.homes[0], nodes.job)
        assert report["verdict"]["culprit_ranks"] == [3], report["verdict"]
        nodes_of = {r["rank"]: r["node"] for r in report["ranks"]}
        assert nodes_of[3] == "n1" and report["status"] == "running"
        # Rank 3's stack came from node 1's sidecar: it is in a group of its own.
        assert [g for g in report["stack_groups"] if g["ranks"] == [3]], report["stack_groups"]
    finally:
        nodes.stop()


OUTSIDER = """
import json, sys, time
from trainwatch.jobstore import JobStore
store = JobStore(sys.argv[1], sys.argv[2])  # reaches the port, has no secret
deadline = time.monotonic() + float(sys.argv[3])
while time.monotonic() < deadline:
    store.register("evil")
    store.add_incident({"kind": "hang", "severity": "critical", "scope": "job", "id": "forged",
                        "culprit_ranks": [0, 1, 2, 3], "nodes": ["n0", "n1"], "summary": "forged"})
    store.request_capture("evil")
    store.publish("evil", b"forged summary")
    time.sleep(0.2)
# What the store gives away without the secret: nothing that decodes.
from trainwatch.watchdog.jobwide import decode_summary
raw = [store.store.get(store.key(f"summary/{n}")) for n in ("n0", "n1")]
print(json.dumps({"summaries_read": sum(decode_summary(b) is not None for b in raw)}))
"""


def test_an_outsider_without_the_secret_takes_no_action(tmp_path):
    nodes = Nodes(tmp_path)
    try:
        nodes.start(*TRAINER, "--max-steps", "100000", "--ckpt-interval", "1000")
        wait_for(lambda: len(diagnose(nodes.homes[0], nodes.job)["ranks"]) == 4, 120, interval=0.5,
                 what="both nodes training")
        def remote_captures() -> set[str]:
            return {p.name for home in nodes.homes for p in (home / "jobs" / nodes.job / "stacks").glob("*-remote-*")}

        before = remote_captures()  # diagnose's own (sealed) requests
        outsider = subprocess.run([sys.executable, "-c", OUTSIDER, f"127.0.0.1:{nodes.port}", nodes.job, "6"],
                                  env=env_for(tmp_path), capture_output=True, text=True, timeout=120, cwd=str(ROOT))
        assert outsider.returncode == 0, outsider.stderr
        assert json.loads(outsider.stdout.splitlines()[-1]) == {"summaries_read": 0}
        page = urllib.request.urlopen(f"http://{node_job(nodes.homes[0], nodes.job, 'n0')['metrics']}/metrics",
                                      timeout=10).read().decode()
        rejected = [line for line in page.splitlines() if line.startswith("trainwatch_store_rejected_total")]
        assert rejected and float(rejected[0].split()[-1]) >= 10, rejected
        # Every rank is still in its first run: no incident, capture, checkpoint or restart was taken.
        for i, home in enumerate(nodes.homes):
            assert [e for e in events(home, nodes.job) if e.id == "forged" or e.kind == "hang"] == []
            assert node_job(home, nodes.job, f"n{i}").get("restarts") == 0
        assert remote_captures() == before  # no py-spy run for a forged capture request
        assert "evil" not in json.dumps(diagnose(nodes.homes[0], nodes.job)["ranks"])
        assert "Traceback" not in nodes.log(0) + nodes.log(1)
    finally:
        nodes.stop()


def test_losing_the_rendezvous_host_is_named_on_the_surviving_node(tmp_path):
    """Node 0 holds the job's store. When it is killed, node 1 says that the
    rendezvous host is gone (not that a rendezvous timed out), in its console
    and as a node_lost incident in its own records, and exits non-zero."""
    nodes = Nodes(tmp_path)
    try:
        nodes.start("--rdzv-timeout", "10", *TRAINER, "--max-steps", "100000")
        wait_for(lambda: len(diagnose(nodes.homes[1], nodes.job)["ranks"]) == 4, 120, interval=0.5,
                 what="both nodes training")
        os.killpg(nodes.procs[0].pid, signal.SIGKILL)
        code = nodes.procs[1].wait(timeout=180)
        out = nodes.log(1)
        assert code != 0 and "succeeded" not in out, out[-3000:]
        assert f"rendezvous host 127.0.0.1:{nodes.port} no longer answers" in out, out[-3000:]
        assert "Traceback" not in out, out[-3000:]
        lost = [e for e in events(nodes.homes[1], nodes.job) if e.kind == "node_lost"]
        assert lost and "rendezvous host" in lost[-1].summary, lost
        crashes = [e for e in events(nodes.homes[1], nodes.job) if e.kind == "crash"]
        assert not [e for e in crashes if set(e.culprit_ranks or []) & {2, 3}], crashes
    finally:
        nodes.stop()



def test_a_collective_skipped_on_another_node_is_a_mismatch_naming_rank_and_node(tmp_path):
    """Rank 3 (node 1) skips a collective: the job-wide watchdog on node 0 calls
    it a collective_mismatch with rank 3 on n1 as the culprit, not a hang with
    no culprit."""
    nodes = Nodes(tmp_path)
    try:
        nodes.start("--inject", "hang:where=collective_skip,rank=3,step=15", "--max-restarts", "0",
                    *TRAINER, "--max-steps", "100000")
        found = wait_for(lambda: [e for e in events(nodes.homes[0], nodes.job)
                                  if e.kind in ("collective_mismatch", "hang")], 120, what="the skip's incident")
    finally:
        nodes.stop()
    first = found[0]
    assert first.kind == "collective_mismatch", found
    assert first.culprit_ranks == [3] and first.nodes == ["n1"], first


def test_a_stopped_rank_on_two_nodes_is_one_incident_on_each_node(tmp_path):
    """Rank 1 (node 0) is stopped: node 0's process state names it at once (its
    own hang incident); the job's hang detector, on node 0 too, calls the same
    stall later: node 0 keeps its one incident, node 1 records the job's."""
    nodes = Nodes(tmp_path)
    try:
        nodes.start("--inject", "stop:rank=1,step=15", "--no-restart", *TRAINER, "--max-steps", "100000")
        hangs = lambda i: [e for e in events(nodes.homes[i], nodes.job) if e.kind == "hang"]  # noqa: E731
        wait_for(lambda: hangs(0), 120, what="node 0's incident for the stopped rank")
        wait_for(lambda: hangs(1), 60, what="the job's hang incident, taken by node 1")
        # Node 0 takes the same job incident in the same store rounds: watch it for a few of them.
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and len(hangs(0)) == 1:
            time.sleep(0.2)
        per_node = [hangs(0), hangs(1)]
    finally:
        nodes.stop()
    assert [len(found) for found in per_node] == [1, 1], per_node
    assert all(found[0].culprit_ranks == [1] for found in per_node), per_node


def test_a_rank_killed_again_and_again_is_crashes_only_while_both_nodes_restart(tmp_path):
    """Rank 3 (node 1) is SIGKILLed four times: the restarts back off (0, 2,
    4, 8 s), and all that while the slots on both nodes hold the stopped
    workers' last steps and silent heartbeats. The job-wide watchdog on node 0
    judges none of it (no job hang, no mismatch): node 1 records its crashes,
    and every restart comes back."""
    nodes = Nodes(tmp_path)
    crashes = [a for step in (25, 40, 55, 70) for a in ("--inject", f"crash:rank=3,step={step},signal=KILL")]
    try:
        nodes.start("--max-restarts", "5", *crashes, *TRAINER, "--max-steps", "90", "--ckpt-interval", "10")
        codes = nodes.wait()
    finally:
        nodes.stop()
    assert codes == [0, 0], nodes.log(0)[-3000:] + nodes.log(1)[-3000:]
    found = [[e for e in events(h, nodes.job) if e.kind in ("crash", "hang", "collective_mismatch", "node_lost")]
             for h in nodes.homes]
    assert not [e for f in found for e in f if e.kind != "crash"], found
    assert [e.culprit_ranks for e in found[1]] == [[3]] * 4, found[1]
    assert [node_job(h, nodes.job, f"n{i}")["restarts"] for i, h in enumerate(nodes.homes)] == [4, 4]
