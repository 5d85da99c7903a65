"""The sidecar's compact history and `trainwatch report`: the writer with an
injected clock, the page built from a job directory, bad input, a real job end
to end, and the page rendered in headless Chromium."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
from slot_tables import make_table
from util import BIN, ROOT, env_for, events, job_json, stop_group, trainwatch, wait_for

from trainwatch import historyfile, rankrow, state
from trainwatch.rank.slotwriter import SlotWriter
from trainwatch.diagnostics.goodput import GoodputLedger
from trainwatch.views import report
from trainwatch.watchdog import history

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (Debian package `chromium`)")


class Clock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def rows(table, clock):
    """What the sidecar hands the writer: the table decoded at the clock's time."""
    return lambda: rankrow.decode(table, clock())


# ---- history writer ---------------------------------------------------------------


def test_writer_samples_once_per_interval_with_mean_step_time(tmp_path):
    clock, wall = Clock(100.0), Clock(1_700_000_000.0)
    w = history.HistoryWriter(tmp_path / "h" / "n.jsonl", clock=clock, wall=wall)
    table = make_table(2, now=100.0, step=10, step_s=0.5)
    calls = []

    def ratios():
        calls.append(1)
        return {1: 1.8}

    assert w.maybe_sample(rows(table, clock), ratios)
    clock.t = 100.5
    assert not w.maybe_sample(rows(table, clock), ratios)  # not due: ratios not even computed
    assert len(calls) == 1
    # 1.3 s later both ranks advanced 4 steps in 1.2 s of progress -> 0.3 s per step
    clock.t, wall.t = 101.3, wall.t + 1
    table = make_table(2, now=101.2, step=14, step_s=0.9)
    assert w.maybe_sample(rows(table, clock), ratios)
    samples = historyfile.read_samples([w.path])
    assert [s["t"] for s in samples] == [1_700_000_000.0, 1_700_000_001.0]
    first, second = samples[0]["r"], samples[1]["r"]
    assert first[0] == [0, 10, 2.0, 0.5, "data", 0.0, None] and first[1][6] == 1.8
    assert second[0][3] == pytest.approx(0.3) and second[0][1] == 14
    assert oct(w.path.stat().st_mode & 0o777) == "0o600"
    assert oct(w.path.parent.stat().st_mode & 0o777) == "0o700"


def test_restart_falls_back_to_the_slot_step_time_and_nan_is_null(tmp_path):
    clock = Clock()
    w = history.HistoryWriter(tmp_path / "n.jsonl", clock=clock, interval_s=1.0)
    w.maybe_sample(rows(make_table(1, now=100.0, step=50), clock))
    clock.t = 101.0
    w.maybe_sample(rows(make_table(1, now=101.0, step=3, step_s=0.7, loss=float("nan")), clock))  # resumed lower
    [_, after] = historyfile.read_samples([w.path])
    assert after["r"][0][1:4] == [3, None, 0.7]


def test_a_new_worker_generation_is_not_averaged_across_the_restart(tmp_path):
    clock = Clock()
    w = history.HistoryWriter(tmp_path / "n.jsonl", clock=clock)
    w.maybe_sample(rows(make_table(1, now=100.0, step=29, step_s=0.25), clock))
    # The restarted rank's fresh slot: step 0, no step done yet (progress == start).
    clock.t = 105.0
    fresh = make_table(1, now=104.0, step=0, phase="init", start_mono=104.0)
    fresh["restart"] = 1
    w.maybe_sample(rows(fresh, clock))
    # Resumed at step 30 and did 6 steps since; the downtime is not in its step time.
    clock.t = 110.0
    resumed = make_table(1, now=109.5, step=35, step_s=0.2, start_mono=104.0)
    resumed["restart"] = 1
    w.maybe_sample(rows(resumed, clock))
    got = [s["r"][0] for s in historyfile.read_samples([w.path])]
    assert got[1] == [0, None, None, None, "init", 1.0, None]  # not "step 0, loss 0"
    assert got[2][1:4] == [35, 2.0, 0.2]


def test_a_failing_write_never_raises(tmp_path, caplog):
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "job").write_text("a file where the job directory should be")
    w = history.HistoryWriter(state.JobDir("job", root=tmp_path).history_file("n0"), clock=Clock())
    for _ in range(3):
        w.clock.t += 1
        assert not w.maybe_sample(rows(make_table(2), w.clock))
    assert caplog.text.count("history sample") == 1  # warned once, not every second


def test_node_names_make_safe_file_names(tmp_path):
    job = state.JobDir("j", root=tmp_path)
    assert job.history_file("gpu-node-7.cluster").name == "gpu-node-7.cluster.jsonl"
    for hostile in ("../../etc/passwd", "..", "", "a/b\\c d"):
        path = job.history_file(hostile)
        assert path.parent == job.history_dir and not path.name.startswith("."), path


def test_the_sidecar_loop_samples_about_once_a_second(tmp_path, monkeypatch):
    """Sidecar.run with an injected clock: 0.5 s per round, so every other round
    samples, plus one forced sample at shutdown; a broken history dir costs
    nothing else."""
    from trainwatch import slots
    from trainwatch.watchdog.sidecar import Sidecar

    monkeypatch.setenv("TRAINWATCH_HOME", str(tmp_path / "home"))
    state.JobDir("sc").create()
    seg = str(tmp_path / "seg")
    slots.create_segment(seg, 2)
    writers = [SlotWriter(slots.Segment(seg), i, pid=os.getpid(), rank=i, world_size=2, restart=0)
               for i in range(2)]
    clock = Clock(100.0)
    from trainwatch.watchdog.config import SidecarConfig

    sc = Sidecar("sc", seg, node="node/0", clock=clock, detectors=[], out=__import__("io").StringIO(),
                 config=SidecarConfig(tick_s=0.01))
    stop = threading.Event()
    rounds = []
    real_tick = sc.tick

    def tick():
        clock.t += 0.5
        rounds.append(clock.t)
        for i, w in enumerate(writers):
            w.write_step(len(rounds), 3.0 - 0.1 * len(rounds), 1.0, 0.5, 0.3, clock.t, 0.0,
                         slots.PHASE_CODES["forward"], clock.t, 0)
        if len(rounds) == 10:
            stop.set()
        return real_tick()

    sc.tick = tick
    from trainwatch.watchdog.writer import InlineWriter

    sc.run(stop, writer=InlineWriter())  # every sample due is written (the thread would coalesce them)
    path = state.JobDir("sc").history_file("node/0")
    samples = historyfile.read_samples([path])
    assert len(samples) == 6  # rounds 1, 3, 5, 7, 9, then the final one (round 11)
    series = historyfile.per_rank(samples)
    assert sorted(series) == [0, 1] and series[0]["step"] == [1, 3, 5, 7, 9, 11]
    assert series[1]["step_s"][1:] == [0.5] * 5  # 2 steps per 1.0 s of progress
    assert state.JobDir("sc").telemetry_file.is_file()


def test_compaction_bounds_the_file_and_keeps_first_and_last(tmp_path):
    clock, wall = Clock(), Clock(1e9)
    w = history.HistoryWriter(tmp_path / "n.jsonl", clock=clock, wall=wall, max_bytes=20_000)
    table = make_table(8)
    n = 1000
    for i in range(n):
        clock.t += 1
        wall.t += 1
        table["step"] += 1
        table["progress_mono"] = clock.t
        assert w.maybe_sample(rows(table, clock))
        assert w.path.stat().st_size <= 20_000
    samples = historyfile.read_samples([w.path])
    times = [s["t"] for s in samples]
    assert times[0] == 1e9 + 1 and times[-1] == 1e9 + n  # the whole span is still covered
    assert times == sorted(times) and len(times) < n
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert gaps[-1] == 1 and max(gaps) > 1  # recent samples at full resolution, older ones thinned
    assert not list(tmp_path.glob(".*tmp*"))


def test_repeated_compactions_keep_the_whole_span_evenly(tmp_path):
    """Hundreds of compactions: the job's first hours are not thinned away
    (every tenth of the span keeps a similar share of samples)."""
    clock, wall = Clock(), Clock(0.0)
    w = history.HistoryWriter(tmp_path / "n.jsonl", clock=clock, wall=wall, max_bytes=30_000)
    table = make_table(1)
    n = 30_000
    for i in range(n):
        clock.t += 1
        wall.t += 1
        table["step"] += 1
        table["progress_mono"] = clock.t
        w.maybe_sample(rows(table, clock))
    assert w.compactions > 100 and w.path.stat().st_size <= 30_000
    times = [s["t"] for s in historyfile.read_samples([w.path])]
    assert times[0] == 1 and times[-1] == n
    old = [t for t in times if t < 0.9 * n]  # outside the full-resolution tail
    bins = [sum(1 for t in old if k * n / 10 <= t < (k + 1) * n / 10) for k in range(9)]
    assert min(bins) >= 0.5 * max(bins) > 0, bins


def test_the_cap_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINWATCH_HISTORY_MAX_BYTES", "65536")
    assert history.HistoryWriter(tmp_path / "n.jsonl").max_bytes == 65536
    monkeypatch.setenv("TRAINWATCH_HISTORY_MAX_BYTES", "lots")
    assert history.HistoryWriter(tmp_path / "n.jsonl").max_bytes == history.MAX_BYTES


def test_reader_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "n.jsonl"
    path.write_text('{"t":1,"r":[[0,1,2.0,0.1,"data",0.0,null]]}\n{"t":2,"r":[[0,2,1.9,0.1,"da')
    samples = historyfile.read_samples([path, tmp_path / "missing.jsonl"])
    assert [s["t"] for s in samples] == [1]
    series = historyfile.per_rank(samples)
    assert series[0]["loss"] == [2.0] and series[0]["t"] == [1]


# ---- the page from a job directory -----------------------------------------------------

HOSTILE = '</script><img src=x onerror=alert(1)>'


def fake_job(home: Path, job: str = "synth", *, status: str = "succeeded", samples: int = 30) -> Path:
    d = state.JobDir(job).create()
    start = 1_700_000_000.0
    state.write_json_atomic(d.job_file, {"job": job, "status": status, "start_time": start,
                                         "end_time": start + samples, "restarts": 1, "nproc_per_node": 3,
                                         "entrypoint": f"train.py --tag {HOSTILE}"})
    w = history.HistoryWriter(d.history_file("node-a"), clock=Clock(0.0), wall=Clock(start))
    for i in range(samples):
        w.clock.t, w.wall.t = float(i), start + i
        table = make_table(3, now=float(i), step=10 * i, step_s=0.1, loss=3.0 - i * 0.05)
        table["step_s"][2] = 0.3
        w.maybe_sample(rows(table, w.clock), lambda: {0: 1.0, 1: 1.0, 2: 2.9})
    for t, kind, culprits, summary in ((10, "straggler", [2], "rank 2 is slow"), (20, "hang", [1], HOSTILE),
                                       (22, "restart", [], "restart 1")):
        stamp = __import__("datetime").datetime.fromtimestamp(start + t).astimezone().isoformat()
        d.append_event({"kind": kind, "culprit_ranks": culprits, "summary": summary, "runbook": kind,
                        "time": stamp})
    return d.path


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINWATCH_HOME", str(tmp_path))
    return tmp_path


def embedded(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="tw-data">(.*?)</script>', page, re.S)
    return json.loads(m.group(1))


def test_report_holds_the_job_and_escapes_what_it_did_not_write(home):
    fake_job(home)
    data = report.collect("synth", now=1_700_000_100.0)
    assert data["ranks"] == [0, 1, 2] and data["steps"] == 290 and data["restarts"] == 1
    assert data["kinds"] == {"hang": 1, "restart": 1, "straggler": 1}
    assert data["verdict"]["kind"] == "hang" and data["verdict"]["culprits"] == [1]
    assert [r["rank"] for r in data["slowest"]] == [2, 0, 1] and data["slowest"][0]["ratio"] == 2.9
    assert data["slowest"][0]["median_step_s"] == pytest.approx(0.1)  # 10 steps per 1 s sample
    page = report.render(data)
    assert HOSTILE not in page  # neither in the header nor inside the <script> data
    assert page.count("</script>") == 2
    assert embedded(page)["events"][1]["summary"] == HOSTILE  # the data survives, as data
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page


def test_report_for_a_job_without_history_still_renders(home):
    d = fake_job(home, "young", status="running", samples=0)
    shutil.rmtree(d / "history", ignore_errors=True)
    r = trainwatch(home, "report", "young")
    assert r.returncode == 0, r.stderr
    page = (d / "report.html").read_text()
    assert embedded(page)["series"] == {} and "young" in page


def test_report_cli_writes_out_file(home, tmp_path):
    fake_job(home)
    out = tmp_path / "out" / "page.html"
    out.parent.mkdir()
    r = trainwatch(home, "report", "synth", "--out", str(out))
    assert r.returncode == 0 and r.stdout.startswith(f"wrote {out}"), r.stderr
    assert "3 ranks, 30 samples" in r.stdout and out.stat().st_size > 10_000


@pytest.mark.parametrize("args, message", [
    (["nosuchjob"], "unknown job 'nosuchjob'"),
    ([], "usage: trainwatch report JOB"),
    (["synth", "--colour", "red"], "unrecognized arguments"),
    (["../etc"], "--job must be"),
    (["synth", "--out", "/nonexistent-dir/x.html"], "pick a writable --out path"),
    (["synth", "--out", "/tmp"], "is a directory"),
])
def test_bad_input_is_one_line_and_exit_2(home, args, message):
    d = fake_job(home)
    before = sorted(p.name for p in d.iterdir())
    r = trainwatch(home, "report", *args)
    assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert sorted(p.name for p in d.iterdir()) == before  # nothing written, nothing lost


# ---- a real job, a real browser --------------------------------------------------------


def render_in_chromium(page: Path, tmp_path: Path, screenshot: Path | None = None) -> tuple[str, str]:
    """The page's DOM after its scripts ran, and Chromium's console log."""
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            f"--user-data-dir={tmp_path / 'chromium-profile'}", "--enable-logging=stderr", "--v=0"]
    dom = subprocess.run(args + ["--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    if screenshot is not None:
        shot = subprocess.run(args + ["--hide-scrollbars", "--window-size=1280,1900", f"--screenshot={screenshot}",
                                      page.as_uri()], capture_output=True, text=True, timeout=120)
        assert shot.returncode == 0 and screenshot.stat().st_size > 10_000, shot.stderr[-2000:]
    return dom.stdout, dom.stderr


@pytest.fixture(scope="module")
def real_job(tmp_path_factory):
    """A real 4-rank launch of the integrated trainer: rank 2 straggles, rank 1's
    DataLoader hangs at step 30 (detected, checkpointed, restarted)."""
    home = tmp_path_factory.mktemp("twhome")
    r = trainwatch(home, "launch", "--nproc-per-node", "4", "--job", "rep",
                   "--inject", "straggler:delay=0.2,rank=2,step=5",
                   "--inject", "hang:where=dataloader,rank=1,step=30",
                   "-m", "trainwatch.trainer", "--model-size", "tiny", "--max-steps", "80", "--log-interval", "1000",
                   timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return home


@pytest.mark.slow
def test_sidecar_keeps_history_of_a_real_job(real_job):
    home = real_job
    [path] = (home / "jobs" / "rep" / "history").glob("*.jsonl")
    samples = historyfile.read_samples([path])
    series = historyfile.per_rank(samples)
    assert sorted(series) == [0, 1, 2, 3]
    assert len(samples) >= 10 and path.stat().st_size < history.MAX_BYTES
    gaps = [b["t"] - a["t"] for a, b in zip(samples, samples[1:-1])]  # the last one lands at shutdown
    assert min(gaps) >= 0.9 and sorted(gaps)[len(gaps) // 2] < 1.5  # ~1 sample per second
    assert any(e.kind == "restart" for e in events(home, "rep"))
    for rank, s in series.items():
        steps = [x for x in s["step"] if x is not None]
        # Before a generation's first step a rank has no step (null), never a
        # dip to "step 0": across the restart the curve has a gap, then resumes.
        assert 0 not in steps and steps == sorted(steps), (rank, s["step"])
    assert max(steps) == 80  # the final sample lands after the last step
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    ratios = [x for x in series[2]["ratio"] if x is not None]
    assert ratios and max(ratios) >= 1.5


@pytest.mark.slow
@needs_chromium
def test_report_of_a_real_job_renders_in_chromium(real_job, tmp_path):
    home = real_job
    r = trainwatch(home, "report", "rep")
    assert r.returncode == 0, r.stderr
    page = home / "jobs" / "rep" / "report.html"
    data = embedded(page.read_text())
    assert {e["kind"] for e in data["events"]} >= {"straggler", "hang", "restart"}
    assert data["slowest"][0]["rank"] == 2 and data["status"] == "succeeded"
    dom, console = render_in_chromium(page, tmp_path, screenshot=tmp_path / "report.png")
    body = re.search(r"<body[^>]*>", dom).group(0)
    assert 'data-rendered="7"' in body and 'data-errors="0"' in body, body
    plots = re.findall(r'<svg[^>]*class="plot"[^>]*data-points="(\d+)"', dom)
    assert len(plots) == 7 and all(int(n) > 0 for n in plots), plots
    assert dom.count('class="series"') >= 5 * 4  # a line per rank on each of the 5 time charts
    assert dom.count('class="incident"') == len(data["events"])
    assert not re.search(r"Uncaught|CONSOLE\(\d+\).*(Error|error)", console), console[-2000:]


@pytest.mark.slow
@needs_chromium
def test_report_of_a_running_job(tmp_path):
    """Mid-run: partial history, status running; the page still renders."""
    home = tmp_path / "home"
    home.mkdir()
    proc = subprocess.Popen(
        [str(BIN / "trainwatch"), "launch", "--nproc-per-node", "2", "--job", "live", "-m", "trainwatch.trainer",
         "--model-size", "tiny", "--max-steps", "100000", "--log-interval", "100000"],
        env=env_for(home), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=str(ROOT), start_new_session=True,
    )
    try:
        path = home / "jobs" / "live" / "history"
        wait_for(lambda: len(historyfile.read_samples(path.glob("*.jsonl"))) >= 3 and
                 any(s["r"][0][1] for s in historyfile.read_samples(path.glob("*.jsonl"))),
                 120, interval=0.5, what="three samples of a training job")
        r = trainwatch(home, "report", "live", "--out", str(tmp_path / "live.html"))
        assert r.returncode == 0, r.stderr
        assert job_json(home, "live")["status"] == "running"
    finally:
        stop_group(proc)
    data = embedded((tmp_path / "live.html").read_text())
    assert data["status"] == "running" and sorted(data["series"]) == ["0", "1"]
    dom, _ = render_in_chromium(tmp_path / "live.html", tmp_path)
    assert 'data-errors="0"' in re.search(r"<body[^>]*>", dom).group(0)


def test_report_out_never_replaces_a_link_or_a_device(home, tmp_path):
    fake_job(home)
    # '-': the page on stdout, the summary on stderr.
    r = trainwatch(home, "report", "synth", "--out", "-")
    assert r.returncode == 0 and r.stdout.lower().startswith("<!doctype html>") and "wrote the page to stdout" in r.stderr
    # A symlink: the file it names gets the page; the link stays a link.
    target = tmp_path / "real.html"
    link = tmp_path / "link.html"
    link.symlink_to(target)
    r = trainwatch(home, "report", "synth", "--out", str(link))
    assert r.returncode == 0 and "through the symlink" in r.stdout, r.stderr
    assert link.is_symlink() and target.stat().st_size > 10_000
    # A character device (/dev/null): written through, never replaced by a file.
    r = trainwatch(home, "report", "synth", "--out", "/dev/null")
    assert r.returncode == 0, r.stderr
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")


def test_report_shows_the_goodput_as_a_stacked_time_bar(home):
    d = state.JobDir("synth")
    fake_job(home)
    ledger = GoodputLedger(started=0.0)
    ledger.stepped(10.0)
    ledger.opened("h", "hang", detected=50.0, fault=45.0)
    ledger.resolved("h", 60.0)
    state.write_json_atomic(d.telemetry_file, {"ranks": [], "goodput": ledger.account(100.0).to_json()})
    data = report.collect("synth", now=1_700_000_100.0)
    assert data["goodput"]["ratio"] == 0.75 and data["goodput"]["badput_s"]["hung"] == 10.0
    page = report.render(data)
    assert "goodput 75.0% of 100 s: lost 15 s to 1 hang, 10 s to start-up" in page
    assert 'class="gp gp-productive" style="width:75.000%"' in page and 'gp-hung" style="width:10.000%"' in page
    # a goodput record of the wrong shape is no goodput, never a traceback
    state.write_json_atomic(d.telemetry_file, {"goodput": {"ratio": "high", "wall_s": 3}})
    data = report.collect("synth", now=1_700_000_100.0)
    assert data["goodput"] is None and "no goodput recorded" in report.render(data)
