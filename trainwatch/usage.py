"""One error style for every command: `error: <what and how to fix it>` on one
line of stderr and exit code 2, never argparse's usage block, never a traceback."""

from __future__ import annotations

import argparse
import re
import sys
from typing import NoReturn

EXIT_USAGE = 2


_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
"""What a terminal acts on instead of showing: C0 and C1 controls (ESC starts CSI
and OSC sequences: colours, titles, screen clears, links; BEL, CR, backspace)
and the bidirectional overrides that reorder what is shown."""


def _visible(m: re.Match) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def printable(text: str, *, newlines: bool = True) -> str:
    """The one sanitiser for text that came from a rank, a log or a state file on
    its way to a terminal: control characters are shown escaped (ESC as \\x1b),
    never acted on; characters UTF-8 cannot encode (lone surrogates from a
    non-UTF-8 command line read back from JSON) become '?'. Tabs and (unless
    `newlines` is false) line breaks stay."""
    text = text.encode("utf-8", "replace").decode("utf-8")
    text = _CONTROL.sub(_visible, text)
    return text if newlines else text.replace("\n", "\\n")


def fail(message: str, code: int = EXIT_USAGE) -> int:
    """The `error:` line (its text escaped: it may quote a path or an argument) and the exit code; a
    message of several errors (joined by a line break and `error: `) is one line each."""
    for line in message.split("\nerror: "):
        print(f"error: {printable(line, newlines=False)}", file=sys.stderr, flush=True)
    return code


class Parser(argparse.ArgumentParser):
    """argparse with trainwatch's one-line errors; `usage_hint` ends the line."""

    def __init__(self, *args, usage_hint: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.usage_hint = usage_hint or f"see `{self.prog} --help`"

    def error(self, message: str) -> NoReturn:
        sys.exit(fail(f"{message} ({self.usage_hint})"))
