"""Python stacks of training processes: the one model every stack parser fills.

Stacks reach trainwatch in many shapes (py-spy, faulthandler, tracebacks,
pystack, gdb, c10 C++ frames); stack_parsers.py turns each into this model:
`ProcessStack` > `ThreadStack` > `Frame`, innermost frame first. The hang
catalog (catalog.py) matches patterns on it and stack_groups.py groups ranks
by where they wait.

Everything here is pure: frozen dataclasses and string helpers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# ---------------------------------------------------------------------------
# Model


@dataclass(frozen=True, slots=True)
class Frame:
    """One stack frame."""

    function: str
    """Function as the tool printed it: `all_reduce`, `Thread.run`, or a C++ symbol."""
    file: str = ""
    """Source file or shared library; '' when the tool gave none."""
    line: int | None = None
    """Line number; None for native frames or when unknown."""

    def describe(self) -> str:
        """`func (file:line)`, the way py-spy prints a frame."""
        where = short_path(self.file)
        if self.line is not None:
            where = f"{where}:{self.line}"
        return f"{self.function} ({where})" if where else self.function


@dataclass(frozen=True, slots=True)
class ThreadStack:
    """The stack of one thread at the moment it was sampled."""

    thread_id: str | None
    """Thread id as printed (hex pthread id or decimal OS tid); None if unknown."""
    thread_name: str | None
    """Python thread name (`MainThread`); None if the tool did not say."""
    frames: tuple[Frame, ...]
    """Frames, innermost (where the thread is now) first."""
    active: bool | None = None
    """py-spy's view: True running, False idle (blocked in a syscall); None if unknown."""
    gil: bool | None = None
    """True if the thread held the GIL when sampled; None if unknown."""
    exception: str | None = None
    """For a traceback: the exception line that ended it (`RuntimeError: ...`)."""


@dataclass(frozen=True, slots=True)
class ProcessStack:
    """All sampled threads of one process (usually one rank)."""

    pid: int | None
    """OS process id; None if the text did not say."""
    rank: int | None
    """Global rank; None if unknown."""
    command: str | None
    """Command line as py-spy printed it; None if unknown."""
    threads: tuple[ThreadStack, ...]
    """Every thread the tool reported."""
    error: str | None = None
    """Why the process could not be sampled (py-spy failed, timed out); None when sampled."""


# ---------------------------------------------------------------------------
# Helpers the model, the catalog and grouping share

_PACKAGES_ROOT = re.compile(r"^.*/(?:site-packages|dist-packages)/")
_STDLIB_ROOT = re.compile(r"^.*/lib/python\d+(?:\.\d+)?/")
_HEX_FUNCTION = re.compile(r"^(?:0x[0-9a-fA-F]+|\?\?)$")


def short_path(path: str) -> str:
    """Drop the install prefix so `/x/site-packages/torch/a.py` reads `torch/a.py`."""
    if not path:
        return ""
    path = path.replace("\\", "/")  # Windows tracebacks
    shorter = _PACKAGES_ROOT.sub("", path, count=1)
    return shorter if shorter != path else _STDLIB_ROOT.sub("", path, count=1)


def is_address(frame: Frame) -> bool:
    """A native frame py-spy or gdb could not name (`0x7f.. (libc.so.6)`, `??`)."""
    return bool(_HEX_FUNCTION.match(frame.function.strip()))
