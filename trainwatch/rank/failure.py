"""Why this rank is about to exit, in the job's errors file: the exception's
type, the last line of its message, the user's file:line and the step. The
agent reads it before restarting (trainwatch.launcher.failures): what a
restart cannot fix is not restarted."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from trainwatch import env, state


def record_failure(tw: Any, type_name: str, message: str, where: str | None) -> None:
    """One line for rank `tw` (a Telemetry handle attached to a launched job); nothing otherwise."""
    job, home = os.environ.get(env.JOB), os.environ.get(env.HOME)
    if not job or not home or not tw.attached:
        return
    line = json.dumps({"run": os.environ.get(env.RUN, ""), "generation": tw.restart, "rank": tw.rank,
                       "step": tw.current_step, "stepped": tw.first_step != 0, "type": type_name[:200],
                       "message": message[:1000], "where": (where or "")[:500], "time": time.time()})
    try:
        state.append_line(state.JobDir(job, root=Path(home)).errors_file, line)
    except (OSError, state.StateError):
        pass
