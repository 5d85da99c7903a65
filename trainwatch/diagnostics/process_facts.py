"""Facts of the process, memory and CUDA messages in log_rules.py's table: exit codes
and signals, OOM sizes, CUDA error texts. Pure functions of one regex match."""

from __future__ import annotations

import re
import signal as _signal

_SIZE = r"[\d.]+\s*(?:[KMGT]i?B|bytes|B)"


def _int(value: str | None) -> int | None:
    """int() that passes None, and anything that is not a number, through as None."""
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


# strsignal() texts that Python prints for a killed worker -> signal names.
SIGNAL_TEXTS = {
    "killed": "SIGKILL",
    "terminated": "SIGTERM",
    "aborted": "SIGABRT",
    "segmentation fault": "SIGSEGV",
    "bus error": "SIGBUS",
    "interrupt": "SIGINT",
    "floating point exception": "SIGFPE",
    "illegal instruction": "SIGILL",
}

_UNITS = {"b": 1, "bytes": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def device_assert(m: re.Match[str]) -> dict:
    """A CUDA kernel's assert: what torch reports as "device-side assert triggered"."""
    return {"cuda_message": "device-side assert triggered", "assertion": m.group("cond").strip()}


def cuda_message(m: re.Match[str]) -> dict:
    """The text after "CUDA error:", without the hints torch appends."""
    message = m.group("msg").strip().rstrip(".").strip()
    return {"cuda_message": message} if message else {}


SOURCE_LOCATION = re.compile(r"\S+:\d{1,9}")


def old_cuda_message(m: re.Match[str]) -> dict:
    """The message of a pre-1.5 CUDA error, without the " at FILE:LINE" torch appended
    (split off by hand: a regex anchored at the end rescans long runs of spaces)."""
    message = m.group("msg").strip()
    head, sep, tail = message.rpartition(" at ")
    if sep and SOURCE_LOCATION.fullmatch(tail.strip()):
        message = head.strip()
    return {"cuda_message": message} if message else {}


def to_bytes(size: str) -> int | None:
    """'2.00 GiB' -> 2147483648; None when the unit is unknown."""
    m = re.fullmatch(r"(\d{0,30}(?:\.\d{0,30})?)\s*([A-Za-z]+)", size.strip())
    if not m or not m.group(1).strip(".") or m.group(2).lower() not in _UNITS:
        return None
    return round(float(m.group(1)) * _UNITS[m.group(2).lower()])


OOM_DETAILS = (
    re.compile(r"Tried\s*to\s*allocate\s*(?P<requested>" + _SIZE + ")"),
    # torch >= 2.1: "GPU 0 has a total capacity of 79.15 GiB of which 1.23 GiB is free"
    # (2.1 spelled it "capacty").
    re.compile(r"GPU\s*(?P<gpu>\d+)\s*has\s*a\s*total\s*capac(?:i)?ty\s*of\s*(?P<total>" + _SIZE
               + r")\s*of\s*which\s*(?P<free>" + _SIZE + r")\s*is\s*free"),
    # torch < 2.1: "(GPU 0; 14.76 GiB total capacity; 8.77 GiB already allocated; 19.75 MiB free; ...)"
    re.compile(r"\(GPU\s*(?P<gpu>\d+);\s*(?P<total>" + _SIZE + r")\s*total\s*capacity;\s*"
               r"(?P<allocated>" + _SIZE + r")\s*already\s*allocated;\s*(?P<free>" + _SIZE + r")\s*free"),
)


def oom_facts(m: re.Match[str]) -> dict:
    """Requested / total / free bytes and the GPU index of a CUDA OOM message."""
    facts: dict = {}
    line = m.string[m.start():]
    for detail in OOM_DETAILS:
        found = detail.search(line)
        if not found:
            continue
        for key, value in found.groupdict().items():
            if value is None:
                continue
            facts["gpu" if key == "gpu" else f"{key}_bytes"] = int(value) if key == "gpu" else to_bytes(value)
    return facts


def elastic_failed(m: re.Match[str]) -> dict:
    """Facts of the agent's "failed (exitcode: -9) local_rank: 3 (pid: 1234)" line."""
    exit_code = int(m.group("exit"))
    return {
        "exit_code": exit_code,
        "signal": signal_name(-exit_code) if exit_code < 0 else None,
        "local_rank": int(m.group("local")),
        "pid": int(m.group("pid")),
    }


def launcher_exit(m: re.Match[str]) -> dict:
    """A launcher's word that a worker exited with a code (a negative one is the signal)."""
    exit_code = int(m.group("exit"))
    return {"exit_code": exit_code, "signal": signal_name(-exit_code) if exit_code < 0 else None}


def elastic_squashed(m: re.Match[str]) -> dict:
    """A ChildFailedError entry on one line: the agent's facts and the global rank it names."""
    return elastic_failed(m) | {"rank": int(m.group("rank"))}


def spawn_exited(m: re.Match[str]) -> dict:
    """torch.multiprocessing.spawn's "process 1 terminated with signal SIGSEGV" / "... with exit code 1"."""
    exit_code = _int(m.group("exit"))
    return {"exit_code": exit_code, "signal": m.group("sig") or (signal_name(-exit_code) if exit_code and exit_code < 0
                                                                   else None), "local_rank": int(m.group("local"))}


def dataloader_facts(m: re.Match[str]) -> dict:
    """Facts of a "DataLoader worker (pid N) is killed by signal: Killed." line."""
    pids = [int(p) for p in re.findall(r"\d+", m.group("pids") or "")]
    facts: dict = {"pids": pids or None}
    if m.group("sig") is not None:
        facts["signal"] = SIGNAL_TEXTS.get(m.group("sig").strip().lower())
    if m.group("exit") is not None:
        facts["exit_code"] = int(m.group("exit"))
    return facts


def bus_error(m: re.Match[str]) -> dict:
    """torch names SIGBUS in a worker when /dev/shm runs out."""
    return {"signal": "SIGBUS"}


def signal_name(number: int) -> str | None:
    """9 -> 'SIGKILL'; None for numbers this platform does not know."""
    try:
        return _signal.Signals(number).name
    except ValueError:
        return None


def signal_died(m: re.Match[str]) -> dict:
    """subprocess's "died with <Signals.SIGKILL: 9>" (torch.distributed.launch before torchrun)."""
    number = int(m.group("num"))
    return {"exit_code": -number, "signal": m.group("sig")}


def task_signalled(m: re.Match[str]) -> dict:
    """Slurm's "srun: error: node7: task 3: Killed" (the task is the global rank)."""
    facts: dict = {"signal": SIGNAL_TEXTS.get(m.group("what").strip().lower())}
    if m.group("task") and m.group("task").isdigit():
        facts["rank"] = int(m.group("task"))
    return facts


def mpi_signalled(m: re.Match[str]) -> dict:
    """mpirun's "process rank 3 with PID 1234 on node x exited on signal 9 (Killed)"."""
    number = int(m.group("num"))
    pid = m.group("pid")
    return {"rank": int(m.group("rank")), "pid": int(pid) if pid.isdigit() else None, "exit_code": -number,
            "signal": signal_name(number)}

