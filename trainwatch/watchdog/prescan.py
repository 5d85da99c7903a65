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

# torchrun and trainwatch options that take no value (every other option does).
_FLAGS = frozenset({"--standalone", "--no-warm-start", "--strict", "--insecure-store", "--no-python", "--no_python", "--run-path", "--run_path", "-m", "--module",
                    "-h", "--help"})


def prescan_job(argv: list[str]) -> str | None:
    """The --job value, read without torchrun's parser (which imports torch):
    options before the script only. None when not given."""
    return prescan_option(argv, "--job")


def prescan_node_scope(argv: list[str]) -> str | None:
    """This node's name when the job spans several nodes (its state is kept per
    node, see env.NODE_SCOPE), else None."""
    nnodes = prescan_option(argv, "--nnodes") or "1"
    if nnodes.rpartition(":")[2].strip() in ("", "1"):
        return None
    name = prescan_option(argv, "--node-name") or socket.gethostname()
    return name if state.JOB_NAME_RE.fullmatch(name) else None


def prescan_option(argv: list[str], option: str) -> str | None:
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == option and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith(option + "="):
            return token.split("=", 1)[1]
        if not token.startswith("-") or token in ("-m", "--module"):
            return None  # the script or module: what follows is its own
        i += 1 if token in _FLAGS or token.startswith("--no-") or "=" in token else 2
    return None


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
