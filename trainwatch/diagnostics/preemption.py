"""A preemption, as job.json's `preempted` record has it: which signal, whether
the checkpoint written for it was saved, at which step. The launcher writes it
while it stops the job; the next run of the same job clears it. `diagnose`,
`jobs`, the report and the metrics all read it through `of_job`, so they say
the same thing.

Pure logic: a job.json dict in, a typed record (or a verdict, or a line) out.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trainwatch import codec
from trainwatch.records import Verdict

RUNBOOK = "preempted"
"""The runbook of a preempted job (not a hang: nothing was stuck)."""


@dataclasses.dataclass(slots=True)
class Preemption:
    """job.json's `preempted`."""

    signal: str = dataclasses.field(metadata=codec.check(max_len=16))
    """The signal's name (SIGTERM, SIGUSR1, ...)."""
    saved: bool = False
    """Whether a rank wrote the preemption checkpoint."""
    step: int | None = dataclasses.field(default=None, metadata=codec.check(min=0))
    """The newest step that checkpoint holds (None: nothing was written)."""
    said: str = dataclasses.field(default="", metadata=codec.check(max_len=2000))
    """What the checkpoint did, in words (the console's line)."""
    seconds: float = dataclasses.field(default=0.0, metadata=codec.check(min=0))
    """How long the checkpoint took (s)."""
    time: float | None = None
    """When the signal came (epoch s)."""
    signals_during: int = dataclasses.field(default=0, metadata=codec.check(min=0))
    """Further stop signals that came while the checkpoint was written (held, not obeyed)."""


def record(signal: str, result: dict, said: str, seconds: float, time: float, signals_during: int = 0) -> dict:
    """job.json's `preempted` from the preemption checkpoint's result
    (`request_emergency_checkpoint`), with the result kept beside it."""
    written = result.get("written") or {}
    step = result.get("step")
    return {"signal": signal, "saved": bool(written), "step": step if isinstance(step, int) else None,
            "said": said, "seconds": round(seconds, 3), "time": time, "signals_during": signals_during,
            "checkpoint": result}


def of_job(job: dict | None) -> Preemption | None:
    """The current run's preemption, or None (not preempted, or cleared by a new run)."""
    value = (job or {}).get("preempted")
    return codec.decode(Preemption, value) if isinstance(value, dict) else None


def line(p: Preemption) -> str:
    """One line: the signal, the checkpoint, the step."""
    ckpt = (f"checkpoint saved at step {p.step}" if p.saved and p.step is not None
            else "checkpoint saved" if p.saved else "no checkpoint saved")
    return f"preempted by {p.signal}: {ckpt}"


def verdict(p: Preemption, job_name: str) -> Verdict:
    """`diagnose`'s verdict on a preempted job: preempted, not hung."""
    resume = (f"launch it again with --job {job_name} to resume from step {p.step}" if p.saved and p.step is not None
              else f"launch it again with --job {job_name}; it resumes from its own last checkpoint")
    evidence = [p.said] if p.said else []
    if p.signals_during:
        evidence.append(f"{p.signals_during} more stop signal(s) came while the checkpoint was written; "
                        "held until it was done")
    return Verdict("preempted", [], f"job {line(p)}; {resume}", RUNBOOK, 0.95, evidence)
