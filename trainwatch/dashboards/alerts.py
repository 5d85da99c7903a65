"""The Prometheus alert rules, generated from the incident kinds (kinds.KINDS).

Every kind is alerted on while one of its incidents is open
(`trainwatch_incident_open`), with the kind's page-or-ticket (`KindSpec.alert`)
as the rule's `severity` label and the kind's runbook: by a rule of its own
where INCIDENT_RULES gives it a name and words, else by the shared rule of its
urgency (GROUP_RULES). A kind whose fault has better series of its own (a GPU
fault's per-GPU counters) names that rule instead (`KindSpec.alert_rule`).
SIGNAL_RULES are the alerts that need no incident: backstops read from the
exporter's series, and the exporter itself.

`runbook_url` is the runbook base URL (`trainwatch dashboards
--runbook-base-url`) followed by `<runbook id>.md`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from trainwatch import kinds

DEFAULT_RUNBOOK_BASE_URL = "https://github.com/trainwatch/trainwatch/blob/main/runbooks/"
"""Where `runbook_url` points unless `--runbook-base-url` says otherwise: the runbooks/ folder of
the project's repository, which renders the markdown. Point it at your own copy to pin a version."""
KIND_RUNBOOK = '{{ reReplaceAll "_" "-" $labels.kind }}'
"""The runbook id of a shared rule's incident, from its `kind` label (loss_spike -> loss-spike)."""
JOB, NODE = "{{ $labels.trainwatch_job }}", "{{ $labels.node }}"
DIAGNOSE = f"trainwatch diagnose {JOB}"


@dataclass(frozen=True, slots=True)
class Rule:
    """One alerting rule, as written to alert-rules.yml."""

    alert: str
    """The alert's name (ALERTS{alertname})."""
    comment: str
    """Why it fires and what it means: the comment above the rule."""
    expr: str
    """PromQL; a multi-line one is written as a block."""
    severity: str
    """The `severity` label: critical (pages) or warning (a ticket)."""
    summary: str
    """One line for the notification; Prometheus templates allowed."""
    action: str
    """The first thing to do."""
    runbook: str
    """Runbook id, or KIND_RUNBOOK in a rule over several kinds."""
    for_: str = ""
    """How long the condition must hold before it fires (`5m`); empty: at once."""


@dataclass(frozen=True, slots=True)
class IncidentRule:
    """The words of a rule of its own for one incident kind."""

    alert: str
    comment: str
    summary: str
    action: str = DIAGNOSE
    for_: str = ""


INCIDENT_RULES = {
    "hang": IncidentRule(
        "TrainwatchJobHung",
        "A hang incident is open: a rank made no progress for max(5 s, k x p99 step time) and has not trained since. "
        "It pages seconds after the hang began, long before NCCL's 10 min (or gloo's 30 min) collective timeout, "
        "and stops once the restarted job trains again.",
        f"trainwatch job {JOB} on {NODE} is hung"),
    "node_lost": IncidentRule(
        "TrainwatchNodeLost",
        "A node of a multi-node job went silent. Counted by the node hosting the rendezvous only, so it pages "
        "once per job, naming the lost node in the incident (trainwatch diagnose).",
        f"trainwatch job {JOB} lost a node (reported by {NODE})"),
    "collective_mismatch": IncidentRule(
        "TrainwatchCollectiveMismatch",
        "Ranks of one process group disagree on which collective comes next. On gloo this never times out: "
        "values are silently wrong until a rank exits.",
        f"trainwatch job {JOB} on {NODE}: ranks disagree on the next collective"),
    "straggler": IncidentRule(
        "TrainwatchStraggler",
        "A straggler incident has been open for 5 minutes: a rank keeps arriving last at the collectives (or "
        "computing well above its peers) and every other rank waits for it. The incident stays open through the "
        "ratio's dips, so this fires once; the incident names the rank.",
        f"trainwatch job {JOB} on {NODE} has had a straggler for 5 minutes", for_="5m"),
    "loss_nan": IncidentRule(
        "TrainwatchLossNaN",
        "The loss went NaN or Inf, and has not been finite for a minute since.",
        f"trainwatch job {JOB} on {NODE}: loss is NaN/Inf",
        f"{DIAGNOSE}; resume from the checkpoint before the first NaN with a lower LR or skipped data"),
}
"""Kinds alerted by a rule of their own; kinds.py decides whether it pages."""

GROUP_RULES = {
    kinds.Alert.PAGE: IncidentRule(
        "TrainwatchIncident",
        "Faults that page and have no rule of their own: {kinds}. Fires while the incident is open; the "
        "incident's kind names the runbook.",
        f"trainwatch job {JOB} on {NODE}: {{{{ $labels.kind }}}} incident"),
    kinds.Alert.TICKET: IncidentRule(
        "TrainwatchTrainingHealth",
        "Training health: {kinds}. The job keeps running but may be wasting its compute; the incident names the "
        "ranks and the numbers. Fires while the incident is open.",
        f"trainwatch job {JOB} on {NODE}: training health: {{{{ $labels.kind }}}}",
        f"{DIAGNOSE}; the incident in events.jsonl names the ranks, steps and values"),
}
"""The rule shared by every other kind of one urgency."""


def _counter_new(series: str, window: str, by: str = "") -> str:
    """`series` increased in the window, or is new in it and already above 0 (an event before the first
    scrape, a restarted sidecar: increase() alone sees nothing there)."""
    if by:
        return (f"sum by ({by}) (increase({series}[{window}])) > 0\n"
                f"or sum by ({by}) ({series} > 0\n"
                f"{' ' * (len(by) + 12)}unless {series} offset {window})")
    return f"increase({series}[{window}]) > 0\nor ({series} > 0\n    unless {series} offset {window})"


_GPU_BY = "trainwatch_job, node, gpu, rank, xid"
SIGNAL_RULES = (
    Rule("TrainwatchRankStalled",
         "Backstop that needs no sidecar verdict: a rank of the node made no progress for a minute, held for a "
         "minute (the node's worst rank, from its aggregate: one alert per node, not per rank). While ranks of "
         "the node are in phases with honest long pauses (start-up, checkpoint, eval) it waits 15 minutes "
         "instead, as the sidecar's detector is lenient there too. trainwatch_node_worst_rank names the rank.",
         "(\n"
         "  max by (trainwatch_job, node) (trainwatch_node_last_progress_age_seconds{stat=\"max\"}) > 60\n"
         "  unless on (trainwatch_job, node)\n"
         "    sum by (trainwatch_job, node) (rate(trainwatch_phase_seconds_total{phase=~\"init|checkpoint|eval\"}"
         "[1m])) > 0\n"
         ")\n"
         "or max by (trainwatch_job, node) (trainwatch_node_last_progress_age_seconds{stat=\"max\"}) > 900",
         "critical", f"trainwatch job {JOB}: a rank on {NODE} has made no progress", DIAGNOSE,
         kinds.KINDS["hang"].runbook, for_="1m"),
    Rule("TrainwatchGpuXidCritical",
         "An Xid the table rates critical (fallen off the bus, uncontained ECC, NVLink down, ...): the GPU or node "
         "needs attention now.",
         _counter_new('trainwatch_gpu_xid_code_errors_total{severity="critical"}', "5m", _GPU_BY),
         kinds.KINDS["xid"].alert.value,
         f"trainwatch job {JOB}: critical Xid {{{{ $labels.xid }}}} on {NODE} GPU {{{{ $labels.gpu }}}}",
         f"drain {NODE} if the Xid repeats; trainwatch explain <kernel log> names the action",
         kinds.KINDS["xid"].runbook),
    Rule("TrainwatchGpuXid",
         "Any other Xid: often the application's own fault (Xid 13, 31, 43), worth a look.",
         _counter_new('trainwatch_gpu_xid_code_errors_total{severity!="critical"}', "5m", _GPU_BY),
         kinds.Alert.TICKET.value,
         f"trainwatch job {JOB}: Xid {{{{ $labels.xid }}}} on {NODE} GPU {{{{ $labels.gpu }}}}", DIAGNOSE,
         kinds.KINDS["xid"].runbook),
    Rule("TrainwatchGpuEccUncorrected",
         "An uncorrected ECC error means the GPU's results cannot be trusted.",
         _counter_new('trainwatch_gpu_ecc_errors_total{type="uncorrected"}', "5m"),
         kinds.KINDS["ecc"].alert.value,
         f"trainwatch job {JOB}: uncorrected ECC error on {NODE} GPU {{{{ $labels.gpu }}}}",
         f"drain {NODE}; the job resumes elsewhere from its last checkpoint", kinds.KINDS["ecc"].runbook),
    Rule("TrainwatchLossScaleLow",
         "Backstop that needs no sidecar verdict: a rank's fp16 loss scale below 1 for 5 minutes (the node's "
         "lowest). Every step's gradients overflow; the run is not learning.",
         'min by (trainwatch_job, node) (trainwatch_node_loss_scale{stat="min"}) < 1',
         kinds.KINDS["loss_scale_collapse"].alert.value,
         f"trainwatch job {JOB}: a rank on {NODE} has a loss scale of {{{{ $value }}}}",
         f"{DIAGNOSE}; roll back before the scale fell and lower the learning rate",
         kinds.KINDS["loss_scale_collapse"].runbook, for_="5m"),
    Rule("TrainwatchRestartLoop",
         "Restarts that keep coming: the fault survives a restart (bad node, bad data, bad checkpoint). The "
         "restart budget will stop the job soon.",
         "increase(trainwatch_restarts_total[30m]) >= 3\n"
         "or (trainwatch_restarts_total >= 3 unless trainwatch_restarts_total offset 30m)",
         "critical", f"trainwatch job {JOB} on {NODE} restarted 3 or more times in 30 minutes",
         f"{DIAGNOSE}; find what survives a restart before spending more budget", "restart-loop"),
    Rule("TrainwatchExporterDown",
         "The exporter stopped answering while its target is still listed: the sidecar (and with it hang "
         "detection) is gone, or the node is.",
         'up{job="trainwatch"} == 0', "warning",
         f"trainwatch exporter {{{{ $labels.instance }}}} of job {JOB} is down",
         "check the job's node; `trainwatch jobs` lists its status", "exporter-down", for_="5m"),
)
"""Alerts that need no incident."""


def incident_expr(kind_names: list[str], *, shared: bool) -> str:
    if shared:
        return (f'max by (trainwatch_job, node, kind) (trainwatch_incident_open{{kind=~"{"|".join(kind_names)}"}})'
                " > 0")
    return f'max by (trainwatch_job, node) (trainwatch_incident_open{{kind="{kind_names[0]}"}}) > 0'


def rules() -> list[Rule]:
    """Every alerting rule: the incident kinds' in KINDS order (a shared rule where its first kind is),
    then SIGNAL_RULES. ValueError: the kinds and the rules disagree (the message names the fix)."""
    unknown = set(INCIDENT_RULES) - set(kinds.KINDS)
    if unknown:
        raise ValueError(f"INCIDENT_RULES names kinds that kinds.KINDS does not declare: {sorted(unknown)}")
    signal = {r.alert for r in SIGNAL_RULES}
    grouped: dict[kinds.Alert, list[str]] = {}
    order: list[object] = []
    for spec in kinds.KINDS.values():
        if spec.alert_rule:
            if spec.alert_rule not in signal:
                raise ValueError(f"kind {spec.name}: alert_rule {spec.alert_rule!r} is not in SIGNAL_RULES")
            continue
        if spec.name in INCIDENT_RULES:
            order.append(spec.name)
            continue
        if spec.runbook != spec.name.replace("_", "-"):
            raise ValueError(f"kind {spec.name}: runbook {spec.runbook!r} is not its name with dashes, which the "
                             "shared rule's runbook template assumes; give it a rule of its own in INCIDENT_RULES")
        if spec.alert not in grouped:
            order.append(spec.alert)
        grouped.setdefault(spec.alert, []).append(spec.name)
    out = []
    for item in order:
        if isinstance(item, str):
            spec, words = kinds.KINDS[item], INCIDENT_RULES[item]
            out.append(Rule(words.alert, words.comment, incident_expr([item], shared=False), spec.alert.value,
                            words.summary, words.action, spec.runbook, words.for_))
        else:
            words, members = GROUP_RULES[item], grouped[item]
            out.append(Rule(words.alert, words.comment.format(kinds=", ".join(members)),
                            incident_expr(members, shared=True), item.value, words.summary, words.action,
                            KIND_RUNBOOK, words.for_))
    return out + list(SIGNAL_RULES)


def kinds_of(rule: Rule) -> list[str]:
    """The incident kinds a rule pages on (from its `kind` matcher)."""
    found = re.search(r'trainwatch_incident_open\{kind=~?"([^"]+)"', rule.expr)
    return found.group(1).split("|") if found else []


# ---- YAML ----------------------------------------------------------------------------


def quote(value: str) -> str:
    """`value` as a YAML scalar that reads back as the same string."""
    if re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", value) and value.lower() not in _YAML_WORDS:
        return value
    if '"' in value and "'" not in value:
        return "'" + value + "'"
    return json.dumps(value)


_YAML_WORDS = frozenset({"true", "false", "yes", "no", "on", "off", "null", "y", "n"})


def comment_lines(text: str, indent: str, width: int = 110) -> list[str]:
    """`text` as `# ` comment lines of at most `width` characters."""
    out, line = [], ""
    for word in text.split():
        if line and len(indent) + 2 + len(line) + 1 + len(word) > width:
            out.append(f"{indent}# {line}")
            line = word
        else:
            line = f"{line} {word}" if line else word
    return out + ([f"{indent}# {line}"] if line else [])


def runbook_url(base: str, runbook: str) -> str:
    return f"{base}{runbook}.md"


HEADER = """\
# Prometheus alerting rules for trainwatch jobs.
#
# Generated from trainwatch/kinds.py by `trainwatch dashboards --out DIR`
# (trainwatch/dashboards/alerts.py); regenerate, never edit. Load from
# prometheus.yml (`rule_files: [alert-rules.yml]`); check with
#   promtool check rules dashboards/alert-rules.yml
#   promtool test rules dashboards/alert-rules.test.yml
# Thresholds match the dashed lines on the Grafana dashboards. Every alert
# carries the trainwatch job name in its `trainwatch_job` label, so the first step is
# `trainwatch diagnose <job>` on the job's node, and names its runbook twice:
# `runbook` is the id (`trainwatch runbook <id>` prints it) and `runbook_url`
# the page under the runbook base URL (`--runbook-base-url`, default
# {base}).
#
# `severity` is critical for what pages and warning for a ticket: an incident
# kind's is declared in trainwatch/kinds.py (`alert`), so every fault that
# stops or restarts a job (a crash as much as a hang) pages alike.
#
# Incidents alert while they are open (trainwatch_incident_open): one fault is
# one incident, open from its detection until its condition is over (a hang
# until its ranks train again, a straggler until it has been gone for a
# minute), so an alert fires once however long the fault lasts and stops when
# trainwatch resolves it. A fault trainwatch healed between two scrapes does
# not page (the dashboards and TrainwatchRestartLoop still show it).
#
# Counters that start at a non-zero value (an event before the first scrape, a
# restarted sidecar) have no earlier sample for increase(), so the counter
# alerts (GPU errors, restarts) also fire on a series that is new and already
# above zero.
groups:
  - name: trainwatch
    rules:
"""


def render_rules(base: str = DEFAULT_RUNBOOK_BASE_URL) -> str:
    """alert-rules.yml."""
    out = [HEADER.replace("{base}", base)]
    for i, r in enumerate(rules()):
        lines = ([""] if i else []) + comment_lines(r.comment, "      ") + [f"      - alert: {r.alert}"]
        if "\n" in r.expr:
            lines += ["        expr: |"] + [f"          {line}" for line in r.expr.splitlines()]
        else:
            lines.append(f"        expr: {r.expr}")
        if r.for_:
            lines.append(f"        for: {r.for_}")
        url = runbook_url(base, r.runbook)
        lines += ["        labels:", f"          severity: {r.severity}", "        annotations:",
                  f"          summary: {json.dumps(r.summary)}", f"          action: {json.dumps(r.action)}",
                  f"          runbook: {quote(r.runbook)}", f"          runbook_url: {quote(url)}"]
        out.append("\n".join(lines) + "\n")
    return "".join(out)
