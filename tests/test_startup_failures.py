"""Start-up on a home or /dev/shm with no room, or a read-only home: one
`error:` line, exit 2, no traceback and nothing left behind. The fills are
private tmpfs mounts in a mount namespace of the test's own (`unshare`):
nothing of the machine's is touched. Also: the CLI's usage and pipe edges."""

from __future__ import annotations

import shutil
import subprocess
import uuid

import pytest

from util import BIN, ROOT, env_for

SCRIPT = "tests/scripts/plain_ddp.py"


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True)
    return r.returncode == 0


needs_unshare = pytest.mark.skipif(not _can_unshare(), reason="needs unshare -rm and tmpfs mounts")


def launch_in_namespace(tmp_path, setup: str, job: str) -> subprocess.CompletedProcess:
    """`trainwatch launch` after `setup` ran in a private mount namespace; prints
    what /dev/shm holds for the job afterwards on its last line."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    script = (f"set -e; {setup}; "
              f"{BIN / 'trainwatch'} launch --standalone --nproc-per-node 1 --job {job} {SCRIPT} || code=$?; "
              f"echo; echo left: $(ls /dev/shm | grep -c -- '-{job}@' || true); exit ${{code:-0}}")
    return subprocess.run(["unshare", "-rm", "sh", "-c", script], env=env_for(home), cwd=str(ROOT),
                          capture_output=True, text=True, timeout=300)


@needs_unshare
@pytest.mark.parametrize("case", ["full home", "read-only home", "no /dev/shm room"])
def test_a_start_up_without_room_is_one_line_and_leaves_nothing(tmp_path, case):
    job = f"room-{uuid.uuid4().hex[:8]}"
    home = tmp_path / "home"
    home.mkdir()
    setup = {
        # Room for the home's directories and the probe, not for job.json.
        "full home": f"mount -t tmpfs -o size=32k tmpfs {home}; dd if=/dev/zero of={home}/fill bs=4k count=100 "
                     "2>/dev/null || true",
        "read-only home": f"mount -t tmpfs -o ro,size=64k tmpfs {home}",
        "no /dev/shm room": "mount -t tmpfs -o size=4k tmpfs /dev/shm; "
                            "dd if=/dev/zero of=/dev/shm/fill bs=4k count=2 2>/dev/null || true",
    }[case]
    r = launch_in_namespace(tmp_path, setup, job)
    errors = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])
    assert len(errors) == 1 and errors[0].startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "left: 0", r.stdout


@pytest.mark.parametrize("args", [["--help"], ["--version"], [], ["jobs"]])
def test_a_reader_that_leaves_is_no_traceback(tmp_path, args):
    cmd = " ".join([str(BIN / "trainwatch"), *args]) + " | true"
    r = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], env=env_for(tmp_path), capture_output=True, text=True,
                       timeout=60, cwd=str(ROOT))
    assert r.stderr == "", r.stderr


def test_dashboards_with_a_bad_flag_is_one_line(tmp_path):
    r = subprocess.run([str(BIN / "trainwatch"), "dashboards", "--bogus"], env=env_for(tmp_path),
                       capture_output=True, text=True, timeout=60, cwd=str(ROOT))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("error: "), r.stderr


def test_the_command_ends_at_once_after_torch_yet_runs_its_exit_handlers(tmp_path):
    """After a command that imported torch the process skips tearing torch down,
    but still runs every exit handler, flushes its output and keeps its exit code."""
    import sys

    marker = tmp_path / "atexit-ran"
    code = ("import atexit, sys, torch\n"
            f"atexit.register(lambda: open({str(marker)!r}, 'w').write('ran'))\n"
            "sys.argv = ['trainwatch', 'no-such-command']\n"
            "print('before', end='')\n"
            "from trainwatch.cli import entry\n"
            "entry()\n")
    r = subprocess.run([sys.executable, "-c", code], env=env_for(tmp_path), capture_output=True, text=True,
                       timeout=120, cwd=str(ROOT))
    assert r.returncode == 2 and r.stdout.startswith("before"), (r.stdout, r.stderr)
    assert "unknown command" in r.stderr and marker.read_text() == "ran"
