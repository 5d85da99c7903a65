"""Concurrent captures of the same ranks are serialised (two py-spy attaches to
one process collide) and share the dump made while they waited: 20
`diagnose` calls at once all get every rank's stack."""

from __future__ import annotations

import json
import subprocess
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from util import BIN, ROOT, env_for, running_plain_job, wait_for

pytestmark = pytest.mark.slow


def test_twenty_diagnoses_at_once_all_have_every_rank_s_stacks(tmp_path):
    home = tmp_path / "home"
    job = f"cc-{uuid.uuid4().hex[:8]}"
    with running_plain_job(home, job):
        def diagnose() -> dict:
            r = subprocess.run([str(BIN / "trainwatch"), "diagnose", job, "--json", "--timeout", "30"],
                               env=env_for(home), capture_output=True, text=True, timeout=180, cwd=str(ROOT))
            assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
            return json.loads(r.stdout)

        wait_for(lambda: diagnose()["status"] == "running", 120, interval=0.5, what="the job running")
        with ThreadPoolExecutor(20) as pool:
            reports = list(pool.map(lambda _: diagnose(), range(20)))
    lacking = [[(r["rank"], r.get("capture_error")) for r in rep["ranks"] if r.get("capture_error")]
               for rep in reports]
    assert all(not x for x in lacking), lacking
    assert all({rank for g in rep["stack_groups"] for rank in g["ranks"]} == {0, 1} for rep in reports)
