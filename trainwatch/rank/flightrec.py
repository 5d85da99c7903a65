"""What the rank's background thread samples: collective sequence numbers per
process group from PyTorch's flight recorders (NCCL's own and the generic one
gloo uses), when this rank arrived at recent collectives of the default group
(for the zero-code straggler detector), the default group's sequence counter
for the step path, and the process's I/O counter.

The flight recorder's API is private: every read is guarded by presence and
shape and falls back to None (the sampler then publishes its own counts).
"""

from __future__ import annotations

import json
import math
import os
import time
import zlib
from collections.abc import Callable

from trainwatch import env, slots


DUMPS = ("_dump_nccl_trace_json", "_dump_fr_trace_json")
"""torch's flight-recorder dumps: ProcessGroupNCCL's own recorder, then the generic one (gloo)."""


def merged_dump(dumps, **kw) -> dict:
    """One dump of several recorders: their entries in turn, their groups' status
    together (process-group ids are numbered across backends, so they never clash).
    A recorder that fails is left out; all failing raises the last error."""
    entries: list = []
    status: dict = {}
    error: Exception | None = None
    ok = False
    for fn in dumps:
        try:
            data = json.loads(fn(**kw))
        except Exception as e:  # noqa: BLE001 - a private API: try the others
            error = e
            continue
        if not isinstance(data, dict):
            error = TypeError("a flight recorder dump of an unknown shape")
            continue
        ok = True
        if isinstance(data.get("entries"), list):
            entries += data["entries"]
        if isinstance(data.get("pg_status"), dict):
            status.update(data["pg_status"])
    if not ok:
        raise error or RuntimeError("no flight recorder dump")
    return {"entries": entries, "pg_status": status}
FULL_READ_DUTY = 0.005
"""Fraction of wall time the whole-buffer reads may take: a dump of 2000 entries
costs tens of milliseconds (the JSON is built in C++ and parsed here), so it is
read at most once per cost / FULL_READ_DUTY, and only when collectives ran. The
cost is that of the buffer as it is now: the last read's cost scaled by the
entries added since (a read of a young buffer is cheap, the next one is not)."""
SCALE_FROM = 200
"""Entries below which a read's cost is taken as fixed, not per entry."""
FULL_READ_MIN_S = 1.0
"""...and at most once a second."""
PARKED_READ_S = 1.0
"""A collective outstanding this long (the rank waits in it, its CPU is idle) is read in
full at once, so its op is published for the mismatch detector's comparison."""


class FlightRecorderReader:
    """Reads per-group collective sequence numbers from PyTorch's flight recorder.

    Every round reads only the per-group status (`includeCollectives=False`:
    sequence numbers, a tenth of a millisecond whatever the buffer holds).
    The entries themselves (op names, group names, arrival times) come from a
    whole-buffer dump, which costs tens of milliseconds at 2000 entries: it is
    read when collectives ran since the last one and its cost fits the duty
    budget (FULL_READ_DUTY, so a collective-heavy loop pays at most 0.5% of
    its time), when a group the reader cannot name yet launched collectives,
    and once when a rank has waited in the same collective for PARKED_READ_S.
    The op of a group is published only when it was read at the group's
    current sequence number ("" otherwise: unknown, never compared).

    `_dump_fr_trace_json` is private: guard by presence and shape, and fall back
    to None (the caller then publishes its own wrapper counts)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.available = False
        self._fn = None
        self._clock = clock
        self._names: dict[int, int] = {}
        """Local pg_id -> stable_group_id, learnt from entries (they roll out of the buffer)."""
        self._ops: dict[int, tuple[int, str]] = {}
        """Local pg_id -> (sequence number, op name) of its last launched collective, from the last full read."""
        self._read_at: dict[int, int] = {}
        """Local pg_id -> last enqueued sequence number at the last full read."""
        self._still: dict[int, tuple[int, float]] = {}
        """Local pg_id -> (outstanding sequence number, since when) while one is outstanding."""
        self._full_at = -math.inf
        """When the last whole-buffer read was (the reader's clock)."""
        self._full_cost = (0.0, 0)
        """(seconds, entries) of the last whole-buffer read."""
        self._capacity = 2000
        self.full_reads = 0
        """Whole-buffer reads so far (the benchmark's and tests' view of the cost)."""
        self._last: list[slots.CollectiveGroup] | None = None
        """The groups' final state once the process group is destroyed: a
        round after `destroy_process_group` republishes it rather than
        falling back to the wrapper's counts, which miss DDP's own collectives."""
        self._ring = ArrivalRing()
        self.arrivals: tuple[int, list[tuple[int, int]]] | None = None
        """What the last `sample()` found to publish in the slot's arrivals:
        (arrival_source, [(seq, t_ns), ...]), or None (leave them as they are)."""
        if not os.environ.get(env.FR_BUFFER_SIZE):
            return
        try:
            self._capacity = max(1, int(os.environ[env.FR_BUFFER_SIZE]))
        except ValueError:
            pass
        try:
            import torch._C._distributed_c10d as c10d

            # Two recorders: NCCL's process groups record into their own (CUDA
            # events; only in CUDA builds), gloo's into the generic one. A job
            # may use both (NCCL for training, gloo for CPU-side groups).
            dumps = [fn for fn in (getattr(c10d, name, None) for name in DUMPS) if fn is not None]
        except Exception:  # noqa: BLE001 - a private API: any failure means "not available"
            dumps = []
        if len(dumps) == 1:
            self._fn = dumps[0]
        elif dumps:
            self._fn = lambda **kw: merged_dump(dumps, **kw)

    def _dump(self, collectives: bool) -> dict:
        raw = self._fn(includeCollectives=collectives, onlyActive=False)  # type: ignore[misc]
        data = raw if isinstance(raw, dict) else json.loads(raw)  # several recorders merge into a dict
        if not isinstance(data, dict) or not isinstance(data.get("pg_status") or {}, dict):
            raise TypeError("a flight recorder dump of an unknown shape")
        return data

    def sample(self) -> list[slots.CollectiveGroup] | None:
        self.arrivals = None
        if self._fn is None:
            return None
        try:
            import torch.distributed as dist

            if not dist.is_available() or not dist.is_initialized():
                return self._last
            data = self._dump(False)
            status = self._status(data.get("pg_status") or {})
            now = self._clock()
            if self._wants_full_read(status, now):
                start = self._clock()
                data = self._dump(True)
                status = self._status(data.get("pg_status") or {}) or status
                entries = data.get("entries") or ()
                self._read_entries(entries)
                self._read_at = {local: enq for local, (enq, _done) in status.items()}
                self._full_cost = (max(self._clock() - start, 0.0), len(entries) if isinstance(entries, list) else 0)
                self._full_at = now
                self.full_reads += 1
        except Exception:  # noqa: BLE001 - a private API: any failure means "not available"
            self.available = False
            self._last = None
            self.arrivals = None
            return None
        groups = []
        for local, (enq, done) in status.items():
            gid = self._names.get(local, 0 if local == 0 else None)
            if gid is None:
                continue  # no collective seen on it yet: nothing to compare
            seq, op = self._ops.get(local, (-1, ""))
            groups.append(slots.CollectiveGroup(gid, enq, done, op if seq == enq else ""))
        groups.sort(key=lambda g: g.pg)
        self.available = True
        self._last = groups
        return groups

    @staticmethod
    def _status(raw: dict) -> dict[int, tuple[int, int]]:
        """Local pg_id -> (last enqueued, last completed) from a dump's pg_status."""
        out = {}
        for pg, st in raw.items():
            try:
                out[int(pg)] = (int(st.get("last_enqueued_collective", -1)), int(st.get("last_completed_collective", -1)))
            except (TypeError, ValueError, AttributeError):
                continue
        return out

    def _wants_full_read(self, status: dict[int, tuple[int, int]], now: float) -> bool:
        moved = [local for local, (enq, _done) in status.items() if enq != self._read_at.get(local) and enq > 0]
        if not moved:
            self._still = {}
            return False
        if any(local not in self._names and local != 0 for local in moved):
            return True  # a group it cannot name yet: its entries say which group it is
        parked = False
        still = {}
        for local, (enq, done) in status.items():
            if enq > done >= 0:  # completion tracked and one outstanding
                seq, since = self._still.get(local, (enq, now))
                if seq != enq:
                    since = now
                still[local] = (enq, since)
                parked |= local in moved and now - since >= PARKED_READ_S
        self._still = still
        return parked or now - self._full_at >= max(FULL_READ_MIN_S, self.next_read_cost(status) / FULL_READ_DUTY)

    def next_read_cost(self, status: dict[int, tuple[int, int]]) -> float:
        """What a whole-buffer read would cost now: the last one's cost per entry
        times the entries the buffer holds by now (the last read's, plus the
        collectives launched since, up to the buffer's size)."""
        cost, entries = self._full_cost
        added = sum(max(enq - self._read_at.get(local, 0), 0) for local, (enq, _done) in status.items())
        # A read of a few entries costs mostly its fixed part: scaled from fewer
        # than SCALE_FROM entries, it would predict a cost it never has.
        return cost * max(1.0, min(self._capacity, entries + added) / max(entries, SCALE_FROM))

    def _read_entries(self, entries) -> None:
        found: dict[int, tuple[int, int]] = {}
        for entry in entries if isinstance(entries, list) else ():
            try:
                local = int(entry.get("pg_id", 0))
                name = (entry.get("process_group") or [""])[0]
                if name != "":
                    self._names[local] = stable_group_id(str(name))
                if not entry.get("is_p2p"):
                    seq = int(entry["collective_seq_id"])
                    self._ops[local] = (seq, str(entry.get("profiling_name", "")).split(":")[-1])
                    if self._names.get(local, 0 if local == 0 else None) == 0:
                        # Entries are in record order: a later one of the same seq (a
                        # re-created group) replaces the earlier.
                        found[seq] = (int(entry.get("time_created_ns") or 0),
                                      int(entry.get("time_discovered_started_ns") or 0))
            except (TypeError, ValueError, IndexError, KeyError, AttributeError):
                continue
        try:
            self.arrivals = self._ring.update(found)
        except Exception:  # noqa: BLE001 - never let the arrivals cost the round
            self.arrivals = None


class ArrivalRing:
    """The arrivals this rank publishes (slots.ARRIVALS entries, region B).

    Arrival at a collective: when the collective started on the device
    (`time_discovered_started_ns`, NCCL with TORCH_NCCL_ENABLE_TIMING=1) if any
    entry has one, else when this rank enqueued it (`time_created_ns`); one
    source at a time, entries without a time of that source are left out.

    Ranks are sampled at different moments and a fast job runs far more
    collectives per round than the ring holds, so each round publishes only
    the new sequence numbers divisible by 2**k, k the smallest for which they
    fit in half the ring: a deterministic subsample, the same on every rank
    at the same rate, and ranks with different k still meet on the multiples
    of the larger stride. The most recent ARRIVALS are kept."""

    def __init__(self, size: int = slots.ARRIVALS):
        self.size = size
        self.source = slots.ARRIVAL_NONE
        self.last = 0
        """The highest sequence number considered so far."""
        self.entries: list[tuple[int, int]] = []

    def update(self, found: dict[int, tuple[int, int]]) -> tuple[int, list[tuple[int, int]]] | None:
        """found: seq -> (created_ns, started_ns) of the default group's collectives
        in this round's dump. Returns what to publish, None when there is nothing."""
        timed = any(started > 0 for _created, started in found.values())
        source = slots.ARRIVAL_STARTED if timed else slots.ARRIVAL_ENQUEUED
        usable = {seq: (started if timed else created) for seq, (created, started) in found.items() if seq > 0}
        usable = {seq: t for seq, t in usable.items() if t > 0}
        if not usable:
            return self.published()
        top = max(usable)
        if source != self.source or top < self.last:
            # Times of another meaning, or a new group whose numbers start over.
            self.source, self.last, self.entries = source, 0, []
        if top > self.last:
            stride = 1
            while top // stride - self.last // stride > self.size // 2:
                stride *= 2
            new = [(seq, t) for seq, t in usable.items() if seq > self.last and seq % stride == 0]
            self.last = top
            if new:
                self.entries = sorted(self.entries + new)[-self.size:]
        return self.published()

    def published(self) -> tuple[int, list[tuple[int, int]]] | None:
        return (self.source, list(self.entries)) if self.entries else None


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



def default_group_seq() -> Callable[[], int] | None:
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
    except Exception:  # noqa: BLE001 - a private API: any failure means "not available"
        return None


def io_bytes() -> int:
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
