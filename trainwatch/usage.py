"""One error style for every command: `error: <what and how to fix it>` on one
line of stderr and exit code 2, never argparse's usage block, never a traceback."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

EXIT_USAGE = 2


def printable(text: str) -> str:
    """text as a terminal or pipe takes it: characters UTF-8 cannot encode (lone
    surrogates from a non-UTF-8 command line read back from JSON) become '?'."""
    return text.encode("utf-8", "replace").decode("utf-8")


def fail(message: str, code: int = EXIT_USAGE) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


class Parser(argparse.ArgumentParser):
    """argparse with trainwatch's one-line errors; `usage_hint` ends the line."""

    def __init__(self, *args, usage_hint: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.usage_hint = usage_hint or f"see `{self.prog} --help`"

    def error(self, message: str) -> NoReturn:
        sys.exit(fail(f"{message} ({self.usage_hint})"))
