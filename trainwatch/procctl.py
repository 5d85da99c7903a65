"""A child process that must not outlive the launcher that started it.

`die_with_parent()` asks the kernel (prctl PR_SET_PDEATHSIG) to signal this
process when its parent dies, then checks the parent is still the expected
one: the launcher may have died between starting us and this call. Linux only;
elsewhere it says so and the caller falls back to polling its parent.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL, expected_parent: int | None = None) -> bool:
    """True when the kernel will signal us on the parent's death. Exits at once
    when the expected parent is already gone (we were orphaned before asking)."""
    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            armed = libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if expected_parent and not parent_alive(expected_parent):
        os._exit(128 + int(sig))
    return armed


def parent_alive(expected_parent: int) -> bool:
    """Our parent is still the process that started us (an orphan is re-parented)."""
    return os.getppid() == expected_parent


_STATES = {b"T": "stopped", b"t": "tracing-stop", b"R": "running", b"S": "sleeping", b"D": "disk-sleep",
           b"Z": "zombie", b"X": "zombie"}


def _state_of(raw: bytes) -> str:
    end = raw.rindex(b")")  # the command name may hold anything, ')' included
    return _STATES.get(raw[end + 2: end + 3], "other")


def process_state(pid: int) -> str | None:
    """'stopped' for a process in state T (SIGSTOP, job control), 'tracing-stop'
    (t: a debugger), 'running', 'sleeping', 'disk-sleep' or 'zombie'; None when gone."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            return _state_of(f.read())
    except (OSError, ValueError):
        return None


class ProcessStates:
    """process_state() for pids asked about again and again (a sidecar's ranks,
    every tick): each pid's stat file stays open and is re-read with pread, one
    syscall instead of three. A file of a process that is gone fails to read
    (even once its pid is reused): it is closed and the next call opens anew."""

    MAX_OPEN = 256

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}

    def __call__(self, pid: int) -> str | None:
        pid = int(pid)
        fd = self._fds.pop(pid, None)
        if fd is None:
            try:
                fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return None
        try:
            state = _state_of(os.pread(fd, 1024, 0))
        except (OSError, ValueError):
            os.close(fd)
            return None
        self._fds[pid] = fd  # the most recently asked last: the oldest go first
        while len(self._fds) > self.MAX_OPEN:
            os.close(self._fds.pop(next(iter(self._fds))))
        return state

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def sweep_marked(name: str, value: str, *, grace_s: float = 2.0, exclude: tuple[int, ...] = ()) -> list[int]:
    """Stop this user's processes whose environment has name=value (a job's run
    marker): what a rank started in a session of its own (`setsid`, a daemon)
    escapes the process tree torchelastic stops, but not its environment.
    SIGTERM, then SIGKILL after `grace_s`; returns the pids found."""
    import time

    import psutil

    me = {os.getpid(), *exclude}
    uid = os.getuid()
    found = []
    for proc in psutil.process_iter(["pid", "uids"]):
        try:
            if proc.pid in me or proc.info["uids"] is None or proc.info["uids"].real != uid:
                continue
            if proc.environ().get(name) == value:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    for proc in found:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _gone, alive = psutil.wait_procs(found, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    return [p.pid for p in found]


def finish_interpreter(code: int) -> int:
    """The interpreter's own shutdown, in its order, short of tearing its modules
    down: join non-daemon threads, run the exit handlers, flush the output.
    The caller then ends with os._exit(code): with torch imported, the module
    teardown this skips takes most of a second and saves nothing."""
    import atexit
    import threading

    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:  # noqa: BLE001
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code
