"""The checkpoint manifest's schema (trainwatch.checkpoint writes it): what a
reader checks before it trusts a manifest.json it did not just write. A
manifest that fails is skipped with a one-line reason, never a traceback in
a save, a retention pass or a resume.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

FORMAT = 1
KINDS = ("periodic", "emergency")
MANIFEST = "manifest.json"
NAME_RE = re.compile(r"^step-(\d{8,})(?:-emergency-r(\d+))?$")
"""A checkpoint directory's name: step-00000030 or step-00000030-emergency-r1."""
MAX_STEP = 10**15
"""A step beyond this is not a training step (a forged or garbled name or manifest)."""
MAX_FILES = 64
"""Files one manifest may list (one state file each, in practice)."""
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be written, found or trusted; the message says why."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_manifest(manifest: Any, path: Path) -> dict:
    """The manifest of checkpoint directory `path` when it has the schema save_checkpoint
    writes (types, sizes, a step equal to the directory's); CheckpointError naming
    the first thing wrong otherwise."""
    where = f"{path}/{MANIFEST}"
    if not isinstance(manifest, dict) or not _is_int(manifest.get("format")) or manifest["format"] != FORMAT:
        raise CheckpointError(f"{where} has an unknown format (expected format {FORMAT})")
    files, step = manifest.get("files"), manifest.get("step")
    if not isinstance(files, dict) or not files or not _is_int(step) or step < 0:
        raise CheckpointError(f"{where} lists no files or no step")
    if len(files) > MAX_FILES:
        raise CheckpointError(f"{where} lists {len(files)} files (at most {MAX_FILES})")
    named = NAME_RE.match(path.name)
    if step > MAX_STEP or (named is not None and int(named.group(1)) != step):
        raise CheckpointError(f"{where} says step {str(step)[:20]}, its directory {path.name[:40]}")
    kind = manifest.get("kind", "periodic")
    if kind not in KINDS or (named is not None and (kind == "emergency") != (named.group(2) is not None)):
        raise CheckpointError(f"{where} says kind {str(kind)[:20]!r}, its directory {path.name[:40]}")
    for key in ("world_size", "rank"):
        if key in manifest and not (_is_int(manifest[key]) and 0 <= manifest[key] <= 1 << 24):
            raise CheckpointError(f"{where}: {key} must be a whole number")
    if "time" in manifest and not isinstance(manifest["time"], (int, float)):
        raise CheckpointError(f"{where}: time must be a number")
    for name, meta in files.items():
        if not name or "/" in name or name.startswith(".") or any(c < " " for c in name) or len(name) > 255:
            raise CheckpointError(f"{where}: bad file name {name[:40]!r}")
        if (not isinstance(meta, dict) or not _is_int(meta.get("bytes")) or meta["bytes"] < 0
                or not isinstance(meta.get("sha256"), str) or not _SHA256_RE.match(meta["sha256"])):
            raise CheckpointError(f"{where}: {name[:40]!r} has no size and sha256")
    return manifest


def checkpoint_name(step: int, *, kind: str = "periodic", rank: int = 0) -> str:
    """Directory name of a checkpoint: step-00000030 or step-00000030-emergency-r1."""
    if kind == "periodic":
        return f"step-{step:08d}"
    return f"step-{step:08d}-emergency-r{rank}"


def state_file_name(*, kind: str = "periodic", rank: int = 0) -> str:
    return "state.pt" if kind == "periodic" else f"state-rank{rank}.pt"
