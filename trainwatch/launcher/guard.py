"""What keeps a launch's edges clean: a start that fails is one line with
nothing left behind, a multi-node job's store records are sealed and every
listener beyond loopback is named, and nothing a rank started outlives the
job.
"""

from __future__ import annotations

from trainwatch import env, netbind, procctl, state
from trainwatch.launcher import prescan
from trainwatch.launcher.options import LaunchError
from trainwatch.usage import printable


class StartUp:
    """Around a launch: `undo` collects what the start made (the launch marker,
    the segment, the sidecar, the key file); a LaunchError or an OSError (a full
    or read-only home, no room in /dev/shm) undoes it, newest first, and leaves
    as one LaunchError. The launcher clears the list once its own clean-up
    owns those things."""

    def __enter__(self) -> list:
        self.undo: list = []
        return self.undo

    def __exit__(self, kind, error, tb) -> bool:
        if not isinstance(error, (LaunchError, OSError)):
            return False
        for step in reversed(self.undo):
            try:
                step()
            except Exception:
                pass
        if isinstance(error, OSError):
            raise LaunchError(prescan.start_failure(error)) from None
        return False


def store_sidecar_args(job_dir: state.JobDir, store: str, namespace: str, *, aggregate: bool, secret: bytes | None,
                       undo: list) -> list[str]:
    """The sidecar's options for the job-wide view through the rendezvous store.
    The secret goes to the sidecar (and diagnose) in an owner-only file."""
    args = ["--store", store, "--store-namespace", namespace] + (["--aggregate"] if aggregate else [])
    if secret is not None:
        state.write_atomic(job_dir.store_key_file, secret, mode=0o600)
        undo.append(lambda: job_dir.store_key_file.unlink(missing_ok=True))
        args += ["--job-secret-file", str(job_dir.store_key_file)]
    else:
        print(f"[trainwatch] warning: --insecure-store: trainwatch's records in the rendezvous store {store} are "
              "not authenticated; anyone who reaches it reads the job's telemetry and stacks and can make it "
              "capture, checkpoint and restart", flush=True)
    job_dir.update_job(store={"endpoint": store, "namespace": namespace, "sealed": secret is not None})  # diagnose
    return args


def warn_exposure(**listeners) -> None:
    """One line per listener of the job beyond loopback (netbind.exposure_warnings)."""
    for line in netbind.exposure_warnings(**listeners):
        print(printable(f"[trainwatch] {line}", newlines=False), flush=True)


def sweep_run(run_id: str) -> list[int]:
    """Stop what the job's ranks left running: a child in a session of its own
    (`setsid`) escapes the worker group torchelastic stops, not the run's
    marker in its environment."""
    try:
        left = procctl.sweep_marked(env.RUN, run_id)
    except Exception:  # a process table psutil cannot read: nothing to sweep
        return []
    if left:
        print(f"[trainwatch] stopped {len(left)} process(es) the job's ranks left behind "
              f"(pid {', '.join(map(str, left[:10]))})", flush=True)
    return left
