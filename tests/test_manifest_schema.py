"""Checkpoints that cannot be fooled: a manifest trainwatch did not just write
is checked against its schema (types, sizes, the step of its directory);
an invalid one is skipped with one warning, never a crash of a save or a
retention pass, and retention never deletes the newest loadable checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainwatch import checkpoint
from trainwatch.checkpoint import CheckpointError, apply_retention, find_latest, save_checkpoint, verify_checkpoint
from trainwatch.ckptschema import validate_manifest

json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                     max_size=4), max_leaves=20)
GOOD = {"format": 1, "step": 30, "kind": "periodic", "time": 1.0, "world_size": 2, "rank": 0, "replicated": True,
        "files": {"state.pt": {"sha256": "0" * 64, "bytes": 10}}}


@settings(max_examples=400, deadline=None)
@given(json_values)
def test_any_json_is_a_manifest_or_one_clear_error(value):
    try:
        assert validate_manifest(value, Path("/x/step-00000030")) is value
    except CheckpointError as e:
        assert "\n" not in str(e)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(GOOD)), json_values)
def test_a_manifest_with_any_field_replaced_is_valid_only_with_the_right_type(key, value):
    manifest = {**GOOD, key: value}
    try:
        validate_manifest(manifest, Path("/x/step-00000030"))
    except CheckpointError:
        return
    # What passed has the types a reader relies on.
    assert isinstance(manifest["files"], dict) and manifest["step"] == 30
    assert all(isinstance(m["bytes"], int) and len(m["sha256"]) == 64 for m in manifest["files"].values())


def test_the_step_must_be_the_directory_s():
    with pytest.raises(CheckpointError, match="says step 31"):
        validate_manifest({**GOOD, "step": 31}, Path("/x/step-00000030"))
    with pytest.raises(CheckpointError, match="says step"):
        validate_manifest({**GOOD, "step": int("9" * 400)}, Path("/x/step-" + "9" * 400))
    with pytest.raises(CheckpointError, match="kind"):
        validate_manifest({**GOOD, "kind": "emergency"}, Path("/x/step-00000030"))


def _save(root: Path, step: int, value: float = 1.0) -> Path:
    return save_checkpoint(root, step, {"w": torch.full((64,), value)}, keep=None)


@pytest.mark.parametrize("files", [["state.pt"], "state.pt", 7, None, {"state.pt": []}, "deeply nested"])
def test_an_odd_older_manifest_never_crashes_a_save_or_retention(tmp_path, files, capfd):
    odd = _save(tmp_path, 5)
    manifest = json.loads((odd / "manifest.json").read_text())
    manifest["files"] = files
    text = json.dumps(manifest)
    if files == "deeply nested":
        text = text.replace('"deeply nested"', "[" * 100_000 + "]" * 100_000)
    (odd / "manifest.json").write_text(text)
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, {"w": torch.zeros(4)}, keep=2)
    assert odd.exists() and (tmp_path / "step-00000030").exists() and not (tmp_path / "step-00000010").exists()
    err = capfd.readouterr().err
    assert err.count("warning: skipping checkpoint") == 1 and "Traceback" not in err, err


def test_a_forged_step_is_skipped_on_resume(tmp_path, capfd):
    good = _save(tmp_path, 5)
    forged = tmp_path / "step-00000900"
    forged.mkdir()
    for f in good.iterdir():
        (forged / f.name).write_bytes(f.read_bytes())  # the manifest still says step 5
    assert find_latest(tmp_path).path == good
    assert "says step 5, its directory step-00000900" in capfd.readouterr().err


def test_retention_never_deletes_the_newest_loadable_checkpoint(tmp_path):
    loadable = _save(tmp_path, 1, 1.0)
    for step in (2, 3):
        bad = _save(tmp_path, step, 2.0)
        state = bad / "state.pt"
        data = bytearray(state.read_bytes())
        data[-20] ^= 0xFF  # same size, wrong contents
        state.write_bytes(bytes(data))
    removed = apply_retention(tmp_path, keep=1)
    assert loadable.exists() and find_latest(tmp_path, warn=lambda _: None).path == loadable
    assert removed == [tmp_path / "step-00000002"]
    verify_checkpoint(loadable)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=300))
def test_any_bytes_as_a_manifest_are_skipped_by_every_reader(tmp_path, data):
    root = tmp_path / "ck"
    d = root / "step-00000007"
    d.mkdir(parents=True, exist_ok=True)
    (d / "manifest.json").write_bytes(data)
    (d / "state.pt").write_bytes(b"x" * 10)
    checkpoint._warned.clear()
    notes = []
    apply_retention(root, keep=1, warn=notes.append)
    assert len(notes) <= 1
    assert find_latest(root, warn=notes.append) is None or data.startswith(b"{")
