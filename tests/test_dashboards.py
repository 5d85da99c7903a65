"""The generated Grafana dashboards and the Prometheus config, checked against
the real thing: promtool for the config and alert rules, and a real Prometheus
scraping a real `trainwatch launch` for every panel's PromQL."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import socket
import subprocess
import sys

import pytest
import requests

from util import ROOT, running_plain_job, wait_for

DASHBOARDS = ROOT / "dashboards"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package `prometheus`)")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (Debian package `prometheus`)")

TEMPLATE_VARS = ("job", "node", "rank")


def load_build():
    spec = importlib.util.spec_from_file_location("dashboards_build", DASHBOARDS / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def committed() -> dict[str, dict]:
    return {name: json.loads((DASHBOARDS / name).read_text()) for name in load_build().DASHBOARDS}


def panels(dash: dict) -> list[dict]:
    """Query panels (rows carry no queries)."""
    return [p for p in dash["panels"] if p["type"] != "row"]


def variables(dash: dict) -> dict[str, dict]:
    return {v["name"]: v for v in dash["templating"]["list"]}


# ---- the generated JSON -------------------------------------------------------------


def test_committed_json_is_what_build_generates():
    for name, text in load_build().rendered().items():
        assert (DASHBOARDS / name).read_text() == text, f"{name} is stale; run: python dashboards/build.py"


def test_check_flag_reports_stale_json(tmp_path):
    ok = subprocess.run([sys.executable, str(DASHBOARDS / "build.py"), "--check"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    subprocess.run([sys.executable, str(DASHBOARDS / "build.py"), "--out", str(tmp_path)], check=True, capture_output=True)
    edited = tmp_path / "trainwatch-gpu.json"
    edited.write_text(edited.read_text().replace("Utilization", "Utilisation"))
    stale = subprocess.run(
        [sys.executable, str(DASHBOARDS / "build.py"), "--check", "--out", str(tmp_path)], capture_output=True, text=True
    )
    assert stale.returncode == 1
    assert "trainwatch-gpu.json" in stale.stderr and "trainwatch-training.json" not in stale.stderr


def test_every_panel_queries_prometheus_through_the_template_variables():
    for name, dash in committed().items():
        assert dash["uid"] and dash["title"] and "trainwatch" in dash["tags"]
        found = variables(dash)
        assert found["datasource"]["type"] == "datasource" and found["datasource"]["query"] == "prometheus"
        for var in TEMPLATE_VARS:
            assert found[var]["type"] == "query" and "label_values(" in found[var]["query"], (name, var)
            assert found[var]["datasource"]["uid"] == "${datasource}"
        ids = [p["id"] for p in dash["panels"]]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        assert len(panels(dash)) >= 8
        for panel in panels(dash):
            where = f"{name}: {panel['title']}"
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
            assert panel["targets"], where
            assert panel.get("description"), where
            for target in panel["targets"]:
                expr = target["expr"]
                assert expr and target["refId"], where
                assert target["datasource"]["uid"] == "${datasource}", where
                # Every selector in the query filters by job and node; those
                # with a rank label by rank too.
                for selector in re.findall(r"(trainwatch_\w+)\{([^}]*)\}", expr):
                    metric, matchers = selector
                    assert 'job=~"$job"' in matchers and 'node=~"$node"' in matchers, (where, metric)
                    if not metric.startswith(("trainwatch_incidents", "trainwatch_restarts")):
                        assert 'rank=~"$rank"' in matchers, (where, metric)
                assert not re.search(r"trainwatch_\w+(?![\w{])", expr), f"{where}: unfiltered metric in {expr}"


def test_training_dashboard_covers_the_design_metrics():
    dash = committed()["trainwatch-training.json"]
    exprs = " ".join(t["expr"] for p in panels(dash) for t in p["targets"])
    for needle in (
        "rate(trainwatch_step{",
        "trainwatch_loss{",
        "trainwatch_grad_norm{",
        "histogram_quantile(0.5,",
        "histogram_quantile(0.99,",
        "trainwatch_step_duration_seconds_bucket{",
        "trainwatch_last_progress_age_seconds{",
        "trainwatch_straggler_slowdown_ratio{",
        'state="enqueued"',
        'state="completed"',
        "trainwatch_phase{",
        "increase(trainwatch_incidents_total{",
        "trainwatch_restarts_total{",
    ):
        assert needle in exprs, needle
    assert any(p["type"] == "table" for p in panels(dash))


def test_gpu_dashboard_covers_every_gpu_metric():
    dash = committed()["trainwatch-gpu.json"]
    assert "gpu" in variables(dash)
    exprs = " ".join(t["expr"] for p in panels(dash) for t in p["targets"])
    for metric in (
        "utilization_ratio", "memory_used_bytes", "memory_total_bytes", "temperature_celsius", "power_watts",
        "sm_clock_hertz", "throttle", "xid_errors_total", "ecc_errors_total",
    ):
        assert f"trainwatch_gpu_{metric}{{" in exprs, metric
        assert f'trainwatch_gpu_{metric}{{job=~"$job",node=~"$node",rank=~"$rank",gpu=~"$gpu"' in exprs, metric


# ---- promtool: config and alert rules -------------------------------------------------


@needs_promtool
def test_promtool_accepts_config_and_rules():
    rules = subprocess.run([PROMTOOL, "check", "rules", str(DASHBOARDS / "alerts.yml")], capture_output=True, text=True)
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert "SUCCESS: 7 rules found" in rules.stdout
    config = subprocess.run([PROMTOOL, "check", "config", str(DASHBOARDS / "prometheus.yml")], capture_output=True, text=True)
    assert config.returncode == 0, config.stdout + config.stderr
    assert "SUCCESS: 1 rule files found" in config.stdout + config.stderr


def _alert(labels: dict, summary: str, action: str = "trainwatch diagnose j") -> dict:
    return {"exp_labels": labels, "exp_annotations": {"summary": summary, "action": action}}


def _case(t: str, name: str, *alerts: dict) -> dict:
    return {"eval_time": t, "alertname": name, "exp_alerts": list(alerts)}


@needs_promtool
def test_alert_rules_fire_when_they_should(tmp_path):
    # promtool's rule unit tests: synthetic series at 15 s steps, expected
    # alerts at given times. JSON is YAML, so no YAML library is needed.
    n = {"job": "j", "node": "n"}
    series = {
        'trainwatch_last_progress_age_seconds{job="j",node="n",rank="0"}': "1x80",  # healthy
        'trainwatch_last_progress_age_seconds{job="j",node="n",rank="1"}': "0+15x80",  # hung
        'trainwatch_last_progress_age_seconds{job="j",node="n",rank="2"}': "0+15x80",  # long checkpoint
        'trainwatch_phase{job="j",node="n",rank="1",phase="backward"}': "1x80",
        'trainwatch_phase{job="j",node="n",rank="2",phase="checkpoint"}': "1x80",
        'trainwatch_incidents_total{job="j",node="n",kind="hang"}': "_x8 1x40",  # first incident at 2m
        'trainwatch_restarts_total{job="j",node="n"}': "0 0 1 1 2 2 3 3 3 3",
        'trainwatch_restarts_total{job="calm",node="n"}': "0 0 1 1 2 2 2 2 2 2",
        'trainwatch_straggler_slowdown_ratio{job="j",node="n",rank="3"}': "2x40",
        'trainwatch_straggler_slowdown_ratio{job="j",node="n",rank="4"}': "1.2x40",
        'trainwatch_gpu_xid_errors_total{job="j",node="n",gpu="0",rank="0"}': "0x10 1x30",
        'trainwatch_gpu_ecc_errors_total{job="j",node="n",gpu="1",rank="1",type="uncorrected"}': "_x4 2x30",
        'trainwatch_gpu_ecc_errors_total{job="j",node="n",gpu="1",rank="1",type="corrected"}': "0+5x30",
        'up{job="trainwatch",instance="127.0.0.1:9"}': "0x40",
    }
    stalled = "trainwatch job j: rank {} on n has made no progress"
    cases = [
        _case("3m", "TrainwatchRankStalled", _alert({**n, "rank": "1", "severity": "critical"}, stalled.format(1))),
        _case(
            "17m", "TrainwatchRankStalled",
            _alert({**n, "rank": "1", "severity": "critical"}, stalled.format(1)),
            _alert({**n, "rank": "2", "severity": "critical"}, stalled.format(2)),
        ),
        _case("1m", "TrainwatchIncident"),
        _case("2m15s", "TrainwatchIncident", _alert({**n, "kind": "hang", "severity": "warning"}, "trainwatch job j on n: hang incident")),
        _case("9m", "TrainwatchIncident"),  # old news: no longer paging
        _case("2m15s", "TrainwatchRestartsFlapping", _alert({**n, "severity": "critical"}, "trainwatch job j on n restarted 3 or more times in 30 minutes")),
        _case("4m", "TrainwatchStraggler"),
        _case("6m", "TrainwatchStraggler", _alert({**n, "rank": "3", "severity": "warning"}, "trainwatch job j: rank 3 on n is a straggler")),
        _case("3m", "TrainwatchGpuXid", _alert({**n, "gpu": "0", "rank": "0", "severity": "critical"}, "trainwatch job j: XID error on n GPU 0")),
        _case(
            "1m15s", "TrainwatchGpuEccUncorrected",
            _alert({**n, "gpu": "1", "rank": "1", "type": "uncorrected", "severity": "critical"}, "trainwatch job j: uncorrected ECC error on n GPU 1"),
        ),
        _case(
            "6m", "TrainwatchExporterDown",
            _alert({"job": "trainwatch", "instance": "127.0.0.1:9", "severity": "warning"}, "trainwatch exporter 127.0.0.1:9 is down",
                   "check the job's node; `trainwatch jobs` lists its status"),
        ),
    ]
    spec = {
        "rule_files": [str(DASHBOARDS / "alerts.yml")],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": [{"series": s, "values": v} for s, v in series.items()],
                "alert_rule_test": cases,
            }
        ],
    }
    path = tmp_path / "alerts_test.yml"
    path.write_text(json.dumps(spec, indent=1))
    r = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# ---- end to end: a real job, a real Prometheus --------------------------------------------

JOB = "dash-e2e"

# Panels that must show data for a healthy 2-rank CPU job. The rest (stragglers,
# incidents, GPU) may be empty here but must still parse and evaluate.
MUST_HAVE_DATA = {
    "Ranks reporting", "Current step", "Worker group restarts", "Step rate", "Step", "Loss",
    "Step duration p50 / p99", "Last progress age", "Collective lag (enqueued - completed)",
    "Completed collectives spread across ranks", "Current phase per rank", "Restarts",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def live_job(tmp_path_factory):
    """A real 2-rank `trainwatch launch` of an unmodified DDP script; yields
    (TRAINWATCH_HOME, job.json) once the exporter address is recorded."""
    home = tmp_path_factory.mktemp("twhome")
    with running_plain_job(home, JOB) as job:
        yield home, job


@pytest.fixture(scope="module")
def prometheus(live_job, tmp_path_factory):
    """The committed prometheus.yml and alerts.yml, run by a real Prometheus on
    127.0.0.1 with the job found through file_sd, as README.md describes.
    Only the intervals change (15 s -> 1 s) so the test is quick."""
    if PROMETHEUS is None:
        pytest.skip("prometheus not installed (Debian package `prometheus`)")
    _home, job = live_job
    cfg_dir = tmp_path_factory.mktemp("prometheus")
    config = (DASHBOARDS / "prometheus.yml").read_text()
    config, n = re.subn(r"(scrape_interval|evaluation_interval): 15s", r"\1: 1s", config)
    assert n == 2, "prometheus.yml no longer sets both intervals to 15s; update this test"
    (cfg_dir / "prometheus.yml").write_text(config)
    shutil.copy(DASHBOARDS / "alerts.yml", cfg_dir / "alerts.yml")
    (cfg_dir / "targets").mkdir()
    (cfg_dir / "targets" / f"{JOB}.json").write_text(json.dumps([{"targets": [job["metrics"]]}]))
    port = free_port()
    log_path = cfg_dir / "prometheus.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={cfg_dir / 'prometheus.yml'}", f"--storage.tsdb.path={cfg_dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        def ready():
            if proc.poll() is not None:
                raise AssertionError(f"prometheus exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                return requests.get(f"{url}/-/ready", timeout=2).status_code == 200
            except requests.ConnectionError:
                return False

        wait_for(ready, 60, interval=0.2, what="prometheus to be ready")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def promql(url: str, expr: str) -> dict:
    r = requests.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert body["status"] == "success", f"{expr}: {body.get('errorType')}: {body.get('error')}"
    return body["data"]


def substitute(expr: str, values: dict[str, str]) -> str:
    """Grafana's variable interpolation, for the variables these dashboards use."""

    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise AssertionError(f"unknown template variable ${name} in {expr}")
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, expr)


VALUES = {"job": JOB, "node": ".*", "rank": ".*", "gpu": ".*", "__rate_interval": "1m", "__range": "5m"}


def panel_queries(name: str) -> list[tuple[str, str]]:
    return [(p["title"], substitute(t["expr"], VALUES)) for p in panels(committed()[name]) for t in p["targets"]]


@pytest.mark.slow
@needs_prometheus
def test_training_panels_return_data_from_a_live_job(prometheus):
    queries = panel_queries("trainwatch-training.json")
    # rate() and the histogram need two scrapes and the collective counters
    # come from a background sampler: wait until every panel that should
    # have data has it, then check all of them.
    def all_present():
        return all(promql(prometheus, q)["result"] for title, q in queries if title in MUST_HAVE_DATA)

    wait_for(all_present, 90, interval=1, what="data for every training panel that should have it")
    for title, q in queries:
        result = promql(prometheus, q)["result"]
        if title in MUST_HAVE_DATA:
            assert result, f"{title}: no data for {q}"
    ranks = promql(prometheus, substitute('count by (job) (trainwatch_step{job=~"$job"})', VALUES))["result"]
    assert [r["metric"]["job"] for r in ranks] == [JOB] and ranks[0]["value"][1] == "2"
    rates = promql(prometheus, substitute('rate(trainwatch_step{job=~"$job"}[$__rate_interval])', VALUES))["result"]
    assert len(rates) == 2 and all(float(r["value"][1]) > 0 for r in rates)
    phases = promql(prometheus, substitute('trainwatch_phase{job=~"$job"} == 1', VALUES))["result"]
    assert sorted(r["metric"]["rank"] for r in phases) == ["0", "1"]


@pytest.mark.slow
@needs_prometheus
def test_gpu_panels_parse_and_evaluate(prometheus):
    # No GPU on a CPU box: the series may be absent, but every query must be
    # valid PromQL that Prometheus evaluates without error.
    for _title, q in panel_queries("trainwatch-gpu.json"):
        promql(prometheus, q)


@pytest.mark.slow
@needs_prometheus
def test_template_variables_list_the_live_job(prometheus):
    wait_for(lambda: promql(prometheus, f'trainwatch_step{{job="{JOB}"}}')["result"], 60, interval=0.5, what="trainwatch_step samples")
    for name, dash in committed().items():
        for var in variables(dash).values():
            if var["type"] != "query":
                continue
            m = re.fullmatch(r"label_values\((.+), (\w+)\)", var["query"])
            assert m, var["query"]
            selector, label = substitute(m.group(1), VALUES), m.group(2)
            r = requests.get(f"{prometheus}/api/v1/series", params={"match[]": selector}, timeout=10).json()
            assert r["status"] == "success", (name, var["name"], r)
            found = {s[label] for s in r["data"] if label in s}
            if var["name"] == "job":
                assert JOB in found
            elif var["name"] == "rank":
                assert found == {"0", "1"}
            elif var["name"] == "node":
                assert len(found) == 1


@pytest.mark.slow
@needs_prometheus
def test_alert_rules_load_and_evaluate_cleanly(prometheus):
    def evaluated():
        groups = requests.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
        rules = [rule for g in groups for rule in g["rules"]]
        return rules if rules and all(rule["health"] != "unknown" for rule in rules) else None

    rules = wait_for(evaluated, 30, interval=0.5, what="every alert rule to be evaluated")
    assert len(rules) == 7
    assert all(rule["health"] == "ok" for rule in rules), [(r["name"], r.get("lastError")) for r in rules]

    def scraped():
        targets = requests.get(f"{prometheus}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
        return [t["health"] for t in targets] == ["up"]

    wait_for(scraped, 30, interval=0.5, what="the job's exporter to be scraped (target up)")
