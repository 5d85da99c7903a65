"""promtool unit tests for the generated alert rules (alert-rules.test.yml).

The incident rules are tested from kinds.KINDS: one incident of every kind
opens at 2m and is resolved at 12m, and each rule must stay quiet before, fire
for exactly its kinds (after its `for:`) with the kind's severity, runbook and
words, and stop once the incident is resolved. The signal rules' cases are
written out below (series and the labels of the alerts expected); every
expected annotation is the rule's own template, expanded.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from trainwatch import kinds
from trainwatch.dashboards.alerts import (
    DEFAULT_RUNBOOK_BASE_URL, KIND_RUNBOOK, SIGNAL_RULES, Rule, comment_lines, kinds_of, quote, rules, runbook_url,
)

STEP_S = 15
OPEN_S, RESOLVED_S = 120, 720
"""When every test incident opens and is resolved (the series' 0/1 samples)."""


@dataclass(frozen=True, slots=True)
class Series:
    series: str
    values: str
    """promtool's expanding notation: `a+bxN` is N+1 samples a, a+b, ...; `_` a missing sample."""
    comment: str = ""


@dataclass(frozen=True, slots=True)
class Case:
    eval_time: str
    alertname: str
    fired: tuple[dict, ...] = ()
    """The labels (severity aside) of each alert expected firing; none: the rule is quiet."""
    comment: str = ""
    value: str = ""
    """What `{{ $value }}` reads in the annotations."""


@dataclass(frozen=True, slots=True)
class Group:
    comment: str
    series: tuple[Series, ...]
    cases: tuple[Case, ...]


J = {"trainwatch_job": "j", "node": "n"}
SIGNAL_TESTS = (
    Group(
        "The alerts that need no incident: backstops on the exporter's series, GPU error counters, restarts and "
        "the exporter itself.",
        (
            Series('trainwatch_node_loss_scale{trainwatch_job="j",node="n",stat="min"}',
                   "1024 512 256 128 64 32 16 8 0.5x40", "node n's lowest loss scale falls below 1 at 2m"),
            Series('trainwatch_node_loss_scale{trainwatch_job="j",node="h",stat="min"}', "65536x48",
                   "node h's stays healthy"),
            Series('trainwatch_node_last_progress_age_seconds{trainwatch_job="j",node="h",stat="max"}', "1x80",
                   "healthy"),
            Series('trainwatch_node_last_progress_age_seconds{trainwatch_job="j",node="n",stat="max"}', "0+15x80",
                   "a rank hung (its peers wait in backward)"),
            Series('trainwatch_node_last_progress_age_seconds{trainwatch_job="j",node="c",stat="max"}', "0+15x80",
                   "a long checkpoint"),
            Series('trainwatch_phase_seconds_total{trainwatch_job="j",node="n",phase="backward"}', "0+120x80",
                   "8 ranks in backward"),
            Series('trainwatch_phase_seconds_total{trainwatch_job="j",node="n",phase="checkpoint"}', "0x80"),
            Series('trainwatch_phase_seconds_total{trainwatch_job="j",node="c",phase="checkpoint"}', "0+120x80",
                   "8 ranks checkpointing"),
            Series('trainwatch_gpu_xid_code_errors_total{trainwatch_job="j",node="n",gpu="0",rank="0",xid="79",'
                   'severity="critical"}', "_x4 1x30"),
            Series('trainwatch_gpu_xid_code_errors_total{trainwatch_job="j",node="n",gpu="2",rank="2",xid="13",'
                   'severity="medium"}', "_x4 1x30"),
            Series('trainwatch_gpu_ecc_errors_total{trainwatch_job="j",node="n",gpu="1",rank="1",type="uncorrected"}',
                   "_x4 2x30"),
            Series('trainwatch_gpu_ecc_errors_total{trainwatch_job="j",node="n",gpu="1",rank="1",type="corrected"}',
                   "0+5x30"),
            Series('trainwatch_restarts_total{trainwatch_job="j",node="n"}', "0 0 1 1 2 2 3 3 3 3"),
            Series('trainwatch_restarts_total{trainwatch_job="calm",node="n"}', "0 0 1 1 2 2 2 2 2 2"),
            Series('up{job="trainwatch",instance="127.0.0.1:9",trainwatch_job="j",node="n"}', "0x40"),
        ),
        (
            Case("1m", "TrainwatchRankStalled"),
            Case("3m", "TrainwatchRankStalled", (J,)),
            Case("17m", "TrainwatchRankStalled", (J, {"trainwatch_job": "j", "node": "c"}),
                 "the checkpoint's 15 minutes are over too"),
            Case("45s", "TrainwatchGpuXidCritical"),
            Case("3m", "TrainwatchGpuXidCritical", (J | {"gpu": "0", "rank": "0", "xid": "79"},)),
            Case("45s", "TrainwatchGpuXid"),
            Case("3m", "TrainwatchGpuXid", (J | {"gpu": "2", "rank": "2", "xid": "13"},)),
            Case("1m15s", "TrainwatchGpuEccUncorrected", (J | {"gpu": "1", "rank": "1", "type": "uncorrected"},)),
            Case("6m", "TrainwatchLossScaleLow", comment="under 1 for 4 minutes only"),
            Case("7m15s", "TrainwatchLossScaleLow", (J,), value="0.5"),
            Case("2m15s", "TrainwatchRestartLoop", (J,)),
            Case("4m", "TrainwatchExporterDown"),
            Case("6m", "TrainwatchExporterDown", ({"job": "trainwatch", "instance": "127.0.0.1:9"} | J,)),
        ),
    ),
    Group(
        "Every counter alert, on series first scraped after the event: the counter is already above zero in its "
        "first sample (Prometheus started scraping late, or the sidecar restarted), so increase() alone would see "
        "nothing. (The GPU error alerts have theirs in the group above.)",
        (
            Series('trainwatch_restarts_total{trainwatch_job="b",node="n"}', "_x7 3x40"),
            Series('trainwatch_node_last_progress_age_seconds{trainwatch_job="b",node="n",stat="max"}',
                   "_x7 0+15x40", "a rank of node n stalls in backward"),
            Series('trainwatch_phase_seconds_total{trainwatch_job="b",node="n",phase="backward"}', "_x7 900+120x40",
                   "the phase counter is born above 0 (rate() sees it a sample later)"),
        ),
        (
            Case("2m15s", "TrainwatchRestartLoop", ({"trainwatch_job": "b", "node": "n"},)),
            Case("5m", "TrainwatchRankStalled", ({"trainwatch_job": "b", "node": "n"},)),
        ),
    ),
)
"""The signal rules' cases."""


def duration(text: str) -> int:
    """Seconds of a Prometheus duration such as `5m` or `2m15s`."""
    parts = re.findall(r"(\d+)([smh])", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration: {text!r}")
    return sum(int(n) * {"s": 1, "m": 60, "h": 3600}[u] for n, u in parts)


def at(seconds: int) -> str:
    m, s = divmod(seconds, 60)
    return (f"{m}m" if m else "") + (f"{s}s" if s or not m else "")


def incident_group() -> Group:
    """One incident of every kind a rule pages on while open; each such rule's cases."""
    alerted = [k for k in kinds.KINDS.values() if not k.alert_rule]
    series = []
    for i, spec in enumerate(alerted):
        before = (OPEN_S // STEP_S) - 1
        first = "_" if i % 2 else "0"  # every other one first scraped already open (a restarted sidecar)
        series.append(Series(
            f'trainwatch_incident_open{{trainwatch_job="j",node="n",kind="{spec.name}",severity="{spec.severity}"}}',
            f"{first}x{before} 1x{(RESOLVED_S - OPEN_S) // STEP_S} 0x20"))
    cases = []
    for rule in rules():
        members = kinds_of(rule)
        if not members:
            continue
        fires = OPEN_S + (duration(rule.for_) if rule.for_ else 0)
        shared = rule.runbook == KIND_RUNBOOK
        fired = tuple(J | ({"kind": k} if shared else {}) for k in members)
        cases.append(Case(at(OPEN_S - 60), rule.alert, comment="nothing open yet"))
        if rule.for_:
            cases.append(Case(at(fires - 30), rule.alert, comment=f"open, not yet {rule.for_}"))
        cases += [Case(at(fires + STEP_S), rule.alert, fired),
                  Case(at(RESOLVED_S - STEP_S), rule.alert, fired, "still open"),
                  Case(at(RESOLVED_S + STEP_S), rule.alert, comment="resolved: no longer firing")]
    return Group(
        f"One incident of every kind opens at {at(OPEN_S)} and is resolved at {at(RESOLVED_S)} "
        "(trainwatch_incident_open); each incident rule fires for its kinds only, with the severity "
        "kinds.py declares.", tuple(series), tuple(cases))


def expand(template: str, labels: dict, value: str = "") -> str:
    """An annotation as Prometheus writes it for an alert with `labels`."""
    text = template.replace(KIND_RUNBOOK, labels.get("kind", "").replace("_", "-"))
    text = text.replace("{{ $value }}", value)
    return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m.group(1), ""), text)


def document(base: str = DEFAULT_RUNBOOK_BASE_URL) -> dict:
    """alert-rules.test.yml as data (what yaml.safe_load reads back from `render_tests`)."""
    by_name: dict[str, Rule] = {r.alert: r for r in rules()}
    missing = {c.alertname for g in SIGNAL_TESTS for c in g.cases} - set(by_name)
    untested = {r.alert for r in SIGNAL_RULES} - {c.alertname for g in SIGNAL_TESTS for c in g.cases if c.fired}
    if missing or untested:
        raise ValueError(f"SIGNAL_TESTS: cases of unknown rules {sorted(missing)}; rules with no firing case "
                         f"{sorted(untested)}")
    tests = []
    for group in (incident_group(), *SIGNAL_TESTS):
        cases = []
        for c in group.cases:
            case: dict = {"eval_time": c.eval_time, "alertname": c.alertname}
            if c.fired:
                r = by_name[c.alertname]
                case["exp_alerts"] = [
                    {"exp_labels": labels | {"severity": r.severity},
                     "exp_annotations": {"summary": expand(r.summary, labels, c.value),
                                         "action": expand(r.action, labels, c.value),
                                         "runbook": expand(r.runbook, labels),
                                         "runbook_url": runbook_url(base, expand(r.runbook, labels))}}
                    for labels in c.fired]
            cases.append(case)
        tests.append({"interval": f"{STEP_S}s",
                      "input_series": [{"series": s.series, "values": s.values} for s in group.series],
                      "alert_rule_test": cases})
    return {"rule_files": ["alert-rules.yml"], "evaluation_interval": f"{STEP_S}s", "tests": tests}


HEADER = """\
# promtool unit tests for alert-rules.yml, generated with it from
# trainwatch/kinds.py (trainwatch/dashboards/alerttests.py); regenerate with
# `trainwatch dashboards --out DIR`, never edit. Each case gives synthetic
# series at 15 s steps and the alerts expected at given times.
#   promtool test rules DIR/alert-rules.test.yml
# (`a+bxN` is N+1 samples a, a+b, ...; `_` is a missing sample.)
"""


def _flow(labels: dict) -> str:
    return "{" + ", ".join(f"{k}: {quote(v)}" for k, v in labels.items()) + "}"


def render_tests(base: str = DEFAULT_RUNBOOK_BASE_URL) -> str:
    """alert-rules.test.yml."""
    doc = document(base)
    groups = (incident_group(), *SIGNAL_TESTS)
    out = [HEADER, "rule_files:\n  - alert-rules.yml\n", f"evaluation_interval: {doc['evaluation_interval']}\n",
           "\ntests:\n"]
    for i, (group, test) in enumerate(zip(groups, doc["tests"])):
        lines = ([""] if i else []) + comment_lines(group.comment, "  ") + [f"  - interval: {test['interval']}",
                                                                              "    input_series:"]
        for s in group.series:
            if s.comment:
                lines.append(f"      # {s.comment}")
            lines += [f"      - series: {quote(s.series)}", f"        values: {quote(s.values)}"]
        lines.append("    alert_rule_test:")
        previous = ""
        for c, case in zip(group.cases, test["alert_rule_test"]):
            if previous and c.alertname != previous:
                lines.append("")
            previous = c.alertname
            lines += [f"      - eval_time: {c.eval_time}",
                      f"        alertname: {c.alertname}" + (f"   # {c.comment}" if c.comment else "")]
            if "exp_alerts" in case:
                lines.append("        exp_alerts:")
                for alert in case["exp_alerts"]:
                    lines += [f"          - exp_labels: {_flow(alert['exp_labels'])}", "            exp_annotations:"]
                    lines += [f"              {k}: {json.dumps(v) if k in ('summary', 'action') else quote(v)}"
                              for k, v in alert["exp_annotations"].items()]
        out.append("\n".join(lines) + "\n")
    return "".join(out)
