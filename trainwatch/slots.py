"""Per-node shared-memory telemetry: one fixed-size slot per local rank.

Why shared memory: the sidecar must read a rank's progress while that rank is
stuck in C++ (a collective), holds the GIL (a long gc pause) or is stopped. An
RPC or a pipe needs the rank's cooperation; a mapped file does not.

Each slot has four regions, each with exactly one writer:

  A  step region      training thread   (seqlock A)  step, loss, phase, end-of-step collective counts
  P  activity marks   training thread   (plain)      last forward-only progress, batches seen
  B  sampler region   sampler thread    (seqlock B)  heartbeat, CPU time, collective seq per group
  C  control region   sidecar <-> rank  (plain)      emergency checkpoint requests, read acks

Every field is declared once, in LAYOUT below; offsets, the struct formats the
writers use and the numpy dtype the sidecar reads with are all derived from it.

A seqlock lets the single writer publish without locks or syscalls: bump the
sequence to odd, write, bump to even. A reader retries while the sequence is
odd or changed under it. On x86 (TSO) stores through the mapping become visible
in program order, which is all a seqlock needs here. Region P holds single
aligned 8-byte words, each of which is whole on its own.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import struct
from dataclasses import dataclass

MAGIC = b"TWSLOT01"
LAYOUT_VERSION = 5
HEADER = struct.Struct("<8sIII")  # magic, version, nslots, slot_size
HEADER_SIZE = 64
SLOT_SIZE = 1024
MAX_GROUPS = 4
"""Process groups published per rank (the flight recorder's first groups by id)."""
RING = 4
"""End-of-step collective counts kept per rank: ranks within this many steps of
each other can be compared at equal step numbers."""
OP_NAME_BYTES = 16
ARRIVALS = 16
"""Collective arrival times kept per rank (region B): the time each rank
entered recent collectives of the default group, by sequence number, for the
zero-code straggler detector (the rank that arrives last is the straggler)."""
ARRIVAL_NONE, ARRIVAL_ENQUEUED, ARRIVAL_STARTED = 0, 1, 2
"""arrival_source: no arrivals; the time the rank enqueued each collective
(flight recorder `time_created_ns`: gloo, NCCL without timing); the time the
collective started on the device (`time_discovered_started_ns`, NCCL with
TORCH_NCCL_ENABLE_TIMING=1)."""

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

STEP_COUNTED, STEP_REPORTED = 0, 1
"""step_source: steps counted by trainwatch's zero-code hooks (optimizer steps
since this process started), or reported by the script (tw.step(step=N))."""

CKPT_IDLE, CKPT_WRITING, CKPT_OK, CKPT_FAILED = 0, 1, 2, 3


def phase_name(code: int) -> str:
    """Phase name for a slot's phase code ('init' for codes from a newer layout)."""
    code = int(code)
    return PHASES[code] if 0 <= code < len(PHASES) else "init"


# ---- the layout, declared once ---------------------------------------------------
#
# (name, struct code, count) per region, in order. A tuple code is a record
# (its own field list) repeated `count` times. Offsets follow natural
# alignment; each region starts on a 64-byte boundary.

GROUP_FIELDS = (
    ("pg", "i", 1),  # process group id (flight recorder's; 0 is the default group)
    ("_pad", "i", 1),
    ("enqueued", "q", 1),  # sequence number of the last collective this rank launched
    ("completed", "q", 1),  # ... and of the last one that finished on this rank
    ("last_op", f"{OP_NAME_BYTES}s", 1),  # name of the last launched collective
)
ARRIVAL_FIELDS = (
    ("seq", "q", 1),  # the collective's sequence number on the default group (0: empty)
    ("t_ns", "q", 1),  # when this rank arrived at it (CLOCK_REALTIME ns: comparable across nodes)
)
RING_FIELDS = (
    ("step", "q", 1),  # the step this entry closes (0: empty)
    ("colls", "q", 1),  # Python collectives on world-spanning groups issued by the end of it
    ("seq", "q", 1),  # the default process group's sequence number at its end (-1: unknown)
)

LAYOUT = {
    "A": (
        ("seq_a", "Q", 1),
        ("pid", "q", 1),
        ("rank", "i", 1),
        ("local_rank", "i", 1),
        ("world_size", "i", 1),
        ("restart", "i", 1),
        ("step", "q", 1),  # last completed step (0: none yet)
        ("loss", "d", 1),
        ("grad_norm", "d", 1),
        ("step_s", "d", 1),  # duration of the last step
        ("compute_s", "d", 1),  # ... less time in phases that wait on peers
        ("progress_mono", "d", 1),  # when the last step completed
        ("start_mono", "d", 1),  # when the process attached
        ("phase", "i", 1),
        ("step_source", "i", 1),  # STEP_COUNTED or STEP_REPORTED
        ("phase_mono", "d", 1),  # when the current phase began
        ("py_collectives", "q", 1),  # Python collectives issued so far (all groups)
        ("peak_loss", "d", 1),  # worst loss since the sidecar's last read (see read_ack)
        ("peak_loss_step", "q", 1),
        ("peak_grad", "d", 1),
        ("peak_grad_step", "q", 1),
        ("first_step", "q", 1),  # the first step this process completed (where it resumed + 1)
        # Training-health signals of the last step (NaN: not known).
        ("lr", "d", 1),  # learning rate of the optimizer's first param group
        ("loss_scale", "d", 1),  # GradScaler's scale (fp16 mixed precision)
        ("zero_grad_frac", "d", 1),  # fraction of gradient elements exactly zero
        ("data_s", "d", 1),  # time in the data phase during the last step
        ("backward_s", "d", 1),  # ... in backward (gradient computation and its overlapped communication)
        ("optimizer_s", "d", 1),  # ... in the optimizer step
        # The slowest step since the sidecar's last read (see read_ack) and where its time went.
        ("peak_step_s", "d", 1),
        ("peak_step_s_step", "q", 1),
        ("peak_data_s", "d", 1),
        ("peak_backward_s", "d", 1),
        ("peak_optimizer_s", "d", 1),
        ("ring", RING_FIELDS, RING),  # end-of-step collective counts, entry = step % RING
    ),
    "P": (
        ("active_mono", "d", 1),  # last forward-only progress (a batch fetched, a no_grad block done)
        ("batches", "q", 1),  # DataLoader batches fetched
    ),
    "B": (
        ("seq_b", "Q", 1),
        ("heartbeat_mono", "d", 1),
        ("fr_ok", "i", 1),
        ("ngroups", "i", 1),
        ("sampled_step", "q", 1),
        ("cpu_s", "d", 1),  # process CPU time (user + system) at the heartbeat
        ("io_bytes", "q", 1),  # bytes the process read + wrote through syscalls so far (-1: unknown)
        ("groups", GROUP_FIELDS, MAX_GROUPS),
        ("arrival_source", "i", 1),  # ARRIVAL_NONE / ARRIVAL_ENQUEUED / ARRIVAL_STARTED
        ("narrivals", "i", 1),
        ("arrivals", ARRIVAL_FIELDS, ARRIVALS),  # entries in no particular order; seq 0 is empty
    ),
    "C": (
        ("ckpt_request", "Q", 1),
        ("ckpt_done", "Q", 1),
        ("ckpt_status", "i", 1),
        ("ckpt_ready", "i", 1),  # 1 once the rank registered state an emergency checkpoint can write
        ("ckpt_step", "q", 1),
        # After every read the sidecar stores here the step it read in this slot
        # (+1, so 0 means "never read"). The rank keeps the worst loss, grad
        # norm and step time since; a peak the sidecar has not read yet (a step
        # after the one acknowledged: it was published between the sidecar's
        # copy and its acknowledgement) is kept, so a one-step spike shorter
        # than the read interval is never lost to sampling or to that race.
        ("read_ack", "Q", 1),
        # In-process recovery (trainwatch.rank.inprocess): the sidecar's request, the rank's answer.
        ("recover_request", "Q", 1),
        ("recover_done", "Q", 1),
        ("recover_step", "i", 1),
        ("recover_ready", "i", 1),  # 1 once the rank can recover in its own process
    ),
}


def _record_size(fields) -> tuple[int, dict[str, int]]:
    offsets, pos = {}, 0
    for name, code, count in fields:
        size, align = _size_align(code)
        pos = (pos + align - 1) // align * align
        offsets[name] = pos
        pos += size * count
    return (pos + 7) // 8 * 8, offsets


def _size_align(code) -> tuple[int, int]:
    if isinstance(code, tuple):
        return _record_size(code)[0], 8
    size = struct.calcsize("<" + code)
    return size, min(size, 8) if not code.endswith("s") else 1


def _derive():
    offsets: dict[str, int] = {}
    pos = 0
    for region, fields in LAYOUT.items():
        pos = (pos + 63) // 64 * 64
        offsets["region_" + region] = pos
        size, rel = _record_size(fields)
        for name, off in rel.items():
            offsets[name] = pos + off
        pos += size
    if pos > SLOT_SIZE:
        raise AssertionError(f"slot layout needs {pos} bytes; SLOT_SIZE is {SLOT_SIZE}")
    return offsets


OFFSETS = _derive()
_CODES = {name: (code, count) for fields in LAYOUT.values() for name, code, count in fields}


def run(first: str, last: str) -> tuple[int, struct.Struct]:
    """(offset, Struct) packing the scalar fields first..last of one region in
    one call, padding included: what the writers use on the hot path."""
    names = [n for fields in LAYOUT.values() for n, _c, _k in fields]
    sel = names[names.index(first): names.index(last) + 1]
    fmt, pos = "<", OFFSETS[first]
    for name in sel:
        code, count = _CODES[name]
        if isinstance(code, tuple) or count != 1:
            raise ValueError(f"{name} is not a scalar field")
        gap = OFFSETS[name] - pos
        size = struct.calcsize("<" + code)
        # Padding fields ("_pad") are skipped bytes, never values.
        fmt += "x" * gap + ("x" * size if name.startswith("_") else code)
        pos = OFFSETS[name] + size
    return OFFSETS[first], struct.Struct(fmt)


def _np_format(code, count):
    import numpy as np

    if isinstance(code, tuple):
        size, rel = _record_size(code)
        sub = np.dtype({"names": [n for n, _c, _k in code if not n.startswith("_")],
                        "formats": [_np_format(c, k) for n, c, k in code if not n.startswith("_")],
                        "offsets": [rel[n] for n, _c, _k in code if not n.startswith("_")], "itemsize": size})
        return (sub, (count,))
    return "<" + ("S" + code[:-1] if code.endswith("s") else {"Q": "u8", "q": "i8", "i": "i4", "d": "f8"}[code])


_DTYPE = None


def slot_dtype():
    """The slot layout as a numpy structured dtype: the sidecar copies the whole
    segment in one memcpy and detectors work on columns, so a 4096-rank tick
    costs milliseconds, not a Python loop over slots."""
    global _DTYPE
    if _DTYPE is None:
        import numpy as np

        names = [n for n, (c, k) in _CODES.items() if not n.startswith("_")]
        _DTYPE = np.dtype({"names": names, "formats": [_np_format(*_CODES[n]) for n in names],
                           "offsets": [OFFSETS[n] for n in names], "itemsize": SLOT_SIZE})
    return _DTYPE


# Writers' structs, derived from the layout.
SEQ = struct.Struct("<Q")
A_IDENT_OFF, A_IDENT = run("pid", "restart")
A_DYN_OFF, A_DYN = run("step", "peak_optimizer_s")
A_PHASE_OFF, A_PHASE = run("phase", "py_collectives")
RING_OFF = OFFSETS["ring"]
RING_ENTRY = struct.Struct("<qqq")
B_HEAD_OFF, B_HEAD = run("heartbeat_mono", "io_bytes")
GROUP = struct.Struct("<ii" + "qq" + f"{OP_NAME_BYTES}s")
GROUPS_OFF = OFFSETS["groups"]
ARRIVALS_HEAD_OFF, ARRIVALS_HEAD = run("arrival_source", "narrivals")
ARRIVAL_ENTRY = struct.Struct("<qq")
ARRIVALS_OFF = OFFSETS["arrivals"]
C_OFF, CONTROL = run("ckpt_request", "ckpt_step")
ACK_OFF = OFFSETS["read_ack"]
R_OFF, RECOVERY = run("recover_request", "recover_ready")


@dataclass(frozen=True, slots=True)
class CollectiveGroup:
    """Collective progress of one process group as seen by one rank."""

    pg: int
    """Process group id (flight recorder's pg id; 0 is the default group)."""
    enqueued: int
    """Sequence number of the last collective this rank launched."""
    completed: int
    """Sequence number of the last collective that finished on this rank."""
    last_op: str = ""
    """Name of the last launched collective (e.g. 'allreduce'), '' if unknown."""


def default_segment_dir() -> str:
    """/dev/shm when usable (RAM, no disk IO), else the system temp dir."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    import tempfile

    return tempfile.gettempdir()


def create_segment(path: str, nslots: int) -> None:
    """Create a new zeroed segment file with room for nslots ranks, mode 0600.

    /dev/shm is world-writable: the path must not exist yet (every run names
    its own segment), so a file or symlink someone planted there is refused,
    never followed or reused."""
    size = HEADER_SIZE + nslots * SLOT_SIZE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise ValueError(f"refusing to use {path}: it already exists (planted, or left by a run that "
                         "did not clean up); remove it if no trainwatch job of yours uses it") from None
    except OSError as e:
        raise ValueError(f"cannot create the slot segment {path} ({e.strerror})") from None
    try:
        os.ftruncate(fd, size)
        # The pages now, not at a rank's first write: a full /dev/shm is one line here, not a SIGBUS there.
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):  # a filesystem that cannot reserve: as before
                raise
        os.pwrite(fd, HEADER.pack(MAGIC, LAYOUT_VERSION, nslots, SLOT_SIZE), 0)
    except OSError as e:
        os.unlink(path)
        raise ValueError(f"cannot create the slot segment {path} ({e.strerror}; {size} bytes): free space in "
                         f"{os.path.dirname(path)} (a container's --shm-size)") from None
    finally:
        os.close(fd)


class Segment:
    """A mapped slot segment. The sidecar and each rank open the same file."""

    def __init__(self, path: str):
        self.path = path
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise ValueError(f"refusing to open {path}: it is a symlink, not a segment trainwatch created") from None
            raise
        try:
            st = os.fstat(fd)
            size = st.st_size
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise ValueError(f"refusing to open {path}: not a private regular file of this user "
                                 f"(owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}); remove it")
            if size < HEADER_SIZE:
                raise ValueError(f"{path} is not a trainwatch slot segment (too small)")
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, version, nslots, slot_size = HEADER.unpack_from(self._mm, 0)
        if magic != MAGIC or version != LAYOUT_VERSION or slot_size != SLOT_SIZE:
            self._mm.close()
            raise ValueError(f"{path} has an unknown slot layout (magic={magic!r}, version={version})")
        if nslots < 1:
            self._mm.close()
            raise ValueError(f"{path} is not a usable slot segment: its header claims {nslots} slots")
        if HEADER_SIZE + nslots * SLOT_SIZE > size:
            self._mm.close()
            raise ValueError(f"{path} is truncated: its header claims {nslots} slots, the file holds fewer")
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

    # ---- reading (sidecar, diagnose) ---------------------------------------------

    def read_table(self, retries: int = 16, previous=None):
        """All slots as one numpy structured array (dtype `slot_dtype()`), copied
        out of the mapping. Seqlock reader: sequence numbers are read before and
        after the copy; rows written meanwhile are re-read. A row still torn
        after the retries (its writer is mid-write right now) takes its value
        from `previous` (the last good table) or is returned empty (pid 0)."""
        import numpy as np

        dt = slot_dtype()
        raw = np.frombuffer(self.buf, dtype=dt, count=self.nslots, offset=HEADER_SIZE)
        # The two sequence columns alone (8 bytes a row), not the whole rows.
        before = _seqs(raw)
        table = raw.copy()
        after = _seqs(raw)
        torn = _torn(before, after)
        for _ in range(retries):
            if not torn.any():
                return table
            idx = np.nonzero(torn)[0]
            before = _seqs(raw, idx)
            table[idx] = raw[idx]
            after = _seqs(raw, idx)
            torn[idx] = _torn(before, after)
        if torn.any():
            idx = np.nonzero(torn)[0]
            if previous is not None and len(previous) == len(table):
                table[idx] = previous[idx]
            else:
                table["pid"][idx] = 0
        return table

    # ---- control region (sidecar writes the request, rank writes the rest) --

    def read_control(self, index: int) -> tuple[int, int, int, int]:
        """(request id, done id, status, step) of the emergency-checkpoint channel."""
        req, done, status, _ready, step = CONTROL.unpack_from(self.buf, self.offset(index) + C_OFF)
        return req, done, status, step

    def acknowledge_read(self, table) -> None:
        """Tell every rank which of its steps was read (`table` is the full table
        `read_table` returned, one row per slot): each rank restarts its peak
        window from the steps after that one."""
        import numpy as np

        if self._ack_idx is None:
            self._ack_idx = np.array([(self.offset(i) + ACK_OFF) // 8 for i in range(self.nslots)])
            self._words = np.frombuffer(self.buf, dtype="<u8")
        self._words[self._ack_idx] = np.maximum(table["step"], -1).astype(np.int64) + 1

    def request_checkpoint(self, index: int, request_id: int) -> None:
        struct.pack_into("<Q", self.buf, self.offset(index) + C_OFF, request_id)

    def clear(self, index: int) -> None:
        """Zero a slot (a restarted rank starts from a clean slate)."""
        base = self.offset(index)
        self.buf[base : base + SLOT_SIZE] = bytes(SLOT_SIZE)


def _seqs(raw, idx=None):
    a, b = raw["seq_a"], raw["seq_b"]
    return (a.copy(), b.copy()) if idx is None else (a[idx], b[idx])


def _torn(before, after):
    return ((before[0] | before[1]) & 1).astype(bool) | (before[0] != after[0]) | (before[1] != after[1])
