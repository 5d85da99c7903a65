"""`trainwatch launch`: torchrun's behaviour, plus the watchdog.

    trainwatch launch [torchrun options] [--job NAME] [--inject SPEC]... [--metrics-port N]
                      [watchdog options] [SCRIPT | -m MODULE] [ARGS...]

With no script it runs the integrated trainer's default job. The options are
parsed and checked in `options`; here a launch runs its steps in order: the job
name claimed and its directory made, torchrun's defaults applied, the warm
start begun, the slot segment made and the environment set for the ranks, the
rendezvous joined, the sidecar started (`sidecarprocess`), torchelastic's agent
run, then the clean-up and the report of how the job ended.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import time
import uuid
from dataclasses import dataclass

from trainwatch import env, kinds, liveness, netbind, slots, state
from trainwatch.records import JobStatus
from trainwatch.inject import spec as inject
from trainwatch.usage import printable
from trainwatch.views.summary import failure_summary
from trainwatch.launcher import failures, guard, prescan, preflight, rendezvous, warmstart
from trainwatch.launcher.options import PREEMPTED_EXIT, LaunchConfig, LaunchError, parse, print_config
from trainwatch.launcher.sidecarprocess import SidecarProcess, start_sidecar

log = logging.getLogger("trainwatch")

__all__ = ["LaunchError", "launch"]


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


@dataclass(slots=True)
class _Run:
    """What the steps of one launch share: the options and this run's identity."""

    args: argparse.Namespace
    """torchrun's options and trainwatch's, parsed."""
    config: LaunchConfig
    """trainwatch's own launch settings."""
    job_dir: state.JobDir
    """The job's state directory, created."""
    lock: liveness.RunLock
    """This process's hold on the job name, kept for its life."""
    run_id: str
    """This run's id (a fresh one per launch)."""
    node: str
    """This node's name."""
    ended: str = ""
    """Why the job failed, in a few words, for the one line that says it did."""


def _launch(argv: list[str], early: str, marker: state.JobDir, lock: liveness.RunLock, undo: list) -> int:
    """The launch's steps, in order; the launcher's exit code."""
    run = _claim_job(argv, early, marker, lock)
    # torch loads only now, after the job was announced: `diagnose` knows it meanwhile.
    from torch.distributed.run import config_from_args

    store_bind, single_node = _torchrun_defaults(run)
    try:
        launch_config, cmd, cmd_args = config_from_args(run.args)
    except (ValueError, AssertionError, RuntimeError) as e:
        raise LaunchError(f"invalid torchrun options: {e}") from None
    cmd, cmd_args = _worker_command(run.args, cmd, cmd_args)
    zygote = _start_zygote(run, cmd, cmd_args, undo)
    segment_path, segment = _create_segment(run, launch_config.nproc_per_node, undo)
    _export_environment(run, store_bind, segment_path)
    _record_start(run, marker, launch_config.nproc_per_node, segment_path)
    rdzv_parameters, rdzv_handler, hosts_store = _rendezvous(run, launch_config, store_bind if single_node else None)
    sidecar = start_sidecar(run.config, run.job_dir, run.node, run.run_id, launch_config, segment_path,
                            single_node=single_node, hosts_store=hosts_store, store_bind=store_bind, undo=undo)
    agent = _make_agent(run, launch_config, cmd, cmd_args, rdzv_parameters, rdzv_handler, segment, sidecar, zygote)

    status, code, nonfinite = JobStatus.FAILED, 1, None
    undo.clear()  # from here the clean-up below owns the segment, the sidecar and the zygote
    try:
        status, code = _run_agent(run, agent, launch_config.rdzv_endpoint)
    finally:
        status, code, nonfinite = _clean_up(run, agent, sidecar, segment, segment_path, status, code)
    print(printable(_end_line(run, status, agent.restart_count)), flush=True)
    if status is JobStatus.FAILED:
        cause = None
        if agent.fatal is not None:
            cause = f"{agent.fatal[0].describe()} ({agent.fatal[1]}; not restarted)"
        elif nonfinite:
            cause = nonfinite
        print(printable(failure_summary(run.config.job, agent.restart_count, run.args.max_restarts, cause)),
              file=sys.stderr, flush=True)
    return code


def _end_line(run: _Run, status: JobStatus, restarts: int) -> str:
    """The one line that says how the job ended (and why it failed): the lines before give only the detail."""
    why = f"{run.ended}; " if status is JobStatus.FAILED and run.ended else ""
    return f"[trainwatch] job {run.config.job} {status} ({why}restarts: {restarts})"


def _claim_job(argv: list[str], early: str, marker: state.JobDir, lock: liveness.RunLock) -> _Run:
    """Parse and check the options, then make the job name this run's: its lock,
    its directory, what an earlier run of it left cleaned."""
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
    return _Run(args=args, config=config, job_dir=job_dir, lock=lock, run_id=uuid.uuid4().hex[:12],
                node=args.node_name or socket.gethostname())


def _torchrun_defaults(run: _Run) -> tuple[str | None, bool]:
    """torchrun's own defaults and trainwatch's on the rendezvous options;
    (the address the c10d stores bind, whether the job is single-node)."""
    from torch.distributed.run import parse_min_max_nnodes

    args, config = run.args, run.config
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
    return store_bind, single_node


def _start_zygote(run: _Run, cmd, cmd_args: list[str], undo: list) -> warmstart.Zygote | None:
    """The warm-start process the workers are forked from, when the entry allows one."""
    args = run.args
    if args.no_warm_start or not isinstance(cmd, str) or tuple(cmd_args[:3]) != warmstart.BOOTSTRAP \
            or not warmstart.install():
        return None
    # It imports torch (and the entry's installed packages) while the sidecar
    # starts and the rendezvous runs; it dies with the launcher.
    zygote = warmstart.Zygote(warmstart.entry_imports(args.training_script, args.module), list(cmd_args[3:]),
                              run.config.job)
    zygote.start()
    undo.append(zygote.close)
    return zygote


def _create_segment(run: _Run, nslots: int, undo: list) -> tuple[str, slots.Segment]:
    """The node's shared-memory slot segment, one slot per local rank."""
    # One segment per run and node: two launches never share one, whatever their homes.
    segment_path = os.path.join(slots.default_segment_dir(), f"trainwatch-{os.getuid()}-{run.config.job}@"
                                f"{state.safe_filename(run.node)}-{run.run_id}.slots")
    try:
        slots.create_segment(segment_path, nslots)
        undo.append(lambda: os.unlink(segment_path))
        segment = slots.Segment(segment_path)
        undo.append(segment.close)
    except ValueError as e:
        raise LaunchError(str(e)) from None
    return segment_path, segment


def _export_environment(run: _Run, store_bind: str | None, segment_path: str) -> None:
    """What the ranks and the sidecar read from the environment (trainwatch.env)."""
    config = run.config
    os.environ[env.JOB] = config.job
    os.environ[env.RUN] = run.run_id
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
    os.environ.setdefault(env.CKPT_DIR, str(run.job_dir.checkpoints_dir))


def _record_start(run: _Run, marker: state.JobDir, nslots: int, segment_path: str) -> None:
    """job.json says `starting` with what this run is; the launch marker goes."""
    args = run.args
    entry = " ".join([("-m " if args.module else "") + args.training_script, *args.training_script_args])
    run.job_dir.update_job(
        status=JobStatus.STARTING,
        run_id=run.run_id,
        node_scoped=bool(os.environ.get(env.NODE_SCOPE)),
        start_time=time.time(),
        node=run.node,
        nodes=[run.node],
        launcher_pid=os.getpid(),
        nproc_per_node=nslots,
        nnodes=args.nnodes,
        max_restarts=args.max_restarts,
        restarts=0,
        entrypoint=entry,
        slots=segment_path,
        state_dir=str(run.job_dir.path),
        faults=[f.to_json() for f in run.config.faults],
        metrics=None,
        preempted=None,  # an earlier run's preemption is over: this run resumes from it
    )
    marker.withdraw_launch()
    print(start_line(run.config.job, entry, nslots, run.job_dir.path), flush=True)


def start_line(job: str, entry: str, nslots: int, state_dir: object) -> str:
    """The console's line for a starting job. The script's path and arguments
    are the user's text: escaped like every other console line, on one line."""
    return printable(f"[trainwatch] job {job}: {entry} on {nslots} local rank(s); state in {state_dir}",
                     newlines=False)


def _rendezvous(run: _Run, launch_config, store_bind: str | None) -> tuple:
    """(torchelastic's rendezvous parameters, its handler, whether this node hosts the store);
    LaunchError, with the job marked failed, when the rendezvous cannot be reached."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

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
        rdzv_handler, hosts_store = rendezvous.rendezvous_handler(rdzv_parameters, store_bind)
    except Exception as e:  # the rendezvous host unreachable: torch's RendezvousConnectionError, ...
        run.job_dir.update_job(status=JobStatus.FAILED, end_time=time.time(), exit_code=1)
        raise LaunchError(f"cannot reach the rendezvous at {launch_config.rdzv_endpoint} "
                          f"({type(e).__name__}); start the node hosting it first, or check --rdzv-endpoint") from None
    return rdzv_parameters, rdzv_handler, hosts_store


def _make_agent(run: _Run, launch_config, cmd, cmd_args: list[str], rdzv_parameters, rdzv_handler,
                segment: slots.Segment, sidecar: SidecarProcess, zygote: warmstart.Zygote | None):
    """torchelastic's agent for this node's workers, with trainwatch's handling of exits and restarts."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.launcher.api import _get_addr_and_port

    from trainwatch.launcher.agent import TrainwatchAgent

    config = run.config
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
    return TrainwatchAgent(
        spec=spec,
        logs_specs=launch_config.logs_specs,
        start_method=launch_config.start_method,
        log_line_prefix_template=launch_config.log_line_prefix_template,
        job=config.job,
        run_id=run.run_id,
        segment=segment,
        sidecar=sidecar,
        emergency_timeout_s=config.sidecar.actions.emergency_timeout_s,
        zygote=zygote,
        preempt_signals=frozenset(int(getattr(signal, f"SIG{name}")) for name in config.preempt_signals),
        preempt_grace_s=config.preempt_grace_s,
        node=run.node,
    )


def _run_agent(run: _Run, agent, rdzv_endpoint: str) -> tuple[JobStatus, int]:
    """Run the job to its end; (its status, the launcher's exit code)."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError as RENDEZVOUS_ERRORS

    job = run.config.job
    try:
        result = agent.run()
        if result.state == WorkerState.SUCCEEDED:
            return JobStatus.SUCCEEDED, 0
        exits = ", ".join(
            f"rank {r}: exit code {f.exitcode}" for r, f in sorted(result.failures.items())
        ) or "the watchdog's restart budget is spent"
        run.ended = exits
    except ChildFailedError as e:
        # torchelastic's summary quotes the ranks' own error files: shown, never acted on by the terminal.
        print(printable(f"[trainwatch] torchelastic's report: {e}"), file=sys.stderr, flush=True)
        run.ended = "a worker failed; torchelastic's report above"
    except RENDEZVOUS_ERRORS as e:
        _rendezvous_lost(run, e, rdzv_endpoint)
    except KeyboardInterrupt:
        return JobStatus.STOPPED, 130
    except Exception as e:  # SignalException from torchelastic on SIGTERM/SIGINT
        if type(e).__name__ != "SignalException":
            raise
        code = 128 + int(getattr(e, "sigval", signal.SIGTERM))
        if agent.preempted is None:
            print(f"[trainwatch] job {job} stopped by {getattr(e, 'sigval', 'signal')}", flush=True)
            return JobStatus.STOPPED, code
        print(f"[trainwatch] job {job} preempted by {agent.preempted['signal']}: {agent.preempted['said']}; "
              f"exit code {PREEMPTED_EXIT}: launch it again with --job {job} to resume", flush=True)
        return JobStatus.STOPPED, PREEMPTED_EXIT
    return JobStatus.FAILED, 1


def _rendezvous_lost(run: _Run, error: Exception, rdzv_endpoint: str) -> None:
    """The nodes did not meet again: said, and, when the node holding the store
    is gone, recorded as this node's node_lost incident."""
    node, run_id = run.node, run.run_id
    host_lost, why = failures.rendezvous_lost(error, rdzv_endpoint)
    run.ended = "the nodes did not meet again"
    print(printable(f"[trainwatch] the nodes did not meet again ({type(error).__name__}: "
                    f"{str(error).splitlines()[0][:200] if str(error) else 'no detail'}); {why}"), file=sys.stderr,
          flush=True)
    if host_lost:  # this node survived the one that held the store: its incident, in its own records
        lost = kinds.KINDS["node_lost"]
        run.job_dir.append_event({"kind": lost.name, "id": f"{node}-{run_id}-rdzv-host", "severity": lost.severity,
                                  "runbook": lost.runbook, "culprit_ranks": [], "victims": [], "node": node,
                                  "summary": f"node_lost: {why}", "time": time.time(),
                                  "evidence": {"node": "rendezvous host", "endpoint": rdzv_endpoint}})
        run.job_dir.append_event({"kind": "resolved", "incident": f"{node}-{run_id}-rdzv-host", "count": 1,
                                  "duration_s": 0.0, "reason": "the job ended", "time": time.time()})


def _clean_up(run: _Run, agent, sidecar: SidecarProcess, segment: slots.Segment, segment_path: str,
              status: JobStatus, code: int) -> tuple[JobStatus, int, str | None]:
    """Stop what the job started and record how it ended; (its status, the exit
    code, why a job that succeeded failed after all: a non-finite end)."""
    config, job_dir = run.config, run.job_dir
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
    guard.sweep_run(run.run_id)  # a rank's `setsid` child does not outlive the job
    state.remove_scrape_target(config.job, run.node)
    try:
        job_dir.store_key_file.unlink()
    except OSError:
        pass
    nonfinite = None
    if status is JobStatus.SUCCEEDED and config.nan_policy == "fail":
        nonfinite = failures.nonfinite_end(job_dir, segment.read_table(), segment.nslots, run.run_id)
        if nonfinite:
            status, code = JobStatus.FAILED, 1
            run.ended = nonfinite
            print(f"[trainwatch] {nonfinite} (--nan-policy alert lets such a job end as succeeded)",
                  file=sys.stderr, flush=True)
    job_dir.update_job(status=status, end_time=time.time(), exit_code=code, restarts=agent.restart_count,
                       **({"preempted": agent.preempted} if agent.preempted is not None else {}))
    segment.close()
    try:
        os.unlink(segment_path)
    except OSError:
        pass
    return status, code, nonfinite
