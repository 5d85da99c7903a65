"""The XID table: coverage of the codes a training cluster meets, and its helpers."""

from __future__ import annotations

import pytest

from trainwatch.diagnostics.xid import (
    ACTIONS,
    ECC_CODES,
    SEVERITY_ORDER,
    XID_TABLE,
    lookup,
    most_severe,
    root_cause,
    severity_rank,
    sxid_info,
)

REQUIRED = [8, 13, 31, 32, 38, 43, 45, 48, 56, 57, 61, 62, 63, 64, 68, 69, 74, 79,
            92, 94, 95, 109, 110, 119, 120, 121, 122, 123, *range(136, 151), 154, 155]


@pytest.mark.parametrize("code", REQUIRED)
def test_required_code_is_in_table(code):
    info = XID_TABLE[code]
    assert info.code == code
    assert info.name and info.name != "unknown Xid"
    assert info.meaning.strip()


def test_every_row_uses_known_severity_and_action():
    for info in XID_TABLE.values():
        assert info.severity in SEVERITY_ORDER, info
        assert info.action in ACTIONS, info


def test_severity_order_is_least_to_most():
    assert SEVERITY_ORDER == ("info", "low", "medium", "high", "critical")
    assert severity_rank("critical") > severity_rank("high") > severity_rank("info")


def test_unknown_code_never_raises():
    info = lookup(9999)
    assert info.code == 9999
    assert info.name == "unknown Xid"
    assert info.severity == "medium"
    assert info.action in ACTIONS
    assert not info.consequence


@pytest.mark.parametrize("code", [13, 31, 43])
def test_application_bugs_are_flagged(code):
    assert lookup(code).app_caused


@pytest.mark.parametrize("code", [48, 79, 94, 95, 119, 74])
def test_hardware_faults_are_not_blamed_on_the_application(code):
    assert not lookup(code).app_caused


@pytest.mark.parametrize("code", [45, 154])
def test_follow_on_codes_are_consequences(code):
    assert lookup(code).consequence


@pytest.mark.parametrize("code", [79, 48, 94, 95, 119])
def test_root_faults_are_not_consequences(code):
    assert not lookup(code).consequence


def test_gpu_lost_is_critical_and_needs_a_reboot():
    assert lookup(79).severity == "critical"
    assert lookup(79).action == "reboot_node"


def test_ecc_codes():
    assert {48, 63, 64, 92, 94, 95} <= ECC_CODES
    assert 13 not in ECC_CODES


def test_most_severe_prefers_higher_severity_then_earliest():
    assert most_severe([13, 79, 45]) == 79
    assert most_severe([13, 31]) == 13  # both medium: the earliest wins
    assert most_severe([]) is None


def test_root_cause_skips_consequences():
    assert root_cause([45, 154, 74, 79]) == 74
    assert root_cause([45, 45]) is None
    assert root_cause([]) is None


def test_sxid_severity_follows_fatal_wording():
    assert sxid_info(12028, "SXid (PCI:0000:84:00.0): 12028, Fatal, Link 32").severity == "high"
    assert sxid_info(11012, "SXid (PCI:0000:84:00.0): 11012, Non-fatal, Link 4").severity == "low"
    assert sxid_info(24007, "SXid (PCI:0000:aa:00.0): 24007, Severity 1").severity == "medium"
