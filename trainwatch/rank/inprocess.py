"""In-process recovery: re-form the process group inside the running ranks and
restore their staged state from memory, instead of a process restart.

A collective mismatch (a rank skipped or added a collective) or a collective
that never completes leaves every rank process alive and responsive: only
their process group is unusable. Restarting the processes throws away the
interpreter, the imports, the model in memory and the rendezvous, which is
most of a restart's time. When the sidecar asks (the slot's
`recover_request`), each rank:

1. on its sampler thread, breaks every collective it is in: it aborts its
   NCCL communicators (a kernel waiting for a peer exits, and every later
   NCCL call fails) and shuts down the process group's connections to its
   peers (gloo pairs; not the rendezvous store), so a collective blocked in
   C++ returns with an error at once, and the next one fails at once;
2. on its training thread, where that error arrives, destroys the process
   group and creates it again under a new store prefix (bounded by
   `REFORM_TIMEOUT_S`: a rank that cannot join means a process restart);
3. agrees with its peers on the newest step all of them staged (the
   emergency checkpointer's double buffer holds the last two), restores it
   from memory, and tells the sidecar (`recover_done`, `recover_step`).

A step that ends after the request was seen is never staged nor counted: on a
GPU, an aborted NCCL kernel returns early and leaves that step's gradients
incomplete (`InProcessRecovery.breaking`).

The trainer (trainwatch.trainer.train) drives steps 2 and 3; a script can do
the same with `InProcessRecovery.recover`. Anything that fails on the way
raises `RecoveryFailed`: the rank then waits to be restarted by the sidecar's
fallback (a process restart, the incident's next action).
"""

from __future__ import annotations

import datetime
import os
import socket
import stat
import sys
import threading
import time
from typing import Any, Callable

from trainwatch.lines import print_line

POLL_S = 0.02
"""Seconds between the sampler thread's looks at the recovery request between its rounds."""
REFORM_TIMEOUT_S = 10.0
"""How long re-forming the process group may take before the rank gives up (s)."""
FALLBACK_WAIT_S = 60.0
"""How long a rank whose recovery failed waits for the sidecar's process restart (s)."""


class RecoveryFailed(RuntimeError):
    """In-process recovery did not work: the rank needs a process restart."""


class RecoveryUnderWay(RuntimeError):
    """Raised by a training loop whose step ended after recovery was asked for (see breaking())."""


def cut_collective_connections(keep_ports: set[int]) -> int:
    """Shut down this process's connected TCP sockets except those to or from
    `keep_ports` (the rendezvous store): the process group's connections to
    its peers. Returns how many were cut. The sockets stay open (their owner
    closes them); a shutdown only ends the connection, so a blocked receive
    returns with an error at once."""
    cut = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = int(name)
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except (OSError, ValueError):
            continue
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                continue
            local = sock.getsockname()[1]
            try:
                peer = sock.getpeername()[1]
            except OSError:
                continue  # listening or unconnected
            if local in keep_ports or peer in keep_ports:
                continue
            sock.shutdown(socket.SHUT_RDWR)
            cut += 1
        except OSError:
            pass
        finally:
            sock.close()
    return cut


def abort_nccl_groups() -> int:
    """Abort the NCCL communicators of every process group of this process (torch's
    ProcessGroupNCCL.abort, under one NCCL group call as torch's own abort of the world
    does, so that aborting one communicator cannot wait on another). Returns how many
    were aborted; 0 without torch, without a group, or where the private API differs."""
    torch = sys.modules.get("torch")
    if torch is None:
        return 0
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        if not (dist.is_available() and dist.is_initialized() and dist.is_nccl_available()):
            return 0
        nccl_type = dist.ProcessGroupNCCL
        backends = []
        for pg in list(c10d._world.pg_map):
            try:
                backend = pg._get_backend(torch.device("cuda"))
            except RuntimeError:
                continue  # a group without a CUDA backend (gloo only)
            if isinstance(backend, nccl_type):
                backends.append(backend)
    except Exception:  # a torch whose private layout differs: the process restart covers it
        return 0
    if not backends:
        return 0
    grouped = hasattr(backends[0], "_group_start") and hasattr(backends[0], "_group_end")
    aborted = 0
    try:
        if grouped:
            backends[0]._group_start()
        for backend in backends:
            try:
                backend.abort()
                aborted += 1
            except Exception:
                pass
    finally:
        if grouped:
            try:
                backends[0]._group_end()
            except Exception:
                pass
    return aborted


def break_collectives(keep_ports: set[int]) -> int:
    """Break every collective this process is in: NCCL communicators aborted, then the
    process group's TCP connections cut (gloo). Returns how many were broken."""
    return abort_nccl_groups() + cut_collective_connections(keep_ports)


class InProcessRecovery:
    """One rank's side of in-process recovery (see the module docstring)."""

    def __init__(self, writer: Any, *, store_ports: set[int], rank: int):
        self.writer = writer
        self.store_ports = set(store_ports)
        self.rank = rank
        self._seen = writer.read_recover_request()  # a request from before this process is not ours
        self.pending = 0
        """The request id being served (0: none)."""
        self.cut_at: float | None = None
        self._lock = threading.Lock()
        writer.set_recover_ready(True)

    # ---- sampler thread ---------------------------------------------------------------

    def poll(self) -> None:
        """Called by the sampler thread every round: a new request breaks the collectives."""
        request = self.writer.read_recover_request()
        if request == 0 or request == self._seen:
            return
        with self._lock:  # held through the cut: recover() never re-forms while a cut is under way
            if request == self._seen:
                return
            self._seen = request
            self.pending = request
            self.cut_at = time.monotonic()
            break_collectives(self.store_ports)

    def wait_round(self, stop: threading.Event, interval_s: float) -> bool:
        """The sampler's wait for its next round (True when stopping), looking at the request
        word every POLL_S meanwhile (one memory read): a request is served within that, not
        within a round."""
        deadline = time.monotonic() + interval_s
        while (left := deadline - time.monotonic()) > 0:
            if stop.wait(min(POLL_S, left)):
                return True
            try:
                self.poll()
            except Exception:  # the round's own poll tries again; the heartbeat must go on
                pass
        return stop.is_set()

    # ---- training thread --------------------------------------------------------------

    def breaking(self) -> bool:
        """Whether a recovery was asked for and not yet served: the step that just ended
        may have run on broken collectives (an aborted NCCL kernel returns early), so it
        must not be staged nor counted; the caller raises into recovery instead."""
        return bool(self.pending)  # set by the sampler before it breaks anything

    def wanted(self, error: BaseException | None = None) -> bool:
        """Whether an error on the training thread is the recovery the sidecar asked for."""
        if self.pending:
            return True
        # The error may reach the training thread before the sampler round that
        # cut the connections has recorded the request (a peer cut first).
        if error is not None and self.writer.read_recover_request() not in (0, self._seen):
            self.poll()
            return True
        return False

    def recover(self, reform: Callable[[str], None], staged_steps: Callable[[], list[int]],
                restore: Callable[[int], None]) -> int:
        """Re-form the process group (reform(prefix) creates it under that store
        prefix), agree on the newest step every rank staged, restore it
        (restore(step)); returns that step. Raises RecoveryFailed."""
        import torch
        import torch.distributed as dist

        self.poll()  # the error may come from a peer's cut before this rank's sampler saw the request
        with self._lock:
            request = self.pending
        if not request:
            raise RecoveryFailed("no in-process recovery was asked for")
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
            reform(f"trainwatch/in-process/{request}")
            mine = [s for s in staged_steps() if s >= 0]
            # NCCL gathers device tensors only.
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
            have = torch.tensor(sorted(mine, reverse=True)[:2] + [-1] * (2 - len(mine[:2])), dtype=torch.int64,
                                device=device)
            world = dist.get_world_size()
            gathered = [torch.empty_like(have) for _ in range(world)]
            dist.all_gather(gathered, have)
            common = set.intersection(*({int(v) for v in g.tolist() if v >= 0} for g in gathered))
            if not common:
                raise RecoveryFailed("no step staged on every rank")
            step = max(common)
            restore(step)
        except RecoveryFailed:
            raise
        except Exception as e:  # a peer that never joins, a store that went away, a state that does not fit
            raise RecoveryFailed(f"{type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
        self.writer.write_recover_done(request, step)
        with self._lock:
            if self.pending == request:
                self.pending = 0
        return step

    def wait_for_restart(self, why: str) -> None:
        """Recovery failed: say so and wait (bounded) for the sidecar's process restart."""
        print_line(f"[trainwatch] rank {self.rank}: in-process recovery failed ({why}); waiting for a process restart")
        time.sleep(FALLBACK_WAIT_S)
        raise RecoveryFailed(why)


def reform_group(backend: str, rank: int, world_size: int, base_store: Any,
                 timeout_s: float = REFORM_TIMEOUT_S) -> Callable[[str], None]:
    """A reform() for InProcessRecovery.recover: the default group again, on the same
    backend (gloo, or NCCL on the rank's current GPU), under a new prefix of the job's store."""

    def reform(prefix: str) -> None:
        import torch.distributed as dist

        dist.init_process_group(backend, store=dist.PrefixStore(prefix, base_store), rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))

    return reform


def reform_gloo(rank: int, world_size: int, base_store: Any,
                timeout_s: float = REFORM_TIMEOUT_S) -> Callable[[str], None]:
    """reform_group on gloo."""
    return reform_group("gloo", rank, world_size, base_store, timeout_s)


def store_ports(environ: dict[str, str] | None = None) -> set[int]:
    """Ports of the rendezvous stores this rank talks to (never cut)."""
    env = os.environ if environ is None else environ
    out = set()
    for key in ("MASTER_PORT", "TORCHELASTIC_MASTER_PORT"):
        try:
            out.add(int(env.get(key, "")))
        except ValueError:
            pass
    return out
