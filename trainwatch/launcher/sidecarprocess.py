"""The node sidecar as the launcher's child: started with this run's options,
waited for until it serves, started again if it dies (training goes on
without it meanwhile), stopped with the job. What it runs is
`trainwatch.watchdog.sidecar`, by that module name (what `ps` shows).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from trainwatch import state
from trainwatch.launcher import guard, rendezvous
from trainwatch.launcher.options import LaunchConfig


class SidecarProcess:
    """Starts the node sidecar and keeps it running: if it dies, training goes on
    and the agent starts a new one (the sidecar is never a single point of failure)."""

    def __init__(self, config: LaunchConfig, segment_path: str, node: str, run_id: str, extra: list[str] = ()):
        self.config = config
        self.run_id = run_id
        self.extra = list(extra)
        self.dir = state.JobDir(config.job)
        self.segment_path = segment_path
        self.node = node
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        self.config.sidecar.write(self.dir.sidecar_config_file)
        # After the first start, rebind the same port so scrapers keep working.
        port = self.config.metrics_port
        if self.starts > 0:
            addr = str((state.read_json(self.dir.sidecar_file) or {}).get("metrics") or "")
            if addr.rsplit(":", 1)[-1].isdigit():
                port = int(addr.rsplit(":", 1)[1])
        cmd = [
            sys.executable, "-m", "trainwatch.watchdog.sidecar",
            "--job", self.config.job,
            "--slots", self.segment_path,
            "--node", self.node,
            "--metrics-host", self.config.metrics_host,
            "--metrics-port", str(port),
            "--config", str(self.dir.sidecar_config_file),
            "--run", self.run_id,
            "--launcher-pid", str(os.getpid()),
            *self.extra,
        ]
        # torch's C++ store client logs a stack dump when a peer's store goes
        # away at the end of a multi-node job; the sidecar says it in one line.
        environ = {**os.environ, "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=environ)
        self.starts += 1
        if self.starts > 1:
            self.dir.update_job(sidecar_pid=self.proc.pid, sidecar_starts=self.starts)

    def wait_ready(self, timeout_s: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            rec = state.read_json(self.dir.sidecar_file)
            if rec and self.proc is not None and rec.get("pid") == self.proc.pid:
                return rec
            if self.proc is not None and self.proc.poll() is not None:
                break
            time.sleep(0.05)
        return {}

    def ensure_running(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            print(
                f"[trainwatch] sidecar exited with code {self.proc.returncode}; starting a new one (training continues)",
                flush=True,
            )
            self.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_sidecar(config: LaunchConfig, job_dir: state.JobDir, node: str, run_id: str, launch_config,
                  segment_path: str, *, single_node: bool, hosts_store: bool, store_bind: str | None,
                  undo: list) -> SidecarProcess:
    """The node's sidecar, started and waited for (`undo` stops it if the start
    fails later); `hosts_store`: this node holds the rendezvous store."""
    # A multi-node job gets one job-wide watchdog through the rendezvous store.
    extra = []
    if not single_node and launch_config.rdzv_backend == "c10d":
        extra = guard.store_sidecar_args(job_dir, rendezvous.store_address(launch_config.rdzv_endpoint),
                                         launch_config.run_id, aggregate=hosts_store, secret=config.job_secret,
                                         undo=undo)
    guard.warn_exposure(metrics_host=config.metrics_host if config.metrics_port >= 0 else None,
                        store=extra[1] if extra else None, rank_store_bind=store_bind,
                        sealed=config.job_secret is not None)
    sidecar = SidecarProcess(config, segment_path, node, run_id, extra)
    undo.append(sidecar.stop)
    sidecar.start()
    ready = sidecar.wait_ready()
    metrics = ready.get("metrics")
    job_dir.update_job(sidecar_pid=sidecar.proc.pid if sidecar.proc else None, metrics=metrics)
    if metrics:
        print(f"[trainwatch] metrics: http://{metrics}/metrics", flush=True)
        target = state.write_scrape_target(config.job, node, rendezvous.reachable(metrics))
        if target is None:
            print(f"[trainwatch] warning: cannot write the Prometheus target under {state.targets_dir()}; "
                  "set TRAINWATCH_TARGETS_DIR to a writable directory", flush=True)
    return sidecar
