"""What `trainwatch launch` does before importing anything heavy: read the job
name from the command line and announce the launch, so `trainwatch diagnose`
knows the job (status `starting`, no ranks yet) from the launcher's first
moments, not only once the watchdog's configuration, the detectors and numpy
are imported (over a second on a busy host).
"""

from __future__ import annotations

import os
import socket

from trainwatch import env, liveness, state
from trainwatch.launcher import configfile

# The options of `trainwatch launch` that take no value; every other option takes one. The
# parser itself is not used here (torch.distributed.run's parser imports torch, a second or
# more before the launch is announced): tests/test_prescan.py checks these against it.
TORCHRUN_FLAGS = frozenset({"-h", "--help", "--standalone", "--no-python", "--no_python", "--run-path", "--run_path",
                            "-m", "--module", "--virtual-local-rank", "--virtual_local_rank"})
"""torch.distributed.run's options that take no value (torch 2.13)."""
TRAINWATCH_FLAGS = frozenset({"--print-config", "--insecure-store", "--no-warm-start", "--strict"})
"""trainwatch's own launch options that take no value; the watchdog's boolean settings are
flags spelled --no-NAME (flags.config_flags: each turns on by default)."""


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
        raise state.StateError(str(e)) from None


def prescan_option(argv: list[str], option: str) -> str | None:
    for token, value in _options(argv):
        if token == option and value is not None:
            return value
    return None


def takes_value(option: str) -> bool:
    """Whether `trainwatch launch` reads the token after this option as its value."""
    return not (option in TORCHRUN_FLAGS or option in TRAINWATCH_FLAGS or option.startswith("--no-"))


def _options(argv: list[str]):
    """(option, value or None) before the script or module; what follows it is its own."""
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":  # the script comes next
            return
        if token.startswith("-") and "=" in token:
            yield tuple(token.split("=", 1))
        elif not token.startswith("-"):  # the script or module (-m is a flag: options may follow it)
            yield token, None
            return
        elif not takes_value(token):
            yield token, None
        elif not token.startswith("--") and len(token) > 2:  # a short option and its value in one: -r3
            yield token[:2], token[2:]
        else:
            yield token, argv[i + 1] if i + 1 < len(argv) else None
            i += 1
        i += 1


def announce(argv: list[str]) -> tuple[str, state.JobDir, liveness.RunLock]:
    """(job name, its JobDir, the run lock) once the launch is announced (launch.json);
    state.StateError when the home is unusable or another run of the job is live."""
    early = prescan_job(argv)
    early = state.generate_job_name() if early is None else early
    scope = prescan_node_scope(argv)
    if scope:  # a multi-node job: this node's records apart from the others' (shared homes)
        os.environ[env.NODE_SCOPE] = scope
    marker = state.JobDir(early)
    state.ensure_home()
    lock = liveness.acquire(marker)  # one live run per job name
    marker.announce_launch()
    return early, marker, lock


def start_failure(error: OSError) -> str:
    """The one line a start-up that ran out of room (or write access) says."""
    where = f" ({error.filename})" if error.filename else ""
    return (f"cannot start the job: {error.strerror or error}{where}; free space in {state.home()} or set "
            f"{env.HOME} to a writable directory with room")
