"""The rank-side API: `tw = trainwatch.init()`, `tw.step(...)`, `with tw.phase(...)`.

Everything on the step path is a few struct writes into the rank's mapped slot:
no syscall, no lock, no allocation that outlives the call. Work that costs more
(flight-recorder dumps, heartbeats, emergency checkpoint writes) runs on one
background thread, which also keeps publishing while the training thread is
stuck in a collective (gloo and NCCL waits release the GIL).
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import threading
import time
from typing import Any, Callable

from trainwatch import slots
from trainwatch.inject.hooks import NO_FAULTS, FaultHooks
from trainwatch.rank import flightrec
from trainwatch.rank.phases import ACC_OF, PhaseScope, charge
from trainwatch.rank.slotwriter import SlotWriter

log = logging.getLogger("trainwatch")

NONFINITE_END = "NonFiniteEnd"
"""The errors-file record of a rank whose last reported loss or grad norm was NaN/inf (launcher.failures)."""
SAMPLE_INTERVAL_S = 0.2
"""Seconds between sampler rounds (heartbeat + flight recorder)."""

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

    def __init__(self, segment: Any, index: int, *, rank: int, world_size: int, restart: int, attached: bool,
                 faults: FaultHooks = NO_FAULTS):
        self.rank = rank
        self.local_rank = index
        self.world_size = world_size
        self.restart = restart
        self.attached = attached
        """True when a trainwatch sidecar reads this slot."""
        self._writer = SlotWriter(
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
        self._nograd_since = 0.0
        """When the outermost open no_grad / inference_mode block began (0: none)."""
        self._nograd_marked = False
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
        self.nonfinite_step = 0
        """The last step whose reported loss or grad norm was NaN/inf (0: none): its state is not staged."""
        self.data_offset = 0
        """Batches a trainer skipped (after a non-finite loss): step s trains on data window s + data_offset."""
        self._source = slots.STEP_COUNTED
        self._first = 0
        self._seq_fn: Callable[[], int] | None = None
        self._state_fn: Callable[[], dict] | None = None
        self._state_refs: tuple = ()
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None
        self._sample_lock = threading.Lock()
        self._fr = flightrec.FlightRecorderReader()
        self._hooks: list[Callable[[int], None]] = []
        self.faults = faults
        """Where injected faults happen in this rank (`--inject`); a no-op by default."""
        self._emergency: Any = None
        self._inprocess: Any = None
        self._scopes: dict[str, PhaseScope] = {}
        self._words = segment.buf.cast("Q")
        self._ack_word = (segment.offset(index) + slots.ACK_OFF) // 8
        self._ack = -1
        self._pl, self._pls, self._pg, self._pgs = math.nan, 0, math.nan, 0
        # Health signals (kept until given again), this step's phase times (see
        # trainwatch.rank.phases), the slowest step since the sidecar's last read.
        self._lr = self._loss_scale = self._zero_frac = math.nan
        self._acc, self._seen = [0.0] * 3, [math.nan] * 3  # seen: 0.0 once the phase was entered, else NaN
        self._ps, self._pss, self._pds, self._pbs, self._pos = math.nan, 0, math.nan, math.nan, math.nan
        self._timed = False
        self._publish()

    # ---- step path ----------------------------------------------------------

    @property
    def current_step(self) -> int:
        return self._step

    @property
    def first_step(self) -> int:
        """The first step this process finished (0: none yet)."""
        return self._first

    def resume_at(self, step: int) -> None:
        """This process continues a run after `step` (a resumed trainer): until
        its first step, faults and failure records count from there."""
        if not self._first:
            self._step = step

    def step(self, loss: Any = None, grad_norm: Any = None, *, step: int | None = None, compute_s: float | None = None,
             lr: Any = None, loss_scale: Any = None, zero_grad_frac: Any = None) -> None:
        """Record that a training step finished.

        loss / grad_norm: floats (a tensor is converted with float(), which on
        GPU waits for the device: pass floats you already have if that matters).
        step: the step number just finished; default previous + 1.
        compute_s: this step's compute time; default step time minus time spent
        in phases that wait on peers (backward, collective).
        lr: the learning rate this step used (the first param group's).
        loss_scale: the mixed-precision loss scale after this step
        (`scaler.get_scale()` of a torch.amp.GradScaler).
        zero_grad_frac: the fraction of gradient elements that were exactly 0.
        lr, loss_scale and zero_grad_frac are kept until given again, so they can
        be measured every few steps; loss and grad_norm are too.
        Time spent in the `data`, `backward` and `optimizer` phases during the
        step is published with it (see `phase`).
        """
        self._explicit = True
        self._source = slots.STEP_REPORTED
        if lr is not None:
            self._lr = lr if lr.__class__ is float else float(lr)
        if loss_scale is not None:
            self._loss_scale = loss_scale if loss_scale.__class__ is float else float(loss_scale)
        if zero_grad_frac is not None:
            self._zero_frac = zero_grad_frac if zero_grad_frac.__class__ is float else float(zero_grad_frac)
        self._record(loss, grad_norm, step, compute_s)

    def _record(self, loss: Any, grad_norm: Any, step: int | None, compute_s: float | None) -> None:
        # The hot path: plain attribute work and three struct writes.
        now = _monotonic()
        i = ACC_OF[self._phase]
        if i >= 0:  # the phase the rank is in counts up to now
            charge(self, i, now)
        self._step = n = self._step + 1 if step is None else step
        if not self._first:
            self._first = n
        step_s = now - self._last
        self._last = now
        if loss is not None:
            self._loss = v = loss if loss.__class__ is float else float(loss)
            if v - v != 0.0:  # NaN or inf (inf - inf is NaN)
                self.nonfinite_step = n
        if grad_norm is not None:
            self._grad_norm = v = grad_norm if grad_norm.__class__ is float else float(grad_norm)
            if v - v != 0.0:
                self.nonfinite_step = n
        self._step_s = step_s
        if compute_s is not None:
            self._compute_s = compute_s
        elif self._wait_s:
            self._compute_s = step_s - self._wait_s if step_s > self._wait_s else 0.0
        self._wait_s = 0.0
        acc, seen = self._acc, self._seen
        d, b, o = acc[0] + seen[0], acc[1] + seen[1], acc[2] + seen[2]
        acc[0] = acc[1] = acc[2] = 0.0
        if self._phase == _INIT:
            # A rank that finished a step is past start-up: time outside any
            # phase from now on is plain compute, not the lenient "init".
            self._phase, self._phase_name = _COMPUTE, "compute"
        # Worst values since the sidecar last read the slot (NaN sticks).
        # The sidecar acknowledges the step it read (+1). A peak at or before
        # that step was seen and starts over from this step; a later one was
        # published after the sidecar's copy and is kept until it is read.
        ack = self._words[self._ack_word]
        if ack != self._ack:
            self._ack = ack
            if self._pss < ack:
                self._pss = 0
            if self._pls < ack or self._pls == 0:
                self._pl, self._pls = self._loss, n
            if self._pgs < ack or self._pgs == 0:
                self._pg, self._pgs = self._grad_norm, n
        if self._timed:  # a process's first step also timed its start-up: never a peak
            if self._pss == 0 or not (step_s <= self._ps):
                self._ps, self._pss, self._pds, self._pbs, self._pos = step_s, n, d, b, o
        elif self._pss == 0:
            self._ps, self._pds, self._pbs, self._pos = math.nan, math.nan, math.nan, math.nan
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
                                self.world_collectives, seq_fn() if seq_fn is not None else -1,
                                (self._lr, self._loss_scale, self._zero_frac, d, b, o,
                                 self._ps, self._pss, self._pds, self._pbs, self._pos))
        self._timed = True
        if self._hooks:
            for hook in self._hooks:
                hook(n)

    def _publish(self) -> None:
        self._writer.write_step(self._step, self._loss, self._grad_norm, self._step_s, self._compute_s, self._last,
                                self._start, self._phase, self._phase_since, self.py_collectives,
                                step_source=self._source)

    FORWARD_ONLY_S = 1.0
    """An outermost no_grad / inference_mode block open this long is published as
    the `eval` phase by the sampler: forward-only work (a rollout, an evaluation
    without model.eval()), as lenient as an evaluation pass (s)."""

    def end_forward_only(self) -> None:
        """The outermost no_grad block ended: leave the `eval` phase the sampler put it in."""
        self._nograd_since = 0.0
        if self._nograd_marked:
            self._nograd_marked = False
            if self._phase == _EVAL:
                self._set_phase(_COMPUTE, "compute", _monotonic())

    def _publish_forward_only(self, now: float) -> None:
        """Sampler side: a long outermost no_grad block is the `eval` phase from its start."""
        since = self._nograd_since
        if since and not self._nograd_marked and now - since >= self.FORWARD_ONLY_S \
                and self._phase in (_COMPUTE, _INIT, _DATA):
            self._nograd_marked = True
            self._set_phase(_EVAL, "eval", since)

    def mark_active(self) -> None:
        """Forward-only progress (an eval forward, a batch fetched): the hang
        detector counts it as progress, so evaluation is not a hang."""
        self._writer.mark_active(_monotonic())

    def count_batch(self) -> None:
        self._writer.count_batch(_monotonic())

    def phase(self, name: str) -> PhaseScope:
        """Mark a phase of the step (data, forward, backward, optimizer, checkpoint, eval...):
        `with tw.phase("data"): ...`. The time each step spends in data, backward
        and optimizer is published with it (trainwatch.rank.phases)."""
        scope = self._scopes.get(name)
        if scope is None or scope.active:
            code = slots.PHASE_CODES.get(name)
            if code is None:
                raise ValueError(f"unknown phase {name!r}; use one of {', '.join(slots.PHASES)}")
            scope = PhaseScope(self, code, name)
            if name not in self._scopes:
                self._scopes[name] = scope
        return scope

    def set_phase(self, name: str) -> None:
        self._set_phase(slots.PHASE_CODES[name], name, _monotonic())

    def _set_phase(self, code: int, name: str, now: float) -> None:
        i = ACC_OF[self._phase]
        if i >= 0:
            charge(self, i, now)
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
            from trainwatch.rank.emergency import EmergencyCheckpointer

            self._emergency = EmergencyCheckpointer(self, checkpoint_dir, self.state_dict, keep=keep)
            self._hooks.append(self._emergency.stage)
            self._writer.set_checkpoint_ready()

    def in_process_recovery(self) -> Any:
        """Let the sidecar recover this rank in its own process: a re-formed process
        group and the staged state restored from memory (trainwatch.rank.inprocess).
        Needs register_state with a checkpoint_dir (the staged state); None otherwise."""
        if self._emergency is not None and self._inprocess is None:
            from trainwatch.rank.inprocess import InProcessRecovery, store_ports

            self._inprocess = InProcessRecovery(self._writer, store_ports=store_ports(), rank=self.rank)
        return self._inprocess

    def staged(self) -> Any:
        """The emergency checkpointer (its staged steps and states), or None."""
        return self._emergency

    def process_group_reformed(self) -> None:
        """The process group was created again (in-process recovery): collective
        counts start over with it, on every rank alike, and the next step is
        timed from here, as a new process's first is (the stall and the recovery
        before it are the incident's time, not a slow step)."""
        self.py_collectives = self.world_collectives = 0
        self._seq_fn = flightrec.default_group_seq()
        self._last = _monotonic()
        self._wait_s = 0.0
        self._acc[:] = [0.0] * 3
        self._timed = False

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

    def record_failure(self, type_name: str, message: str, where: str | None) -> None:
        """Say why this rank is about to exit (trainwatch.rank.failure)."""
        from trainwatch.rank.failure import record_failure

        record_failure(self, type_name, message, where)

    # ---- fault-injection points (no-ops unless `--inject` armed this rank) ------

    def fault_point(self, where: str) -> None:
        """Called by the trainer at 'data', 'forward', 'checkpoint' and 'step_end';
        an armed fault (hang, crash, delay) really happens here, in this rank."""
        self.faults.fault_point(self, where)

    def skip_collective(self) -> bool:
        """True when an injected fault wants this rank to skip its next all_reduce."""
        return self.faults.skip_collective(self)

    def perturb_loss(self, loss: Any) -> Any:
        """Return the loss, or a NaN/spiked copy when such a fault is armed."""
        return self.faults.perturb_loss(self, loss)

    # ---- waits on peers (collective hooks) --------------------------------------

    def begin_wait(self) -> tuple | None:
        """Enter the `collective` phase for a blocking call; None if already in it."""
        if self._phase == _COLLECTIVE:
            return None
        token = (self._phase, self._phase_name, _monotonic())
        i = ACC_OF[self._phase]
        if i >= 0:
            charge(self, i, token[2])
        self._phase, self._phase_name, self._phase_since = _COLLECTIVE, "collective", token[2]
        self._writer.write_phase(_COLLECTIVE, self._source, token[2], self.py_collectives)
        return token

    def end_wait(self, token: tuple | None) -> None:
        if token is None:
            return
        prev, prev_name, start = token
        end = _monotonic()
        self._wait_s += end - start
        self._phase, self._phase_name, self._phase_since = prev, prev_name, end
        self._writer.write_phase(prev, self._source, end, self.py_collectives)

    def publish_phase(self) -> None:
        """Publish the current phase again (the collective count moved with it)."""
        self._writer.write_phase(self._phase, self._source, self._phase_since, self.py_collectives)

    def forget_group(self) -> None:
        self._seq_fn = None
    # ---- background sampler ---------------------------------------------------

    def start_sampler(self, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        if self._sampler is not None:
            return
        self._sampler = threading.Thread(target=self._sample_loop, args=(interval_s,), name="trainwatch-sampler", daemon=True)
        self._sampler.start()

    def _sample_loop(self, interval_s: float) -> None:
        # A rank that offers in-process recovery looks at its request between rounds too.
        while not (self._stop.wait(interval_s) if self._inprocess is None
                   else self._inprocess.wait_round(self._stop, interval_s)):
            try:
                self.sample_now()
                if self._emergency is not None:
                    self._emergency.poll(self._writer)
                if self._inprocess is not None:
                    self._inprocess.poll()
            except Exception:  # one bad round must not end the heartbeat
                log.debug("trainwatch sampler round failed", exc_info=True)

    def sample_now(self) -> None:
        """One sampler round: heartbeat + collective sequence numbers. The lock
        keeps region B single-writer; it is never taken on the step path."""
        with self._sample_lock:
            # Refreshed every round: the default group may be destroyed and re-created.
            self._seq_fn = flightrec.default_group_seq()
            self._publish_forward_only(time.monotonic())
            groups = self._fr.sample()
            if groups is None:
                groups = [slots.CollectiveGroup(0, self.py_collectives, self.py_collectives, self.last_py_op)]
            # Arrivals at recent default-group collectives (None: leave the last ones).
            self._writer.write_sampler(time.monotonic(), self._fr.available, self._step, groups, time.process_time(),
                                       flightrec.io_bytes(), arrivals=self._fr.arrivals)

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join(timeout=2)
        self._set_phase(slots.PHASE_CODES["done"], "done", time.monotonic())
        if self._step and self.nonfinite_step == self._step:
            # Ends on a NaN/inf: the launcher does not call such a job a success (--nan-policy).
            self.record_failure(NONFINITE_END, f"last reported loss {self._loss}, grad norm {self._grad_norm} "
                                f"at step {self._step}", None)


_monotonic = time.monotonic
_INIT = slots.PHASE_CODES["init"]
_COMPUTE = slots.PHASE_CODES["compute"]
_COLLECTIVE = slots.PHASE_CODES["collective"]
_EVAL = slots.PHASE_CODES["eval"]
_DATA = slots.PHASE_CODES["data"]
