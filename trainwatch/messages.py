"""The messages between trainwatch's own processes, read and written with
`trainwatch.codec`: the sidecar's restart request to the agent
(control/restart-request.json) and the warm-start process's fork protocol
(one JSON object a line)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class RestartRequest:
    """The sidecar's request that the agent restart the worker group
    (control/restart-request.json)."""

    run: str
    """The launcher run it is for: another run's request is ignored."""
    generation: int
    """The worker group it is about: a request that arrives after the agent
    restarted for another reason must not restart again."""
    reason: str = "sidecar request"
    kind: str | None = None
    incident: str | None = None
    """The id of the incident the restart is an action of."""
    time: float = 0.0


@dataclasses.dataclass(slots=True)
class ZygoteReady:
    """The warm-start process is up, with the entry's imports preloaded."""

    pid: int
    preloaded: list[str] = dataclasses.field(default_factory=list)
    import_s: float = 0.0
    cuda_initialized: bool = False
    op: str = "ready"


@dataclasses.dataclass(slots=True)
class ZygoteFork:
    """The agent asks the warm-start process for one worker."""

    id: int
    args: list[str]
    env: dict[str, str]
    cwd: str
    stdout: str | None = None
    stderr: str | None = None
    op: str = "fork"


@dataclasses.dataclass(slots=True)
class ZygoteForked:
    """The answer to a fork: the worker's pid, or why there is none."""

    id: int
    pid: int | None = None
    error: str | None = None
    op: str = "forked"


@dataclasses.dataclass(slots=True)
class ZygoteExit:
    """A forked worker exited (its exit code as os.waitstatus_to_exitcode gives it)."""

    pid: int
    code: int
    op: str = "exit"


ZYGOTE_MESSAGES = {"ready": ZygoteReady, "fork": ZygoteFork, "forked": ZygoteForked, "exit": ZygoteExit}
"""The warm-start protocol's messages by their `op` (one JSON object a line)."""
