"""The rank-side API: `tw = trainwatch.init()`, `tw.step(...)`, `with tw.phase(...)`.

Everything on the step path is a few struct writes into the rank's mapped slot:
no syscall, no lock, no allocation that outlives the call. Work that costs more
(flight-recorder dumps, heartbeats, emergency checkpoint writes) runs on one
background thread, which also keeps publishing while the training thread is
stuck in a collective (gloo and NCCL waits release the GIL).
"""

from __future__ import annotations

import gc
import json
import logging
import math
import mmap
import os
import threading
import time
import zlib
from typing import Any, Callable

from trainwatch import slots

log = logging.getLogger("trainwatch")

SAMPLE_INTERVAL_S = 0.2
"""Seconds between sampler rounds (heartbeat + flight recorder)."""

_COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_single",  # FSDP2's all-gather (torch >= 2.10)
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",  # FSDP2's reduce-scatter
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
)
# Point-to-point: a rank blocked in one waits on a peer (phase `collective`),
# but ranks issue different ones by design (pipeline stages), so they are
# never part of the counts ranks compare.
_P2P = ("send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list", "recv_object_list")
_ASYNC_P2P = frozenset({"isend", "irecv", "batch_isend_irecv"})


class _Anonymous:
    """A private one-slot segment for processes not started by trainwatch launch,
    so the API costs and behaves the same everywhere."""

    def __init__(self) -> None:
        self._mm = mmap.mmap(-1, slots.HEADER_SIZE + slots.SLOT_SIZE)
        self.buf = memoryview(self._mm)
        self.nslots = 1

    def offset(self, index: int) -> int:
        return slots.HEADER_SIZE


class Telemetry:
    """Per-process telemetry handle. Get it with `trainwatch.init()`."""

    def __init__(self, segment: Any, index: int, *, rank: int, world_size: int, restart: int, attached: bool):
        self.rank = rank
        self.local_rank = index
        self.world_size = world_size
        self.restart = restart
        self.attached = attached
        """True when a trainwatch sidecar reads this slot."""
        self._segment = segment
        self._writer = slots.SlotWriter(
            segment, index, pid=os.getpid(), rank=rank, world_size=world_size, restart=restart
        )
        now = time.monotonic()
        self._start = now
        self._last = now
        self._step = 0
        self._phase = slots.PHASE_CODES["init"]
        self._phase_name = "init"
        self._phase_since = now
        self._wait_s = 0.0
        self._loss = math.nan
        self._grad_norm = math.nan
        self._step_s = math.nan
        self._compute_s = math.nan
        self.py_collectives = 0
        """Python-issued collectives so far, on any process group."""
        self.world_collectives = 0
        """...on process groups spanning every rank: what all ranks must agree on."""
        self.last_py_op = ""
        self._explicit = False
        self._source = slots.STEP_COUNTED
        self._first = 0
        self._seq_fn: Callable[[], int] | None = None
        self._state_fn: Callable[[], dict] | None = None
        self._state_refs: tuple = ()
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None
        self._sample_lock = threading.Lock()
        self._fr = FlightRecorderReader()
        self._hooks: list[Callable[[int], None]] = []
        self.faults: Any = None
        """The faults `--inject` armed in this rank, if any."""
        self._emergency: Any = None
        self._scopes: dict[str, _PhaseScope] = {}
        self._words = segment.buf.cast("Q")
        self._ack_word = (segment.offset(index) + slots.ACK_OFF) // 8
        self._ack = -1
        self._pl, self._pls, self._pg, self._pgs = math.nan, 0, math.nan, 0
        self._publish()

    # ---- step path ----------------------------------------------------------

    @property
    def current_step(self) -> int:
        return self._step

    def step(self, loss: Any = None, grad_norm: Any = None, *, step: int | None = None, compute_s: float | None = None) -> None:
        """Record that a training step finished.

        loss / grad_norm: floats (a tensor is converted with float(), which on
        GPU waits for the device: pass floats you already have if that matters).
        step: the step number just finished; default previous + 1.
        compute_s: this step's compute time; default step time minus time spent
        in phases that wait on peers (backward, collective).
        """
        self._explicit = True
        self._source = slots.STEP_REPORTED
        self._record(loss, grad_norm, step, compute_s)

    def _record(self, loss: Any, grad_norm: Any, step: int | None, compute_s: float | None) -> None:
        # The hot path: plain attribute work and three struct writes.
        now = _monotonic()
        self._step = n = self._step + 1 if step is None else step
        if not self._first:
            self._first = n
        step_s = now - self._last
        self._last = now
        if loss is not None:
            self._loss = loss if loss.__class__ is float else float(loss)
        if grad_norm is not None:
            self._grad_norm = grad_norm if grad_norm.__class__ is float else float(grad_norm)
        self._step_s = step_s
        if compute_s is not None:
            self._compute_s = compute_s
        elif self._wait_s:
            self._compute_s = step_s - self._wait_s if step_s > self._wait_s else 0.0
        self._wait_s = 0.0
        if self._phase == _INIT:
            # A rank that finished a step is past start-up: time outside any
            # phase from now on is plain compute, not the lenient "init".
            self._phase, self._phase_name = _COMPUTE, "compute"
        # Worst values since the sidecar last read the slot (NaN sticks).
        ack = self._words[self._ack_word]
        if ack != self._ack:
            self._ack = ack
            self._pl, self._pls, self._pg, self._pgs = self._loss, n, self._grad_norm, n
        else:
            pk = self._pl
            if pk == pk and not (self._loss <= pk):
                self._pl, self._pls = self._loss, n
            pk = self._pg
            if pk == pk and not (self._grad_norm <= pk):
                self._pg, self._pgs = self._grad_norm, n
        # Exact end-of-step collective counts (Python calls on world-spanning
        # groups; the default group's sequence number, which also counts
        # DDP/FSDP's own collectives): ranks compare them at equal steps.
        seq_fn = self._seq_fn
        self._writer.write_fast(n, self._loss, self._grad_norm, step_s, self._compute_s, now, self._start,
                                self._phase, self._source, self._phase_since, self.py_collectives,
                                self._pl, self._pls, self._pg, self._pgs, self._first,
                                self.world_collectives, seq_fn() if seq_fn is not None else -1)
        if self._hooks:
            for hook in self._hooks:
                hook(n)

    def _publish(self) -> None:
        self._writer.write_step(self._step, self._loss, self._grad_norm, self._step_s, self._compute_s, self._last,
                                self._start, self._phase, self._phase_since, self.py_collectives,
                                step_source=self._source)

    def mark_active(self) -> None:
        """Forward-only progress (an eval forward, a batch fetched): the hang
        detector counts it as progress, so evaluation is not a hang."""
        self._writer.mark_active(_monotonic())

    def count_batch(self) -> None:
        self._writer.count_batch(_monotonic())

    def phase(self, name: str) -> "_PhaseScope":
        """Mark a phase of the step (data, forward, backward, optimizer, checkpoint, eval...):
        `with tw.phase("data"): ...`"""
        scope = self._scopes.get(name)
        if scope is None or scope.active:
            code = slots.PHASE_CODES.get(name)
            if code is None:
                raise ValueError(f"unknown phase {name!r}; use one of {', '.join(slots.PHASES)}")
            scope = _PhaseScope(self, code, name)
            if name not in self._scopes:
                self._scopes[name] = scope
        return scope

    def set_phase(self, name: str) -> None:
        self._set_phase(slots.PHASE_CODES[name], name, _monotonic())

    def _set_phase(self, code: int, name: str, now: float) -> None:
        self._phase, self._phase_name, self._phase_since = code, name, now
        self._writer.write_phase(code, self._source, now, self.py_collectives)

    @property
    def phase_name(self) -> str:
        return self._phase_name

    # ---- state for emergency checkpoints ------------------------------------

    def register_state(
        self,
        model: Any = None,
        optimizer: Any = None,
        *,
        state_fn: Callable[[], dict] | None = None,
        checkpoint_dir: str | None = None,
        keep: int | None = None,
    ) -> None:
        """Name what an emergency checkpoint saves: a model and optimizer, or any
        callable returning a state dict. With checkpoint_dir (and under
        `trainwatch launch`), the state is staged to CPU after every step and
        written there when the watchdog asks, even while this rank is hung."""
        self._state_refs = (model, optimizer)
        self._state_fn = state_fn
        if checkpoint_dir and self.attached and self._emergency is None:
            from trainwatch.trainer.emergency import EmergencyCheckpointer

            self._emergency = EmergencyCheckpointer(self, checkpoint_dir, self.state_dict, keep=keep)
            self._hooks.append(self._emergency.stage)
            self._writer.set_checkpoint_ready()

    def emergency_save(self, reason: str) -> str | None:
        """Write the last staged state now (e.g. a peer died and this rank is exiting)."""
        if self._emergency is None:
            return None
        return self._emergency.write(reason)

    def state_dict(self) -> dict:
        if self._state_fn is not None:
            return self._state_fn()
        model, optimizer = self._state_refs
        out: dict = {"step": self._step}
        if model is not None:
            out["model"] = model.state_dict()
        if optimizer is not None:
            out["optimizer"] = optimizer.state_dict()
        return out

    # ---- fault-injection points (no-ops unless `--inject` armed this rank) ------

    def fault_point(self, where: str) -> None:
        """Called by the trainer at 'data', 'forward', 'checkpoint' and 'step_end';
        an armed fault (hang, crash, delay) really happens here, in this rank."""

    def skip_collective(self) -> bool:
        """True when an injected fault wants this rank to skip its next all_reduce."""
        return False

    def perturb_loss(self, loss: Any) -> Any:
        """Return the loss, or a NaN/spiked copy when such a fault is armed."""
        return loss

    def add_step_hook(self, hook: Callable[[int], None]) -> None:
        """Call hook(step) after every recorded step (fault injection, staging)."""
        self._hooks.append(hook)

    # ---- background sampler ---------------------------------------------------

    def start_sampler(self, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        if self._sampler is not None:
            return
        self._sampler = threading.Thread(target=self._sample_loop, args=(interval_s,), name="trainwatch-sampler", daemon=True)
        self._sampler.start()

    def _sample_loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.sample_now()
                if self._emergency is not None:
                    self._emergency.poll(self._writer)
            except Exception:  # one bad round must not end the heartbeat
                log.debug("trainwatch sampler round failed", exc_info=True)

    def sample_now(self) -> None:
        """One sampler round: heartbeat + collective sequence numbers. The lock
        keeps region B single-writer; it is never taken on the step path."""
        with self._sample_lock:
            # Refreshed every round: the default group may be destroyed and re-created.
            self._seq_fn = _default_group_seq()
            groups = self._fr.sample()
            if groups is None:
                groups = [slots.CollectiveGroup(0, self.py_collectives, self.py_collectives, self.last_py_op)]
            self._writer.write_sampler(time.monotonic(), self._fr.available, self._step, groups, time.process_time(),
                                       _io_bytes())

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join(timeout=2)
        self._set_phase(slots.PHASE_CODES["done"], "done", time.monotonic())


def _io_bytes() -> int:
    """Bytes this process read and wrote through syscalls (/proc/self/io rchar +
    wchar): a checkpoint being written moves it, a write blocked forever does not."""
    try:
        with open("/proc/self/io", "rb") as f:
            total = 0
            for line in f:
                if line.startswith((b"rchar:", b"wchar:")):
                    total += int(line.split()[1])
            return total
    except (OSError, ValueError, IndexError):
        return -1


class _PhaseScope:
    """Context manager for one phase; reused per phase name (no generator per call)."""

    __slots__ = ("tw", "code", "name", "wait", "prev", "prev_name", "start", "active")

    def __init__(self, tw: Telemetry, code: int, name: str):
        self.tw, self.code, self.name = tw, code, name
        self.wait = name in slots.WAIT_PHASES
        self.active = False

    def __enter__(self) -> None:
        tw = self.tw
        self.active = True
        self.prev, self.prev_name = tw._phase, tw._phase_name
        self.start = now = _monotonic()
        tw._phase, tw._phase_name, tw._phase_since = self.code, self.name, now
        tw._writer.write_phase(self.code, tw._source, now, tw.py_collectives)

    def __exit__(self, *exc: Any) -> None:
        tw = self.tw
        now = _monotonic()
        if self.wait:
            tw._wait_s += now - self.start
        tw._phase, tw._phase_name, tw._phase_since = self.prev, self.prev_name, now
        tw._writer.write_phase(self.prev, tw._source, now, tw.py_collectives)
        self.active = False


_monotonic = time.monotonic
_INIT = slots.PHASE_CODES["init"]
_COMPUTE = slots.PHASE_CODES["compute"]


class FlightRecorderReader:
    """Reads per-group collective sequence numbers from PyTorch's flight recorder.

    `_dump_fr_trace_json` is private: guard by presence and shape, and fall back
    to None (the caller then publishes its own wrapper counts)."""

    def __init__(self) -> None:
        self.available = False
        self._fn = None
        self._names: dict[int, int] = {}
        """Local pg_id -> stable_group_id, learnt from entries (they roll out of the buffer)."""
        if not os.environ.get("TORCH_FR_BUFFER_SIZE"):
            return
        try:
            from torch._C._distributed_c10d import _dump_fr_trace_json  # type: ignore[attr-defined]

            self._fn = _dump_fr_trace_json
        except Exception:
            self._fn = None

    def sample(self) -> list[slots.CollectiveGroup] | None:
        if self._fn is None:
            return None
        try:
            import torch.distributed as dist

            if not dist.is_available() or not dist.is_initialized():
                return None
            data = json.loads(self._fn(includeCollectives=True, onlyActive=False))
        except Exception:
            self.available = False
            return None
        status = data.get("pg_status") or {}
        last_ops: dict[int, str] = {}
        for entry in data.get("entries") or ():
            try:
                local = int(entry.get("pg_id", 0))
                name = (entry.get("process_group") or [""])[0]
                if name != "":
                    self._names[local] = stable_group_id(str(name))
                if not entry.get("is_p2p"):
                    last_ops[local] = str(entry.get("profiling_name", "")).split(":")[-1]
            except (TypeError, ValueError, IndexError):
                continue
        groups = []
        for pg, st in status.items():
            try:
                local = int(pg)
                gid = self._names.get(local, 0 if local == 0 else None)
                if gid is None:
                    continue  # no collective seen on it yet: nothing to compare
                groups.append(
                    slots.CollectiveGroup(
                        gid,
                        int(st.get("last_enqueued_collective", -1)),
                        int(st.get("last_completed_collective", -1)),
                        last_ops.get(local, ""),
                    )
                )
            except (TypeError, ValueError):
                continue
        groups.sort(key=lambda g: g.pg)
        self.available = True
        return groups


def stable_group_id(name: str) -> int:
    """A process group's id that means the same group on every rank.

    The flight recorder's pg_id is local: a rank outside a subgroup never
    creates it, so the same number names different groups on different ranks.
    The group's name is global (torch numbers new groups in creation order on
    every rank, or hashes their ranks): small numeric names keep their number
    (the default group is 0), other names a 30-bit hash above them."""
    if name.isdigit() and int(name) < 1 << 30:
        return int(name)
    return (zlib.crc32(name.encode()) & 0x3FFFFFFF) | 1 << 30


# ---- process-wide handle -------------------------------------------------------

_instance: Telemetry | None = None
_instance_lock = threading.Lock()


def init(*, zero_code: bool = False) -> Telemetry:
    """Return this process's telemetry handle, attaching to the job's slot segment
    when started by `trainwatch launch` (TRAINWATCH_SLOTS is set)."""
    global _instance
    with _instance_lock:
        if _instance is not None:
            return _instance
        rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        path = os.environ.get("TRAINWATCH_SLOTS")
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
            tw = Telemetry(segment, local_rank, rank=rank, world_size=world, restart=restart, attached=True)
            _count_collectives(tw)
            tw.start_sampler()
            from trainwatch.watchdog import inject

            inject.install(tw)
            import atexit

            atexit.register(tw.close)
        _instance = tw
        return tw


def _default_group_seq() -> Callable[[], int] | None:
    """The default process group's sequence-number getter (a sub-microsecond
    read that counts every collective on the group, DDP's and FSDP's included),
    or None before the group exists or where torch does not offer it."""
    try:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return None
        fn = dist.distributed_c10d._get_default_group()._get_sequence_number_for_group
        fn()
        return fn
    except Exception:
        return None


def _group_arg_index(fn: Callable) -> int | None:
    import inspect

    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return params.index("group") if "group" in params else None


def _wrap_work_wait(tw: Telemetry, dist: Any) -> None:
    """`work.wait()` on an async collective or point-to-point op (isend/irecv,
    FSDP's all-gathers) blocks on peers just like a blocking call: mark it."""
    work = getattr(getattr(dist, "distributed_c10d", None), "Work", None)
    original = getattr(work, "wait", None)
    if original is None:
        return
    collective = slots.PHASE_CODES["collective"]

    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        if tw._phase == collective:
            return original(self, *args, **kwargs)  # already marked by the blocking call around it
        prev, prev_name, start = tw._phase, tw._phase_name, _monotonic()
        tw._phase, tw._phase_name, tw._phase_since = collective, "collective", start
        tw._writer.write_phase(collective, tw._source, start, tw.py_collectives)
        try:
            return original(self, *args, **kwargs)
        finally:
            end = _monotonic()
            tw._wait_s += end - start
            tw._phase, tw._phase_name, tw._phase_since = prev, prev_name, end
            tw._writer.write_phase(prev, tw._source, end, tw.py_collectives)

    try:
        work.wait = wait
    except (TypeError, AttributeError):
        pass  # a build whose Work type is closed: blocking calls are still marked


def _count_collectives(tw: Telemetry) -> None:
    """Wrap torch.distributed's Python collectives: count them (the fallback
    when the flight recorder is unavailable, and the end-of-step count ranks
    compare), and mark the rank as waiting in a collective while a blocking
    one runs, so a peer that never joins it is the one named."""
    try:
        import torch.distributed as dist
    except Exception:
        return
    if getattr(dist, "_trainwatch_wrapped", False):
        return
    spans_world: dict[int, bool] = {}
    collective = slots.PHASE_CODES["collective"]

    def is_world(group: Any) -> bool:
        # Subgroup collectives (pipeline stages, tensor-parallel groups) differ
        # between ranks by design; only world-spanning groups must agree.
        if group is None:
            return True
        known = spans_world.get(id(group))
        if known is None:
            try:
                known = dist.get_world_size(group) == dist.get_world_size()
            except Exception:
                known = False
            spans_world[id(group)] = known
        return known

    def wrap(name: str, fn: Callable) -> Callable:
        skippable = name == "all_reduce"
        p2p = name in _P2P
        always_async = name in _ASYNC_P2P
        at = _group_arg_index(fn)

        def counted(*args: Any, **kwargs: Any) -> Any:
            if skippable and tw.skip_collective():
                return None  # an injected desync: this rank silently skips one all_reduce
            tw.py_collectives += 1
            if not p2p:
                group = kwargs.get("group") if "group" in kwargs or at is None else (
                    args[at] if len(args) > at else None)
                if is_world(group):
                    tw.world_collectives += 1
            tw.last_py_op = name
            if always_async or kwargs.get("async_op"):
                tw._writer.write_phase(tw._phase, tw._source, tw._phase_since, tw.py_collectives)
                return fn(*args, **kwargs)
            # Published before the call: a rank blocked inside it must show
            # that it entered one more collective than a peer that skipped it.
            prev, prev_name, start = tw._phase, tw._phase_name, _monotonic()
            tw._writer.write_phase(collective, tw._source, start, tw.py_collectives)
            tw._phase, tw._phase_name, tw._phase_since = collective, "collective", start
            try:
                return fn(*args, **kwargs)
            finally:
                end = _monotonic()
                tw._wait_s += end - start
                tw._phase, tw._phase_name, tw._phase_since = prev, prev_name, end
                tw._writer.write_phase(prev, tw._source, end, tw.py_collectives)

        counted.__wrapped__ = fn  # type: ignore[attr-defined]
        counted.__name__ = fn.__name__
        counted.__doc__ = fn.__doc__
        return counted

    for name in _COLLECTIVES + _P2P:
        fn = getattr(dist, name, None)
        if fn is not None:
            setattr(dist, name, wrap(name, fn))
    _wrap_work_wait(tw, dist)

    destroy = dist.destroy_process_group

    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        try:  # last look at the flight recorder before the groups are gone
            tw.sample_now()
        except Exception:
            pass
        # A DDP module waiting for the cyclic collector may hold the last
        # reference to its process group; freed after the group is destroyed,
        # its destructor joins gloo's threads holding the GIL while a worker
        # needs the GIL to finish: a hang at exit. Free it while the group lives.
        gc.collect()
        tw._seq_fn = None  # the group's counter goes with it
        spans_world.clear()
        return destroy(*args, **kwargs)

    dist.destroy_process_group = destroy_process_group
    dist._trainwatch_wrapped = True  # type: ignore[attr-defined]
