"""kinds.py is the one declaration of incident kinds: a kind added there (and
only there) has a runbook, an alert rule, an exporter series and a default
severity everywhere; no other module keeps a list of kinds of its own, and no
detector restates a kind's severity or runbook."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from trainwatch import kinds
from trainwatch.dashboards import alerts
from trainwatch.diagnostics import runbooks, utilisation
from trainwatch.watchdog.exporter import INCIDENT_KINDS
from trainwatch.watchdog.incident import SEVERITIES, Incident

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "trainwatch"

LITERAL_KIND_LISTS_OK = {
    ("trainwatch/inject/spec.py", frozenset({"xid", "ecc"})):
        "the faults `--inject` can cause (named like the kinds they cause), not incident kinds",
}
"""Literal collections of two or more kind names outside kinds.py that are not lists of incident kinds."""


def test_every_kind_has_a_runbook_an_alert_a_series_and_a_valid_severity():
    rules = {r.alert: r for r in alerts.rules()}
    alerted = {k for r in rules.values() for k in alerts.kinds_of(r)}
    for name, spec in kinds.KINDS.items():
        assert spec.severity in SEVERITIES, name
        assert (PKG / "runbooks" / f"{spec.runbook}.md").is_file(), (name, spec.runbook)
        assert spec.runbook in runbooks.PRODUCT_RUNBOOKS, name
        assert name in INCIDENT_KINDS, f"{name}: no trainwatch_incident_open / _incidents_total series"
        if spec.alert_rule:  # the declared reason it has no rule on its open incident
            assert spec.alert_rule in rules and name not in alerted, name
        else:
            assert name in alerted, f"{name}: no alert rule pages on its open incident"
        assert set(spec.mutes) <= set(kinds.KINDS), name


def test_an_incident_takes_its_kind_s_severity_and_runbook():
    for name, spec in kinds.KINDS.items():
        inc = Incident(kind=name, culprit_ranks=[0])
        assert (inc.severity, inc.runbook) == (spec.severity, spec.runbook), name
    # a deliberate other severity or runbook for one incident is kept
    inc = Incident(kind="xid", culprit_ranks=[0], severity="critical", runbook="stopped")
    assert (inc.severity, inc.runbook) == ("critical", "stopped")
    # a record that is not an incident kind keeps its own
    assert (Incident(kind="restart", culprit_ranks=[]).severity, Incident(kind="restart", culprit_ranks=[]).runbook) \
        == ("medium", None)


def test_stepping_verdicts_are_every_kind_that_leaves_the_job_running():
    assert utilisation.STEPPING_VERDICTS == {"healthy", *kinds.ALERT_ONLY_KINDS}


def _sources():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel != "trainwatch/kinds.py":
            yield rel, ast.parse(path.read_text(), filename=rel)


def _literal_kind_lists():
    for rel, tree in _sources():
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                continue
            names = {e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in kinds.KINDS}
            if len(names) >= 2:
                yield rel, node.lineno, frozenset(names)


def test_no_module_keeps_a_list_of_kinds_of_its_own():
    """A list of kinds written out anywhere but kinds.py goes stale when a kind is
    added (as diagnose's list of kinds whose ranks still step did): derive it from
    a KindSpec field instead."""
    found = list(_literal_kind_lists())
    assert len(found) >= len(LITERAL_KIND_LISTS_OK)  # the scan sees them
    stale = [f"{rel}:{line} {sorted(names)}" for rel, line, names in found
             if (rel, names) not in LITERAL_KIND_LISTS_OK]
    assert not stale, "lists of incident kinds outside kinds.py (derive them from kinds.KINDS): " + "; ".join(stale)


def _restated():
    """`severity=`/`runbook=` literals in an incident that equal what kinds.py declares for its kind."""
    declared_runbooks = {k.runbook for k in kinds.KINDS.values()}
    for rel, tree in _sources():
        if not rel.startswith("trainwatch/watchdog/"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                pairs = [(k.arg, k.value) for k in node.keywords if k.arg]
            elif isinstance(node, ast.Dict):
                pairs = [(k.value, v) for k, v in zip(node.keys, node.values) if isinstance(k, ast.Constant)]
            else:
                continue
            given = {k: v.value for k, v in pairs if isinstance(v, ast.Constant) and isinstance(v.value, str)}
            spec = kinds.KINDS.get(given.get("kind", ""))
            if given.get("runbook") in declared_runbooks:
                yield f"{rel}:{node.lineno} runbook={given['runbook']!r}"
            if spec is not None and given.get("severity") == spec.severity:
                yield f"{rel}:{node.lineno} severity={spec.severity!r} for {spec.name}"


def test_no_incident_restates_its_kind_s_severity_or_runbook():
    found = list(_restated())
    assert not found, "leave these to kinds.py: " + "; ".join(found)


@pytest.mark.parametrize("kind", sorted(kinds.KINDS))
def test_a_kind_s_alert_severity_matches_its_declaration(kind):
    spec = kinds.KINDS[kind]
    rule = next(r for r in alerts.rules() if kind in alerts.kinds_of(r) or r.alert == spec.alert_rule)
    assert rule.severity == spec.alert.value
