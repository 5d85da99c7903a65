"""Kernel-log parsing: every log wrapping, burst summaries, findings, and real excerpts.

Unit tests use short constructed lines (one per log format); the golden
corpus under fixtures/kernel_logs/ is real, publicly posted machine output.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainwatch.diagnostics.kernel_log import (
    XidEvent,
    normalize_pci,
    parse_kernel_log,
    pci_key,
    summarize,
    xid_findings,
)

FIXTURES = Path(__file__).parent / "fixtures" / "kernel_logs"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())

MESSAGE = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus."


def only(text: str) -> XidEvent:
    events = parse_kernel_log(text)
    assert len(events) == 1, events
    return events[0]


# --- formats -----------------------------------------------------------------

def test_plain_dmesg_line():
    event = only(f"[12345.678901] {MESSAGE}")
    assert event.code == 79
    assert event.pci == "0000:3b:00"
    assert event.pid == 1234
    assert event.process == "python"
    assert event.timestamp == "12345.678901"
    assert event.severity == "critical"
    assert event.action == "reboot_node"
    assert event.line_no == 1
    assert not event.is_sxid
    assert event.text == f"[12345.678901] {MESSAGE}"


def test_dmesg_human_time():
    event = only(f"[Mon Nov 23 07:55:06 2026] {MESSAGE}")
    assert event.timestamp == "Mon Nov 23 07:55:06 2026"
    assert event.code == 79


def test_journal_syslog_line_with_and_without_host():
    with_host = only(f"Nov 23 07:55:06 host kernel: {MESSAGE}")
    without_host = only(f"Nov 23 07:55:06 kernel: {MESSAGE}")
    assert with_host.timestamp == without_host.timestamp == "Nov 23 07:55:06"
    assert with_host.pci == without_host.pci == "0000:3b:00"


def test_syslog_line_that_also_carries_a_dmesg_stamp_keeps_the_wall_clock():
    event = only(f"Nov 23 07:55:06 host kernel: [ 269.516977] {MESSAGE}")
    assert event.timestamp == "Nov 23 07:55:06"


def test_kmsg_record():
    event = only(f"4,1234,5678901,-;{MESSAGE}")
    assert event.timestamp == "5.678901"
    assert event.code == 79


def test_no_timestamp_at_all():
    event = only(MESSAGE)
    assert event.timestamp is None
    assert event.pid == 1234


def test_iso_stamped_dmesg():
    event = only(f"kern  :err   : 2025-01-25T10:34:54,859532+00:00 {MESSAGE}")
    assert event.timestamp == "2025-01-25T10:34:54,859532+00:00"


def test_unknown_pid_and_name_are_none():
    event = only("NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, "
                 "Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0): Illegal Instruction")
    assert event.pid is None
    assert event.process is None
    assert event.code == 13


def test_semicolon_separated_detail_fields():
    event = only("NVRM: Xid (PCI:0000:3b:00): 31; pid=77; name=trainer; MMU Fault")
    assert event.pid == 77
    assert event.process == "trainer"


def test_old_format_without_pci_prefix():
    event = only("NVRM: Xid (0000:01:00): 3, C 00000005 SC 00000007")
    assert event.pci == "0000:01:00"
    assert event.severity == "medium"  # unknown to the table, still reported


def test_fallen_off_the_bus_without_number_means_79():
    event = only("[   49.261458] NVRM: GPU at 0000:01:00.0 has fallen off the bus.")
    assert event.code == 79
    assert event.pci == "0000:01:00.0"


def test_fallen_off_the_bus_without_pci_keeps_pci_none():
    assert only("NVRM: GPU has fallen off the bus.").pci is None


def test_fallen_off_echo_of_numbered_line_is_not_counted_twice():
    text = ("NVRM: Xid (PCI:0000:2b:00): 79, GPU has fallen off the bus.\n"
            "NVRM: GPU 0000:2b:00.0: GPU has fallen off the bus.\n")
    assert [e.code for e in parse_kernel_log(text)] == [79]


def test_fallen_off_on_another_gpu_is_a_separate_event():
    text = ("NVRM: Xid (PCI:0000:2b:00): 79, GPU has fallen off the bus.\n"
            "NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.\n")
    assert [e.pci for e in parse_kernel_log(text)] == ["0000:2b:00", "0000:3b:00.0"]


def test_multiline_message_is_joined():
    text = ("[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0\n"
            "               NVRM: (PCI ID: 10de:26b5) installed in this system has\n"
            "               NVRM: fallen off the bus and is not responding to commands.\n")
    event = only(text)
    assert event.code == 79
    assert event.pci == "0000:b3:00.0"
    assert event.line_no == 1
    assert "not responding" in event.text


def test_indented_numbered_lines_are_not_glued_together():
    text = ("  NVRM: Xid (PCI:0000:3b:00): 13, Graphics Exception\n"
            "  NVRM: Xid (PCI:0000:3b:00): 43, Ch 00000020\n")
    assert [e.code for e in parse_kernel_log(text)] == [13, 43]


def test_nvswitch_sxid():
    event = only("nvidia-nvswitch3: SXid (PCI:0000:86:00.0): 12028, Non-fatal, Link 32")
    assert event.is_sxid
    assert event.code == 12028
    assert event.pci == "0000:86:00.0"
    assert event.severity == "low"


def test_gsp_timeout_without_number_relates_to_119():
    event = only("[   84.300488] NVRM: GPU6 _kgspLogRpcTimeout: ****** GSP Timeout ******")
    assert event.code == 119
    assert event.pci is None
    assert event.action == "reset_gpu"
    assert only("NVRM: GPU0 GSP RPC timeout while waiting for function 76").code == 119


def test_gsp_timeout_banner_next_to_numbered_119_is_one_event():
    text = ("NVRM: Xid (PCI:0000:61:00): 119, pid=1, name=x, Timeout waiting for RPC from GSP!\n"
            "NVRM: GPU0 _kgspLogXid119: ***** GSP Timeout *****\n")
    assert [e.code for e in parse_kernel_log(text)] == [119]


def test_recovery_action_of_xid_154_raises_severity_and_sets_action():
    event = only("NVRM: Xid (PCI:0000:48:00): 154, GPU recovery action changed from "
                 "0x0 (None) to 0x2 (Node Reboot Required)")
    assert event.recovery_action == "Node Reboot Required"
    assert event.action == "reboot_node"
    assert event.severity == "critical"


@pytest.mark.parametrize(("text", "action"), [
    ("GPU Reset Required", "reset_gpu"),
    ("Drain and Reset Recommended", "drain_node"),
])
def test_recovery_text_on_any_xid_line(text, action):
    event = only(f"NVRM: Xid (PCI:0000:48:00): 95, pid=1, Uncontained: LTC TAG. {text}")
    assert event.recovery_action == text
    assert event.action == action


def test_comment_lines_and_noise_are_ignored():
    text = ("# source: https://example.invalid/thread\n"
            "# NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus.\n"
            "[   12.0] usb 1-1: new high-speed USB device\n"
            "NVRM: kgspRcAndNotifyAllChannels_IMPL: RC all channels for critical error 79.\n")
    assert parse_kernel_log(text) == []


def test_line_numbers_count_every_line():
    text = "# source: x\n\nhello\n" + MESSAGE + "\n"
    assert only(text).line_no == 4


# --- PCI helpers ----------------------------------------------------------------

def test_normalize_pci():
    assert normalize_pci("PCI:0000:3B:00") == "0000:3b:00"
    assert normalize_pci("00000000:3B:00.0") == "0000:3b:00.0"
    assert normalize_pci("PCI:0004:01:00") == "0004:01:00"
    assert normalize_pci("PCI:...") is None
    assert normalize_pci(None) is None


def test_pci_key_ignores_function():
    assert pci_key("0000:3b:00.0") == pci_key("PCI:0000:3B:00") == "0000:3b:00"


# --- summaries ------------------------------------------------------------------

BURST = (
    "[100.0] NVRM: Xid (PCI:0000:48:00): 45, pid=1, name=w, channel 0x10\n"
    "[100.1] NVRM: Xid (PCI:0000:48:00): 13, pid=1, name=w, Graphics Exception\n"
    "[100.2] NVRM: Xid (PCI:0000:48:00): 94, pid=1, name=w, Contained: SM (0x1).\n"
    "[100.3] NVRM: Xid (PCI:0000:48:00): 95, pid=1, name=w, Uncontained: LTC TAG.\n"
    "[100.4] NVRM: Xid (PCI:0000:48:00): 79, GPU has fallen off the bus.\n"
)


def test_summary_root_cause_is_earliest_non_consequence():
    summary = summarize(parse_kernel_log(BURST))
    assert summary.root_cause is not None and summary.root_cause.code == 13
    assert len(summary.events) == 5


def test_summary_most_severe_ties_go_to_the_earliest():
    summary = summarize(parse_kernel_log(BURST))
    # 95 and 79 are both critical; 95 came first.
    assert summary.most_severe is not None and summary.most_severe.code == 95


def test_summary_of_nothing():
    summary = summarize([])
    assert summary.root_cause is None and summary.most_severe is None and summary.events == ()


def test_summary_when_everything_is_a_consequence():
    summary = summarize(parse_kernel_log("NVRM: Xid (PCI:0000:61:00): 45, pid=1, Ch 0000000a\n"))
    assert summary.root_cause is None
    assert summary.most_severe is not None and summary.most_severe.code == 45


# --- findings ---------------------------------------------------------------------

CONTRACT_KEYS = {"kind", "category", "op", "xid", "pci", "seq", "timeout_ms", "rank",
                 "ranks", "severity", "runbook", "evidence"}


def test_findings_have_contract_shape_and_ecc_category():
    text = ("[1.0] NVRM: Xid (PCI:0000:07:00): 48, pid='<unknown>', name=<unknown>, "
            "An uncorrectable double bit error (DBE) has been detected on GPU\n"
            "[1.1] NVRM: Xid (PCI:0000:07:00): 13, Graphics Exception\n"
            "[1.2] NVRM: Xid (PCI:0000:07:00): 13, Graphics Exception again\n")
    findings = xid_findings(text)
    assert [f["xid"] for f in findings] == [48, 13]
    for finding in findings:
        assert CONTRACT_KEYS <= finding.keys()
        assert finding["kind"] == "xid"
        assert finding["op"] is None and finding["seq"] is None and finding["rank"] is None
        assert finding["action"] and finding["meaning"]
    ecc, app = findings
    assert (ecc["category"], ecc["runbook"], ecc["severity"]) == ("ecc", "gpu-ecc", "critical")
    assert ecc["pci"] == "0000:07:00"
    assert ecc["evidence"].startswith("[1.0] NVRM: Xid")
    assert (app["category"], app["runbook"], app["count"]) == ("xid", "gpu-xid", 2)


def test_findings_for_sxid_do_not_claim_an_xid_number():
    findings = xid_findings("nvidia-nvswitch1: SXid (PCI:0000:84:00.0): 12028, Fatal, Link 3\n")
    assert findings[0]["xid"] is None
    assert findings[0]["sxid"] == 12028
    assert findings[0]["severity"] == "high"


def test_findings_of_clean_log_are_empty():
    assert xid_findings("[0.0] Linux version 6.8.0\n") == []


# --- golden corpus: real excerpts ---------------------------------------------------

def test_golden_corpus_is_large_and_sourced():
    logs = sorted(FIXTURES.glob("*.log"))
    assert len(logs) >= 15
    assert sorted(p.name for p in logs) == sorted(EXPECTED)
    for path in logs:
        first = path.read_text().splitlines()[0]
        assert first.startswith("# source: http"), path.name


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_golden_excerpt(name):
    expected = EXPECTED[name]
    events = parse_kernel_log((FIXTURES / name).read_text())
    codes: list[int] = []
    for event in events:
        if event.code not in codes:
            codes.append(event.code)
    assert codes == expected["codes"]
    assert [e.code for e in events if e.is_sxid] == expected.get("sxid_codes", [])
    summary = summarize(events)
    root = summary.root_cause
    assert (root.code if root else None) == expected["root_cause"]
    reference = root if root is not None else events[0]
    assert reference.pci == expected["pci"]
    assert summary.most_severe is not None
    assert summary.most_severe.code == expected["most_severe"]
    assert summary.most_severe.severity == expected["severity"]


def test_golden_multi_gpu_burst_keeps_each_gpu():
    events = parse_kernel_log((FIXTURES / "xid45_caused_by_nvlink_kernel_prefix.log").read_text())
    assert {e.pci for e in events} == {"0000:dc:00", "0000:ed:00", "0000:ba:00", "0000:97:00"}
    assert all(e.process == "python3" and e.pid is not None for e in events)


def test_golden_recovery_action_from_real_xid_154():
    events = parse_kernel_log((FIXTURES / "xid45_74_154_gsp_talos.log").read_text())
    (recovery,) = [e for e in events if e.code == 154]
    assert recovery.recovery_action == "GPU Reset Required"
    assert recovery.action == "reset_gpu"
    assert recovery.severity == "high"
    assert recovery.timestamp == "2026-04-22T21:26:20.695845708Z"


# --- follow-on Xids that name their cause ------------------------------------------------

def test_follow_on_xid_takes_the_severity_and_action_of_the_xid_it_names():
    event = only("NVRM: Xid (PCI:0000:3b:00): 45, pid=1234, name=python, Ch 00000008, (caused by previous Xid 79)")
    assert (event.code, event.caused_by) == (45, 79)
    assert (event.severity, event.action) == ("critical", "reboot_node")


def test_follow_on_xid_never_gets_milder_than_itself():
    # An application fault cannot make a lost GPU a matter for the application.
    event = only("NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=python, GPU has fallen off the bus caused by Xid 13")
    assert (event.caused_by, event.severity, event.action) == (13, "critical", "reboot_node")


@pytest.mark.parametrize("text", [
    "NVRM: Xid (PCI:0000:3b:00): 45, pid=1, name=w, Ch 00000008",
    "NVRM: Xid (PCI:0000:3b:00): 45, pid=1, name=w, Ch 00000008 caused by previous Xid",
    "NVRM: Xid (PCI:0000:3b:00): 45, pid=1, name=w, caused by previous Xid 45",
])
def test_follow_on_xid_without_a_usable_cause_keeps_its_own_row(text):
    event = only(text)
    assert (event.caused_by, event.severity) == (None, "info")


def test_golden_nvlink_burst_follows_the_nvlink_xids_it_names():
    """NVIDIA/open-gpu-kernel-modules#1150: only the Xid 45 clean-ups survive in the excerpt,
    each naming the NVLink Xid (149 NETIR, 145 RLW) that caused it."""
    events = parse_kernel_log((FIXTURES / "xid45_caused_by_nvlink_kernel_prefix.log").read_text())
    assert {e.caused_by for e in events} == {149, 145}
    assert {(e.severity, e.action) for e in events} == {("high", "reset_gpu")}
    summary = summarize(events)
    assert summary.root_cause is None  # the NVLink lines themselves are not in the excerpt
    assert summary.root_cause_xid == 149
    assert summary.most_severe is not None and summary.most_severe.severity == "high"
    findings = {f["pci"]: f for f in xid_findings((FIXTURES / "xid45_caused_by_nvlink_kernel_prefix.log").read_text())}
    assert findings["0000:dc:00"]["caused_by_xid"] == 149 and findings["0000:ed:00"]["caused_by_xid"] == 145
    assert {(f["severity"], f["action"]) for f in findings.values()} == {("high", "reset_gpu")}


def test_summary_root_cause_xid_is_the_root_events_when_it_is_in_the_log():
    assert summarize(parse_kernel_log(BURST)).root_cause_xid == 13
    assert summarize([]).root_cause_xid is None


# --- lines that state their own fatality ---------------------------------------------------

@pytest.mark.parametrize("line, severity, action", [
    # One NVLink Xid number covers fatal and non-fatal forms; the word on the line decides.
    ("NVRM: Xid (PCI:0000:c1:00): 146, TLW_TX Nonfatal Link 7 (0x00000002 0x0)", "low", "restart_job"),
    ("NVRM: Xid (PCI:0000:c1:00): 144, SAW_MVB Non-fatal XC0 i1 Link 3 (0x1 0x0)", "low", "restart_job"),
    ("NVRM: Xid (PCI:0000:c1:00): 150, MSE_WATCHDOG not fatal, link retrained", "low", "restart_job"),
    ("NVRM: Xid (PCI:0000:c1:00): 147, TREX_RX Fatal XC1 i0 Link 9 (0x4 0x0)", "high", "reset_gpu"),
    ("NVRM: Xid (PCI:0000:c1:00): 148, PWR_CTRL_UNCORRECTABLE Link 2", "high", "reset_gpu"),
    ("NVRM: Xid (PCI:0000:c1:00): 148, NVLINK_FATAL_ERROR Link 2", "high", "reset_gpu"),
    # no wording: the table's default stands
    ("NVRM: Xid (PCI:0000:c1:00): 147, TREX_RX XC1 i0 Link 9 (0x4 0x0)", "medium", "reset_gpu"),
    # a fatal word never lowers what the table already calls worse
    ("NVRM: Xid (PCI:0000:c1:00): 79, pid=7, name=python, GPU has fallen off the bus, fatal", "critical",
     "reboot_node"),
])
def test_a_line_that_states_its_fatality_beats_the_table(line, severity, action):
    (finding,) = xid_findings(line)
    assert (finding["severity"], finding["action"]) == (severity, action)


def test_a_nonfatal_line_that_asks_for_a_reset_still_gets_one():
    # The driver's recovery request is the last word: the event itself was non-fatal,
    # but the GPU is left needing a reset.
    (finding,) = xid_findings("NVRM: Xid (PCI:0000:c1:00): 145, RLW_RX Nonfatal Link 1 GPU Reset Required")
    assert (finding["severity"], finding["action"]) == ("high", "reset_gpu")


def test_sxid_and_xid_read_fatality_alike():
    nonfatal, fatal = xid_findings(
        "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error\n"
        "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 20034, Fatal, Link 30 LTSSM Fault Up\n")
    assert (nonfatal["severity"], fatal["severity"]) == ("low", "high")


def test_nvml_xid_events_as_device_plugins_log_them():
    (finding,) = xid_findings(
        "2024/05/06 07:08:09 XidCriticalError: Xid=94 on Device=GPU-0f1e2d3c-0000-1111-2222-333344445555, "
        "the device will go unhealthy.\n"
        "2024/05/06 07:08:09 'nvidia.com/gpu' device marked unhealthy: GPU-0f1e2d3c-0000-1111-2222-333344445555\n")
    assert (finding["xid"], finding["category"], finding["pci"]) == (94, "ecc", None)
