"""End-to-end: `trainwatch launch` with real gloo ranks, the torchelastic agent and the sidecar."""

from __future__ import annotations

import json
import os
import signal

import psutil
import pytest

from util import SCRIPTS, events, job_json, start, trainwatch, wait_for

pytestmark = pytest.mark.slow


def test_zero_code_script_reports_steps(tmp_path):
    r = trainwatch(tmp_path, "launch", "--nproc-per-node", "2", "--job", "zc", str(SCRIPTS / "plain_ddp.py"), "--steps", "12")
    assert r.returncode == 0, r.stdout + r.stderr
    job = job_json(tmp_path, "zc")
    assert job["status"] == "succeeded" and job["exit_code"] == 0
    assert sorted(x["rank"] for x in job["ranks"]) == [0, 1]
    assert all(x["pid"] > 0 and x["node"] == job["node"] for x in job["ranks"])
    assert job["metrics"].startswith("127.0.0.1:")
    assert (tmp_path / "jobs" / "zc").stat().st_mode & 0o777 == 0o700
    assert tmp_path.stat().st_mode & 0o777 == 0o700
    tel = json.loads((tmp_path / "jobs" / "zc" / "telemetry.json").read_text())
    assert sorted((x["rank"], x["step"]) for x in tel["ranks"]) == [(0, 12), (1, 12)]
    assert all(x["loss"] is not None for x in tel["ranks"])
    # the flight recorder (or the wrapper fallback) saw DDP's gradient all_reduces
    assert all(x["groups"] and x["groups"][0]["completed"] >= 12 for x in tel["ranks"])
    assert events(tmp_path, "zc") == []
    listing = trainwatch(tmp_path, "jobs")
    assert "zc" in listing.stdout and "succeeded" in listing.stdout


def test_trainer_module_writes_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    r = trainwatch(
        tmp_path, "launch", "--nproc-per-node", "2", "--job", "tr", "-m", "trainwatch.trainer",
        "--max-steps", "30", "--ckpt-dir", str(ckpt), "--model-size", "tiny",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert any(p.name.startswith("step-") and (p / "manifest.json").is_file() for p in ckpt.iterdir())
    tel = json.loads((tmp_path / "jobs" / "tr" / "telemetry.json").read_text())
    assert sorted((x["rank"], x["step"]) for x in tel["ranks"]) == [(0, 30), (1, 30)]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--nproc-per-node", "two", "x.py"], "--nproc-per-node"),
        (["--nproc-per-node", "0", "x.py"], "--nproc-per-node"),
        (["--nproc-per-node", "2", "does/not/exist.py"], "not found"),
        (["--inject", "meteor:rank=1"], "unknown kind"),
        (["--inject", "hang:where=moon"], "where"),
        (["--inject", "crash:colour=red"], "unknown key"),
        (["--job", "../etc", "x.py"], "--job"),
        (["--metrics-port", "70000"], "--metrics-port"),
        (["--bogus-flag"], "unrecognized"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, args, needle):
    r = trainwatch(tmp_path, "launch", *args)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], r.stderr
    assert "Traceback" not in r.stdout + r.stderr


@pytest.mark.parametrize("value", ["", "lots"])
def test_a_flight_recorder_size_torch_would_hang_on_is_refused(tmp_path, value):
    """torch hangs every rank in init_process_group with a non-numeric
    TORCH_FR_BUFFER_SIZE (even empty): refuse it before any rank starts."""
    r = trainwatch(tmp_path, "launch", "--nproc-per-node", "1", "--job", "frs", str(SCRIPTS / "plain_ddp.py"),
                   TORCH_FR_BUFFER_SIZE=value)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "TORCH_FR_BUFFER_SIZE" in lines[0], r.stderr
    assert "Traceback" not in r.stdout + r.stderr


def test_trainer_bad_input_is_checked_before_any_rank_starts(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    corrupt = tmp_path / "step-00000005"
    corrupt.mkdir()
    (corrupt / "state.pt").write_bytes(b"not a checkpoint")
    for args, needle in [
        (["--ckpt-dir", str(blocker / "sub")], "ckpt-dir"),
        (["--resume", str(corrupt)], "--resume"),
        (["--max-steps", "0"], "--max-steps"),
        (["--model-size", "huge"], "--model-size"),
    ]:
        r = trainwatch(tmp_path, "launch", "--nproc-per-node", "2", "-m", "trainwatch.trainer", *args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        lines = [l for l in r.stderr.splitlines() if l.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], (args, r.stderr)
        assert "Traceback" not in r.stdout + r.stderr
    assert blocker.read_text() == "x" and (corrupt / "state.pt").read_bytes() == b"not a checkpoint"


def test_unwritable_home_is_one_line_exit_2(tmp_path):
    home = tmp_path / "home"
    home.write_text("a file, not a directory")
    r = trainwatch(home, "launch", "--nproc-per-node", "1", str(SCRIPTS / "plain_ddp.py"))
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error:") and "TRAINWATCH_HOME" in r.stderr
    assert "Traceback" not in r.stderr
    assert home.read_text() == "a file, not a directory"


def test_sigterm_stops_everything(tmp_path):
    proc = start(tmp_path, "launch", "--nproc-per-node", "2", "--job", "term", str(SCRIPTS / "plain_ddp.py"),
                 "--steps", "100000", "--sleep", "0.05")
    try:
        def progressing():
            tel = tmp_path / "jobs" / "term" / "telemetry.json"
            try:
                ranks = json.loads(tel.read_text())["ranks"]
            except (OSError, ValueError, KeyError):
                return None
            return len(ranks) == 2 and all(r["step"] >= 3 for r in ranks) and ranks

        wait_for(progressing, 90, what="both ranks stepping")
        job = job_json(tmp_path, "term")
        pids = [r["pid"] for r in job["ranks"]] + [job["sidecar_pid"]]
        assert all(psutil.pid_exists(p) for p in pids)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)

        def gone():
            return not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)

        wait_for(gone, 30, what="ranks and sidecar to exit")
        assert job_json(tmp_path, "term")["status"] == "stopped"
        assert not os.path.exists(job["slots"])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
