"""Stack parsers: every stack text or py-spy JSON shape -> the model in stacks.py.

Stacks reach trainwatch in many shapes: `py-spy dump` (text or `--json`, with or
without `--native`), faulthandler dumps, Python tracebacks, pystack, gdb `bt` and
`py-bt`, and C++ frames printed by c10 exceptions. Every parser here turns its
shape into the same model (`ProcessStack` > `ThreadStack` > `Frame`, innermost
frame first) and never raises on junk: a line it does not understand is skipped.

Everything here is pure: text or decoded JSON in, frozen dataclasses out (the JSON
shapes are read in pyspy_json.py).
"""

from __future__ import annotations

import re

from trainwatch.diagnostics.pyspy_json import decode_json_values, parse_pyspy_json  # noqa: F401 - re-exported
from trainwatch.diagnostics.stacks import Frame, ProcessStack, ThreadStack

# ---------------------------------------------------------------------------
# Text parsers

_SOURCE_LINE = re.compile(r"^\s*# source:")
_FENCE = re.compile(r"^\s*```")
# Launchers prefix every line: torch's "[rankN]:" (twice when torchrun tees a rank's
# output that already carries it, or after torchrun's own "[default3]:"), a host
# ("node-7: "), a clock ("18:11:06.680 "). Prefixes stack; the first rank named wins.
_LINE_PREFIX = re.compile(
    r"\[(?:rank|RANK)\s*(?P<rank>\d{1,9})\]:\s?"
    r"|\[[\w|.-]+\]:\s?"
    # Ray's actor prefix "(RayWorkerWrapper pid=4009, ip=10.0.0.1) ", with or without the
    # colour codes around it (or their printable leftovers "[36m" once ESC is lost).
    r"|(?:\x1b?\[\d{1,3}m)?\([\w.:-]+ pid=\d{1,12}(?:, ip=[\w.:-]+)?\)(?:\x1b?\[0m)?\s?"
    # a quoted paste ("> " per line; the quoted text keeps its own indentation)
    r"|> ?(?=\s*\S)"
    # a host or a clock only in front of a bracketed prefix ("RuntimeError: [1] ..." keeps its name)
    r"|(?:[\w.-]+:|(?:\d{4}-\d{2}-\d{2}[T ])?\d{1,2}:\d{2}:\d{2}(?:[.,]\d+)?)\s+(?=\[[\w|.-]+\]:)"
)

# Dumps pasted into a list or a quote keep their shape but gain a margin, so headers
# may be indented too.
_PYSPY_PROCESS = re.compile(r"^\s*Process (\d{1,12}): (.*?)\s*$")
_PID_BANNER = re.compile(r"^=+\s*pid\s+(\d{1,12})\s*=+\s*$", re.IGNORECASE)
_PYSPY_THREAD = re.compile(
    r'^\s*Thread\s*(?P<id>0[xX][0-9a-fA-F]+|\d+)?\s*\((?P<state>[a-z+]+)\)(?::\s*"(?P<name>.*)")?\s*$'
)
# A py-spy frame without its thread header (a paste that starts mid-dump): only a
# location py-spy itself prints, "file.py:LINE" or a native library, counts.
_PYSPY_LOOSE_FRAME = re.compile(
    r"^\s+(?P<func>[\w<>.:~-][^()]*)\((?P<loc>[^()\s]+\.py:\d{1,9}|[^()\s]+\.(?:so|dylib)(?:\.[\d.]+)?)\)\s*$")
# lldb `bt`: "* thread #1, queue = 'com.apple.main-thread', stop reason = signal SIGSTOP"
# and "  * frame #0: 0x00000001aa919084 Metal`pthread_cond_wait + 12". The frame's tail
# (" + 12", " at file.c:34:5") is split off in Python: a regex doing it backtracks on long lines.
_LLDB_THREAD = re.compile(r"^\s*(?:\*\s*)?thread #(?P<num>\d+)(?:,\s*(?P<desc>.*))?$")
_LLDB_FRAME = re.compile(r"^\s*(?:\*\s*)?frame #\d+:\s*(?:0x[0-9a-fA-F]+\s+)?(?P<lib>[^`\s]+)`(?P<rest>\S.*)$")
_LLDB_AT = re.compile(r"\s+at\s+(?P<file>\S+?)(?::(?P<line>\d{1,9}))?(?::\d{1,9})?$")
_OFFSET = re.compile(r"\s+\+\s+\d{1,12}$")
# macOS crash reports: "3   libtorch_cpu.dylib   \t0x000000010a2f15f6 at::native::foo + 406"
_MAC_CRASH_FRAME = re.compile(r"^\s*\d{1,4}\s+(?P<lib>\S+)\s+0x[0-9a-fA-F]+\s+(?P<rest>\S.*)$")
_MAC_CRASH_THREAD = re.compile(r"^Thread (?P<num>\d+)(?: Crashed)?::?\s*(?P<desc>.*)$")
_PYSPY_LOCALS = re.compile(r"^(?P<indent>\s+)(?:Arguments|Locals):\s*$")
_FAULT_THREAD = re.compile(
    r"^\s*(?P<current>Current thread|Thread) (?P<id>0x[0-9a-fA-F]+)(?: \[(?P<name>[^\]]*)\])?"
    r" \(most recent call first\):\s*$"
)
_FAULT_FRAME = re.compile(r'^\s*File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<func>\S.*?)\s*$')
_GC_MARK = re.compile(r"^\s*<?Garbage-collecting>?\s*$")
_TB_HEADER = re.compile(r"^\s*Traceback \(most recent call (?P<order>last|first)\):\s*$")
_TB_FRAME = re.compile(r'^\s*File "(?P<file>[^"]*)", line (?P<line>\d+), in (?P<func>\S.*?)\s*$')
_EXCEPTION = re.compile(
    r"^(?:[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Warning|Timeout\w*)|[A-Za-z_][\w.]*\.\w+)(?::|\s*$)"
)
_PYSTACK_THREAD = re.compile(
    r"^\s*Traceback for thread (?P<id>\d+)(?: \((?P<name>[^)]*)\))?(?: \[(?P<state>[^\]]*)\])?"
    r" \(most recent call last\):\s*$"
)
_PYSTACK_FRAME = re.compile(
    r'^\s*\((?:Python|C)\) File "(?P<file>[^"]*)", line (?P<line>\d+), in (?P<func>.+?)'
    r"(?: \((?P<lib>[^()]*)\))?\s*$"
)
_OLD_PYSTACK_FRAME = re.compile(r"^\s*(?P<file>\S+\.py) \((?P<line>\d+)\): (?P<func>\S+)\s*$")
_GDB_THREAD = re.compile(r"^\*?\s*Thread (?P<num>\d+) \((?P<desc>.*)\):?\s*$")
_GDB_PYBT_FRAME = re.compile(
    r"^#\d+ Frame 0x[0-9a-fA-F]+, for file (?P<file>.+?), line (?P<line>\d+), in (?P<func>[^\s(]+)"
)
_GDB_FRAME = re.compile(r"^#\d+\s+(?:0x[0-9a-fA-F]+ in )?(?P<rest>\S.*?)\s*$")
_GDB_WHERE = re.compile(r"\s+(?:from|at) (?P<file>\S+?)(?::(?P<line>\d+))?\s*$")
_GDB_CONTINUATION = re.compile(r"^\s+(?:from|at) (?P<file>\S+?)(?::(?P<line>\d+))?\s*$")
_CPP_FRAME = re.compile(
    r"^frame #\d+: (?P<func>.+?)(?: \+ 0x[0-9a-fA-F]+)? \((?:0x[0-9a-fA-F]+ in )?(?P<file>[^()]*)\)\s*$"
)
_LWP = re.compile(r"LWP (\d+)")
# PaddlePaddle's native stack on a fatal signal: a header, then "0   paddle::imperative::...".
_PADDLE_CPP_HEADER = re.compile(r"^\s*C\+\+ Traceback \(most recent call last\):\s*$")
_PADDLE_CPP_FRAME = re.compile(r"^\s*\d{1,4}\s{2,}(?P<func>[A-Za-z_~][^\s(]*(?:\(.*\))?)\s*$")
# cuda-gdb's `info cuda kernels` table: one row per kernel on the device, the kernel's name last
# ("*  0  -  0 52162520 Active 0x00000001 (1,1,1) (64,1,1) ncclReduceRingLLKernel_sum_f64()").
# An active kernel is where that GPU is: a frame of a "GPU" thread.
_CUDA_GDB_KERNEL = re.compile(
    r"^\*?\s*\d{1,6}\s+\S+\s+\d{1,4}\s+\d{1,12}\s+Active\s+0x[0-9a-fA-F]+\s+\([\d,\s]+\)\s+\([\d,\s]+\)\s+"
    r"(?P<func>[A-Za-z_][\w:<>~]*)\s*(?:\(.*)?$")


def parse_stack_text(text: str) -> list[ProcessStack]:
    """Any supported stack text -> processes; auto-detects the format(s) line by line.

    Several processes in one text (py-spy `Process N:` headers, `[rankN]:` log
    prefixes, `== pid N ==` banners) become several ProcessStacks. Lines starting
    with `# source:` and markdown fences are ignored.
    """
    lines = [line.rstrip("\r") for line in text.splitlines()
             if not _SOURCE_LINE.match(line) and not _FENCE.match(line)]
    body = "\n".join(lines).strip()
    if body[:1] in ("[", "{"):
        values = decode_json_values(body)
        if values is not None:
            return [p for value in values for p in parse_pyspy_json(value)]
    processes: list[ProcessStack] = []
    for rank, chunk in _split_by_rank(lines):
        for proc in _join_native_halves(_scan(chunk)):
            processes.append(proc if proc.rank is not None or rank is None else _with_rank(proc, rank))
    return processes


def _join_native_halves(processes: list[ProcessStack]) -> list[ProcessStack]:
    """Fold a pid-less process (a gdb `thread apply all bt`) into the process whose
    threads it shares: gdb's `LWP 1234` and py-spy's `Thread 1234` are one OS thread."""
    out = list(processes)
    for proc in processes:
        ids = {t.thread_id for t in proc.threads if t.thread_id}
        if proc.pid is not None or not ids:
            continue
        home = next((p for p in out if p is not proc and ids & {t.thread_id for t in p.threads}), None)
        if home is not None:
            out.remove(proc)
            merged = ProcessStack(home.pid, home.rank, home.command, home.threads + proc.threads, home.error)
            out[out.index(home)] = merged
    return out


def _with_rank(proc: ProcessStack, rank: int) -> ProcessStack:
    return ProcessStack(proc.pid, rank, proc.command, proc.threads, proc.error)


def strip_line_prefixes(line: str) -> tuple[int | None, str]:
    """(the rank the line's launcher prefixes name, the line without them)."""
    rank: int | None = None
    pos = 0
    while (m := _LINE_PREFIX.match(line, pos)) and m.end() > pos:
        if rank is None and m.group("rank") is not None:
            rank = int(m.group("rank"))
        pos = m.end()
    return rank, line[pos:]


def _split_by_rank(lines: list[str]) -> list[tuple[int | None, list[str]]]:
    """Route `[rankN]:`-prefixed lines to one chunk per rank; other lines stay together."""
    chunks: dict[int | None, list[str]] = {}
    for line in lines:
        rank, rest = strip_line_prefixes(line)
        chunks.setdefault(rank, []).append(rest)
    return list(chunks.items())


class _ThreadBuilder:
    """Frames of one thread while it is being read; `innermost_last` tracebacks flip at the end."""

    __slots__ = ("kind", "thread_id", "name", "active", "gil", "frames", "exception", "innermost_last",
                 "collecting")

    def __init__(self, kind: str, thread_id: str | None = None, name: str | None = None,
                 active: bool | None = None, gil: bool | None = None, innermost_last: bool = False):
        self.kind = kind
        self.thread_id = thread_id
        self.name = name
        self.active = active
        self.gil = gil
        self.frames: list[Frame] = []
        self.exception: str | None = None
        self.innermost_last = innermost_last
        self.collecting = False  # pystack says the thread is inside a GC pass

    def build(self) -> ThreadStack:
        frames = tuple(reversed(self.frames)) if self.innermost_last else tuple(self.frames)
        if self.collecting:
            frames = (Frame("<gc>", "gc"), *frames)
        return ThreadStack(self.thread_id, self.name, frames, self.active, self.gil, self.exception)


class _ProcessBuilder:
    __slots__ = ("pid", "command", "threads")

    def __init__(self, pid: int | None = None, command: str | None = None):
        self.pid = pid
        self.command = command
        self.threads: list[_ThreadBuilder] = []

    def build(self) -> ProcessStack:
        threads = tuple(t.build() for t in self.threads
                        if t.frames or t.kind == "pyspy" or t.exception)
        return ProcessStack(self.pid, None, self.command, threads)


def _scan(lines: list[str]) -> list[ProcessStack]:
    """One pass over the lines of one rank's text; every format is recognised by its own lines."""
    processes: list[_ProcessBuilder] = []
    proc: _ProcessBuilder | None = None
    thread: _ThreadBuilder | None = None
    skip_indent: int | None = None  # inside py-spy `Arguments:`/`Locals:` blocks

    def new_process(pid: int | None, command: str | None) -> _ProcessBuilder:
        nonlocal thread
        p = _ProcessBuilder(pid, command)
        processes.append(p)
        thread = None
        return p

    def new_thread(t: _ThreadBuilder) -> _ThreadBuilder:
        nonlocal proc
        if proc is None:
            proc = new_process(None, None)
        proc.threads.append(t)
        return t

    def current(kind: str, innermost_last: bool = False) -> _ThreadBuilder:
        # Frames without a header (a trimmed paste) still form a thread.
        nonlocal thread
        if thread is None or thread.kind != kind or thread.exception is not None:
            thread = new_thread(_ThreadBuilder(kind, innermost_last=innermost_last))
        return thread

    for line in lines:
        if not line.strip():
            continue
        if skip_indent is not None:
            if len(line) - len(line.lstrip()) > skip_indent:
                continue
            skip_indent = None

        if m := _PYSPY_PROCESS.match(line):
            proc = new_process(int(m.group(1)), m.group(2) or None)
        elif m := _PID_BANNER.match(line):
            proc = new_process(int(m.group(1)), None)
        elif m := _PYSPY_THREAD.match(line):
            state = m.group("state")
            thread = new_thread(_ThreadBuilder(
                "pyspy", m.group("id"), m.group("name"),
                active="active" in state if ("active" in state or "idle" in state) else None,
                gil="gil" in state,
            ))
        elif m := _FAULT_THREAD.match(line):
            thread = new_thread(_ThreadBuilder("fault", m.group("id"), m.group("name")))
        elif m := _PYSTACK_THREAD.match(line):
            state = m.group("state") or ""
            thread = new_thread(_ThreadBuilder(
                "pystack", m.group("id"), m.group("name"),
                gil=True if "Has the GIL" in state else None, innermost_last=True))
            thread.collecting = "Garbage collecting" in state
        elif _PADDLE_CPP_HEADER.match(line):
            thread = new_thread(_ThreadBuilder("paddlecpp", innermost_last=True))
        elif thread is not None and thread.kind == "paddlecpp" and (m := _PADDLE_CPP_FRAME.match(line)):
            thread.frames.append(Frame(m.group("func").split("(")[0], ""))
        elif m := _TB_HEADER.match(line):
            first = m.group("order") == "first"  # gdb's py-bt prints innermost first
            thread = new_thread(_ThreadBuilder(
                "pybt" if first else "traceback", name=None if first else "traceback",
                innermost_last=not first))
        elif m := _GDB_THREAD.match(line):
            lwp = _LWP.search(m.group("desc"))
            thread = new_thread(_ThreadBuilder("gdb", lwp.group(1) if lwp else m.group("num")))
        elif m := _LLDB_THREAD.match(line):
            thread = new_thread(_ThreadBuilder("lldb", m.group("num"), _lldb_name(m.group("desc"))))
        elif m := _LLDB_FRAME.match(line):
            current("lldb").frames.append(_native_frame(m.group("rest"), m.group("lib")))
        elif m := _MAC_CRASH_THREAD.match(line):
            thread = new_thread(_ThreadBuilder("maccrash", m.group("num"), m.group("desc").strip() or None))
        elif thread is not None and thread.kind == "pyspy" and (m := _PYSPY_LOCALS.match(line)):
            skip_indent = len(m.group("indent"))
        elif thread is not None and thread.kind == "pyspy" and (frame := _pyspy_frame(line)):
            thread.frames.append(frame)
        elif m := _FAULT_FRAME.match(line):
            current("fault").frames.append(_frame(m))
        elif _GC_MARK.match(line):
            current("fault").frames.append(Frame("<gc>", "gc"))
        elif m := _TB_FRAME.match(line):
            if thread is not None and thread.kind in ("traceback", "pybt") and thread.exception is None:
                thread.frames.append(_frame(m))
            else:
                current("traceback", innermost_last=True).frames.append(_frame(m))
        elif m := _PYSTACK_FRAME.match(line):
            current("pystack", innermost_last=True).frames.append(
                Frame(m.group("func"), m.group("lib") or m.group("file"), _line(m.group("line")) or None))
        elif m := _GDB_PYBT_FRAME.match(line):
            current("gdb").frames.append(_frame(m))
        elif m := _CPP_FRAME.match(line):
            current("cpp").frames.append(Frame(m.group("func").strip(), m.group("file").strip()))
        elif m := _GDB_FRAME.match(line):
            frame = _gdb_frame(m.group("rest"))
            if frame is not None:
                current("gdb").frames.append(frame)
        elif thread is not None and thread.kind == "gdb" and thread.frames and (m := _GDB_CONTINUATION.match(line)):
            last = thread.frames[-1]
            if not last.file:
                thread.frames[-1] = Frame(last.function, m.group("file"), _line(m.group("line")))
        elif m := _CUDA_GDB_KERNEL.match(line):
            current("cudagdb").frames.append(Frame(m.group("func"), "<gpu kernel>"))
        elif m := _OLD_PYSTACK_FRAME.match(line):
            current("oldpystack").frames.append(_frame(m))
        elif thread is not None and thread.kind == "maccrash" and (m := _MAC_CRASH_FRAME.match(line)):
            thread.frames.append(_native_frame(m.group("rest"), m.group("lib")))
        elif (thread is None or thread.kind == "pyspy") and (m := _PYSPY_LOOSE_FRAME.match(line)):
            file, _, lineno = m.group("loc").rpartition(":")
            if not lineno.isdigit():
                file, lineno = m.group("loc"), ""
            current("pyspy").frames.append(Frame(m.group("func").strip(), file, _line(lineno)))
        elif (thread is not None and thread.kind == "traceback" and thread.frames
              and thread.exception is None and not line[0].isspace() and _EXCEPTION.match(line)):
            thread.exception = line.strip()
    return [p.build() for p in processes if p.threads or p.pid is not None]


def _pyspy_frame(line: str) -> Frame | None:
    """An indented "func (file.py:12)" line: the location is inside the last parentheses.

    Split by hand: the regex's lazy name before optional spaces backtracks over a long run
    of blanks, quadratic in the line's length."""
    body = line.rstrip()
    cut = body.rfind("(")
    if not (line[:1].isspace() and body.endswith(")") and cut > 0):
        return None
    func, loc = body[:cut].strip(), body[cut + 1:-1]
    if not func or not loc.isprintable() or any(c in loc for c in "() \t"):
        return None
    file, _, lineno = loc.rpartition(":")
    if not (file and lineno.isdigit()):
        file, lineno = loc, ""
    return Frame(func, file, _line(lineno))


def _native_frame(rest: str, lib: str) -> Frame:
    """An lldb or crash-report frame: "func + 12" or "func at file.c:34:5" in library `lib`."""
    rest = rest.rstrip()
    file, line = lib, None
    if (at := _LLDB_AT.search(rest)) is not None:
        file, line = at.group("file"), _line(at.group("line"))
        rest = rest[:at.start()]
    rest = _OFFSET.sub("", rest).strip()
    return Frame(rest or "??", file, line)


def _lldb_name(desc: str | None) -> str | None:
    """The queue or name lldb prints for a thread, if any."""
    m = re.search(r"(?:queue|name) = '([^']*)'", desc or "")
    return m.group(1) if m else None


def _line(value: str | None) -> int | None:
    # A line number is short; a run of digits longer than any file is no line number.
    return int(value) if value and value.isdigit() and len(value) <= 12 else None


def _frame(m: re.Match[str]) -> Frame:
    return Frame(m.group("func"), m.group("file"), _line(m.group("line")))


def _gdb_frame(rest: str) -> Frame | None:
    """`func (args) from lib.so` / `func (args) at file.c:12` / `func from file.py:12`."""
    if rest.startswith("<"):
        return None  # py-bt's `<built-in method ...>` lines carry no location
    file, line = "", None
    where = _GDB_WHERE.search(rest)
    if where:
        file, line = where.group("file"), _line(where.group("line"))
        rest = rest[: where.start()]
    function = rest.split(" (", 1)[0].strip()
    return Frame(function, file, line) if function else None
