"""Facts of NCCL's own warning lines (NCCL_DEBUG=WARN), for the rules in log_rules.py.

NCCL says more in its WARN lines than the exception torch raises from them,
and often the process is gone before any exception is printed: a peer that
closed its connection or broke the pipe means the rank on the other end died
(or its network did), which NCCL reports as ncclRemoteError; "retcode N" is
an ncclResult_t; NCCL's own mismatch checks name a rank or two message sizes.
Pure functions of a regex match.
"""

from __future__ import annotations

import re

# ncclResult_t numbers, as NCCL's "retcode N" and "-> N" lines print them.
NCCL_RETURN_CODES = {
    1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
    4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError", 7: "ncclInProgress",
}
_PEER = re.compile(r"(?:from|peer|remote peer)\s+(?P<peer>[\w.:%-]+<\d+>)")


def nccl_peer_lost(m: re.Match[str]) -> dict:
    """An NCCL warning that the other end of a connection went away: the peer process
    died or its network failed, which NCCL reports as ncclRemoteError."""
    facts: dict = {"nccl_code": "ncclRemoteError", "peer_lost": True,
                   "nccl_warning": " ".join(m.group("msg").split())[:300]}
    peer = _PEER.search(m.group("msg"))
    if peer:
        facts["peer"] = peer.group("peer")
    return facts


def nccl_retcode(m: re.Match[str]) -> dict:
    """NCCL's proxy failing an operation for a peer rank, with the ncclResult_t it got."""
    code = int(m.group("code")) if len(m.group("code")) < 4 else None
    return {"nccl_code": NCCL_RETURN_CODES.get(code), "peer_rank": int(m.group("peer")),
            "nccl_operation": m.group("oper")}


def nccl_mismatch_rank(m: re.Match[str]) -> dict:
    """NCCL's own collective-mismatch check, which names the rank to look at."""
    rank = int(m.group("rank"))
    return {"ranks": [rank], "rank": rank, "transport": "nccl"}


def nccl_size_mismatch(m: re.Match[str]) -> dict:
    """NCCL's network plugin receiving a message of another size than it posted."""
    return {"local_size": int(m.group("local")), "remote_size": int(m.group("remote")), "transport": "nccl"}


# NCCL's one-line descriptions (ncclGetErrorString) -> the ncclResult_t name.
NCCL_DESCRIPTIONS = {
    "unhandled system error": "ncclSystemError",
    "internal error": "ncclInternalError",
    "remote process exited or there was a network error": "ncclRemoteError",
    "unhandled cuda error": "ncclUnhandledCudaError",
    "invalid usage": "ncclInvalidUsage",
    "invalid argument": "ncclInvalidArgument",
}


def nccl_line(m: re.Match[str]) -> dict:
    """Facts of "NCCL error in: FILE:LINE, DESCRIPTION, NCCL version V"."""
    desc = " ".join(m.group("desc").lower().split())
    code = next((c for d, c in NCCL_DESCRIPTIONS.items() if desc.startswith(d)), None)
    facts: dict = {"nccl_code": code}
    if m.group("ver"):
        facts["nccl_version"] = m.group("ver").rstrip(".")
    return facts


def nccl_code(m: re.Match[str]) -> dict:
    """Facts of an "ncclSystemError: ..." line."""
    return {"nccl_code": m.group("code")}
