"""What the rank's background thread samples: collective sequence numbers per
process group from PyTorch's flight recorder, the default group's sequence
counter for the step path, and the process's I/O counter.

The flight recorder's API is private: every read is guarded by presence and
shape and falls back to None (the sampler then publishes its own counts).
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Callable

from trainwatch import env, slots


class FlightRecorderReader:
    """Reads per-group collective sequence numbers from PyTorch's flight recorder.

    `_dump_fr_trace_json` is private: guard by presence and shape, and fall back
    to None (the caller then publishes its own wrapper counts)."""

    def __init__(self) -> None:
        self.available = False
        self._fn = None
        self._names: dict[int, int] = {}
        """Local pg_id -> stable_group_id, learnt from entries (they roll out of the buffer)."""
        self._last: list[slots.CollectiveGroup] | None = None
        """The groups' final state once the process group is destroyed: a
        round after `destroy_process_group` republishes it rather than
        falling back to the wrapper's counts, which miss DDP's own collectives."""
        if not os.environ.get(env.FR_BUFFER_SIZE):
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
                return self._last
            data = json.loads(self._fn(includeCollectives=True, onlyActive=False))
        except Exception:
            self.available = False
            self._last = None
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
        self._last = groups
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
    except Exception:
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
