"""`trainwatch launch`'s command line: torchrun's options (its own parser, same
env-var defaults), trainwatch's, and the watchdog's settings generated from
SidecarConfig. Every bad input is one `LaunchError` naming the fix, raised
before anything starts.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from trainwatch import env, flags, state
from trainwatch.inject import spec as inject
from trainwatch.watchdog import configfile
from trainwatch.watchdog.config import FLAG_ALIASES, SidecarConfig, launch_flags

DEFAULT_MODULE = "trainwatch.trainer"
DEFAULT_MAX_RESTARTS = 3
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
    tw.add_argument("--no-warm-start", action="store_true",
                    help="Start every worker as a fresh interpreter, as torchrun does (default: fork workers from a "
                    "per-node process that imported torch once, so a restart does not pay for it again).")
    tw.add_argument("--strict", action="store_true",
                    help="Refuse to start (exit 2) when a `trainwatch doctor` check fails (default: print it, go on).")
    flags.add_flags(parser.add_argument_group("trainwatch watchdog (thresholds and actions)"), launch_flags(),
                    FLAG_ALIASES)
    return parser


# torchrun and trainwatch options that take no value (every other option does).
_FLAGS = frozenset({"--standalone", "--no-warm-start", "--strict", "--print-config", "--no-python", "--no_python", "--run-path", "--run_path", "-m", "--module",
                    "-h", "--help"})


def prescan_job(argv: list[str]) -> str | None:
    """The --job value, read without torchrun's parser (which imports torch):
    options before the script only, then the config file. None when not given."""
    return _prescan_layered(argv, "--job", "job")


def prescan_node_scope(argv: list[str]) -> str | None:
    """This node's name when the job spans several nodes (its state is kept per
    node, see env.NODE_SCOPE), else None."""
    nnodes = _prescan_layered(argv, "--nnodes", "nnodes") or "1"
    if nnodes.rpartition(":")[2].strip() in ("", "1"):
        return None
    name = _prescan_layered(argv, "--node-name", "node_name") or socket.gethostname()
    return name if state.JOB_NAME_RE.fullmatch(name) else None


def prescan_print_config(argv: list[str]) -> bool:
    """Whether `--print-config` is among the options before the script."""
    return any(token == "--print-config" for token, _ in _options(argv))


def config_path(argv: list[str]) -> str | None:
    """The config file: `--config FILE` before the script, else $TRAINWATCH_CONFIG."""
    return prescan_option(argv, "--config") or os.environ.get(configfile.CONFIG_ENV) or None


def _prescan_layered(argv: list[str], option: str, dest: str) -> str | None:
    given = prescan_option(argv, option)
    if given is not None:
        return given
    try:
        return configfile.prescan_value(config_path(argv), dest)
    except ValueError as e:
        raise LaunchError(str(e)) from None


def prescan_option(argv: list[str], option: str) -> str | None:
    for token, value in _options(argv):
        if token == option and value is not None:
            return value
    return None


def _options(argv: list[str]):
    """(option, value or None) before the script or module; what follows it is its own."""
    i = 0
    while i < len(argv):
        token = argv[i]
        if token.startswith("-") and "=" in token:
            yield tuple(token.split("=", 1))
        elif not token.startswith("-") or token in ("-m", "--module"):
            yield token, None
            return
        elif token in _FLAGS or token.startswith("--no-"):
            yield token, None
        else:
            yield token, argv[i + 1] if i + 1 < len(argv) else None
            i += 1
        i += 1


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
    if check_trainer and args.module and args.training_script == DEFAULT_MODULE:
        check_trainer_args(job, args.training_script_args)
    return args, LaunchConfig(job=job, metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                              faults=faults, sidecar=sidecar)


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
