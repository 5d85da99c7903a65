"""Log rules: the one table of error messages trainwatch reads out of log text.

Each `LineRule` is one message form that PyTorch, NCCL, CUDA, gloo or
torchelastic prints: the regex that finds it, the error category it proves
(see findings.ERROR_CATEGORIES) and a reader that turns the match into facts
(SeqNum, op, timeout, exit code, ...). logparse.py runs the table over every
line of a log.

Everything here is pure. A fact the message does not state stays out of the
facts; nothing is inferred from defaults or typical values.
"""

from __future__ import annotations

import re

from trainwatch.diagnostics.desync_reports import FINGERPRINT_MISMATCH, fingerprint_facts
from trainwatch.diagnostics.line_rule import LineRule, nothing as _nothing, rank_list as _rank_list
from trainwatch.diagnostics.line_rule import words as _words
# signal_name and to_bytes are read through this module too (logparse, tests).
from trainwatch.diagnostics.process_facts import (cuda_message, device_assert, old_cuda_message, oom_facts,
                                                  signal_name, to_bytes)
from trainwatch.diagnostics.framework_rules import ANCHOR_WORDS as _FRAMEWORK_WORDS, FRAMEWORK_RULES
from trainwatch.diagnostics.process_rules import PROCESS_RULES
from trainwatch.diagnostics.torch_rules import ANCHOR_WORDS as _TORCH_WORDS, TORCH_RULES
from trainwatch.diagnostics.nccl_facts import (nccl_code, nccl_line, nccl_mismatch_rank, nccl_peer_lost, nccl_retcode,
                                                nccl_size_mismatch)

__all__ = ["RULES", "LineRule", "may_hold_message", "signal_name", "to_bytes"]


_INT = r"-?\d+"
_CUDA_CHECK = r"cudaSuccess\s*\(\d{1,3}\s*vs\.\s*0\)"  # a failed glog CUDA check (Caffe, CUDA extensions)
_WORK = r"WorkNCCL\s*\((?P<body>(?:[^()]|\(\s*ms\s*\))*)\)"
# "unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.18.1"
_NCCL_DESC = r"(?P<desc>[^,(]+?)\s*(?=[,(]|$)(?:\([^)]*\))?(?:\s*,\s*NCCL\s*version\s*(?P<ver>[\w.+-]+))?"


def _kv(body: str) -> dict[str, str]:
    """Key=value pairs of a WorkNCCL(...) body; Timeout(ms)=N is read as Timeout."""
    return {k: v for k, v in re.findall(r"(\w+)\s*(?:\(\s*ms\s*\))?\s*=\s*(-?\w+)", body)}


def _int(value: str | None) -> int | None:
    """int() that passes None, and anything that is not a number (a wrapped line
    glued "NumelIn=" to the next line's first word), through as None."""
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


def _work(m: re.Match[str]) -> dict:
    """Facts of a WorkNCCL(SeqNum=..., OpType=..., Timeout(ms)=...) record."""
    kv = _kv(m.groupdict().get("body") or "")  # a line quoted without its record
    facts = {
        "seq": _int(kv.get("SeqNum")),
        "op": kv.get("OpType"),
        "timeout_ms": _int(kv.get("Timeout")),
        "transport": "nccl",
    }
    # NumelIn/NumelOut exist since torch 2.2; a mismatch between ranks is a
    # classic desync sign, so keep them when present.
    for key, fact in (("NumelIn", "numel_in"), ("NumelOut", "numel_out")):
        if _int(kv.get(key)) is not None:
            facts[fact] = _int(kv[key])
    return facts


def _progress(m: re.Match[str]) -> dict:
    """Facts of a "... at work: N, last enqueued ...: E, last completed ...: C" line."""
    facts = {
        "last_enqueued": int(m.group("enq")),
        "last_completed": int(m.group("comp")),
        "transport": "nccl",
    }
    if m.groupdict().get("seq") is not None:
        facts["seq"] = int(m.group("seq"))
    return facts


def _heartbeat(m: re.Match[str]) -> dict:
    """Facts of the heartbeat monitor's own time-out line."""
    pending = m.group("pending")
    return {} if pending is None else {"pending_work": int(pending)}


def _dump_signal(m: re.Match[str]) -> dict:
    """Facts of "Received a dump signal due to a collective timeout from ..."."""
    facts: dict = {}
    if m.group("src") is not None:
        facts["source_rank"] = int(m.group("src"))
    elif m.group("local"):
        facts["source_local"] = True  # resolved to this line's rank later
    if m.group("enq") is not None:
        facts["last_enqueued"] = int(m.group("enq"))
        facts["last_completed"] = int(m.group("comp"))
    return facts


def _at_work(lead: str) -> re.Pattern[str]:
    """"<lead> N, last enqueued NCCL work: E, last completed NCCL work: C"."""
    return re.compile(_words(lead) + r"\s*(?P<seq>" + _INT + r"),\s*" + _words("last enqueued NCCL work:")
                      + r"\s*(?P<enq>" + _INT + r"),\s*" + _words("last completed NCCL work:") + r"\s*(?P<comp>" + _INT + ")")


_PG_NAME = re.compile(r"PG\s*GUID\s*\d+\s*\((?P<name>[^)\]]+)\)")


def _stuck(m: re.Match[str]) -> dict:
    """The heartbeat monitor's verdict on a stuck watchdog: seconds without progress
    (the heartbeat timeout it exceeded) and the process group's name when printed."""
    secs = int(m.group("secs"))
    facts: dict = {"stuck_s": secs, "timeout_ms": secs * 1000}
    name = _PG_NAME.search(m.string, 0, m.start())
    if name:
        facts["pg_name"] = name.group("name").strip()
    return facts


def _nccl_async(m: re.Match[str]) -> dict:
    """A collective that raised an async NCCL error: the work record plus the code."""
    return {**_work(m), **nccl_line(m)}


def _gloo_timeout(m: re.Match[str]) -> dict:
    """Facts of gloo's "Timed out waiting 1800000ms for recv operation"."""
    return {"timeout_ms": int(m.group("ms")), "transport": "gloo"}


def _gloo_peer(m: re.Match[str]) -> dict:
    """Facts of gloo's "Connection closed by peer [host]:port" line."""
    peer = m.group("peer1") or m.group("peer2")
    return {"transport": "gloo", "peer": peer}


# The one table of message forms. Order matters inside a family only.
RULES: tuple[LineRule, ...] = (
    # -- collective timeouts -------------------------------------------------
    LineRule("nccl-watchdog-timeout", "caught", "collective_timeout", re.compile(
        r"[Cc]aught\s*collective\s*operation\s*timeout\s*:?\s*" + _WORK), _work, family="watchdog-timeout"),
    # The same line quoted without its WorkNCCL record (the record stays unknown).
    LineRule("nccl-watchdog-timeout-bare", "caught", "collective_timeout", re.compile(
        r"[Cc]aught\s*collective\s*operation\s*timeout\b"), _work, family="watchdog-timeout"),
    LineRule("nccl-blocking-wait", "blocking", "collective_timeout", re.compile(
        r"Work\s*" + _WORK + r"\s*" + _words("timed out in blocking wait")), _work),
    LineRule("nccl-timeout-at-work", "enqueued", "collective_timeout", _at_work("Timeout at NCCL work:"), _progress,
             family="progress"),
    # torch >= 2.4 says which it was: "Work timeout is detected by watchdog at work: 3502, ...",
    # "NCCL error is detected by watchdog at work: 2210, ...".
    LineRule("nccl-timeout-detected", "enqueued", "collective_timeout",
             _at_work("Work timeout is detected by watchdog at work:"), _progress, family="progress"),
    LineRule("nccl-error-detected", "enqueued", "nccl_error", _at_work("NCCL error is detected by watchdog at work:"),
             _progress, family="progress"),
    # "Exception (either an error or timeout)": an error or a timeout, so it
    # only adds numbers to a timeout finding and never makes one by itself.
    LineRule("nccl-exception-at-work", "enqueued", "collective_timeout", _at_work("detected by watchdog at work:"),
             _progress, role="support", family="progress"),
    LineRule("nccl-failure-at-work", "enqueued", "collective_timeout", re.compile(
        _words("failure detected by watchdog at work sequence id:") + r"\s*(?P<seq>" + _INT + r")\s*"
        + _words("PG status: last enqueued work:") + r"\s*(?P<enq>" + _INT + r"),\s*"
        + _words("last completed work:") + r"\s*(?P<comp>" + _INT + ")"), _progress, role="support",
        family="progress"),
    LineRule("gloo-timeout", "gloo", "collective_timeout", re.compile(
        r"gloo[^\]\s]*\]\s*" + _words("Timed out waiting") + r"\s*(?P<ms>\d+)\s*ms\s*for\s*(?:recv|send)\s*operation"),
        _gloo_timeout),
    # monitored_barrier naming the ranks that never arrived: "Ranks 1, 3 failed to pass
    # monitoredBarrier in 1800000 ms".
    LineRule("monitored-barrier", "monitoredbarrier", "collective_timeout", re.compile(
        r"Ranks?\s*(?P<ranks>\d{1,9}(?:\s*,\s*\d{1,9}){0,63})\s*failed\s*to\s*pass\s*monitoredBarrier"),
        lambda m: {"op": "BARRIER", "ranks": _rank_list(m)}),
    # Huawei's HCCL on Ascend NPUs: "hccl fftsplus task timeout occurred during task execution".
    LineRule("hccl-task-timeout", "hccl", "collective_timeout", re.compile(
        r"(?i)\bhccl\b.{0,40}?task\s*timeout"), _nothing),
    LineRule("gloo-peer-lost", "gloo", "collective_timeout", re.compile(
        r"gloo[^\]\s]*\]\s*(?:Read\s*error\s*(?P<peer1>\[[^\]]*\]:\d+)\s*:\s*)?"
        r"Connection\s*(?:closed|reset)\s*by\s*peer"
        r"(?:\s*(?P<peer2>\[[^\]]*\]:\d+))?"), _gloo_peer),
    # -- heartbeat monitor / watchdog ------------------------------------------
    LineRule("heartbeat-monitor", "heartbeat", "heartbeat_timeout", re.compile(
        _words("Heartbeat monitor timed out!") + r"(?:.*?workMetaList_\.size\(\)\s*=\s*(?P<pending>\d+))?"),
        _heartbeat),
    # ProcessGroupNCCL telling every rank to dump its debug info because a collective timed out
    # (on this rank or another): the collective time-out, seen from each rank.
    LineRule("dump-signal", "dump", "collective_timeout", re.compile(
        _words("Received a dump signal due to a collective timeout from") + r"\s*(?:(?P<local>"
        + _words("this local rank") + r")|rank\s*(?P<src>\d+))"
        + r"(?:.*?" + _words("Last enqueued NCCL work:") + r"\s*(?P<enq>" + _INT + r"),\s*"
        + _words("last completed NCCL work:") + r"\s*(?P<comp>" + _INT + "))?"), _dump_signal, family="progress"),
    # Any other line with both counters (a flight-recorder summary, a custom
    # print): no finding of its own, but a progress point for the comparison.
    LineRule("nccl-progress", "enqueued", "collective_timeout", re.compile(
        r"(?i)" + _words("last enqueued") + r"\s*(?:NCCL\s*)?work:\s*(?P<enq>" + _INT + r"),\s*"
        + _words("last completed") + r"\s*(?:NCCL\s*)?work:\s*(?P<comp>" + _INT + ")"), _progress, role="support",
        family="progress"),
    LineRule("timeout-signal", "received", "collective_timeout", re.compile(
        r"Received\s*a\s*(?:" + _words("global timeout from another rank") + "|"
        + _words("timeout signal from this local rank") + ")"), _nothing),
    # The heartbeat monitor's own time-out when the watchdog thread made no progress
    # (torch >= 2.4 prints it instead of "Heartbeat monitor timed out!").
    LineRule("watchdog-stuck", "stuck", "heartbeat_timeout", re.compile(
        r"(?i)(?:ProcessGroupNCCL'\s*s\s*)?watchdog\s*got\s*stuck\s*for\s*(?P<secs>\d+)\s*seconds"), _stuck,
        runbook="watchdog-stuck"),
    # The rendezvous and its store, before any collective: a node or rank that never joined or
    # a rendezvous already closed ("RendezvousTimeoutError", "RendezvousClosedError"), a TCPStore
    # client that never reached the store, a store server whose clients never came.
    LineRule("rendezvous-error", "rendezvous", "heartbeat_timeout", re.compile(
        r"\bRendezvous(?:Timeout|Closed|Connection)Error\b"), _nothing),
    # The store's own words: a get or wait that timed out ("Socket Timeout"), the barrier
    # init_process_group runs on it, a server that cannot listen (the port is taken).
    LineRule("store-socket-timeout", "socket timeout", "heartbeat_timeout", re.compile(r"\bSocket\s*Timeout\b"),
             _nothing),
    LineRule("store-barrier-timeout", "store based barrier", "heartbeat_timeout", re.compile(
        _words("Timed out initializing process group in store based barrier")), _nothing),
    LineRule("store-listen-failed", "the server socket", "heartbeat_timeout", re.compile(
        _words("The server socket has failed to") + r"\s*(?:listen\s*on\s*any\s*local\s*network\s*address|"
        r"(?:listen\s*on|bind\s*to)\s*\S+\s*\(errno:\s*98\b)"), _nothing),
    # torch's TCPStore server when its port is taken: "RuntimeError: Address already in use".
    LineRule("store-address-in-use", "already in use", "heartbeat_timeout", re.compile(
        r"(?:RuntimeError|DistNetworkError|DistStoreError)\s*:\s*(?:\[Errno\s*98\]\s*)?Address\s*already\s*in\s*use"),
        _nothing),
    LineRule("store-connect-timeout", "timed out", "heartbeat_timeout", re.compile(
        _words("The client socket has timed out after") + r"\s*(?P<secs>\d{1,9})m?s\s*"
        + _words("while trying to connect to")), _nothing),
    LineRule("store-connect-failed", "failed to connect", "heartbeat_timeout", re.compile(
        _words("The client socket has failed to connect to") + r"\s*(?:any\s*network\s*address\s*of|\S+\s*\(errno:\s*\d)"),
        _nothing),
    # Older torch's words for the same ("connect() timed out. Original timeout was 1800000 ms."),
    # a store that answered out of protocol, and the store's own network error.
    LineRule("store-connect-old", "timed out", "heartbeat_timeout", re.compile(
        r"connect\(\)\s*timed\s*out\.\s*Original\s*timeout\s*was\s*\d{1,12}\s*ms|Error:\s*connect\(\)\s*timed\s*out"), _nothing),
    LineRule("store-protocol", "stop_waiting", "heartbeat_timeout", re.compile(
        _words("Stop_waiting response is expected")), _nothing),
    LineRule("store-network-error", "distnetworkerror", "heartbeat_timeout", re.compile(
        r"DistNetworkError\s*:\s*(?P<why>Connection\s*reset\s*by\s*peer|Broken\s*pipe|Connection\s*refused)"), _nothing),
    LineRule("store-server-gone", "got 0 bytes", "heartbeat_timeout", re.compile(
        r"Failed\s*to\s*recv,\s*got\s*0\s*bytes\.\s*Connection\s*was\s*likely\s*closed"), _nothing),
    LineRule("store-clients-timeout", "timed out", "heartbeat_timeout", re.compile(
        r"Timed\s*out\s*after\s*\d{1,9}\s*seconds\s*waiting\s*for\s*clients"), _nothing),
    # -- desynchronised ranks ----------------------------------------------------------
    LineRule("fingerprint-mismatch", "mismatch", "collective_mismatch", FINGERPRINT_MISMATCH, fingerprint_facts),
    LineRule("nccl-warn-mismatch", "mismatch", "collective_mismatch", re.compile(
        r"NCCL\s*WARN\s*Mismatched\s*collective\s*detected.*?around\s*rank\s*(?P<rank>\d{1,9})"),
        nccl_mismatch_rank),
    LineRule("nccl-net-size-mismatch", "mismatch", "collective_mismatch", re.compile(
        r"collective\s*mismatch\s*error,\s*local\s*size\s*(?P<local>\d{1,18})\s*remote\s*size\s*(?P<remote>\d{1,18})"),
        nccl_size_mismatch),
    # Horovod's stall inspector: some ranks submitted a tensor the others never did.
    LineRule("horovod-stall", "subset", "collective_mismatch", re.compile(
        _words("submitted to be reduced, gathered or broadcasted by subset of ranks")), _nothing),
    # -- NCCL errors ---------------------------------------------------------------
    LineRule("nccl-async-error", "async", "nccl_error", re.compile(
        r"Collective\s*" + _WORK + r"\s*" + _words("raised the following async exception:")
        + r"\s*NCCL\s*error\s*:\s*" + _NCCL_DESC),
        _nccl_async, family="nccl-text"),
    LineRule("nccl-error-in", "nccl", "nccl_error", re.compile(
        r"(?i:NCCL)\s*(?:[Ee]rror|failure)\s*(?:in\s*:\s*[^,\s]+\s*,|(?:\d{1,3}\s*)?:|\(\d{1,3}\)\s*,|,)\s*" + _NCCL_DESC),
        nccl_line,
        family="nccl-text"),
    # A rank fetching the communicator's unique id from rank 0 through the store when rank 0
    # is gone: the NCCL group never forms ("... via c10d key-value store by key '0', but
    # store->get('0') got error: Connection reset by peer").
    LineRule("nccl-unique-id", "nccluniqueid", "nccl_error", re.compile(
        _words("is setting up NCCL communicator and retrieving ncclUniqueId from") + r"\s*\[(?P<peer>\d{1,9})\]"
        + r".{0,200}?" + _words("got error:") + r"(?!\s*Socket\s*Timeout)\s*(?P<why>[^.]{1,80})"), _nothing),
    # Other frameworks name the NCCL call that failed: "ncclCommInitRank failed: unhandled system error".
    LineRule("nccl-call-failed", "nccl", "nccl_error", re.compile(
        r"\bnccl[A-Z]\w{2,40}(?:\((?:[^()]|\(\)){0,300}\))?\s*failed\s*:\s*(?:nccl[A-Z]\w{2,40}(?:\(\))?\s*failed\s*:\s*)?" + _NCCL_DESC),
        nccl_line, family="nccl-text"),
    # NCCL_DEBUG=WARN lines that say the peer of a connection is gone: no "NCCL error"
    # line may follow (the process that printed them is killed first).
    LineRule("nccl-warn-peer-lost", "warn", "nccl_error", re.compile(
        r"NCCL\s*WARN(?P<msg>.*?(?:Connection\s*closed\s*by\s*remote\s*peer|Connection\s*reset\s*by\s*peer"
        r"|Broken\s*pipe|Network\s*is\s*unreachable|No\s*route\s*to\s*host|Connection\s*refused|Got\s*completion\s*(?:from\s*peer\s*\S+\s*)?with\s*(?:error|status)\s*=?\s*\d+).*)"),
        nccl_peer_lost),
    # NCCL_DEBUG=WARN lines of a connection or network device that could not be set up:
    # "socketStartConnect: Connect to 10.1.1.1<43411> failed", "Bootstrap : no socket interface found",
    # "NET/IB : Unable to open device mlx5_0", "Call to ibv_create_qp failed".
    LineRule("nccl-warn-net-setup", "warn", "nccl_error", re.compile(
        r"NCCL\s*WARN\s*(?P<msg>(?:socket\w{0,20}\s*:\s*)?Connect\s*to\s*\S+\s*failed.{0,120}"
        r"|Bootstrap\s*:\s*no\s*socket\s*interface\s*found|NET/\w{1,20}\s*:\s*Unable\s*to\s*open\s*device\s*\S+"
        r"|Call\s*to\s*ibv_\w{1,40}\s*failed.{0,80}|NET/IB\s*:\s*\S{1,40}\s*Got\s*async\s*event\s*:\s*\w{0,20}\s*(?:error|fatal)"
        r"|\[Service\s*thread\]\s*Error\s*encountered.{0,120})"), lambda m: {"nccl_warn": m.group("msg").strip()}),
    # NCCL's shared memory transport in a container whose /dev/shm is too small.
    LineRule("nccl-shm", "/dev/shm", "nccl_error", re.compile(
        r"NCCL\s*WARN\s*.{0,80}?failed\s*to\s*extend\s*/dev/shm|Error\s*while\s*creating\s*shared\s*memory"
        r"\s*segment\s*/dev/shm/nccl-"), _nothing),
    # Two ranks given one GPU: NCCL refuses the communicator.
    LineRule("nccl-duplicate-gpu", "duplicate gpu", "nccl_error", re.compile(
        r"Duplicate\s*GPU\s*detected\s*:\s*rank\s*(?P<a>\d{1,9})\s*and\s*rank\s*(?P<b>\d{1,9})\s*both\s*on\s*CUDA\s*device"),
        lambda m: {"ranks": [int(m.group("a")), int(m.group("b"))]}),
    # NCCL's own error lines: "NCCL WARN Error : ring 0 does not loop back to start", and the
    # "Last error:" that NCCL 2.19+ appends to an error ("Net : Connection closed by remote peer").
    LineRule("nccl-warn-error", "warn", "nccl_error", re.compile(r"NCCL\s*WARN\s*Error\s*:\s*(?P<msg>\S.{0,200})"),
             lambda m: {"nccl_warn": m.group("msg").strip()}),
    LineRule("nccl-last-error-peer", "remote peer", "nccl_error", re.compile(
        r"^\s*(?:Last\s*error:\s*)?(?i:net)\s*(?:/\w{1,10})?\s*:\s*(?P<msg>Connection\s*closed\s*by\s*remote\s*peer.{0,80})"),
        lambda m: {"nccl_warn": m.group("msg").strip()}),
    LineRule("nccl-warn-retcode", "retcode", "nccl_error", re.compile(
        r"NCCL\s*WARN\s*\[[^\]]*\]\s*Failed\s*to\s*execute\s*operation\s*(?P<oper>\w+)\s*from\s*rank\s*"
        r"(?P<peer>\d{1,9}),\s*retcode\s*(?P<code>\d{1,9})"), nccl_retcode),
    LineRule("nccl-proxy-accept", "accept failed", "nccl_error", re.compile(
        r"NCCL\s*WARN\s*\[(?:Proxy\s*)?Service\s*thread\]\s*Accept\s*failed"), _nothing),
    LineRule("nccl-code", "nccl", "nccl_error", re.compile(
        r"\b(?P<code>nccl(?:UnhandledCudaError|SystemError|InternalError|InvalidArgument|InvalidUsage"
        r"|RemoteError))\s*:"),
        nccl_code),
    # -- CUDA: one finding per line, most specific first -------------------------
    LineRule("cuda-ecc", "ecc", "ecc", re.compile(
        _words("uncorrectable ECC error encountered") + r"|CUDA_ERROR_ECC_UNCORRECTABLE|cudaErrorECCUncorrectable"),
        _nothing, family="cuda"),
    LineRule("cuda-illegal-address", "illegal", "illegal_memory_access", re.compile(
        r"illegal\s*(?:cuda\s*)?memory\s*access\s*was\s*encountered|(?:cuda|hip)ErrorIllegalAddress|(?:CUDA|ROCM)_ERROR_ILLEGAL_ADDRESS"),
        _nothing, family="cuda"),
    LineRule("cuda-misaligned-address", "misaligned", "illegal_memory_access", re.compile(
        r"\b(?i:CUDA\s*error)\s*:\s*misaligned\s*address|" + _CUDA_CHECK + r"\s*misaligned\s*address"
        r"|cudaErrorMisalignedAddress|CUDA_ERROR_MISALIGNED_ADDRESS"),
        _nothing, family="cuda"),
    # cuda-gdb stopping on the faulting warp: "CUDA Exception: Warp Illegal Address".
    LineRule("cuda-gdb-illegal-address", "warp", "illegal_memory_access", re.compile(
        r"CUDA\s*Exception\s*:\s*Warp\s*(?:Illegal|Out-of-range|Misaligned)\s*Address"), _nothing, family="cuda"),
    # ROCm's words for the same fault: "Memory access fault by GPU node-1 (...) on address 0x..."
    LineRule("rocm-ecc-fault", "ecc", "ecc", re.compile(
        r"Memory\s*access\s*fault\s*by\s*GPU.{0,300}?Reason:\s*DRAM\s*ECC\s*failure"), _nothing, family="cuda"),
    LineRule("rocm-memory-fault", "fault", "illegal_memory_access", re.compile(
        r"Memory\s*access\s*fault\s*by\s*GPU"), _nothing, family="cuda"),
    LineRule("cuda-error-oom", "memory", "oom", re.compile(
        r"\b(?i:CUDA|HIP)\s*(?:driver\s*)?(?i:error)\s*:\s*out\s*of\s*memory"),
             _nothing, family="cuda"),
    # cuBLAS failing to allocate its workspace: the device is out of memory.
    LineRule("cublas-alloc-failed", "cublas_status", "oom", re.compile(r"\bCUBLAS_STATUS_ALLOC_FAILED\b"), _nothing,
             family="cuda"),
    # Before torch 1.5: "cuda runtime error (2) : out of memory at ...THCGeneral.cpp:50",
    # "THCudaCheck FAIL file=... line=271 error=4 : unspecified launch failure".
    LineRule("cuda-runtime-oom", "cuda", "oom", re.compile(
        r"(?i)(?:THCudaCheck\s*FAIL\s*file=\S+\s*line=\d+\s*error=\d+|cuda\s*runtime\s*error\s*\(\d+\))"
        r"\s*:\s*out\s*of\s*memory"), _nothing, family="cuda"),
    LineRule("cuda-runtime-error", "cuda", "cuda_error", re.compile(
        r"(?i)(?:THCudaCheck\s*FAIL\s*file=\S+\s*line=\d+\s*error=\d+|cuda\s*runtime\s*error\s*\(\d+\))"
        r"\s*:\s*(?P<msg>\S.*)"), old_cuda_message, family="cuda"),
    # NCCL_DEBUG=WARN: "enqueue.cc:1556 NCCL WARN Cuda failure 700 'an illegal memory access was
    # encountered'" (the specific CUDA rules above read the quoted text first).
    LineRule("nccl-cuda-failure-oom", "failure", "oom", re.compile(
        r"NCCL\s*WARN\s*Cuda\s*failure\s*(?:\d{1,4}\s*)?'out of memory'"), _nothing, family="cuda"),
    # ... in NCCL's transports or proxy (P2P / IPC set-up between GPUs): NCCL's own connection failed.
    LineRule("nccl-transport-cuda-failure", "failure", "nccl_error", re.compile(
        r"(?:transport/\S+|proxy\.cc|p2p\.cc):\d+\s*NCCL\s*WARN\s*Cuda\s*failure"), _nothing, family="cuda"),
    LineRule("nccl-cuda-failure", "failure", "cuda_error", re.compile(
        r"NCCL\s*WARN\s*Cuda\s*failure\s*(?:\d{1,4}\s*)?'(?P<msg>[^']{1,200})'"), cuda_message, family="cuda"),
    # A CUDA extension's own check, and the runtime's words wherever they are printed.
    LineRule("cuda-check-failed", "kernel image", "cuda_error", re.compile(
        r"(?P<msg>no\s*kernel\s*image\s*is\s*available\s*for\s*execution\s*on\s*the\s*device)"), cuda_message,
        family="cuda"),
    LineRule("cuda-error", "cuda", "cuda_error", re.compile(
        r"\b(?i:CUDA\s*error)\s*:\s*(?P<msg>.+?)\s*"
        r"(?:CUDA\s*kernel\s*errors|Search\s*for\s*`|Compile\s*with\s*`|'?,\s*please|$)"),
        cuda_message, family="cuda"),
    # The same from the CUDA driver API, and from ROCm ("HIP error: invalid device function").
    LineRule("cuda-driver-api-error", "driver error", "cuda_error", re.compile(
        r"CUDA\s*driver\s*error\s*:\s*(?P<msg>[^.\n]{1,200})"), cuda_message, family="cuda"),
    LineRule("hip-error", "hip error", "cuda_error", re.compile(
        r"\bHIP\s*error\s*:\s*(?P<msg>.+?)\s*(?:HIP\s*kernel\s*errors|Search\s*for\s*`|Compile\s*with\s*`|$)"),
        cuda_message, family="cuda"),
    # The driver's and cuBLAS's own error names, as TensorFlow, JAX and C++ code print them:
    # "CUDA_ERROR_LAUNCH_FAILED: unspecified launch failure", "CUBLAS_STATUS_EXECUTION_FAILED".
    LineRule("cuda-malloc-oom", "memory", "oom", re.compile(
        r"\bcudaErrorMemoryAllocation\b|cudaMalloc\w{0,12}\s*failed\s*:?\s*out\s*of\s*memory"
        r"|" + _CUDA_CHECK + r"\s*out\s*of\s*memory"), _nothing, family="cuda"),
    # Caffe's and glog's CUDA check: "Check failed: error == cudaSuccess (74 vs. 0)  misaligned address".
    LineRule("cuda-check-glog", "cudasuccess", "cuda_error", re.compile(
        r"Check\s*failed:\s*\w{1,20}\s*==\s*" + _CUDA_CHECK + r"\s*(?P<msg>\S.{0,200})"),
        cuda_message, family="cuda"),
    LineRule("cuda-driver-oom", "cuda_error", "oom", re.compile(r"\bCUDA_ERROR_OUT_OF_MEMORY\b"),
             _nothing, family="cuda"),
    LineRule("cuda-driver-error", "cuda_error", "cuda_error", re.compile(
        r"\b(?P<msg>CUDA_ERROR_[A-Z_]{3,40})\b"), cuda_message, family="cuda"),
    LineRule("cudnn-error", "cudnn_status", "cuda_error", re.compile(
        r"\b(?P<msg>CUDNN_STATUS_(?!SUCCESS)[A-Z_]{3,40})\b"), cuda_message, family="cuda"),
    # No usable GPU or driver at all: torch's own words.
    LineRule("cuda-unavailable", "nvidia driver", "cuda_error", re.compile(
        r"(?P<msg>Found\s*no\s*NVIDIA\s*driver\s*on\s*your\s*system|The\s*NVIDIA\s*driver\s*on\s*your\s*system\s*is\s*too\s*old)"),
        cuda_message, family="cuda"),
    LineRule("cuda-no-gpus", "gpus", "cuda_error", re.compile(
        r"(?P<msg>No\s*CUDA\s*GPUs\s*are\s*available|ProcessGroupNCCL\s*is\s*only\s*supported\s*with\s*GPUs,\s*no\s*GPUs\s*found)"),
        cuda_message, family="cuda"),
    LineRule("cuda-deferred-call", "deferredcudacallerror", "cuda_error", re.compile(
        r"DeferredCudaCallError\s*:\s*(?P<msg>.{1,200})"), cuda_message, family="cuda"),
    # cuDNN's v8 API when no kernel fits the layer (often a cuDNN library other than torch's):
    # "GET was unable to find an engine to execute this computation".
    # A torch built without NCCL (Windows, macOS) asked for it: a platform error none of the
    # categories above names.
    LineRule("nccl-not-built", "nccl", "other", re.compile(_words("Distributed package doesn't have NCCL")), _nothing),
    # cuDNN failing to start or to pick a kernel (often the device out of memory underneath):
    # torch's "Unable to find a valid cuDNN algorithm", TensorFlow's "Failed to get convolution algorithm".
    LineRule("cudnn-no-algorithm", "cudnn", "cuda_error", re.compile(
        r"(?P<msg>Unable\s*to\s*find\s*a\s*valid\s*cuDNN\s*algorithm|Failed\s*to\s*get\s*convolution\s*algorithm\.\s*"
        r"This\s*is\s*probably\s*because\s*cuDNN\s*failed\s*to\s*initialize)"), cuda_message, family="cuda"),
    LineRule("cudnn-no-engine", "find an engine", "cuda_error", re.compile(
        r"(?P<msg>(?:GET|FIND)?\s*was\s*unable\s*to\s*find\s*an\s*engine\s*to\s*execute\s*this\s*computation)"),
        cuda_message, family="cuda"),
    LineRule("cublas-error", "cublas_status", "cuda_error", re.compile(
        r"\b(?P<msg>CUBLAS_STATUS_(?!SUCCESS)[A-Z_]{3,40})\b"), cuda_message, family="cuda"),
    # A kernel's assert, printed per thread before "CUDA error: device-side assert triggered":
    # ".../Indexing.cu:1231: indexSelectSmallIndex: block: [31,0,0], thread: [116,0,0] Assertion `x` failed."
    LineRule("cuda-device-assert", "assertion", "cuda_error", re.compile(
        r"\.cu[h]?:\d{1,9}:.{0,200}?Assertion\s*`(?P<cond>[^`]{1,200})`\s*failed"), device_assert, family="cuda"),
    LineRule("cuda-async-hint", "asynchronously", "cuda_error", re.compile(
        _words("CUDA kernel errors might be asynchronously reported")), _nothing, role="hint"),
    # The frames of the exception the NCCL watchdog raises for a timed-out work, where the
    # message line itself was cut from the paste.
    LineRule("nccl-checktimeout-frame", "checktimeout", "collective_timeout", re.compile(
        r"ProcessGroupNCCL::WorkNCCL::checkTimeout"), _nothing),
    # ProcessGroupNCCL taking the process down after a failed or timed-out collective; alone it is
    # the only word of the failure, beside the timeout or error line it only repeats it.
    LineRule("nccl-ops-failed", "nccl operations", "nccl_error", re.compile(
        _words("Some NCCL operations have failed or timed out")), _nothing, role="hint"),
    # -- memory --------------------------------------------------------------------
    LineRule("cuda-oom", "memory", "oom", re.compile(
        r"OutOfMemoryError\s*:\s*(?=\S)|(?:CUDA|HIP|XPU|NPU)\s*out\s*of\s*memory\.|MPS\s*backend\s*out\s*of\s*memory"),
        oom_facts),
    # XLA (JAX, TensorFlow) on an accelerator: "RESOURCE_EXHAUSTED: Out of memory while trying to
    # allocate 4770354232 bytes", "OOM when allocating tensor with shape[...]".
    LineRule("xla-oom", "resource_exhausted", "oom", re.compile(
        r"RESOURCE_EXHAUSTED\s*:\s*(?:Out\s*of\s*memory|Failed\s*to\s*allocate)"), _nothing),
    LineRule("tf-oom", "oom when", "oom", re.compile(_words("OOM when allocating tensor")), _nothing),
    # Host memory: torch's CPU allocator, the kernel's OOM killer, Ray's memory monitor.
    LineRule("host-oom", "memory", "oom", re.compile(
        r"DefaultCPUAllocator:\s*can't\s*allocate\s*memory|(?:Memory\s*cgroup\s*)?[Oo]ut\s*of\s*memory:\s*Kill(?:ed)?"
        r"\s*process\s*(?P<pid>\d{1,12})|killed\s*due\s*to\s*memory\s*pressure\s*\(OOM\)"),
        lambda m: {"pid": int(m.group("pid"))} if m.group("pid") else {}),
    # PaddlePaddle: "Out of memory error on GPU 0. Cannot allocate 400.000244MB memory on GPU 0, ...".
    LineRule("paddle-oom", "out of memory error", "oom", re.compile(
        r"Out\s*of\s*memory\s*error\s*on\s*(?:GPU|XPU|NPU)\s*\d{1,4}\b"), _nothing),
) + TORCH_RULES + FRAMEWORK_RULES + PROCESS_RULES

# Cheap pre-filter: a line holding none of these (lower-cased) words cannot start a message in RULES, so
# the rule loop skips it. Plain substrings: NCCL INFO chatter fills real logs, and a regex costs more.
_ANCHOR_WORDS = (
    "watchdog", "heartbeat", "signal", "timeout", "timed out", "collective", "enqueued", "either an",
    "error", "ncclinvalid", "ecc", "memory", "dataloader", "exitcode", "gloo", "processgroupnccl'",
    "nccl warn", "mismatch", "assertion", "terminated with", "subset of ranks", "nccl operations",
    "checktimeout", "cublas_status", "return code", "nccl failure", "cudnn_status", "oom when",
    "failed to connect", "resource_exhausted", "rendezvous", "socket timeout", "failed to listen", "torch_",
    "encountered in worker", "hip error", "driver error", "died with", "srun", "noticed", "no longer possible",
    "monitoredbarrier", "/dev/shm", "the server socket", "abort", "kernel image", "cudasuccess", "hccl",
    "already in use", "duplicate gpu", "find an engine", "killing subprocess", "warp", "nvidia driver", "gpus",
    "deferredcudacallerror", "deadline_exceeded", "cudnn", "remote peer", "worker group failed", "actor died",
    "worker died", "ran out of memory", "child process", "stop_waiting", "nan or inf", "got 0 bytes", "non-zero exit code", *_FRAMEWORK_WORDS, *_TORCH_WORDS, "distnetworkerror", "raisedexception",
    "non-zero exit status", "horovod has been shut down", "mmap", "store based barrier", "lock file", "accept failed",
)


_ANCHORS = tuple(sorted(w for w in set(_ANCHOR_WORDS) if not any(o != w and o in w for o in _ANCHOR_WORDS)))


def may_hold_message(line: str) -> bool:
    """True when a line may hold (the start of) a known message (_ANCHORS: the words without those that
    hold a shorter one, "error" standing for "hip error": the same lines, fewer tests)."""
    lower = line.lower()
    return any(word in lower for word in _ANCHORS)
