"""One validating codec for the typed records trainwatch writes to files and
hands between processes (a rank's failure record, the agent's rank exits, ...).

A record is a dataclass. `encode(record)` gives plain JSON values; `decode(cls,
data)` reads them back and checks every field against its annotation and its
`check(...)` metadata, so that the same declaration says what is written and
what is accepted:

- a required field (no default) that is missing or of the wrong type makes the
  whole record unreadable: `decode` returns None (the reader skips it), or
  raises `CodecError` naming the field with `strict=True`;
- an optional field of the wrong type takes its default;
- items of the wrong type in a list (or a typed dict) are dropped (a culprit
  list `[1, "x", 2]` reads `[1, 2]`); text is cut to its `max_len` with a
  visible note ("… (cut, N chars)"), when written and when read (every
  string inside a free-form field such as an incident's evidence too);
- keys the class does not declare are ignored (a newer writer's additions).

Numbers: `bool` is never an `int` here (JSON's true is not rank 1), floats must
be finite, `check(min=...)` bounds both; `check(one_of=...)` names the only
strings accepted. Enums are written as their value.
Nothing here raises on hostile input except `CodecError` in strict mode.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")

_DROP = object()
"""A value that does not fit its annotation."""


class CodecError(ValueError):
    """A record that does not fit its declaration (strict decoding)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Check:
    """Bounds of one field beyond its type."""

    min: float | None = None
    """Smallest number accepted (numbers)."""
    max_len: int | None = None
    """Longest text kept; longer is cut with a note (strings, and every string inside a list, dict or Any)."""
    one_of: tuple | None = None
    """The only values accepted (strings)."""


def check(*, min: float | None = None, max_len: int | None = None, one_of: tuple | None = None) -> dict:
    """Field metadata: `rank: int = dataclasses.field(metadata=check(min=0))`."""
    return {"codec": Check(min=min, max_len=max_len, one_of=one_of)}


def is_int(value: Any) -> bool:
    """An integer read from JSON (true and false are not numbers)."""
    return isinstance(value, int) and not isinstance(value, bool)


def finite_number(value: Any) -> float | None:
    """value as a finite float, None when it is not a number (or NaN, infinite, too large)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


_PLAIN = frozenset({str, int, float, bool, type(None)})


def cut(text: str, max_len: int) -> str:
    """text, or as much of it as fits in max_len characters with a note saying it was cut."""
    if len(text) <= max_len:
        return text
    note = f"… (cut, {len(text)} chars)"
    if len(note) * 2 > max_len:
        return text[:max_len]  # a short code or name: no room for the note
    return text[:max_len - len(note)] + note


def bound_text(value: Any, max_len: int) -> Any:
    """A JSON value with every string in it (object keys too) cut to max_len."""
    if isinstance(value, str):
        return cut(value, max_len)
    if isinstance(value, list):
        return [bound_text(v, max_len) for v in value]
    if isinstance(value, dict):
        return {cut(str(k), max_len): bound_text(v, max_len) for k, v in value.items()}
    return value


@functools.cache
def _text_bounds(cls: type) -> dict[str, int]:
    """A record's fields that declare a max_len, and it."""
    out = {}
    for f in dataclasses.fields(cls):
        bounds = f.metadata.get("codec")
        if bounds is not None and bounds.max_len is not None:
            out[f.name] = bounds.max_len
    return out


def encode_field(record: Any, name: str) -> Any:
    """One field of a record as plain JSON values, its text cut to the field's max_len."""
    value = encode(getattr(record, name))
    limit = _text_bounds(type(record)).get(name)
    return value if limit is None else bound_text(value, limit)


@functools.cache
def _field_names(cls: type) -> tuple[str, ...] | None:
    """A dataclass's field names (None for other classes), looked up once per class."""
    return tuple(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else None


def encode(value: Any) -> Any:
    """A record (or any value inside one) as plain JSON values."""
    cls = type(value)
    if cls in _PLAIN:
        return value
    names = _field_names(cls)
    if names is not None:
        out = {}
        for name in names:  # plain values inline: a 4096-rank snapshot encodes ~90k fields
            v = getattr(value, name)
            out[name] = v if type(v) in _PLAIN else encode(v)
        for name, limit in _text_bounds(cls).items():
            out[name] = bound_text(out[name], limit)
        return out
    if isinstance(value, enum.Enum):
        return encode(value.value)
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(encode(v) for v in value)
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    return value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def decode(cls: type[T], data: Any, *, strict: bool = False) -> T | None:
    """`data` (parsed JSON) as a `cls`; None (or CodecError when strict) when it does not fit."""
    try:
        return _record(cls, data)
    except CodecError:
        if strict:
            raise
        return None
    except (TypeError, ValueError, RecursionError) as e:  # a record's own __post_init__ refusing it
        if strict:
            raise CodecError(f"{cls.__name__}: {e}") from None
        return None


def decode_line(classes: dict[str, type], line: bytes | str, *, tag: str = "op") -> Any:
    """One JSON line of a protocol whose messages are told apart by `tag`, as
    the record its tag names; None for anything else (not JSON, an unknown
    tag, a message that does not fit)."""
    try:
        data = json.loads(line)
    except (ValueError, RecursionError):
        return None
    cls = classes.get(data.get(tag)) if isinstance(data, dict) and isinstance(data.get(tag), str) else None
    return decode(cls, data) if cls is not None else None


def _record(cls: type[T], data: Any) -> T:
    if not isinstance(data, dict):
        raise CodecError(f"{cls.__name__}: expected an object, got {type(data).__name__}")
    hints = _hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        bounds = f.metadata.get("codec", Check())
        value = _value(hints[f.name], data[f.name], bounds) if f.name in data else _DROP
        if value is _DROP:
            if required:
                problem = "missing" if f.name not in data else f"not {_describe(hints[f.name])}"
                raise CodecError(f"{cls.__name__}.{f.name}: {problem}")
            continue  # the default
        values[f.name] = value
    return cls(**values)


def _value(annotation: Any, raw: Any, bounds: Check) -> Any:
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return raw if bounds.max_len is None else bound_text(raw, bounds.max_len)
    if origin is typing.Union or origin is types.UnionType:
        options = typing.get_args(annotation)
        if raw is None:
            return None if type(None) in options else _DROP
        for option in options:
            if option is not type(None) and (got := _value(option, raw, bounds)) is not _DROP:
                return got
        return _DROP
    if origin in (list, tuple, frozenset, set):
        if not isinstance(raw, list):
            return _DROP
        args = typing.get_args(annotation)
        item = args[0] if args else Any
        kept = [v for v in (_value(item, x, bounds) for x in raw) if v is not _DROP]
        return kept if origin is list else (tuple(kept) if origin is tuple else origin(kept))
    if origin is dict or annotation is dict:
        if not isinstance(raw, dict):
            return _DROP
        key_t, value_t = typing.get_args(annotation) or (Any, Any)
        key_bounds = Check(max_len=bounds.max_len)
        kept = ((_value(key_t, k, key_bounds), _value(value_t, v, bounds)) for k, v in raw.items())
        return {k: v for k, v in kept if k is not _DROP and v is not _DROP}
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        try:
            return _record(annotation, raw)
        except CodecError:
            return _DROP
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        try:
            return annotation(raw)
        except (ValueError, TypeError):
            return _DROP
    if annotation is bool:
        return raw if isinstance(raw, bool) else _DROP
    if annotation is int:
        if not is_int(raw):
            return _DROP
        return raw if bounds.min is None or raw >= bounds.min else _DROP
    if annotation is float:
        number = finite_number(raw)
        if number is None or (bounds.min is not None and number < bounds.min):
            return _DROP
        return number
    if annotation is str:
        if not isinstance(raw, str) or (bounds.one_of is not None and raw not in bounds.one_of):
            return _DROP
        return cut(raw, bounds.max_len) if bounds.max_len is not None else raw
    return _DROP


def _describe(annotation: Any) -> str:
    name = getattr(annotation, "__name__", None)
    return f"a {name}" if name else f"of type {annotation}"


def jsonable(value: Any) -> Any:
    """Convert numpy scalars/arrays, tuples and sets to plain JSON types.

    Non-finite floats become the strings 'nan'/'inf'/'-inf': a NaN loss is a
    fact worth keeping, and bare NaN is not valid JSON for other readers."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if isinstance(value, bytes):
        return value.rstrip(b"\0").decode("ascii", "replace")
    if hasattr(value, "tolist") and not isinstance(value, (str, int, float, bool)):
        return jsonable(value.tolist())  # numpy scalar or array
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value
