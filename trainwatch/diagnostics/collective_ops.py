"""Collective op names: which collective (`all_reduce`, `barrier`, `recv`, ...) a thread is in.

Stack groups and `trainwatch explain` show the op beside the hang pattern, so
"63 ranks in all_reduce, rank 17 in barrier" reads at a glance. Names are read
from frame functions (Python, c10d and gloo symbols) and spelled one way
(`allreduce` and `_all_reduce_coalesced` both read `all_reduce`).
"""

from __future__ import annotations

import re

from trainwatch.diagnostics.frame_rules import DIST_FILE
from trainwatch.diagnostics.stacks import Frame, ThreadStack

_OP_TOKEN = re.compile(
    r"^_*(?P<base>all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|broadcast|monitored_barrier|barrier|"
    r"reduce|gather|scatter|isend|irecv|send|recv)(?P<suffix>\w*)$",
    re.IGNORECASE,
)
_CANONICAL = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
              "alltoall": "all_to_all", "all_toall": "all_to_all", "allto_all": "all_to_all"}
# Suffixes that name a variant of the op (`all_gather_into_tensor`), kept in the name.
_KEPT_SUFFIXES = ("_into_tensor", "_coalesced", "_single", "_object", "_object_list", "_tensor")
# Generic names (`gather`, `send`, ...) are collectives only inside torch.distributed
# and friends, or in native c10d/gloo frames (DataParallel has a `gather` too).
_WEAK_BASES = frozenset({"broadcast", "reduce", "gather", "scatter", "isend", "irecv", "send", "recv"})
_DIST_FILE_RX = re.compile(DIST_FILE)


# DDP's C++ reducer: its threads wait on the all-reduce of a gradient bucket (the
# default comm hook, and the compressing ones, all-reduce) without naming it.
_DDP_REDUCER = re.compile(r"^c10d::Reducer::")


def collective_op(thread: ThreadStack) -> str | None:
    """Name of the collective the thread is in (`all_reduce`, `barrier`, `recv`, ...), innermost first."""
    for frame in thread.frames:
        op = _op_of(frame)
        if op is not None:
            return op
    if any(_DDP_REDUCER.match(frame.function) for frame in thread.frames):
        return "all_reduce"
    return None


def _op_of(frame: Frame) -> str | None:
    name = frame.function.split("(", 1)[0]
    tokens = [t for t in re.split(r"::|\.", name) if t]
    native = name.startswith(("c10d::", "gloo::"))
    for token in reversed(tokens[-2:]):
        if token in ("RecvWork", "SendWork"):
            return token[:4].lower()
        m = _OP_TOKEN.match(token)
        if m is None:
            continue
        base = m.group("base").lower()
        base = _CANONICAL.get(base, base)
        if base in _WEAK_BASES and not (native or _DIST_FILE_RX.search(frame.file)):
            continue
        suffix = m.group("suffix").lower()
        if m.group("suffix") and not suffix.startswith("_"):
            continue  # `reduced`, `gathering`: a different word, not an op
        return base + suffix if suffix in _KEPT_SUFFIXES else base
    return None
