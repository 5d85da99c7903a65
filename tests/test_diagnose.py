"""Verdicts (pure) and `trainwatch diagnose` on finished and unknown jobs."""

from __future__ import annotations

import dataclasses
import json

import pytest

from trainwatch import state
from trainwatch.slots import CollectiveGroup
from trainwatch.cli import main
from trainwatch.rankrow import RankRow
from trainwatch.records import HardwareFinding, Incident, Resolution
from trainwatch.diagnostics.goodput import GoodputLedger
from trainwatch.diagnostics.stack_groups import StackGroup
from trainwatch.diagnostics.verdict import decide


def row(rank, step=20, phase="backward", idle=8.0, hb=0.1, enq=40, **kw):
    """A rank row as diagnose hands it to the verdict (its process seen sleeping)."""
    kw = {"node": "n", "pid": 100 + rank, "step_s": 0.1, "state": "sleeping",
          "groups": (CollectiveGroup(0, enq, enq - 1, "allreduce"),)} | kw
    return RankRow(rank, step=step, phase=phase, last_progress_s=idle, heartbeat_age_s=hb, **kw)


def test_healthy_when_steps_advance():
    v = decide([row(r, idle=0.1) for r in range(4)])
    assert v.category == "healthy" and v.culprit_ranks == [] and v.runbook == "healthy"
    assert "steps advancing" in v.summary


def test_odd_rank_out_in_data_loading():
    ranks = [row(0), row(1), row(2, step=19, phase="data", enq=38), row(3)]
    groups = [
        StackGroup((0, 1, 3), ("all_reduce (torch/distributed/distributed_c10d.py:2501)",), "collective_wait",
                   "collective-wait", "MainThread", evidence="all_reduce (distributed_c10d.py)"),
        StackGroup((2,), ("_try_get_data (torch/utils/data/dataloader.py:1133)",), "dataloader", "dataloader-stall",
                   "MainThread", evidence="_try_get_data (dataloader.py)"),
    ]
    v = decide(ranks, groups)
    assert v.category == "dataloader" and v.culprit_ranks == [2]
    assert v.runbook == "dataloader-stall"
    assert v.confidence >= 0.8


def test_heartbeat_stale_rank_holds_the_gil():
    ranks = [row(0), row(1), row(2, phase="forward", hb=7.0), row(3)]
    v = decide(ranks)
    assert v.culprit_ranks == [2] and v.category == "gc_collect"
    assert any("holds the GIL" in e for e in v.evidence)


def test_rank_that_could_not_be_sampled_is_a_prime_suspect():
    ranks = [row(0), row(1), row(2, phase="forward", capture_error="py-spy timed out after 5s (process state: disk-sleep)"), row(3)]
    v = decide(ranks)
    assert v.culprit_ranks == [2]


def test_everyone_in_the_same_collective_names_no_culprit():
    v = decide([row(r) for r in range(4)], [StackGroup((0, 1, 2, 3), ("all_reduce (x.py:1)",), "collective_wait",
                                                       None, "MainThread", evidence="all_reduce (x.py:1)")])
    assert v.category == "collective_wait" and v.culprit_ranks == []
    assert "another node" in v.summary


def test_the_verdict_quotes_the_threshold_the_watchdog_called_the_hang_by():
    """The watchdog held rank 1 to the 3.3 s steady step it learnt (below the 5 s
    floor telemetry.json has): diagnose judges and speaks by that figure."""
    force = {"hang": {"floor_s": 5.0, "k": 5.0, "ranks": {str(r): 5.0 for r in range(4)}}}
    hang = Incident("hang", [1], summary="hang: rank 1 stuck in phase 'forward'",
                    evidence={"culprits": {"1": {"threshold_s": 3.3, "threshold_steady": True}}})
    ranks = [row(0, idle=4.0), row(1, phase="forward", idle=4.0, enq=39), row(2, idle=4.0), row(3, idle=4.0)]
    v = decide(ranks, incidents=[hang], thresholds=force)
    assert v.culprit_ranks == [1]
    assert "rank 1: no progress for 4.0s, past the hang threshold in force (3.3s)" in v.evidence
    assert not any("5.0s" in e for e in [v.summary, *v.evidence])


def test_all_ranks_stalled_quote_the_threshold_in_force_not_the_default_floor():
    force = {"hang": {"floor_s": 2.0, "k": 5.0, "ranks": {str(r): 2.5 for r in range(4)}}}
    v = decide([row(r, idle=3.0) for r in range(4)], thresholds=force)
    assert v.culprit_ranks == [] and v.evidence == ["4 rank(s) without progress past the hang threshold in force (2.5s)"]


def test_hardware_fault_wins():
    hw = [HardwareFinding("xid", "critical", gpu=1, xid=79, meaning="fallen off the bus", rank=1,
                          action="reboot_node")]
    v = decide([row(r) for r in range(4)], hardware=hw)
    assert v.category == "xid" and v.culprit_ranks == [1] and v.runbook == "gpu-xid"


def test_mismatch_incident_is_the_verdict_until_a_restart():
    inc = [Incident("collective_mismatch", [3], summary="rank 3 issued fewer collectives")]
    assert decide([row(r, idle=0.1) for r in range(4)], incidents=inc).category == "collective_mismatch"
    # Its restart's ranks stepped: the sidecar resolved it.
    after = [dataclasses.replace(inc[0], resolution=Resolution(reason="its ranks restarted")), Incident("restart", [3])]
    assert decide([row(r, idle=0.1) for r in range(4)], incidents=after).category == "healthy"


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINWATCH_HOME", str(tmp_path))
    return tmp_path


def test_unknown_job_lists_known_jobs(home, capsys):
    state.JobDir("alpha").create()
    state.JobDir("alpha").update_job(status="succeeded", start_time=1.0)
    assert main(["diagnose", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown job 'nope'") and "alpha" in err and "\n" not in err


def test_finished_job_shows_its_last_incident(home, capsys):
    state.JobDir("done").create()
    state.JobDir("done").update_job(status="failed", start_time=1.0, launcher_pid=999999999)
    state.JobDir("done").append_event({"kind": "hang", "culprit_ranks": [1], "summary": "rank 1 stuck",
                                "verdict": {"category": "checkpoint_io", "culprit_ranks": [1], "summary": "rank 1 in torch.save",
                                            "runbook": "torch-save", "confidence": 0.8}})
    assert main(["diagnose", "done", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) >= {"job", "status", "verdict", "ranks", "stack_groups", "hardware", "incidents"}
    assert report["status"] == "failed"
    assert report["verdict"]["category"] == "checkpoint_io" and report["verdict"]["culprit_ranks"] == [1]
    assert report["verdict"]["runbook"] == "torch-save"
    assert main(["diagnose", "done"]) == 0
    assert "verdict: checkpoint_io" in capsys.readouterr().out


def test_diagnose_says_the_goodput_the_sidecar_counted(home, capsys):
    d = state.JobDir("gp").create()
    d.update_job(status="succeeded", start_time=1.0, launcher_pid=999999999)
    ledger = GoodputLedger(started=0.0)
    ledger.stepped(4.0)
    ledger.opened("c", "crash", detected=50.0, fault=50.0, restarting=True)
    ledger.recovered("c", 58.0, recovery_s=8.0, recompute_s=2.0)
    state.write_json_atomic(d.telemetry_file, {"ranks": [], "goodput": ledger.account(100.0).to_json()})
    assert main(["diagnose", "gp", "--json"]) == 0
    gp = json.loads(capsys.readouterr().out)["goodput"]
    assert gp["ratio"] == 0.86 and gp["badput_s"]["restart"] == 8.0 and gp["badput_s"]["recompute"] == 2.0
    assert main(["diagnose", "gp"]) == 0
    assert "goodput 86.0% of 100 s: lost 8 s to restarts, 2 s of recomputed steps, 4 s to start-up" \
        in capsys.readouterr().out
    state.write_json_atomic(d.telemetry_file, {"goodput": [1, 2]})  # not ours: no goodput, no traceback
    assert main(["diagnose", "gp", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["goodput"] is None


def test_runbook_command(home, capsys):
    assert main(["runbook"]) == 0
    listing = capsys.readouterr().out
    assert "hang" in listing and "gpu-xid" in listing
    assert main(["runbook", "gpu-xid"]) == 0
    assert "## Fix" in capsys.readouterr().out
    assert main(["runbook", "nope"]) == 2


# ---- the edges of a job: starting, finished, restarting ------------------------------


def test_job_phase_at_the_edges():
    import time as _time

    from trainwatch.views.diagnose import phase_of_job

    now = _time.time()
    job = {"status": "running", "start_time": now - 3, "workers_started_time": now - 2, "nproc_per_node": 2,
           "ranks": [{"rank": 0}, {"rank": 1}]}
    importing = [RankRow(0, step=0, phase="init", batches=0)]
    assert phase_of_job(job, importing, True) == "starting"  # one of two attached, none stepped
    first_batches = [RankRow(r, step=0, phase="eval", batches=3) for r in (0, 1)]
    assert phase_of_job(job, first_batches, True) == "running"  # working: a verdict is due
    done = [RankRow(r, step=50, phase="done") for r in (0, 1)]
    assert phase_of_job(job, done, True) == "finished"
    assert phase_of_job({**job, "status": "restarting"}, done, True) == "restarting"
    old = {**job, "workers_started_time": now - 600}
    assert phase_of_job(old, importing, True) == "running"  # ten minutes in init is not starting any more
    assert phase_of_job({**job, "status": "succeeded"}, done, False) == "succeeded"


def test_prescan_reads_the_job_name_without_torch():
    from trainwatch.launcher.options import prescan_job

    assert prescan_job(["--nproc-per-node", "2", "--job", "a1", "train.py", "--job", "x"]) == "a1"
    assert prescan_job(["--standalone", "--job=b2", "-m", "pkg"]) == "b2"
    assert prescan_job(["train.py", "--job", "x"]) is None  # the script's own flag
    assert prescan_job(["-m", "pkg", "--job", "x"]) is None
    assert prescan_job(["--nnodes=1", "--no-restart", "--job", "c3"]) == "c3"


def test_diagnose_knows_a_job_the_moment_launch_starts(home, capsys):
    from trainwatch import state
    from trainwatch.views import diagnose

    job_dir = state.JobDir("early-job")
    job_dir.announce_launch()
    try:
        assert diagnose.main(["early-job", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["status"] == "starting" and report["verdict"]["category"] == "starting"
    finally:
        job_dir.withdraw_launch(failed=True)
    assert not (home / "jobs" / "early-job").exists()  # a failed launch leaves nothing behind


def test_launch_is_announced_before_anything_heavy_is_imported(home, capsys):
    """`trainwatch launch` announces the job (diagnose: `starting`, no ranks) from
    a module that imports neither numpy nor the watchdog's configuration: the
    second or more those take on a busy host is no longer a window in which
    diagnose answers `unknown job`."""
    import subprocess
    import sys

    from trainwatch.views import diagnose
    from trainwatch.launcher import prescan

    probe = ("import sys, trainwatch.launcher.prescan; "
             "print(sorted(m for m in ('numpy', 'torch', 'trainwatch.watchdog.config') if m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip() == "[]"
    name, marker, lock = prescan.announce(["--nproc-per-node", "2", "--job", "announced", "train.py"])
    try:
        assert name == "announced"
        assert diagnose.main(["announced", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["status"] == "starting" and report["ranks"] == []
        with pytest.raises(state.StateError):  # one live run per job name, from the first moment
            prescan.announce(["--job", "announced", "train.py"])
    finally:
        marker.withdraw_launch(failed=True)
        lock.release()


def test_verdict_and_hang_detector_name_the_same_culprit():
    """One culprit rule: the sidecar's incident and diagnose's verdict agree."""
    from slot_tables import SyncJob, set_rows

    from trainwatch import rankrow
    from trainwatch.watchdog.detectors import HangDetector

    for stuck_phase, hb_age in (("data", 0.1), ("compute", 6.0), ("backward", 0.1)):
        det = HangDetector()
        job = SyncJob(4)
        for _ in range(20):
            det.check(job.step())
        t0 = job.now
        set_rows(job.table, [0, 1, 3], phase="backward", phase_mono=t0 + 0.3)
        set_rows(job.table, 2, phase=stuck_phase, phase_mono=t0 + 0.1)
        if stuck_phase == "backward":
            set_rows(job.table, 2, step=19)  # everyone waits; rank 2 is a step behind
        view = job.at(t0 + 7.0)
        set_rows(view.table, 2, heartbeat_mono=t0 + 7.0 - hb_age)
        [incident] = det.check(view)
        rows = [dataclasses.replace(r, state="sleeping") for r in rankrow.decode(view.table, view.now)]
        assert decide(rows).culprit_ranks == incident.culprit_ranks == [2], stuck_phase


def test_every_command_answers_bad_input_with_one_line(home, capsys):
    for argv in (["diagnose"], ["diagnose", "x", "--bogus"], ["jobs", "--bogus"], ["runbook", "a", "b"],
                 ["explain"], ["report"], ["diagnose", "bad name!"], ["diagnose", "x", "--timeout", "0"]):
        with pytest.raises(SystemExit) as e:
            raise SystemExit(main(argv))
        err = capsys.readouterr().err
        assert e.value.code == 2, argv
        assert err.startswith("error: ") and err.count("\n") == 1, (argv, err)


def _finished_job(name: str, n: int) -> None:
    import numpy as np

    from trainwatch import rankrow
    from slot_tables import make_table

    table = make_table(n, now=100.0, step=50)
    table["step"][123] = 31  # one rank far behind, idle for long
    table["progress_mono"][123] = 10.0
    rows = rankrow.rows_json(rankrow.decode(table, 100.5, [f"n{r // 8}" for r in range(n)]))
    jd = state.JobDir(name).create()
    jd.update_job(status="failed", start_time=1.0, launcher_pid=999999999)
    state.write_json_atomic(jd.telemetry_file, {"node": "n0", "time": 1.0, "ranks": rows})
    jd.append_event({"kind": "hang", "culprit_ranks": [200], "summary": "rank 200 stuck"})
    assert np.all(table["pid"] > 0)


def test_a_large_jobs_report_is_summarised_unless_all_ranks(home, capsys):
    _finished_job("big", 300)
    assert main(["diagnose", "big", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) >= {"job", "status", "verdict", "ranks", "stack_groups", "hardware", "incidents"}
    shown = {r["rank"] for r in report["ranks"]}
    assert {123, 200} <= shown and len(shown) <= 64  # the laggard and the culprit, not 300 rows
    summary = report["ranks_summary"]
    assert (summary["total"], summary["shown"], summary["nodes"]) == (300, len(shown), 38)
    assert summary["step"] == {"min": 31, "median": 50, "p99": 50, "max": 50}
    assert summary["last_progress_s"]["max"] == 90.5
    assert all(set(r) >= {"rank", "node", "pid", "step", "phase", "last_progress_s", "collectives"}
               for r in report["ranks"])
    assert main(["diagnose", "big", "--json", "--all-ranks"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert len(full["ranks"]) == 300 and "ranks_summary" not in full
    assert main(["diagnose", "big"]) == 0
    text = capsys.readouterr().out
    assert "of 300 ranks on 38 node(s) shown (`--all-ranks` for every one)" in text
    assert len(text.splitlines()) < 100


def test_a_small_jobs_report_lists_every_rank():
    from trainwatch.diagnostics.rank_summary import summarise

    report = {"verdict": {"culprit_ranks": []}, "stack_groups": [], "ranks": [row(r).to_json() for r in range(64)]}
    assert summarise(report) is report


def test_a_capture_past_its_budget_names_the_ranks_it_did_not_sample():
    import os

    from trainwatch.capture import capture_all

    caps = capture_all({0: os.getpid(), 1: os.getpid()}, budget_s=0.0, job="nobody")
    assert all(c.stack.error.startswith("not sampled: the capture's 0s budget") for c in caps.values())
