"""Fault injection: `trainwatch launch --inject KIND[:key=val,...]`.

Parsed in the launcher (bad specs fail before anything starts), passed to ranks
as JSON in TRAINWATCH_INJECT, and carried out inside the rank process so the
watchdog sees a real fault, not a simulated one.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

KINDS: dict[str, set[str]] = {
    "hang": {"where", "rank", "step", "seconds"},
    "crash": {"rank", "step", "signal", "at"},
    "straggler": {"delay", "rank", "step"},
    "nan": {"rank", "step"},
    "spike": {"rank", "step", "factor"},
    "xid": {"code", "rank", "step"},
    "ecc": {"rank", "step"},
}
HANG_WHERE = ("collective_skip", "gc", "dataloader", "checkpoint", "compute")
CRASH_AT = ("forward", "emergency_write")


class InjectError(ValueError):
    pass


@dataclass(slots=True)
class FaultSpec:
    kind: str
    rank: int = 1
    step: int = 5
    params: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def parse(spec: str) -> FaultSpec:
    kind, _, rest = spec.partition(":")
    kind = kind.strip()
    if kind not in KINDS:
        raise InjectError(f"--inject: unknown kind {kind!r}; valid kinds: {', '.join(sorted(KINDS))}")
    fault = FaultSpec(kind)
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise InjectError(f"--inject {spec!r}: expected key=value, got {item!r}")
        if key not in KINDS[kind]:
            raise InjectError(f"--inject {kind}: unknown key {key!r}; valid keys: {', '.join(sorted(KINDS[kind]))}")
        if key in ("rank", "step"):
            try:
                setattr(fault, key, int(value))
            except ValueError:
                raise InjectError(f"--inject {kind}: {key} must be an integer, got {value!r}") from None
        else:
            fault.params[key] = value
    if kind == "hang":
        where = fault.params.setdefault("where", "compute")
        if where not in HANG_WHERE:
            raise InjectError(f"--inject hang: unknown where={where!r}; valid: {', '.join(HANG_WHERE)}")
    if kind == "crash" and fault.params.setdefault("at", "forward") not in CRASH_AT:
        raise InjectError(f"--inject crash: unknown at={fault.params['at']!r}; valid: {', '.join(CRASH_AT)}")
    for key in ("delay", "seconds", "factor"):
        if key in fault.params:
            try:
                fault.params[key] = float(fault.params[key])
            except ValueError:
                raise InjectError(f"--inject {kind}: {key} must be a number, got {fault.params[key]!r}") from None
    if "code" in fault.params:
        try:
            fault.params["code"] = int(fault.params["code"])
        except ValueError:
            raise InjectError(f"--inject {kind}: code must be an integer, got {fault.params['code']!r}") from None
    return fault


def encode(faults: list[FaultSpec]) -> str:
    return json.dumps([f.to_json() for f in faults])


def decode(text: str | None) -> list[FaultSpec]:
    if not text:
        return []
    return [FaultSpec(**d) for d in json.loads(text)]


def install(tw) -> None:
    """Arm this rank's faults (from TRAINWATCH_INJECT) on its telemetry handle."""
    faults = [f for f in decode(os.environ.get("TRAINWATCH_INJECT")) if f.rank == tw.rank]
    if not faults:
        return
    # Faults fire on the first run only: a restarted job must be able to recover.
    if tw.restart > 0:
        return
    from trainwatch.watchdog import faults as _faults

    tw.faults = _faults.arm(tw, faults)
