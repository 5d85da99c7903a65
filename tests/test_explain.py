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
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
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


@pytest.mark.parametrize("path", CORPUS, ids=[p.stem for p in CORPUS])
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
    logs = [p for p in CORPUS if p.name.startswith("log-")]
    assert len(logs) >= 28
    for path in logs:
        assert path.read_text().startswith("# source: https://"), path.name
    covered = {f["category"] for p in logs for f in _expected(p)["findings"]}
    assert covered >= set(ERROR_CATEGORIES), set(ERROR_CATEGORIES) - covered

    total = matched = files = 0
    failures = []
    for path in CORPUS:
        files += 1
        want = len(_expected(path).get("findings", []))
        got, problems = _score(path)
        total += want
        matched += got
        failures += [f"{path.name}: {p}" for p in problems if not p.startswith("missing")]
    accuracy = matched / total if total else 1.0
    record_property("explain_corpus_files", files)
    record_property("explain_expected_findings", total)
    record_property("explain_accuracy", round(accuracy, 4))
    print(f"\nexplain golden corpus: {files} files ({len(logs)} logs), "
          f"{matched}/{total} expected findings matched ({accuracy:.1%}), {len(failures)} false positives")
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
