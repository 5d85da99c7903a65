"""Emergency checkpoints that work while the rank is hung.

At the end of every step the training thread copies its registered state into
one of two preallocated CPU buffers (on GPU: pinned memory, on a side stream,
so the copy overlaps the next step). The rank's background thread watches the
slot's control region; when the sidecar asks, it writes the newest complete
buffer with the same atomic format as periodic checkpoints. No collective is
involved, so a rank whose main thread is stuck in one can still save.

Non-finite state is never saved: a step whose reported loss or grad norm is
NaN/inf is not staged (the buffers keep the last good step), and a buffer is
checked for NaN/inf before it is written; when the newest one holds them
(weights poisoned by a step whose own loss was still finite), the older one
is written instead, or nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from trainwatch import slots
from trainwatch.lines import print_line

log = logging.getLogger("trainwatch")


def _alloc(value: Any) -> Any:
    """A buffer shaped like value: tensors become (pinned) CPU tensors, containers recurse."""
    import torch

    if isinstance(value, torch.Tensor):
        pin = value.is_cuda
        return torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=pin)
    if isinstance(value, dict):
        return {k: _alloc(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_alloc(v) for v in value)
    return value


def _same_shape(buf: Any, value: Any) -> bool:
    import torch

    if isinstance(value, torch.Tensor):
        return isinstance(buf, torch.Tensor) and buf.shape == value.shape and buf.dtype == value.dtype
    if isinstance(value, dict):
        return isinstance(buf, dict) and buf.keys() == value.keys() and all(_same_shape(buf[k], value[k]) for k in value)
    if isinstance(value, (list, tuple)):
        return isinstance(buf, (list, tuple)) and len(buf) == len(value) and all(
            _same_shape(b, v) for b, v in zip(buf, value)
        )
    return True


def _copy(buf: Any, value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        buf.copy_(value.detach(), non_blocking=value.is_cuda)
        return buf
    if isinstance(value, dict):
        return {k: _copy(buf[k], v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(b, v) for b, v in zip(buf, value))
    return value


class EmergencyCheckpointer:
    def __init__(self, tw: Any, ckpt_dir: str, state_fn: Callable[[], dict], *, keep: int | None = None):
        self.tw = tw
        self.ckpt_dir = ckpt_dir
        self.state_fn = state_fn
        self.keep = keep
        self._buffers: list[Any] = [None, None]
        self._steps = [-1, -1]
        self._events: list[Any] = [None, None]
        self._current = -1  # index of the newest complete buffer
        self._pinned = -1  # index the writer is reading
        self._lock = threading.Lock()
        self._done_request = 0
        self._stream = None
        self.last_written: str | None = None
        self.refused_step = -1
        """The step of a staged state not written because it held NaN/inf (-1: none)."""
        self._written_step = -1
        self._failed_step = -1
        self._write_lock = threading.Lock()

    # ---- training thread ------------------------------------------------------------

    def stage(self, step: int) -> None:
        if self.tw.nonfinite_step == step:
            return  # this step's loss or grad norm is NaN/inf: keep the last good state
        with self._lock:
            target = 1 - self._current if self._current >= 0 else 0
            if target == self._pinned:
                return  # the writer holds it; the next step stages again
        state = self.state_fn()
        buf = self._buffers[target]
        if buf is None or not _same_shape(buf, state):
            buf = _alloc(state)
        event = None
        import torch

        if torch.cuda.is_available() and _has_cuda(state):
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                buf = _copy(buf, state)
                event = torch.cuda.Event()
                event.record(self._stream)
        else:
            buf = _copy(buf, state)
        self._buffers[target] = buf
        self._events[target] = event
        self._steps[target] = step
        with self._lock:
            self._current = target

    # ---- background thread ------------------------------------------------------------

    def poll(self, writer: Any) -> None:
        """Called by the sampler thread: serve a pending checkpoint request."""
        request = writer.read_request()
        if request == 0 or request == self._done_request:
            return
        self._done_request = request
        writer.write_checkpoint_status(request, slots.CKPT_WRITING, self.staged_step)
        ok = self.write("requested by the watchdog") is not None
        # The step written, not the one staged since (the training thread goes on meanwhile).
        writer.write_checkpoint_status(request, slots.CKPT_OK if ok else slots.CKPT_FAILED,
                                       self._written_step if ok else self.staged_step)

    def staged_steps(self) -> list[int]:
        """The steps the two buffers hold (-1: empty)."""
        return list(self._steps)

    def staged_state(self, step: int) -> Any | None:
        """The staged state of `step` (CPU buffers; read, never kept), or None."""
        for i in (0, 1):
            if self._steps[i] == step and self._buffers[i] is not None:
                if self._events[i] is not None:
                    self._events[i].synchronize()
                return self._buffers[i]
        return None

    @property
    def staged_step(self) -> int:
        return self._steps[self._current] if self._current >= 0 else -1

    def write(self, reason: str) -> str | None:
        """Write the newest staged state; returns the checkpoint path or None.
        The watchdog's request (background thread) and a dying training thread
        may both ask at once: one writes, the other gets its result."""
        with self._write_lock:
            if self.last_written is not None and self._written_step == self.staged_step:
                return self.last_written
            if self._failed_step == self.staged_step >= 0:
                return None  # tried and said why: a second try of the same step says it again, no more
            path = self._write(reason)
            if path is None:
                self._failed_step = self.staged_step
            return path

    def _write(self, reason: str) -> str | None:
        from trainwatch.checkpoint import save_checkpoint
        from trainwatch.finite import nonfinite_tensors

        with self._lock:
            index = self._current
            self._pinned = index
        try:
            if index < 0:
                log.warning("trainwatch: no staged state yet; emergency checkpoint skipped")
                return None
            if self._events[index] is not None:
                self._events[index].synchronize()
            bad = nonfinite_tensors(self._buffers[index])
            if bad:
                older = 1 - index
                with self._lock:
                    self._pinned = older  # the training thread stages into neither while we look
                usable = 0 <= self._steps[older] < self._steps[index] and self._buffers[older] is not None
                if usable and self._events[older] is not None:
                    self._events[older].synchronize()
                if not usable or nonfinite_tensors(self._buffers[older]):
                    self.refused_step = self._steps[index]
                    print_line(f"[trainwatch] rank {self.tw.rank}: emergency checkpoint not written: the staged "
                               f"state of step {self._steps[index]} holds NaN/inf ({', '.join(bad)}) and no earlier "
                               "finite state is staged; a restart resumes from the newest finite checkpoint on disk")
                    return None
                print_line(f"[trainwatch] rank {self.tw.rank}: the staged state of step {self._steps[index]} holds "
                           f"NaN/inf ({', '.join(bad)}); saving step {self._steps[older]} instead")
                index = older
            step = self._steps[index]
            t0 = time.monotonic()
            path = save_checkpoint(
                self.ckpt_dir, step, self._buffers[index], kind="emergency", rank=self.tw.rank, keep=self.keep,
                fault_point=lambda: self.tw.fault_point("emergency_write"),
            )
            self.last_written = str(path)
            self._written_step = step
            print_line(f"[trainwatch] rank {self.tw.rank}: emergency checkpoint of step {step} written in "
                       f"{time.monotonic() - t0:.2f}s ({reason}): {path}")
            return str(path)
        except Exception as e:
            log.error("trainwatch: emergency checkpoint failed on rank %s: %s", self.tw.rank, e)
            return None
        finally:
            with self._lock:
                self._pinned = -1


def _has_cuda(state: Any) -> bool:
    import torch

    if isinstance(state, torch.Tensor):
        return state.is_cuda
    if isinstance(state, dict):
        return any(_has_cuda(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return any(_has_cuda(v) for v in state)
    return False
