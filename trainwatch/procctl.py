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


def process_state(pid: int) -> str | None:
    """'stopped' for a process in state T (SIGSTOP, job control), 'tracing-stop'
    (t: a debugger), 'running', 'sleeping', 'disk-sleep' or 'zombie'; None when gone."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            raw = f.read()
        code = raw[raw.rindex(b")") + 2: raw.rindex(b")") + 3]
    except (OSError, ValueError):
        return None
    return {b"T": "stopped", b"t": "tracing-stop", b"R": "running", b"S": "sleeping", b"D": "disk-sleep",
            b"Z": "zombie", b"X": "zombie"}.get(code, "other")
