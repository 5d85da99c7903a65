"""Read a scalar off the GPU without waiting for it.

Reading a CUDA scalar (`float(loss)`, `.item()`) blocks the training thread
until every kernel queued before it has run, which would turn trainwatch's
zero-code hooks into a per-step synchronisation. A `DeferredScalar` instead
queues a device-to-host copy (non_blocking, into a preallocated pinned CPU
tensor) behind the work that produces the value, records a CUDA event after
it, and reads the host copy later, only once `event.query()` says the copy
is done. It never synchronises.

The price is a lag: the value read at step n is the one queued at step n-1
in the usual case (a training loop that waits for its device once a step),
or an older one when the CPU runs further ahead of the GPU. At most one copy
is in flight; a value offered while it is, is dropped (the next one is read).
CPU tensors are read at once, with no lag.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _pinned_buffer() -> Any:
    import torch

    return torch.empty((), dtype=torch.float32, pin_memory=True)


def _cuda_event() -> Any:
    import torch

    return torch.cuda.Event()


def _capturing() -> bool:
    """True while a CUDA graph is being captured on the current stream (no event
    record or copy may be queued then)."""
    import torch

    return torch.cuda.is_current_stream_capturing()


class DeferredScalar:
    """One scalar value read from the device without a synchronisation.

    buffer: makes the host buffer the copy lands in (default: a pinned float32 CPU
    tensor, made once, on first use). event: makes the completion marker, an object
    with record() and query() (default: torch.cuda.Event, made once). deferred: the
    device types read this way (default CUDA); CPU tensors are read at once, any
    other device is not read at all. The factories are the hardware boundary: tests
    pass a plain CPU buffer and a fake event to exercise the logic without a GPU.
    """

    __slots__ = ("_buf", "_capturing", "_deferred", "_event", "_make_buffer", "_make_event", "_pending")

    def __init__(self, *, buffer: Callable[[], Any] = _pinned_buffer, event: Callable[[], Any] = _cuda_event,
                 deferred: tuple[str, ...] = ("cuda",), capturing: Callable[[], bool] = _capturing):
        self._make_buffer, self._make_event = buffer, event
        self._deferred = deferred
        self._capturing = capturing
        self._buf: Any = None
        self._event: Any = None
        self._pending = False

    @property
    def pending(self) -> bool:
        """A copy is in flight (queued and not read yet)."""
        return self._pending

    def take(self, tensor: Any) -> float | None:
        """Offer this step's value; return the newest value readable now: this
        tensor's on CPU, an earlier one's whose copy finished on CUDA, or None."""
        kind = tensor.device.type
        if kind in self._deferred:
            value = self.ready()
            if not self._pending and not self._capturing():
                self._start(tensor)
            return value
        if kind == "cpu":
            return float(tensor)
        return None

    def ready(self) -> float | None:
        """The value of an earlier take() once its copy has finished (once), else None."""
        if self._pending and self._event.query():
            self._pending = False
            return float(self._buf)
        return None

    def _start(self, tensor: Any) -> None:
        if self._buf is None:
            self._buf = self._make_buffer()
            self._event = self._make_event()
        src = tensor.detach()
        if src.dtype != self._buf.dtype:
            src = src.to(self._buf.dtype)  # converted on the device, queued like the rest
        self._buf.copy_(src.reshape(()), non_blocking=True)
        self._event.record()
        self._pending = True
