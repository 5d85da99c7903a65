"""Warm start: workers forked from a zygote that imported torch once behave as
fresh interpreters would (environment, arguments, output, exit codes,
signals, random seeds), and nothing outlives the zygote."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import textwrap

import psutil
import pytest
from util import events, job_json, trainwatch, wait_for

from trainwatch import capture
from trainwatch.launcher import warmstart

SCRIPT = textwrap.dedent("""
    import json, os, random, sys, time
    out = sys.argv[1]
    if sys.argv[2] == "sleep":
        open(out, "w").write("up")
        time.sleep(600)
    print("hello from", os.environ["RANK"], flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    json.dump({"argv": sys.argv, "cwd": os.getcwd(), "rank": os.environ["RANK"], "random": random.random(),
               "pgid": os.getpgid(0), "pid": os.getpid(), "ppid": os.getppid(),
               "parent": os.environ.get("TRAINWATCH_PARENT_PID"), "torch": "torch" in sys.modules,
               "main": __name__}, open(out, "w"))
    raise SystemExit(int(sys.argv[2]))
""")


@pytest.fixture
def zygote():
    z = warmstart.Zygote([], job="zjob")
    z.start()
    assert z.wait_ready(120) is not None
    yield z
    z.close()


def _fork(z, tmp_path, name, *args, redirect=False):
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "RANK": name}
    out = str(tmp_path / f"{name}.out") if redirect else None
    err = str(tmp_path / f"{name}.err") if redirect else None
    return warmstart.ForkedProcess(z.fork([str(script), str(tmp_path / f"{name}.json"), *args], env, out, err), z)


def test_a_forked_worker_is_the_process_a_fresh_interpreter_would_be(zygote, tmp_path, monkeypatch):
    assert {"torch", "trainwatch.rank.bootstrap"} <= set(zygote.ready.preloaded)
    monkeypatch.chdir(tmp_path)
    a = _fork(zygote, tmp_path, "0", "3", redirect=True)
    b = _fork(zygote, tmp_path, "1", "0")
    assert a.wait(60) == 3 and b.wait(60) == 0  # exit codes as the script gave them
    ra, rb = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "01")
    assert ra["argv"][1:] == [str(tmp_path / "0.json"), "3"] and ra["main"] == "__main__"
    assert ra["cwd"] == str(tmp_path) and ra["rank"] == "0" and rb["rank"] == "1"
    assert ra["pgid"] == ra["pid"]  # its own process group, as torchelastic starts workers
    assert ra["ppid"] == zygote.proc.pid and ra["parent"] == str(zygote.proc.pid)
    assert ra["torch"]  # imported already: the point of it
    assert ra["random"] != rb["random"]  # reseeded: forked copies do not share one stream
    assert (tmp_path / "0.out").read_text() == "hello from 0\n"
    assert (tmp_path / "0.err").read_text() == "to stderr\n"


def test_no_fork_from_a_zygote_that_initialised_cuda(zygote, tmp_path):
    """A preload that initialised CUDA makes forked workers unable to use the GPU:
    the launcher then starts them cold (the zygote says so in its ready message)."""
    assert zygote.ready.cuda_initialized is False
    zygote.ready = dataclasses.replace(zygote.ready, cuda_initialized=True)
    with pytest.raises(warmstart.ZygoteUnavailable, match="CUDA"):
        zygote.fork([str(tmp_path / "w.py")], dict(os.environ), None, None)


def test_signals_reach_the_worker_and_its_code_says_so(zygote, tmp_path):
    proc = _fork(zygote, tmp_path, "0", "sleep")
    wait_for(lambda: (tmp_path / "0.json").exists(), 60, what="worker up")
    assert proc.poll() is None
    # Its stacks may be sampled: /proc/PID/environ (the zygote's) names the job.
    assert capture.belongs_to_job(proc.pid, "zjob") and not capture.belongs_to_job(proc.pid, "other")
    warmstart.ForkedHandler(proc, 0).close(signal.SIGTERM)
    assert proc.wait(30) == -signal.SIGTERM


def test_workers_die_with_the_zygote(tmp_path):
    z = warmstart.Zygote([])
    z.start()
    try:
        assert z.wait_ready(120) is not None
        proc = _fork(z, tmp_path, "0", "sleep")
        wait_for(lambda: (tmp_path / "0.json").exists(), 60, what="worker up")
        z.proc.kill()
        # Its exit is reported (never waited for forever) and the kernel ends the worker.
        assert proc.wait(30) == -signal.SIGKILL
        wait_for(lambda: not psutil.pid_exists(proc.pid) or psutil.Process(proc.pid).status() == "zombie", 30,
                 what="worker gone")
        with pytest.raises(warmstart.ZygoteUnavailable):
            z.fork(["x.py"], dict(os.environ), None, None)
    finally:
        z.close()


def test_entry_imports_are_installed_packages_only(tmp_path):
    (tmp_path / "mylib.py").write_text("")
    script = tmp_path / "train.py"
    script.write_text("import os, json\nimport torch.nn as nn\nfrom numpy import array\nimport mylib\nfrom . import x\n"
                      "def f():\n    import psutil\n")
    sys.path.insert(0, str(tmp_path))
    try:
        found = warmstart.entry_imports(str(script), module=False)
    finally:
        sys.path.remove(str(tmp_path))
    assert found == ["torch.nn", "numpy"]  # not the stdlib, not the user's own module, not a nested import
    assert warmstart.entry_imports(str(tmp_path / "missing.py"), module=False) == []
    assert warmstart.entry_imports("trainwatch.trainer", module=True) == ["trainwatch.trainer.train"]
    (tmp_path / "bad.py").write_bytes(b"\xff\x00def (")
    assert warmstart.entry_imports(str(tmp_path / "bad.py"), module=False) == []


@pytest.mark.slow
@pytest.mark.parametrize("warm", [True, False])
def test_a_restart_forks_the_new_workers_from_the_zygote(tmp_path, warm):
    from util import SCRIPTS

    job = f"ws{int(warm)}"
    r = trainwatch(tmp_path, "launch", "--nproc-per-node", "2", "--job", job, "--inject", "crash:rank=1,step=5",
                   *([] if warm else ["--no-warm-start"]), str(SCRIPTS / "plain_ddp.py"), "--steps", "10")
    assert r.returncode == 0, r.stdout + r.stderr
    timing = json.loads((tmp_path / "jobs" / job / "control" / "restart-timing.json").read_text())
    assert timing["restart"] == 1 and timing["warm"] is warm
    assert job_json(tmp_path, job)["status"] == "succeeded"
    assert [e.kind for e in events(tmp_path, job) if e.kind != "action"][:1] == ["crash"]
    assert "zygote" not in r.stdout + r.stderr  # a survivor's traceback shows the program's frames only
