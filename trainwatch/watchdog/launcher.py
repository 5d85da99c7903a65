"""`trainwatch launch`: torchrun's options and behaviour, plus the watchdog.

    trainwatch launch [torchrun options] [--job NAME] [--inject SPEC]... [--metrics-port N]
                      [SCRIPT | -m MODULE] [ARGS...]

With no script it runs the integrated trainer's default job.
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
from dataclasses import dataclass, field
from pathlib import Path

from trainwatch import state
from trainwatch.watchdog import inject

log = logging.getLogger("trainwatch")

DEFAULT_MODULE = "trainwatch.trainer"
DEFAULT_MAX_RESTARTS = 3


class LaunchError(ValueError):
    """Bad launch input; the message names the fix."""


@dataclass(kw_only=True, slots=True)
class WatchConfig:
    """trainwatch's own launch options (torchrun's are kept in its namespace)."""

    job: str
    """Job name: the key of the state directory and of `trainwatch diagnose`."""
    metrics_port: int = 0
    """Prometheus exporter port on 127.0.0.1; 0 picks a free port, -1 turns it off."""
    metrics_host: str = "127.0.0.1"
    """Address the exporter binds; loopback unless told otherwise."""
    faults: list = field(default_factory=list)
    """Faults to inject (parsed `--inject` specs)."""
    kernel_log: str | None = None
    """A file to follow as the kernel log (default /dev/kmsg when readable)."""
    restart: bool = True
    """Restart the worker group on hangs, mismatches, crashes and critical Xids."""
    emergency_timeout_s: float = 10.0
    """Seconds ranks get to write an emergency checkpoint before the restart."""


class _ParseError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise _ParseError(message)


def build_parser() -> argparse.ArgumentParser:
    """torchrun's own parser (same options, same env-var defaults) + ours."""
    from torch.distributed.run import get_args_parser

    base = get_args_parser()
    parser = _Parser(
        prog="trainwatch launch",
        description="Run a distributed PyTorch job like torchrun, watched by trainwatch. "
        "With no script, runs the integrated trainer's default job.",
        parents=[base],
        add_help=False,
        conflict_handler="resolve",
    )
    for action in parser._actions:
        if action.dest == "training_script":
            action.nargs = "?"
            action.default = None
    # trainwatch restarts hung or crashed jobs by default (torchrun: 0).
    parser.set_defaults(max_restarts=int(os.environ.get("PET_MAX_RESTARTS", DEFAULT_MAX_RESTARTS)))
    tw = parser.add_argument_group("trainwatch")
    tw.add_argument("--job", default=None, help="Job name (default: generated and printed).")
    tw.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="KIND[:key=val,...]",
        help=f"Inject a fault for testing (repeatable). Kinds: {', '.join(sorted(inject.KINDS))}.",
    )
    tw.add_argument("--metrics-port", type=int, default=0, help="Prometheus port on 127.0.0.1 (0 = free port, -1 = off).")
    tw.add_argument("--metrics-host", default="127.0.0.1", help="Exporter bind address (default 127.0.0.1).")
    tw.add_argument("--kernel-log", default=None, help="Follow this file as the kernel log instead of /dev/kmsg.")
    tw.add_argument("--no-restart", action="store_true", help="Alert only: never restart the job on an incident.")
    tw.add_argument(
        "--emergency-timeout", type=float, default=10.0, help="Seconds for the emergency checkpoint before a restart."
    )
    return parser


# torchrun and trainwatch options that take no value (every other option does).
_FLAGS = frozenset({"--standalone", "--no-python", "--no_python", "--run-path", "--run_path", "-m", "--module",
                    "--no-restart", "-h", "--help"})


def prescan_job(argv: list[str]) -> str | None:
    """The --job value, read without torchrun's parser (which imports torch):
    options before the script only. None when not given."""
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--job" and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith("--job="):
            return token.split("=", 1)[1]
        if not token.startswith("-") or token in ("-m", "--module"):
            return None  # the script or module: what follows is its own
        i += 1 if token in _FLAGS or "=" in token else 2
    return None


def parse(argv: list[str], default_job: str | None = None) -> tuple[argparse.Namespace, WatchConfig]:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _ParseError as e:
        raise LaunchError(f"{e} (see `trainwatch launch --help`)") from None
    nproc = str(args.nproc_per_node)
    if nproc not in ("cpu", "gpu", "xpu", "auto"):
        try:
            if int(nproc) < 1:
                raise ValueError
        except ValueError:
            raise LaunchError(f"--nproc-per-node must be a positive integer (or cpu/gpu/auto); got {nproc!r}") from None
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts must be >= 0; got {args.max_restarts}")
    if not -1 <= args.metrics_port <= 65535:
        raise LaunchError(f"--metrics-port must be 0..65535 (0 = free port, -1 = off); got {args.metrics_port}")
    if args.emergency_timeout <= 0:
        raise LaunchError(f"--emergency-timeout must be > 0 seconds; got {args.emergency_timeout}")
    job = args.job if args.job is not None else (default_job or state.generate_job_name())
    try:
        state.check_job_name(job)
    except state.StateError as e:
        raise LaunchError(str(e)) from None
    if args.training_script is None:
        if args.module or args.no_python or args.run_path:
            raise LaunchError("-m/--no-python/--run-path need a script or module name after the options")
        args.module = True
        args.training_script = DEFAULT_MODULE
    elif not args.module and not args.no_python:
        script = Path(args.training_script)
        if not script.is_file():
            raise LaunchError(
                f"training script {args.training_script!r} not found; give a path to a Python file, "
                "or `-m MODULE`, or nothing to run the integrated trainer"
            )
    if args.module and args.training_script == DEFAULT_MODULE:
        _check_trainer_args(args.training_script_args)
    try:
        faults = [inject.parse(spec) for spec in args.inject]
    except inject.InjectError as e:
        raise LaunchError(str(e)) from None
    if args.kernel_log is not None and not os.access(os.path.dirname(os.path.abspath(args.kernel_log)) or ".", os.W_OK | os.R_OK):
        raise LaunchError(f"--kernel-log {args.kernel_log!r}: its directory must exist and be readable")
    config = WatchConfig(
        job=job,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        faults=faults,
        kernel_log=os.path.abspath(args.kernel_log) if args.kernel_log else None,
        restart=not args.no_restart,
        emergency_timeout_s=args.emergency_timeout,
    )
    return args, config


def _check_trainer_args(argv: list[str]) -> None:
    """Validate the integrated trainer's flags here, once, instead of every rank
    failing with its own copy of the error after the workers start."""
    from trainwatch.trainer.__main__ import build_parser
    from trainwatch.trainer.config import TrainConfig, UsageError, resolve

    parser = build_parser()

    def fail(message: str):
        raise LaunchError(f"trainer: {message} (see `python -m trainwatch.trainer --help`)")

    parser.error = fail  # type: ignore[method-assign]
    cfg = TrainConfig(**vars(parser.parse_args(argv)))
    try:
        cfg = resolve(cfg)
        if cfg.resume not in ("auto", "never"):
            from trainwatch.trainer.checkpoint import CheckpointError, verify_checkpoint

            try:
                verify_checkpoint(cfg.resume)
            except (CheckpointError, OSError) as e:
                raise LaunchError(f"--resume {cfg.resume}: {e}; pass a valid checkpoint, or --resume auto") from None
        if cfg.ckpt_dir:
            from trainwatch.trainer.checkpoint import CheckpointError, ensure_writable

            try:
                ensure_writable(cfg.ckpt_dir)
            except CheckpointError as e:
                raise LaunchError(str(e)) from None
    except UsageError as e:
        raise LaunchError(str(e)) from None


class SidecarProcess:
    """Starts the node sidecar and keeps it running: if it dies, training goes on
    and the agent starts a new one (the sidecar is never a single point of failure)."""

    def __init__(self, config: WatchConfig, segment_path: str, node: str):
        self.config = config
        self.segment_path = segment_path
        self.node = node
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self._config_file = state.job_dir(config.job) / "control" / "sidecar-config.json"

    def start(self) -> None:
        state.write_json_atomic(
            self._config_file,
            {
                "faults": [f.to_json() for f in self.config.faults],
                "kernel_log": self.config.kernel_log,
                "restart": self.config.restart,
                "emergency_timeout_s": self.config.emergency_timeout_s,
            },
        )
        # After the first start, rebind the same port so scrapers keep working.
        port = self.config.metrics_port
        if self.starts > 0:
            rec = state.read_json(state.job_dir(self.config.job) / "sidecar.json") or {}
            addr = rec.get("metrics") or ""
            if ":" in addr:
                port = int(addr.rsplit(":", 1)[1])
        cmd = [
            sys.executable, "-m", "trainwatch.watchdog.sidecar",
            "--job", self.config.job,
            "--slots", self.segment_path,
            "--node", self.node,
            "--metrics-host", self.config.metrics_host,
            "--metrics-port", str(port),
            "--config", str(self._config_file),
        ]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        self.starts += 1
        if self.starts > 1:
            state.update_job(self.config.job, sidecar_pid=self.proc.pid, sidecar_starts=self.starts)

    def wait_ready(self, timeout_s: float = 30.0) -> dict:
        path = state.job_dir(self.config.job) / "sidecar.json"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            rec = state.read_json(path)
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
        return cmd, ["-u", "-m", "trainwatch.watchdog.bootstrap", *cmd_args[1:]]
    return cmd, cmd_args


def launch(argv: list[str]) -> int:
    early = prescan_job(argv)
    early = state.generate_job_name() if early is None else early
    marker = state.announce_launch(early)
    try:
        return _launch(argv, early, marker)
    except LaunchError:
        state.withdraw_launch(marker, failed=True)
        raise


def _launch(argv: list[str], early: str, marker) -> int:
    args, config = parse(argv, default_job=early)
    if config.job != early:
        state.withdraw_launch(marker, failed=True)
        marker = None
    try:
        state.ensure_home()
        job_dir = state.make_job_dir(config.job)
    except state.StateError as e:
        raise LaunchError(str(e)) from None

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import config_from_args

    from trainwatch import slots
    from trainwatch.watchdog.agent import TrainwatchAgent

    # Same defaults torchrun applies in run(): a single-node job gets a local c10d store.
    if args.standalone:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        from torch.distributed.run import parse_min_max_nnodes

        if parse_min_max_nnodes(args.nnodes)[1] == 1:
            args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    if args.rdzv_id == "none":
        args.rdzv_id = config.job
    if not config.restart:
        args.max_restarts = 0  # alert-only: crashes are reported, never restarted

    try:
        launch_config, cmd, cmd_args = config_from_args(args)
    except (ValueError, AssertionError, RuntimeError) as e:
        raise LaunchError(f"invalid torchrun options: {e}") from None
    cmd, cmd_args = _worker_command(args, cmd, cmd_args)

    node = socket.gethostname()
    nslots = launch_config.nproc_per_node
    segment_path = os.path.join(slots.default_segment_dir(), f"trainwatch-{os.getuid()}-{config.job}.slots")
    slots.create_segment(segment_path, nslots)
    segment = slots.Segment(segment_path)

    os.environ["TRAINWATCH_JOB"] = config.job
    os.environ["TRAINWATCH_HOME"] = str(state.home().resolve())
    os.environ["TRAINWATCH_SLOTS"] = segment_path
    os.environ["TRAINWATCH_INJECT"] = inject.encode(config.faults)
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    # With the rendezvous TCPStore shared across rounds (torch's default), a
    # restarted gloo worker group reads the previous attempt's addresses from
    # the store and fails in connectFullMesh ("Connection refused"): plain
    # torchrun --max-restarts cannot restart such a job. A fresh store per
    # attempt avoids it.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # Checkpoints (periodic and emergency) default into the job's directory, so a
    # restarted worker group resumes from them with no flag.
    os.environ.setdefault("TRAINWATCH_CKPT_DIR", str(job_dir / "checkpoints"))
    if config.kernel_log:
        os.environ["TRAINWATCH_KERNEL_LOG"] = config.kernel_log

    entry = " ".join([("-m " if args.module else "") + args.training_script, *args.training_script_args])
    state.update_job(
        config.job,
        status="starting",
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
        state_dir=str(job_dir),
        faults=[f.to_json() for f in config.faults],
        metrics=None,
    )
    state.withdraw_launch(marker)
    print(f"[trainwatch] job {config.job}: {entry} on {nslots} local rank(s); state in {job_dir}", flush=True)

    sidecar = SidecarProcess(config, segment_path, node)
    sidecar.start()
    ready = sidecar.wait_ready()
    metrics = ready.get("metrics")
    state.update_job(config.job, sidecar_pid=sidecar.proc.pid if sidecar.proc else None, metrics=metrics)
    if metrics:
        print(f"[trainwatch] metrics: http://{metrics}/metrics", flush=True)
        target = state.write_scrape_target(config.job, node, metrics)
        if target is None:
            print(f"[trainwatch] warning: cannot write the Prometheus target under {state.targets_dir()}; "
                  "set TRAINWATCH_TARGETS_DIR to a writable directory", flush=True)

    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry
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
    master_addr, master_port = _get_addr_and_port(rdzv_parameters)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = launch_config.signals_to_handle
    spec = WorkerSpec(
        role=launch_config.role,
        local_world_size=launch_config.nproc_per_node,
        entrypoint=cmd,
        args=tuple(cmd_args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(rdzv_parameters),
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
        segment=segment,
        sidecar=sidecar,
        emergency_timeout_s=config.emergency_timeout_s,
    )

    status, code = "failed", 1
    try:
        result = agent.run()
        from torch.distributed.elastic.agent.server.api import WorkerState

        if result.state != WorkerState.SUCCEEDED:
            status, code = "failed", 1
            failures = ", ".join(
                f"rank {r}: exit code {f.exitcode}" for r, f in sorted(result.failures.items())
            ) or "the watchdog's restart budget is spent"
            print(f"[trainwatch] job {config.job} failed ({failures})", file=sys.stderr, flush=True)
        else:
            status, code = "succeeded", 0
    except ChildFailedError as e:
        print(f"[trainwatch] job {config.job} failed: {e}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        status, code = "stopped", 130
    except Exception as e:  # SignalException from torchelastic on SIGTERM/SIGINT
        if type(e).__name__ == "SignalException":
            status, code = "stopped", 128 + int(getattr(e, "sigval", signal.SIGTERM))
            print(f"[trainwatch] job {config.job} stopped by {getattr(e, 'sigval', 'signal')}", flush=True)
        else:
            raise
    finally:
        try:
            agent._shutdown()
        except Exception:
            pass
        sidecar.stop()
        state.remove_scrape_target(config.job, node)
        state.update_job(config.job, status=status, end_time=time.time(), exit_code=code, restarts=agent.restart_count)
        segment.close()
        try:
            os.unlink(segment_path)
        except OSError:
            pass
    print(f"[trainwatch] job {config.job} {status} (restarts: {agent.restart_count})", flush=True)
    if status == "failed":
        print(failure_summary(config.job, agent.restart_count, args.max_restarts), file=sys.stderr, flush=True)
    return code


def failure_summary(job: str, restarts: int, max_restarts: int) -> str:
    """What a user needs when trainwatch gives up: what happened, how often, what next."""
    events = list(state.read_events(job))
    kinds: dict[str, int] = {}
    for e in events:
        kinds[e.get("kind", "?")] = kinds.get(e.get("kind", "?"), 0) + 1
    last = next((e for e in reversed(events) if e.get("kind") not in ("restart",)), None)
    lines = [f"[trainwatch] summary for job {job}:"]
    lines.append(f"  restarts: {restarts} of {max_restarts} allowed"
                 + (" (budget spent)" if max_restarts and restarts >= max_restarts else ""))
    lines.append("  incidents: " + (", ".join(f"{k} x{n}" for k, n in sorted(kinds.items())) or "none"))
    if last is not None:
        verdict = last.get("verdict") or {}
        lines.append(f"  last: {last.get('kind')}: {verdict.get('summary') or last.get('summary', '')}")
        runbook = verdict.get("runbook") or last.get("runbook")
        if runbook:
            lines.append(f"  next: trainwatch runbook {runbook}")
    lines.append(f"  details: trainwatch diagnose {job}")
    return "\n".join(lines)
