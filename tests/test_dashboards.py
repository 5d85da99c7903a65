"""The generated Grafana dashboards, the provisioning files, the Prometheus
config and the alert rules, checked against the real thing: the SDK reads the
JSON back, promtool checks the config and unit-tests every alert, and a real
Prometheus scraping a real `trainwatch launch` with an injected straggler,
hang and Xid evaluates every panel's and annotation's PromQL."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time

import pytest
import requests
import yaml
from grafana_foundation_sdk.models import dashboard as dm

from trainwatch import dashboards, kinds
from trainwatch.dashboards import alerts, alerttests
from trainwatch.dashboards.definitions import DASHBOARDS
from trainwatch.diagnostics.kernel_log import normalize_pci
from trainwatch.inject.fake_nvml import FakeNvml
from trainwatch.dashboards.panels import DATASOURCE_UID, STALL_SECONDS, STRAGGLER_RATIO
from trainwatch.watchdog.aggregates import RANK_SIGNALS, SIGNALS
from trainwatch.diagnostics.runbooks import get_runbook
from util import BIN, ROOT, env_for, events, job_json, prometheus_server, stop_group, wait_for

OUT = ROOT / "dashboards"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package `prometheus`)")

TEMPLATE_VARS = ("job", "node", "rank")
PER_RANK = {"trainwatch_" + s.metric for s in SIGNALS if s.name in RANK_SIGNALS}
"""The only series with a rank label (besides the GPUs'): what a person drills into."""
REQUIRED_ALERTS = {
    "TrainwatchJobHung", "TrainwatchCollectiveMismatch", "TrainwatchStraggler", "TrainwatchGpuXidCritical",
    "TrainwatchGpuEccUncorrected", "TrainwatchLossNaN", "TrainwatchRestartLoop",
}


def committed() -> dict[str, dict]:
    return {name: json.loads((OUT / name).read_text()) for name in DASHBOARDS}


def panels(dash: dict) -> list[dict]:
    """Query panels (rows carry no queries)."""
    return [p for p in dash["panels"] if p["type"] != "row"]


def variables(dash: dict) -> dict[str, dict]:
    return {v["name"]: v for v in dash["templating"]["list"]}


def exprs(dash: dict) -> str:
    return " ".join(t["expr"] for p in panels(dash) for t in p["targets"])


def alert_rules() -> list[dict]:
    doc = yaml.safe_load((OUT / "alert-rules.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


# ---- generated files ----------------------------------------------------------------


def test_committed_files_are_what_the_code_generates():
    """Dashboards from their definitions, alert rules and their promtool tests from kinds.py."""
    rendered = dashboards.rendered()
    assert {"alert-rules.yml", "alert-rules.test.yml"} <= set(rendered)
    for name, text in rendered.items():
        assert (OUT / name).read_text() == text, f"{name} is stale; run: trainwatch dashboards --out dashboards/"


def test_cli_writes_and_checks(tmp_path):
    tw = str(BIN / "trainwatch")
    wrote = subprocess.run([tw, "dashboards", "--out", str(tmp_path)], capture_output=True, text=True)
    assert wrote.returncode == 0, wrote.stderr
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()) == sorted(dashboards.rendered())
    ok = subprocess.run([tw, "dashboards", "--out", str(tmp_path), "--check"], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout == "", ok.stdout + ok.stderr
    edited = tmp_path / "trainwatch-gpu.json"
    edited.write_text(edited.read_text().replace("Utilization", "Utilisation"))
    stale = subprocess.run([tw, "dashboards", "--out", str(tmp_path), "--check"], capture_output=True, text=True)
    assert stale.returncode == 1
    assert "trainwatch-gpu.json" in stale.stderr and "trainwatch-overview.json" not in stale.stderr
    assert "-" in stale.stdout and "Utilisation" in stale.stdout  # the diff
    assert "Utilisation" in edited.read_text()  # --check writes nothing
    again = subprocess.run([tw, "dashboards", "--out", str(tmp_path)], capture_output=True, text=True)
    assert again.returncode == 0 and again.stdout.strip() == f"wrote {edited}"
    # bad input: one line naming the fix
    not_dir = tmp_path / "file"
    not_dir.write_text("")
    bad = subprocess.run([tw, "dashboards", "--out", str(not_dir)], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "give a directory" in bad.stderr


def test_cli_points_runbook_urls_at_another_base(tmp_path):
    tw = str(BIN / "trainwatch")
    base = "https://wiki.example.com/ml/runbooks"
    wrote = subprocess.run([tw, "dashboards", "--out", str(tmp_path), "--runbook-base-url", base],
                           capture_output=True, text=True)
    assert wrote.returncode == 0, wrote.stderr
    rules = yaml.safe_load((tmp_path / "alert-rules.yml").read_text())["groups"][0]["rules"]
    hung = next(r for r in rules if r["alert"] == "TrainwatchJobHung")
    assert hung["annotations"]["runbook_url"] == base + "/hang.md"
    assert all(r["annotations"]["runbook_url"].startswith(base + "/") for r in rules)
    assert base + "/hang.md" in (tmp_path / "alert-rules.test.yml").read_text()
    # the committed files carry the default base: --check against them with another base says stale
    other = subprocess.run([tw, "dashboards", "--out", str(OUT), "--check", "--runbook-base-url", base],
                           capture_output=True, text=True)
    assert other.returncode == 1 and "alert-rules.yml" in other.stderr
    for bad_url in ("wiki/runbooks", "https://x/{{ $labels.kind }}", "https://x/a b"):
        bad = subprocess.run([tw, "dashboards", "--out", str(tmp_path), "--runbook-base-url", bad_url],
                             capture_output=True, text=True)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--runbook-base-url" in bad.stderr, bad.stderr


# ---- the JSON, read back --------------------------------------------------------------


def test_sdk_reads_every_dashboard_back_unchanged():
    # The SDK's annotation model has no Prometheus-specific fields (step,
    # titleFormat, ...); everything else must survive a round trip.
    extra = ("step", "titleFormat", "textFormat", "tagKeys", "useValueForTime")
    for name, dash in committed().items():
        model = dm.Dashboard.from_json(dash)
        back = json.loads(dashboards.render(model))
        for a in dash["annotations"]["list"]:
            assert all(a[k] is not None for k in extra), (name, a["name"])
            for k in extra:
                del a[k]
        assert back == dash, name


def test_four_dashboards_with_the_template_variables():
    dashes = committed()
    assert len(dashes) >= 4
    titles = {d["title"] for d in dashes.values()}
    assert {"trainwatch: job overview", "trainwatch: ranks and stragglers", "trainwatch: collectives",
            "trainwatch: GPU health"} <= titles
    for name, dash in dashes.items():
        assert dash["uid"] and "trainwatch" in dash["tags"]
        found = variables(dash)
        ds = found["datasource"]
        assert ds["type"] == "datasource" and ds["query"] == "prometheus"
        assert ds["current"]["value"] == DATASOURCE_UID
        for var in TEMPLATE_VARS:
            assert found[var]["type"] == "query" and "label_values(" in found[var]["query"], (name, var)
            assert found[var]["datasource"]["uid"] == "${datasource}"
            assert found[var]["includeAll"] and found[var]["allValue"] == ".*"


def test_panel_ids_unique_and_layout_inside_24_columns():
    for name, dash in committed().items():
        ids = [p["id"] for p in dash["panels"]]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        cells = set()
        for p in dash["panels"]:
            g = p["gridPos"]
            assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, (name, p["title"], g)
            assert g["h"] > 0 and g["y"] >= 0
            for x in range(g["x"], g["x"] + g["w"]):
                for y in range(g["y"], g["y"] + g["h"]):
                    assert (x, y) not in cells, f"{name}: {p['title']} overlaps another panel"
                    cells.add((x, y))


def test_every_reference_resolves_and_every_query_filters():
    builtins = {"__rate_interval", "__range", "__interval", "__all"}
    for name, dash in committed().items():
        defined = set(variables(dash)) | builtins
        text = json.dumps(dash)
        used = set(re.findall(r"\$\{?(\w+)", text))
        assert used <= defined, f"{name}: unresolved variables {used - defined}"
        queries = [(p["title"], t) for p in panels(dash) for t in p["targets"]]
        queries += [(a["name"], a) for a in dash["annotations"]["list"]]
        assert len(dash["annotations"]["list"]) >= 2
        for panel in panels(dash):
            where = f"{name}: {panel['title']}"
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
            assert panel["targets"] and len(panel.get("description", "")) > 40, where
            if panel["type"] in ("timeseries", "stat"):
                assert panel["fieldConfig"]["defaults"].get("unit"), f"{where}: no unit"
        for where, target in queries:
            expr = target["expr"]
            assert expr and target["datasource"]["uid"] == "${datasource}", where
            # Every selector filters by job and node; the per-rank series (and the GPUs) by rank too.
            for metric, matchers in re.findall(r"(trainwatch_\w+)\{([^}]*)\}", expr):
                assert 'trainwatch_job=~"$job"' in matchers, (where, metric)
                if metric.startswith("trainwatch_job_"):
                    continue  # a job aggregate: one set of series per job, no node or rank
                assert 'node=~"$node"' in matchers, (where, metric)
                if metric in PER_RANK or metric.startswith("trainwatch_gpu_"):
                    assert 'rank=~"$rank"' in matchers, (where, metric)
                else:
                    assert metric.startswith(("trainwatch_node_", "trainwatch_incident", "trainwatch_restarts",
                                              "trainwatch_phase_seconds", "trainwatch_step_duration",
                                              "trainwatch_goodput", "trainwatch_badput")), (where, metric)
            assert not re.search(r"trainwatch_(?!job\b)\w+(?![\w{])", expr), f"{where}: unfiltered metric in {expr}"


def test_each_dashboard_covers_its_signals():
    d = committed()
    overview = d["trainwatch-overview.json"]
    for needle in ("rate(trainwatch_node_step{", "trainwatch_node_loss{", "topk(5, trainwatch_loss{",
                   "histogram_quantile(0.5,", "histogram_quantile(0.99,", "trainwatch_step_duration_seconds_bucket{",
                   "trainwatch_node_last_progress_age_seconds{", "trainwatch_incidents_total{",
                   "trainwatch_restarts_total{", "rate(trainwatch_phase_seconds_total{", "trainwatch_goodput_ratio{",
                   "trainwatch_badput_seconds_total{"):
        assert needle in exprs(overview), needle
    annotations = {a["name"]: a["expr"] for a in overview["annotations"]["list"]}
    assert "trainwatch_incidents_total" in annotations["Incidents"] and "trainwatch_restarts_total" in annotations["Restarts"]

    ranks = d["trainwatch-ranks.json"]
    heatmaps = [p for p in panels(ranks) if p["type"] == "heatmap"]
    assert {p["title"] for p in heatmaps} >= {"Step time of the slowest nodes", "Step duration distribution"}
    assert "trainwatch_straggler_slowdown_ratio{" in exprs(ranks)
    assert any(p["type"] == "table" and "topk(" in p["targets"][0]["expr"] for p in panels(ranks))

    coll = d["trainwatch-collectives.json"]
    for needle in ('state="enqueued"', 'state="completed"', "max by (trainwatch_job, pg)", "min by (trainwatch_job, pg)"):
        assert needle in exprs(coll), needle

    gpu = d["trainwatch-gpu.json"]
    assert "gpu" in variables(gpu)
    for metric in ("utilization_ratio", "memory_used_bytes", "memory_total_bytes", "temperature_celsius", "power_watts",
                   "sm_clock_hertz", "throttle", "xid_errors_total", "xid_code_errors_total", "ecc_errors_total"):
        assert f'trainwatch_gpu_{metric}{{trainwatch_job=~"$job",node=~"$node",rank=~"$rank",gpu=~"$gpu"' in exprs(gpu), metric

    # Thresholds drawn where the alerts fire.
    def threshold_of(dash, title):
        [panel] = [p for p in panels(dash) if p["title"] == title]
        return panel["fieldConfig"]["defaults"]["thresholds"]["steps"][-1]["value"]

    assert threshold_of(overview, "Last progress age") == STALL_SECONDS
    assert threshold_of(ranks, "Straggler slowdown ratio") == STRAGGLER_RATIO
    rules = {r["alert"]: r["expr"] for r in alert_rules()}
    from trainwatch.watchdog.detectors.straggler import StragglerConfig

    # The straggler alert pages on the open incident; the ratio line is the detector's own.
    assert f"> {STALL_SECONDS}" in rules["TrainwatchRankStalled"] and StragglerConfig().ratio == STRAGGLER_RATIO


def test_default_panels_draw_a_bounded_number_of_lines():
    """No panel draws a line per rank or per node: every selector sits under an
    aggregation by job (or job and a small label), a topk/bottomk, or a count."""
    bounded = re.compile(r"^(histogram_quantile\([\d.]+, )?\(?(topk|bottomk)\(\d+,"
                         r"|^(histogram_quantile\([\d.]+, )?\(?(sum|min|max|count|quantile) by \(trainwatch_job(, (le|kind|pg|phase|reason|cause))?\)"
                         r"|^count\(count by \(pg\)|^max\(max by \(trainwatch_job, pg\)|^max\(trainwatch_node_"
                         r"|^trainwatch_job_")
    for name, dash in committed().items():
        for panel in panels(dash):
            for target in panel["targets"]:
                expr = target["expr"]
                if panel["type"] == "heatmap" and expr.startswith("sum by (le)"):
                    continue  # one histogram: its buckets, not ranks
                assert bounded.search(expr), f"{name}: {panel['title']}: unbounded {expr}"
                legend = target.get("legendFormat", "")
                assert not legend or "{{trainwatch_job}}" in legend, f"{name}: {panel['title']}: legend without the job"




# ---- Grafana provisioning ----------------------------------------------------------------


def test_provisioning_points_grafana_at_the_dashboards():
    ds = yaml.safe_load((OUT / "provisioning/datasources/trainwatch.yaml").read_text())
    [source] = ds["datasources"]
    assert ds["apiVersion"] == 1 and source["type"] == "prometheus" and source["uid"] == DATASOURCE_UID
    assert source["url"].startswith("http://127.0.0.1:")
    prov = yaml.safe_load((OUT / "provisioning/dashboards/trainwatch.yaml").read_text())
    [provider] = prov["providers"]
    assert provider["type"] == "file" and provider["options"]["path"] == "${TRAINWATCH_DASHBOARDS}"
    # Every dashboard's datasource variable defaults to the provisioned uid.
    for dash in committed().values():
        assert variables(dash)["datasource"]["current"]["value"] == source["uid"]


# ---- alert rules ---------------------------------------------------------------------


def test_alerts_cover_the_failure_modes_and_name_their_runbooks():
    rules = alert_rules()
    names = {r["alert"] for r in rules}
    assert REQUIRED_ALERTS <= names
    for rule in rules:
        ann = rule["annotations"]
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert ann["summary"] and ann["action"], rule["alert"]
        if "{{" in ann["runbook"]:  # templated from the incident kind
            kinds = re.search(r'kind=~"([^"]+)"', rule["expr"]).group(1).split("|")
            ids = [k.replace("_", "-") for k in kinds]
        else:
            ids = [ann["runbook"]]
            assert ann["runbook_url"] == f"{alerts.DEFAULT_RUNBOOK_BASE_URL}{ann['runbook']}.md", rule["alert"]
        for rid in ids:
            assert get_runbook(rid).startswith("# "), (rule["alert"], rid)
            assert (ROOT / "runbooks" / f"{rid}.md").is_file(), rid


def test_every_alert_has_a_firing_unit_test():
    tests = yaml.safe_load((OUT / "alert-rules.test.yml").read_text())
    assert tests["rule_files"] == ["alert-rules.yml"]
    firing = {case["alertname"] for t in tests["tests"] for case in t["alert_rule_test"] if case.get("exp_alerts")}
    quiet = {case["alertname"] for t in tests["tests"] for case in t["alert_rule_test"] if not case.get("exp_alerts")}
    names = {r["alert"] for r in alert_rules()}
    assert names <= firing, f"alerts with no firing test: {names - firing}"
    assert REQUIRED_ALERTS - {"TrainwatchGpuEccUncorrected", "TrainwatchRestartLoop"} <= quiet  # and a not-yet case


def test_every_incident_kind_alerts_as_kinds_py_declares():
    """Each kind of kinds.KINDS is alerted by one rule on trainwatch_incident_open
    (or by the rule of its own series it names: GPU faults page on their per-GPU
    counters, which name the Xid), with the severity label of its page or ticket;
    every fault that restarts the job pages, a crash as a hang."""
    paged: dict[str, list[str]] = {}
    for rule in alert_rules():
        if "trainwatch_incident_open" not in rule["expr"]:
            continue
        for m in re.finditer(r'kind=~?"([^"]+)"', rule["expr"]):
            for kind in m.group(1).split("|"):
                paged.setdefault(kind, []).append(rule["labels"]["severity"])
    severity = {r["alert"]: r["labels"]["severity"] for r in alert_rules()}
    assert set(paged) <= set(kinds.KINDS), set(paged) - set(kinds.KINDS)
    for name, spec in kinds.KINDS.items():
        if spec.alert_rule:
            assert name not in paged and severity[spec.alert_rule] == spec.alert.value, name
        else:
            assert paged.get(name) == [spec.alert.value], (name, paged.get(name))
        if spec.response is kinds.Response.RESTART:
            assert spec.alert is kinds.Alert.PAGE, name
    assert paged["crash"] == paged["hang"] == ["critical"]


def test_the_test_file_reads_back_as_generated():
    """The hand-rolled YAML of alert-rules.test.yml says exactly what the generator meant."""
    assert yaml.safe_load(alerttests.render_tests()) == alerttests.document()
    rules = yaml.safe_load(alerts.render_rules())["groups"][0]["rules"]
    assert [r["alert"] for r in rules] == [r.alert for r in alerts.rules()]
    for got, want in zip(rules, alerts.rules()):
        assert got["expr"].strip() == want.expr and got.get("for", "") == want.for_, want.alert
        assert got["labels"] == {"severity": want.severity}
        assert got["annotations"]["summary"] == want.summary and got["annotations"]["runbook"] == want.runbook


def test_for_durations_are_written_as_one_number_and_unit():
    """Other tools rewrite `for:` with a regex to run a faster copy of the rules."""
    text = (OUT / "alert-rules.yml").read_text()
    fors = re.findall(r"^ +for: (.*)$", text, flags=re.MULTILINE)
    assert fors and all(re.fullmatch(r"\d+[smh]", f) for f in fors), fors


def _new_kind(monkeypatch, spec):
    monkeypatch.setattr(kinds, "KINDS", {**kinds.KINDS, spec.name: spec})


@needs_promtool
def test_a_new_kind_is_alerted_and_tested_without_touching_the_rules(monkeypatch, tmp_path):
    """Adding a kind to kinds.py is enough: the shared rule of its urgency pages on it and the
    promtool tests open one and expect it, with its severity and runbook."""
    _new_kind(monkeypatch, kinds.KindSpec("disk_full", "high", "disk-full", kinds.Response.ALERT,
                                          kinds.Resolution.ABSENCE, kinds.Alert.PAGE))
    files = dashboards.rendered()
    incident = next(r for r in alerts.rules() if r.alert == "TrainwatchIncident")
    assert alerts.kinds_of(incident) == ["crash", "disk_full"] and incident.severity == "critical"
    assert 'kind="disk_full",severity="high"' in files["alert-rules.test.yml"]
    assert "runbooks/disk-full.md" in files["alert-rules.test.yml"]
    for name in ("alert-rules.yml", "alert-rules.test.yml"):
        (tmp_path / name).write_text(files[name])
    r = subprocess.run([PROMTOOL, "test", "rules", str(tmp_path / "alert-rules.test.yml")], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_generator_names_what_kinds_py_and_the_rules_disagree_on(monkeypatch):
    _new_kind(monkeypatch, kinds.KindSpec("fan_stopped", "high", "gpu-fan", kinds.Response.ALERT,
                                          kinds.Resolution.ABSENCE, kinds.Alert.TICKET))
    with pytest.raises(ValueError, match="fan_stopped.*INCIDENT_RULES"):
        alerts.rules()
    _new_kind(monkeypatch, kinds.KindSpec("fan_stopped", "high", "gpu-fan", kinds.Response.ALERT,
                                          kinds.Resolution.ABSENCE, kinds.Alert.TICKET, alert_rule="TrainwatchFan"))
    with pytest.raises(ValueError, match="TrainwatchFan.*SIGNAL_RULES"):
        alerts.rules()


def _born_above_zero(values: str) -> bool:
    """A promtool series that is missing at first and whose first sample is above 0."""
    tokens = values.split()
    if len(tokens) < 2 or not tokens[0].startswith("_"):
        return False
    return float(re.split(r"[x+-]", tokens[1], maxsplit=1)[0]) > 0


def test_every_counter_alert_is_tested_on_a_series_born_above_zero():
    """increase()/rate() see nothing on a series whose first sample already
    holds the event; every alert that reads a counter that way must have a
    firing promtool case on such a series (its values start with `_`)."""
    tests = yaml.safe_load((OUT / "alert-rules.test.yml").read_text())
    missing = []
    for rule in alert_rules():
        counters = set(re.findall(r"(?:increase|rate)\((\w+)", rule["expr"]))
        if not counters:
            continue
        covered = False
        for group in tests["tests"]:
            born = {s["series"].split("{")[0] for s in group["input_series"] if _born_above_zero(str(s["values"]))}
            fires = any(c["alertname"] == rule["alert"] and c.get("exp_alerts") for c in group["alert_rule_test"])
            covered |= bool(counters & born) and fires
        if not covered:
            missing.append(rule["alert"])
    assert not missing, f"counter alerts with no firing case on a series first scraped above 0: {missing}"


def test_panels_count_a_first_event_that_was_never_scraped_at_zero():
    """Every panel that counts events with increase() also counts a series that
    is new in the window (the `unless ... offset` term of `events()`)."""
    for name, dash in committed().items():
        for p in panels(dash):
            for t in p["targets"]:
                expr = t["expr"]
                for counter in re.findall(r"increase\((trainwatch_(?:incidents|gpu_xid_errors|gpu_ecc_errors|restarts)_total)", expr):
                    assert f"unless {counter}" in expr, (name, p["title"], expr)


@needs_promtool
def test_promtool_check_and_test_rules():
    rules = subprocess.run([PROMTOOL, "check", "rules", str(OUT / "alert-rules.yml")], capture_output=True, text=True)
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in rules.stdout
    config = subprocess.run([PROMTOOL, "check", "config", str(OUT / "prometheus.yml")], capture_output=True, text=True)
    assert config.returncode == 0, config.stdout + config.stderr
    unit = subprocess.run([PROMTOOL, "test", "rules", str(OUT / "alert-rules.test.yml")], capture_output=True, text=True)
    assert unit.returncode == 0 and "SUCCESS" in unit.stdout, unit.stdout + unit.stderr


@needs_promtool
def test_promtool_catches_a_broken_alert(tmp_path):
    """The unit tests have teeth: a rule whose threshold drifts fails them."""
    shutil.copy(OUT / "alert-rules.test.yml", tmp_path / "alert-rules.test.yml")
    text = (OUT / "alert-rules.yml").read_text().replace('trainwatch_incident_open{kind="straggler"}) > 0\n        for: 5m',
                                                         'trainwatch_incident_open{kind="straggler"}) > 0\n        for: 10m')
    (tmp_path / "alert-rules.yml").write_text(text)
    r = subprocess.run([PROMTOOL, "test", "rules", str(tmp_path / "alert-rules.test.yml")], capture_output=True, text=True)
    assert r.returncode != 0 and "TrainwatchStraggler" in r.stdout + r.stderr


# ---- end to end: a real job, a real Prometheus ---------------------------------------------

JOB = "dash-e2e"
CULPRIT_SLOW, CULPRIT_HUNG = 2, 1
STEPS = 90

# Panel targets that may stay empty in this run, and why. Everything else must
# return data: the run below produces every other signal the dashboards show.
EMPTY_OK = {
    "Nodes with a stalled rank": "no rank stays 60 s without a step: the hang is detected and restarted in seconds",
    "Loss scale": "the trainer runs without a GradScaler here (only its scale_collapse fault turns one on)",
    "Loss trend slope": "90 steps are fewer than the loss trend window needs for a fit",
}


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    """The shipped prometheus.yml and alert-rules.yml run by a real Prometheus
    on 127.0.0.1, set up as README.md says: `targets/` linked to the directory
    `trainwatch launch` writes its file_sd targets into. Only the intervals
    change (15 s -> 1 s) so the test is quick. Yields (url, TRAINWATCH_HOME)."""
    home = tmp_path_factory.mktemp("twhome")
    cfg_dir = tmp_path_factory.mktemp("prometheus")
    config = (OUT / "prometheus.yml").read_text()
    config, n = re.subn(r"(scrape_interval|evaluation_interval): 15s", r"\1: 1s", config)
    assert n == 2, "prometheus.yml no longer sets both intervals to 15s; update this test"
    shutil.copy(OUT / "alert-rules.yml", cfg_dir / "alert-rules.yml")
    (home / "targets").mkdir(mode=0o700)
    (cfg_dir / "targets").symlink_to(home / "targets")
    with prometheus_server(cfg_dir, config) as url:
        yield url, home


def promql(url: str, expr: str, **params) -> dict:
    path = "query_range" if "start" in params else "query"
    r = requests.get(f"{url}/api/v1/{path}", params={"query": expr, **params}, timeout=30)
    body = r.json()
    assert body["status"] == "success", f"{expr}: {body.get('errorType')}: {body.get('error')}"
    return body["data"]


@pytest.fixture(scope="module")
def finished_run(prometheus):
    """A real 4-rank `trainwatch launch` of the integrated trainer, scraped by
    the Prometheus above from the moment it starts: rank 2 straggles from step
    5, rank 1's DataLoader hangs at step 30 (detected, checkpointed, restarted),
    and an Xid 13 lands on rank 3's (fake) GPU. Yields (url, start, end)."""
    url, home = prometheus
    log_path = home.parent / "dash-e2e-launch.log"
    klog = home / "kern.log"
    klog.write_text("")
    start = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [str(BIN / "trainwatch"), "launch", "--nproc-per-node", "4", "--job", JOB, "--kernel-log", str(klog),
             "--inject", f"straggler:delay=0.25,rank={CULPRIT_SLOW},step=5",
             "--inject", f"hang:where=dataloader,rank={CULPRIT_HUNG},step=30",
             # Brings the fake GPUs (NVML is a hardware boundary); the Xid itself is
             # written below, once Prometheus holds the GPU's Xid counter at 0.
             "--inject", "xid:code=13,rank=3,step=1000000000",
             "-m", "trainwatch.trainer", "--model-size", "tiny", "--max-steps", str(STEPS), "--log-interval", "1000"],
            env=env_for(home), stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT), start_new_session=True,
        )
    try:
        # The launcher lists its exporter for file_sd while it runs ...
        target = wait_for(lambda: list((home / "targets").glob(f"{JOB}@*.json")), 120, interval=0.2,
                          what="the job's file_sd target")[0]
        listed = json.loads(target.read_text())
        assert listed[0]["targets"] == [job_json(home, JOB)["metrics"]]
        assert listed[0]["labels"]["trainwatch_job"] == JOB

        def scraped():
            targets = requests.get(f"{url}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
            return any(t["health"] == "up" and t["labels"].get("trainwatch_job") == JOB for t in targets)

        wait_for(scraped, 60, interval=0.5, what="Prometheus to scrape the job through file_sd")

        # An Xid 13 on rank 3's GPU, after Prometheus has scraped that GPU's
        # Xid counter at 0: the dashboards must count this first event.
        def xid_counter_at_zero():
            body = requests.get(f"{url}/api/v1/query", timeout=10, params={
                "query": f'trainwatch_gpu_xid_errors_total{{trainwatch_job="{JOB}",gpu="3"}} == 0'}).json()
            return body["data"]["result"]

        wait_for(xid_counter_at_zero, 60, interval=0.2, what="Prometheus to hold GPU 3's Xid counter at 0")
        assert proc.poll() is None, "the job ended before the Xid could be injected"
        bus = normalize_pci(FakeNvml(gpu_count=4).gpus[3].bus_id).rsplit(".", 1)[0]
        with open(klog, "a") as f:
            f.write(f"[{time.monotonic():12.6f}] NVRM: Xid (PCI:{bus}): 13, pid=1, name=python, "
                    "Graphics Exception: ESR 0x404600=0x80000002\n")
        code = proc.wait(timeout=420)
    finally:
        stop_group(proc)
    assert code == 0, log_path.read_text()[-4000:]
    # ... and removes it when it ends.
    assert not list((home / "targets").glob(f"{JOB}@*.json"))
    kinds = [e.kind for e in events(home, JOB)]
    assert {"straggler", "hang", "restart"} <= set(kinds), kinds
    assert job_json(home, JOB)["restarts"] == 1
    end = time.time() + 2
    yield url, start, end


VALUES = {"job": JOB, "node": ".*", "rank": ".*", "gpu": ".*", "__rate_interval": "4s", "__range": "10m",
          "__interval": "1s"}


def substitute(expr: str) -> str:
    """Grafana's variable interpolation, for the variables these dashboards use."""

    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name not in VALUES:
            raise AssertionError(f"unknown template variable ${name} in {expr}")
        return VALUES[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, expr)


def all_queries() -> list[tuple[str, str, str, bool]]:
    """(dashboard, panel or annotation, PromQL, instant) for every query of every dashboard."""
    out = []
    for name, dash in committed().items():
        for p in panels(dash):
            for t in p["targets"]:
                out.append((name, p["title"], substitute(t["expr"]), bool(t.get("instant"))))
        for a in dash["annotations"]["list"]:
            out.append((name, f"annotation {a['name']}", substitute(a["expr"]), False))
    return out


@pytest.mark.slow
def test_every_panel_query_runs_on_prometheus_and_returns_the_run(finished_run):
    url, start, end = finished_run
    results: dict[tuple[str, str, str], int] = {}
    for dash, title, expr, _instant in all_queries():
        # Over the whole run, as Grafana draws a graph: every expression must
        # parse and evaluate; each whose signal the run produced has data.
        data = promql(url, expr, start=start, end=end, step=1)
        results[(dash, title, expr)] = len(data["result"])
    empty = [(d, t, e) for (d, t, e), n in results.items() if n == 0 and t not in EMPTY_OK]
    summary = {"dashboards": len(DASHBOARDS), "queries": len(results), "with_data": sum(1 for n in results.values() if n)}
    print(f"\npanel queries: {json.dumps(summary)}")
    assert not empty, "no data for:\n" + "\n".join(f"{d}: {t}: {e}" for d, t, e in empty)


@pytest.mark.slow
def test_panels_show_the_injected_faults(finished_run):
    url, start, end = finished_run
    window = {"start": start, "end": end, "step": 1}

    def peak_by(expr: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for series in promql(url, substitute(expr), **window)["result"]:
            out[series["metric"].get(label, "")] = max(float(v) for _, v in series["values"])
        return out

    ratios = peak_by('trainwatch_straggler_slowdown_ratio{trainwatch_job=~"$job"}', "rank")
    assert max(ratios, key=ratios.get) == str(CULPRIT_SLOW) and ratios[str(CULPRIT_SLOW)] >= STRAGGLER_RATIO, ratios
    ages = peak_by('trainwatch_last_progress_age_seconds{trainwatch_job=~"$job"}', "rank")
    assert ages[str(CULPRIT_HUNG)] >= 4, ages
    incidents = peak_by('sum by (kind) (trainwatch_incidents_total{trainwatch_job=~"$job"})', "kind")
    assert incidents["hang"] >= 1 and incidents["straggler"] >= 1, incidents
    assert "restart" not in incidents, incidents  # a restart is an action of the hang, not an incident
    assert peak_by('max(trainwatch_restarts_total{trainwatch_job=~"$job"})', "") == {"": 1.0}
    xids = peak_by('trainwatch_gpu_xid_code_errors_total{trainwatch_job=~"$job"}', "xid")
    assert xids == {"13": 1.0}
    # increase() extrapolates to the window's edges: about 1, not exactly. With few
    # samples after the counter moved (a short run) the factor nears 2; one event
    # (the per-code peak above) never reads as 3.
    assert 0.9 <= peak_by('sum(increase(trainwatch_gpu_xid_errors_total{trainwatch_job=~"$job"}[10m]))', "")[""] < 2.5
    # The annotation markers land on the hang's restart.
    marks = promql(url, substitute('sum by (trainwatch_job, node) (changes(trainwatch_restarts_total{trainwatch_job=~"$job",node=~"$node"}[1m])) > 0'), **window)
    assert marks["result"]


@pytest.mark.slow
def test_alerts_fired_during_the_run(finished_run, prometheus):
    url, start, end = finished_run
    home = prometheus[1]
    fired = promql(url, f'ALERTS{{trainwatch_job="{JOB}",alertstate="firing"}}', start=start, end=end, step=1)["result"]
    names = {s["metric"]["alertname"] for s in fired}
    assert "TrainwatchJobHung" in names, names
    assert "TrainwatchGpuXid" in names, names  # Xid 13 is not critical: a warning
    # The hang the job recovered from in seconds stops paging within a rule
    # interval or two (1 s here) of its resolution, not minutes later.
    [hang] = [e for e in events(home, JOB) if e.kind == "hang"]
    hung = [s for s in fired if s["metric"]["alertname"] == "TrainwatchJobHung"]
    last_firing = max(float(t) for s in hung for t, _ in s["values"])
    assert hang.status == "resolved" and last_firing <= hang.resolution.time + 5.0, (
        last_firing - hang.resolution.time)
    groups = requests.get(f"{url}/api/v1/rules", timeout=10).json()["data"]["groups"]
    rules = [rule for g in groups for rule in g["rules"]]
    assert len(rules) == len(alert_rules())
    assert all(rule["health"] == "ok" for rule in rules), [(r["name"], r.get("lastError")) for r in rules]


@pytest.mark.slow
def test_template_variables_list_the_run(finished_run):
    url, start, end = finished_run
    for name, dash in committed().items():
        for var in variables(dash).values():
            if var["type"] != "query":
                continue
            m = re.fullmatch(r"label_values\((.+), (\w+)\)", var["query"])
            assert m, var["query"]
            selector, label = substitute(m.group(1)), m.group(2)
            r = requests.get(f"{url}/api/v1/series", params={"match[]": selector, "start": start, "end": end},
                             timeout=10).json()
            assert r["status"] == "success", (name, var["name"], r)
            found = {s[label] for s in r["data"] if label in s}
            expected = {"trainwatch_job": {JOB}, "rank": {"0", "1", "2", "3"}, "gpu": {"0", "1", "2", "3"}}.get(label)
            if expected is not None:
                assert found == expected, (name, var["name"], found)
            else:
                assert len(found) == 1, (name, var["name"], found)
