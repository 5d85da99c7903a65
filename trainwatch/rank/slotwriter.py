"""The rank side of a slot: the only code that writes a rank's telemetry.

Each rank writes its own slot, from two threads with one region each (the
training thread region A and its activity marks, the sampler thread region B)
and answers checkpoint requests in region C. See trainwatch.slots for the
layout and the seqlock protocol.
"""

from __future__ import annotations

import math
import struct

from trainwatch.slots import (
    A_DYN,
    ARRIVAL_ENTRY,
    ARRIVALS,
    ARRIVALS_HEAD,
    ARRIVALS_HEAD_OFF,
    ARRIVALS_OFF,
    A_DYN_OFF,
    A_IDENT,
    A_IDENT_OFF,
    A_PHASE,
    A_PHASE_OFF,
    B_HEAD,
    B_HEAD_OFF,
    C_OFF,
    GROUP,
    GROUPS_OFF,
    MAX_GROUPS,
    OFFSETS,
    OP_NAME_BYTES,
    RING,
    RING_ENTRY,
    RING_OFF,
    SEQ,
    STEP_REPORTED,
    CollectiveGroup,
    Segment,
)


_NO_HEALTH = (math.nan,) * 7 + (0,) + (math.nan,) * 3


class SlotWriter:
    """The rank side of one slot. Only the owning rank's threads write here."""

    __slots__ = ("_buf", "_base", "_seq_a", "_seq_b", "_ident", "_dyn", "_dyn_off", "_ph", "_ph_off",
                 "_ring", "_ring_off", "_q", "_qa", "_qb", "_d", "_active", "_batches")

    def __init__(self, segment: Segment, index: int, *, pid: int, rank: int, world_size: int, restart: int):
        self._buf = segment.buf
        self._base = base = segment.offset(index)
        self._seq_a = SEQ.unpack_from(self._buf, base + OFFSETS["seq_a"])[0] & ~1
        self._seq_b = SEQ.unpack_from(self._buf, base + OFFSETS["seq_b"])[0] & ~1
        self._ident = (pid, rank, index, world_size, restart)
        # Sequence numbers are stored as single aligned 8-byte writes through a
        # 'Q' view: struct.pack_into zero-fills before writing, and a reader
        # that caught two such zero windows would take a torn record as whole.
        self._q = segment.buf.cast("Q")
        self._d = segment.buf.cast("d")
        self._qa = (base + OFFSETS["seq_a"]) // 8
        self._qb = (base + OFFSETS["seq_b"]) // 8
        self._active = (base + OFFSETS["active_mono"]) // 8
        self._batches = (base + OFFSETS["batches"]) // 8
        self._dyn = A_DYN.pack_into
        self._dyn_off = base + A_DYN_OFF
        self._ph = A_PHASE.pack_into
        self._ph_off = base + A_PHASE_OFF
        self._ring = RING_ENTRY.pack_into
        self._ring_off = base + RING_OFF

    def write_fast(self, step, loss, grad_norm, step_s, compute_s, progress_mono, start_mono, phase, step_source,
                   phase_mono, py_collectives, peak_loss=math.nan, peak_loss_step=0, peak_grad=math.nan,
                   peak_grad_step=0, first_step=0, colls=-1, seq=-1, health=_NO_HEALTH) -> None:
        """The per-step write: the dynamic fields and this step's ring entry
        (exact end-of-step collective counts), under one seqlock bump.

        health: (lr, loss_scale, zero_grad_frac, data_s, backward_s, optimizer_s,
        peak_step_s, peak_step_s_step, peak_data_s, peak_backward_s, peak_optimizer_s)."""
        s = self._seq_a + 1
        q = self._q
        q[self._qa] = s
        self._dyn(self._buf, self._dyn_off, step, loss, grad_norm, step_s, compute_s, progress_mono, start_mono,
                  phase, step_source, phase_mono, py_collectives, peak_loss, peak_loss_step, peak_grad,
                  peak_grad_step, first_step, *health)
        self._ring(self._buf, self._ring_off + (step % RING) * 24, step, colls, seq)
        self._seq_a = s + 1
        q[self._qa] = s + 1

    def write_step(self, step: int, loss: float, grad_norm: float, step_s: float, compute_s: float,
                   progress_mono: float, start_mono: float, phase: int, phase_mono: float, py_collectives: int,
                   *, step_source: int = STEP_REPORTED, colls: int = -1, seq: int = -1) -> None:
        """Identity and step fields under one seqlock bump: a slot's first write
        (a reader never sees a pid without its start time), and for tools and
        tests that publish a whole record at once."""
        s = self._seq_a + 1
        q = self._q
        q[self._qa] = s
        A_IDENT.pack_into(self._buf, self._base + A_IDENT_OFF, *self._ident)
        self._dyn(self._buf, self._dyn_off, step, loss, grad_norm, step_s, compute_s, progress_mono, start_mono,
                  phase, step_source, phase_mono, py_collectives, math.nan, 0, math.nan, 0, 0, *_NO_HEALTH)
        self._ring(self._buf, self._ring_off + (step % RING) * 24, step, colls, seq)
        self._seq_a = s + 1
        q[self._qa] = s + 1

    def write_phase(self, phase: int, step_source: int, phase_mono: float, py_collectives: int) -> None:
        s = self._seq_a + 1
        q = self._q
        q[self._qa] = s
        self._ph(self._buf, self._ph_off, phase, step_source, phase_mono, py_collectives)
        self._seq_a = s + 1
        q[self._qa] = s + 1

    def mark_active(self, mono: float) -> None:
        """Forward-only progress (a batch, an eval forward): one aligned store."""
        self._d[self._active] = mono

    def count_batch(self, mono: float) -> None:
        self._d[self._active] = mono
        self._q[self._batches] += 1

    def write_sampler(
        self,
        heartbeat_mono: float,
        fr_ok: bool,
        sampled_step: int,
        groups: list[CollectiveGroup] | tuple[CollectiveGroup, ...],
        cpu_s: float = math.nan,
        io_bytes: int = -1,
        arrivals: tuple[int, list[tuple[int, int]]] | None = None,
    ) -> None:
        """One sampler round under seqlock B. arrivals: (arrival_source, [(seq,
        t_ns), ...]) of recent default-group collectives, at most ARRIVALS kept
        (the last ones); None leaves the previous arrivals as they are."""
        base = self._base
        seq = self._seq_b + 1
        self._q[self._qb] = seq
        groups = groups[:MAX_GROUPS]
        B_HEAD.pack_into(self._buf, base + B_HEAD_OFF, heartbeat_mono, int(fr_ok), len(groups), sampled_step, cpu_s,
                         io_bytes)
        for i, g in enumerate(groups):
            GROUP.pack_into(
                self._buf,
                base + GROUPS_OFF + i * GROUP.size,
                g.pg,
                0,
                g.enqueued,
                g.completed,
                g.last_op.encode("ascii", "replace")[:OP_NAME_BYTES],
            )
        if arrivals is not None:
            source, entries = arrivals
            entries = entries[-ARRIVALS:]
            ARRIVALS_HEAD.pack_into(self._buf, base + ARRIVALS_HEAD_OFF, source, len(entries))
            for i in range(ARRIVALS):
                s_, t = entries[i] if i < len(entries) else (0, 0)
                ARRIVAL_ENTRY.pack_into(self._buf, base + ARRIVALS_OFF + i * ARRIVAL_ENTRY.size, s_, t)
        self._seq_b = seq + 1
        self._q[self._qb] = seq + 1

    # control region, rank side
    def read_request(self) -> int:
        return struct.unpack_from("<Q", self._buf, self._base + C_OFF)[0]

    def write_checkpoint_status(self, done_id: int, status: int, step: int) -> None:
        struct.pack_into("<Qi", self._buf, self._base + OFFSETS["ckpt_done"], done_id, status)
        struct.pack_into("<q", self._buf, self._base + OFFSETS["ckpt_step"], step)

    def read_recover_request(self) -> int:
        return struct.unpack_from("<Q", self._buf, self._base + OFFSETS["recover_request"])[0]

    def write_recover_done(self, request_id: int, step: int) -> None:
        struct.pack_into("<i", self._buf, self._base + OFFSETS["recover_step"], max(-1, min(step, 2**31 - 1)))
        struct.pack_into("<Q", self._buf, self._base + OFFSETS["recover_done"], request_id)

    def set_recover_ready(self, ready: bool) -> None:
        """This rank can recover in its own process (trainwatch.rank.inprocess)."""
        struct.pack_into("<i", self._buf, self._base + OFFSETS["recover_ready"], int(ready))

    def set_checkpoint_ready(self) -> None:
        """This rank can answer emergency checkpoint requests (it registered state)."""
        struct.pack_into("<i", self._buf, self._base + OFFSETS["ckpt_ready"], 1)
