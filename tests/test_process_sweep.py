"""Nothing a rank starts outlives the job: a child in a session of its own
(`setsid`, reparented to init) is found by the run's marker in its
environment and stopped when the job ends."""

from __future__ import annotations

import subprocess
import uuid

import psutil
import pytest

from util import BIN, ROOT, env_for, wait_for

pytestmark = pytest.mark.slow

ESCAPER = """
import os, subprocess, sys
# A daemon of the rank's own: a new session, its parent gone once the rank exits.
subprocess.Popen(["setsid", sys.executable, "-c", "import time; time.sleep(600)  # {tag}"],
                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
"""


def escapers(tag: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(tag in part for part in p.info["cmdline"] or []):
                out.append(p)
        except psutil.Error:
            continue
    return out


@pytest.mark.parametrize("warm", [True, False])
def test_a_setsid_child_of_a_rank_is_gone_when_the_job_ends(tmp_path, warm):
    tag = f"escaper-{uuid.uuid4().hex[:8]}"
    script = tmp_path / "escape.py"
    script.write_text(ESCAPER.replace("{tag}", tag))
    home = tmp_path / "home"
    try:
        r = subprocess.run([str(BIN / "trainwatch"), "launch", "--standalone", "--nproc-per-node", "1",
                            "--job", tag, *([] if warm else ["--no-warm-start"]), str(script)],
                           env=env_for(home), cwd=str(ROOT), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "left behind" in r.stdout, r.stdout[-3000:]
        wait_for(lambda: not escapers(tag), 10, what="the rank's setsid child gone")
    finally:
        for p in escapers(tag):
            p.kill()
