"""One line, one write: what ranks print to the log they share."""

from __future__ import annotations

import sys


def print_line(message: str, *, stderr: bool = False) -> None:
    """Print `message` and its newline with a single write.

    Every local rank's stdout and stderr are the agent's, so ranks write into one
    log. Unbuffered (PYTHONUNBUFFERED, common in launch scripts) print() writes
    the text and the newline apart, and two ranks saying something at the same
    moment (an emergency checkpoint, a received checkpoint) ran together mid-line.
    """
    stream = sys.stderr if stderr else sys.stdout
    stream.write(message + "\n")
    stream.flush()
