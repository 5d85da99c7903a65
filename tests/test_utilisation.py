"""The GPU utilisation section of `trainwatch diagnose`: the low-utilisation
decision tree (pure), the sidecar's GPU snapshot from a fake NVML, and the
section in diagnose's report."""

from __future__ import annotations

import io
import json
import math
import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainwatch import kinds, liveness, state
from trainwatch.diagnostics import utilisation
from trainwatch.diagnostics.utilisation import gpu_utilisation, not_judged, samples_from_telemetry
from trainwatch.inject.fake_nvml import FakeNvml
from trainwatch.views import diagnose
from trainwatch.watchdog.hardware import HardwareMonitor
from trainwatch.watchdog.incident import Incident

GIB = 1024**3


def row(rank, step_s=1.0, compute_s=None, data=0.05, backward=0.3, optimizer=0.05, last_op="allreduce", **kw):
    """A rank that spent its step mostly computing; compute_s as the rank computes it by default
    (step time less backward and other waits on peers)."""
    times = {k: v for k, v in (("data", data), ("backward", backward), ("optimizer", optimizer)) if v is not None}
    r = {"rank": rank, "local_rank": rank, "node": "n", "pid": 100 + rank, "step": 20, "phase": "forward",
         "step_s": step_s, "compute_s": compute_s if compute_s is not None else step_s - (backward or 0.0),
         "phase_times": times, "py_collectives": 0,
         "groups": [{"pg": 0, "enqueued": 40, "completed": 40, "last_op": last_op}],
         "collectives": {"enqueued": 40, "completed": 40, "last_op": last_op}}
    r.update(kw)
    return r


@pytest.fixture
def fake_gpus(tmp_path, monkeypatch):
    """telemetry.json's GPU record for GPUs of the given busy percent and memory
    fraction, as the sidecar's hardware monitor samples them from a fake NVML."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    kernel_log = tmp_path / "kmsg"
    kernel_log.write_text("")

    def make(utils, mem=None, nvml=None):
        nvml = nvml or FakeNvml(gpu_count=len(utils))
        for gpu, util, frac in zip(nvml.gpus, utils, mem or [0.5] * len(utils)):
            gpu.utilization_pct = util
            gpu.memory_total_bytes = 80 * GIB
            gpu.memory_used_bytes = int(frac * 80 * GIB)
        monitor = HardwareMonitor(nproc=len(utils), kernel_log_path=str(kernel_log), nvml=nvml, out=io.StringIO())
        try:
            return {"node": "n", "gpus": monitor.snapshot()}
        finally:
            monitor.close()

    return make


def section(rows, telemetry, **kw):
    samples, no_samples, simulated = samples_from_telemetry(telemetry)
    out = gpu_utilisation(rows, samples, no_samples=no_samples, simulated=simulated, **kw)["gpu_utilisation"]
    json.dumps(out, allow_nan=False)  # always valid JSON
    return out


# ---- the decision tree ---------------------------------------------------------------------


def test_data_loading_comes_first(fake_gpus):
    rows = [row(0), row(1, data=0.4), row(2), row(3)]
    s = section(rows, fake_gpus([20, 25, 30, 22]))
    assert s["status"] == "low" and s["mean_util_pct"] == 24.2
    assert s["finding"] == "data_loading" and s["ranks"] == [1]
    assert s["evidence"]["data_share_max"] == 0.4 and s["evidence"]["data_share_max_rank"] == 1
    assert s["runbook"] == "gpu-utilisation" and "num_workers" in s["advice"] and "rank 1" in s["advice"]
    assert [(g["gpu"], g["rank"], g["utilization_pct"]) for g in s["per_gpu"]] == [(0, 0, 20), (1, 1, 25),
                                                                                  (2, 2, 30), (3, 3, 22)]


def test_waits_on_peers_are_communication(fake_gpus):
    # 0.3 s outside compute beyond backward: explicit collectives waiting on peers.
    rows = [row(r, compute_s=0.4, backward=0.3) for r in range(4)]
    s = section(rows, fake_gpus([30] * 4))
    assert s["finding"] == "communication" and s["ranks"] == [0, 1, 2, 3]
    assert s["evidence"]["wait_share"] == 0.3
    assert "NCCL" in s["advice"]


def test_backward_beyond_the_others_is_communication(fake_gpus):
    rows = [row(0), row(1), row(2), row(3, backward=0.7)]
    s = section(rows, fake_gpus([30] * 4))
    assert s["finding"] == "communication" and s["ranks"] == [3]
    assert s["evidence"]["backward_excess_share_max"] == 0.4 and s["evidence"]["backward_excess_rank"] == 3


def test_backward_compute_is_not_a_wait(fake_gpus):
    """The default compute_s leaves backward out; a long, even backward is gradient
    computation, not waiting, so communication does not explain it."""
    rows = [row(r, backward=0.6) for r in range(4)]
    s = section(rows, fake_gpus([30] * 4))
    assert s["evidence"]["wait_share"] == 0.0 and s["finding"] == "unexplained"


def test_point_to_point_traffic_is_a_pipeline_bubble(fake_gpus):
    rows = [row(0, last_op="send"), row(1, last_op="recv"), row(2), row(3)]
    s = section(rows, fake_gpus([30] * 4, mem=[0.95] * 4))
    assert s["finding"] == "pipeline_bubble" and s["ranks"] == [0, 1]  # before memory in the order
    assert s["evidence"]["p2p_ops"] == ["recv", "send"]


def test_no_pipeline_evidence_skips_that_branch(fake_gpus):
    s = section([row(r) for r in range(4)], fake_gpus([30] * 4, mem=[0.5, 0.5, 0.96, 0.5]))
    assert s["evidence"]["p2p_ranks"] == []
    assert s["finding"] == "memory_pressure" and s["ranks"] == [2]
    assert s["evidence"]["memory_fraction_max"] == 0.96 and s["evidence"]["memory_fraction_max_gpu"] == 2
    assert "activation checkpointing" in s["advice"]


def test_nothing_stands_out_is_unexplained_naming_what_was_unknown(fake_gpus):
    rows = [row(r, data=None, backward=None, optimizer=None, compute_s=1.0) for r in range(2)]
    s = section(rows, fake_gpus([10, 12]))
    assert s["finding"] == "unexplained" and s["ranks"] == []
    assert s["evidence"]["data_share"] is None and "data_share unknown" in s["advice"]
    assert "torch.profiler" in s["advice"]


def test_busy_gpus_are_ok(fake_gpus):
    s = section([row(0, data=0.5), row(1)], fake_gpus([85, 95]))
    assert s["status"] == "ok" and s["finding"] is None and s["mean_util_pct"] == 90.0


def test_only_the_job_gpus_count(fake_gpus):
    """A node's GPUs the job does not use are idle for no reason of the job's."""
    telemetry = fake_gpus([80, 80, 0, 0])
    s = section([row(0), row(1)], telemetry)
    assert s["status"] == "ok" and s["mean_util_pct"] == 80.0


# ---- when it is not judged ------------------------------------------------------------------


def test_no_gpu_is_unknown_not_a_crash(fake_gpus):
    telemetry = fake_gpus([], nvml=FakeNvml(init_error=FakeNvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    assert telemetry["gpus"] == {"nvml": False, "simulated": False, "samples": []}
    s = section([row(0)], telemetry)
    assert s["status"] == "unknown" and s["reason"] == "no GPU" and s["finding"] is None
    assert section([row(0)], {"node": "n"})["reason"].startswith("no GPU samples recorded")
    assert section([], {})["status"] == "unknown"


def test_a_job_not_stepping_is_not_judged(fake_gpus):
    telemetry = fake_gpus([5, 5])
    assert not_judged("running", "healthy") is None and not_judged("running", "straggler") is None
    for status, category in (("finished", "finished"), ("running", "collective_wait"), ("starting", "starting")):
        s = section([row(0), row(1)], telemetry, skip=not_judged(status, category))
        assert s["status"] == "unknown" and s["finding"] is None and s["mean_util_pct"] == 5.0
        assert status in s["reason"] or category in s["reason"]


# ---- in diagnose -----------------------------------------------------------------------------


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINWATCH_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_diagnose_reports_the_section(home, fake_gpus):
    job_dir = state.JobDir("busy")
    lock = liveness.acquire(job_dir)  # a launcher holds the name: the job is live
    try:
        job_dir.update_job(status="running", start_time=time.time() - 600, workers_started_time=time.time() - 600,
                           nproc_per_node=2, node="n")
        ranks = [row(r, data=0.5 if r == 1 else 0.05, pid=os.getpid(), last_progress_s=0.1, heartbeat_age_s=0.1)
                 for r in range(2)]
        state.write_json_atomic(job_dir.telemetry_file, {**fake_gpus([15, 20]), "ranks": ranks})
        report = diagnose.collect("busy", capture=False)
    finally:
        lock.release()
    assert report["status"] == "running" and report["verdict"]["category"] == "healthy"
    g = report["gpu_utilisation"]
    assert g["status"] == "low" and g["finding"] == "data_loading" and g["ranks"] == [1]
    text = diagnose.render(report)
    assert "gpu utilisation: low (mean 18% over 2 GPUs) — data_loading" in text
    assert "trainwatch runbook gpu-utilisation" in text
    json.dumps(report, allow_nan=False)


@pytest.mark.parametrize("kind", ["dead_grad", "loss_spike", "step_time_spike"])
def test_diagnose_keeps_the_section_while_a_training_health_incident_is_open(home, fake_gpus, kind):
    """A job that trains on with an open training-health incident is stepping: its idle GPUs still say
    something about throughput (every kind that leaves the job running, as kinds.py declares)."""
    assert kind in kinds.ALERT_ONLY_KINDS
    job_dir = state.JobDir("health")
    lock = liveness.acquire(job_dir)
    try:
        job_dir.update_job(status="running", start_time=time.time() - 600, workers_started_time=time.time() - 600,
                           nproc_per_node=2, node="n")
        ranks = [row(r, data=0.5 if r == 1 else 0.05, pid=os.getpid(), last_progress_s=0.1, heartbeat_age_s=0.1)
                 for r in range(2)]
        state.write_json_atomic(job_dir.telemetry_file, {**fake_gpus([15, 20]), "ranks": ranks})
        job_dir.append_event(Incident(kind=kind, culprit_ranks=[1], summary=f"{kind} on rank 1").to_json()
                             | {"id": f"{kind}-1"})
        report = diagnose.collect("health", capture=False)
    finally:
        lock.release()
    assert report["verdict"]["category"] == kind, report["verdict"]
    g = report["gpu_utilisation"]
    assert g["status"] == "low" and g["finding"] == "data_loading", g
    assert "not stepping" not in diagnose.render(report)


def test_diagnose_of_an_ended_job_keeps_its_keys(home, capsys, fake_gpus):
    job_dir = state.JobDir("done")
    job_dir.create()
    job_dir.update_job(status="failed", start_time=1.0)
    state.write_json_atomic(job_dir.telemetry_file, {**fake_gpus([0]), "ranks": [row(0)]})
    assert diagnose.main(["done", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) >= {"job", "status", "verdict", "ranks", "stack_groups", "hardware", "incidents",
                           "gpu_utilisation"}
    assert report["gpu_utilisation"]["status"] == "unknown" and "failed" in report["gpu_utilisation"]["reason"]
    assert diagnose.main(["done"]) == 0
    assert "gpu utilisation: unknown" in capsys.readouterr().out


def test_diagnose_of_a_job_still_launching(home, capsys):
    job_dir = state.JobDir("early")
    job_dir.announce_launch()
    try:
        assert diagnose.main(["early", "--json"]) == 0
    finally:
        job_dir.withdraw_launch(failed=True)
    g = json.loads(capsys.readouterr().out)["gpu_utilisation"]
    assert g["status"] == "unknown" and "starting" in g["reason"] and g["per_gpu"] == []


# ---- odd values ------------------------------------------------------------------------------

ODD = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True, allow_infinity=True), st.integers(),
                st.sampled_from([0, -1, -0.0, math.nan, math.inf, 1e308, 10**400, 2**63, "1.0", [], {}]))


@st.composite
def odd_rows(draw):
    rows = []
    for rank in range(draw(st.integers(0, 4))):
        rows.append({"rank": draw(st.one_of(st.just(rank), ODD)), "local_rank": draw(st.one_of(st.just(rank), ODD)),
                     "node": draw(st.sampled_from(["n", "", None, 3])), "step_s": draw(ODD), "compute_s": draw(ODD),
                     "phase_times": draw(st.one_of(ODD, st.fixed_dictionaries(
                         {"data": ODD, "backward": ODD, "optimizer": ODD}))),
                     "groups": draw(st.one_of(ODD, st.lists(st.one_of(ODD, st.fixed_dictionaries(
                         {"last_op": st.one_of(ODD, st.sampled_from(["send", "recv", "allreduce"]))})), max_size=2))),
                     "collectives": draw(st.one_of(ODD, st.fixed_dictionaries({"last_op": ODD})))})
    return draw(st.one_of(ODD, st.just(rows)))


samples = st.lists(st.one_of(ODD, st.fixed_dictionaries(
    {"gpu": ODD, "local_rank": st.one_of(st.integers(0, 3), ODD), "utilization_pct": ODD,
     "memory_used_bytes": ODD, "memory_total_bytes": ODD})), max_size=4)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=odd_rows(), gpus=st.one_of(ODD, samples), nvml=ODD, skip=st.sampled_from([None, "job is failed"]))
def test_odd_values_never_raise(rows, gpus, nvml, skip):
    telemetry = {"node": "n", "gpus": {"nvml": nvml, "samples": gpus}}
    s = section(rows if isinstance(rows, list) else [rows], telemetry, skip=skip)
    assert s["status"] in ("ok", "low", "unknown")
    assert s["finding"] is None or s["finding"] in utilisation.FINDINGS
    assert (s["status"] == "low") == (s["finding"] is not None)
    assert 0 <= (s["mean_util_pct"] or 0) <= 100
    for key in ("data_share", "wait_share", "backward_excess_share_max", "memory_fraction_max"):
        assert s["evidence"][key] is None or 0 <= s["evidence"][key] <= 1
    assert isinstance(s["advice"], str) and s["advice"]
    assert isinstance(utilisation.render_lines(s), list)
