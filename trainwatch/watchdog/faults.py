"""Rank-side fault actions for `--inject`. Each fault really happens in the rank:
a real blocked DataLoader, a real GIL-holding pause, a real blocked file write,
a real skipped all_reduce, a real signal. The watchdog must find them the way it
would find the real thing, from slots and stacks.
"""

from __future__ import annotations

import gc
import json
import itertools
import os
import signal
import tempfile
import time
from typing import Any

from trainwatch.watchdog.inject import FaultSpec

# Which fault point each fault fires at. The trainer calls "data" before each
# batch, "forward" before forward, "step_end" after tw.step; the zero-code
# bootstrap calls "data" from DataLoader and "forward"/"step_end" from the
# optimizer hooks.
_POINTS = {
    ("hang", "compute"): "forward",
    ("hang", "gc"): "forward",
    ("hang", "dataloader"): "data",
    ("hang", "checkpoint"): "step_end",
    ("straggler", None): "data",
}


def mark_fired(f: FaultSpec, rank: int, step: int) -> None:
    """Record when a fault really began (for detection and recovery latency):
    one line in the job's control/faults.jsonl, CLOCK_MONOTONIC and wall time."""
    job, home = os.environ.get("TRAINWATCH_JOB"), os.environ.get("TRAINWATCH_HOME")
    if not job or not home:
        return
    line = json.dumps({"kind": f.kind, "params": f.params, "rank": rank, "step": step,
                       "mono": time.monotonic(), "wall": time.time()})
    try:
        fd = os.open(os.path.join(home, "jobs", job, "control", "faults.jsonl"),
                     os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        pass


class Armed:
    def __init__(self, tw: Any, faults: list[FaultSpec]):
        self.tw = tw
        self.faults = faults
        self.fired: set[int] = set()

    def _due(self, i: int, f: FaultSpec, persistent: bool = False) -> bool:
        # tw.current_step is the last completed step; the step running now is +1.
        running = self.tw.current_step + 1
        if persistent:
            return running >= f.step
        return i not in self.fired and running >= f.step

    def fault_point(self, where: str) -> None:
        for i, f in enumerate(self.faults):
            if f.kind == "crash":
                point = f.params.get("at", "forward")
            else:
                point = _POINTS.get((f.kind, f.params.get("where") if f.kind == "hang" else None))
            if point != where:
                continue
            if f.kind == "straggler":
                if self._due(i, f, persistent=True):
                    if i not in self.fired:
                        self.fired.add(i)
                        mark_fired(f, self.tw.rank, self.tw.current_step + 1)
                    delay = float(f.params.get("delay", 0.5))
                    with self.tw.phase("compute"):
                        time.sleep(delay)
                continue
            if not self._due(i, f):
                continue
            self.fired.add(i)
            self.tw.sample_now()
            mark_fired(f, self.tw.rank, self.tw.current_step + 1)
            _ACTIONS[(f.kind, f.params.get("where"))](self.tw, f)

    def wants(self, kind: str, where: str | None = None) -> bool:
        """True when a fault of this kind (and hang location) is armed here."""
        return any(f.kind == kind and (where is None or f.params.get("where") == where) for f in self.faults)

    def unfired(self) -> list[FaultSpec]:
        return [f for i, f in enumerate(self.faults) if i not in self.fired]

    def skip_collective(self) -> bool:
        for i, f in enumerate(self.faults):
            if f.kind == "hang" and f.params.get("where") == "collective_skip" and self._due(i, f):
                self.fired.add(i)
                mark_fired(f, self.tw.rank, self.tw.current_step + 1)
                return True
        return False

    def perturb_loss(self, loss: Any) -> Any:
        for i, f in enumerate(self.faults):
            if f.kind in ("nan", "spike") and self._due(i, f):
                self.fired.add(i)
                mark_fired(f, self.tw.rank, self.tw.current_step + 1)
                if f.kind == "nan":
                    return loss * float("nan")
                return loss * float(f.params.get("factor", 50.0))
        return loss


def arm(tw: Any, faults: list[FaultSpec]) -> Armed:
    armed = Armed(tw, faults)
    tw.fault_point = armed.fault_point
    tw.skip_collective = armed.skip_collective
    tw.perturb_loss = armed.perturb_loss
    return armed


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
    name = str(f.params.get("signal", "KILL")).upper()
    sig = getattr(signal, name if name.startswith("SIG") else f"SIG{name}", signal.SIGKILL)
    os.kill(os.getpid(), sig)


def _deadline(f: FaultSpec) -> float:
    seconds = f.params.get("seconds")
    return float("inf") if seconds is None else time.monotonic() + float(seconds)


_ACTIONS = {
    ("hang", "compute"): hang_compute,
    ("hang", "gc"): hang_gc,
    ("hang", "dataloader"): hang_dataloader,
    ("hang", "checkpoint"): hang_checkpoint,
    ("crash", None): crash,
}
