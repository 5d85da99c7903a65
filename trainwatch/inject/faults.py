"""Rank-side fault actions for `--inject`. Each fault really happens in the rank:
a real blocked DataLoader, a real GIL-holding pause, a real blocked file write,
a real skipped all_reduce, a real signal. The watchdog must find them the way it
would find the real thing, from slots and stacks.

Training-health faults leave the rank running and make its training go wrong
from their step on, each with the real mechanism:

- `lr:value=V`: the optimizer's learning rate is set to V in every param group
  just before each optimizer step, so an LR scheduler writing it back is undone.
- `dead_grad`: the rank's gradients are zeroed after backward (after DDP's
  all-reduce), before clipping and the optimizer read them.
- `scale_collapse`: one gradient element of the rank is set to inf just before
  its GradScaler checks them, as an fp16 overflow does: the scaler skips the
  optimizer step and halves its scale, every step. Put after backward, so it
  stays in this rank (an inf loss would reach every rank through DDP's
  all-reduce, and poison the weights of ranks without a scaler). Zero-code, it
  fires only in scripts that use a GradScaler.
- `loss_rise:rate=R`: the loss is multiplied by 1 + R * (steps since the fault's
  step) before backward: a steadily rising curve, not a spike.
- `slow_step:where=data|backward|optimizer,delay=S,every=N`: a sleep of S seconds
  inside that phase, once (every=0) or every N steps.

After a restart, faults keep their meaning: one that has not fired yet fires
at its step when the new run reaches it; one that already fired does not fire
again (a crash replayed at the same step would only spend the restart
budget), and the rank says so. `nan` and `spike` stand for a bad batch, so
they follow the data: replaying the same data window replays them, and a run
that skips that window (the trainer's `--nan-skip-batches`) never meets them
again.
"""

from __future__ import annotations

import gc
import itertools
import json
import math
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from trainwatch import env, state
from trainwatch.inject.hooks import NO_FAULTS, FaultHooks
from trainwatch.inject.spec import HARDWARE_KINDS, FaultSpec, decode, signal_number

# Which fault point each fault fires at. The trainer calls "data" before each
# batch, "forward" before forward, "backward" and "optimizer" inside those
# phases, "step_end" after tw.step; the zero-code bootstrap calls "data" from
# DataLoader, "backward" from Tensor.backward and "forward"/"optimizer"/
# "step_end" from the optimizer hooks. (slow_step fires at its `where`.)
_POINTS = {
    ("hang", "compute"): "forward",
    ("hang", "gc"): "forward",
    ("hang", "dataloader"): "data",
    ("hang", "checkpoint"): "step_end",
    ("straggler", None): "data",
    ("stop", None): "forward",
    ("zombie", None): "forward",
}


DATA_KINDS = frozenset({"nan", "spike"})
"""Faults that stand for a bad batch: they fire again whenever their data window is trained again."""


def _faults_file() -> Path | None:
    job, home = os.environ.get(env.JOB), os.environ.get(env.HOME)
    if not job or not home:
        return None
    try:
        return state.JobDir(job, root=Path(home)).faults_file
    except state.StateError:
        return None


def mark_fired(f: FaultSpec, rank: int, step: int) -> None:
    """Record when a fault really began (for detection and recovery latency):
    one line in the job's faults file, CLOCK_MONOTONIC and wall time."""
    path = _faults_file()
    if path is None:
        return
    line = json.dumps({"kind": f.kind, "params": f.params, "rank": rank, "step": step, "planned": f.step,
                       "mono": time.monotonic(), "wall": time.time()})
    try:
        state.append_line(path, line)
    except (OSError, state.StateError):
        pass


def fired_before(rank: int, path: Path | None = None) -> set[tuple]:
    """(kind, params, planned step) of every fault this rank fired in this run so far
    (earlier worker generations). Lines that do not parse are skipped."""
    path = path or _faults_file()
    out: set[tuple] = set()
    if path is None:
        return out
    try:
        text = path.read_bytes()[: 4 << 20].decode("utf-8", "replace")
    except OSError:
        return out
    for line in text.splitlines():
        try:
            rec = json.loads(line)
            if isinstance(rec, dict) and rec.get("rank") == rank and isinstance(rec.get("params"), dict):
                out.add((str(rec.get("kind")), json.dumps(rec["params"], sort_keys=True), rec.get("planned")))
        except (ValueError, RecursionError, TypeError):
            continue
    return out


def _key(f: FaultSpec) -> tuple:
    return (f.kind, json.dumps(f.params, sort_keys=True), f.step)


class Armed(FaultHooks):
    """The faults armed in one rank; fired at the fault points the rank calls."""

    def __init__(self, faults: list[FaultSpec], replay: set[int] | None = None):
        self.faults = faults
        self.fired: set[int] = set()
        self.replay = replay or set()
        """Data faults that fired in an earlier worker generation: they fire only on their own data window."""
        self._slow_at: dict[int, int] = {}

    @staticmethod
    def _running(tw: Any) -> int:
        return tw.current_step + 1  # current_step is the last completed step

    @staticmethod
    def _window(tw: Any) -> int:
        """The data window the running step trains on (a trainer that skipped
        batches after a non-finite loss sets tw.data_offset)."""
        return tw.current_step + 1 + getattr(tw, "data_offset", 0)

    def _due(self, tw: Any, i: int, f: FaultSpec, persistent: bool = False) -> bool:
        if persistent:
            return self._running(tw) >= f.step
        if f.kind in DATA_KINDS:
            window = self._window(tw)
            return i not in self.fired and (window == f.step if i in self.replay else window >= f.step)
        return i not in self.fired and self._running(tw) >= f.step

    def _ongoing(self, tw: Any, i: int, f: FaultSpec) -> bool:
        """A fault that lasts from its step on: True from then, recorded the first time."""
        running = self._running(tw)
        if running < f.step:
            return False
        if i not in self.fired:
            self.fired.add(i)
            mark_fired(f, tw.rank, running)
        return True

    def fault_point(self, tw: Any, where: str) -> None:
        for i, f in enumerate(self.faults):
            if f.kind == "crash":
                point = f.params.get("at", "forward")
            elif f.kind == "slow_step":
                point = f.params.get("where", "data")
            else:
                point = _POINTS.get((f.kind, f.params.get("where") if f.kind == "hang" else None))
            if point != where:
                continue
            if f.kind == "straggler":
                if self._ongoing(tw, i, f):
                    delay = float(f.params.get("delay", 0.5))
                    with tw.phase("compute"):
                        time.sleep(delay)
                continue
            if f.kind == "slow_step":
                self._slow_step(tw, i, f, point)
                continue
            if not self._due(tw, i, f):
                continue
            self.fired.add(i)
            tw.sample_now()
            mark_fired(f, tw.rank, self._running(tw))
            _ACTIONS[(f.kind, f.params.get("where"))](tw, f)

    def wants(self, kind: str, where: str | None = None) -> bool:
        return any(f.kind == kind and (where is None or f.params.get("where") == where) for f in self.faults)

    def unfired(self) -> list[FaultSpec]:
        return [f for i, f in enumerate(self.faults) if i not in self.fired and i not in self.replay]

    def not_replayed(self) -> list[FaultSpec]:
        """Data faults of an earlier generation whose window this run did not train again."""
        return [f for i, f in enumerate(self.faults) if i not in self.fired and i in self.replay]

    def skip_collective(self, tw: Any) -> bool:
        for i, f in enumerate(self.faults):
            if f.kind == "hang" and f.params.get("where") == "collective_skip" and self._due(tw, i, f):
                self.fired.add(i)
                mark_fired(f, tw.rank, self._running(tw))
                return True
        return False

    def _slow_step(self, tw: Any, i: int, f: FaultSpec, where: str) -> None:
        """At most once a step: at the fault's step, then every `every` steps if set."""
        running, every = self._running(tw), int(f.params.get("every", 0))
        if running < f.step or self._slow_at.get(i) == running:
            return
        if (every and (running - f.step) % every) or (not every and i in self.fired):
            return
        self._slow_at[i] = running
        if i not in self.fired:
            self.fired.add(i)
            mark_fired(f, tw.rank, running)
        with tw.phase(where):  # the step's extra time is this phase's
            time.sleep(float(f.params.get("delay", 1.0)))

    def after_backward(self, tw: Any, params: Any) -> None:
        for i, f in enumerate(self.faults):
            if f.kind == "dead_grad" and self._ongoing(tw, i, f):
                for p in params() if callable(params) else params:
                    if p.grad is not None:
                        p.grad.zero_()

    def before_unscale(self, tw: Any, params: Any) -> None:
        for i, f in enumerate(self.faults):
            if f.kind == "scale_collapse" and self._ongoing(tw, i, f):
                for p in params() if callable(params) else params:
                    g = p.grad
                    if g is not None and g.numel():
                        g[(0,) * g.dim()] = math.inf  # an overflow, as fp16 gradients have them
                        break

    def before_optimizer(self, tw: Any, optimizer: Any) -> None:
        for i, f in enumerate(self.faults):
            if f.kind == "lr" and self._ongoing(tw, i, f):
                value = float(f.params.get("value", 0.0))
                for group in optimizer.param_groups:
                    lr = group.get("lr")
                    if hasattr(lr, "fill_"):  # a tensor LR (capturable optimizers): keep the tensor
                        lr.fill_(value)
                    else:
                        group["lr"] = value

    def perturb_loss(self, tw: Any, loss: Any) -> Any:
        for i, f in enumerate(self.faults):
            if f.kind == "loss_rise" and self._ongoing(tw, i, f):
                loss = loss * (1.0 + float(f.params.get("rate", 0.02)) * (self._running(tw) - f.step))
            elif f.kind in ("nan", "spike") and self._due(tw, i, f):
                self.fired.add(i)
                mark_fired(f, tw.rank, self._running(tw))
                if f.kind == "nan":
                    return loss * float("nan")
                return loss * float(f.params.get("factor", 50.0))
        return loss


def armed_faults(encoded: str | None, rank: int, restart: int = 0, *, fired: set[tuple] | None = None,
                 say: Any = None) -> FaultHooks:
    """The hooks for this rank from TRAINWATCH_INJECT: its faults, or none.
    Hardware faults (xid, ecc) are the sidecar's, not the rank's. In a restarted
    worker group (restart > 0) a fault that already fired is not armed again
    (said on the console), except data faults, which replay on their window."""
    say = say or (lambda msg: print(msg, flush=True))
    try:
        faults = [f for f in decode(encoded) if f.rank == rank and f.kind not in HARDWARE_KINDS]
    except (ValueError, TypeError) as e:
        say(f"[trainwatch] rank {rank}: ignoring {env.INJECT} ({e})")
        return NO_FAULTS
    replay: set[int] = set()
    if restart > 0 and faults:
        done = fired_before(rank) if fired is None else fired
        kept = []
        for f in faults:
            if _key(f) not in done:
                kept.append(f)
            elif f.kind in DATA_KINDS:
                replay.add(len(kept))
                kept.append(f)
                say(f"[trainwatch] rank {rank}: injected fault {f.kind} (step {f.step}) fired before restart "
                    f"{restart}; it fires again if this run trains the same data window")
            else:
                say(f"[trainwatch] rank {rank}: injected fault {f.kind} (step {f.step}) already fired before "
                    f"restart {restart}; not armed again")
        faults = kept
    return Armed(faults, replay) if faults else NO_FAULTS


# ---- the faults -------------------------------------------------------------------


def hang_compute(tw: Any, f: FaultSpec) -> None:
    """Spin in Python: the GIL is released between bytecodes, so the heartbeat
    thread keeps running; only step progress stops."""
    deadline = _deadline(f)
    with tw.phase("compute"):
        x = 0
        while time.monotonic() < deadline:
            x = (x * 31 + 7) % 1000003


def hang_gc(tw: Any, f: FaultSpec) -> None:
    """A gc pause that holds the GIL: a gc callback that runs a long C-level loop.
    No other thread (heartbeat included) runs until it ends."""
    seconds = f.params.get("seconds")
    # sum() over itertools.repeat runs in C without releasing the GIL.
    n = None if seconds is None else int(float(seconds) * 3e7)

    def on_gc_collect(phase: str, info: dict) -> None:
        if phase == "start":
            sum(itertools.repeat(1) if n is None else itertools.repeat(1, n))

    gc.callbacks.append(on_gc_collect)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(on_gc_collect)


def hang_dataloader(tw: Any, f: FaultSpec) -> None:
    """A DataLoader whose worker never delivers: the rank blocks in __next__."""
    import torch.utils.data as tud

    class StalledDataset(tud.Dataset):
        def __len__(self) -> int:
            return 1

        def __getitem__(self, i: int):
            time.sleep(float(f.params.get("seconds", 1e9)))
            return i

    loader = tud.DataLoader(StalledDataset(), num_workers=1)
    with tw.phase("data"):
        next(iter(loader))


def hang_checkpoint(tw: Any, f: FaultSpec) -> None:
    """torch.save into a FIFO nobody reads: a real file write blocked in the kernel,
    the way a save to a stalled network filesystem blocks."""
    import torch

    path = os.path.join(tempfile.mkdtemp(prefix="trainwatch-ckpt-"), "state.pt")
    os.mkfifo(path, 0o600)
    with tw.phase("checkpoint"):
        torch.save({"step": tw.current_step}, path)


def crash(tw: Any, f: FaultSpec) -> None:
    if "code" in f.params:  # exits on its own (no atexit handlers: like a C library's exit)
        os._exit(int(f.params["code"]))
    os.kill(os.getpid(), signal_number(str(f.params.get("signal", "KILL"))))


def stop(tw: Any, f: FaultSpec) -> None:
    """SIGSTOP to itself: state T, no progress, no heartbeat, until a SIGCONT."""
    os.kill(os.getpid(), signal.SIGSTOP)


def zombie(tw: Any, f: FaultSpec) -> None:
    """The main thread ends (pthread_exit, the GIL released by ctypes) while the
    process's other threads run on: the kernel shows the process as a zombie
    (state Z) that its parent cannot reap, and the heartbeat thread keeps beating."""
    import ctypes

    ctypes.CDLL(None).pthread_exit(None)


def _deadline(f: FaultSpec) -> float:
    seconds = f.params.get("seconds")
    return float("inf") if seconds is None else time.monotonic() + float(seconds)


_ACTIONS = {
    ("hang", "compute"): hang_compute,
    ("hang", "gc"): hang_gc,
    ("hang", "dataloader"): hang_dataloader,
    ("hang", "checkpoint"): hang_checkpoint,
    ("crash", None): crash,
    ("stop", None): stop,
    ("zombie", None): zombie,
}
