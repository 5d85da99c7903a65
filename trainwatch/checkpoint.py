"""Checkpoints on disk: atomic directories with a checksummed manifest.

Layout under a checkpoint directory:

    step-00000030/                    periodic checkpoint (rank 0 writes state.pt)
      state.pt
      manifest.json                   {"format", "step", "kind", "time", "world_size",
                                       "rank", "files": {name: {"sha256", "bytes"}}, "replicated"}
    step-00000031-emergency-r3/       emergency checkpoint written by rank 3 alone
      state-rank3.pt
      manifest.json
    .tmp-step-00000060-4242/          a save in progress (or killed mid-write): ignored

A save writes everything into a temp directory, fsyncs each file, writes the
manifest last, then renames the directory into place and fsyncs the parent. A
crash at any point leaves either the old set of checkpoints or the new one,
never a half-written directory under a final name. Training state is replicated
across data-parallel ranks, so any one file that verifies is a whole checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from trainwatch.finite import NonFiniteState, nonfinite_problem

# The manifest's schema; CheckpointError, FORMAT, KINDS and MANIFEST are this module's API too.
from trainwatch.ckptschema import FORMAT, KINDS, MANIFEST, MAX_STEP, CheckpointError, validate_manifest  # noqa: F401
from trainwatch.ckptschema import NAME_RE as _NAME_RE
from trainwatch.ckptschema import checkpoint_name, state_file_name  # noqa: F401

_OWNER = ".owner"
_TEMP_RE = re.compile(r"^\.tmp-(old-)?(step-\d{8,}(?:-emergency-r\d+)?)-(\d+)$")
_HASH_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """A checkpoint directory that passed verification."""

    path: Path
    """The checkpoint directory."""
    step: int
    """Last finished training step the state belongs to."""
    kind: str
    """'periodic' or 'emergency'."""
    file: Path
    """A state file whose size and sha256 match the manifest (load this one)."""
    manifest: dict
    """The parsed manifest.json."""


# ---- writing ---------------------------------------------------------------------


def ensure_writable(ckpt_dir: str | os.PathLike) -> Path:
    """Create ckpt_dir if needed and prove a file can be written there, so a bad
    --ckpt-dir fails at start-up instead of at the first save, hours later."""
    root = Path(ckpt_dir)
    probe = root / f".probe-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(
            f"--ckpt-dir must be a writable directory; got {root} ({e.strerror or e})"
        ) from None
    return root


class _HashingWriter:
    """File-like that hashes bytes on their way to disk, so a save reads nothing back."""

    def __init__(self, f: Any):
        self._f = f
        self.sha = hashlib.sha256()
        self.bytes = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.sha.update(view)
        self.bytes += view.nbytes
        return self._f.write(view)

    def flush(self) -> None:
        self._f.flush()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    ckpt_dir: str | os.PathLike,
    step: int,
    state: dict,
    *,
    kind: str = "periodic",
    keep: int | None = 3,
    rank: int = 0,
    world_size: int = 1,
    fault_point: Callable[[], None] | None = None,
    allow_nonfinite: bool = False,
) -> Path:
    """Write state atomically as checkpoint `step`; return the final directory.

    kind: 'periodic' (rank 0 writes state.pt) or 'emergency' (this rank writes
    state-rank{rank}.pt into its own directory, so ranks never collide).
    keep: after a successful save, delete the oldest complete checkpoints so
    that at most this many steps remain; None keeps everything.
    fault_point: called once the state file is open and before the rename
    (where a fault injector hangs or kills a rank mid-write).
    state holds tensors, dicts, lists, numbers and strings only, so it loads
    with torch.load(weights_only=True).
    NaN/inf in a tensor: not written (NonFiniteState) unless allow_nonfinite.
    """
    import torch

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}; got {kind!r}")
    if step < 0:
        raise ValueError(f"step must be >= 0; got {step}")
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1 or None; got {keep}")
    root = Path(ckpt_dir)
    final = root / checkpoint_name(step, kind=kind, rank=rank)
    if not allow_nonfinite and (problem := nonfinite_problem(state)):
        raise NonFiniteState(f"checkpoint {final.name} not written: {problem}; earlier checkpoints are kept")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"--ckpt-dir must be a writable directory; got {root} ({e.strerror or e})") from None
    remove_stale_temp(root)
    # Kind and rank in the temp name: an emergency save may run on a background
    # thread while the training thread writes a periodic one for the same step.
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    fname = state_file_name(kind=kind, rank=rank)
    try:
        if tmp.exists():
            shutil.rmtree(tmp)  # our own pid: a failed earlier attempt in this process
        tmp.mkdir()
        # Lets a cleaner on another node of a shared filesystem tell our pid from its own.
        (tmp / _OWNER).write_text(socket.gethostname())
        with open(tmp / fname, "wb") as f:
            if fault_point is not None:
                fault_point()
            writer = _HashingWriter(f)
            torch.save(state, writer)
            f.flush()
            os.fsync(f.fileno())
        manifest = {
            "format": FORMAT,
            "step": int(step),
            "kind": kind,
            "time": time.time(),
            "world_size": int(world_size),
            "rank": int(rank),
            "files": {fname: {"sha256": writer.sha.hexdigest(), "bytes": writer.bytes}},
            "replicated": True,
        }
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():
            # Same step saved twice (a resumed run re-saving its last step): the old
            # copy goes only after the new one is complete on disk.
            old = root / f".tmp-old-{final.name}-{os.getpid()}"
            os.rename(final, old)
            try:
                os.rename(tmp, final)
            except OSError:
                os.rename(old, final)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
        try:
            (final / _OWNER).unlink(missing_ok=True)
        except OSError:
            pass  # a leftover mark inside a complete checkpoint is harmless
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        reason = getattr(e, "strerror", None) or (str(e).splitlines() or [type(e).__name__])[0]
        if "unexpected pos" in reason or "file write failed" in reason:  # torch's words for a short write
            reason = "a short write: the disk is full or a file-size limit was reached"
        raise CheckpointError(
            f"cannot write checkpoint {final} ({reason}; {_free_space(root)} free); earlier checkpoints are "
            "kept; free space or pass a writable --ckpt-dir"
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep is not None:
        try:
            apply_retention(root, keep, trusted=final)
        except OSError as e:  # the save is done; an old checkpoint left behind is no reason to fail it
            _stderr(f"warning: checkpoint retention in {root} failed ({e.strerror or e}); older checkpoints kept")
    return final


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def _free_space(root: Path) -> str:
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return "unknown space"
    return f"{free / 2**20:.1f} MiB" if free < 2**30 else f"{free / 2**30:.1f} GiB"


def remove_stale_temp(ckpt_dir: str | os.PathLike) -> list[Path]:
    """Delete temp directories of saves whose process is gone (killed mid-write).

    A save of a step that already existed moves the old copy aside before the
    new one takes its name; killed between the two renames, neither has the
    name. The complete new copy, else the old one, is put back first: a
    checkpoint that was on disk is never deleted by a crash.
    """
    root = Path(ckpt_dir)
    removed = []
    host = socket.gethostname()
    try:
        entries = sorted(root.iterdir(), key=lambda e: not e.name.startswith(".tmp-old-"))
    except OSError:
        return removed
    for entry in entries:
        m = _TEMP_RE.match(entry.name)
        if not m or not entry.is_dir() or entry.is_symlink():
            continue
        pid = int(m.group(3))
        try:
            owner = (entry / _OWNER).read_text().strip()
        except OSError:
            owner = host  # killed before the mark was written (or a renamed-away old copy)
        if owner != host or pid == os.getpid() or _pid_alive(pid):
            continue
        final = root / m.group(2)
        if m.group(1) and not final.exists():
            new = root / f".tmp-{m.group(2)}-{pid}"
            source = new if next(valid_checkpoints(root, warn=lambda _: None, paths=[new]), None) else entry
            _restore_final(source, final)
            if source is entry and final.exists():
                continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


def _restore_final(path: Path, final: Path) -> None:
    try:
        (path / _OWNER).unlink(missing_ok=True)
        os.rename(path, final)
        _fsync_dir(final.parent)
    except OSError:
        pass


def _complete(path: Path, warn: Callable[[str], None]) -> bool:
    """Cheap check for retention: a valid manifest (else one warning) and files of its sizes."""
    try:
        manifest = validate_manifest(_read_manifest(path), path)
    except CheckpointError as e:
        if path not in _warned:
            _warned.add(path)
            warn(f"warning: skipping checkpoint: {e}")
        return False
    try:
        return all((path / name).stat().st_size == meta["bytes"] for name, meta in manifest["files"].items())
    except (OSError, ValueError):
        return False


_warned: set[Path] = set()  # invalid checkpoints warned about: one line per directory, not per save


def apply_retention(ckpt_dir: str | os.PathLike, keep: int, *, trusted: Path | None = None,
                    warn: Callable[[str], None] | None = None) -> list[Path]:
    """Delete complete checkpoints older than the newest `keep` steps; return them.
    Incomplete or invalid ones are left alone (deleting on a guess could remove
    the only copy a user has), and the newest one that verifies is never
    deleted, even when newer ones of the right size fail verification.
    `trusted`: a checkpoint just written (not read back)."""
    warn = warn or _stderr
    steps: dict[int, list[Path]] = {}
    for path, step, _kind, _rank in _candidates(Path(ckpt_dir)):
        if _complete(path, warn):
            steps.setdefault(step, []).append(path)
    order = sorted(steps, reverse=True)
    kept = [p for step in order[:keep] for p in steps[step]]
    doomed = [p for step in order[keep:] for p in steps[step]]
    if doomed and not any(p == trusted or _verifies(p) for p in kept):
        spare = next((p for p in doomed if _verifies(p)), None)
        doomed = [p for p in doomed if p != spare]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def _verifies(path: Path) -> bool:
    try:
        verify_checkpoint(path)
    except CheckpointError:
        return False
    return True


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- finding and loading -------------------------------------------------------------


def _candidates(root: Path) -> list[tuple[Path, int, str, int]]:
    """(path, step, kind, rank) of every final-named checkpoint directory, newest first;
    at equal steps a periodic checkpoint comes before emergency ones."""
    out = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return out
    for entry in entries:
        m = _NAME_RE.match(entry.name)
        if m and len(m.group(1)) <= len(str(MAX_STEP)) and entry.is_dir():
            emergency = m.group(2) is not None
            out.append((entry, int(m.group(1)), "emergency" if emergency else "periodic", int(m.group(2) or 0)))
    out.sort(key=lambda c: (-c[1], c[2] != "periodic", c[3]))
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _read_manifest(path: Path) -> Any:
    """The parsed manifest.json of checkpoint directory `path`; CheckpointError when unreadable."""
    try:
        return json.loads((path / MANIFEST).read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a complete checkpoint (no {MANIFEST})") from None
    except (OSError, ValueError, RecursionError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else (
            "nested too deep" if isinstance(e, RecursionError) else str(e).splitlines()[0] if str(e) else "")
        raise CheckpointError(f"{path}/{MANIFEST} is unreadable ({reason})") from None


def verify_checkpoint(path: str | os.PathLike) -> CheckpointInfo:
    """Check a checkpoint directory's manifest and checksums; raise CheckpointError."""
    path = Path(path)
    manifest = validate_manifest(_read_manifest(path), path)
    files, step = manifest["files"], manifest["step"]
    problems = []
    for name, meta in files.items():
        file = path / name
        try:
            size = file.stat().st_size
            digest = _sha256(file) if size == meta["bytes"] else None
        except (OSError, ValueError) as e:  # ValueError: a name the filesystem cannot hold
            problems.append(f"{name!r}: {getattr(e, 'strerror', None) or e}")
            continue
        if digest is None:
            problems.append(f"{name}: {size} bytes, manifest says {meta['bytes']}")
        elif digest != meta["sha256"]:
            problems.append(f"{name}: sha256 mismatch")
        else:
            return CheckpointInfo(path=path, step=step, kind=manifest.get("kind", "periodic"), file=file,
                                  manifest=manifest)
    raise CheckpointError(f"{path} is corrupt ({'; '.join(problems)})")


def find_latest(ckpt_dir: str | os.PathLike, *, warn: Callable[[str], None] | None = None) -> CheckpointInfo | None:
    """The newest checkpoint that verifies, or None; corrupt or truncated ones newer
    than it are skipped with a one-line warning (default: to stderr)."""
    return next(valid_checkpoints(ckpt_dir, warn=warn), None)


def valid_checkpoints(ckpt_dir: str | os.PathLike, *, warn: Callable[[str], None] | None = None,
                      paths: list[Path] | None = None) -> Iterator[CheckpointInfo]:
    """Every checkpoint that verifies, newest first (a resume falls back to an
    older one when the newest cannot be loaded); corrupt ones are skipped with
    a one-line warning (default: to stderr). `paths`: these directories instead."""
    warn = warn or _stderr
    for path in paths if paths is not None else [c[0] for c in _candidates(Path(ckpt_dir))]:
        try:
            yield verify_checkpoint(path)
        except CheckpointError as e:
            warn(f"warning: skipping checkpoint: {e}")


def load_checkpoint(path_or_info: CheckpointInfo | str | os.PathLike) -> dict:
    """Load a checkpoint's state dict onto the CPU (weights_only: no code runs on load).

    Accepts a CheckpointInfo, a checkpoint directory (verified first) or a single
    .pt file (verified against its directory's manifest when there is one).
    """
    import torch

    if isinstance(path_or_info, CheckpointInfo):
        file = path_or_info.file
    else:
        path = Path(path_or_info)
        if path.is_dir():
            file = verify_checkpoint(path).file
        elif path.is_file():
            file = path
            if (path.parent / MANIFEST).exists():
                manifest_files = _manifest_files(path.parent)
                meta = manifest_files.get(path.name)
                if meta is None or path.stat().st_size != meta.get("bytes") or _sha256(path) != meta.get("sha256"):
                    raise CheckpointError(f"{path} is corrupt (does not match {path.parent / MANIFEST})")
        else:
            raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(file, weights_only=True, map_location="cpu")
    except Exception as e:  # torch raises RuntimeError, pickle errors, EOFError... for bad files
        raise CheckpointError(f"{file} is not a loadable checkpoint ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{file} does not hold a state dict")
    return state


def _manifest_files(path: Path) -> dict:
    """{file name: {"sha256", "bytes"}} of a manifest; entries of the wrong shape left out."""
    manifest = _read_manifest(path)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    return {name: meta for name, meta in files.items() if isinstance(meta, dict)} if isinstance(files, dict) else {}
