"""Checkpoint files: atomic saves, verification, retention, and survival of a kill mid-write."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from trainwatch.checkpoint import (
    MANIFEST,
    CheckpointError,
    apply_retention,
    ensure_writable,
    find_latest,
    load_checkpoint,
    remove_stale_temp,
    save_checkpoint,
    verify_checkpoint,
)


def make_state(step: int, size: int = 64) -> dict:
    gen = torch.Generator().manual_seed(step)
    return {
        "step": step,
        "model": {"w": torch.randn(size, generator=gen), "b": torch.zeros(3)},
        "optimizer": {"state": {0: {"exp_avg": torch.ones(2)}}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95)}]},
        "rng": {"torch_cpu": torch.get_rng_state()},
        "seed": 7,
        "config": {"model_size": "tiny", "lr": 0.1, "ckpt_dir": None},
    }


def collect_warnings() -> tuple[list[str], object]:
    lines: list[str] = []
    return lines, lines.append


def test_save_load_roundtrip(tmp_path: Path) -> None:
    state = make_state(30)
    path = save_checkpoint(tmp_path, 30, state, world_size=2)
    assert path == tmp_path / "step-00000030"
    assert sorted(p.name for p in path.iterdir()) == [MANIFEST, "state.pt"]
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["format"] == 1 and manifest["step"] == 30 and manifest["kind"] == "periodic"
    assert manifest["world_size"] == 2 and manifest["replicated"] is True
    assert manifest["files"]["state.pt"]["bytes"] == (path / "state.pt").stat().st_size
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temp dir left behind"

    info = find_latest(tmp_path)
    assert info is not None and info.step == 30 and info.kind == "periodic"
    for loaded in (load_checkpoint(info), load_checkpoint(path), load_checkpoint(path / "state.pt")):
        assert loaded["step"] == 30
        assert torch.equal(loaded["model"]["w"], state["model"]["w"])
        assert loaded["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)


def test_find_latest_empty_or_missing(tmp_path: Path) -> None:
    assert find_latest(tmp_path) is None
    assert find_latest(tmp_path / "nope") is None


def test_retention_keeps_last_n(tmp_path: Path) -> None:
    for step in range(1, 7):
        save_checkpoint(tmp_path, step * 10, make_state(step), keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000040", "step-00000050", "step-00000060"]


def test_retention_leaves_incomplete_dirs_alone(tmp_path: Path) -> None:
    (tmp_path / "step-00000001").mkdir()  # no manifest: neither counted nor deleted
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, make_state(step), keep=None)
    removed = apply_retention(tmp_path, 2)
    assert [p.name for p in removed] == ["step-00000010"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001", "step-00000020", "step-00000030"]


def test_resave_same_step_replaces(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 5, make_state(1))
    save_checkpoint(tmp_path, 5, make_state(2))
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000005"]
    assert torch.equal(load_checkpoint(find_latest(tmp_path))["model"]["w"], make_state(2)["model"]["w"])


def _truncate(file: Path) -> None:
    os.truncate(file, file.stat().st_size // 2)


def _flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def _drop_manifest(file: Path) -> None:
    (file.parent / MANIFEST).unlink()


@pytest.mark.parametrize("damage", [_truncate, _flip, _drop_manifest], ids=["truncated", "flipped", "no-manifest"])
def test_corrupt_latest_is_skipped(tmp_path: Path, damage) -> None:
    save_checkpoint(tmp_path, 10, make_state(10))
    newest = save_checkpoint(tmp_path, 20, make_state(20))
    damage(newest / "state.pt")
    warnings, warn = collect_warnings()
    info = find_latest(tmp_path, warn=warn)
    assert info is not None and info.step == 10
    assert load_checkpoint(info)["step"] == 10
    assert len(warnings) == 1 and warnings[0].startswith("warning: ") and "step-00000020" in warnings[0]
    assert "\n" not in warnings[0]


def test_default_warning_goes_to_stderr(tmp_path: Path, capsys) -> None:
    save_checkpoint(tmp_path, 10, make_state(10))
    _flip(save_checkpoint(tmp_path, 20, make_state(20)) / "state.pt")
    assert find_latest(tmp_path).step == 10
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: skipping checkpoint")


def test_explicit_bad_paths_raise(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 10, make_state(10))
    _flip(path / "state.pt")
    with pytest.raises(CheckpointError, match="sha256 mismatch"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(path / "state.pt")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "step-00000099")
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="not a loadable checkpoint"):
        load_checkpoint(junk)
    with pytest.raises(CheckpointError, match="no manifest.json"):
        verify_checkpoint(tmp_path)


def test_emergency_any_valid_rank_file_suffices(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 20, make_state(20))
    r0 = save_checkpoint(tmp_path, 31, make_state(31), kind="emergency", rank=0)
    r1 = save_checkpoint(tmp_path, 31, make_state(31), kind="emergency", rank=1)
    assert r0.name == "step-00000031-emergency-r0" and (r0 / "state-rank0.pt").exists()
    assert r1.name == "step-00000031-emergency-r1" and (r1 / "state-rank1.pt").exists()
    _truncate(r0 / "state-rank0.pt")
    warnings, warn = collect_warnings()
    info = find_latest(tmp_path, warn=warn)
    assert info.path == r1 and info.kind == "emergency" and info.step == 31
    assert load_checkpoint(info)["step"] == 31
    assert len(warnings) == 1


def test_ensure_writable_rejects_a_file(tmp_path: Path) -> None:
    file = tmp_path / "f"
    file.write_text("x")
    for bad in (file, file / "sub"):
        with pytest.raises(CheckpointError, match="--ckpt-dir must be a writable directory"):
            ensure_writable(bad)
    assert ensure_writable(tmp_path / "a" / "b").is_dir()


def test_stale_temp_of_live_process_is_kept(tmp_path: Path) -> None:
    mine = tmp_path / f".tmp-step-00000001-{os.getppid()}"  # a live pid that is not ours
    mine.mkdir()
    assert remove_stale_temp(tmp_path) == []
    assert mine.exists()


_KILLED_WRITER = textwrap.dedent(
    """
    import sys, threading
    from pathlib import Path
    import torch
    from trainwatch.checkpoint import save_checkpoint

    ckpt_dir, marker = Path(sys.argv[1]), Path(sys.argv[2])
    save_checkpoint(ckpt_dir, 1, {"step": 1, "w": torch.ones(8)})

    def stall():
        # Runs with the new state file open in the temp dir: leave part of a
        # payload there, tell the test, and wait to be killed.
        (tmp,) = ckpt_dir.glob(".tmp-step-00000002-*")
        with open(tmp / "state.pt", "ab") as f:
            f.write(b"PK" + bytes(1 << 20))
        marker.write_text(str(tmp))
        threading.Event().wait()

    save_checkpoint(ckpt_dir, 2, {"step": 2, "w": torch.zeros(1 << 20)}, fault_point=stall)
    """
)


def test_sigkill_mid_write_keeps_previous_checkpoint(tmp_path: Path) -> None:
    ckpt_dir, marker = tmp_path / "ckpt", tmp_path / "marker"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINWATCH_")}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(ckpt_dir), str(marker)], env=env)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None, f"writer exited early with {proc.returncode}"
            assert time.monotonic() < deadline, "writer never reached the middle of its save"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    tmp = Path(marker.read_text())
    assert tmp.is_dir() and (tmp / "state.pt").stat().st_size > 1 << 20  # really killed mid-write
    assert not (ckpt_dir / "step-00000002").exists()

    warnings, warn = collect_warnings()
    info = find_latest(ckpt_dir, warn=warn)
    assert info is not None and info.step == 1 and warnings == []  # the temp dir is not even a candidate
    assert torch.equal(load_checkpoint(info)["w"], torch.ones(8))

    # The next save cleans up after the dead writer.
    save_checkpoint(ckpt_dir, 3, {"step": 3})
    assert not tmp.exists()
    assert find_latest(ckpt_dir).step == 3


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("new_complete", [True, False])
def test_killed_between_the_renames_of_a_resave_loses_no_checkpoint(tmp_path: Path, new_complete: bool) -> None:
    """A same-step re-save moves the old copy aside, then renames the new one in;
    a process killed between the two leaves neither under the final name."""
    pid = dead_pid()
    old = save_checkpoint(tmp_path / "a", 7, make_state(1))
    new = save_checkpoint(tmp_path / "b", 7, make_state(2))
    old.rename(tmp_path / f".tmp-old-step-00000007-{pid}")
    if not new_complete:
        (new / "state.pt").write_bytes(b"torn")
    new.rename(tmp_path / f".tmp-step-00000007-{pid}")
    removed = remove_stale_temp(tmp_path)
    expected = make_state(2 if new_complete else 1)
    assert torch.equal(load_checkpoint(tmp_path / "step-00000007")["model"]["w"], expected["model"]["w"])
    assert len(removed) == 1  # the copy that lost: the old one, or the torn new one
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-old")]


def test_disk_full_is_a_one_line_error_that_keeps_earlier_checkpoints(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import resource, signal, torch
        from trainwatch.checkpoint import CheckpointError, save_checkpoint
        save_checkpoint({str(tmp_path)!r}, 1, {{"w": torch.zeros(16)}})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a full disk: writes fail with an error
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        try:
            save_checkpoint({str(tmp_path)!r}, 2, {{"w": torch.zeros(1 << 16)}})
        except CheckpointError as e:
            print(e)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip()
    assert line.count("\n") == 0 and "cannot write checkpoint" in line and "free" in line, line
    assert "earlier checkpoints are kept" in line
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001"]
    assert verify_checkpoint(tmp_path / "step-00000001").step == 1
