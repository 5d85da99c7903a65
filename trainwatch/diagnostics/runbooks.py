"""Runbooks: one markdown file per failure pattern, shipped inside the package.

Verdicts, stack groups and `trainwatch explain` findings name a runbook id;
`trainwatch runbook ID` prints the file. Files live in trainwatch/runbooks/ and
are read through importlib.resources so an installed wheel finds them too.

Every runbook starts with `# Title` and has the sections Symptoms, Confirm,
Likely causes and Fix.
"""

from __future__ import annotations

import re
from importlib import resources
from importlib.abc import Traversable

from trainwatch import kinds

PRODUCT_RUNBOOKS = (
    *dict.fromkeys(k.runbook for k in kinds.KINDS.values()),  # every incident kind's
    "collective-timeout",
    "heartbeat-timeout",
    "watchdog-stuck",
    "nccl-error",
    "cuda-error",
    "illegal-memory-access",
    "gpu-utilisation",
    "oom",
    "child-failed",
    "python-exception",
    "dataloader-worker-killed",
    "healthy",
    "stopped",
    "preempted",
    "starting",
    "finished",
    "restart-loop",
    "exporter-down",
    "nccl-env-overrides",
    "gpu-visibility",
    "process-limits",
)
"""Runbook ids that incident kinds, verdicts and the doctor's checks outside the stack catalog refer to."""

SECTIONS = ("Symptoms", "Confirm", "Likely causes", "Fix")
"""Second-level headings every runbook has, in this order."""

_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")


def _directory() -> Traversable:
    return resources.files("trainwatch").joinpath("runbooks")


def _known_ids() -> list[str]:
    return sorted(p.name[:-3] for p in _directory().iterdir() if p.name.endswith(".md"))


def runbook_path(runbook_id: str) -> Traversable:
    """Where the runbook lives (a Traversable; a real Path for normal installs).

    ValueError, naming the known ids, for an id with no runbook.
    """
    path = _directory().joinpath(f"{runbook_id}.md") if _ID.match(runbook_id or "") else None
    if path is None or not path.is_file():
        raise ValueError(f"no runbook {runbook_id!r}; known runbooks: {', '.join(_known_ids())}")
    return path


def get_runbook(runbook_id: str) -> str:
    """The markdown text of one runbook; ValueError naming the known ids if it does not exist."""
    return runbook_path(runbook_id).read_text(encoding="utf-8")


def runbook_title(text: str) -> str:
    """The `# Title` on the first line of a runbook ('' if the first line is not a title)."""
    first = text.split("\n", 1)[0].strip()
    return first[2:].strip() if first.startswith("# ") else ""


def list_runbooks() -> list[tuple[str, str]]:
    """(id, title) of every shipped runbook, sorted by id."""
    return [(rid, runbook_title(get_runbook(rid))) for rid in _known_ids()]
