"""`trainwatch doctor [--json] [--nproc-per-node N] [--nnodes N] [--ckpt-dir DIR]`:
preflight checks for settings that hang or break a distributed job, run before
it starts (and at the top of every `trainwatch launch`).

Exit code 0 when no check fails (warnings allowed), 1 when one does, 2 for bad
input. The GPU list comes from the caller (the cli reads NVML): this layer
imports nothing of the watchdog.
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Callable
from pathlib import Path

from trainwatch import env
from trainwatch.usage import Parser, fail, printable
from trainwatch.views import fschecks, hostchecks
from trainwatch.views.hostchecks import Check, GpuInfo, Host, Options

USAGE = ("usage: trainwatch doctor [--json] [--nproc-per-node N] [--nnodes N] [--ckpt-dir DIR] "
         "[--master-addr HOST] [--master-port PORT | --rdzv-endpoint HOST:PORT]")

CHECKS: tuple[Callable[[Host, Options], Check], ...] = (
    hostchecks.check_nccl_socket_ifname, hostchecks.check_gloo_socket_ifname, hostchecks.check_nccl_proto_algo,
    hostchecks.check_nccl_nvls, hostchecks.check_nccl_debug, hostchecks.check_gpu_count,
    hostchecks.check_master_addr, hostchecks.check_master_port,
    fschecks.check_collective_timeout, fschecks.check_triton_cache_fs, fschecks.check_extensions_cache_fs,
    fschecks.check_stale_extension_lock, fschecks.check_checkpoint_space, fschecks.check_shm_size,
    fschecks.check_core_ulimit, fschecks.check_nofile_ulimit,
)
"""Every check, in the order they print."""


def run_checks(host: Host, opts: Options) -> list[Check]:
    """Every check, in order; a check that breaks on input nobody foresaw is a
    skip naming the error, never a traceback in a job's launch."""
    results = []
    for check in CHECKS:
        name = check.__name__.removeprefix("check_").replace("_", "-")
        try:
            results.append(check(host, opts))
        except Exception as e:  # noqa: BLE001 - one check must not stop the others or the launch
            results.append(Check(name, "skip", f"check failed: {type(e).__name__}: {e}", "hang", {}))
    return results


def real_host(gpus: tuple[GpuInfo, ...] | None = None, gpu_reason: str = "no GPU") -> Host:
    """This machine, as the checks read it."""
    try:
        with open("/proc/mounts", "rb") as f:
            mounts = f.read(4 << 20).decode("utf-8", "replace")
    except OSError:
        mounts = ""
    return Host(env=dict(os.environ), root=Path("/"), mounts=mounts, home=Path.home(), statvfs=os.statvfs,
                getrlimit=resource.getrlimit, resolve=hostchecks.resolve_with_timeout,
                port_probe=hostchecks.probe_port, gpus=gpus, gpu_reason=gpu_reason, now=time.time)


def ckpt_dir_problem(path: Path) -> str | None:
    """Why `path` cannot be a checkpoint directory (a file, or under one), else None;
    a directory that does not exist yet is fine (the job creates it)."""
    for p in (path, *path.parents):
        try:
            if p.exists():
                return None if p.is_dir() else f"{p} is not a directory"
        except OSError as e:
            return f"{p}: {e.strerror or e}"
    return None


def parse_nnodes(value: object) -> int | None:
    """The largest node count of 'N' or 'MIN:MAX'; None when it is neither."""
    return hostchecks.positive_int(str(value).rpartition(":")[2])


def summary(checks: list[Check]) -> str:
    counts = {v: sum(c.verdict == v for c in checks) for v in hostchecks.VERDICTS}
    return (f"doctor: {len(checks)} checks: " + ", ".join(f"{n} {v}" for v, n in counts.items())
            + ("; `trainwatch runbook ID` says more" if counts["warn"] or counts["fail"] else ""))


def main(argv: list[str], *, gpus: tuple[GpuInfo, ...] | None = None, gpu_reason: str = "no GPU",
         host: Host | None = None) -> int:
    p = Parser(prog="trainwatch doctor", usage_hint=USAGE)
    p.add_argument("--json", action="store_true")
    p.add_argument("--nproc-per-node", type=int, default=None, metavar="N")
    p.add_argument("--nnodes", default=None, metavar="N")
    p.add_argument("--ckpt-dir", default=None, metavar="DIR")
    p.add_argument("--master-addr", default=None, metavar="HOST")
    p.add_argument("--master-port", type=int, default=None, metavar="PORT")
    p.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT")
    args = p.parse_args(argv)
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        return fail(f"--nproc-per-node must be a positive integer; got {args.nproc_per_node} ({USAGE})")
    nnodes = None
    if args.nnodes is not None and (nnodes := parse_nnodes(args.nnodes)) is None:
        return fail(f"--nnodes must be N or MIN:MAX; got {args.nnodes!r} ({USAGE})")
    ckpt = args.ckpt_dir if args.ckpt_dir is not None else os.environ.get(env.CKPT_DIR) or None
    if ckpt is not None:
        where = "--ckpt-dir" if args.ckpt_dir is not None else env.CKPT_DIR
        problem = ckpt_dir_problem(Path(ckpt)) if ckpt.strip() and "\0" not in ckpt else "empty or not a path"
        if problem:
            return fail(printable(f"{where} must be a directory (or not exist yet); {problem}"))
    host = host or real_host(gpus, gpu_reason)
    ports = hostchecks.port_options(args.master_port, args.master_addr, args.rdzv_endpoint)
    checks = run_checks(host, Options(nproc_per_node=args.nproc_per_node, nnodes=nnodes,
                                      ckpt_dir=Path(ckpt) if ckpt else None, **ports))
    failed = any(c.verdict == "fail" for c in checks)
    if args.json:
        print(json.dumps({"checks": [c.to_json() for c in checks], "ok": not failed}, indent=2, default=str))
    else:
        for c in checks:
            hint = f"  [runbook {c.runbook}]" if c.verdict in ("warn", "fail") else ""
            print(printable(f"{c.verdict:<5} {c.id:<22} {c.message}{hint}"))
        print(summary(checks))
    return 1 if failed else 0
