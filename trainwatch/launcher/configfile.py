"""`trainwatch launch`'s options from a TOML file (`--config FILE`) and from
`TRAINWATCH_*` environment variables.

Every option `trainwatch launch` takes (torchrun's, trainwatch's and the
watchdog's, generated from SidecarConfig) is also a key of the file and an
environment variable: the list is the launch parser itself, nothing here names
an option. The command line beats the environment, which beats the file,
which beats the built-in defaults. The file:

    [launch]                      # torchrun's and trainwatch's options, by their argparse names
    nproc_per_node = 8
    metrics_port = 9400
    [watchdog]                    # SidecarConfig, nested as the dataclasses are
    tick_s = 0.15
    [watchdog.detectors.hang]
    floor_s = 5.0
    [watchdog.actions]
    restart = false

A variable is the flag's name: `--hang-floor-s 5` is `TRAINWATCH_HANG_FLOOR_S=5`,
`--no-restart` is `TRAINWATCH_NO_RESTART=1`. Names the job's processes already
use (`TRAINWATCH_JOB`, `TRAINWATCH_INJECT`: see trainwatch.env) are not
options. `trainwatch launch --print-config` writes the effective configuration
in this format.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, Mapping

from trainwatch import env, flags

CONFIG_ENV = "TRAINWATCH_CONFIG"
"""Path of the config file when `--config` is not given."""
_NOT_OPTIONS = frozenset({"help", "config", "print_config"})
_POSITIONALS = frozenset({"training_script", "training_script_args"})
_RESERVED = frozenset(getattr(env, name) for name in dir(env) if name.isupper())
_TRUE, _FALSE = frozenset({"1", "true", "yes", "on"}), frozenset({"0", "false", "no", "off", ""})


@dataclass(frozen=True, slots=True)
class Setting:
    """One launch option as a config-file key and an environment variable."""

    key: tuple[str, ...]
    """Where it sits in the file: ('launch', 'nproc_per_node'), ('watchdog', 'detectors', 'hang', 'floor_s')."""
    dest: str
    """The parser's destination for it."""
    option: str
    """The long flag ('--hang-floor-s'); the script's name and arguments have none."""
    kind: type
    """bool, int, float, str, or tuple (a list of strings)."""
    flag_value: Any = True
    """For a bool: what giving the flag stores (False for a generated --no-... flag)."""
    generated: flags.Flag | None = None
    """The SidecarConfig field behind a watchdog option."""

    @property
    def env(self) -> str | None:
        if self.dest in _POSITIONALS:
            return None
        name = "TRAINWATCH_" + self.option.lstrip("-").replace("-", "_").upper()
        return None if name in _RESERVED or name == CONFIG_ENV else name

    @property
    def dotted(self) -> str:
        return ".".join(self.key)


def settings(parser: argparse.ArgumentParser, generated: list[flags.Flag]) -> list[Setting]:
    """Every option of the launch parser as a Setting."""
    by_dest = {f.dest: f for f in generated}
    out = []
    for action in parser._actions:
        if action.dest in _NOT_OPTIONS or (not action.option_strings and action.dest not in _POSITIONALS):
            continue
        longs = [o for o in action.option_strings if o.startswith("--")]
        option = next((o for o in longs if "_" not in o), longs[0] if longs else "")
        flag = by_dest.get(action.dest)
        if flag is not None:
            out.append(Setting(key=("watchdog", *flag.path), dest=action.dest, option=flag.option, kind=flag.kind,
                               flag_value=not flag.default if flag.kind is bool else True, generated=flag))
            continue
        if action.nargs == 0:
            kind = bool
        elif isinstance(action, argparse._AppendAction) or action.nargs == argparse.REMAINDER \
                or getattr(action.type, "__name__", "") == "comma_separated_list":
            kind = tuple
        else:
            kind = action.type if action.type in (int, float) else str
        out.append(Setting(key=("launch", action.dest), dest=action.dest, option=option, kind=kind,
                           flag_value=action.const if action.nargs == 0 and action.const is not None else True))
    return out


def layered_defaults(table: list[Setting], path: str | None,
                     environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """Parser defaults from the file (None: no file), then the environment over
    it; the command line parsed with them beats both. ValueError on one line
    naming the file key or the variable."""
    values: dict[str, Any] = {}
    if path:
        for setting, raw in _file_items(path, table):
            if setting.key[0] == "launch" and "PET_" + setting.dest.upper() in environ:
                continue  # torchrun's own variable is the environment: it beats the file
            try:
                values[setting.dest] = _from_file(setting, raw)
            except ValueError as e:
                raise ValueError(f"{path}: {setting.dotted}: {e}") from None
    for setting in table:
        name = setting.env
        if name and name in environ:
            try:
                values[setting.dest] = _from_env(setting, environ[name])
            except ValueError as e:
                raise ValueError(f"{name}={environ[name]!r}: {e}") from None
    return values


def prescan_value(path: str | None, dest: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """A [launch] key from the environment or the file, read without the parser
    (which imports torch); None when neither gives it. The command line is the
    caller's to check first."""
    name = "TRAINWATCH_" + dest.upper()
    if name in environ and name not in _RESERVED:
        return environ[name]
    if "PET_" + dest.upper() in environ:
        return environ["PET_" + dest.upper()]
    if not path:
        return None
    launch = flags.read_toml(path).get("launch")
    value = launch.get(dest) if isinstance(launch, dict) else None
    return None if value is None or isinstance(value, (dict, list, bool)) else str(value)


def effective(table: list[Setting], args: argparse.Namespace, sidecar: Any) -> str:
    """The configuration a launch would run with, as a config file."""
    tree: dict[str, Any] = {"launch": {}, "watchdog": {}}
    comments = {}
    for setting in table:
        if setting.generated is not None:
            value: Any = sidecar
            for name in setting.generated.path:
                value = getattr(value, name)
            value = flags.to_json(value)
        else:
            value = getattr(args, setting.dest, None)
            value = list(value) if isinstance(value, (list, tuple)) else value
        node = tree
        for name in setting.key[:-1]:
            node = node.setdefault(name, {})
        node[setting.key[-1]] = value
        spelled = [setting.option] if setting.option else []
        comments[setting.dotted] = " / ".join(spelled + ([setting.env] if setting.env else [])) or "the script"
    header = "# trainwatch launch --config FILE: command line > TRAINWATCH_* environment > this file\n"
    return header + flags.to_toml(tree, comments)


def _file_items(path: str, table: list[Setting]) -> list[tuple[Setting, Any]]:
    data = flags.read_toml(path)
    by_key = {s.key: s for s in table}
    sections = {s.key[:i] for s in table for i in range(1, len(s.key))}
    out = []

    def walk(prefix: tuple[str, ...], node: dict) -> None:
        for name, value in node.items():
            key = prefix + (name,)
            if key in by_key:
                out.append((by_key[key], value))
            elif key in sections and isinstance(value, dict):
                walk(key, value)
            else:
                what = "table" if isinstance(value, dict) else "key"
                raise ValueError(f"{path}: unknown {what} {'.'.join(key)!r} (`trainwatch launch --print-config` "
                                 "lists every key)")

    walk((), data)
    return out


def _from_file(setting: Setting, raw: Any) -> Any:
    if setting.generated is not None:
        return flags.parse_value(setting.generated, raw)
    if setting.kind is bool:
        if not isinstance(raw, bool):
            raise ValueError(f"must be true or false; got {raw!r}")
        return raw
    if setting.kind is tuple:
        if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw):
            raise ValueError(f"must be a list of strings; got {raw!r}")
        return list(raw)
    if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
        raise ValueError(f"must be a {'string' if setting.kind is str else 'number'}; got {raw!r}")
    if setting.kind is str:
        return str(raw)
    if setting.kind is int and not isinstance(raw, int):
        raise ValueError(f"must be an integer; got {raw!r}")
    if isinstance(raw, str):
        raise ValueError(f"must be a number, not a string; got {raw!r}")
    return setting.kind(raw)


def _from_env(setting: Setting, raw: str) -> Any:
    if setting.kind is bool:
        word = raw.strip().lower()
        if word not in _TRUE | _FALSE:
            raise ValueError(f"{setting.option} is a switch: set 1 or 0")
        given = word in _TRUE
        return setting.flag_value if given else (not setting.flag_value)
    if setting.generated is not None:
        return flags.parse_value(setting.generated, raw)
    if setting.kind is tuple:
        return [x.strip() for x in raw.split(",") if x.strip()]
    if setting.kind in (int, float):
        try:
            return setting.kind(raw)
        except ValueError:
            raise ValueError(f"{setting.option} must be {'an integer' if setting.kind is int else 'a number'}") \
                from None
    return raw
