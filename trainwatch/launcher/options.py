"""`trainwatch launch`'s command line: torchrun's options (its own parser, same
env-var defaults), trainwatch's, and the watchdog's settings generated from
SidecarConfig. Every bad input is one `LaunchError` naming the fix, raised
before anything starts.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from trainwatch import env, flags, jobstore, state
from trainwatch.inject import spec as inject
from trainwatch.launcher import configfile
from trainwatch.watchdog.config import FLAG_ALIASES, SidecarConfig, launch_flags

DEFAULT_MODULE = "trainwatch.trainer"
NAN_POLICIES = ("fail", "alert")
PREEMPT_SIGNALS = ("TERM", "USR1", "USR2", "INT", "HUP")
DEFAULT_MAX_RESTARTS = 3
PREEMPTED_EXIT = 75
"""Exit code of a job stopped by a preemption signal after its checkpoint (EX_TEMPFAIL:
try again). Schedulers requeue on it (README: Slurm, Kubernetes)."""
TRAINER_CHECK_TIMEOUT_S = 120.0


class LaunchError(ValueError):
    """Bad launch input; the message names the fix."""


@dataclass(kw_only=True, slots=True)
class LaunchConfig:
    """trainwatch's own launch options (torchrun's are kept in its namespace)."""

    job: str
    """Job name: the key of the state directory and of `trainwatch diagnose`."""
    metrics_port: int = 0
    """Prometheus exporter port; 0 picks a free port, -1 turns it off."""
    metrics_host: str = "127.0.0.1"
    """Address the exporter binds; loopback unless told otherwise."""
    faults: list = field(default_factory=list)
    """Faults to inject (parsed `--inject` specs)."""
    sidecar: SidecarConfig = field(default_factory=SidecarConfig)
    """Everything the node's watchdog does (thresholds, actions, intervals)."""
    nan_policy: str = "fail"
    """'fail': a job whose last reported loss is NaN/inf ends failed; 'alert': incidents only."""
    preempt_signals: tuple = ("TERM",)
    """Signals to the launcher that mean preemption: checkpoint every rank, then stop (names, no SIG)."""
    preempt_grace_s: float = 30.0
    """Seconds ranks get to write their preemption checkpoint."""
    job_secret: bytes | None = None
    """The job's secret sealing trainwatch's records in a multi-node job's rendezvous store."""
    insecure_store: bool = False
    """A multi-node job run without a job secret, knowingly (--insecure-store)."""


class _ParseError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise _ParseError(message)


def build_parser() -> argparse.ArgumentParser:
    """torchrun's own parser (same options, same env-var defaults) + ours."""
    from torch.distributed.run import get_args_parser

    parser = _Parser(
        prog="trainwatch launch",
        description="Run a distributed PyTorch job like torchrun, watched by trainwatch. "
        "With no script, runs the integrated trainer's default job.",
        parents=[get_args_parser()],
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
    tw.add_argument("--config", default=None, metavar="FILE",
                    help="Read launch and watchdog options from this TOML file (or $TRAINWATCH_CONFIG); "
                    "TRAINWATCH_* variables beat it, flags beat both.")
    tw.add_argument("--print-config", action="store_true",
                    help="Print the effective configuration (file, environment and flags merged) as TOML and exit.")
    tw.add_argument("--job", default=None, help="Job name (default: generated and printed).")
    tw.add_argument("--inject", action="append", default=[], metavar="KIND[:key=val,...]",
                    help=f"Inject a fault for testing (repeatable). Kinds: {', '.join(sorted(inject.KINDS))}.")
    tw.add_argument("--metrics-port", type=int, default=0,
                    help="Prometheus exporter port (0 = free port, -1 = off).")
    tw.add_argument("--metrics-host", default="127.0.0.1", help="Exporter bind address (default 127.0.0.1).")
    tw.add_argument("--kernel-log", default=None, help="Follow this file as the kernel log instead of /dev/kmsg.")
    tw.add_argument("--node-name", default=None,
                    help="This node's name in a multi-node job (default: the hostname; give one per agent when "
                    "several share a machine).")
    tw.add_argument("--rdzv-timeout", type=float, default=None, metavar="S",
                    help="Seconds to wait for every node at a (re-)rendezvous before giving up (default 600).")
    tw.add_argument("--job-secret-file", default=None, metavar="FILE",
                    help=f"File holding the job's secret (16+ bytes, the same on every node; or ${env.JOB_SECRET}): "
                    "seals trainwatch's records in a multi-node job's rendezvous store. Required with --nnodes > 1.")
    tw.add_argument("--insecure-store", action="store_true",
                    help="Run a multi-node job without a job secret: anyone who reaches the rendezvous port can "
                    "read the job's telemetry and stacks and steer its watchdog.")
    tw.add_argument("--no-warm-start", action="store_true",
                    help="Start every worker as a fresh interpreter, as torchrun does (default: fork workers from a "
                    "per-node process that imported torch once, so a restart does not pay for it again).")
    tw.add_argument("--nan-policy", choices=NAN_POLICIES, default="fail",
                    help="fail (default): a NaN/inf loss never ends as succeeded; the integrated trainer stops at "
                    "it and the restart rolls back before it. alert: report it and train on.")
    tw.add_argument("--preempt-signals", default="TERM", metavar="SIG[,SIG]",
                    help="Signals to the launcher that mean preemption (default TERM; add USR1 for Slurm's "
                    "--signal=B:USR1@90; 'none' turns it off): every rank that registered state writes an "
                    f"emergency checkpoint, then the job stops with exit code {PREEMPTED_EXIT}.")
    tw.add_argument("--preempt-grace-s", type=float, default=30.0, metavar="S",
                    help="Seconds ranks get to write the preemption checkpoint (default 30; keep it under the "
                    "scheduler's notice).")
    tw.add_argument("--strict", action="store_true",
                    help="Refuse to start (exit 2) when a `trainwatch doctor` check fails (default: print it, go on).")
    flags.add_flags(parser.add_argument_group("trainwatch watchdog (thresholds and actions)"), launch_flags(),
                    FLAG_ALIASES)
    return parser


# Read before anything heavy is imported (trainwatch.launcher.prescan); kept importable from here.
from trainwatch.launcher.prescan import (_options, config_path, prescan_job, prescan_node_scope,  # noqa: E402,F401
                                         prescan_option, prescan_print_config)


def parse(argv: list[str], default_job: str | None = None, *,
          check_trainer: bool = True) -> tuple[argparse.Namespace, LaunchConfig]:
    parser = build_parser()
    table = configfile.settings(parser, launch_flags())
    try:
        defaults = configfile.layered_defaults(table, config_path(argv))
    except ValueError as e:
        raise LaunchError(str(e)) from None
    # The script and its arguments come as one: the file's only when the command line names none.
    script, script_args = defaults.pop("training_script", None), defaults.pop("training_script_args", [])
    parser.set_defaults(**defaults)
    try:
        args = parser.parse_args(argv)
    except _ParseError as e:
        raise LaunchError(f"{e} (see `trainwatch launch --help`)") from None
    if args.training_script is None and script is not None:
        args.training_script, args.training_script_args = script, list(script_args)
    _check_torchrun_options(args)
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
    elif not args.module and not args.no_python and not Path(args.training_script).is_file():
        raise LaunchError(
            f"training script {args.training_script!r} not found; give a path to a Python file, "
            "or `-m MODULE`, or nothing to run the integrated trainer"
        )
    try:
        faults = [inject.parse(spec) for spec in args.inject]
        inject.check_ranks(faults, _world_size(args))
        sidecar = flags.apply_flags(SidecarConfig(), launch_flags(), args)
    except (inject.InjectError, ValueError) as e:
        raise LaunchError(str(e)) from None
    if args.kernel_log is not None:
        folder = os.path.dirname(os.path.abspath(args.kernel_log)) or "."
        if not os.access(folder, os.W_OK | os.R_OK):
            raise LaunchError(f"--kernel-log {args.kernel_log!r}: its directory must exist and be readable")
        sidecar.kernel_log = os.path.abspath(args.kernel_log)
    sidecar.faults = [f.to_json() for f in faults if f.kind in inject.HARDWARE_KINDS]
    preempt = parse_preempt_signals(args.preempt_signals)
    if not (0 < args.preempt_grace_s < 1e6):
        raise LaunchError(f"--preempt-grace-s must be a positive number of seconds; got {args.preempt_grace_s}")
    if not args.no_python:
        check_entry(args.training_script, module=bool(args.module))
    secret = _job_secret(args)
    if check_trainer and args.module and args.training_script == DEFAULT_MODULE:
        check_trainer_args(job, args.training_script_args)
    return args, LaunchConfig(job=job, metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                              faults=faults, sidecar=sidecar, nan_policy=args.nan_policy,
                              preempt_signals=preempt, preempt_grace_s=args.preempt_grace_s, job_secret=secret,
                              insecure_store=bool(args.insecure_store and secret is None))


def parse_preempt_signals(value: str) -> tuple:
    """'TERM,USR1' -> ('TERM', 'USR1'); 'none' -> (); LaunchError for others."""
    names = [v.strip().upper().removeprefix("SIG") for v in str(value).split(",") if v.strip()]
    if names == ["NONE"]:
        return ()
    bad = [n for n in names if n not in PREEMPT_SIGNALS]
    if bad or not names:
        raise LaunchError(f"--preempt-signals takes {', '.join(PREEMPT_SIGNALS)} (comma-separated) or none; "
                          f"got {value!r}")
    return tuple(dict.fromkeys(names))


def _job_secret(args: argparse.Namespace) -> bytes | None:
    """The job secret; a multi-node job refuses to start without one unless --insecure-store."""
    try:
        secret = jobstore.read_secret(secret_file=args.job_secret_file)
    except jobstore.SecretError as e:
        raise LaunchError(str(e)) from None
    if secret is None and not args.insecure_store and _max_nodes(args) > 1:
        raise LaunchError(f"a multi-node job needs a job secret (anyone who reaches the rendezvous port could "
                          f"otherwise steer it): set {env.JOB_SECRET} or give --job-secret-file FILE, the same on "
                          "every node (e.g. `openssl rand -hex 32`), or --insecure-store to run without one")
    return secret


def _max_nodes(args: argparse.Namespace) -> int:
    from torch.distributed.run import parse_min_max_nnodes

    return parse_min_max_nnodes(str(args.nnodes))[1]


def print_config(argv: list[str]) -> str:
    """`trainwatch launch --print-config`: the effective configuration as a config file."""
    args, config = parse(argv, check_trainer=False)
    return configfile.effective(configfile.settings(build_parser(), launch_flags()), args, config.sidecar)


def _check_torchrun_options(args: argparse.Namespace) -> None:
    nproc = str(args.nproc_per_node)
    if nproc not in ("cpu", "gpu", "xpu", "auto"):
        try:
            if int(nproc) < 1:
                raise ValueError
        except ValueError:
            raise LaunchError(f"--nproc-per-node must be a positive integer (or cpu/gpu/auto); got {nproc!r}") from None
    try:
        from torch.distributed.run import parse_min_max_nnodes

        low, high = parse_min_max_nnodes(str(args.nnodes))
        if not 1 <= low <= high:
            raise ValueError
    except (ValueError, RuntimeError):
        raise LaunchError(f"--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX; got {args.nnodes!r}") from None
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts must be >= 0; got {args.max_restarts}")
    if not -1 <= args.metrics_port <= 65535:
        raise LaunchError(f"--metrics-port must be 0..65535 (0 = free port, -1 = off); got {args.metrics_port}")
    if args.node_name is not None and not state.JOB_NAME_RE.fullmatch(args.node_name):
        raise LaunchError(f"--node-name must be 1-100 letters, digits, '.', '_' or '-'; got {args.node_name!r}")
    if args.rdzv_timeout is not None and not (args.rdzv_timeout > 0 and args.rdzv_timeout < 1e7):
        raise LaunchError(f"--rdzv-timeout must be a positive number of seconds; got {args.rdzv_timeout}")
    if args.rdzv_endpoint:
        host, sep, port = str(args.rdzv_endpoint).rpartition(":")
        if not sep:
            host, port = port, ""
        if not host.strip("[]") or any(c.isspace() for c in host) or port and not (
                port.isdigit() and int(port) <= 65535):
            raise LaunchError(f"--rdzv-endpoint must be HOST or HOST:PORT with a port 0..65535; "
                              f"got {args.rdzv_endpoint!r}")


def _world_size(args: argparse.Namespace) -> int | None:
    """Ranks of a single-node job (a fault aimed beyond them never fires); None when unknown."""
    try:
        from torch.distributed.run import parse_min_max_nnodes

        low, high = parse_min_max_nnodes(str(args.nnodes))
        return int(args.nproc_per_node) * high if low == high else None
    except (ValueError, RuntimeError, TypeError):
        return None


def check_entry(target: str, *, module: bool) -> None:
    """A module that cannot be found or a script that does not compile fails
    every rank on every attempt: say it before anything starts."""
    if module:
        import importlib.util

        top = target.split(".")[0]
        sys.path.insert(0, os.getcwd())  # `python -m` looks in the working directory first
        try:
            found = importlib.util.find_spec(top) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path.pop(0)
        if not found:
            raise LaunchError(f"-m {target}: No module named {top!r}; install it, or check the name and the "
                              "working directory")
        return
    try:
        source = Path(target).read_bytes()
        compile(source, target, "exec", dont_inherit=True)
    except SyntaxError as e:
        raise LaunchError(f"{target}:{e.lineno}: SyntaxError: {e.msg}; fix the script") from None
    except (OSError, ValueError):
        return  # the ranks report what they cannot read


def check_trainer_args(job: str, argv: list[str]) -> None:
    """Validate the integrated trainer's flags once, here, instead of every rank
    failing with its own copy of the error after the workers start. The trainer
    checks itself (`--check`) in a subprocess: the launcher imports nothing of it."""
    environ = dict(os.environ)
    environ.setdefault(env.CKPT_DIR, str(state.JobDir(job).checkpoints_dir))
    try:
        r = subprocess.run([sys.executable, "-m", DEFAULT_MODULE, "--check", *argv], env=environ,
                           capture_output=True, text=True, timeout=TRAINER_CHECK_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LaunchError(f"trainer: could not check its flags ({e})") from None
    if r.returncode != 0:
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        message = lines[-1].removeprefix("error: ") if lines else f"exit code {r.returncode}"
        raise LaunchError(f"trainer: {message} (see `python -m trainwatch.trainer --help`)")
