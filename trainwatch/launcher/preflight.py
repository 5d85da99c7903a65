"""The doctor's checks at the top of `trainwatch launch`, and the GPU list both
read from NVML (the views layer the checks live in cannot import NVML).

A launch prints one `[trainwatch] doctor: <id>: <message>` line per warning or
failure and goes on; with `--strict` a failing check stops it (exit 2, one
`error:` line per failure) before any rank starts.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from trainwatch import env
from trainwatch.usage import printable
from trainwatch.views import doctor
from trainwatch.views.hostchecks import GpuInfo, Options, port_options, positive_int
from trainwatch.watchdog.nvml import NvmlPoller

NVLINK_DEVICE_TYPE_SWITCH = 2
"""NVML_NVLINK_DEVICE_TYPE_SWITCH, as defined in nvml.h."""


def read_gpus(nvml: Any | None = None) -> tuple[tuple[GpuInfo, ...] | None, str]:
    """(the GPUs NVML sees, or None; why None). Never raises: a machine without
    a driver or library is 'no GPU'."""
    poller = NvmlPoller(nvml)
    if poller.nvml is None:
        return None, "no GPU: pynvml is not installed"
    try:
        if not poller.start():
            return None, "no GPU: NVML cannot start (no driver or library)"
        try:
            return tuple(_gpu(poller, index, handle) for index, handle in poller.handles()), ""
        finally:
            poller.shutdown()
    except Exception as e:  # noqa: BLE001 - a broken driver is a skipped check, not a failed launch
        return None, f"no GPU: NVML failed ({type(e).__name__}: {e})"


def _gpu(poller: NvmlPoller, index: int, handle: Any) -> GpuInfo:
    nv = poller.nvml

    def read(name: str, *args: Any) -> Any:
        fn = getattr(nv, name, None)
        if fn is None:
            return None
        try:
            return fn(handle, *args)
        except nv.NVMLError:
            return None

    uuid, name, cc = read("nvmlDeviceGetUUID"), read("nvmlDeviceGetName"), read("nvmlDeviceGetCudaComputeCapability")
    nvswitch: bool | None = None
    for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
        if not read("nvmlDeviceGetNvLinkState", link):
            continue  # inactive, absent, or not supported
        kind = read("nvmlDeviceGetNvLinkRemoteDeviceType", link)
        if kind is None:
            continue
        nvswitch = nvswitch or int(kind) == NVLINK_DEVICE_TYPE_SWITCH
    return GpuInfo(index=index, uuid=_text(uuid), name=_text(name),
                   compute_capability=(int(cc[0]), int(cc[1])) if isinstance(cc, tuple) and len(cc) == 2 else None,
                   nvswitch=nvswitch)


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def check_launch(args: argparse.Namespace) -> None:
    """Run the checks for the launch `args` describe; print its warnings; under
    --strict raise LaunchError when one fails."""
    from trainwatch.launcher.options import LaunchError  # numpy and the detectors: not for `trainwatch doctor`

    gpus, reason = read_gpus()
    ckpt = os.environ.get(env.CKPT_DIR)
    # The port the job will use is the flag's, not only MASTER_PORT's; a
    # multi-node job's --rdzv-endpoint is in use wherever another node hosts it.
    single = doctor.parse_nnodes(args.nnodes) == 1
    ports = port_options(getattr(args, "master_port", None), getattr(args, "master_addr", None),
                         getattr(args, "rdzv_endpoint", None) if single else None)
    opts = Options(nproc_per_node=positive_int(args.nproc_per_node), nnodes=doctor.parse_nnodes(args.nnodes),
                   ckpt_dir=Path(ckpt) if ckpt and "\0" not in ckpt and not doctor.ckpt_dir_problem(Path(ckpt))
                   else None, **ports)
    checks = doctor.run_checks(doctor.real_host(gpus, reason), opts)
    for c in checks:
        if c.verdict in ("warn", "fail"):
            print(printable(f"[trainwatch] doctor: {c.id}: {c.message}"), flush=True)
    failed = [c for c in checks if c.verdict == "fail"]
    if failed and getattr(args, "strict", False):
        # usage.fail prefixes the first line; the others get theirs here: one `error:` line per failure.
        raise LaunchError(printable("\nerror: ".join(f"doctor: {c.id}: {c.message} (--strict)" for c in failed)))


def check_master_port(args: argparse.Namespace) -> None:
    """A --master-port something on this machine already listens on fails every
    rank (after torch's timeout): say it now, in one line."""
    from trainwatch.views.hostchecks import probe_port, resolve_with_timeout
    from trainwatch.launcher.options import LaunchError

    try:
        addresses = resolve_with_timeout(args.master_addr or "127.0.0.1")
    except OSError:
        return
    if addresses and probe_port(addresses, int(args.master_port)) == "taken":
        raise LaunchError(f"--master-port {args.master_port} is already in use on this machine: pick a free port "
                          "(or leave --master-port out for a free one), or stop what listens there")
