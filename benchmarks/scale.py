"""Fleet scale: what a scrape costs, whether the sidecar's tick keeps its
period, how long `diagnose` takes, at 8 to 16384 simulated ranks.

    python benchmarks/scale.py [--quick]
    python benchmarks/scale.py --smoke   # every measurement at 8 to 64 ranks, a few seconds each (for tests)

Ranks are simulated where thousands are needed: real slot segments and real
sidecars (a node's 8 ranks per segment; the job-wide aggregator fed every
other node's summary through an in-process c10d HashStore, exactly what the
rendezvous store carries), real HTTP scrapes of the real exporter. `diagnose`
runs as the command: on a live 16-rank job (real gloo ranks) and on a finished
4096-rank job's telemetry. The last line is one JSON object:

  {"scrape_bytes": {"8": .., "512": .., "4096": ..}, "scrape_s": {..},
   "tick_period_ms": {"4096": .., "16384": ..}, "diagnose_s": {"live_16": .., "finished_4096": ..},
   "series_per_default_panel_max": ..}

At 512 and 4096 the scrape figures are the job-wide aggregator's endpoint (its
own node's ranks plus the job-wide series). `tick_period_ms` is the p99 of the
time between detection rounds of one sidecar watching that many ranks, with
snapshots and history samples due as usual (tick 150 ms; a round every tick, as
while something develops: the quiet cadence would only lengthen the period).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402

from common import SMOKE_HELP, log, new_home, run_command  # noqa: E402

RANKS_PER_NODE = 8


def _fill(segment, n: int, base: int, *, now: float, step: int) -> np.ndarray:
    """Write `n` healthy ranks (global ranks base..base+n-1) into a real segment."""
    from slot_tables import make_table

    from trainwatch import slots

    table = make_table(n, now=now, step=step, step_s=0.5, compute_s=0.3)
    table["rank"] += base
    table["world_size"] = base + n
    table["pid"] = os.getpid()
    rng = np.random.default_rng(base)
    table["loss"] = 2.0 + rng.normal(0, 0.05, n)
    table["step_s"] = 0.5 + rng.normal(0, 0.01, n).clip(-0.1, 0.1)
    for name in ("lr", "zero_grad_frac", "data_s", "backward_s", "optimizer_s"):
        table[name] = rng.uniform(0.01, 0.1, n)
    np.frombuffer(segment.buf, dtype=slots.slot_dtype(), count=n, offset=slots.HEADER_SIZE)[:] = table
    return table


class SimulatedNode:
    """A real segment of `n` ranks and a real sidecar watching it."""

    def __init__(self, job: str, node: str, n: int, base: int, tmp: Path, jobstore=None, aggregate=False):
        from trainwatch import slots, state
        from trainwatch.watchdog.sidecar import Sidecar

        state.JobDir(job).create()
        self.path = str(tmp / f"{node}.slots")
        slots.create_segment(self.path, n)
        self.segment = slots.Segment(self.path)
        self.n, self.base, self.step = n, base, 10
        self.advance()
        self.sidecar = Sidecar(job, self.path, node=node, out=io.StringIO(), jobstore=jobstore, aggregate=aggregate)

    def advance(self) -> None:
        """Every rank completes one more step now. The first call builds the
        table; later ones move only what a step moves (the simulated ranks share
        the sidecar's process here, so their writes must not hold its lock for
        long: real ranks are processes of their own)."""
        from slot_tables import set_ring

        from trainwatch import slots

        self.step += 1
        now, step = time.monotonic(), self.step
        if getattr(self, "table", None) is None:
            self.table = _fill(self.segment, self.n, self.base, now=now, step=step)
            return
        t = self.table
        t["step"] = t["sampled_step"] = step
        t["py_collectives"] = 2 * step
        t["progress_mono"] = t["phase_mono"] = t["heartbeat_mono"] = now
        set_ring(t, step, colls=t["py_collectives"], seq=3 * step)
        t["groups"]["enqueued"][:, 0] = t["groups"]["completed"][:, 0] = 3 * step
        np.frombuffer(self.segment.buf, dtype=slots.slot_dtype(), count=self.n, offset=slots.HEADER_SIZE)[:] = t


def scrape(url: str, rounds: int = 3) -> tuple[int, float]:
    sizes, times = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        with urllib.request.urlopen(url, timeout=300) as r:
            body = r.read()
        times.append(time.perf_counter() - t0)
        sizes.append(len(body))
    return sizes[-1], statistics.median(times)


def scrape_figures(ranks: int, tmp: Path) -> tuple[int, float]:
    from torch.distributed import HashStore

    from trainwatch.jobstore import JobStore
    from trainwatch.watchdog.jobwide import encode_summary
    from trainwatch.watchdog.sidecar import start_metrics_server

    job = f"scale{ranks}"
    store = None
    if ranks > RANKS_PER_NODE:
        store = JobStore("", job, store=HashStore())
        store.register("n0")
    me = SimulatedNode(job, "n0", min(ranks, RANKS_PER_NODE), 0, tmp, jobstore=store, aggregate=store is not None)
    try:
        if store is not None:  # every other node's summary, as its sidecar publishes it
            from slot_tables import make_table

            now = time.monotonic()
            for i in range(1, ranks // RANKS_PER_NODE):
                table = make_table(RANKS_PER_NODE, now=now, step=11)
                table["rank"] += i * RANKS_PER_NODE
                table["pid"] = os.getpid()
                store.register(f"n{i}")
                store.publish(f"n{i}", encode_summary(f"n{i}", 1, now, table))
        for _ in range(3):
            me.advance()
            me.sidecar.tick()
        address = start_metrics_server(me.sidecar, "127.0.0.1", 0)
        return scrape(f"http://{address}/metrics")
    finally:
        me.segment.close()
        os.unlink(me.path)


def tick_period_p99(ranks: int, tmp: Path, seconds: float) -> float:
    """p99 of the time between detection rounds of one sidecar watching `ranks`."""
    node = SimulatedNode(f"tick{ranks}", "n0", ranks, 0, tmp)
    node.sidecar.config.quiet_ticks = 1
    starts: list[float] = []
    node.sidecar.tick_started = starts.append
    stop = threading.Event()
    loop = threading.Thread(target=node.sidecar.run, args=(stop,))
    loop.start()
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:  # ranks step once a second, as a slow job's would
            time.sleep(1.0)
            node.advance()
    finally:
        stop.set()
        loop.join(120)
        node.segment.close()
        os.unlink(node.path)
    periods = np.diff(np.asarray(starts[2:])) * 1000  # past the first rounds (imports, first snapshot)
    return float(np.percentile(periods, 99)) if len(periods) else float("nan")


def diagnose_finished(ranks: int, tmp: Path) -> float:
    from trainwatch import state

    node = SimulatedNode("finished", "n0", ranks, 0, tmp)
    try:
        node.sidecar.tick()
        node.sidecar.write_snapshot()
    finally:
        node.segment.close()
        os.unlink(node.path)
    state.JobDir("finished").update_job(status="succeeded", node="n0", start_time=time.time() - 600,
                                        ranks=[{"rank": r, "pid": 1} for r in range(ranks)])
    return _time_diagnose("finished")


def _time_diagnose(job: str, rounds: int = 3) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        r = run_command([sys.executable, "-m", "trainwatch", "diagnose", job, "--json"], timeout=600, env=os.environ)
        times.append(time.perf_counter() - t0)
        if r.returncode != 0:
            raise RuntimeError(f"diagnose {job}: {r.stderr.strip()}")
    return statistics.median(times)


def diagnose_live(nproc: int) -> float:
    from common import launch, stop

    home = Path(os.environ["TRAINWATCH_HOME"])
    job = f"live{nproc}"
    proc = launch(home, "--nproc-per-node", str(nproc), "--job", job, str(ROOT / "tests/scripts/plain_ddp.py"),
                  "--steps", "1000000", "--sleep", "0.2")
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            r = run_command([sys.executable, "-m", "trainwatch", "diagnose", job, "--json", "--timeout", "3"],
                            timeout=120, env=os.environ)
            if r.returncode == 0 and json.loads(r.stdout)["status"] == "running":
                break
            time.sleep(1.0)
        else:
            raise RuntimeError(f"{job} never reached running")
        return _time_diagnose(job)
    finally:
        stop(proc)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="shorter tick runs; no 16384")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = p.parse_args()
    # --smoke: scrapes at 8 and 16 ranks (16: the aggregator's), the tick period at 64 ranks for 2 s,
    # diagnose of a finished 64-rank job and of a live 2-rank one, the default panels over 16 ranks.
    sizes = {"scrape": (8, 16), "tick": (64,), "tick_s": 2, "finished": 64, "live": 2, "panels": 16,
             "panels_s": 8.0} if args.smoke else {
        "scrape": (8, 512, 4096), "tick": (4096,) if args.quick else (4096, 16384), "tick_s": 10 if args.quick else 30,
        "finished": 4096, "live": 16, "panels": 4096, "panels_s": 45.0}
    home = new_home("scale")
    os.environ["TRAINWATCH_HOME"] = str(home)
    tmp = Path(f"/dev/shm/trainwatch-bench-scale-{os.getpid()}")
    tmp.mkdir()
    out: dict = {"scrape_bytes": {}, "scrape_s": {}, "tick_period_ms": {}, "diagnose_s": {}}
    try:
        for ranks in sizes["scrape"]:
            size, secs = scrape_figures(ranks, tmp)
            out["scrape_bytes"][str(ranks)], out["scrape_s"][str(ranks)] = size, round(secs, 4)
            log(f"scrape at {ranks} ranks: {size} bytes in {secs:.3f} s")
        for ranks in sizes["tick"]:
            p99 = tick_period_p99(ranks, tmp, sizes["tick_s"])
            out["tick_period_ms"][str(ranks)] = round(p99, 1)
            log(f"tick period p99 at {ranks} ranks: {p99:.1f} ms")
        finished, live = f"finished_{sizes['finished']}", f"live_{sizes['live']}"
        out["diagnose_s"][finished] = round(diagnose_finished(sizes["finished"], tmp), 3)
        log(f"diagnose of a finished {sizes['finished']}-rank job: {out['diagnose_s'][finished]} s")
        out["diagnose_s"][live] = round(diagnose_live(sizes["live"]), 3)
        log(f"diagnose of a live {sizes['live']}-rank job: {out['diagnose_s'][live]} s")
        counts = panel_series(sizes["panels"], tmp, sizes["panels_s"])
        empty = sorted(k for k, n in counts.items() if n == 0)
        out["series_per_default_panel_max"] = max(counts.values())
        log(f"series per default panel at {sizes['panels']} ranks: max {max(counts.values())} "
            f"({max(counts, key=counts.get)}); {len(counts)} panels, no data: {empty}")
    finally:
        for leftover in tmp.iterdir():
            leftover.unlink()
        tmp.rmdir()
    print(json.dumps(out))


def panel_series(ranks: int, tmp: Path, seconds: float = 45.0) -> dict[str, int]:
    """Series each default panel's PromQL returns (All jobs, nodes, ranks, GPUs)
    from a real Prometheus scraping `ranks` simulated ranks: one real sidecar
    and exporter per node of 8 (a shared fake GPU monitor playing each node's 8
    GPUs), the first node the job-wide aggregator, every node behind its own
    /metrics path of one HTTP server."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import requests
    from prometheus_client import CollectorRegistry, generate_latest
    from torch.distributed import HashStore

    from trainwatch import dashboards, netbind
    from trainwatch.inject.hardware import InjectedHardwareFaults
    from trainwatch.jobstore import JobStore
    from trainwatch.watchdog.exporter import TrainwatchCollector
    from trainwatch.watchdog.hardware import HardwareMonitor
    from util import prometheus_server

    job, store = "fleet", HashStore()
    gpus = HardwareMonitor(nproc=RANKS_PER_NODE, kernel_log_path=None,
                           injected=InjectedHardwareFaults([], nproc=RANKS_PER_NODE, kernel_log_path=None))
    nodes, registries = [], []
    for i in range(ranks // RANKS_PER_NODE):
        jobstore = JobStore("", job, store=store)
        jobstore.register(f"n{i}")
        node = SimulatedNode(job, f"n{i}", RANKS_PER_NODE, i * RANKS_PER_NODE, tmp, jobstore=jobstore,
                             aggregate=i == 0)
        node.sidecar.add_hardware(gpus)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(TrainwatchCollector(node.sidecar))
        nodes.append(node)
        registries.append(registry)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # /n<i>/metrics
            body = generate_latest(registries[int(self.path.split("/")[1][1:])])
            try:
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # Prometheus gave up on a slow scrape (a busy machine): its next one counts

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", netbind.free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cfg_dir = tmp.parent / f"{tmp.name}-prometheus"
    cfg_dir.mkdir()
    targets = cfg_dir / "targets.json"
    targets.write_text(json.dumps([{"targets": [f"127.0.0.1:{server.server_port}"],
                                    "labels": {"__metrics_path__": f"/n{i}/metrics"}} for i in range(len(nodes))]))
    config = {"global": {"scrape_interval": "5s", "scrape_timeout": "5s"},
              "scrape_configs": [{"job_name": "trainwatch", "file_sd_configs": [{"files": [str(targets)]}]}]}
    counts: dict[str, int] = {}
    try:
        with prometheus_server(cfg_dir, json.dumps(config)) as url:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:  # the ranks step, the sidecars read and aggregate
                for node in nodes:
                    node.advance()
                    node.sidecar.tick()
                time.sleep(1.0)
            values = {"job": ".*", "node": ".*", "rank": ".*", "gpu": ".*", "__rate_interval": "30s",
                      "__range": "5m", "__interval": "5s"}
            for name, text in dashboards.rendered().items():
                if not name.endswith(".json"):
                    continue
                for panel in json.loads(text)["panels"]:
                    for target in panel.get("targets", []):
                        expr = target["expr"]
                        for var, value in values.items():
                            expr = expr.replace("${" + var + "}", value).replace("$" + var, value)
                        r = requests.get(f"{url}/api/v1/query", params={"query": expr}, timeout=120).json()
                        if r["status"] != "success":
                            raise RuntimeError(f"{panel['title']}: {r.get('error')}")
                        key = f"{name}: {panel['title']}"
                        counts[key] = counts.get(key, 0) + len(r["data"]["result"])
    finally:
        server.shutdown()
        gpus.close()
        for node in nodes:
            node.segment.close()
            os.unlink(node.path)
        import shutil

        shutil.rmtree(cfg_dir, ignore_errors=True)
    return counts


if __name__ == "__main__":
    import common

    common.main(main)
