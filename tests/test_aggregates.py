"""Bounded metrics: a scrape's size grows with the ranks only through the
handful of per-rank drill-down series, and not at all below `rank` detail;
the job-wide aggregator's series do not grow with the job."""

from __future__ import annotations

import io
import itertools
import os

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from trainwatch import slots, state
from trainwatch.watchdog.aggregates import PhaseClock, RANK_SIGNALS
from trainwatch.watchdog.exporter import TrainwatchCollector
from trainwatch.watchdog.sidecar import Sidecar

from slot_tables import make_table


_SEQ = itertools.count()


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINWATCH_HOME", str(tmp_path / "home"))
    return tmp_path


def scrape(tmp_path, n: int, detail: str, name: str = "agg") -> list:
    state.JobDir(name).create()
    path = str(tmp_path / f"{name}-{n}-{detail}-{next(_SEQ)}.slots")
    slots.create_segment(path, n)
    seg = slots.Segment(path)
    table = make_table(n, now=100.0, step=20)
    table["pid"] = os.getpid()
    table["loss"] = np.linspace(1.0, 2.0, n)
    np.frombuffer(seg.buf, dtype=slots.slot_dtype(), count=n, offset=slots.HEADER_SIZE)[:] = table
    sc = Sidecar(name, path, node="n0", out=io.StringIO(), clock=lambda: 101.0)
    sc.config.metrics_detail = detail
    sc.tick()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TrainwatchCollector(sc))
    seg.close()
    return [s for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples]


def test_per_rank_series_are_only_the_drill_down_handful(home):
    small, large = scrape(home, 8, "rank"), scrape(home, 64, "rank")
    ranked = {s.name for s in large if "rank" in s.labels and not s.name.startswith("trainwatch_gpu_")}
    assert ranked <= {"trainwatch_step", "trainwatch_last_progress_age_seconds", "trainwatch_step_time_seconds",
                      "trainwatch_loss", "trainwatch_straggler_slowdown_ratio"}
    assert len(large) - len(small) <= len(RANK_SIGNALS) * (64 - 8)
    assert all("job" not in s.labels and s.labels.get("trainwatch_job") == "agg" for s in large
               if s.name.startswith("trainwatch_") and not s.name.startswith("trainwatch_job_"))


def test_below_rank_detail_a_scrape_does_not_grow_with_ranks(home):
    for detail in ("node", "job"):
        assert len(scrape(home, 8, detail)) == len(scrape(home, 64, detail)), detail
    node = {(s.name, s.labels.get("stat")): s.value for s in scrape(home, 64, "node")}
    assert node[("trainwatch_node_loss", "min")] == 1.0 and node[("trainwatch_node_loss", "max")] == 2.0
    assert node[("trainwatch_node_step", "median")] == 20.0
    worst = {s.labels["signal"]: s.value for s in scrape(home, 64, "node") if s.name == "trainwatch_node_worst_rank"}
    assert worst["loss"] == 63.0  # the highest loss is the last rank's
    assert not any(s.name.startswith("trainwatch_node_") for s in scrape(home, 8, "job"))


def test_every_phase_has_a_counter_from_the_start():
    clock = PhaseClock()
    table = make_table(4, phase="data")
    table["phase"][0] = slots.PHASE_CODES["backward"]
    clock.observe(table, 10.0)
    clock.observe(table, 12.0)
    family = clock.family("j", "n0")
    seconds = {s.labels["phase"]: s.value for s in family.samples}
    assert set(seconds) == set(slots.PHASES)  # never appear or vanish as ranks change phase
    assert seconds["data"] == 6.0 and seconds["backward"] == 2.0 and seconds["checkpoint"] == 0.0


def test_a_detail_that_does_not_exist_is_a_launch_error():
    from trainwatch.launcher.options import LaunchError, parse

    with pytest.raises(LaunchError, match="--metrics-detail must be one of rank, node, job"):
        parse(["--metrics-detail", "pod", "tests/scripts/plain_ddp.py"])
    assert parse(["--metrics-detail", "job", "tests/scripts/plain_ddp.py"])[1].sidecar.metrics_detail == "job"
