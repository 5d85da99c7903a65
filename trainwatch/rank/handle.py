"""The process-wide telemetry handle: `trainwatch.init()` attaches the process to
its slot in the job's segment when `trainwatch launch` started it (and makes it
die with the launcher), or returns a handle that records nothing."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
from typing import Any

from trainwatch import env, procctl, slots
from trainwatch.inject.faults import armed_faults
from trainwatch.rank import collectives, store
from trainwatch.rank.telemetry import Telemetry, _Anonymous

log = logging.getLogger("trainwatch")

_instance: Telemetry | None = None
_instance_lock = threading.Lock()


def init() -> Telemetry:
    """Return this process's telemetry handle, attaching to the job's slot segment
    when started by `trainwatch launch` (TRAINWATCH_SLOTS is set)."""
    global _instance
    with _instance_lock:
        if _instance is not None:
            return _instance
        rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        restart = int(os.environ.get(env.GENERATION) or os.environ.get(env.RESTART_COUNT, "0"))
        path = os.environ.get(env.SLOTS)
        segment: Any = None
        if path:
            try:
                segment = slots.Segment(path)
                if local_rank >= segment.nslots:
                    log.warning("trainwatch: local rank %d has no slot in %s; telemetry off", local_rank, path)
                    segment = None
            except (OSError, ValueError) as e:
                log.warning("trainwatch: cannot open telemetry segment %s (%s); telemetry off", path, e)
                segment = None
        if segment is None:
            tw = Telemetry(_Anonymous(), 0, rank=rank, world_size=world, restart=restart, attached=False)
        else:
            # After a restart, faults that already fired stay fired (see inject.faults).
            faults = armed_faults(os.environ.get(env.INJECT), rank, restart)
            # Launched by trainwatch: never outlive the launcher (a SIGKILLed
            # launcher would leave ranks training, unwatched, forever).
            parent = os.environ.get(env.PARENT_PID) or os.environ.get(env.LAUNCHER_PID, "")
            procctl.die_with_parent(signal.SIGKILL, int(parent) if parent.isdigit() else None)
            # Past a file-size limit (ulimit -f) a write should fail with EFBIG,
            # which the checkpoint code reports, not kill the rank with SIGXFSZ.
            try:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            except ValueError:
                pass  # init() outside the main thread: signals are not ours to set
            tw = Telemetry(segment, local_rank, rank=rank, world_size=world, restart=restart, attached=True,
                           faults=faults)
            collectives.install(tw)
            store.install()
            tw.start_sampler()
            atexit.register(tw.close)
        _instance = tw
        return tw


