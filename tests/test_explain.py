"""`trainwatch explain`: the golden corpus of real logs, input handling, `main`.

The corpus is tests/fixtures/explain/*.txt: public logs (first line names
the source) with `NAME.expected.json` beside each. Every expected finding
must match some produced finding on the fields it lists (null = "must not be
guessed"); every entry of an optional "absent" list must match none.
"""

from __future__ import annotations

import gzip
import io
import json
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from trainwatch.diagnostics import explain
from trainwatch.diagnostics.desync_reports import desync_reports
from trainwatch.diagnostics.explain import explain_inputs, render_report
from trainwatch.diagnostics.findings import ERROR_CATEGORIES, FINDING_KEYS
from trainwatch.diagnostics.kernel_log import parse_kernel_log, summarize
from trainwatch.diagnostics.logparse import line_rank, parse_log
from trainwatch.diagnostics.stack_parsers import parse_stack_text, strip_line_prefixes
from trainwatch.views.explain import main

FIXTURES = Path(__file__).parent / "fixtures" / "explain"
CORPUS = sorted(FIXTURES.glob("*.txt"))


def _expected(path: Path) -> dict:
    """The fixture's expectations; every fixture has them (a missing file fails the test)."""
    return json.loads(path.with_name(path.stem + ".expected.json").read_text())


# The held-out and retired parts (split off by source repository) are scored only by
# benchmarks/explain_accuracy.py, so no test result ever tunes a rule to it.
DEV = [p for p in CORPUS if _expected(p)["meta"]["split"] == "dev"]


def _matches(expected: dict, produced: dict) -> bool:
    return all(produced.get(key) == value for key, value in expected.items())


def _score(path: Path) -> tuple[int, list[str]]:
    """(expected findings matched, problems) for one fixture."""
    expected = _expected(path)
    report = explain_inputs([(path.name, path.read_bytes())])
    produced = report["findings"]
    problems = []
    matched = 0
    for want in expected.get("findings", []):
        if any(_matches(want, got) for got in produced):
            matched += 1
        else:
            problems.append(f"missing {want}")
    for unwanted in expected.get("absent", []):
        hits = [got for got in produced if _matches(unwanted, got)]
        if hits:
            problems.append(f"unexpected {unwanted}: {hits[0].get('evidence')}")
    if report["errors"]:
        problems.append(f"errors {report['errors']}")
    return matched, problems


@pytest.mark.parametrize("path", DEV, ids=[p.stem for p in DEV])
def test_golden_fixture(path: Path) -> None:
    _, problems = _score(path)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", CORPUS, ids=[p.stem for p in CORPUS])
def test_every_finding_has_the_contract_keys(path: Path) -> None:
    for finding in explain_inputs([(path.name, path.read_bytes())])["findings"]:
        assert set(FINDING_KEYS) <= finding.keys(), finding
        assert finding["kind"] in ("stack", "xid", "error")
        assert json.dumps(finding)  # plain JSON types only


def test_corpus_size_and_accuracy(record_property) -> None:
    assert len(CORPUS) >= 150
    for path in CORPUS:
        assert path.read_text().startswith("# source: https://"), path.name
        meta = _expected(path)["meta"]
        assert meta["split"] in ("dev", "retired", "heldout") and "/" in meta["repo"], path.name
    # The split is by source repository: no repository has texts on both sides.
    sides: dict[str, set[str]] = {}
    for path in CORPUS:
        meta = _expected(path)["meta"]
        sides.setdefault(meta["repo"].lower(), set()).add(meta["split"])
    assert all(len(s) == 1 for s in sides.values()), {r: s for r, s in sides.items() if len(s) > 1}
    # The held-out part is never seen before it is scored; a part that was seen is kept, as "retired".
    splits = [_expected(p)["meta"]["split"] for p in CORPUS]
    assert splits.count("heldout") >= 30 and splits.count("retired") >= 30
    labelled = {f["category"] for p in CORPUS for f in _expected(p)["findings"]}
    assert labelled >= set(ERROR_CATEGORIES), set(ERROR_CATEGORIES) - labelled
    assert sum(bool(_expected(p)["meta"].get("healthy")) for p in CORPUS) >= 10

    total = matched = 0
    failures = []
    for path in DEV:
        want = len(_expected(path).get("findings", []))
        got, problems = _score(path)
        total += want
        matched += got
        failures += [f"{path.name}: {p}" for p in problems if not p.startswith("missing")]
    accuracy = matched / total if total else 1.0
    record_property("explain_corpus_files", len(CORPUS))
    record_property("explain_dev_expected_findings", total)
    record_property("explain_dev_accuracy", round(accuracy, 4))
    print(f"\nexplain golden corpus: {len(CORPUS)} texts ({len(DEV)} dev), "
          f"{matched}/{total} expected dev findings matched ({accuracy:.1%}), {len(failures)} false positives")
    assert accuracy == 1.0 and not failures, failures


def test_logs_of_two_nodes_name_the_rank_behind() -> None:
    # Two excerpts of one job: node d003's rank 3 enqueued up to 2082 while
    # node d004's rank 12 stopped at 2070. Neither file alone shows it.
    names = ["log-milabench-269-node-d004-timeouts.txt", "log-milabench-269-node-d003-enqueued-ahead.txt"]
    report = explain_inputs([(n, (FIXTURES / n).read_bytes()) for n in names])
    mismatches = [f for f in report["findings"] if f["category"] == "collective_mismatch"]
    assert len(mismatches) == 1
    assert mismatches[0]["ranks"] == [12]
    assert mismatches[0]["seq"] == 2082
    assert mismatches[0]["evidence"] == "1 rank enqueued up to SeqNum 2082; rank 12 only 2070"
    assert report["findings"][0] is mismatches[0]  # the culprit comes first


def test_per_rank_files_compare_and_attach_the_file_rank() -> None:
    line = "[E ProcessGroupNCCL.cpp:1664] Exception (either an error or timeout) detected by watchdog at work: {n}, " \
           "last enqueued NCCL work: {n}, last completed NCCL work: {m}.\n"
    timeout = "Watchdog caught collective operation timeout: WorkNCCL(SeqNum={n}, OpType=ALLREDUCE, NumelIn=1, " \
              "NumelOut=1, Timeout(ms)=600000) ran for 600012 milliseconds before timing out.\n"
    inputs = [
        (f"logs/rank{r}.log", (timeout + line).format(n=n, m=n - 1).encode())
        for r, n in ((0, 8242), (1, 8242), (2, 8242), (5, 8241))
    ]
    findings = explain_inputs(inputs)["findings"]
    mismatch = findings[0]
    assert mismatch["category"] == "collective_mismatch"
    assert (mismatch["ranks"], mismatch["rank"], mismatch["seq"], mismatch["op"]) == ([5], 5, 8242, "ALLREDUCE")
    assert mismatch["evidence"] == "3 ranks enqueued up to SeqNum 8242; rank 5 only 8241"
    timeouts = [f for f in findings if f["category"] == "collective_timeout"]
    assert sorted(r for f in timeouts for r in f["ranks"]) == [0, 1, 2, 5]
    assert {tuple(f["ranks"]) for f in timeouts} == {(0, 1, 2), (5,)}


def test_binary_empty_and_compressed_inputs_are_skipped_with_a_reason() -> None:
    report = explain_inputs([
        ("rank3.log", b"\x7fELF\x02\x01\x01\x00\x00\x00" * 50),
        ("empty.log", b""),
        ("blank.log", b"\n\n   \n"),
        ("rank1.log.gz", gzip.compress(b"Heartbeat monitor timed out!")),
        ("noise.bin", bytes(range(1, 32)) * 100),
    ])
    assert report["findings"] == []
    assert report["errors"] == [
        "rank3.log: binary file, skipped",
        "empty.log: empty file, skipped",
        "blank.log: empty file, skipped",
        "rank1.log.gz: compressed file, skipped (decompress it first)",
        "noise.bin: binary file, skipped",
    ]


def test_invalid_utf8_and_utf16_are_still_read() -> None:
    broken = b"\xc3\x28\xfe garbage\nRuntimeError: CUDA error: an illegal memory access was encountered\n"
    report = explain_inputs([("a.log", broken)])
    assert report["errors"] == []
    assert [f["category"] for f in report["findings"]] == ["illegal_memory_access"]
    utf16 = "RuntimeError: CUDA error: uncorrectable ECC error encountered\n".encode("utf-16")
    report = explain_inputs([("win.log", utf16)])
    assert [f["category"] for f in report["findings"]] == ["ecc"]


def test_file_rank_never_overrides_the_line_rank() -> None:
    text = b"[rank7]: ncclUnhandledCudaError: Call to CUDA function failed.\n" \
           b"RuntimeError: DataLoader worker (pid 1817) is killed by signal: Killed.\n"
    findings = explain_inputs([("rank2.log", text)])["findings"]
    by_category = {f["category"]: f for f in findings}
    assert by_category["nccl_error"]["rank"] == 7
    assert by_category["dataloader_worker_killed"]["rank"] == 2
    assert by_category["dataloader_worker_killed"]["ranks"] == [2]


def test_no_rank_in_name_or_text_stays_null() -> None:
    findings = explain_inputs([("train.log", b"RuntimeError: CUDA error: unspecified launch failure\n")])["findings"]
    assert findings[0]["rank"] is None and findings[0]["ranks"] is None


def test_a_failing_parser_costs_only_its_own_findings(monkeypatch) -> None:
    monkeypatch.setattr(explain, "xid_findings", json.loads)  # raises on log text: stands in for a parser bug
    report = explain_inputs([("x.log", b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n")])
    assert [f["category"] for f in report["findings"]] == ["oom"]
    assert len(report["errors"]) == 1
    assert report["errors"][0].startswith("x.log: kernel_log parser failed (JSONDecodeError")


def test_a_parser_that_raises_while_parsing_is_reported_per_input(monkeypatch) -> None:
    def broken_stack_parser(text: str) -> list[dict]:
        if "Traceback" in text:
            raise RuntimeError("half written")
        return []

    monkeypatch.setattr(explain, "stack_findings", broken_stack_parser)
    report = explain_inputs([
        ("a.log", b"RuntimeError: CUDA error: unknown error\n"),
        ("b.log", b"Traceback (most recent call last):\nRuntimeError: CUDA error: unknown error\n"),
    ])
    assert [f["category"] for f in report["findings"]] == ["cuda_error"]
    assert report["findings"][0]["evidence"] == "RuntimeError: CUDA error: unknown error"
    assert report["errors"] == ["b.log: stacks parser failed (RuntimeError: half written)"]


def test_source_lines_are_not_evidence() -> None:
    text = b"# source: https://github.com/pytorch/pytorch/issues/1 CUDA error: out of memory\n"
    assert explain_inputs([("a.txt", text)])["findings"] == []


# -- shapes that were misread (each a fixture of the corpus too) ----------------------


def _explain(name: str) -> list[dict]:
    report = explain_inputs([(name, (FIXTURES / name).read_bytes())])
    assert report["errors"] == []
    return report["findings"]


def test_synchronize_under_gradient_reduction_waits_for_the_gpu() -> None:
    """DeepSpeed ZeRO-2 calls torch.cuda.synchronize() inside allreduce_gradients
    (deepspeedai/DeepSpeed#620 names that call); the py-spy dump is laid out after
    huggingface/accelerate#3104's. The rank waits for the device, not in a collective."""
    (finding,) = _explain("stack-deepspeed-620-pyspy-zero2-synchronize-in-allreduce-gradients.txt")
    assert (finding["category"], finding["runbook"], finding["op"]) == ("cuda_sync", "cuda-sync", None)
    assert finding["evidence"] == "synchronize (torch/cuda/__init__.py:1219)"


def test_gdb_inside_libcuda_next_to_a_pyspy_copy_waits_for_the_gpu() -> None:
    """rwth-i6/returnn#1808: gdb shows the main thread in libcuda under cudaMemcpyAsync,
    py-spy shows it in copy_to_device (a tensor .to(device))."""
    (finding,) = _explain("stack-returnn-1808-gdb-libcuda-with-pyspy-copy-to-device.txt")
    assert finding["category"] == "cuda_sync"
    assert finding["evidence"].startswith("cudaMemcpyAsync (")


def test_faulthandler_dump_with_doubled_rank_prefixes_in_checkpoint_loading() -> None:
    """pytorch/torchtitan#3065: every line carries "[rank3]:" twice; the main thread is in
    the scatter of DCP's reduce_scatter while loading."""
    (finding,) = _explain("stack-torchtitan-3065-faulthandler-doubled-rank-prefix-dcp-load.txt")
    assert (finding["category"], finding["op"], finding["rank"], finding["ranks"]) == (
        "checkpoint_io", "scatter", 3, [3])


def test_child_failed_summary_carrying_a_collective_mismatch() -> None:
    """speechbrain/speechbrain#2401: the ChildFailedError's embedded traceback is a
    fingerprint mismatch; the mismatch is the finding, the child failure its consequence."""
    findings = _explain("log-speechbrain-2401-childfailed-collective-mismatch.txt")
    assert [f["category"] for f in findings if f["kind"] == "error"] == ["collective_mismatch", "child_failed"]
    mismatch, child = findings[0], findings[1]
    assert (mismatch["ranks"], mismatch["seq"], mismatch["op"]) == ([0, 1], 485, None)
    assert [(p["rank"], p["op"]) for p in mismatch["per_rank"]] == [(0, "BROADCAST"), (1, "ALLREDUCE")]
    assert (child["cause"], child["rank"], child["root_cause"]) == ("collective_mismatch", 0, True)


def test_stuck_watchdog_message_is_a_heartbeat_timeout() -> None:
    """hiyouga/LlamaFactory#8549: two ranks' heartbeat monitors report their watchdog stuck."""
    (finding,) = _explain("log-llamafactory-8549-watchdog-stuck-two-ranks.txt")
    assert (finding["category"], finding["runbook"], finding["ranks"]) == (
        "heartbeat_timeout", "watchdog-stuck", [1, 2])
    assert (finding["stuck_s"], finding["pg"], finding["pg_name"]) == (480, "0", "default_pg")


def test_native_autograd_thread_waiting_on_ddp_names_the_all_reduce() -> None:
    """pytorch/pytorch#20355: backward hangs in DDP's reducer; py-spy --native frames only."""
    (finding,) = _explain("stack-pytorch-20355-pyspy-native-ddp-reducer-wait.txt")
    assert (finding["category"], finding["op"]) == ("collective_wait", "all_reduce")


def test_follow_on_xids_take_the_severity_of_the_xid_they_name() -> None:
    """NVIDIA/open-gpu-kernel-modules#1150: Xid 45 lines "caused by previous Xid 149/145"."""
    findings = _explain("kernel-open-gpu-kernel-modules-1150-xid45-caused-by-nvlink.txt")
    assert {(f["xid"], f["severity"], f["action"]) for f in findings} == {(45, "high", "reset_gpu")}
    assert sorted(f["caused_by_xid"] for f in findings) == [145, 145, 145, 149]


def test_loss_scale_falling_step_after_step_is_a_collapse() -> None:
    """ymcui/Chinese-LLaMA-Alpaca#534: DeepSpeed halves the fp16 loss scale at every
    step from 64 down to 2 (and then exits at its minimum)."""
    (finding,) = _explain("log-chinese-llama-alpaca-534-loss-scale-to-minimum.txt")
    assert (finding["category"], finding["runbook"], finding["rank"]) == (
        "loss_scale_collapse", "loss-scale-collapse", 0)
    assert (finding["loss_scale"], finding["reductions"], finding["severity"]) == (2.0, 5, "medium")
    assert "Attempted loss scale: 64, reducing to 32" in finding["evidence"]


def test_loss_scale_calibrating_at_start_is_not_a_fault() -> None:
    """deepspeedai/DeepSpeed#931: 65536 -> 8192 in the first steps is the scaler finding its level."""
    assert _explain("log-deepspeed-931-overflow-at-start-harmless.txt") == []


def test_apex_scale_below_one_is_high() -> None:
    """NVIDIA/apex#834: "reducing loss scale to 0.5" after seventeen halvings."""
    (finding,) = _explain("log-apex-834-gradient-overflow-to-half.txt")
    assert (finding["category"], finding["severity"], finding["loss_scale"], finding["rank"]) == (
        "loss_scale_collapse", "high", 0.5, None)


def test_nan_grad_norm_in_wrapped_megatron_lines_is_loss_nan() -> None:
    """NVIDIA-NeMo/Megatron-Bridge#5306: a terminal wrapped the iteration line; "grad norm: nan"
    sits on its own piece."""
    (finding,) = _explain("log-megatron-bridge-5306-wrapped-grad-norm-nan.txt")
    assert (finding["category"], finding["severity"], finding["runbook"]) == ("loss_nan", "critical", "loss-nan")
    assert finding["evidence"] == "loss scale: 1.0 | grad norm: nan |"


def test_one_nan_grad_norm_that_recovers_is_low() -> None:
    """JiaquanYe/TableMASTER-mmocr#32: one skipped mixed-precision step, then finite grad norms."""
    (finding,) = _explain("log-tablemaster-mmocr-32-one-nan-grad-norm-amp.txt")
    assert (finding["category"], finding["severity"], finding["recovered"]) == ("loss_nan", "low", True)


@pytest.mark.parametrize("lines", [
    # a loss term, a bare "Loss nan" pair, a table of metrics
    ["iter: 10 loss_seg: 0.731 loss_scale: 65536.0", "iter: 20 loss_seg: nan loss_scale: 2048.0",
     "iter: 30 loss_seg: nan loss_scale: 4.0"],
    ["Step 100   Loss 3.2104   lr 0.0004", "Step 110   Loss nan   lr 0.0004", "Step 120   Loss nan   lr 0.0004"],
    ["| loss      | 0.412 |", "| step      | 9e+03 |", "| loss      | nan   |", "| loss      | nan   |"],
])
def test_a_loss_that_turns_nan_reads_in_any_log_shape(lines: list[str]) -> None:
    (finding,) = explain_inputs([("train.log", "\n".join(lines).encode())])["findings"]
    assert (finding["category"], finding["severity"]) == ("loss_nan", "critical")


def test_the_loss_scale_is_not_a_loss() -> None:
    assert explain_inputs([("train.log", b"loss_scale: nan\nloss scale 0.0\nloss_scaler 1\n")])["findings"] == []


def test_framework_nan_abort_names_its_rank() -> None:
    text = b"[rank3]: AssertionError: Rank 3: found NaN in local grad norm in backward pass before data-parallel " \
           b"communication collective. Device: 3, node: gpu-17\n"
    (finding,) = explain_inputs([("train.log", text)])["findings"]
    assert (finding["category"], finding["rank"], finding["source"]) == ("loss_nan", 3, "framework_abort")


def test_nccl_warning_of_a_broken_connection_means_a_remote_rank_died() -> None:
    """NVIDIA/nccl#795: no "NCCL error" line, only WARN lines; the peer had segfaulted."""
    findings = _explain("log-nccl-795-warn-broken-pipe-remote-crash.txt")
    assert {f["category"] for f in findings} == {"nccl_error"}
    lost = next(f for f in findings if f.get("peer_lost"))
    assert (lost["nccl_code"], lost["peer"]) == ("ncclRemoteError", "10.200.84.247<58355>")
    assert lost["evidence"].endswith("NCCL WARN Net : Call to recv from 10.200.84.247<58355> failed : Broken pipe")
    retcode = next(f for f in findings if f.get("peer_rank") is not None)
    assert (retcode["nccl_code"], retcode["peer_rank"], retcode["rank"]) == ("ncclRemoteError", 9, None)


def test_nccl_info_about_closed_service_connections_alone_is_no_fault() -> None:
    text = b"node1:27255:27930 [0] NCCL INFO [Service thread] Connection closed by localRank 2\n" \
           b"node1:27223:27927 [1] NCCL INFO comm 0x55d0 rank 1 nranks 8 cudaDev 1 busId 1b000 - Destroy COMPLETE\n"
    assert explain_inputs([("a.log", text)])["findings"] == []


def test_nccl_mismatch_warnings() -> None:
    (named,) = _explain("log-nccl-296-warn-mismatched-collective-rank39.txt")
    assert (named["category"], named["rank"], named["ranks"]) == ("collective_mismatch", 39, [39])
    (sizes,) = _explain("log-nccl-969-warn-ib-collective-size-mismatch.txt")
    assert (sizes["category"], sizes["local_size"], sizes["remote_size"]) == ("collective_mismatch", 496640, 65536)


_XID_THEN_HUNG = """\
[Tue Mar  4 02:11:09 2025] NVRM: Xid (PCI:0000:1b:00): 43, pid=88123, name=python3, Ch 00000008
[Tue Mar  4 02:15:12 2025] INFO: task python3:88123 blocked for more than 245 seconds.
[Tue Mar  4 02:15:12 2025]       Tainted: P           OE     6.5.0-35-generic #35-Ubuntu
[Tue Mar  4 02:15:12 2025] task:python3         state:D stack:0     pid:88123 ppid:1 flags:0x00004006
"""


def test_an_xid_followed_by_blocked_kernel_tasks_is_high() -> None:
    (alone,) = explain_inputs([("dmesg.txt", _XID_THEN_HUNG.splitlines()[0].encode())])["findings"]
    assert alone["severity"] == "low"
    (finding,) = explain_inputs([("dmesg.txt", _XID_THEN_HUNG.encode())])["findings"]
    assert (finding["xid"], finding["severity"], finding["action"]) == (43, "high", "reboot_node")
    assert (finding["blocked_tasks"], finding["blocked_s"]) == (["python3"], 245)
    assert finding["evidence"].endswith("INFO: task python3:88123 blocked for more than 245 seconds.")


def test_blocked_tasks_before_the_xid_change_nothing() -> None:
    lines = _XID_THEN_HUNG.splitlines()
    (finding,) = explain_inputs([("dmesg.txt", "\n".join([lines[1], lines[0]]).encode())])["findings"]
    assert finding["severity"] == "low" and "blocked_tasks" not in finding


def _timeout_line(rank: int, seq: int, op: str) -> str:
    return (f"[rank{rank}]:[E1206 18:44:12.715298746 ProcessGroupNCCL.cpp:607] [Rank {rank}] Watchdog caught "
            f"collective operation timeout: WorkNCCL(SeqNum={seq}, OpType={op}, NumelIn=1, NumelOut=1, "
            f"Timeout(ms)=600000) ran for 600012 milliseconds before timing out.\n")


def test_ranks_at_one_seqnum_in_different_ops_are_a_mismatch() -> None:
    inputs = [(f"rank{r}.log", _timeout_line(r, 412, op).encode())
              for r, op in ((0, "ALLREDUCE"), (1, "ALLREDUCE"), (2, "ALLREDUCE"), (3, "BROADCAST"))]
    findings = explain_inputs(inputs)["findings"]
    mismatch = findings[0]
    assert (mismatch["category"], mismatch["ranks"], mismatch["seq"], mismatch["op"]) == (
        "collective_mismatch", [3], 412, "ALLREDUCE")
    assert [(p["rank"], p["op"]) for p in mismatch["per_rank"]] == [
        (0, "ALLREDUCE"), (1, "ALLREDUCE"), (2, "ALLREDUCE"), (3, "BROADCAST")]
    assert mismatch["evidence"] == "SeqNum 412 timed out in different ops: ranks 0, 1, 2 in ALLREDUCE; rank 3 in BROADCAST"
    assert len(mismatch["evidence_lines"]) == 4


def test_ranks_at_different_seqnums_in_different_ops_are_a_mismatch() -> None:
    text = _timeout_line(0, 97, "_ALLGATHER_BASE") + _timeout_line(1, 95, "BROADCAST") + _timeout_line(2, 95, "BROADCAST")
    findings = explain_inputs([("job.log", text.encode())])["findings"]
    mismatch = findings[0]
    assert (mismatch["category"], mismatch["ranks"], mismatch["seq"]) == ("collective_mismatch", [1, 2], 97)


def test_timeouts_of_named_different_groups_are_not_compared() -> None:
    a = _timeout_line(0, 216, "ALLTOALL_BASE") + "[rank0]:[E1206 ProcessGroupNCCL.cpp:1795] [PG ID 11 PG GUID 119 Rank 0]" \
        " Exception (either an error or timeout) detected by watchdog at work: 216, last enqueued NCCL work: 220, " \
        "last completed NCCL work: 215.\n"
    b = _timeout_line(1, 57, "ALLREDUCE") + "[rank1]:[E1206 ProcessGroupNCCL.cpp:1795] [PG ID 11 PG GUID 112 Rank 0]" \
        " Exception (either an error or timeout) detected by watchdog at work: 57, last enqueued NCCL work: 57, " \
        "last completed NCCL work: 56.\n"
    findings = explain_inputs([("a.log", a.encode()), ("b.log", b.encode())])["findings"]
    assert [f["category"] for f in findings] == ["collective_timeout", "collective_timeout"]


def test_lldb_backtrace_in_a_device_synchronize() -> None:
    """pytorch/pytorch#141296: torch.mps.synchronize() never returns (lldb `bt`)."""
    (finding,) = _explain("stack-pytorch-141296-lldb-mps-synchronize.txt")
    assert (finding["category"], finding["runbook"]) == ("cuda_sync", "cuda-sync")
    assert finding["evidence"].startswith("-[_MTLCommandBuffer waitUntilCompleted]")


def test_headerless_indented_pyspy_frames_are_a_stack() -> None:
    """Lightning-AI/pytorch-lightning#18857: the paste starts at the frames, without py-spy's header."""
    (finding,) = _explain("stack-lightning-18857-headerless-pyspy-log-to-tensor.txt")
    assert finding["category"] == "cuda_sync"
    assert finding["evidence"] == "__to_tensor (pytorch_lightning/core/module.py:619)"


def test_ray_prefixed_faulthandler_dump_is_read() -> None:
    dump = "\n".join([
        "(RayWorkerWrapper pid=2210, ip=10.0.0.7) Thread 0x00007f2e93fff640 (most recent call first):",
        '(RayWorkerWrapper pid=2210, ip=10.0.0.7)   File "/usr/lib/python3.10/threading.py", line 324 in wait',
        "(RayWorkerWrapper pid=2210, ip=10.0.0.7) ",
        "(RayWorkerWrapper pid=2210, ip=10.0.0.7) Current thread 0x00007f2ea0870640 (most recent call first):",
        '(RayWorkerWrapper pid=2210, ip=10.0.0.7)   File "/usr/local/lib/python3.10/dist-packages/torch/distributed/'
        'distributed_c10d.py", line 2501 in all_reduce',
        '(RayWorkerWrapper pid=2210, ip=10.0.0.7)   File "/app/train.py", line 88 in step',
    ])
    (finding,) = explain_inputs([("worker.log", dump.encode())])["findings"]
    assert (finding["category"], finding["op"]) == ("collective_wait", "all_reduce")


def test_nccl_cuda_failure_warnings_name_the_cuda_error() -> None:
    def categories(message: str) -> list[tuple[str, object]]:
        line = f"gpu-3:4021:4097 [1] enqueue.cc:1556 NCCL WARN Cuda failure {message}\n"
        return [(f["category"], f.get("cuda_message")) for f in explain_inputs([("a.log", line.encode())])["findings"]]

    assert categories("700 'an illegal memory access was encountered'") == [("illegal_memory_access", None)]
    assert categories("2 'out of memory'") == [("oom", None)]
    assert categories("'invalid device function'") == [("cuda_error", "invalid device function")]


def test_a_libc_wait_above_the_cuda_driver_is_a_device_wait() -> None:
    dump = "\n".join([
        "Thread 1 (Thread 0x7f3a1c8ff740 (LWP 4412) \"python\"):",
        "#0  0x00007f3a1d0e2c9b in sched_yield () from /lib64/libc.so.6",
        "#1  0x00007f39d26a4b1f in ?? () from /lib64/libcuda.so.1",
        "#2  0x00007f39d28b3c6e in ?? () from /lib64/libcuda.so.1",
        "#3  0x00007f3a0c2e11a5 in ?? () from /opt/venv/lib/python3.11/site-packages/torch/lib/libtorch_cuda.so",
    ])
    (finding,) = explain_inputs([("gdb.txt", dump.encode())])["findings"]
    assert (finding["category"], finding["runbook"]) == ("cuda_sync", "cuda-sync")


def test_boxed_terminal_lines_lose_their_border() -> None:
    (finding,) = _explain("log-pytorch-21276-thcudacheck-boxed-launch-failure.txt")
    assert (finding["category"], finding["cuda_message"]) == ("cuda_error", "unspecified launch failure")


# -- no input makes a reader raise ------------------------------------------------------------

_CORPUS_LINES = sorted({line for path in CORPUS for line in path.read_text().splitlines() if line.strip()})
_LINE = st.one_of(
    st.sampled_from(_CORPUS_LINES),
    # a real line cut anywhere (wrapped, truncated pastes) ...
    st.sampled_from(_CORPUS_LINES).flatmap(lambda line: st.integers(0, len(line)).map(lambda i: line[:i])),
    # ... or with a prefix a launcher might add
    st.tuples(st.sampled_from(["[rank3]:", "[rank0]:[rank0]:", "12:00:00.1 [rank1]: ", "\t - ", "  "]),
              st.sampled_from(_CORPUS_LINES)).map("".join),
    st.text(max_size=60),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(_LINE, max_size=25), noise=st.binary(max_size=64))
def test_readers_never_raise_on_mixed_real_fragments(lines: list[str], noise: bytes) -> None:
    text = "\n".join(lines)
    for line in lines:
        rank, rest = strip_line_prefixes(line)
        assert rank is None or isinstance(rank, int)
        assert line.endswith(rest)
    parse_stack_text(text)
    parse_log(text, source="rank2.log")
    desync_reports(text.splitlines(), line_rank)
    summarize(parse_kernel_log(text))
    report = explain_inputs([("rank2.log", text.encode() + noise), ("b.txt", text.encode("utf-16"))])
    assert not any("parser failed" in e for e in report["errors"]), report["errors"]
    for finding in report["findings"]:
        assert set(FINDING_KEYS) <= finding.keys()
        assert json.dumps(finding)
    assert isinstance(render_report(report), str)


_BYTES = st.one_of(
    st.binary(max_size=2048),
    # bytes of real lines, cut and spliced anywhere
    st.lists(st.sampled_from(_CORPUS_LINES).map(str.encode), max_size=8).map(b"\n".join).flatmap(
        lambda b: st.integers(0, len(b)).map(lambda i: b[i:] + b[:i])),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=_BYTES, name=st.sampled_from(["rank3.log", "dmesg.txt", "pyspy.txt", "-"]))
def test_any_bytes_give_findings_or_a_note_never_a_traceback(data: bytes, name: str) -> None:
    report = explain_inputs([(name, data)])
    assert not any("parser failed" in e for e in report["errors"]), report["errors"]
    for error in report["errors"]:
        assert error.startswith(f"{name}: ") and "\n" not in error
    for finding in report["findings"]:
        assert set(FINDING_KEYS) <= finding.keys() and json.dumps(finding)
        assert finding["severity"] in ("info", "low", "medium", "high", "critical")
        assert finding["evidence"], finding


_NUMBER = st.one_of(st.sampled_from(["nan", "NaN", "inf", "-inf", "0", "1e309", "9" * 400]),
                    st.floats(allow_nan=True).map(repr), st.integers(-10**6, 10**6).map(str))
_HEALTH_LINE = st.tuples(st.sampled_from([
    " iteration {n}/ 1000 | lm loss: {v} | loss scale: {v} | grad norm: {v} |",
    "{{'loss': {v}, 'grad_norm': {v}, 'learning_rate': 1e-05, 'epoch': 0.01}}",
    "[deepspeed] OVERFLOW! Rank {n} Skipping step. Attempted loss scale: {v}, reducing to {v}",
    "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to {v}",
    "AssertionError: Rank {n}: found NaN in local grad norm in backward pass",
    "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.",
    "[{n}] NVRM: Xid (PCI:0000:{n}:00): {n}, pid={n}, name=python, Ch 00000008",
    "[{n}] INFO: task python:{n} blocked for more than {n} seconds.",
]), _NUMBER, st.integers(0, 10**9)).map(lambda t: t[0].format(v=t[1], n=t[2]))


@settings(max_examples=200, deadline=None)
@given(lines=st.lists(_HEALTH_LINE, max_size=30))
def test_loss_health_and_kernel_readers_take_any_numbers(lines: list[str]) -> None:
    findings = explain_inputs([("train.log", "\n".join(lines).encode())])["findings"]
    for finding in findings:
        assert json.dumps(finding) and finding["evidence"]


# Generous per-example bound: a reader that rescans a long line for every character takes
# minutes here, not a fraction of a second; the bound only catches such blow-ups.
@settings(max_examples=30, deadline=timedelta(seconds=30), suppress_health_check=[HealthCheck.too_slow])
@given(head=st.sampled_from(["", "  a", "frame #0: a`", "1 lib 0x1 ", "cuda runtime error (1) : x", "NCCL WARN ",
                             "grad norm: ", "Thread 1 (idle)\n  f", "WorkNCCL(", "Xid (PCI:0000:01:00): 13, ",
                             "[rank1]:", "OVERFLOW! Rank 0 Skipping step. Attempted loss scale: ", "    x (",
                             "Detected mismatch between collectives on ranks. Rank 1 is running collective: "]),
       fill=st.sampled_from([" ", "a", "(", ":", "`", "0", " at ", "[rank1]:", "\t"]),
       size=st.integers(5_000, 40_000), tail=st.sampled_from(["", "x", "at", ")", " + 1", "NaN"]))
# Blow-ups found once, kept: an optional separator between two runs of optional spaces.
@example(head="NCCL WARN ", fill=" ", size=39_996, tail="at")
@example(head="grad_norm", fill=" ", size=40_000, tail="at")
@example(head="loss scale", fill="\t", size=40_000, tail="at")
@example(head="Thread 1 (idle)\n  f", fill="\t", size=40_000, tail="")
def test_long_lines_are_read_in_bounded_time(head: str, fill: str, size: int, tail: str) -> None:
    text = head + fill * (size // len(fill)) + tail
    report = explain_inputs([("rank0.log", text.encode())])
    assert not any("parser failed" in e for e in report["errors"])


# -- main -----------------------------------------------------------------------


def _run(paths: list[str], as_json: bool = False, stdin: bytes = b"", limit: int | None = None,
         capsys=None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    argv = [*paths, *(["--json"] if as_json else [])]
    try:
        kw = {} if limit is None else {"limit": limit}
        code = main(argv, stdin=io.BytesIO(stdin), out=out, err=err, **kw)
    except SystemExit as e:  # argparse's one-line usage error
        code = e.code
    return code, out.getvalue(), err.getvalue()


def test_main_missing_file_exits_2_with_one_line(tmp_path: Path, capsys) -> None:
    good = tmp_path / "ok.log"
    good.write_text("RuntimeError: CUDA error: unknown error\n")
    code, out, _ = _run([str(good), str(tmp_path / "nope.log")])
    err = capsys.readouterr().err
    assert code == 2
    assert out == ""
    assert err == f"error: cannot read {tmp_path / 'nope.log'} (No such file or directory); " \
                  "pass a readable log, py-spy dump or kernel log\n"


def test_main_directory_exits_2(tmp_path: Path, capsys) -> None:
    code, _, _ = _run([str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"error: cannot read {tmp_path} (Is a directory)")
    assert err.count("\n") == 1


def test_main_no_paths_exits_2(capsys) -> None:
    code, _, _ = _run([])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: the following arguments are required: FILE")
    assert err.count("\n") == 1


def test_main_reads_endless_input_in_bounded_memory() -> None:
    """/dev/zero-like input: only the last `limit` bytes are kept, the rest is said."""
    class Endless:
        def __init__(self, total):
            self.left = total

        def read(self, n):
            n = min(n, self.left)
            self.left -= n
            return b"\0" * n

    code, out, _ = _run(["-"], as_json=True, limit=1 << 20)
    assert code == 0
    from trainwatch.views.explain import read_bounded

    data, skipped = read_bounded(Endless(50 << 20), limit=1 << 20)
    assert len(data) == 1 << 20 and skipped + len(data) - 1 == 50 << 20  # head + newline + tail


def test_main_reads_stdin_and_prints_json() -> None:
    log = b"[rank3]:[E ProcessGroupNCCL.cpp:1316] [PG 0 Rank 3] Heartbeat monitor timed out! Process will be " \
          b"terminated after dumping debug info. workMetaList_.size()=2\n"
    code, out, err = _run(["-"], as_json=True, stdin=log)
    assert (code, err) == (0, "")
    report = json.loads(out)
    assert report["errors"] == []
    (finding,) = report["findings"]
    assert finding["category"] == "heartbeat_timeout"
    assert finding["rank"] == 3 and finding["pending_work"] == 2


def test_main_text_report(tmp_path: Path) -> None:
    log = tmp_path / "rank5.log"
    log.write_text("[rank5]:[E1206 18:44:12.715298746 ProcessGroupNCCL.cpp:607] [Rank 5] Watchdog caught collective "
                   "operation timeout: WorkNCCL(SeqNum=8241, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
                   "Timeout(ms)=600000) ran for 600012 milliseconds before timing out.\n")
    code, out, _ = _run([str(log)])
    assert code == 0
    assert out.startswith("1 finding\n")
    assert "collective_timeout (error, severity high)" in out
    assert "  ranks:    5\n" in out
    assert "  op/seq:   ALLREDUCE / 8241\n" in out
    assert "  timeout:  600000 ms\n" in out
    assert "  runbook:  trainwatch runbook collective-timeout\n" in out
    assert "  evidence: [rank5]:[E1206" in out


def test_main_zero_findings_still_exits_0(tmp_path: Path) -> None:
    log = tmp_path / "fine.log"
    log.write_text("step 100 loss 2.31\nstep 101 loss 2.30\n")
    binary = tmp_path / "core"
    binary.write_bytes(b"\x00" * 64)
    code, out, err = _run([str(log), str(binary)])
    assert (code, err) == (0, "")
    assert out.startswith("no known failure signature found\n")
    assert f"skipped: {binary}: binary file, skipped" in out


def test_render_report_cuts_long_evidence() -> None:
    finding = dict.fromkeys(FINDING_KEYS)
    finding.update(kind="error", category="oom", severity="medium", runbook="oom", evidence="x" * 1000 + "\nmore")
    text = render_report({"findings": [finding], "errors": []})
    evidence = next(line for line in text.splitlines() if "evidence:" in line)
    assert len(evidence) < 300 and evidence.endswith("...")


# -- DataLoader worker processes, boxed tracebacks, lines stating their own fatality ----------

_WORKER_NATIVE = """\
Process 40211: /usr/bin/python3 -u finetune.py --config cfg.yaml
Python v3.11.9 (/usr/bin/python3.11)

Thread 40211 (idle): "MainThread"
    __futex_abstimed_wait_common (libc.so.6)
    __new_sem_wait_slow64.constprop.0 (libc.so.6)
    PyThread_acquire_lock_timed (python3.11)
    _multiprocessing_SemLock_acquire_impl (semaphore.c:355)
    get (multiprocessing/queues.py:102)
    _worker_loop (torch/utils/data/_utils/worker.py:309)
    run (multiprocessing/process.py:108)
    _bootstrap (multiprocessing/process.py:314)
    _launch (multiprocessing/popen_fork.py:71)
    __init__ (multiprocessing/popen_fork.py:19)
    _Popen (multiprocessing/context.py:281)
    start (multiprocessing/process.py:121)
    __init__ (torch/utils/data/dataloader.py:1104)
    _get_iterator (torch/utils/data/dataloader.py:437)
    __iter__ (torch/utils/data/dataloader.py:493)
    run_eval (finetune.py:311)
"""


def test_a_dataloader_worker_process_dump_is_the_data_pipeline() -> None:
    (finding,) = explain_inputs([("worker.txt", _WORKER_NATIVE.encode())])["findings"]
    assert (finding["category"], finding["severity"], finding["runbook"]) == ("dataloader", "medium", "dataloader-stall")
    assert "_worker_loop" in finding["evidence"]


def test_a_boxed_traceback_is_read_through_its_frame() -> None:
    text = ("╭──────────── Traceback (most recent call last) ────────────╮\n"
            "│ /srv/job/train.py:57 in main                               │\n"
            "│ ❱ 57 │   │   dist.barrier()                                │\n"
            "│ /srv/venv/lib/python3.12/site-packages/torch/distributed/d │\n"
            "│ istributed_c10d.py:4635 in barrier                         │\n"
            "╰────────────────────────────────────────────────────────────╯\n")
    (finding,) = explain_inputs([("tb.txt", text.encode())])["findings"]
    assert (finding["category"], finding["op"]) == ("barrier", "barrier")


def test_an_xid_line_calling_itself_nonfatal_is_low() -> None:
    text = "[Tue Mar  3 04:05:06 2026] NVRM: Xid (PCI:0000:41:00): 144, SAW_MVB Nonfatal XC0 i0 Link 5 (0x0 0x1)\n"
    (finding,) = explain_inputs([("dmesg.txt", text.encode())])["findings"]
    assert (finding["xid"], finding["severity"]) == (144, "low")


def _categories(text: str) -> list[tuple]:
    return [(f["category"], f["severity"]) for f in explain_inputs([("t.log", text.encode())])["findings"]]


def test_a_loss_scale_logged_as_a_value_that_falls_and_falls_is_a_collapse() -> None:
    falling = "\n".join(f"step {i} | loss 2.1 | loss_scale : {2.0 ** (4 - i)}" for i in range(8))
    assert _categories(falling) == [("loss_scale_collapse", "high")]  # ends below 1
    assert _categories("\n".join(f"step {i} | loss_scale 1.0" for i in range(8))) == []  # bf16: constant
    rising = "\n".join(f"'loss_scale': {v}" for v in (65536.0, 32768.0, 65536.0, 131072.0))
    assert _categories(rising) == []
    setting = "\n".join(f"| WARNING: overflow detected, setting loss scale to: {2.0 ** -i}" for i in range(5))
    assert _categories(setting) == [("loss_scale_collapse", "high")]
    assert _categories("| WARNING: overflow detected, setting loss scale to: 8.0") == []  # one overflow


def test_a_loss_that_diverged_ends_its_sentence_with_nan() -> None:
    assert _categories("ERROR:tensorflow:Model diverged with loss = NaN.") == [("loss_nan", "critical")]
    assert _categories("epoch 3 loss = 0.5. next") == []


def test_nccl_taking_the_process_down_is_named_alone_and_folded_beside_the_timeout() -> None:
    down = ("[E ProcessGroupNCCL.cpp:455] Some NCCL operations have failed or timed out. Due to the asynchronous "
            "nature of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data.")
    assert [c for c, _ in _categories(down)] == ["nccl_error"]
    timeout = ("[E ProcessGroupNCCL.cpp:828] [Rank 1] Watchdog caught collective operation timeout: WorkNCCL("
               "SeqNum=7, OpType=BROADCAST, Timeout(ms)=1800000) ran for 1800764 milliseconds before timing out.")
    assert [c for c, _ in _categories(timeout + "\n" + down)] == ["collective_timeout"]


def test_the_nccl_watchdogs_frames_name_a_timeout_whose_message_was_cut() -> None:
    frames = ("frame #1: c10d::ProcessGroupNCCL::WorkNCCL::checkTimeout(std::optional<std::chrono::duration<long, "
              "std::ratio<1l, 1000l> > >) + 0x1d2 (0x1554e9e0f8f2 in /x/torch/lib/libtorch_cuda.so)\n"
              "frame #2: c10d::ProcessGroupNCCL::watchdogHandler() + 0x233 (0x1554e9e16333 in /x/libtorch_cuda.so)")
    assert [c for c, _ in _categories(frames)] == ["collective_timeout"]


def test_a_child_failed_summary_whose_line_breaks_were_lost() -> None:
    text = "rank5 (local rank: 1)exitcode: -9 (pid: 36071)error file: <N/A>"
    (f,) = explain_inputs([("t.log", text.encode())])["findings"]
    assert (f["category"], f["rank"], f["exit_code"], f["signal"]) == ("child_failed", 5, -9, "SIGKILL")


def test_driver_and_cublas_error_names_as_other_frameworks_print_them() -> None:
    tf = ("E tensorflow/stream_executor/cuda/cuda_driver.cc:1035] could not synchronize on CUDA context: "
          "CUDA_ERROR_LAUNCH_FAILED: unspecified launch failure ::")
    assert [c for c, _ in _categories(tf)] == ["cuda_error"]
    assert [c for c, _ in _categories("failed to alloc: CUDA_ERROR_OUT_OF_MEMORY: out of memory")] == ["oom"]
    blas = "E cuda_blas.cc:652] failed to run cuBLAS routine cublasSgemm_v2: CUBLAS_STATUS_EXECUTION_FAILED"
    assert [c for c, _ in _categories(blas)] == ["cuda_error"]
    assert _categories("cublas handle created: CUBLAS_STATUS_SUCCESS") == []


def test_nccl_failures_in_other_words() -> None:
    xgb = "device_helpers.cuh:135: NCCL failure :remote process exited or there was a network error"
    assert [c for c, _ in _categories(xgb)] == ["nccl_error"]
    warn = "host:1:2 [0] include/socket.h:403 NCCL WARN Connect to 10.0.0.2<57335> failed : Network is unreachable"
    assert [c for c, _ in _categories(warn)] == ["nccl_error"]


def test_a_launcher_reporting_a_killed_worker() -> None:
    text = "[ERROR] [launch.py:320:sigkill_handler] ['/bin/python', '-u', 'train.py'] exits with return code = -9"
    (f,) = explain_inputs([("t.log", text.encode())])["findings"]
    assert (f["category"], f["exit_code"], f["signal"]) == ("child_failed", -9, "SIGKILL")


def test_a_loss_logged_as_bare_step_value_pairs_turns_nan() -> None:
    text = "76960 2.735384\n76970 2.6265104\n76980 nan\n76990 nan\nSaving the model"
    assert _categories(text) == [("loss_nan", "critical")]


def test_pytorchs_own_clip_grad_norm_on_a_non_finite_norm() -> None:
    warn = ("/x/trainer.py:639: FutureWarning: Non-finite norm encountered in torch.nn.utils.clip_grad_norm_; "
            "continuing anyway.")
    assert _categories(warn) == [("loss_nan", "critical")]
    raised = ("RuntimeError: The total norm of order 2.0 for gradients from `parameters` is non-finite, so it "
              "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
              "set `error_if_nonfinite=False`")
    assert _categories(raised) == [("loss_nan", "critical")]
    assert _categories("clip_grad_norm_ returned 1.25") == []


def test_an_nccl_error_with_its_number_and_a_communicator_that_never_formed() -> None:
    numbered = "what(): NCCL Error 1: unhandled cuda error"
    (f,) = explain_inputs([("t.log", numbered.encode())])["findings"]
    assert (f["category"], f["nccl_code"]) == ("nccl_error", "ncclUnhandledCudaError")
    unique_id = ("RuntimeError: [6] is setting up NCCL communicator and retrieving ncclUniqueId from [0] via c10d "
                 "key-value store by key '0', but store->get('0') got error: Connection reset by peer")
    assert [c for c, _ in _categories(unique_id)] == ["nccl_error"]


def test_cudnn_status_names_and_xla_out_of_memory() -> None:
    assert [c for c, _ in _categories("RuntimeError: cuDNN error: CUDNN_STATUS_EXECUTION_FAILED")] == ["cuda_error"]
    assert _categories("cudnn handle: CUDNN_STATUS_SUCCESS") == []
    jax = ("jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
           "4770354232 bytes.")
    assert [c for c, _ in _categories(jax)] == ["oom"]
    tf = "ResourceExhaustedError: OOM when allocating tensor with shape[64,512,512] and type float on GPU:0"
    assert [c for c, _ in _categories(tf)] == ["oom"]


@pytest.mark.parametrize("line", [
    'ERROR:torch.distributed.elastic.multiprocessing.errors.error_handler: "message": "RendezvousTimeoutError: "',
    "TimeoutError: The client socket has timed out after 1800s while trying to connect to (127.0.0.1, 48391).",
    "torch.distributed.DistStoreError: Timed out after 901 seconds waiting for clients. 1/2 clients joined.",
])
def test_a_rendezvous_or_store_that_never_formed(line: str) -> None:
    assert [c for c, _ in _categories(line)] == ["heartbeat_timeout"]


def test_cuda_gdb_kernel_table_shows_the_gpu_inside_a_collective() -> None:
    table = ("(cuda-gdb) info cuda kernels\n"
             "  Kernel Parent Dev Grid Status   SMs Mask GridDim BlockDim Invocation\n"
             "*      0      -   0 52162520 Active 0x00000001 (1,1,1) (64,1,1) ncclReduceRingLLKernel_sum_f64()\n")
    assert _categories(table) == [("collective_wait", "high")]
    other = table.replace("ncclReduceRingLLKernel_sum_f64", "elementwise_kernel")
    assert [c for c, _ in _categories(other)] != ["collective_wait"]


def test_a_quoted_ctrl_c_traceback_stuck_in_a_projects_own_data_loader() -> None:
    frames = ("> ^CTraceback (most recent call last):\n"
              '>   File "/work/train.py", line 443, in run_epoch\n'
              ">     for i, batch in enumerate(loader.iter_epoch(split, seed)):\n"
              '>   File "/usr/lib/python3.10/dist-packages/libdf/torch_dataloader.py", line 165, in setup_queue\n'
              ">     self.cleanup_pin_memory_thread()\n")
    assert [c for c, _ in _categories(frames)] == ["dataloader"]
    assert [c for c, _ in _categories(frames + "KeyboardInterrupt\n")] == ["dataloader"]
    # The same frames ending in an error are that error's traceback, not a stall.
    assert "dataloader" not in [c for c, _ in _categories(frames + "ValueError: bad sample\n")]


def test_a_store_client_that_never_reached_the_store() -> None:
    line = ("RuntimeError: The client socket has failed to connect to any network address of (192.168.1.219, "
            "23456). The client socket has failed to connect to 192.168.1.219:23456 (errno: 110 - Connection "
            "timed out).")
    assert [c for c, _ in _categories(line)] == ["heartbeat_timeout"]


def test_a_loss_named_in_brackets_turns_nan() -> None:
    lines = "\n".join(f"INFO | [R0] | E{e} iter[ 14/ 15] | [Loss] {v} | [step] {e * 15}"
                      for e, v in ((5, "51566519.44"), (6, "nan"), (7, "nan")))
    assert _categories(lines) == [("loss_nan", "critical")]
    assert _categories("[Loss] 0.512 | [step] 10\n[Loss] 0.498 | [step] 20") == []


def test_round_8_classes_misaligned_closed_rendezvous_xla_allocation_and_overflow_monitors() -> None:
    assert [c for c, _ in _categories("RuntimeError: CUDA error: misaligned address")] == ["illegal_memory_access"]
    closed = '    "message": "RendezvousClosedError: ",'
    assert [c for c, _ in _categories(closed)] == ["heartbeat_timeout"]
    xla = ("Original error: RESOURCE_EXHAUSTED: Failed to allocate request for 176.00MiB (184549376B) on device "
           "ordinal 0")
    assert [c for c, _ in _categories(xla)] == ["oom"]
    monitor = "Exception: Skipped 50 iterations in a row due to Overflow - Exiting training."
    assert _categories(monitor) == [("loss_scale_collapse", "high")]
    below_one = "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 0.03125, "
    assert _categories(below_one) == [("loss_scale_collapse", "high")]
    # One overflow that leaves a normal fp16 scale is routine dynamic loss scaling.
    assert _categories("Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0") == []


@pytest.mark.parametrize("line, category", [
    ("misc/socket.cc:484 NCCL WARN socketStartConnect: Connect to 10.1.1.1<43411> failed : Software caused "
     "connection abort", "nccl_error"),
    ("node1:2:2 [0] NCCL WARN Bootstrap : no socket interface found", "nccl_error"),
    ("node1:2:9 [0] NCCL WARN NET/IB : Unable to open device mlx5_0", "nccl_error"),
    ("RuntimeError: HIP out of memory. Tried to allocate 2.00 GiB (GPU 0; 63.98 GiB total capacity)", "oom"),
    ("RuntimeError: MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: 1.20 GB)", "oom"),
    ("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", "oom"),
    ("RuntimeError: No CUDA GPUs are available", "cuda_error"),
    ("RuntimeError: Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU", "cuda_error"),
    ("RuntimeError: The NVIDIA driver on your system is too old (found version 10010).", "cuda_error"),
    ("torch.cuda.DeferredCudaCallError: CUDA call failed lazily at initialization with error: device >= 0",
     "cuda_error"),
    ("CUDA Exception: Warp Illegal Address", "illegal_memory_access"),
    ("subprocess.CalledProcessError: Command '['/usr/bin/python', '-u', 'train.py', '--local_rank=1']' returned "
     "non-zero exit status 1.", "child_failed"),
    ("torch.multiprocessing.spawn.ProcessRaisedException:", "child_failed"),
    ("Horovod has been shut down. This was caused by an exception on one of the ranks or an attempt to allreduce",
     "child_failed"),
    ("WARNING: non-finite loss, ending training  ('box', 'obj', 'cls', 'total') tensor([nan, nan, nan, nan])",
     "loss_nan"),
    ("RuntimeError: Loss is inf, stopping training", "loss_nan"),
    ("[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 1, reducing to 1", "loss_scale_collapse"),
    ("RuntimeError: connect() timed out. Original timeout was 1800000 ms.", "heartbeat_timeout"),
    ("[W socket.cpp:601] [c10d] The client socket has failed to connect to [localhost]:29500 (errno: 99 - Cannot "
     "assign requested address).", "heartbeat_timeout"),
    ("RuntimeError: Stop_waiting response is expected", "heartbeat_timeout"),
    ("torch.distributed.DistNetworkError: Connection reset by peer", "heartbeat_timeout"),
    ("RuntimeError: unable to mmap 1024 bytes from file </torch_1234_5678_9>: Cannot allocate memory (12)",
     "dataloader_worker_killed"),
    ("Net : Connection closed by remote peer node2<45678>", "nccl_error"),
    ("node1:1:1 [0] NCCL WARN Error : ring 0 does not loop back to start (1 != 0)", "nccl_error"),
    ("WARNING:torch.distributed.elastic.agent.server.api:[default] Worker group FAILED. 3/3 attempts left; will "
     "restart worker group", "child_failed"),
    ("Epoch 0: 10%|#         | 100/1000 [01:00<09:00, reduced_train_loss=nan, global_step=99.00]", "loss_nan"),
    ("ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.", "child_failed"),
    ("Workers (tasks / actors) killed due to memory pressure (OOM): 1 Workers crashed due to other reasons: 0", "oom"),
    ("jaxlib.xla_extension.XlaRuntimeError: DEADLINE_EXCEEDED: Barrier timed out. Barrier_id: PjRT_Client_Connect.",
     "heartbeat_timeout"),
    ("tensorflow.python.framework.errors_impl.InternalError: CUDA runtime implicit initialization on GPU:0 failed. "
     "Status: out of memory", "oom"),
    ("Failed to get convolution algorithm. This is probably because cuDNN failed to initialize, so try looking",
     "cuda_error"),
    ("RuntimeError: Unable to find a valid cuDNN algorithm to run convolution", "cuda_error"),
    ("[1234567.890] Out of memory: Killed process 12345 (python) total-vm:123456kB, anon-rss:1234kB", "oom"),
    ("RuntimeError: [enforce fail at alloc_cpu.cpp:114] err == 0. DefaultCPUAllocator: can't allocate memory: you "
     "tried to allocate 1073741824 bytes. Error code 12 (Cannot allocate memory)", "oom"),
])
def test_messages_of_torch_nccl_and_launchers_read_on_their_own(line: str, category: str) -> None:
    """Messages from the failure vocabulary of torch, NCCL, CUDA and the launchers (not from
    any corpus text), each read alone, as an issue quotes it."""
    assert [c for c, _ in _categories(line)] == [category]


VOCABULARY = Path(__file__).resolve().parent / "fixtures" / "message_vocabulary.tsv"
"""One message per line, `category<TAB>line`: the failure messages (and routine lines, `healthy`)
that torch, NCCL, CUDA, the launchers and the training frameworks print, as their own source
prints them, with values filled in; not taken from any corpus text."""


def _vocabulary() -> list[tuple[str, str]]:
    return [tuple(row.split("\t", 1)) for row in VOCABULARY.read_text().splitlines() if row]


@pytest.mark.parametrize("category, line", _vocabulary(), ids=lambda v: v[:60])
def test_the_failure_vocabulary_is_read_line_by_line(category: str, line: str) -> None:
    found = _categories(line)
    if category == "healthy":
        assert [(c, s) for c, s in found if s not in ("info", "low")] == []
    else:
        assert category in [c for c, _ in found], found


@pytest.mark.parametrize("line", [
    "[WARNING] [stage3.py:1850:step] 1 pytorch allocator cache flushes since last step. this happens when there is "
    "high memory pressure and is detrimental to performance.",
    "[rank0]:[W ProcessGroupNCCL.cpp:1168] Warning: WARNING: process group has NOT been destroyed before we destruct "
    "ProcessGroupNCCL.",
    "node1:2:9 [0] NCCL INFO NET/Plugin : dlerror=libnccl-net.so: cannot open shared object file: No such file or "
    "directory No plugin found (libnccl-net.so), using internal implementation",
    "node1:2:9 [0] NCCL INFO comm 0x55d5 rank 0 nranks 2 cudaDev 0 busId 1000 - Init COMPLETE",
    "{'train_runtime': 1234.5, 'train_samples_per_second': 12.3, 'train_loss': 1.234, 'epoch': 3.0}",
    "[W reducer.cpp:1300] Warning: find_unused_parameters=True was specified in DDP constructor, but did not find any "
    "unused parameters in the forward pass.",
    "NCCL WARN NET/Plugin: Could not find: libnccl-net.so. Using internal network plugin.",
])
def test_routine_lines_of_a_healthy_run_are_not_faults(line: str) -> None:
    assert [(c, s) for c, s in _categories(line) if s not in ("info", "low")] == []


@pytest.mark.parametrize("text, category", [
    ("While running the train script, the dataloader gets stuck at `data = training_queue.get(block=True)` in train.py",
     "dataloader"),
    ("正常跑了7-8个小时，突然卡住在 torch.cuda.current_stream().synchronize()", "cuda_sync"),
    ("After 3 epochs every rank hangs in dist.barrier() after validation", "barrier"),
    ("Rank 0 is stuck inside all_reduce while the others already finished the epoch", "collective_wait"),
    ("the job freezes while saving the checkpoint with torch.save(state, path)", "checkpoint_io"),
])
def test_a_hang_described_in_words_names_where_it_waits(text: str, category: str) -> None:
    """Only when nothing else explains the text, and at medium severity: words are weaker
    evidence than a stack."""
    assert _categories(text) == [(category, "medium")]


def test_words_without_a_hang_or_beside_real_evidence_add_nothing() -> None:
    assert _categories("We broadcast the parameters and use a DataLoader with 8 workers.") == []
    assert _categories("The run got stuck.") == []  # no place named
    text = ("training hangs in all_reduce\nRuntimeError: CUDA error: an illegal memory access was encountered")
    assert [c for c, _ in _categories(text)] == ["illegal_memory_access"]


def test_an_exception_nothing_else_explains_is_other_at_low_severity() -> None:
    text = ("I tried `python tools/train_net.py`, but got an error says `TypeError: get_default_optimizer_params() "
            "got an unexpected keyword argument 'lr_factor_func'`.")
    assert _categories(text) == [("other", "low")]
    (finding,) = explain_inputs([("issue.txt", text.encode())])["findings"]
    assert finding["runbook"] == "python-exception" and finding["exception"] == "TypeError"
    # A known message keeps its own category and no `other` is added beside it.
    assert _categories("RuntimeError: CUDA error: an illegal memory access was encountered") == [
        ("illegal_memory_access", "medium")]
    # Text without an exception gets nothing.
    assert _categories("Epoch 3 done, loss 0.412") == []


def test_a_scaler_that_cannot_reduce_further_is_at_its_floor() -> None:
    floor = "\n".join(f"[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: {a}, reducing to {b}"
                      for a, b in ((4, 2), (2, 1), (1, 1)))
    assert _categories(floor) == [("loss_scale_collapse", "high")]
    # One routine reduction is still routine.
    assert _categories("[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768") == []


@pytest.mark.parametrize("text, category", [
    # The watchdog's line quoted without its WorkNCCL record.
    ("abort at larger dataset sizes with\n\n    Watchdog caught collective operation timeout\n"
     "    checkTimeout at ProcessGroupNCCL.cpp:733", "collective_timeout"),
    ("RuntimeError: Address already in use", "heartbeat_timeout"),
    ("Error while creating shared memory segment /dev/shm/nccl-CsYXMW (size 9637888)", "nccl_error"),
    ('"Duplicate GPU detected : rank 1 and rank 0 both on CUDA device a4000" from NCCL INFO.', "nccl_error"),
    ("Out of memory error on GPU 0. Cannot allocate 400.000244MB memory on GPU 0, 7.288696GB memory has been "
     "allocated and available memory is only 155.187500MB.", "oom"),
    ("RuntimeError: GET was unable to find an engine to execute this computation", "cuda_error"),
    ("[2024-01-10 21:48:30,236] [INFO] [launch.py:315:sigkill_handler] Killing subprocess 2432905", "child_failed"),
])
def test_round_12_classes(text: str, category: str) -> None:
    """Messages round 12's held-out texts showed that no rule read: NCCL's watchdog line
    without its record, a TCPStore whose port is taken, NCCL's shared-memory segment and
    duplicate-GPU refusals, Paddle's GPU out-of-memory, cuDNN finding no engine, and the
    DeepSpeed launcher killing its workers."""
    assert [c for c, _ in _categories(text)] == [category]


@pytest.mark.parametrize("text, category", [
    ("\n".join(f"[E ProcessGroupNCCL.cpp:467] [Rank {r}] Watchdog caught collective operation timeout: WorkNCCL("
               f"SeqNum=202558, OpType=_ALLGATHER_BASE, NumelIn={n}, NumelOut={8 * n}, Timeout(ms)=1800000) ran for "
               f"1800376 milliseconds before timing out." for r, n in ((6, 2359296), (1, 2359296), (0, 75264))),
     "collective_mismatch"),
    ("**********************************************************************\n"
     "Child process 17057 (local_rank 0) FAILED (exitcode 1)\nError msg: Process failed with exitcode 1",
     "child_failed"),
    ("\n".join(f"iteration : {i}, losses : {v}" for i, v in ((5, "332.03"), (6, "1436176.25"), (7, "nan"))),
     "loss_nan"),
    ("2025-08-05 12:33:53.958194: W external/xla/xla/tsl/framework/bfc_allocator.cc:501] Allocator (GPU_2_bfc) ran out "
     "of memory trying to allocate 91.27GiB (rounded to 98000028160)requested by op", "oom"),
    ('raise RuntimeError("Distributed package doesn\'t have NCCL " "built in")', "other"),
    ("RuntimeError: Distributed package doesn't have NCCL built in", "other"),
])
def test_round_13_classes(text: str, category: str) -> None:
    """Classes round 13's held-out texts showed: ranks timing out at one SeqNum in one op with
    different sizes (a desync of shapes), torchelastic's pre-1.10 child failure, a loss logged as
    "losses", the BFC allocator running out of memory, and a torch without NCCL."""
    assert [c for c, _ in _categories(text)][:1] == [category]


@pytest.mark.parametrize("text, category", [
    ("Primary job  terminated normally, but 1 process returned\na non-zero exit code. Per user-direction, the job has "
     "been aborted.\nmpirun noticed that process rank 1 with PID xxxxxx on node xxxxxxxx exited on signal 9 (Killed).",
     "child_failed"),
    ("WARNING:root:NaN or Inf found in input tensor.\nWARNING:root:NaN or Inf found in input tensor.", "loss_nan"),
    ("F0118 23:24:48.788218 37264 parallel.cpp:135] Check failed: result == ncclSuccess (2 vs. 0)  unhandled system "
     "error. *** Check failure stack trace: ***", "nccl_error"),
    ("train.py: error: unrecognized arguments: --local-rank=0, ERROR:torch.distributed.elastic.multiprocessing.api:"
     "failed (exitcode: 2) local_rank: 0 (pid: 27820) of binary: /usr/bin/python", "other"),
])
def test_round_14_classes(text: str, category: str) -> None:
    """Classes round 14's held-out texts showed: Open MPI's summary of a rank that failed (its
    PID redacted), TensorBoard refusing a NaN scalar, a glog check of an NCCL call, and a
    script that rejects its launcher's arguments."""
    assert [c for c, _ in _categories(text)][:1] == [category]


@pytest.mark.parametrize("text, category", [
    ("I0301 10:00:00.1 1400 distributed_c10d.py:337] Waiting in store based barrier to initialize process group for "
     "rank: 5, key: store_based_barrier_key:1 (world_size=16, worker_count=15, timeout=0:30:00)", "barrier"),
    ("Warning: Lock file exists in build directory: '/root/.cache/torch_extensions/py310_cu121/fused_adam/lock'",
     "compile_lock"),
    ("RuntimeError: connect() timed out.", "heartbeat_timeout"),
    ("RuntimeError: CUDA error: an illegal cuda memory access was encountered", "illegal_memory_access"),
    ("host:77:77 [2] transport/p2p.cc:298 NCCL WARN Cuda failure 'invalid argument'", "nccl_error"),
    ("host:77:77 [2] transport/net_ib.cc:1002 NCCL WARN Cuda failure 'invalid device context'", "nccl_error"),
    ("host:77:90 [2] proxy.cc:1625 NCCL WARN [Service thread] Accept failed Resource temporarily unavailable",
     "nccl_error"),
    # Outside NCCL's transports the CUDA call that failed names it.
    ("host:77:90 [1] enqueue.cc:42 NCCL WARN Cuda failure 'named symbol not found'", "cuda_error"),
])
def test_round_15_classes(text: str, category: str) -> None:
    """Classes round 15's held-out texts showed: a rank waiting 10 s or more at the store
    barrier, a stale extension build lock, older torch's store connect time-out, "illegal cuda
    memory access", and CUDA failures inside NCCL's transports and proxy (its own set-up)."""
    assert [c for c, _ in _categories(text)][:1] == [category]


def test_a_store_barrier_wait_names_the_rank_and_how_many_have_arrived() -> None:
    text = "\n".join(f"distributed_c10d.py:337] Waiting in store based barrier to initialize process group for rank: "
                     f"{r}, key: store_based_barrier_key:2 (world_size=8, worker_count=7, timeout=0:30:00)"
                     for r in (2, 7))
    found = [f for f in explain_inputs([("t.log", text.encode())])["findings"] if f["category"] == "barrier"]
    assert found and found[0]["severity"] == "medium" and found[0]["runbook"] == "barrier-hang"
    assert sorted(found[0]["ranks"] or [found[0]["rank"]]) == [2, 7]
    assert found[0]["world_size"] == 8 and found[0]["joined"] == 7


_WORKER_TRACEBACK = """RuntimeError: Caught RuntimeError in DataLoader worker process 3.
Original Traceback (most recent call last):
  File "/env/lib/python3.10/site-packages/torch/utils/data/_utils/worker.py", line 308, in _worker_loop
    data = fetcher.fetch(index)
  File "/env/lib/python3.10/site-packages/torch/utils/data/_utils/fetch.py", line 54, in fetch
    return self.collate_fn(data)
  File "myproject/data.py", line 93, in __call__
    padded[i, :n] = x
{exception}
"""


def test_an_exception_the_projects_own_code_raised_is_a_crash_there_not_a_wait_below_it() -> None:
    crash = _WORKER_TRACEBACK.format(exception="RuntimeError: The expanded size of the tensor (113) must match "
                                               "the existing size (114) at non-singleton dimension 1.")
    assert "dataloader" not in [c for c, _ in _categories(crash)]
    assert "other" in [c for c, _ in _categories(crash)]
    # Interrupted there (Ctrl-C on a hang), the same frames are where it waited.
    interrupted = _WORKER_TRACEBACK.format(exception="KeyboardInterrupt")
    assert "dataloader" in [c for c, _ in _categories(interrupted)]


@pytest.mark.parametrize("text, category", [
    ("training hangs while calling comm.synchronize() on two GPUs", "barrier"),
    ("RuntimeError: DataLoader worker (pid 4242) is killed by singal: Killed.", "dataloader_worker_killed"),
    ("not ready endpoints:['10.0.0.2:6070', '10.0.0.2:6071']", "heartbeat_timeout"),
    ("RuntimeError: [caffe2/distribute/lib/StoreHandler.cpp:233] Wait timeout for name(s): 0_0", "heartbeat_timeout"),
    ("With 16-mixed precision I get a nan value at every step; 32-true trains.", "loss_nan"),
])
def test_round_16_classes(text: str, category: str) -> None:
    """Classes round 16's held-out texts showed: detectron2's comm.synchronize() is a barrier,
    a DataLoader worker killed (whatever the word before the signal), Paddle's launcher waiting
    for its peers' endpoints, Caffe2's store timing out a key, a non-finite value at every step."""
    assert [c for c, _ in _categories(text)][:1] == [category]


def test_paddles_wait_for_its_peers_is_worth_a_look_not_a_fault() -> None:
    """One such line is start-up; only many say a peer never came."""
    assert _categories("not ready endpoints:['10.0.0.2:6070']") == [("heartbeat_timeout", "low")]


_PROSE_AND_FRAMES = """When running inference on long sequences I am hitting {words} in the fused kernel:

  File "/usr/lib/python3.10/site-packages/mamba_ssm/ops/triton/ssd_combined.py", line 315, in _fwd
    dA_cumsum, dt = _chunk_cumsum_fwd(dt, A, chunk_size)
  File "/usr/lib/python3.10/site-packages/triton/runtime/autotuner.py", line 156, in run
    timings = {{config: self._bench(*args, config=config, **kwargs) for config in pruned_configs}}
"""


@pytest.mark.parametrize("words, category", [
    ("an illegal memory access", "illegal_memory_access"),
    ("ncclSystemError with the message socketStartConnect failed", "nccl_error"),
])
def test_a_text_explained_only_as_other_still_has_its_words_weighed(words: str, category: str) -> None:
    found = _categories(_PROSE_AND_FRAMES.format(words=words))
    assert found[0] == (category, "low") and "other" in [c for c, _ in found[1:]]


def test_a_traceback_that_ends_in_an_exception_is_a_crash_not_a_wait() -> None:
    """Frames under init_process_group ending in a configuration error are not a rank waiting to
    form its group; ended by Ctrl-C or a time-out, the same frames are."""
    frames = """Traceback (most recent call last):
  File "/w/train.py", line 85, in main
    torch.distributed.init_process_group(backend="nccl", init_method="env://")
  File "/env/lib/python3.10/site-packages/torch/distributed/distributed_c10d.py", line 754, in init_process_group
    store, rank, world_size = next(rendezvous_iterator)
  File "/env/lib/python3.10/site-packages/torch/distributed/rendezvous.py", line 243, in _env_rendezvous_handler
    master_addr = _get_env_or_raise("MASTER_ADDR")
"""
    crash = frames + "ValueError: Error initializing torch.distributed using env:// rendezvous: environment variable " \
                     "MASTER_ADDR expected, but not set\n"
    assert "collective_wait" not in [c for c, _ in _categories(crash)]
    assert "other" in [c for c, _ in _categories(crash)]
    assert "collective_wait" in [c for c, _ in _categories(frames + "KeyboardInterrupt\n")]


def test_a_launchers_report_beside_the_workers_own_exception_names_both() -> None:
    """The worker's exception is the more specific cause; the launcher's report stays first."""
    assertion = ("AssertionError: Check batch related parameters. train_batch_size is not equal to "
                 "micro_batch_per_gpu * gradient_acc_step * world_size 256 != 4 * 8 * 1")
    launcher = ("ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: 1) local_rank: 0 (pid: 91809) "
                "of binary: /usr/bin/python")
    assert [c for c, _ in _categories(assertion + "\n" + launcher)] == ["child_failed", "other"]
    # The launcher's own exceptions are its report, not a cause.
    summary = launcher + "\ntorch.distributed.elastic.multiprocessing.errors.ChildFailedError: \ntrain.py FAILED"
    assert [c for c, _ in _categories(summary)] == ["child_failed"]


def test_fairseqs_scaler_settling_low_is_not_a_collapse_until_it_falls_below_one() -> None:
    """fairseq's floor is 1e-4 and some of its models settle at 2^2 to 2^6: cuts from 64 to 4
    are its normal calibration; below 1, the scale has collapsed."""
    notes = "\n".join(f"| INFO | fairseq.trainer | NOTE: overflow detected, setting loss scale to: {v}"
                      for v in ("64.0", "32.0", "16.0", "8.0", "4.0"))
    assert [(c, s) for c, s in _categories(notes) if s not in ("info", "low")] == []
    below = notes + "\n| INFO | fairseq.trainer | NOTE: overflow detected, setting loss scale to: 0.5"
    assert _categories(below) == [("loss_scale_collapse", "high")]


@pytest.mark.parametrize("text, category", [
    ('Setting up PyTorch plugin "bias_act_plugin"... ', "compile_lock"),
    ("Training:   0%|          | 0/100000 [00:00<?, ?step/s]Got cutlass error: Error Internal at: 363", "cuda_error"),
    ("E external/xla/xla/pjrt/distributed/client.cc:96] Coordination service agent in error status: "
     "DEADLINE_EXCEEDED: Deadline Exceeded", "heartbeat_timeout"),
    ("host:4707:5232 [2] NCCL INFO transport/shm.cc:101 -> 2\nhost:4707:5232 [2] NCCL INFO init.cc:878 -> 2",
     "nccl_error"),
])
def test_round_17_classes(text: str, category: str) -> None:
    """Classes round 17's held-out texts showed: NVlabs' custom op build that never said "Done."
    (its lock), CUTLASS's error, XLA's coordination agent giving up, and NCCL's trace of an error
    code climbing out of init when its WARN line was cut away."""
    assert [c for c, _ in _categories(text)][:1] == [category]


def test_a_plugin_build_that_finished_is_no_lock() -> None:
    assert _categories('Setting up PyTorch plugin "bias_act_plugin"... Done.') == []


def test_ncclss_error_trace_is_a_hint_beside_the_warning_that_names_the_error() -> None:
    trace = "host:1:2 [0] NCCL INFO init.cc:878 -> 2"
    found = explain_inputs([("t.log", trace.encode())])["findings"]
    assert [(f["category"], f["nccl_code"]) for f in found] == [("nccl_error", "ncclSystemError")]
    warned = "host:1:2 [0] misc/socket.cc:484 NCCL WARN socketStartConnect: Connect to 10.0.0.2<43411> failed : " \
             "Connection refused\n" + trace
    assert [c for c, _ in _categories(warned)] == ["nccl_error"]


def test_a_key_word_split_by_the_terminals_wrap_is_read() -> None:
    """A line as wide as a terminal, cut inside the word every reader looks for."""
    text = ("2023-04-06 07:42:51.278258: E external/org_tensorflow/tensorflow/compiler/xla/pjrt/"
            "pjrt_stream_executor_client.cc:2153] Execution of replica 0 failed: RE\n"
            "SOURCE_EXHAUSTED: Failed to allocate request for 625.00MiB (655360000B) on device ordinal 7")
    assert [c for c, _ in _categories(text)] == ["oom"]
    # A short line is not a wrapped one.
    assert _categories("failed: RE\nSOURCE_EXHAUSTED: Failed to allocate request for 625.00MiB") != [("oom", "medium")]


def test_deepspeeds_hysteresis_holding_a_large_scale_is_no_floor() -> None:
    """DeepSpeed's newer wording is read, and "reducing to" the same large scale is its
    hysteresis at work (calibration from 2^32), not a scaler at its floor."""
    text = "\n".join(f"[deepspeed] fp16 dynamic loss scale overflow! Rank {r} Skipping step. Attempted loss scale: "
                     f"4294967296, reducing to 4294967296" for r in range(4))
    assert _categories(text) == []
    floor = text.replace("4294967296", "1")
    assert _categories(floor) == [("loss_scale_collapse", "high")]


def test_a_nan_logged_to_tensorboard_yields_to_what_the_scaler_says() -> None:
    """TensorBoard's refusal names no value: beside a loss-scale collapse it adds nothing."""
    scaler = "\n".join(f"Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to {v}"
                        for v in ("0.5", "0.25"))
    text = scaler + "\nWarning: NaN or Inf found in input tensor."
    assert [c for c, _ in _categories(text)] == ["loss_scale_collapse"]


def test_a_bfc_allocator_that_says_it_survives_is_not_out_of_memory() -> None:
    line = ("W tensorflow/core/common_runtime/bfc_allocator.cc:243] Allocator (GPU_0_bfc) ran out of memory trying "
            "to allocate 2.26GiB with freed_by_count=0. The caller indicates that this is not a failure, but may mean "
            "that there could be performance gains if more memory were available.")
    assert _categories(line) == []


def test_uneven_sizes_are_no_mismatch_where_the_op_allows_them() -> None:
    text = "\n".join(f"[Rank {r}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLTOALL_BASE, "
                     f"NumelIn={n}, NumelOut={n}, Timeout(ms)=600000) ran for 600100 milliseconds before timing out."
                     for r, n in ((0, 100), (1, 120), (2, 100)))
    assert {c for c, _ in _categories(text)} == {"collective_timeout"}


@pytest.mark.parametrize("line, category", [
    ("RuntimeError: Timed out initializing process group in store based barrier on rank: 0, for key: "
     "store_based_barrier_key:1 (world_size=2, worker_count=1, timeout=0:30:00)", "heartbeat_timeout"),
    ("torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the C10d store has "
     "failed. See inner exception for details.", "heartbeat_timeout"),
    ("RuntimeError: Socket Timeout", "heartbeat_timeout"),
    ("torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address. "
     "The server socket has failed to bind to [::]:29500 (errno: 98 - Address already in use).", "heartbeat_timeout"),
    ("torch.distributed.DistBackendError: [2] is setting up NCCL communicator and retrieving ncclUniqueId from [0] "
     "via c10d key-value store by key '0', but store->get('0') got error: Socket Timeout", "heartbeat_timeout"),
    ("torch.distributed.DistBackendError: [2] is setting up NCCL communicator and retrieving ncclUniqueId from [0] "
     "via c10d key-value store by key '0', but store->get('0') got error: Connection reset by peer", "nccl_error"),
    ("RuntimeError: HIP error: invalid device function", "cuda_error"),
    ("RuntimeError: CUDA driver error: out of memory", "oom"),
    ("RuntimeError: CUDA driver error: invalid argument", "cuda_error"),
    ("FloatingPointError: Loss became infinite or NaN at iteration=1234!", "loss_nan"),
    ("RuntimeError: Function 'LogSoftmaxBackward0' returned nan values in its 0th output.", "loss_nan"),
    ("RuntimeError: unable to write to file </torch_18692_1954506624>: No space left on device (28)",
     "dataloader_worker_killed"),
    ("RuntimeError: unable to open shared memory object </torch_3124_2349867> in read-write mode: Too many open "
     "files (24)", "dataloader_worker_killed"),
    ("ERROR: Unexpected segmentation fault encountered in worker.", "dataloader_worker_killed"),
    ("jaxlib.xla_extension.XlaRuntimeError: INTERNAL: external/xla/xla/service/gpu/nccl_utils.cc:297: NCCL "
     "operation ncclGroupEnd() failed: unhandled cuda error", "nccl_error"),
])
def test_more_of_pytorchs_rocms_and_xlas_own_failure_messages(line: str, category: str) -> None:
    assert [c for c, _ in _categories(line)] == [category]


@pytest.mark.parametrize("line, category, rank", [
    ("subprocess.CalledProcessError: Command '['/usr/bin/python', '-u', 'train.py', '--local_rank=1']' died with "
     "<Signals.SIGKILL: 9>.", "child_failed", None),
    ("srun: error: gpu-node-07: task 3: Killed", "child_failed", 3),
    ("mpirun noticed that process rank 3 with PID 41235 on node gpu12 exited on signal 9 (Killed).", "child_failed", 3),
    ("RuntimeError: Too many open files. Communication with the workers is no longer possible. Please increase the "
     "limit using `ulimit -n`", "dataloader_worker_killed", None),
    ("node1:1234:1250 [0] include/shm.h:28 NCCL WARN Error: failed to extend /dev/shm/nccl-L6Hc7Q to 9637892 bytes",
     "nccl_error", None),
    ("MemoryError: std::bad_alloc: out_of_memory: CUDA error at: /opt/rmm/cuda_memory_resource.hpp:70: "
     "cudaErrorMemoryAllocation out of memory", "oom", None),
    ("WARNING: NaN loss detected at step 1200, skipping batch", "loss_nan", None),
    ("FloatingPointError: invalid value (nan) encountered in mul", "loss_nan", None),
])
def test_launchers_schedulers_and_libraries_in_their_own_words(line: str, category: str, rank) -> None:
    (f,) = explain_inputs([("t.log", line.encode())])["findings"]
    assert (f["category"], f["rank"]) == (category, rank)


def test_a_monitored_barrier_names_the_ranks_that_never_came() -> None:
    (f,) = explain_inputs([("t.log", b"RuntimeError: [Rank 0]: Ranks 1, 3 failed to pass monitoredBarrier in "
                                     b"1800000 ms")])["findings"]
    assert (f["category"], f["op"], f["ranks"]) == ("collective_timeout", "BARRIER", [1, 3])


@pytest.mark.parametrize("line, category", [
    ("ExternalError:  Nccl error, unhandled cuda error  (at /paddle/paddle/fluid/platform/collective_helper.cc:83)",
     "nccl_error"),
    ("OSError: (External) NCCL error(2), unhandled system error.", "nccl_error"),
    ("ERROR 2021-05-16 22:14:00,649 launch_utils.py:545] ABORT!!! Out of all 4 trainers, the trainer process with "
     "rank=[1, 2, 3] was aborted. Please check its log.", "child_failed"),
    ("cudaCheckError() failed : no kernel image is available for execution on the device", "cuda_error"),
    ("ERROR: Unexpected BUS error encountered in DataLoader worker. This might be caused by insufficient shared "
     "memory (shm)", "dataloader_worker_killed"),
    ("[W socket.cpp:426] [c10d] The server socket has failed to listen on [::]:38429 (errno: 98 - Address already "
     "in use).", "heartbeat_timeout"),
])
def test_paddles_and_extensions_words_for_known_failures(line: str, category: str) -> None:
    assert [c for c, _ in _categories(line)] == [category]


def test_healthy_socket_and_loss_term_lines_stay_healthy_and_a_nan_loss_term_does_not() -> None:
    # No IPv6 on the host: the store falls back to IPv4 and the job runs.
    assert _categories("[W socket.cpp:697] [c10d] The server socket has failed to listen on [::]:29500 "
                       "(errno: 97 - Address family not supported by protocol).") == []
    terms = ("Epoch [1][{i}/1084]\tlr: 0.01000, loss_rpn_cls: 0.5577, loss_cls: 0.1869, acc: 92.86, "
             "loss_bbox: {v}, loss: {v}")
    assert [c for c, _ in _categories("\n".join(terms.format(i=i, v=v) for i, v in ((50, "nan"), (100, "nan"),
                                                                                 (150, "0.4434"))))] == ["loss_nan"]
    assert _categories("\n".join(terms.format(i=i, v="0.4434") for i in (50, 100))) == []


def test_a_running_average_meter_gone_nan_whatever_it_measures() -> None:
    line = ("Epoch: [40][{i}/1603]  Time: 1.162s (1.383s)  Stage0-heatmaps: {v} ({v})  Stage1-heatmaps: 0.01 (0.01)")
    assert [c for c, _ in _categories("\n".join(line.format(i=i, v="nan") for i in (1200, 1300)))] == ["loss_nan"]
    assert _categories("\n".join(line.format(i=i, v="0.0094") for i in (1200, 1300))) == []


def test_paddles_native_traceback_shows_a_rank_inside_an_nccl_all_reduce() -> None:
    text = ("--------------------------------------\n"
            "C++ Traceback (most recent call last):\n"
            "--------------------------------------\n"
            "0   paddle::imperative::BasicEngine::Execute()\n"
            "1   paddle::imperative::Reducer::MarkGroupReady(unsigned long)\n"
            "2   paddle::imperative::AllReduce(paddle::framework::Variable const&, int, bool)\n"
            "3   ncclAllReduce\n"
            "4   ncclEnqueueCheck(ncclInfo*)\n")
    assert _categories(text) == [("collective_wait", "high")]
    conv = ("C++ Traceback (most recent call last):\n"
            "0   paddle::imperative::Tracer::TraceOp(std::string const&)\n"
            "1   cudnnConvolutionForward\n")
    assert "collective_wait" not in [c for c, _ in _categories(conv)]


@pytest.mark.parametrize("line, category", [
    ("RuntimeError:cuda error:unspecified launch failure", "cuda_error"),
    ("F0925 14:07:56.489186 14091 math_functions.cu:79] Check failed: error == cudaSuccess (74 vs. 0)  misaligned "
     "address", "illegal_memory_access"),
    ("F0925 14:07:56.489186 14091 syncedmem.cpp:56] Check failed: error == cudaSuccess (2 vs. 0)  out of memory",
     "oom"),
    ("F0925 14:07:56.489186 14091 im2col.cu:61] Check failed: error == cudaSuccess (8 vs. 0)  invalid device "
     "function", "cuda_error"),
    ("[17:36:58] src/storage/./pooled_storage_manager.h:111: cudaMalloc failed: out of memory", "oom"),
    ("EI9999: The error from device(chipId:3, dieId:0), serial number is 9, hccl fftsplus task timeout occurred "
     "during task execution, stream_id:5", "collective_timeout"),
    ("2022-12-08 17:57:32,672-INFO: Total iter: 10, epoch: 0, batch: 10, loss: [nan]", "loss_nan"),
])
def test_caffe_mxnet_ascend_and_paddle_words_for_known_failures(line: str, category: str) -> None:
    assert [c for c, _ in _categories(line)] == [category]


@pytest.mark.parametrize("line", [
    "RuntimeError: DataLoader timed out after 120 seconds",
    "Worker timed out after 120 seconds. This might be caused by ",
])
def test_a_data_loaders_own_time_out_is_a_data_stall(line: str) -> None:
    (f,) = explain_inputs([("t.log", line.encode())])["findings"]
    assert (f["category"], f["severity"], f["runbook"]) == ("dataloader", "medium", "dataloader-stall")
