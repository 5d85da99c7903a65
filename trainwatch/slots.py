"""Per-node shared-memory telemetry: one fixed-size slot per local rank.

Why shared memory: the sidecar must read a rank's progress while that rank is
stuck in C++ (a collective), holds the GIL (a long gc pause) or is stopped. An
RPC or a pipe needs the rank's cooperation; a mapped file does not.

Each slot has three regions, each with exactly one writer:

  A  step region     training thread   (seqlock A)  step, loss, phase, ...
  B  sampler region  sampler thread    (seqlock B)  heartbeat, collective seq
  C  control region  sidecar -> rank   (plain)      emergency checkpoint requests

A seqlock lets the single writer publish without locks or syscalls: bump the
sequence to odd, write, bump to even. A reader retries while the sequence is
odd or changed under it. On x86 (TSO) stores through the mapping become visible
in program order, which is all a seqlock needs here.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass, field

MAGIC = b"TWSLOT01"
LAYOUT_VERSION = 2
HEADER = struct.Struct("<8sIII")  # magic, version, nslots, slot_size
HEADER_SIZE = 64
SLOT_SIZE = 512
MAX_GROUPS = 4
OP_NAME_BYTES = 16

PHASES = (
    "init",
    "data",
    "forward",
    "backward",
    "optimizer",
    "checkpoint",
    "eval",
    "compute",
    "collective",
    "done",
)
PHASE_CODES = {name: code for code, name in enumerate(PHASES)}
# Phases in which a rank may be blocked on its peers; their time is not "compute".
WAIT_PHASES = frozenset({"backward", "collective"})
# Phases with honest long pauses; the hang detector is lenient there.
SLOW_PHASES = frozenset({"init", "checkpoint", "eval"})

# Region A: seq, pid, rank, local_rank, world_size, restart, step, loss,
# grad_norm, step_s, compute_s, progress_mono, start_mono, phase, pad,
# phase_mono, py_collectives
SEQ = struct.Struct("<Q")
A_BODY = struct.Struct("<qiiiiqddddddiidq")
A_OFF = 0
A_BODY_OFF = A_OFF + SEQ.size
# Hot-path sub-structs of region A (the identity fields are written once).
A_DYN = struct.Struct("<qddddddiidqdqdq")  # step .. py_collectives, then the peaks
A_DYN_OFF = A_BODY_OFF + 24
A_PHASE = struct.Struct("<iidq")  # phase, pad, phase_mono, py_collectives
A_PHASE_OFF = A_BODY_OFF + 80
# Region B: seq, heartbeat_mono, fr_ok, ngroups, sampled_step, then groups
B_OFF = 160
B_HEAD = struct.Struct("<diiq")
B_HEAD_OFF = B_OFF + SEQ.size
GROUP = struct.Struct("<iiqq16s")  # pg id, pad, enqueued, completed, last op
B_GROUPS_OFF = B_HEAD_OFF + B_HEAD.size
# Region C: ckpt_request, ckpt_done, ckpt_status, pad, ckpt_step, then read_ack
C_OFF = 384
CONTROL = struct.Struct("<QQiiq")
# The sidecar bumps read_ack after every read; the rank keeps the worst loss and
# grad norm (and their steps) seen since the last bump. A one-step spike shorter
# than the sidecar's read interval is thus never lost to sampling.
ACK_OFF = C_OFF + CONTROL.size

CKPT_IDLE, CKPT_WRITING, CKPT_OK, CKPT_FAILED = 0, 1, 2, 3


def _numpy_dtype():
    """The slot layout as a numpy structured dtype: the sidecar copies the whole
    segment in one memcpy and detectors work on columns, so a 4096-rank tick
    costs milliseconds, not a Python loop over slots."""
    import numpy as np

    group = np.dtype(
        {"names": ["pg", "enqueued", "completed", "last_op"], "formats": ["<i4", "<i8", "<i8", "S16"],
         "offsets": [0, 8, 16, 24], "itemsize": GROUP.size}
    )
    fields = [
        ("seq_a", "<u8", 0), ("pid", "<i8", 8), ("rank", "<i4", 16), ("local_rank", "<i4", 20),
        ("world_size", "<i4", 24), ("restart", "<i4", 28), ("step", "<i8", 32), ("loss", "<f8", 40),
        ("grad_norm", "<f8", 48), ("step_s", "<f8", 56), ("compute_s", "<f8", 64),
        ("progress_mono", "<f8", 72), ("start_mono", "<f8", 80), ("phase", "<i4", 88),
        ("phase_mono", "<f8", 96), ("py_collectives", "<i8", 104),
        ("seq_b", "<u8", B_OFF), ("heartbeat_mono", "<f8", B_HEAD_OFF), ("fr_ok", "<i4", B_HEAD_OFF + 8),
        ("ngroups", "<i4", B_HEAD_OFF + 12), ("sampled_step", "<i8", B_HEAD_OFF + 16),
        ("groups", (group, (MAX_GROUPS,)), B_GROUPS_OFF),
        ("ckpt_request", "<u8", C_OFF), ("ckpt_done", "<u8", C_OFF + 8), ("ckpt_status", "<i4", C_OFF + 16),
        ("ckpt_step", "<i8", C_OFF + 24),
        ("peak_loss", "<f8", A_DYN_OFF + 80), ("peak_loss_step", "<i8", A_DYN_OFF + 88),
        ("peak_grad", "<f8", A_DYN_OFF + 96), ("peak_grad_step", "<i8", A_DYN_OFF + 104),
        ("read_ack", "<u8", ACK_OFF),
    ]
    return np.dtype(
        {"names": [f[0] for f in fields], "formats": [f[1] for f in fields],
         "offsets": [f[2] for f in fields], "itemsize": SLOT_SIZE}
    )


_DTYPE = None


def slot_dtype():
    global _DTYPE
    if _DTYPE is None:
        _DTYPE = _numpy_dtype()
    return _DTYPE

assert A_BODY_OFF + A_BODY.size <= B_OFF
assert B_GROUPS_OFF + MAX_GROUPS * GROUP.size <= C_OFF
assert A_DYN_OFF + A_DYN.size <= B_OFF
assert ACK_OFF + 8 <= SLOT_SIZE


@dataclass(frozen=True, slots=True)
class CollectiveGroup:
    """Collective progress of one process group as seen by one rank."""

    pg: int
    """Process group id (flight recorder's pg id; 0 is the default group)."""
    enqueued: int
    """Sequence number of the last collective this rank launched."""
    completed: int
    """Sequence number of the last collective that finished on this rank."""
    last_op: str
    """Name of the last launched collective (e.g. 'allreduce'), '' if unknown."""


@dataclass(frozen=True, slots=True)
class RankSnapshot:
    """One consistent read of a rank's slot. Times are CLOCK_MONOTONIC seconds."""

    local_rank: int
    pid: int
    rank: int
    world_size: int
    restart: int
    step: int
    loss: float
    grad_norm: float
    step_s: float
    compute_s: float
    progress_mono: float
    start_mono: float
    phase: str
    phase_mono: float
    py_collectives: int
    heartbeat_mono: float
    fr_ok: bool
    sampled_step: int
    groups: tuple[CollectiveGroup, ...] = field(default_factory=tuple)
    node: str = ""
    peak_loss: float = math.nan
    """Worst loss since the sidecar's previous read (see ACK_OFF)."""
    peak_loss_step: int = 0
    """Step of peak_loss; 0 when none was reported."""

    @property
    def alive(self) -> bool:
        return self.pid > 0


def default_segment_dir() -> str:
    """/dev/shm when usable (RAM, no disk IO), else the system temp dir."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    import tempfile

    return tempfile.gettempdir()


def create_segment(path: str, nslots: int) -> None:
    """Create (or reset) a zeroed segment file with room for nslots ranks."""
    size = HEADER_SIZE + nslots * SLOT_SIZE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, size)
        os.pwrite(fd, HEADER.pack(MAGIC, LAYOUT_VERSION, nslots, SLOT_SIZE), 0)
    finally:
        os.close(fd)


class Segment:
    """A mapped slot segment. The sidecar and each rank open the same file."""

    def __init__(self, path: str):
        self.path = path
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_SIZE:
                raise ValueError(f"{path} is not a trainwatch slot segment (too small)")
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, version, nslots, slot_size = HEADER.unpack_from(self._mm, 0)
        if magic != MAGIC or version != LAYOUT_VERSION or slot_size != SLOT_SIZE:
            self._mm.close()
            raise ValueError(f"{path} has an unknown slot layout (magic={magic!r}, version={version})")
        self.nslots = nslots
        self.buf = memoryview(self._mm)
        self._ack_idx = None
        self._words = None

    def offset(self, index: int) -> int:
        if not 0 <= index < self.nslots:
            raise IndexError(f"slot {index} out of range 0..{self.nslots - 1}")
        return HEADER_SIZE + index * SLOT_SIZE

    def close(self) -> None:
        self._words = None
        try:
            self.buf.release()
            self._mm.close()
        except (BufferError, ValueError):
            pass  # a live export (e.g. a writer still holding a view) keeps it mapped

    # ---- reading (sidecar) -------------------------------------------------

    def read(self, index: int, retries: int = 64) -> RankSnapshot | None:
        """Consistent snapshot of a slot, or None if it was never written.

        Bounded retries: a writer that died mid-write leaves an odd sequence
        forever; after the retries we return the torn read rather than block.
        """
        base = self.offset(index)
        buf = self.buf
        a = b = None
        for _ in range(retries):
            s1 = SEQ.unpack_from(buf, base + A_OFF)[0]
            a = A_BODY.unpack_from(buf, base + A_BODY_OFF)
            s2 = SEQ.unpack_from(buf, base + A_OFF)[0]
            if s1 == s2 and not s1 & 1:
                break
        for _ in range(retries):
            s1 = SEQ.unpack_from(buf, base + B_OFF)[0]
            b = B_HEAD.unpack_from(buf, base + B_HEAD_OFF)
            ngroups = max(0, min(b[2], MAX_GROUPS))
            groups = tuple(
                GROUP.unpack_from(buf, base + B_GROUPS_OFF + i * GROUP.size) for i in range(ngroups)
            )
            s2 = SEQ.unpack_from(buf, base + B_OFF)[0]
            if s1 == s2 and not s1 & 1:
                break
        pid = a[0]
        if pid == 0:
            return None
        peak_loss, peak_loss_step = struct.unpack_from("<dq", buf, base + A_DYN_OFF + 80)
        phase_code = a[12]
        return RankSnapshot(
            local_rank=a[2],
            pid=pid,
            rank=a[1],
            world_size=a[3],
            restart=a[4],
            step=a[5],
            loss=a[6],
            grad_norm=a[7],
            step_s=a[8],
            compute_s=a[9],
            progress_mono=a[10],
            start_mono=a[11],
            phase=PHASES[phase_code] if 0 <= phase_code < len(PHASES) else "init",
            phase_mono=a[14],
            py_collectives=a[15],
            heartbeat_mono=b[0],
            fr_ok=bool(b[1]),
            sampled_step=b[3],
            groups=tuple(
                CollectiveGroup(g[0], g[2], g[3], g[4].rstrip(b"\0").decode("ascii", "replace"))
                for g in groups
            ),
            peak_loss=peak_loss,
            peak_loss_step=peak_loss_step,
        )

    def read_table(self, retries: int = 16, previous=None):
        """All slots as one numpy structured array (dtype `slot_dtype()`), copied
        out of the mapping. Seqlock reader: sequence numbers are read before and
        after the copy; rows written meanwhile are re-read. A row still torn
        after the retries (its writer is mid-write right now) takes its value
        from `previous` (the last good table) or is returned empty (pid 0)."""
        import numpy as np

        dt = slot_dtype()
        raw = np.frombuffer(self.buf, dtype=dt, count=self.nslots, offset=HEADER_SIZE)
        seq = raw[["seq_a", "seq_b"]]
        before = seq.copy()
        table = raw.copy()
        after = seq.copy()
        torn = _torn(before, after)
        for _ in range(retries):
            if not torn.any():
                return table
            idx = np.nonzero(torn)[0]
            before = seq[idx].copy()
            table[idx] = raw[idx]
            after = seq[idx].copy()
            torn[idx] = _torn(before, after)
        if torn.any():
            idx = np.nonzero(torn)[0]
            if previous is not None and len(previous) == len(table):
                table[idx] = previous[idx]
            else:
                table["pid"][idx] = 0
        return table

    def read_all(self) -> list[RankSnapshot]:
        return [s for s in (self.read(i) for i in range(self.nslots)) if s is not None]

    # ---- control region (sidecar writes the request, rank writes the rest) --

    def read_control(self, index: int) -> tuple[int, int, int, int]:
        """(request id, done id, status, step) of the emergency-checkpoint channel."""
        req, done, status, _pad, step = CONTROL.unpack_from(self.buf, self.offset(index) + C_OFF)
        return req, done, status, step

    def acknowledge_read(self, counter: int) -> None:
        """Tell every rank its slot was read (they restart their peak windows)."""
        import numpy as np

        if self._ack_idx is None:
            self._ack_idx = np.array([(self.offset(i) + ACK_OFF) // 8 for i in range(self.nslots)])
            self._words = np.frombuffer(self.buf, dtype="<u8")
        self._words[self._ack_idx] = counter

    def request_checkpoint(self, index: int, request_id: int) -> None:
        struct.pack_into("<Q", self.buf, self.offset(index) + C_OFF, request_id)

    def clear(self, index: int) -> None:
        """Zero a slot (a restarted rank starts from a clean slate)."""
        base = self.offset(index)
        self.buf[base : base + SLOT_SIZE] = bytes(SLOT_SIZE)


def _torn(before, after):
    return (
        ((before["seq_a"] | before["seq_b"]) & 1).astype(bool)
        | (before["seq_a"] != after["seq_a"])
        | (before["seq_b"] != after["seq_b"])
    )


class SlotWriter:
    """The rank side of one slot. Only the owning rank's threads write here."""

    __slots__ = ("_buf", "_base", "_seq_a", "_seq_b", "_ident", "_a_off", "_seq_off", "_body",
                 "_dyn", "_dyn_off", "_ph", "_ph_off", "_q", "_qa", "_qb")

    def __init__(self, segment: Segment, index: int, *, pid: int, rank: int, world_size: int, restart: int):
        self._buf = segment.buf
        self._base = segment.offset(index)
        self._seq_a = SEQ.unpack_from(self._buf, self._base + A_OFF)[0] & ~1
        self._seq_b = SEQ.unpack_from(self._buf, self._base + B_OFF)[0] & ~1
        self._ident = (pid, rank, index, world_size, restart)
        self._a_off = self._base + A_BODY_OFF
        self._seq_off = self._base + A_OFF
        self._body = A_BODY.pack_into
        # Sequence numbers are stored as single aligned 8-byte writes through a
        # 'Q' view: struct.pack_into zero-fills before writing, and a reader
        # that caught two such zero windows would take a torn record as whole.
        self._q = segment.buf.cast("Q")
        self._qa = (self._base + A_OFF) // 8
        self._qb = (self._base + B_OFF) // 8
        self._dyn = A_DYN.pack_into
        self._dyn_off = self._base + A_DYN_OFF
        self._ph = A_PHASE.pack_into
        self._ph_off = self._base + A_PHASE_OFF

    def write_fast(self, step, loss, grad_norm, step_s, compute_s, progress_mono, start_mono, phase, phase_mono,
                   py_collectives, peak_loss=math.nan, peak_loss_step=0, peak_grad=math.nan,
                   peak_grad_step=0) -> None:
        """write_step without the identity fields (written once by write_step):
        the per-step call, kept to three struct writes."""
        seq = self._seq_a + 1
        q = self._q
        q[self._qa] = seq
        self._dyn(self._buf, self._dyn_off, step, loss, grad_norm, step_s, compute_s, progress_mono, start_mono,
                  phase, 0, phase_mono, py_collectives, peak_loss, peak_loss_step, peak_grad, peak_grad_step)
        self._seq_a = seq + 1
        q[self._qa] = seq + 1

    def write_phase(self, phase: int, phase_mono: float, py_collectives: int) -> None:
        seq = self._seq_a + 1
        q = self._q
        q[self._qa] = seq
        self._ph(self._buf, self._ph_off, phase, 0, phase_mono, py_collectives)
        self._seq_a = seq + 1
        q[self._qa] = seq + 1

    def write_step(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        step_s: float,
        compute_s: float,
        progress_mono: float,
        start_mono: float,
        phase: int,
        phase_mono: float,
        py_collectives: int,
    ) -> None:
        seq = self._seq_a + 1
        self._q[self._qa] = seq
        pid, rank, local_rank, world, restart = self._ident
        self._body(
            self._buf,
            self._a_off,
            pid,
            rank,
            local_rank,
            world,
            restart,
            step,
            loss,
            grad_norm,
            step_s,
            compute_s,
            progress_mono,
            start_mono,
            phase,
            0,
            phase_mono,
            py_collectives,
        )
        self._seq_a = seq + 1
        self._q[self._qa] = seq + 1

    def write_sampler(
        self,
        heartbeat_mono: float,
        fr_ok: bool,
        sampled_step: int,
        groups: list[CollectiveGroup] | tuple[CollectiveGroup, ...],
    ) -> None:
        base = self._base
        seq = self._seq_b + 1
        self._q[self._qb] = seq
        groups = groups[:MAX_GROUPS]
        B_HEAD.pack_into(self._buf, base + B_HEAD_OFF, heartbeat_mono, int(fr_ok), len(groups), sampled_step)
        for i, g in enumerate(groups):
            GROUP.pack_into(
                self._buf,
                base + B_GROUPS_OFF + i * GROUP.size,
                g.pg,
                0,
                g.enqueued,
                g.completed,
                g.last_op.encode("ascii", "replace")[:OP_NAME_BYTES],
            )
        self._seq_b = seq + 1
        self._q[self._qb] = seq + 1

    # control region, rank side
    def read_request(self) -> int:
        return struct.unpack_from("<Q", self._buf, self._base + C_OFF)[0]

    def write_checkpoint_status(self, done_id: int, status: int, step: int) -> None:
        struct.pack_into("<Qiiq", self._buf, self._base + C_OFF + 8, done_id, status, 0, step)


NAN = math.nan
