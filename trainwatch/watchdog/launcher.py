"""`trainwatch launch`: torchrun's behaviour, plus the watchdog.

    trainwatch launch [torchrun options] [--job NAME] [--inject SPEC]... [--metrics-port N]
                      [watchdog options] [SCRIPT | -m MODULE] [ARGS...]

With no script it runs the integrated trainer's default job. The options are
parsed and checked in `options`; here the job directory, the slot segment, the
sidecar and torchelastic's agent are set up and run.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

from trainwatch import env, kinds, liveness, netbind, slots, state
from trainwatch.records import JobStatus
from trainwatch.inject import spec as inject
from trainwatch.usage import printable
from trainwatch.views.summary import failure_summary
from trainwatch.watchdog import failures, guard, prescan, preflight, rendezvous, warmstart
from trainwatch.watchdog.options import PREEMPTED_EXIT, LaunchConfig, LaunchError, parse, print_config

log = logging.getLogger("trainwatch")

__all__ = ["LaunchError", "launch"]


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


def _worker_command(args: argparse.Namespace, cmd, cmd_args: list[str]) -> tuple:
    """Route python workers through the zero-code bootstrap (same interpreter,
    same -u); non-python entrypoints run as given."""
    if isinstance(cmd, str) and not args.no_python and not args.run_path and cmd_args and cmd_args[0] == "-u":
        return cmd, ["-u", "-m", "trainwatch.rank.bootstrap", *cmd_args[1:]]
    return cmd, cmd_args


def launch(argv: list[str], announced: tuple[str, state.JobDir, liveness.RunLock] | None = None) -> int:
    """Run the job. `announced`: what `prescan.announce(argv)` returned when the
    caller announced the launch before importing this module (the CLI does)."""
    if prescan.prescan_print_config(argv):  # says what a launch would run with, runs nothing
        sys.stdout.write(print_config(argv))
        return 0
    with guard.StartUp() as undo:  # a failed start: one line, and what it made is undone
        if announced is None:
            try:
                announced = prescan.announce(argv)
            except state.StateError as e:
                raise LaunchError(str(e)) from None
        early, marker, lock = announced
        undo.append(lambda: marker.withdraw_launch(failed=True))
        return _launch(argv, early, marker, lock, undo)


def _launch(argv: list[str], early: str, marker: state.JobDir, lock: liveness.RunLock, undo: list) -> int:
    args, config = parse(argv, default_job=early)
    # The ranks never need the job secret: it goes to the sidecar through an owner-only file.
    os.environ.pop(env.JOB_SECRET, None)
    preflight.check_launch(args)  # the doctor's warnings; --strict stops on a failed check
    fr_size = os.environ.get(env.FR_BUFFER_SIZE)
    if fr_size is not None and not fr_size.strip().isdigit():
        # torch reads it in init_process_group and every rank hangs there.
        raise LaunchError(f"{env.FR_BUFFER_SIZE}={fr_size!r} is not a whole number (torch hangs in "
                          f"init_process_group with it): unset it or set e.g. {env.FR_BUFFER_SIZE}=2000")
    try:
        if config.job != early:
            marker.withdraw_launch(failed=True)
            lock.release()
            lock = liveness.acquire(state.JobDir(config.job))
        job_dir = state.JobDir(config.job).create()
    except state.StateError as e:
        raise LaunchError(str(e)) from None
    # The name is ours now: what an earlier run of it left (a segment, a target
    # file, a job.json saying `running`) is cleaned, and its control records are
    # not this run's.
    previous = job_dir.read_job()
    if previous is not None:
        liveness.reap(job_dir, previous, locked=True)
    job_dir.start_run()
    run_id = uuid.uuid4().hex[:12]

    # torch loads only now, after the job was announced: `diagnose` knows it meanwhile.
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError as RENDEZVOUS_ERRORS
    from torch.distributed.run import config_from_args, parse_min_max_nnodes

    from trainwatch.watchdog.agent import TrainwatchAgent

    # Same defaults torchrun applies in run(): a single-node job gets a local c10d store.
    if args.standalone:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        if parse_min_max_nnodes(args.nnodes)[1] == 1:
            args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    elif args.rdzv_backend == "static" and int(args.node_rank or 0) == 0:
        preflight.check_master_port(args)  # this node hosts the store on it
    # The stores are not authenticated: a single-node job's listen on loopback
    # only; a multi-node job's on the address given by --local-addr (README).
    single_node = parse_min_max_nnodes(str(args.nnodes))[1] == 1
    if single_node and not args.local_addr:
        args.local_addr = "127.0.0.1"
    store_bind = "127.0.0.1" if single_node else args.local_addr
    if store_bind is None and args.rdzv_endpoint and netbind.is_loopback(rendezvous.store_address(args.rdzv_endpoint)
                                                                         .rpartition(":")[0]):
        # Every node on this machine: rank 0's store need not be reachable elsewhere
        # (and is advertised as loopback, so the other nodes' ranks find it there).
        store_bind = args.local_addr = "127.0.0.1"
    if args.rdzv_id == "none":
        args.rdzv_id = config.job
    if args.rdzv_timeout is not None:
        args.rdzv_conf = ",".join(filter(None, [args.rdzv_conf, f"join_timeout={int(args.rdzv_timeout) or 1}"]))
    if not config.sidecar.actions.restart:
        args.max_restarts = 0  # alert-only: crashes are reported, never restarted

    try:
        launch_config, cmd, cmd_args = config_from_args(args)
    except (ValueError, AssertionError, RuntimeError) as e:
        raise LaunchError(f"invalid torchrun options: {e}") from None
    cmd, cmd_args = _worker_command(args, cmd, cmd_args)
    zygote = None
    if not args.no_warm_start and isinstance(cmd, str) and tuple(cmd_args[:3]) == warmstart.BOOTSTRAP \
            and warmstart.install():
        # It imports torch (and the entry's installed packages) while the sidecar
        # starts and the rendezvous runs; it dies with the launcher.
        zygote = warmstart.Zygote(warmstart.entry_imports(args.training_script, args.module), list(cmd_args[3:]),
                                  config.job)
        zygote.start()

    node = args.node_name or socket.gethostname()
    nslots = launch_config.nproc_per_node
    # One segment per run and node: two launches never share one, whatever their homes.
    segment_path = os.path.join(slots.default_segment_dir(),
                                f"trainwatch-{os.getuid()}-{config.job}@{state.safe_filename(node)}-{run_id}.slots")
    if zygote is not None:
        undo.append(zygote.close)
    try:
        slots.create_segment(segment_path, nslots)
        undo.append(lambda: os.unlink(segment_path))
        segment = slots.Segment(segment_path)
        undo.append(segment.close)
    except ValueError as e:
        raise LaunchError(str(e)) from None

    os.environ[env.JOB] = config.job
    os.environ[env.RUN] = run_id
    os.environ[env.LAUNCHER_PID] = str(os.getpid())
    if store_bind:
        os.environ[env.STORE_BIND] = store_bind
    os.environ[env.HOME] = str(state.home().resolve())
    os.environ[env.SLOTS] = segment_path
    os.environ[env.INJECT] = inject.encode([f for f in config.faults if f.kind not in inject.HARDWARE_KINDS])
    os.environ[env.NAN_POLICY] = config.nan_policy
    os.environ.setdefault(env.FR_BUFFER_SIZE, "2000")
    # With the rendezvous TCPStore shared across rounds (torch's default), a
    # restarted gloo worker group reads the previous attempt's addresses from
    # the store and fails in connectFullMesh ("Connection refused"): plain
    # torchrun --max-restarts cannot restart such a job. A fresh store per
    # attempt avoids it.
    os.environ.setdefault(env.FRESH_RDZV_STORE, "1")
    # Checkpoints (periodic and emergency) default into the job's directory, so a
    # restarted worker group resumes from them with no flag.
    os.environ.setdefault(env.CKPT_DIR, str(job_dir.checkpoints_dir))

    entry = " ".join([("-m " if args.module else "") + args.training_script, *args.training_script_args])
    job_dir.update_job(
        status=JobStatus.STARTING,
        run_id=run_id,
        node_scoped=bool(os.environ.get(env.NODE_SCOPE)),
        start_time=time.time(),
        node=node,
        nodes=[node],
        launcher_pid=os.getpid(),
        nproc_per_node=nslots,
        nnodes=args.nnodes,
        max_restarts=args.max_restarts,
        restarts=0,
        entrypoint=entry,
        slots=segment_path,
        state_dir=str(job_dir.path),
        faults=[f.to_json() for f in config.faults],
        metrics=None,
    )
    marker.withdraw_launch()
    print(f"[trainwatch] job {config.job}: {entry} on {nslots} local rank(s); state in {job_dir.path}", flush=True)

    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.launcher.api import _get_addr_and_port

    rdzv_parameters = RendezvousParameters(
        backend=launch_config.rdzv_backend,
        endpoint=launch_config.rdzv_endpoint,
        run_id=launch_config.run_id,
        min_nodes=launch_config.min_nodes,
        max_nodes=launch_config.max_nodes,
        local_addr=launch_config.local_addr,
        **launch_config.rdzv_configs,
    )
    try:
        rdzv_handler, hosts_store = rendezvous.rendezvous_handler(rdzv_parameters, store_bind if single_node else None)
    except Exception as e:  # the rendezvous host unreachable: torch's RendezvousConnectionError, ...
        job_dir.update_job(status=JobStatus.FAILED, end_time=time.time(), exit_code=1)
        raise LaunchError(f"cannot reach the rendezvous at {launch_config.rdzv_endpoint} "
                          f"({type(e).__name__}); start the node hosting it first, or check --rdzv-endpoint") from None
    # A multi-node job gets one job-wide watchdog through the rendezvous store.
    extra = []
    if not single_node and launch_config.rdzv_backend == "c10d":
        extra = guard.store_sidecar_args(job_dir, rendezvous.store_address(launch_config.rdzv_endpoint), launch_config.run_id,
                                         aggregate=hosts_store, secret=config.job_secret, undo=undo)
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

    master_addr, master_port = _get_addr_and_port(rdzv_parameters)
    # Preemption signals (Slurm's --signal=USR1) reach the agent as torchelastic's SignalException too.
    handled = [x.strip() for x in launch_config.signals_to_handle.split(",") if x.strip()]
    handled += [f"SIG{name}" for name in config.preempt_signals if f"SIG{name}" not in handled]
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(handled)
    spec = WorkerSpec(
        role=launch_config.role,
        local_world_size=launch_config.nproc_per_node,
        entrypoint=cmd,
        args=tuple(cmd_args),
        rdzv_handler=rdzv_handler,
        max_restarts=launch_config.max_restarts,
        monitor_interval=launch_config.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=launch_config.local_addr,
    )
    agent = TrainwatchAgent(
        spec=spec,
        logs_specs=launch_config.logs_specs,
        start_method=launch_config.start_method,
        log_line_prefix_template=launch_config.log_line_prefix_template,
        job=config.job,
        run_id=run_id,
        segment=segment,
        sidecar=sidecar,
        emergency_timeout_s=config.sidecar.actions.emergency_timeout_s,
        zygote=zygote,
        preempt_signals=frozenset(int(getattr(signal, f"SIG{name}")) for name in config.preempt_signals),
        preempt_grace_s=config.preempt_grace_s,
        node=node,
    )

    status, code = JobStatus.FAILED, 1
    undo.clear()  # from here the clean-up below owns the segment, the sidecar and the zygote
    try:
        result = agent.run()
        from torch.distributed.elastic.agent.server.api import WorkerState

        if result.state != WorkerState.SUCCEEDED:
            status, code = JobStatus.FAILED, 1
            exits = ", ".join(
                f"rank {r}: exit code {f.exitcode}" for r, f in sorted(result.failures.items())
            ) or "the watchdog's restart budget is spent"
            print(f"[trainwatch] job {config.job} failed ({exits})", file=sys.stderr, flush=True)
        else:
            status, code = JobStatus.SUCCEEDED, 0
    except ChildFailedError as e:
        # torchelastic's summary quotes the ranks' own error files: shown, never acted on by the terminal.
        print(printable(f"[trainwatch] job {config.job} failed: {e}"), file=sys.stderr, flush=True)
    except RENDEZVOUS_ERRORS as e:
        host_lost, why = failures.rendezvous_lost(e, launch_config.rdzv_endpoint)
        print(printable(f"[trainwatch] job {config.job} failed: the nodes did not meet again ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200] if str(e) else 'no detail'}); {why}"), file=sys.stderr,
              flush=True)
        if host_lost:  # this node survived the one that held the store: its incident, in its own records
            lost = kinds.KINDS["node_lost"]
            job_dir.append_event({"kind": lost.name, "id": f"{node}-{run_id}-rdzv-host", "severity": lost.severity,
                                  "runbook": lost.runbook, "culprit_ranks": [], "victims": [], "node": node,
                                  "summary": f"node_lost: {why}", "time": time.time(),
                                  "evidence": {"node": "rendezvous host", "endpoint": launch_config.rdzv_endpoint}})
            job_dir.append_event({"kind": "resolved", "incident": f"{node}-{run_id}-rdzv-host", "count": 1,
                                  "duration_s": 0.0, "reason": "the job ended", "time": time.time()})
    except KeyboardInterrupt:
        status, code = JobStatus.STOPPED, 130
    except Exception as e:  # SignalException from torchelastic on SIGTERM/SIGINT
        if type(e).__name__ == "SignalException":
            status, code = JobStatus.STOPPED, 128 + int(getattr(e, "sigval", signal.SIGTERM))
            if agent.preempted is not None:
                code = PREEMPTED_EXIT
                print(f"[trainwatch] job {config.job} preempted by {agent.preempted['signal']}: "
                      f"{agent.preempted['said']}; exit code {PREEMPTED_EXIT}: launch it again with --job "
                      f"{config.job} to resume", flush=True)
            else:
                print(f"[trainwatch] job {config.job} stopped by {getattr(e, 'sigval', 'signal')}", flush=True)
        else:
            raise
    finally:
        # A second Ctrl-C or SIGTERM must not cut the clean-up short (a segment
        # or target file left behind); what it asked for is under way.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        try:
            agent._shutdown()
        except Exception:
            pass
        sidecar.stop()
        if agent.zygote is not None:
            # Idle, holding nothing: its interpreter's own teardown (a second with
            # torch imported) need not delay the job's exit.
            agent.zygote.close(timeout_s=0.3)
        guard.sweep_run(run_id)  # a rank's `setsid` child does not outlive the job
        state.remove_scrape_target(config.job, node)
        try:
            job_dir.store_key_file.unlink()
        except OSError:
            pass
        nonfinite = None
        if status is JobStatus.SUCCEEDED and config.nan_policy == "fail":
            nonfinite = failures.nonfinite_end(job_dir, segment.read_table(), segment.nslots, run_id)
            if nonfinite:
                status, code = JobStatus.FAILED, 1
                print(f"[trainwatch] job {config.job} failed: {nonfinite} (--nan-policy alert lets such a job "
                      "end as succeeded)", file=sys.stderr, flush=True)
        job_dir.update_job(status=status, end_time=time.time(), exit_code=code, restarts=agent.restart_count,
                           **({"preempted": agent.preempted} if agent.preempted is not None else {}))
        segment.close()
        try:
            os.unlink(segment_path)
        except OSError:
            pass
    print(f"[trainwatch] job {config.job} {status} (restarts: {agent.restart_count})", flush=True)
    if status is JobStatus.FAILED:
        cause = None
        if agent.fatal is not None:
            cause = f"{agent.fatal[0].describe()} ({agent.fatal[1]}; not restarted)"
        elif nonfinite:
            cause = nonfinite
        print(printable(failure_summary(config.job, agent.restart_count, args.max_restarts, cause)), file=sys.stderr,
              flush=True)
    return code
