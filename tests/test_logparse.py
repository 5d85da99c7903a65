"""Log parsers: each message form, rank attribution, merging, cross-rank comparison.

Lines follow the formats PyTorch, NCCL and torchelastic print (see the real
logs in tests/fixtures/explain); numbers are made up.
"""

from __future__ import annotations

import pytest

from trainwatch.diagnostics.findings import ERROR_CATEGORIES, FINDING_KEYS
from trainwatch.diagnostics.log_rules import signal_name, to_bytes
from trainwatch.diagnostics.logparse import error_findings, line_rank, parse_log, rank_from_name
from trainwatch.diagnostics.rank_comparison import collapse_ranks, mismatch_findings

TIMEOUT = ("[rank{r}]:[E1206 18:44:12.715298746 ProcessGroupNCCL.cpp:607] [Rank {r}] Watchdog caught collective "
           "operation timeout: WorkNCCL(SeqNum={seq}, OpType={op}, NumelIn=1, NumelOut=1, Timeout(ms)=600000) "
           "ran for 600012 milliseconds before timing out.")
AT_WORK = ("[rank{r}]:[E1206 18:44:12.715588844 ProcessGroupNCCL.cpp:1664] [PG {pg} Rank {r}] Exception (either an "
           "error or timeout) detected by watchdog at work: {seq}, last enqueued NCCL work: {enq}, last completed "
           "NCCL work: {comp}.")


def one(text: str, source: str | None = None) -> dict:
    findings = error_findings(text, source)
    assert len(findings) == 1, findings
    return findings[0]


def categories(text: str) -> list[str]:
    return [f["category"] for f in error_findings(text)]


# -- collective timeouts ------------------------------------------------------------


def test_watchdog_timeout_new_format() -> None:
    f = one(TIMEOUT.format(r=3, seq=8241, op="ALLREDUCE"))
    assert f["kind"] == "error"
    assert f["category"] == "collective_timeout"
    assert (f["op"], f["seq"], f["timeout_ms"], f["rank"], f["ranks"]) == ("ALLREDUCE", 8241, 600000, 3, [3])
    assert (f["numel_in"], f["numel_out"]) == (1, 1)
    assert (f["severity"], f["runbook"]) == ("high", "collective-timeout")
    assert f["evidence"].startswith("[rank3]:[E1206") and f["evidence"].endswith("before timing out.")
    assert list(f)[:len(FINDING_KEYS)] == list(FINDING_KEYS)
    assert f["xid"] is None and f["pci"] is None


def test_watchdog_timeout_pg_guid_prefix_and_last_enqueued() -> None:
    text = "\n".join([
        "[rank3]:[E626 06:24:44.903 ProcessGroupNCCL.cpp:616] [PG ID 0 PG GUID 0(default_pg) Rank 3] Watchdog caught "
        "collective operation timeout: WorkNCCL(SeqNum=8241, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
        "Timeout(ms)=600000) ran for 600012 milliseconds before timing out.",
        "[rank3]:[E626 06:24:44.906 ProcessGroupNCCL.cpp:1785] [PG ID 0 PG GUID 0(default_pg) Rank 3] Exception "
        "(either an error or timeout) detected by watchdog at work: 8241, last enqueued NCCL work: 8242, last "
        "completed NCCL work: 8240.",
    ])
    f = one(text)
    assert (f["seq"], f["last_enqueued"], f["last_completed"], f["pg"], f["rank"]) == (8241, 8242, 8240, "0", 3)


def test_old_format_without_numel_leaves_them_unknown() -> None:
    f = one("[E ProcessGroupNCCL.cpp:737] [Rank 1] Watchdog caught collective operation timeout: "
            "WorkNCCL(SeqNum=469508, OpType=ALLREDUCE, Timeout(ms)=1800000) ran for 1802212 milliseconds before "
            "timing out.")
    assert (f["seq"], f["op"], f["timeout_ms"], f["rank"]) == (469508, "ALLREDUCE", 1800000, 1)
    assert f.get("numel_in") is None and f.get("last_enqueued") is None


def test_oldest_format_without_seqnum() -> None:
    f = one("[E ProcessGroupNCCL.cpp:566] [Rank 0] Watchdog caught collective operation timeout: "
            "WorkNCCL(OpType=BROADCAST, Timeout(ms)=1800000) ran for 1806128 milliseconds before timing out.")
    assert (f["op"], f["seq"], f["timeout_ms"]) == ("BROADCAST", None, 1800000)


def test_blocking_wait_and_watchdog_lines_are_one_finding() -> None:
    text = "\n".join([
        TIMEOUT.format(r=1, seq=2521, op="ALLREDUCE"),
        "[rank1]:[E1002 18:16:40.662691402 ProcessGroupNCCL.cpp:756] [Rank 1] Work WorkNCCL(SeqNum=2521, "
        "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) timed out in blocking wait.",
    ])
    assert one(text)["seq"] == 2521


def test_timeout_at_work_alone_is_a_timeout_without_op() -> None:
    f = one("[rank2]:[E1206 18:44:16.99 ProcessGroupNCCL.cpp:1709] [PG 1 Rank 2] Timeout at NCCL work: 7753, "
            "last enqueued NCCL work: 7755, last completed NCCL work: 7752.")
    assert (f["category"], f["seq"], f["op"], f["last_enqueued"], f["last_completed"]) == \
        ("collective_timeout", 7753, None, 7755, 7752)


def test_exception_at_work_alone_is_no_finding() -> None:
    # "either an error or timeout": not enough to call it a timeout.
    assert error_findings(AT_WORK.format(r=0, pg=1, seq=5, enq=5, comp=4)) == []


def test_failure_detected_pg_status_line_enriches_the_timeout() -> None:
    text = "\n".join([
        TIMEOUT.format(r=7, seq=460631, op="ALLREDUCE"),
        "[rank7]:[E901 05:20:03.12 ProcessGroupNCCL.cpp:2271] [PG ID 0 PG GUID 0(default_pg) Rank 7]  failure "
        "detected by watchdog at work sequence id: 460631 PG status: last enqueued work: 460631, last completed "
        "work: 460630",
    ])
    f = one(text)
    assert (f["last_enqueued"], f["last_completed"]) == (460631, 460630)


def test_gloo_recv_timeout() -> None:
    f = one("RuntimeError: [/opt/conda/conda-bld/pytorch/work/third_party/gloo/gloo/transport/tcp/"
            "unbound_buffer.cc:81] Timed out waiting 1800000ms for recv operation to complete")
    assert (f["category"], f["timeout_ms"], f["transport"], f["op"]) == ("collective_timeout", 1800000, "gloo", None)


def test_gloo_peer_closed() -> None:
    f = one("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:598] Read error [10.0.0.2]:60270: "
            "Connection closed by peer")
    assert (f["category"], f["transport"], f["peer"]) == ("collective_timeout", "gloo", "[10.0.0.2]:60270")


def test_wrapped_message_is_joined_and_keeps_its_rank() -> None:
    text = ("[rank2]:[E424 01:11:21.16 ProcessGroupNCCL.cpp:629] [Rank 2] Watchdog caught collective operation "
            "timeout: WorkNCCL(SeqNum=4, OpTy\npe=BROADCAST, NumelIn=112, NumelOut=112, Timeout(ms)=1800000) ran for "
            "1800010 milliseconds before timing out.")
    f = one(text)
    assert (f["op"], f["seq"], f["rank"]) == ("BROADCAST", 4, 2)


def test_message_wrapped_at_a_word_break() -> None:
    text = ("[rank0]:[E327 17:04:16.98 ProcessGroupNCCL.cpp:565] [Rank 0] Watchdog caught collective operation\n"
            "timeout: WorkNCCL(SeqNum=2,\nOpType=ALLREDUCE, NumelIn=12, NumelOut=12, Timeout(ms)=1000) ran for\n"
            "1099 milliseconds before timing out.")
    f = one(text)
    assert (f["op"], f["seq"], f["timeout_ms"], f["rank"]) == ("ALLREDUCE", 2, 1000, 0)


# -- heartbeat monitor / watchdog -------------------------------------------------------


def test_heartbeat_monitor() -> None:
    f = one("[rank3]:[E ProcessGroupNCCL.cpp:1316] [PG 0 Rank 3] Heartbeat monitor timed out! Process will be "
            "terminated after dumping debug info. workMetaList_.size()=2")
    assert (f["category"], f["rank"], f["pending_work"], f["runbook"]) == (
        "heartbeat_timeout", 3, 2, "heartbeat-timeout")


def test_dump_signal_from_another_rank() -> None:
    f = one("[rank5]:[E723 01:58:45.66 ProcessGroupNCCL.cpp:1743] [PG ID 0 PG GUID 0(default_pg) Rank 5] Received a "
            "dump signal due to a collective timeout from  rank 2 and we will try our best to dump the debug info. "
            "Last enqueued NCCL work: 136, last completed NCCL work: 135.This is most likely caused by incorrect "
            "usages of collectives")
    # The signal is sent because a collective timed out (on rank 2): a collective time-out.
    assert (f["category"], f["rank"], f["source_rank"], f["last_enqueued"], f["last_completed"], f["runbook"]) == (
        "collective_timeout", 5, 2, 136, 135, "collective-timeout")


def test_dump_signal_from_this_local_rank_names_itself() -> None:
    f = one("[rank1]:[E418 01:32:50.9 ProcessGroupNCCL.cpp:1890] [PG ID 0 PG GUID 0(default_pg) Rank 1] Received a "
            "dump signal due to a collective timeout from this local rank and we will try our best to dump the debug "
            "info. Last enqueued NCCL work: 9, last completed NCCL work: 9.")
    assert f["source_rank"] == 1


def test_dump_signal_from_this_local_rank_without_a_rank_stays_unknown() -> None:
    f = one("Received a dump signal due to a collective timeout from this local rank and we will try our best to "
            "dump the debug info.")
    assert f["rank"] is None and f.get("source_rank") is None


def test_timeout_signal_from_the_monitor_thread() -> None:
    f = one("[rank0]:[E327 17:04:16.18 ProcessGroupNCCL.cpp:1346] [PG 0 Rank 0] Received a timeout signal from this "
            "local rank and will start to dump the debug info. Last enqueued NCCL work: 2, last completed NCCL "
            "work: 1.")
    assert (f["category"], f["rank"]) == ("collective_timeout", 0)


def test_watchdog_stuck_is_the_heartbeat_monitor_timing_out() -> None:
    """torch >= 2.4's heartbeat monitor names the stuck watchdog instead of printing
    "Heartbeat monitor timed out!"; no WorkNCCL/SeqNum line comes with it."""
    f = one("[rank3]:[E419 10:53:25.42 ProcessGroupNCCL.cpp:1484] [PG ID 0 PG GUID 0(default_pg) Rank 3] "
            "ProcessGroupNCCL's watchdog got stuck for 480 seconds without making progress in monitoring enqueued "
            "collectives. This typically indicates a NCCL/CUDA API (e.g., CudaEventDestroy) hang blocking the "
            "watchdog, and could be triggered by another thread holding the GIL inside a CUDA api (for example, "
            "CudaEventDestroy), or other deadlock-prone behaviors.")
    assert (f["category"], f["severity"], f["runbook"]) == ("heartbeat_timeout", "high", "watchdog-stuck")
    assert (f["stuck_s"], f["timeout_ms"], f["rank"], f["pg"], f["pg_name"]) == (480, 480000, 3, "0", "default_pg")
    assert f["seq"] is None and f["op"] is None


def test_watchdog_stuck_in_a_named_subgroup_keeps_its_name() -> None:
    f = one("[rank4]:[E205 18:11:06.37 ProcessGroupNCCL.cpp:1870] [PG ID 12 PG GUID 99(EXPERT_MODEL_PARALLEL_GROUP) "
            "Rank 4] ProcessGroupNCCL's watchdog got stuck for 600 seconds without making progress")
    assert (f["rank"], f["pg"], f["pg_name"], f["stuck_s"]) == (4, "99", "EXPERT_MODEL_PARALLEL_GROUP", 600)


def test_heartbeat_line_and_stuck_watchdog_line_are_one_event() -> None:
    text = ("[rank3]:[E ProcessGroupNCCL.cpp:1316] [PG 0 Rank 3] Heartbeat monitor timed out! Process will be "
            "terminated after dumping debug info. workMetaList_.size()=2\n"
            "[rank3]:[F ProcessGroupNCCL.cpp:1169] [PG 0 Rank 3] [PG 0 Rank 3] ProcessGroupNCCL's watchdog got stuck "
            "for 600 seconds without making progress in monitoring enqueued collectives.")
    f = one(text)
    assert (f["category"], f["rank"], f["pending_work"], f["stuck_s"]) == ("heartbeat_timeout", 3, 2, 600)


# -- NCCL errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(("description", "code"), [
    ("unhandled system error (run with NCCL_DEBUG=INFO for details)", "ncclSystemError"),
    ("internal error - please report this issue to the NCCL developers", "ncclInternalError"),
    ("internal error", "ncclInternalError"),
    ("remote process exited or there was a network error", "ncclRemoteError"),
    ("unhandled cuda error (run with NCCL_DEBUG=INFO for details)", "ncclUnhandledCudaError"),
    ("invalid usage (run with NCCL_DEBUG=WARN for details)", "ncclInvalidUsage"),
    ("invalid argument", "ncclInvalidArgument"),
])
def test_nccl_error_line(description: str, code: str) -> None:
    f = one(f"torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/"
            f"ProcessGroupNCCL.cpp:1970, {description}, NCCL version 2.18.1")
    assert (f["category"], f["nccl_code"], f["nccl_version"]) == ("nccl_error", code, "2.18.1")
    assert f["runbook"] == "nccl-error"


def test_unknown_nccl_description_keeps_the_code_unknown() -> None:
    f = one("RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:38, something new happened, NCCL version 2.30.1")
    assert f["category"] == "nccl_error" and f["nccl_code"] is None


def test_nccl_error_and_code_line_are_one_finding_with_last_error() -> None:
    text = "\n".join([
        "[rank7]: torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, "
        "unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.20.5",
        "[rank7]: ncclUnhandledCudaError: Call to CUDA function failed.",
        "[rank7]: Last error:",
        "[rank7]: Cuda failure 1 'invalid argument'",
    ])
    f = one(text)
    assert (f["rank"], f["nccl_code"]) == (7, "ncclUnhandledCudaError")
    assert f["last_error"] == "Cuda failure 1 'invalid argument'"


@pytest.mark.parametrize("code", ["ncclSystemError", "ncclInternalError", "ncclRemoteError", "ncclUnhandledCudaError",
                                  "ncclInvalidUsage", "ncclInvalidArgument"])
def test_nccl_code_line_alone(code: str) -> None:
    f = one(f"{code}: A call failed.")
    assert (f["category"], f["nccl_code"]) == ("nccl_error", code)


def test_async_nccl_error_carries_the_collective() -> None:
    f = one("Collective WorkNCCL(SeqNum=2, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=1000000) raised the "
            "following async exception: NCCL error: unhandled system error (run with NCCL_DEBUG=INFO for details), "
            "NCCL version 2.25.1")
    assert (f["category"], f["seq"], f["op"], f["nccl_code"]) == ("nccl_error", 2, "ALLREDUCE", "ncclSystemError")


def test_blank_line_after_last_error_means_no_detail() -> None:
    f = one("ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error.\n"
            "Last error:\n\nException raised from checkForNCCLErrorsInternal at ProcessGroupNCCL.cpp:2501")
    assert f.get("last_error") is None


# -- CUDA ----------------------------------------------------------------------------------------


ASYNC_HINT = ("CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below "
              "might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1.")


def test_illegal_memory_access_hides_the_generic_hint() -> None:
    f = one("RuntimeError: CUDA error: an illegal memory access was encountered\n" + ASYNC_HINT)
    assert (f["category"], f["runbook"], f["severity"]) == ("illegal_memory_access", "illegal-memory-access", "medium")


def test_ecc() -> None:
    f = one("RuntimeError: CUDA error: uncorrectable ECC error encountered\n" + ASYNC_HINT)
    assert (f["category"], f["runbook"], f["severity"]) == ("ecc", "gpu-ecc", "critical")


def test_other_cuda_error_keeps_its_message() -> None:
    f = one("RuntimeError: CUDA error: device-side assert triggered\n" + ASYNC_HINT)
    assert (f["category"], f["cuda_message"]) == ("cuda_error", "device-side assert triggered")


def test_async_hint_alone_is_a_cuda_error() -> None:
    f = one(ASYNC_HINT)
    assert f["category"] == "cuda_error" and f.get("cuda_message") is None


def test_cuda_error_out_of_memory_is_oom() -> None:
    f = one("RuntimeError: CUDA error: out of memory\n" + ASYNC_HINT)
    assert f["category"] == "oom" and f.get("requested_bytes") is None


# -- OOM -----------------------------------------------------------------------------------------


def test_oom_current_format() -> None:
    f = one("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
            "79.15 GiB of which 1.23 GiB is free. Including non-PyTorch memory, this process has 77.91 GiB memory "
            "in use.")
    assert (f["category"], f["requested_bytes"], f["gpu"]) == ("oom", 2 * 2**30, 0)
    assert f["total_bytes"] == round(79.15 * 2**30) and f["free_bytes"] == round(1.23 * 2**30)


def test_oom_pre_2_1_format() -> None:
    f = one("RuntimeError: CUDA out of memory. Tried to allocate 512.00 MiB (GPU 3; 15.90 GiB total capacity; "
            "13.13 GiB already allocated; 415.88 MiB free; 14.80 GiB reserved in total by PyTorch)")
    assert (f["requested_bytes"], f["gpu"], f["allocated_bytes"]) == (512 * 2**20, 3, round(13.13 * 2**30))
    assert f["free_bytes"] == round(415.88 * 2**20)


def test_oom_without_numbers_leaves_them_unknown() -> None:
    f = one("torch.cuda.OutOfMemoryError: CUDA out of memory.")
    assert f["category"] == "oom"
    assert all(f.get(k) is None for k in ("requested_bytes", "total_bytes", "free_bytes", "gpu"))


# -- processes ---------------------------------------------------------------------------------------

CHILD_FAILED = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2024-05-01_10:00:00
  host      : node-b
  rank      : 9 (local_rank: 1)
  exitcode  : 1 (pid: 4321)
  error_file: /tmp/torchelastic_x/error.json
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2024-05-01_10:00:00
  host      : node-a
  rank      : 3 (local_rank: 3)
  exitcode  : -9 (pid: 1234)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 1234
============================================================"""


def test_child_failed_summary_gives_one_finding_per_failure() -> None:
    findings = error_findings(CHILD_FAILED)
    assert [f["category"] for f in findings] == ["child_failed", "child_failed"]
    other, root = findings
    assert (root["rank"], root["local_rank"], root["exit_code"], root["pid"], root["signal"], root["host"]) == (
        3, 3, -9, 1234, "SIGKILL", "node-a")
    assert root["root_cause"] is True and root.get("error_file") is None
    assert (other["rank"], other["exit_code"], other["signal"], other["root_cause"]) == (9, 1, None, False)
    assert other["error_file"] == "/tmp/torchelastic_x/error.json"
    assert root["evidence"] == ("rank      : 3 (local_rank: 3); exitcode  : -9 (pid: 1234); "
                                "traceback : Signal 9 (SIGKILL) received by PID 1234")


def test_agent_failed_line_joins_the_summary_entry_of_the_same_pid() -> None:
    text = ("E0325 20:57:27.620000 2606 torch/distributed/elastic/multiprocessing/api.py:869] failed (exitcode: -9) "
            "local_rank: 3 (pid: 1234) of binary: /usr/bin/python\n" + CHILD_FAILED)
    root = [f for f in error_findings(text) if f.get("pid") == 1234]
    assert len(root) == 1 and root[0]["rank"] == 3


def test_agent_failed_line_alone_does_not_guess_the_global_rank() -> None:
    f = one("ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: -6) local_rank: 5 (pid: 22) of "
            "binary: /opt/conda/bin/python")
    assert (f["rank"], f["local_rank"], f["signal"], f["exit_code"]) == (None, 5, "SIGABRT", -6)


@pytest.mark.parametrize(("line", "pids", "signal"), [
    ("RuntimeError: DataLoader worker (pid 1234) is killed by signal: Killed.", [1234], "SIGKILL"),
    ("RuntimeError: DataLoader worker (pid 99) is killed by signal: Bus error.", [99], "SIGBUS"),
    ("RuntimeError: DataLoader worker (pid 7) is killed by signal: Segmentation fault.", [7], "SIGSEGV"),
    ("RuntimeError: DataLoader worker (pid(s) 123, 456) exited unexpectedly", [123, 456], None),
    ("RuntimeError: DataLoader worker is killed by signal: Killed.", None, "SIGKILL"),
])
def test_dataloader_worker_killed(line: str, pids: list[int] | None, signal: str | None) -> None:
    f = one(line)
    assert (f["category"], f["pids"], f.get("signal"), f["runbook"]) == (
        "dataloader_worker_killed", pids, signal, "dataloader-worker-killed")


def test_dataloader_exit_code() -> None:
    f = one("RuntimeError: DataLoader worker (pid 4743) exited unexpectedly with exit code 1. Details are lost due "
            "to multiprocessing.")
    assert (f["exit_code"], f.get("signal")) == (1, None)


def test_dataloader_bus_error_in_worker() -> None:
    f = one("ERROR: Unexpected bus error encountered in worker. This might be caused by insufficient shared memory "
            "(shm).")
    assert (f["category"], f["signal"]) == ("dataloader_worker_killed", "SIGBUS")


def test_source_code_lines_in_a_traceback_are_not_failures() -> None:
    text = "\n".join([
        "    raise RuntimeError('DataLoader worker (pid(s) {}) exited unexpectedly'.format(pids_str)) from e",
        "    except torch.cuda.OutOfMemoryError:",
        "# source: https://github.com/x/y/issues/1 CUDA error: unknown error",
    ])
    assert error_findings(text) == []


# -- ranks ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("line", "rank"), [
    ("[rank3]:[E ProcessGroupNCCL.cpp:1] [PG 5 Rank 0] x", 3),  # global prefix beats the PG rank
    ("[E ProcessGroupNCCL.cpp:1] [Rank 4] x", 4),
    ("[E ProcessGroupNCCL.cpp:1] [PG ID 0 PG GUID 0(default_pg) Rank 6] x", 6),
    ("[E ProcessGroupNCCL.cpp:1] [PG 0 (default_pg) Rank 2] x", 2),
    ("[E ProcessGroupNCCL.cpp:1] [PG 5 Rank 0] x", None),  # rank inside group 5: not the global rank
    ("[E ProcessGroupNCCL.cpp:1] [PG ID 2 PG GUID 9 Rank 4] x", None),
    ("(VllmWorker rank=5 pid=33503) ERROR 03-06 06:49:30 x", 5),
    ("'--local_rank=0', '--name'", None),
    ("plain line", None),
])
def test_line_rank(line: str, rank: int | None) -> None:
    assert line_rank(line) == rank


@pytest.mark.parametrize(("name", "rank"), [
    ("rank3.log", 3), ("logs/rank_12.txt", 12), ("job-rank-0.err", 0), ("/x/RANK7.log", 7),
    ("train.log", None), ("prank3.log", None), ("rank.log", None), (None, None),
])
def test_rank_from_name(name: str | None, rank: int | None) -> None:
    assert rank_from_name(name) == rank


def test_file_name_rank_fills_only_unknown_ranks() -> None:
    text = TIMEOUT.format(r=3, seq=5, op="ALLREDUCE") + "\nRuntimeError: CUDA error: unspecified launch failure"
    findings = {f["category"]: f for f in error_findings(text, source="logs/rank6.log")}
    assert findings["collective_timeout"]["rank"] == 3
    assert findings["cuda_error"]["rank"] == 6


def test_same_timeout_on_many_ranks_is_one_finding() -> None:
    text = "\n".join(TIMEOUT.format(r=r, seq=808, op="ALLREDUCE") for r in (2, 0, 1))
    f = one(text)
    assert (f["ranks"], f["rank"]) == ([0, 1, 2], None)


def test_collapse_keeps_a_per_rank_detail_only_when_all_agree() -> None:
    a = {**dict.fromkeys(FINDING_KEYS), "kind": "error", "category": "heartbeat_timeout", "rank": 0, "pending_work": 3}
    b = {**a, "rank": 4, "pending_work": 2}
    c = {**a, "rank": 5, "pending_work": 3}
    (merged,) = collapse_ranks([a, b])
    assert (merged["ranks"], merged["pending_work"]) == ([0, 4], None)
    (merged,) = collapse_ranks([a, c])
    assert (merged["ranks"], merged["pending_work"]) == ([0, 5], 3)


def test_every_category_has_a_runbook_and_severity() -> None:
    severities = {"info", "low", "medium", "high", "critical"}
    for category, (severity, runbook) in ERROR_CATEGORIES.items():
        assert severity in severities
        # The exceptions share the runbook of a stack category (ECC, a data loader that stalls, a
        # barrier, an extension build's lock), or name what `other` is when a log says it (a
        # Python exception nothing else explains).
        assert runbook.replace("-", "_") == category or runbook in (
            "gpu-ecc", "dataloader-stall", "barrier-hang", "cpp-extension-lock", "python-exception")


# -- cross-rank comparison ------------------------------------------------------------------------


def test_timed_out_seqnums_name_the_rank_behind() -> None:
    seqs = ((0, 8242), (1, 8242), (2, 8242), (5, 8241))
    text = "\n".join(TIMEOUT.format(r=r, seq=s, op="ALLREDUCE") for r, s in seqs)
    mismatch = error_findings(text)[0]
    assert mismatch["category"] == "collective_mismatch"
    assert (mismatch["ranks"], mismatch["rank"], mismatch["seq"], mismatch["op"]) == ([5], 5, 8242, "ALLREDUCE")
    assert mismatch["evidence"] == "3 ranks reached SeqNum 8242; rank 5 only 8241"
    assert mismatch["leading_ranks"] == [0, 1, 2]
    assert mismatch["behind"] == [{"rank": 5, "seq": 8241}]
    assert (mismatch["severity"], mismatch["runbook"], mismatch["timeout_ms"]) == ("high", "collective-mismatch", None)


def test_several_lagging_ranks_are_listed_by_how_far_behind() -> None:
    text = "\n".join(AT_WORK.format(r=r, pg=1, seq=e, enq=e, comp=e - 1)
                     for r, e in ((0, 100), (1, 100), (2, 99), (3, 97), (4, 99)))
    (mismatch,) = [f for f in error_findings(text) if f["category"] == "collective_mismatch"]
    assert mismatch["ranks"] == [2, 3, 4] and mismatch["rank"] is None
    assert mismatch["evidence"] == "2 ranks enqueued up to SeqNum 100; ranks 2, 4 only 99; rank 3 only 97"
    assert mismatch["pg"] == "1" and mismatch["metric"] == "last_enqueued"


def test_agreeing_ranks_give_no_mismatch() -> None:
    text = "\n".join(TIMEOUT.format(r=r, seq=808, op="ALLREDUCE") + "\n"
                     + AT_WORK.format(r=r, pg=0, seq=808, enq=811, comp=807) for r in range(4))
    assert "collective_mismatch" not in categories(text)


def test_different_process_groups_are_not_compared() -> None:
    text = "\n".join([
        TIMEOUT.format(r=13, seq=216, op="ALLTOALL_BASE"),
        AT_WORK.format(r=13, pg="ID 11 PG GUID 119", seq=216, enq=220, comp=215),
        TIMEOUT.format(r=15, seq=57, op="ALLREDUCE"),
        AT_WORK.format(r=15, pg="ID 11 PG GUID 112", seq=57, enq=57, comp=56),
    ])
    assert "collective_mismatch" not in categories(text)


def test_a_rank_with_several_seqnums_and_no_group_is_not_compared() -> None:
    # Old logs print no process group; two SeqNums on one rank are two groups.
    text = "\n".join([
        "[E ProcessGroupNCCL.cpp:458] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=96120, "
        "OpType=ALLREDUCE, Timeout(ms)=1800000) ran for 25624887 milliseconds before timing out.",
        "[E ProcessGroupNCCL.cpp:458] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=96117, "
        "OpType=ALLREDUCE, Timeout(ms)=1800000) ran for 25625613 milliseconds before timing out.",
        "[E ProcessGroupNCCL.cpp:458] [Rank 7] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=64088, "
        "OpType=ALLREDUCE, Timeout(ms)=1800000) ran for 25625251 milliseconds before timing out.",
    ])
    assert "collective_mismatch" not in categories(text)


def test_ranks_each_timing_out_once_in_different_ops_are_compared() -> None:
    # One timeout per rank and no group named: the text gives no reason to think of two
    # groups, and a rank one collective behind in another op has left the schedule.
    text = TIMEOUT.format(r=0, seq=10, op="ALLREDUCE") + "\n" + TIMEOUT.format(r=1, seq=9, op="BROADCAST")
    (mismatch,) = [f for f in error_findings(text) if f["category"] == "collective_mismatch"]
    assert (mismatch["ranks"], mismatch["seq"], mismatch["op"]) == ([1], 10, "ALLREDUCE")  # the op the leaders are in


def test_a_rank_timing_out_in_several_unnamed_groups_is_not_compared() -> None:
    text = "\n".join([TIMEOUT.format(r=0, seq=10, op="ALLREDUCE"), TIMEOUT.format(r=0, seq=3, op="BROADCAST"),
                      TIMEOUT.format(r=1, seq=9, op="BROADCAST")])
    assert "collective_mismatch" not in categories(text)


def test_unranked_progress_is_not_compared() -> None:
    text = "last enqueued NCCL work: 8242, last completed NCCL work: 8241\n" \
           "last enqueued NCCL work: 8241, last completed NCCL work: 8240"
    assert error_findings(text) == []


def test_progress_points_from_per_rank_files() -> None:
    points = []
    for rank, enqueued in ((0, 8242), (1, 8242), (5, 8241)):
        text = f"last enqueued NCCL work: {enqueued}, last completed NCCL work: {enqueued - 1}"
        parsed = parse_log(text, source=f"rank{rank}.log")
        assert parsed.findings == []  # counters alone are no failure
        points += parsed.points
    (mismatch,) = mismatch_findings(points)
    assert (mismatch["ranks"], mismatch["seq"]) == ([5], 8242)
    assert mismatch["evidence"] == "2 ranks enqueued up to SeqNum 8242; rank 5 only 8241"


def test_mismatch_findings_of_nothing() -> None:
    assert mismatch_findings([]) == []


# -- helpers --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "value"), [
    ("2.00 GiB", 2 * 2**30), ("512.00 MiB", 512 * 2**20), ("0 bytes", 0), ("1.5 KiB", 1536), ("10 GB", 10**10),
    ("3 parsecs", None),
])
def test_to_bytes(text: str, value: int | None) -> None:
    assert to_bytes(text) == value


def test_signal_name() -> None:
    assert [signal_name(n) for n in (9, 6, 11, 999)] == ["SIGKILL", "SIGABRT", "SIGSEGV", None]


def test_empty_and_unrelated_text() -> None:
    assert error_findings("") == []
    assert error_findings("step 100 | loss 2.31 | lr 3e-4\nNCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC\n") == []


# -- ranks that disagree: torch's own mismatch reports ------------------------------------------

_OPTIONS = ("TensorOptions(dtype=float (default), device=cuda, layout=Strided (default), requires_grad=false "
            "(default), pinned_memory=false (default), memory_format=(nullopt))")


def test_fingerprint_mismatch_names_both_ranks_and_their_collectives() -> None:
    # Lightning-AI/pytorch-lightning#19045: the peer's fingerprint lost its comma.
    f = one(f"[rank3]: RuntimeError: Detected mismatch between collectives on ranks. Rank 3 is running collective: "
            f"CollectiveFingerPrint(SequenceNumber=152517, OpType=BROADCAST, TensorShape=[1], TensorDtypes=Long, "
            f"TensorDeviceTypes={_OPTIONS}), but Rank 0 is running collective: "
            f"CollectiveFingerPrint(SequenceNumber=0OpType=REDUCE).Collectives differ in the following aspects: "
            f"\t Sequence number: 152517vs 0  Op type: BROADCASTvs REDUCE")
    assert (f["category"], f["severity"], f["runbook"]) == ("collective_mismatch", "high", "collective-mismatch")
    assert (f["ranks"], f["rank"], f["reported_by"], f["op"], f["seq"]) == ([0, 3], None, 3, None, None)
    assert f["per_rank"] == [{"rank": 0, "seq": 0, "op": "REDUCE"}, {"rank": 3, "seq": 152517, "op": "BROADCAST"}]
    assert f["mismatch"] == "rank 0 REDUCE #0 vs rank 3 BROADCAST #152517"


def test_fingerprint_mismatch_of_shapes_keeps_the_common_op_and_seq() -> None:
    # modelscope/ms-swift#9443
    f = one(f"[rank1]: RuntimeError: Detected mismatch between collectives on ranks. Rank 1 is running collective: "
            f"CollectiveFingerPrint(SequenceNumber=3104, OpType=ALLREDUCE, TensorShape=[195812480], "
            f"TensorDtypes=BFloat16, TensorDeviceTypes={_OPTIONS}), but Rank 0 is running collective: "
            f"CollectiveFingerPrint(SequenceNumber=3104, OpType=ALLREDUCE, TensorShape=[51123456], "
            f"TensorDtypes=BFloat16, TensorDeviceTypes={_OPTIONS}).")
    assert (f["op"], f["seq"], f["ranks"]) == ("ALLREDUCE", 3104, [0, 1])


def test_old_fingerprint_mismatch_without_sequence_numbers() -> None:
    # speechbrain/speechbrain#1166 (torch 1.10): one fingerprint only, no peer.
    f = one(f"RuntimeError: Detected mismatch between collectives on ranks. Rank 0 is running inconsistent "
            f"collective: CollectiveFingerPrint(OpType=BROADCAST, TensorShape=[4], TensorDtypes=Float, "
            f"TensorDeviceTypes={_OPTIONS}")
    assert (f["ranks"], f["rank"], f["op"], f["seq"]) == ([0], 0, "BROADCAST", None)


def test_the_same_mismatch_seen_from_both_ranks_is_one_finding() -> None:
    side = "CollectiveFingerPrint(SequenceNumber=21, OpType={op}, TensorShape=[1])"
    line = ("[rank{r}]: RuntimeError: Detected mismatch between collectives on ranks. Rank {r} is running "
            "collective: {mine}, but Rank {o} is running collective: {theirs}.")
    text = "\n".join([
        line.format(r=0, o=1, mine=side.format(op="BROADCAST"), theirs=side.format(op="ALLREDUCE")),
        line.format(r=1, o=0, mine=side.format(op="ALLREDUCE"), theirs=side.format(op="BROADCAST")),
    ])
    f = one(text)
    assert (f["ranks"], f["seq"], f["op"], f.get("reported_by")) == ([0, 1], 21, None, None)


NCCL_DESYNC_REPORT = (
    "[rank0]:[E ProcessGroupNCCL.cpp:577] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=103, "
    "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600315 milliseconds before timing out.\n"
    "[rank0]:[E ProcessGroupNCCL.cpp:1096]\n"
    "\t - [0] Timeout at collective: ALLREDUCE, #103\n"
    "\t - To our best knowledge, the lagging/dead/mismatched ranks that caused the desync are:\n"
    "\t   - [3] joined but didn't finish collective #103 (count from 1)\n"
    "\t     [1, 2] finished collective #103, but didn't join collective #104 (count from 1)\n"
    "\t - Snapshot of ranks' latest states:\n"
    "\t   #103 started ranks:\n"
    "\t     [0, 3] started ALLREDUCE\n"
)


def test_nccl_desync_report_names_the_lagging_ranks() -> None:
    """The report's wording is torch's retrieveDesyncReport (torch/csrc/distributed/c10d/TraceUtils.h)."""
    findings = error_findings(NCCL_DESYNC_REPORT)
    assert [f["category"] for f in findings] == ["collective_timeout", "collective_mismatch"]
    f = findings[1]
    assert (f["ranks"], f["rank"], f["op"], f["seq"], f["reported_by"]) == ([1, 2, 3], None, "ALLREDUCE", 103, 0)
    assert f["per_rank"] == [
        {"rank": 3, "seq": 103, "state": "joined, not finished"},
        {"rank": 1, "seq": 103, "state": "finished, next not joined"},
        {"rank": 2, "seq": 103, "state": "finished, next not joined"},
    ]
    assert f["evidence"].startswith("[0] Timeout at collective: ALLREDUCE, #103; [3] joined")


def test_nccl_desync_report_of_ranks_that_never_joined() -> None:
    text = ("\t - [2] Timeout at collective: BROADCAST, #1\n"
            "\t - To our best knowledge, ranks [5, 7] are the lagging ranks that caused this timeout. "
            "They never joined any collectives\n")
    f = one(text)
    assert (f["category"], f["ranks"], f["op"], f["seq"], f["reported_by"]) == (
        "collective_mismatch", [5, 7], "BROADCAST", 1, 2)
    assert {p["state"] for p in f["per_rank"]} == {"never joined"}


def test_a_desync_report_that_names_no_rank_is_no_finding() -> None:
    assert error_findings("\t - [2] Timeout at collective: BROADCAST, #1\n") == []


def test_child_failure_caused_by_a_mismatch_comes_second_and_names_it() -> None:
    text = CHILD_FAILED.replace(
        "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
        "  traceback : Traceback (most recent call last):\n"
        "    File \"train.py\", line 3, in main\n"
        "  RuntimeError: Detected mismatch between collectives on ranks. Rank 9 is running collective: "
        "CollectiveFingerPrint(SequenceNumber=7, OpType=ALLGATHER), but Rank 3 is running collective: "
        "CollectiveFingerPrint(SequenceNumber=7, OpType=REDUCE).")
    findings = error_findings(text)
    assert [f["category"] for f in findings] == ["collective_mismatch", "child_failed", "child_failed"]
    cause = {f["rank"]: f.get("cause") for f in findings if f["category"] == "child_failed"}
    assert cause == {9: "collective_mismatch", 3: None}



# -- messages other frameworks print for the same faults ------------------------------------


@pytest.mark.parametrize("line, code", [
    ("tensorflow.python.framework.errors_impl.UnknownError: ncclCommInitRank failed: unhandled system error",
     "ncclSystemError"),
    ("horovod.common.exceptions.HorovodInternalError: ncclAllReduce failed: unhandled cuda error", "ncclUnhandledCudaError"),
    ("INTERNAL: ncclGroupEnd failed: ncclGroupEnd failed: remote process exited or there was a network error",
     "ncclRemoteError"),
])
def test_a_named_nccl_call_that_failed_is_a_nccl_error(line: str, code: str) -> None:
    f = one(line)
    assert (f["category"], f["nccl_code"]) == ("nccl_error", code)


def test_a_kernel_assert_is_a_device_side_assert() -> None:
    text = "\n".join(
        f"/src/aten/native/cuda/ScatterGather.cu:365: operator(): block: [4,0,0], thread: [{t},0,0] "
        "Assertion `idx_dim >= 0 && idx_dim < index_size && \"index out of bounds\"` failed." for t in range(3))
    f = one(text)
    assert (f["category"], f["cuda_message"]) == ("cuda_error", "device-side assert triggered")
    assert f["assertion"].startswith("idx_dim >= 0")


def test_a_host_assert_is_not_a_device_assert() -> None:
    assert categories("python: main.c:12: main: Assertion `x > 0' failed.\nAborted (core dumped)") == []


def test_rocm_memory_access_fault_is_an_illegal_memory_access() -> None:
    f = one("Memory access fault by GPU node-3 (Agent handle: 0x5612a0) on address 0x7f00dead0000. "
            "Reason: Write access to a read-only page.")
    assert f["category"] == "illegal_memory_access"


@pytest.mark.parametrize("line, signal, exit_code", [
    ("torch.multiprocessing.spawn.ProcessExitedException: process 3 terminated with signal SIGKILL", "SIGKILL", None),
    ("Exception: process 0 terminated with exit code 1", None, 1),
])
def test_a_spawned_process_that_died_is_a_failed_child(line: str, signal: str | None, exit_code: int | None) -> None:
    f = one(line)
    assert (f["category"], f["signal"], f["exit_code"]) == ("child_failed", signal, exit_code)


def test_horovod_stall_inspector_is_a_mismatch() -> None:
    line = ("[1,2]<stderr>:[2024-02-01 10:00:00.000000: W horovod/common/stall_inspector.cc:105] One or more tensors "
            "were submitted to be reduced, gathered or broadcasted by subset of ranks and are waiting for remainder "
            "of ranks for more than 60 seconds.")
    assert one(line)["category"] == "collective_mismatch"
