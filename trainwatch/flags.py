"""Command-line flags generated from config dataclasses, so every setting is
stated once: its field (name, type, default) and the docstring under it.

Used by the integrated trainer (`python -m trainwatch.trainer`) and by
`trainwatch launch` for the watchdog's settings (`--hang-floor-s`,
`--no-live-counts`, ...). Nested config dataclasses become sections whose
flags carry the section's prefix.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import math
import os
import stat
import textwrap
import typing
from dataclasses import dataclass
from typing import Any, Callable


def field_docs(cls: type) -> dict[str, str]:
    """The one-line docstrings under a dataclass's fields, by field name.

    Read from the source so the field docstrings are the single description of
    each setting; without source (a stripped install) the help is just shorter.
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def flag(name: str) -> str:
    """Command-line spelling of a config field: max_steps -> max-steps."""
    return name.replace("_", "-")


@dataclass(frozen=True, slots=True)
class Range:
    """Where a numeric setting's value may lie: from `low` to `high`, each end
    included unless open. Every numeric setting is finite."""

    low: float = 0.0
    high: float = math.inf
    low_open: bool = False
    """True: the value must be above `low` (a period of 0 would be a busy loop)."""
    high_open: bool = False

    def holds(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        low = f"{'>' if self.low_open else '>='} {self.low:g}"
        if self.high == math.inf:
            return low
        return f"{low} and {'<' if self.high_open else '<='} {self.high:g}"

    def problem(self, option: str, kind: type, raw: Any) -> str:
        """The one line saying what `option` takes."""
        return f"{option} must be {'an integer' if kind is int else 'a finite number'} {self}; got {raw!r}"


NON_NEGATIVE = Range()
"""A setting's range unless its config declares another."""


def check_ranges(config: Any, ranges: dict[str, Range], option: Callable[[str], str]) -> None:
    """ValueError naming the flag (`option(dotted path)`) of the first setting
    of `config` outside its range in `ranges` (dotted path -> Range)."""
    for dotted, rng in ranges.items():
        value: Any = config
        for name in dotted.split("."):
            value = getattr(value, name)
        kind = int if is_int(value) else float
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not rng.holds(value):
            raise ValueError(rng.problem(option(dotted), kind, value))


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class Flag:
    """One generated flag: where its value goes in the config, how it is spelled."""

    path: tuple[str, ...]
    """Attribute path in the root config, e.g. ('detectors', 'hang', 'floor_s')."""
    option: str
    """The flag, e.g. '--hang-floor-s' or '--no-live-counts'."""
    kind: type
    """bool, int, float, str, or tuple (a comma-separated list of names)."""
    default: Any
    help: str
    range: Range | None = None
    """Where a number may lie; None: NON_NEGATIVE."""

    @property
    def dest(self) -> str:
        return "cfg__" + "__".join(self.path)


def config_flags(cls: type, prefixes: dict[tuple[str, ...], str], *, path: tuple[str, ...] = (),
                 ranges: dict[str, Range] | None = None) -> list[Flag]:
    """Flags for every field of `cls`, recursing into nested config dataclasses.
    `prefixes` maps a section's path to its flag prefix ('hang-'); `ranges` a
    numeric field's dotted path to its Range; fields with metadata {"flag":
    False} are left out. A boolean that defaults to True is spelled --no-<name>."""
    ranges = ranges or {}
    out: list[Flag] = []
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    instance = cls()
    for f in dataclasses.fields(cls):
        if f.metadata.get("flag") is False:
            continue
        sub = path + (f.name,)
        kind = _kind(hints[f.name])
        default = getattr(instance, f.name)
        if dataclasses.is_dataclass(kind):
            out += config_flags(kind, prefixes, path=sub, ranges=ranges)
            continue
        prefix = prefixes.get(path, "")
        name = flag(prefix + f.name)
        if kind is bool and default is True:
            name = "no-" + name
        help_text = docs.get(f.name, "").replace("%", "%%")
        if kind is bool and default is True:
            # The field's docstring says what the setting does when on; its
            # flag turns it off, so the help says so.
            help_text = "Do not " + help_text[:1].lower() + help_text[1:] + " (on by default)"
        if kind is not bool:
            shown = ",".join(sorted(default)) if kind is tuple else default
            help_text += f" (default: {shown})"
        out.append(Flag(sub, "--" + name, kind, default, help_text, ranges.get(".".join(sub))))
    return out


def add_flags(group: Any, flags: list[Flag], aliases: dict[str, str] | None = None) -> None:
    """Add the flags to an argparse parser or group; `aliases` maps an option to
    extra spellings (kept for older command lines)."""
    aliases = aliases or {}
    for f in flags:
        names = [f.option, *([aliases[f.option]] if f.option in aliases else [])]
        if f.kind is bool:
            group.add_argument(*names, dest=f.dest, action="store_const", const=not f.default, default=None,
                               help=f.help)
        else:
            metavar = "NAME,..." if f.kind is tuple else f.path[-1].upper()
            group.add_argument(*names, dest=f.dest, default=None, metavar=metavar, help=f.help)


def apply_flags(config: Any, flags: list[Flag], namespace: argparse.Namespace) -> Any:
    """A copy of `config` with every flag given on the command line applied;
    ValueError naming the flag for a value that is not a finite, non-negative
    number (or a list of names)."""
    config = _copy(config)
    for f in flags:
        raw = getattr(namespace, f.dest, None)
        if raw is None:
            continue
        value = raw if f.kind is bool else _parse(f, raw)
        target = config
        for name in f.path[:-1]:
            target = getattr(target, name)
        current = getattr(target, f.path[-1])
        if isinstance(current, frozenset):
            value = frozenset(value)
        setattr(target, f.path[-1], value)
    _validate(config)
    return config


def _validate(config: Any) -> None:
    """Run each nested config's own checks (__post_init__) on the final values."""
    if not dataclasses.is_dataclass(config):
        return
    for f in dataclasses.fields(config):
        _validate(getattr(config, f.name))
    check = getattr(config, "__post_init__", None)
    if check is not None:
        check()


def parse_value(f: Flag, raw: Any) -> Any:
    """A flag's value from the command line (a string) or a config file (typed);
    ValueError naming the flag when it is not one."""
    return _parse(f, raw)


def _parse(f: Flag, raw: Any) -> Any:
    if f.kind is tuple:
        if isinstance(raw, (list, tuple, frozenset, set)):
            if not all(isinstance(x, str) for x in raw):
                raise ValueError(f"{f.option} must be a list of names; got {list(raw)!r}")
            return tuple(x.strip() for x in raw if x.strip())
        items = tuple(x.strip() for x in str(raw).split(",") if x.strip())
        return items
    if f.kind is bool:
        if not isinstance(raw, bool):
            raise ValueError(f"{f.option} must be true or false; got {raw!r}")
        return raw
    if isinstance(raw, bool) or (f.kind is not str and isinstance(raw, (list, dict))):
        raise ValueError(f"{f.option} must be {'an integer' if f.kind is int else 'a number'}; got {raw!r}")
    if f.kind is int and isinstance(raw, float):
        raise ValueError(f"{f.option} must be an integer; got {raw!r}")
    try:
        value = f.kind(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{f.option} must be {'an integer' if f.kind is int else 'a number'}; got {raw!r}") from None
    rng = f.range or NON_NEGATIVE
    if isinstance(value, (int, float)) and not rng.holds(value):
        raise ValueError(rng.problem(f.option, f.kind, raw))
    return value


def _kind(annotation: Any) -> type:
    origin = typing.get_origin(annotation)
    if origin in (tuple, frozenset, set, list) or annotation in (tuple, frozenset, set, list):
        return tuple
    if origin is typing.Union or str(origin) == "types.UnionType":
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _kind(args[0]) if args else str
    return annotation if isinstance(annotation, type) else str


def _copy(config: Any) -> Any:
    """Deep copy of nested config dataclasses (their leaves are immutable)."""
    if not dataclasses.is_dataclass(config):
        return config
    return dataclasses.replace(config, **{f.name: _copy(getattr(config, f.name)) for f in dataclasses.fields(config)
                                          if f.init})


def to_json(config: Any) -> Any:
    """A config dataclass as plain JSON values (sets and tuples become sorted/plain lists)."""
    if dataclasses.is_dataclass(config):
        return {f.name: to_json(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, (set, frozenset)):
        return sorted(config)
    if isinstance(config, tuple):
        return list(config)
    return config


def from_json(cls: type, data: Any) -> Any:
    """The inverse of to_json; ValueError for unknown fields or wrong types."""
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__}: expected an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown field(s) {', '.join(sorted(unknown))}")
    values = {}
    for name, raw in data.items():
        kind = _kind(hints[name])
        origin = typing.get_origin(hints[name]) or hints[name]
        if dataclasses.is_dataclass(kind):
            values[name] = from_json(kind, raw)
        elif kind is tuple:
            if not isinstance(raw, list):
                raise ValueError(f"{cls.__name__}.{name}: expected a list")
            values[name] = frozenset(raw) if origin is frozenset else (list(raw) if origin is list else tuple(raw))
        elif raw is None or kind is str or isinstance(raw, kind) or (kind is float and isinstance(raw, int)):
            values[name] = raw
        else:
            raise ValueError(f"{cls.__name__}.{name}: expected {kind.__name__}, got {type(raw).__name__}")
    return cls(**values)


def read_toml(path: str) -> dict:
    """A TOML file's tables; ValueError on one line naming the file and what is wrong.
    Python 3.11 reads TOML itself; 3.10 needs the `tomli` package."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise ValueError(f"{path}: reading a TOML config file on Python 3.10 needs `pip install tomli`") from None
    data = _read_config_bytes(path)
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}); a TOML config file is UTF-8") from None
    except RecursionError:
        raise ValueError(f"{path}: not a config file (nested too deep)") from None
    except tomllib.TOMLDecodeError as e:
        reason = " ".join(str(e).split())
        raise ValueError(f"{path}: not valid TOML ({reason})") from None


MAX_CONFIG_BYTES = 1 << 20
"""Largest config file read: a full one (`--print-config`) is ~10 KiB."""
_NOT_FILES = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
              (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _read_config_bytes(path: str) -> bytes:
    """At most MAX_CONFIG_BYTES of a regular file: a FIFO, a device or a
    directory is named as such before anything is read from it, so that
    /dev/zero or a pipe nobody writes to never fills memory or blocks."""
    try:
        # O_NONBLOCK: opening a FIFO that has no writer would wait forever.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ValueError(f"{path}: cannot read the config file ({e.strerror or e})") from None
    try:
        mode = os.fstat(fd).st_mode
        what = next((name for test, name in _NOT_FILES if test(mode)), None if stat.S_ISREG(mode) else "not a file")
        if what is not None:
            raise ValueError(f"{path}: is {what}, not a config file; give a regular TOML file")
        chunks, size = [], 0
        while size <= MAX_CONFIG_BYTES:
            chunk = os.read(fd, min(1 << 16, MAX_CONFIG_BYTES + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        raise ValueError(f"{path}: cannot read the config file ({e.strerror or e})") from None
    finally:
        os.close(fd)
    if size > MAX_CONFIG_BYTES:
        raise ValueError(f"{path}: over {MAX_CONFIG_BYTES >> 20} MiB, too large for a config file; "
                         "give the TOML file `trainwatch launch --print-config` writes")
    return b"".join(chunks)


def to_toml(tables: dict, comments: dict[str, str] | None = None) -> str:
    """Nested dicts of str/int/float/bool/list values as TOML; None values are
    written as comments (TOML has no null). `comments` maps a dotted key to the
    line written above it."""
    comments = comments or {}
    lines: list[str] = []

    def emit(prefix: tuple[str, ...], table: dict) -> None:
        scalars = {k: v for k, v in table.items() if not isinstance(v, dict)}
        if prefix and scalars:
            lines.extend(["", f"[{'.'.join(prefix)}]"])
        for key, value in scalars.items():
            dotted = ".".join(prefix + (key,))
            if dotted in comments:
                lines.append(f"# {comments[dotted]}")
            lines.append(f"# {key} = (unset)" if value is None else f"{key} = {_toml_value(value)}")
        for key, value in table.items():
            if isinstance(value, dict):
                emit(prefix + (key,), value)

    emit((), tables)
    return "\n".join(lines).lstrip("\n") + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value) if math.isfinite(value) else ("nan" if value != value else ("inf" if value > 0 else "-inf"))
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value) if isinstance(value, (set, frozenset)) else value
        return "[" + ", ".join(_toml_value(x) for x in items) + "]"
    return '"' + "".join(_toml_char(c) for c in str(value)) + '"'


def _toml_char(c: str) -> str:
    if c in '"\\':
        return "\\" + c
    code = ord(c)
    if code < 0x20 or code == 0x7F:
        return f"\\u{code:04x}"
    return "\ufffd" if 0xD800 <= code <= 0xDFFF else c  # a lone surrogate cannot be written as UTF-8
