"""`trainwatch explain FILE... [--json]`: read the files (or stdin), explain
them (trainwatch.diagnostics.explain), print the findings.

Inputs are read in bounded memory: at most MAX_BYTES of each, in chunks, so
`/dev/zero` or a log of many gigabytes never exhausts memory; what was left
unread is said in the report's errors.
"""

from __future__ import annotations

import json
import sys
from typing import BinaryIO, TextIO

from trainwatch.diagnostics.explain import explain_inputs, render_report
from trainwatch.usage import Parser, fail

MAX_BYTES = 64 * 1024 * 1024
"""Per input: the most of a file that is read (a training log's last lines
matter most, so a longer file is read from its end)."""
_CHUNK = 1 << 20


def read_bounded(stream: BinaryIO, limit: int = MAX_BYTES) -> tuple[bytes, int]:
    """(the last `limit` bytes of the stream, bytes skipped before them), reading
    in chunks so memory stays bounded whatever the stream's length."""
    kept = bytearray()
    skipped = 0
    while True:
        chunk = stream.read(_CHUNK)
        if not chunk:
            return bytes(kept), skipped
        kept += chunk
        if len(kept) > limit:
            cut = len(kept) - limit
            skipped += cut
            del kept[:cut]


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
                data, skipped = read_bounded(stdin, limit)
                name = "<stdin>"
            else:
                with open(path, "rb") as f:
                    data, skipped = read_bounded(f, limit)
                name = path
        except OSError as e:
            return fail(f"cannot read {path} ({e.strerror or type(e).__name__}); "
                        "pass a readable log, py-spy dump or kernel log")
        if skipped:
            notes.append(f"{name}: {skipped} bytes before its last {limit} were not read")
        inputs.append((name, data))
    report = explain_inputs(inputs)
    report["errors"] = notes + report["errors"]
    out.write(json.dumps(report, indent=2) + "\n" if args.json else render_report(report))
    return 0
