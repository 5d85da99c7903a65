"""The sidecar in-process: a real slot segment, ranks simulated by writers,
an injected clock. Checks the loop's outputs: events.jsonl, console line,
counters, metrics, OpenTelemetry span; and that one bad round never kills it."""

from __future__ import annotations

import io
import json
import os
import threading

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry, generate_latest

from trainwatch import slots, state
from trainwatch.rank.slotwriter import SlotWriter
from trainwatch.watchdog import otel
from trainwatch.watchdog.exporter import TrainwatchCollector
from trainwatch.watchdog.sidecar import Sidecar

from util import Clock, wait_for


@pytest.fixture
def job(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINWATCH_HOME", str(tmp_path / "home"))
    state.JobDir("sc").create()
    path = str(tmp_path / "seg")
    slots.create_segment(path, 4)
    return path


def writers(path, n=4):
    seg = slots.Segment(path)
    return [SlotWriter(seg, i, pid=os.getpid(), rank=i, world_size=n, restart=0) for i in range(n)]


def publish(ws, step, now, phases, pycoll=None):
    for i, w in enumerate(ws):
        w.write_step(step, 2.0, 1.0, 0.5, 0.3, now if phases[i] != "stuck" else now - 30, 0.0,
                     slots.PHASE_CODES["data" if phases[i] == "stuck" else phases[i]], now,
                     step if pycoll is None else pycoll)
        w.write_sampler(now, True, step, [slots.CollectiveGroup(0, step, step, "allreduce")])


def rank_2_stops_after_healthy_steps(sc, ws, clock) -> float:
    """29 healthy 0.5 s steps, then rank 2 stops in data loading: the time it stopped."""
    for step in range(1, 30):
        clock.t = 1000.0 + step * 0.5
        publish(ws, step, clock.t, ["backward"] * 4)
        sc.tick()
    ws[2].write_step(29, 2.0, 1.0, 0.5, 0.3, clock.t, 0.0, slots.PHASE_CODES["data"], clock.t, 29)
    return clock.t


def test_hang_is_one_incident_with_outputs(job):
    clock = Clock(1000.0)
    out = io.StringIO()
    sc = Sidecar("sc", job, node="n0", clock=clock, out=out)
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=otel.resource("sc", "n0"))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    sc.tracer = otel.IncidentTracer(provider)
    ws = writers(job)
    for step in range(1, 30):  # a healthy history: 0.5 s steps
        clock.t = 1000.0 + step * 0.5
        publish(ws, step, clock.t, ["backward"] * 4)
        assert sc.tick() == []
    # rank 2 stops in data loading at step 29; the others wait in backward
    t_stop = clock.t
    for k in range(1, 80):
        clock.t = t_stop + k * 0.1
        for i, w in enumerate(ws):
            w.write_sampler(clock.t, True, 29, [slots.CollectiveGroup(0, 29, 29, "allreduce")])
        if k == 1:
            ws[2].write_step(29, 2.0, 1.0, 0.5, 0.3, t_stop, 0.0, slots.PHASE_CODES["data"], t_stop, 29)
        sc.tick()
    found = state.JobDir("sc").incidents()
    assert [e.kind for e in found] == ["hang"]
    assert found[0].culprit_ranks == [2] and found[0].victims == [0, 1, 3]
    assert out.getvalue().count("INCIDENT hang culprit rank(s) 2") == 1
    assert sc.incident_counts == {"hang": 1}
    [span] = exporter.get_finished_spans()
    assert span.name == "trainwatch.incident.hang"
    registry = CollectorRegistry()
    registry.register(TrainwatchCollector(sc))
    text = generate_latest(registry).decode()
    assert 'trainwatch_incidents_total{kind="hang",node="n0",trainwatch_job="sc"} 1.0' in text
    assert 'trainwatch_step{node="n0",rank="2",trainwatch_job="sc"} 29.0' in text
    assert "trainwatch_step_duration_seconds_bucket" in text
    # Goodput: start-up to the first step, productive until rank 2 stopped, then
    # detection (its last progress to the incident) and the time since.
    gp = sc.goodput_now()
    detected = found[0].detected_mono
    assert gp.wall_s == pytest.approx(clock.t - 1000.0)
    assert gp.badput_s["startup"] == 0.5 and gp.productive_s == pytest.approx(t_stop - 1000.5)
    assert gp.badput_s["detection"] == pytest.approx(detected - t_stop)
    assert gp.badput_s["hung"] + gp.badput_s["capture_checkpoint"] == pytest.approx(clock.t - detected)
    assert f'trainwatch_goodput_ratio{{node="n0",trainwatch_job="sc"}} {gp.ratio}' in text
    for cause in ("startup", "detection", "capture_checkpoint", "restart", "recompute", "hung"):
        assert f'trainwatch_badput_seconds_total{{cause="{cause}",node="n0",trainwatch_job="sc"}}' in text
    sc.write_snapshot()
    assert json.loads(state.JobDir("sc").telemetry_file.read_text())["goodput"]["wall_s"] == round(gp.wall_s, 3)


def test_nothing_is_judged_from_the_slots_while_the_agent_restarts_the_workers(job):
    """From the teardown until the new workers start (control/restarting, the
    agent's word), the slots hold the stopped workers' last steps: a stall
    there is no hang (the same stall without that word is the hang of the test above)."""
    clock = Clock(1000.0)
    sc = Sidecar("sc", job, node="n0", clock=clock, out=io.StringIO())
    ws = writers(job)
    t_stop = rank_2_stops_after_healthy_steps(sc, ws, clock)
    restarting = state.JobDir("sc").restarting_file
    restarting.touch()
    for k in range(1, 150):
        clock.t = t_stop + k * 0.1
        for w in ws:
            w.write_sampler(clock.t, True, 29, [slots.CollectiveGroup(0, 29, 29, "allreduce")])
        assert sc.tick() == [], k
    assert state.JobDir("sc").incidents() == [] and sc.engine.open_incidents() == []


def test_a_failing_round_never_ends_the_loop(job):
    sc = Sidecar("sc", job, node="n0", out=io.StringIO())
    calls = []

    def bad_tick():
        calls.append(1)
        if len(calls) == 2:
            stop.set()
        raise RuntimeError("odd slot")

    sc.tick = bad_tick
    sc.config.tick_s = 0.001
    stop = threading.Event()
    sc.run(stop)
    assert len(calls) >= 2


def test_snapshot_is_written(job):
    clock = Clock(50.0)
    sc = Sidecar("sc", job, node="n0", clock=clock, out=io.StringIO())
    ws = writers(job)
    publish(ws, 7, 49.5, ["forward"] * 4)
    sc.tick()
    sc.write_snapshot()
    snap = json.loads(state.JobDir("sc").telemetry_file.read_text())
    assert [(r["rank"], r["step"], r["phase"]) for r in snap["ranks"]] == [(i, 7, "forward") for i in range(4)]
    assert snap["ranks"][0]["last_progress_s"] == 0.5


def test_response_runs_off_the_tick(job, monkeypatch):
    """A capture that takes long (here: until released) never stops detection:
    the incident is recorded the moment it is found, the next ticks run, and
    the response's results are appended when they are done."""
    from trainwatch.watchdog.responder import Responder

    release = threading.Event()
    started = threading.Event()

    def slow_capture(self, record):
        started.set()
        assert release.wait(30)
        return {"capture": {"seconds": 9.9, "ranks": 4, "dir": "x", "failed": {}},
                "verdict": {"category": "dataloader", "culprit_ranks": [2]}}, None

    monkeypatch.setattr(Responder, "capture", slow_capture)
    clock = Clock(1000.0)
    out = io.StringIO()
    sc = Sidecar("sc", job, node="n0", clock=clock, out=out, respond=True)
    sc.config.actions.restart = False  # alert only: the response is capture + verdict
    ws = writers(job)
    t_stop = rank_2_stops_after_healthy_steps(sc, ws, clock)
    ticks_after = 0
    for k in range(1, 120):
        clock.t = t_stop + k * 0.1
        for w in ws:
            w.write_sampler(clock.t, True, 29, [slots.CollectiveGroup(0, 29, 29, "allreduce")])
        sc.tick()
        if started.is_set():
            ticks_after += 1
    assert started.wait(10)
    [incident] = state.JobDir("sc").incidents()
    assert incident.kind == "hang" and incident.verdict is None  # recorded at detection, acted on later
    assert ticks_after > 10  # the ticks went on while the capture ran
    release.set()
    assert sc.responder.drain(10)
    [incident] = state.JobDir("sc").incidents()
    assert incident.verdict.category == "dataloader" and incident.capture.seconds == 9.9
    assert f"hang {incident.id}: stacks of 4 rank(s)" in out.getvalue()
    sc.responder.close()


def test_the_writer_coalesces_and_drains():
    from trainwatch.watchdog.writer import BackgroundWriter

    writer = BackgroundWriter()
    gate, ran = threading.Event(), []
    writer.submit("block", gate.wait)  # holds the thread while the next ones queue up
    for i in range(5):
        writer.submit("snapshot", lambda i=i: ran.append(("snapshot", i)))
    writer.submit("history", lambda: ran.append(("history", 0)))
    writer.submit("bad", lambda: 1 / 0)  # logged; the thread goes on
    assert writer.pending("snapshot") and writer.replaced == 4  # one waiting job per key: bounded
    gate.set()
    assert writer.close(timeout_s=10)
    assert ran == [("snapshot", 4), ("history", 0)]  # only the newest snapshot, in submission order
    writer.submit("late", lambda: ran.append("late"))  # after close: dropped, never run on a dead thread
    assert ran[-1] != "late"


def test_the_writer_gives_way_while_a_tick_runs():
    """The writer's pause points hold while a tick runs and pass at once
    otherwise: a snapshot of thousands of ranks is encoded between ticks."""
    from trainwatch.watchdog.writer import TickGate

    gate = TickGate()
    gate.pause()  # no tick: returns at once
    paused, resumed = threading.Event(), threading.Event()

    def writer():
        paused.set()
        gate.pause()
        resumed.set()

    with gate.ticking():
        t = threading.Thread(target=writer)
        t.start()
        assert paused.wait(10)
        assert not resumed.wait(0.2)  # still ticking: the writer waits
    assert resumed.wait(10)
    t.join(10)


def test_decoding_and_encoding_many_ranks_pause_every_few_hundred_rows():
    from slot_tables import make_table

    from trainwatch import rankrow

    calls = []
    table = make_table(1000)
    rows = rankrow.decode(table, 1.0, "n0", pause=lambda: calls.append("decode"))
    as_json = rankrow.rows_json(rows, pause=lambda: calls.append("rows"))
    text = state.dumps_compact({"ranks": as_json, "n": 1}, pause=lambda: calls.append("json"))
    assert calls.count("decode") == calls.count("rows") == calls.count("json") == 3  # rows 256, 512, 768
    assert json.loads(text) == {"ranks": as_json, "n": 1}
    assert rows == rankrow.decode(table, 1.0, "n0")


def test_the_loop_never_waits_on_a_slow_write(job):
    """A snapshot and history write that take as long as the disk likes (here:
    until released) hold neither the detection rounds nor each other's slot;
    the loop's last round waits for them, so nothing written is lost."""
    sc = Sidecar("sc", job, node="n0", out=io.StringIO())
    sc.config.tick_s, sc.config.snapshot_s = 0.005, 0.0
    publish(writers(job), 7, 0.0, ["forward"] * 4)
    release, writes, rounds = threading.Event(), [], []
    real_job = sc.snapshot_job

    def slow_job():
        job = real_job()

        def write():
            release.wait(60)
            job()
            writes.append(1)
        return write

    sc.snapshot_job = slow_job
    sc.tick_started = rounds.append
    stop = threading.Event()
    loop = threading.Thread(target=sc.run, args=(stop,))
    loop.start()
    try:
        wait_for(lambda: len(rounds) >= 40, timeout=30, what="detection rounds while a write is stuck")
        assert writes == []  # still stuck: the rounds went on without it
    finally:
        release.set()
        stop.set()
        loop.join(30)
    assert not loop.is_alive() and writes  # the last snapshot was written before the loop ended
    snap = json.loads(state.JobDir("sc").telemetry_file.read_text())
    assert [r["step"] for r in snap["ranks"]] == [7] * 4
    assert state.JobDir("sc").history_file("n0").read_text().count("\n") >= 1


def test_slow_writes_are_spaced_out():
    from trainwatch.watchdog.writer import DUTY_FACTOR, BackgroundWriter

    writer = BackgroundWriter()
    assert writer.spacing("snapshot", 2.0) == 2.0  # nothing written yet: the configured interval
    writer.seconds["snapshot"] = 1.0  # a write of thousands of ranks on a slow disk
    assert writer.spacing("snapshot", 2.0) == DUTY_FACTOR * 1.0
    writer.close()


def test_compact_json_is_the_encoders_text_slice_by_slice():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5)
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3),
                                                                                             inner, max_size=3),
                          max_leaves=8)
    keys = st.text(max_size=4) | st.integers() | st.booleans() | st.none()

    @settings(max_examples=60, deadline=None)
    @given(st.dictionaries(keys, values | st.lists(scalars, min_size=250, max_size=700), max_size=4))
    def check(data):
        assert state.dumps_compact(data, pause=lambda: None) == json.dumps(data, separators=(",", ":"))

    check()
