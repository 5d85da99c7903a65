"""`trainwatch explain FILE... [--json]`: read the files (or stdin), explain
them (trainwatch.diagnostics.explain), print the findings.

Inputs are read in a bounded window: at most MAX_BYTES of each, its head and
its tail (a training log's first lines say how the job was set up, its last
ones how it ended), so a log of many gigabytes is read in the time of
MAX_BYTES. A stream that cannot seek (stdin, a pipe, /dev/zero) is read
through once, keeping its head and a rolling tail, for at most MAX_SCAN_BYTES
or MAX_SCAN_S; what was left unread is said in the report's errors. Every
string printed passes through the one terminal sanitiser (usage.printable).
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import BinaryIO, TextIO

from trainwatch.diagnostics.explain import explain_inputs, render_report
from trainwatch.usage import Parser, fail, printable

MAX_BYTES = 64 * 1024 * 1024
"""Per input: the most of it that is kept, a quarter from its head and the rest from its end."""
MAX_SCAN_BYTES = 1 << 30
"""Per stream that cannot seek: the most read through for its tail."""
MAX_SCAN_S = 3.0
"""Per stream that cannot seek: the longest spent reading it (an endless input ends here)."""
_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class Window:
    """What was read of one input."""

    data: bytes
    """Its head, a newline and its tail (all of it when it fits)."""
    skipped: int
    """Bytes between the head and the tail that were read past or never read."""
    cut_short: bool = False
    """The scan limits ended the reading of a stream that had more."""


def read_bounded(stream: BinaryIO, limit: int = MAX_BYTES) -> tuple[bytes, int]:
    """(at most `limit` bytes of the stream, bytes not kept): see read_window."""
    w = read_window(stream, limit)
    return w.data, w.skipped


def read_window(stream: BinaryIO, limit: int = MAX_BYTES, *, scan_bytes: int = MAX_SCAN_BYTES,
                scan_s: float = MAX_SCAN_S, clock=time.monotonic) -> Window:
    """At most `limit` bytes of the stream: a quarter from its head, the rest from
    its end. A regular file is read at both ends; any other stream through once,
    in chunks, so memory stays bounded whatever its length."""
    head_n = limit // 4
    tail_n = max(0, limit - head_n - 1)
    size = _regular_size(stream)
    if size is not None:
        if size <= limit:
            return Window(stream.read(limit), 0)
        head = stream.read(head_n)
        stream.seek(size - tail_n)
        tail = stream.read(tail_n)
        return Window(head + b"\n" + tail, size - len(head) - len(tail))
    head = bytearray()
    while len(head) < head_n:
        chunk = stream.read(min(_CHUNK, head_n - len(head)))
        if not chunk:
            return Window(bytes(head), 0)
        head += chunk
    tail: deque[bytes] = deque()
    kept = dropped = 0
    seen = len(head)
    deadline = clock() + scan_s
    cut_short = False
    while True:
        if seen >= scan_bytes or clock() >= deadline:
            cut_short = _has_more(stream)
            break
        chunk = stream.read(min(_CHUNK, scan_bytes - seen))
        if not chunk:
            break
        seen += len(chunk)
        tail.append(chunk)
        kept += len(chunk)
        while kept - len(tail[0]) >= tail_n:
            kept -= len(tail[0])
            dropped += len(tail.popleft())
    data = b"".join(tail)
    cut = max(0, len(data) - tail_n)
    if not dropped and len(head) + len(data) <= limit:
        return Window(bytes(head) + data, 0, cut_short)
    return Window(bytes(head) + b"\n" + data[cut:], dropped + cut, cut_short)


def _regular_size(stream: BinaryIO) -> int | None:
    try:
        st = os.fstat(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) and stream.seekable() else None


def _has_more(stream: BinaryIO) -> bool:
    try:
        return bool(stream.read(1))
    except OSError:
        return False


def main(argv: list[str], stdin: BinaryIO | None = None, out: TextIO | None = None,
         err: TextIO | None = None, limit: int = MAX_BYTES) -> int:
    p = Parser(prog="trainwatch explain", usage_hint="usage: trainwatch explain FILE... [--json]; '-' reads stdin",
               description="Verdicts from logs, py-spy dumps, faulthandler text and kernel logs.")
    p.add_argument("files", nargs="+", metavar="FILE", help="log, py-spy dump or kernel log; '-' reads stdin")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    stdin = sys.stdin.buffer if stdin is None else stdin
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    inputs, notes = [], []
    for path in args.files:
        try:
            if path == "-":
                window = read_window(stdin, limit)
                name = "<stdin>"
            else:
                with open(path, "rb") as f:
                    window = read_window(f, limit)
                name = path
        except OSError as e:
            return fail(f"cannot read {path} ({e.strerror or type(e).__name__}); "
                        "pass a readable log, py-spy dump or kernel log")
        if window.cut_short:
            notes.append(f"{name}: stopped reading after {MAX_SCAN_S:g} s or {MAX_SCAN_BYTES} bytes (an endless "
                         f"input?); its first {limit // 4} bytes and the last {limit - limit // 4 - 1} read were "
                         "explained")
        elif window.skipped:
            notes.append(f"{name}: only its first {limit // 4} and last {limit - limit // 4 - 1} bytes were read "
                         f"({window.skipped} bytes between them were not)")
        inputs.append((printable(name), window.data))
    report = explain_inputs(inputs)
    report["errors"] = notes + report["errors"]
    # JSON escapes control characters itself; the text report is for a terminal.
    out.write(json.dumps(report, indent=2) + "\n" if args.json else printable(render_report(report)))
    return 0
