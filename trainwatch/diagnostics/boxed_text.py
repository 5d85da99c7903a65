"""Text drawn inside boxes: `rich` tracebacks, panels and pasted dumps framed in `│ ... │`.

`rich` (and the CLIs built on it: typer, Lightning, NeMo, accelerate's launcher)
prints a traceback in a box: a `╭── Traceback (most recent call last) ──╮` top,
each frame as `│ /path/file.py:1163 in _try_get_data │` (the function name
wrapped onto the next line when the path is long), source lines with their
numbers and indentation guides (`│ ❱ 1163 │   │   data = ... │`), and the
exception below the box. Terminals, log viewers and chat tools draw other
dumps in the same frames.

`unbox` rewrites such text into what the plain readers know: frames become
Python traceback lines (`File "...", line N, in func`), a boxed title naming
a traceback becomes its header, borders and source lines go (their lines
are dropped, not left blank, so wrapped records stay together), and anything
else inside a frame keeps its own indentation (a py-spy dump stays one).
Text without box characters is returned unchanged.

Everything here is pure: text in, text out.
"""

from __future__ import annotations

import re

# Vertical strokes a frame is drawn with (light, heavy, double, dashed).
_BARS = "│┃║┆┇┊┋╎╏"
_BAR = re.compile(f"[{_BARS}]")
# What a border line is made of around its title ("╭── Traceback (...) ──╮").
_BORDER_CHARS = " \t" + "".join(chr(c) for c in range(0x2500, 0x2580))
# Everything in the Box Drawing block; a line made of these (and a title) is a border.
_BOX_CHARS = re.compile(r"[\u2500-\u257f]")
# What may stand before a frame's left bar: a margin, or a launcher prefix ("[rank3]: ",
# "(RayWorker pid=12) ", "node-1: ") that the stack and log readers strip themselves.
_BEFORE_BAR = re.compile(r"^(?:\s*|.{0,120}?(?:\]:|\)|:)\s+)$")
# rich's frame headers: "path.py:LINE in func" (a file it could read) or "in func:LINE".
_RICH_FRAME = re.compile(
    r"^\s*(?P<file>(?:[A-Za-z]:)?[^\s:]+?\.pyx?|<[^\s>]+>):(?P<line>\d{1,9}) in (?P<func>[\w<>.]+)\s*$")
_RICH_FRAME_NO_FILE = re.compile(r"^\s*in (?P<func>[\w<>.]+):(?P<line>\d{1,9})\s*$")
# A header cut before the function: "…/dataloader.py:1163 in" or "…/dataloader.py:1163".
_CUT_HEADER = re.compile(r"^\s*(?:[A-Za-z]:)?[^\s:]+?\.pyx?:\d{1,9}(?: in)?\s*$")
# rich's source lines: "  1313 │   │   elif ..." and the marked one "❱ 1315 │ ...".
_SOURCE_LINE = re.compile(r"^\s*(?:[❱>→]\s*)?\d{1,9}(?:\s+[" + _BARS + r"]|\s*$)|^\s*❱")
_MAX_NESTING = 4
"""Boxes inside boxes (rich's locals panels) are peeled this deep at most."""


def has_box(text: str) -> bool:
    """True when the text draws frames at all (the fast path skips everything else)."""
    return bool(_BOX_CHARS.search(text))


def unbox(text: str) -> str:
    """The text with box frames peeled and rich traceback frames rewritten (see the module doc)."""
    if not has_box(text):
        return text
    out: list[str] = []
    cut: str | None = None  # a frame header rich wrapped over several lines, so far
    for raw in text.splitlines():
        prefix, body, boxed = _peel(raw)
        if cut is not None:
            if boxed:
                # A folded path continues without a space ("...c10d.p" + "y:2501 in"); a header
                # wrapped at a space continues after one ("x.py:12 in" + "func").
                joined = cut + body.strip() if _folded_path(cut) else f"{cut} {body.strip()}"
                if _RICH_FRAME.match(joined):
                    out.append(prefix + _rewrite(joined))
                    cut = None
                    continue
                if _CUT_HEADER.match(joined):
                    cut = joined
                    continue
            out.append(prefix + cut)
            cut = None
        if not boxed:
            out.append(raw)
        elif _CUT_HEADER.match(body) or _folded_path(body):
            cut = body.strip()
        elif line := _rewrite(body):
            out.append(prefix + line)
    if cut is not None:
        out.append(cut)
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def _folded_path(body: str) -> bool:
    """A path rich folded at the frame's width: one word with a slash and no `:LINE` yet.

    String tests, not a regex: a pattern with two open-ended runs around the slash
    backtracks quadratically on a long word of slashes.
    """
    word = body.strip()
    if not word or any(c.isspace() for c in word) or ("/" not in word and "\\" not in word):
        return False
    return ":" not in (word[2:] if word[1:2] == ":" else word)  # "C:\\..." keeps its drive


def _peel(line: str) -> tuple[str, str, bool]:
    """(launcher prefix, the line inside its frames, whether it was framed or a border at all)."""
    first = _BOX_CHARS.search(line)
    if first is None or not _BEFORE_BAR.match(line[:first.start()]):
        return "", line, False
    prefix = line[:first.start()] if line[:first.start()].strip() else ""
    body = line[first.start():]
    if first.group() not in _BARS:
        # A border: "╭── Traceback (most recent call last) ──╮", "├────┤", "╰────╯".
        title = body.strip(_BORDER_CHARS)
        return (prefix, title, True) if not _BOX_CHARS.search(title) else ("", line, False)
    for _ in range(_MAX_NESTING):
        if not body.startswith(tuple(_BARS)):
            break
        inner = body[1:].rstrip()
        if inner.endswith(tuple(_BARS)):
            inner = inner[:-1].rstrip()
        # One space pads the bar; the rest is the content's own indentation.
        body = inner[1:] if inner.startswith(" ") else inner
        if not body.lstrip().startswith(tuple(_BARS)):
            break
        body = body.lstrip()  # a nested panel (rich's locals) inside the frame
    return prefix, body, True


def _rewrite(body: str) -> str:
    """One line from inside a frame, in the words the plain readers know."""
    if m := _RICH_FRAME.match(body):
        return f'  File "{m.group("file")}", line {m.group("line")}, in {m.group("func")}'
    if m := _RICH_FRAME_NO_FILE.match(body):
        return f'  File "", line {m.group("line")}, in {m.group("func")}'
    if "Traceback (most recent call last)" in body:
        return "Traceback (most recent call last):"
    if _SOURCE_LINE.match(body) or not _BOX_CHARS.sub("", body).strip():
        return ""
    return body
