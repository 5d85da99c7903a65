"""Fault injection: `trainwatch launch --inject KIND[:key=val,...]`.

Parsed in the launcher (bad specs fail before anything starts), passed to ranks
as JSON in TRAINWATCH_INJECT, and carried out inside the rank process so the
watchdog sees a real fault, not a simulated one.
"""

from __future__ import annotations

import json
import math
import signal
from dataclasses import asdict, dataclass, field

KINDS: dict[str, set[str]] = {
    "hang": {"where", "rank", "step", "seconds"},
    "crash": {"rank", "step", "signal", "at", "code"},
    # The process stays but never runs again: SIGSTOP (state T), or its main
    # thread ends while its other threads live on (a zombie leader, state Z).
    "stop": {"rank", "step"},
    "zombie": {"rank", "step"},
    "straggler": {"delay", "rank", "step"},
    "nan": {"rank", "step"},
    "spike": {"rank", "step", "factor"},
    "xid": {"code", "rank", "step"},
    "ecc": {"rank", "step"},
    # Training-health faults: the rank trains on, badly (trainwatch.inject.faults).
    "lr": {"value", "rank", "step"},
    "dead_grad": {"rank", "step"},
    "scale_collapse": {"rank", "step"},
    "loss_rise": {"rate", "rank", "step"},
    "slow_step": {"where", "delay", "every", "rank", "step"},
}
HANG_WHERE = ("collective_skip", "gc", "dataloader", "checkpoint", "compute")
SLOW_WHERE = ("data", "backward", "optimizer")
DEFAULTS: dict[str, dict] = {
    "lr": {"value": 0.0},
    "loss_rise": {"rate": 0.02},
    "slow_step": {"where": "data", "delay": 1.0, "every": 0},
}
"""Parameters a kind takes when the spec leaves them out."""
CRASH_AT = ("forward", "emergency_write", "checkpoint")
HARDWARE_KINDS = frozenset({"xid", "ecc"})
"""Faults the sidecar injects (a fake NVML, kernel-log lines), not the ranks."""


def signal_number(name: str) -> int:
    """'KILL', 'SIGKILL', 'kill' or '9' as a signal number; ValueError otherwise."""
    text = name.strip().upper()
    if text.isdigit():
        return signal.Signals(int(text)).value
    try:
        return signal.Signals[text if text.startswith("SIG") else f"SIG{text}"].value
    except KeyError:
        raise ValueError(name) from None


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
            if getattr(fault, key) < (0 if key == "rank" else 1):
                raise InjectError(f"--inject {kind}: {key} must be {'>= 0' if key == 'rank' else '>= 1'}, got {value}")
        else:
            fault.params[key] = value
    if kind == "hang":
        where = fault.params.setdefault("where", "compute")
        if where not in HANG_WHERE:
            raise InjectError(f"--inject hang: unknown where={where!r}; valid: {', '.join(HANG_WHERE)}")
    if kind == "slow_step" and fault.params.get("where", "data") not in SLOW_WHERE:
        raise InjectError(f"--inject slow_step: unknown where={fault.params['where']!r}; "
                          f"valid: {', '.join(SLOW_WHERE)}")
    if kind == "crash" and fault.params.setdefault("at", "forward") not in CRASH_AT:
        raise InjectError(f"--inject crash: unknown at={fault.params['at']!r}; valid: {', '.join(CRASH_AT)}")
    if kind == "crash" and "code" in fault.params:
        try:
            fault.params["code"] = int(fault.params["code"])
        except ValueError:
            raise InjectError(f"--inject crash: code must be an exit code (an integer), got {fault.params['code']!r}") \
                from None
        if "signal" in fault.params:
            raise InjectError("--inject crash: give signal= (killed) or code= (exited), not both")
    if kind == "crash" and "signal" in fault.params:
        try:
            signal_number(str(fault.params["signal"]))
        except ValueError:
            raise InjectError(f"--inject crash: unknown signal {fault.params['signal']!r}; "
                              "use a name like KILL, SEGV, ABRT, TERM or a number") from None
    for key in ("delay", "seconds", "factor", "value", "rate"):
        if key in fault.params:
            try:
                fault.params[key] = float(fault.params[key])
            except ValueError:
                raise InjectError(f"--inject {kind}: {key} must be a number, got {fault.params[key]!r}") from None
            if not math.isfinite(fault.params[key]) or fault.params[key] < 0:
                raise InjectError(f"--inject {kind}: {key} must be a finite number >= 0, got {fault.params[key]}")
    if fault.params.get("rate") == 0:
        raise InjectError(f"--inject {kind}: rate must be greater than 0, got 0")
    if "every" in fault.params:
        try:
            fault.params["every"] = int(fault.params["every"])
        except ValueError:
            raise InjectError(f"--inject {kind}: every must be an integer, got {fault.params['every']!r}") from None
        if fault.params["every"] < 0:
            raise InjectError(f"--inject {kind}: every must be >= 0 (0: once), got {fault.params['every']}")
    for key, value in DEFAULTS.get(kind, {}).items():
        fault.params.setdefault(key, value)
    if "code" in fault.params:
        try:
            fault.params["code"] = int(fault.params["code"])
        except ValueError:
            raise InjectError(f"--inject {kind}: code must be an integer, got {fault.params['code']!r}") from None
        if not 1 <= fault.params["code"] <= 999:
            raise InjectError(f"--inject {kind}: code must be an Xid number 1..999, got {fault.params['code']}")
    return fault


def check_ranks(faults: list[FaultSpec], world_size: int | None) -> None:
    """A fault aimed at a rank the job does not have would silently never fire."""
    for f in faults:
        if world_size is not None and f.rank >= world_size:
            raise InjectError(f"--inject {f.kind}: rank={f.rank} but the job has {world_size} rank(s) "
                              f"(0..{world_size - 1})")


def encode(faults: list[FaultSpec]) -> str:
    return json.dumps([f.to_json() for f in faults])


def decode(text: str | None) -> list[FaultSpec]:
    """The launcher's encoding back into specs; ValueError/TypeError on anything else."""
    if not text:
        return []
    items = json.loads(text)
    if not isinstance(items, list):
        raise ValueError("not a list of fault specs")
    return [FaultSpec(**d) for d in items]
