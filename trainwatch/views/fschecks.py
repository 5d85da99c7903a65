"""Preflight checks of filesystems, checkpoints and process limits (see
`hostchecks` for the `Host` they read through and the network/NCCL/GPU checks).

/proc/mounts and checkpoint manifests are text trainwatch did not write: any
content gives a verdict, never an exception.
"""

from __future__ import annotations

import json
import os
import re
import resource
from dataclasses import dataclass
from pathlib import Path

from trainwatch.views.hostchecks import Check, Host, Options, gib, number

NETWORK_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "ceph", "glusterfs", "beegfs",
                        "afs", "panfs", "wekafs", "orangefs", "pvfs2", "9p", "virtiofs"})
"""Mount types whose file locks and small-file latency make shared caches stall."""
LOCAL_FUSE = frozenset({"fuse.lxcfs", "fuse.portal", "fuse.gvfsd-fuse", "fuse.fuse-overlayfs", "fuse.snapfuse",
                        "fuse.squashfuse"})
"""FUSE types that are local; every other fuse.* counts as remote."""
STALE_LOCK_S = 15 * 60.0
"""A torch_extensions `lock` file older than this is most likely left by a killed build."""
SHM_MIN_BYTES = 1 << 30
SHM_PER_RANK_BYTES = 256 << 20
"""Free /dev/shm per local rank: DataLoader workers pass every batch through it."""
CORE_JOB_RANKS = 8
"""From this many ranks, an unlimited core size lets one bad step write a core per rank."""
MIN_NOFILE = 4096
"""NCCL/gloo sockets and DataLoader workers' shared-memory fds need more than the common 1024."""
DEFAULT_TIMEOUT_S = {"nccl": 600.0, "gloo": 1800.0}
"""torch's default process-group timeouts."""
TIMEOUT_ENV = (("TORCH_DISTRIBUTED_TIMEOUT", 1.0), ("NCCL_TIMEOUT", 1.0), ("DEEPSPEED_TIMEOUT", 60.0))
"""Variables frameworks read the process-group timeout from, and their unit in seconds
(torch itself only takes init_process_group(timeout=...))."""
MANIFEST_MAX_BYTES = 1 << 20
_CKPT_NAME = re.compile(r"^step-(\d{8,})(-emergency-r\d+)?$")  # checkpoint.checkpoint_name's names
_TIMING_KEYS = ("save_s", "save_seconds", "load_s", "load_seconds", "duration_s")


# ---- mounts -----------------------------------------------------------------------------


def _unescape(field: str) -> str:
    # /proc/mounts writes space, tab, newline and backslash as \040 \011 \012 \134.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_of(path: str, mounts: str) -> tuple[str, str] | None:
    """(mount point, fs type) of the mount holding `path`: the longest mount point
    that is a prefix of it; of equal ones the last line (mounted on top)."""
    best: tuple[str, str] | None = None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point, fstype = _unescape(fields[1]), fields[2]
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, fstype)
    return best


def is_network_fs(fstype: str) -> bool:
    return fstype in NETWORK_FS or (fstype.startswith("fuse.") and fstype not in LOCAL_FUSE)


def _cache_fs_check(host: Host, check_id: str, runbook: str, dirs: dict[str, str], fix: str) -> Check:
    evidence = {}
    remote = []
    for label, path in dirs.items():
        real = os.path.realpath(path)
        mount = mount_of(real, host.mounts)
        evidence[label] = {"path": path, "mount": mount[0] if mount else None, "fstype": mount[1] if mount else None}
        if mount and is_network_fs(mount[1]):
            remote.append(f"{label}={path} ({mount[1]} at {mount[0]})")
    if not host.mounts.strip():
        return Check(check_id, "skip", "no mount table (/proc/mounts) to read", runbook, evidence)
    if remote:
        return Check(check_id, "warn", f"{'; '.join(remote)} is on a network filesystem: {fix}", runbook, evidence)
    return Check(check_id, "ok", f"{', '.join(dirs.values())} on a local filesystem", runbook, evidence)


def check_triton_cache_fs(host: Host, opts: Options) -> Check:
    env = host.env
    home = Path(env.get("TRITON_HOME") or host.home)
    dirs = {"TRITON_CACHE_DIR": env.get("TRITON_CACHE_DIR") or str(home / ".triton" / "cache")}
    if env.get("TORCHINDUCTOR_CACHE_DIR"):
        dirs["TORCHINDUCTOR_CACHE_DIR"] = env["TORCHINDUCTOR_CACHE_DIR"]
    return _cache_fs_check(host, "triton-cache-fs", "triton-cache-lock", dirs,
                           "point TRITON_CACHE_DIR at node-local disk (e.g. /tmp/triton-$USER)")


def extensions_dir(host: Host) -> str:
    """Where torch.utils.cpp_extension builds JIT extensions."""
    if host.env.get("TORCH_EXTENSIONS_DIR"):
        return host.env["TORCH_EXTENSIONS_DIR"]
    cache = host.env.get("XDG_CACHE_HOME") or str(Path(host.home) / ".cache")
    return str(Path(cache) / "torch_extensions")


def check_extensions_cache_fs(host: Host, opts: Options) -> Check:
    return _cache_fs_check(host, "extensions-cache-fs", "cpp-extension-lock",
                           {"TORCH_EXTENSIONS_DIR": extensions_dir(host)},
                           "set TORCH_EXTENSIONS_DIR to node-local disk, or pre-build the extension")


def check_stale_extension_lock(host: Host, opts: Options) -> Check:
    root = extensions_dir(host)
    stale, seen = [], 0
    # torch builds in ROOT/<python_cuda tag>/<name>/ (older versions: ROOT/<name>/); a waiter polls `lock` there.
    level = [root]
    for _depth in range(2):
        below = []
        for folder in level:
            try:
                with os.scandir(folder) as it:
                    entries = [e for _, e in zip(range(500), it)]
            except OSError:
                continue
            for e in entries:
                seen += 1
                if e.is_dir(follow_symlinks=False):
                    below.append(e.path)
                    lock = os.path.join(e.path, "lock")
                    try:
                        age = host.now() - os.stat(lock).st_mtime
                    except OSError:
                        continue
                    if age > STALE_LOCK_S:
                        stale.append((lock, round(age)))
        level = below
    evidence = {"dir": root, "stale_locks": [{"path": p, "age_s": a} for p, a in stale[:10]],
                "older_than_s": STALE_LOCK_S}
    if stale:
        return Check("stale-extension-lock", "warn", f"{len(stale)} build lock(s) older than "
                     f"{STALE_LOCK_S / 60:.0f} min, e.g. {stale[0][0]}: ranks building that extension wait forever; "
                     "delete the lock if no ninja/nvcc build is running", "cpp-extension-lock", evidence)
    return Check("stale-extension-lock", "ok", "no stale build lock" + ("" if seen else f" ({root} is empty or absent)"),
                 "cpp-extension-lock", evidence)


# ---- checkpoints ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NewestCheckpoint:
    path: Path
    bytes: int
    manifest: dict | None


def read_manifest(path: Path) -> dict | None:
    """A checkpoint's manifest.json as a dict, or None: missing, too big, not JSON, not an object."""
    try:
        with open(path / "manifest.json", "rb") as f:
            data = f.read(MANIFEST_MAX_BYTES + 1)
        if len(data) > MANIFEST_MAX_BYTES:
            return None
        value = json.loads(data)
    except (OSError, ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _size(path: Path, manifest: dict | None) -> int:
    files = manifest.get("files") if manifest else None
    if isinstance(files, dict) and files:
        sizes = [number(meta.get("bytes")) if isinstance(meta, dict) else None for meta in files.values()]
        if all(s is not None for s in sizes):
            return int(sum(sizes))
    total = 0
    try:
        with os.scandir(path) as it:
            for _, e in zip(range(10_000), it):
                if e.is_file(follow_symlinks=False):
                    total += e.stat(follow_symlinks=False).st_size
    except OSError:
        pass
    return total


def newest_checkpoint(ckpt_dir: Path) -> NewestCheckpoint | None:
    """The newest step's checkpoint directory (periodic before emergency), unverified:
    a doctor reads sizes and timings, it does not hash gigabytes."""
    best = None
    try:
        with os.scandir(ckpt_dir) as it:
            for e in it:
                m = _CKPT_NAME.match(e.name)
                if m and e.is_dir():
                    key = (int(m.group(1)), m.group(2) is None)
                    if best is None or key > best[0]:
                        best = (key, Path(e.path))
    except OSError:
        return None
    if best is None:
        return None
    manifest = read_manifest(best[1])
    return NewestCheckpoint(best[1], _size(best[1], manifest), manifest)


def manifest_seconds(manifest: dict | None) -> dict[str, float]:
    """Save/load times a manifest records ({} when none: trainwatch's own manifests do not)."""
    if not manifest:
        return {}
    timing = manifest.get("timing")
    found = {}
    for source in (manifest, timing if isinstance(timing, dict) else {}):
        for key in _TIMING_KEYS:
            value = number(source.get(key))
            if value is not None:
                found[key] = value
    return found


def _no_ckpt(check_id: str, runbook: str, opts: Options) -> Check | None:
    if opts.ckpt_dir is None:
        return Check(check_id, "skip", "no checkpoint directory (give --ckpt-dir or TRAINWATCH_CKPT_DIR)", runbook,
                     {})
    return None


def check_collective_timeout(host: Host, opts: Options) -> Check:
    runbook = "collective-timeout"
    if (skip := _no_ckpt("collective-timeout", runbook, opts)) is not None:
        return skip
    backend = "nccl" if host.gpus else "gloo"
    timeout, source = DEFAULT_TIMEOUT_S[backend], f"{backend} default"
    for var, unit in TIMEOUT_ENV:
        raw = host.env.get(var)
        if raw is not None:
            value = number(raw)
            if value is None or value == 0:
                return Check("collective-timeout", "warn", f"{var}={raw} is not a positive number: set it in "
                             f"{'minutes' if unit == 60 else 'seconds'} or unset it", runbook, {var: raw})
            timeout, source = value * unit, var
            break
    evidence: dict = {"timeout_s": timeout, "timeout_from": source, "ckpt_dir": str(opts.ckpt_dir)}
    newest = newest_checkpoint(opts.ckpt_dir)
    if newest is None:
        return Check("collective-timeout", "skip", f"no checkpoint in {opts.ckpt_dir} yet", runbook, evidence)
    evidence["checkpoint"] = str(newest.path)
    times = manifest_seconds(newest.manifest)
    evidence["recorded"] = times
    if not times:
        return Check("collective-timeout", "skip", f"{newest.path.name}/manifest.json records no save/load time",
                     runbook, evidence)
    longest = max(times.values())
    fix = ("raise the process-group timeout (init_process_group(timeout=...)) well above it, or save "
           "asynchronously")
    if longest >= timeout:
        return Check("collective-timeout", "fail", f"the last checkpoint took {longest:.0f} s, longer than the "
                     f"{timeout:.0f} s collective timeout ({source}): ranks waiting for it time out; {fix}",
                     runbook, evidence)
    if 2 * longest >= timeout:
        return Check("collective-timeout", "warn", f"the last checkpoint took {longest:.0f} s, over half the "
                     f"{timeout:.0f} s collective timeout ({source}): {fix}", runbook, evidence)
    return Check("collective-timeout", "ok", f"checkpoint {longest:.0f} s vs collective timeout {timeout:.0f} s",
                 runbook, evidence)


def _free(host: Host, path: Path) -> tuple[int, int]:
    """(free bytes for unprivileged users, total bytes) of the filesystem holding path
    (its nearest existing parent when it is not there yet)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    st = host.statvfs(str(probe))
    return int(st.f_bavail) * int(st.f_frsize), int(st.f_blocks) * int(st.f_frsize)


def check_checkpoint_space(host: Host, opts: Options) -> Check:
    if (skip := _no_ckpt("checkpoint-space", "checkpoint-io", opts)) is not None:
        return skip
    try:
        free, _total = _free(host, opts.ckpt_dir)
    except OSError as e:
        return Check("checkpoint-space", "skip", f"cannot statvfs {opts.ckpt_dir} ({e.strerror or e})",
                     "checkpoint-io", {"ckpt_dir": str(opts.ckpt_dir)})
    evidence: dict = {"ckpt_dir": str(opts.ckpt_dir), "free_bytes": free}
    newest = newest_checkpoint(opts.ckpt_dir)
    if newest is None:
        return Check("checkpoint-space", "skip", f"no checkpoint in {opts.ckpt_dir} yet ({gib(free)} free)",
                     "checkpoint-io", evidence)
    evidence.update(checkpoint=str(newest.path), checkpoint_bytes=newest.bytes)
    # A save writes the new checkpoint in full before retention deletes an old one.
    if free < newest.bytes:
        return Check("checkpoint-space", "fail", f"{gib(free)} free in {opts.ckpt_dir}, less than one "
                     f"checkpoint ({gib(newest.bytes)}): the next save fails; free space or move --ckpt-dir",
                     "checkpoint-io", evidence)
    if free < 2 * newest.bytes:
        return Check("checkpoint-space", "warn", f"{gib(free)} free in {opts.ckpt_dir}, less than two "
                     f"checkpoints ({gib(2 * newest.bytes)}): free space or keep fewer checkpoints",
                     "checkpoint-io", evidence)
    return Check("checkpoint-space", "ok", f"{gib(free)} free, checkpoints are {gib(newest.bytes)}",
                 "checkpoint-io", evidence)


# ---- shared memory and limits -------------------------------------------------------------


def check_shm_size(host: Host, opts: Options) -> Check:
    try:
        st = host.statvfs("/dev/shm")  # not its parent when absent: that would be the root disk
        free, total = int(st.f_bavail) * int(st.f_frsize), int(st.f_blocks) * int(st.f_frsize)
    except OSError as e:
        return Check("shm-size", "skip", f"cannot statvfs /dev/shm ({e.strerror or e})",
                     "dataloader-worker-killed", {})
    local = opts.local_ranks(host.env) or 1
    need = local * SHM_PER_RANK_BYTES
    evidence = {"total_bytes": total, "free_bytes": free, "local_ranks": local, "wanted_free_bytes": need}
    fix = "enlarge it (docker --shm-size=16g, a bigger emptyDir medium: Memory) or lower num_workers"
    if total < SHM_MIN_BYTES:
        return Check("shm-size", "warn", f"/dev/shm is {gib(total)}: DataLoader workers die with a bus error; {fix}",
                     "dataloader-worker-killed", evidence)
    if free < need:
        return Check("shm-size", "warn", f"/dev/shm has {gib(free)} free for {local} ranks (want {gib(need)}): {fix}",
                     "dataloader-worker-killed", evidence)
    return Check("shm-size", "ok", f"/dev/shm {gib(free)} free of {gib(total)}", "dataloader-worker-killed",
                 evidence)


def _limit(value: int) -> str | int:
    return "unlimited" if value < 0 or value == resource.RLIM_INFINITY else value


def check_core_ulimit(host: Host, opts: Options) -> Check:
    soft, hard = host.getrlimit(resource.RLIMIT_CORE)
    world = opts.world_size(host.env)
    evidence = {"soft": _limit(soft), "hard": _limit(hard), "world_size": world}
    if _limit(soft) != "unlimited":
        return Check("core-ulimit", "ok", "core dumps are off" if soft == 0 else f"core files limited to {soft} bytes",
                     "process-limits", evidence)
    if world is None or world < CORE_JOB_RANKS:
        return Check("core-ulimit", "ok", "core size unlimited on a small job", "process-limits", evidence)
    return Check("core-ulimit", "warn", f"core size is unlimited on a {world}-rank job: ranks that crash together "
                 "each dump their whole address space and fill the disk; run `ulimit -c 0` (or a bounded size) "
                 "before launching", "process-limits", evidence)


def check_nofile_ulimit(host: Host, opts: Options) -> Check:
    soft, hard = host.getrlimit(resource.RLIMIT_NOFILE)
    evidence = {"soft": _limit(soft), "hard": _limit(hard), "minimum": MIN_NOFILE}
    if _limit(soft) == "unlimited" or soft >= MIN_NOFILE:
        return Check("nofile-ulimit", "ok", f"open files limit {_limit(soft)}", "process-limits", evidence)
    room = "" if _limit(hard) == "unlimited" or hard >= MIN_NOFILE else " (the hard limit too: limits.conf/systemd)"
    return Check("nofile-ulimit", "warn", f"open files limited to {soft}: NCCL/gloo sockets and DataLoader workers "
                 f"run out (\"Too many open files\"); run `ulimit -n 65536` before launching{room}",
                 "process-limits", evidence)
