"""Preflight checks for `trainwatch doctor` (and the top of `trainwatch launch`):
settings that make a distributed job hang or fail, found before it starts.

Every check reads the machine only through one `Host` (environment, a root for
/sys/class/net, the text of /proc/mounts, statvfs, getrlimit, a resolver, a port
probe, the GPUs NVML reported), so tests hand in a fake machine. A check never
raises: what it cannot read is a `skip` with the reason. The filesystem,
checkpoint and limit checks live in `fschecks`; `doctor.CHECKS` lists them all.
"""

from __future__ import annotations

import errno
import math
import os
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VERDICTS = ("ok", "warn", "fail", "skip")

LARGE_JOB_RANKS = 64
"""NCCL_DEBUG=INFO from this many ranks on: every rank logs its rings, trees and
channels for every communicator it creates, gigabytes on a big job."""
RESOLVE_TIMEOUT_S = 0.1
"""How long MASTER_ADDR may take to resolve before the check gives up (a skip)."""


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """One GPU as NVML reported it; None where NVML could not tell."""

    index: int
    """NVML device index."""
    uuid: str | None = None
    """'GPU-...' (CUDA_VISIBLE_DEVICES may name a GPU by it)."""
    name: str | None = None
    """Product name, e.g. 'NVIDIA H100 80GB HBM3'."""
    compute_capability: tuple[int, int] | None = None
    """(major, minor): NVLS needs 9.0 (Hopper) or newer."""
    nvswitch: bool | None = None
    """True when an active NVLink of this GPU ends at an NVSwitch."""


@dataclass(kw_only=True, slots=True)
class Host:
    """Everything the checks read about the machine, injectable for tests."""

    env: Mapping[str, str]
    """The environment the job will get."""
    root: Path = Path("/")
    """Root under which sys/class/net is listed."""
    mounts: str = ""
    """Text of /proc/mounts."""
    home: Path = Path("~")
    """The user's home: default cache directories are under it."""
    statvfs: Callable[[str], Any] = os.statvfs
    """statvfs(path) -> f_bavail, f_blocks, f_frsize."""
    getrlimit: Callable[[int], tuple[int, int]] = lambda _resource: (-1, -1)
    """resource.getrlimit."""
    resolve: Callable[[str], list[str]] = lambda name: [name]
    """Host name -> addresses; OSError when it does not resolve, TimeoutError when too slow."""
    port_probe: Callable[[list[str], int], str] = lambda _addrs, _port: "free"
    """(addresses, port) -> 'free', 'taken', 'remote' (not this machine) or 'error: ...'."""
    gpus: tuple[GpuInfo, ...] | None = None
    """The GPUs NVML sees; None when NVML could not start."""
    gpu_reason: str = "no GPU"
    """Why gpus is None (e.g. 'no GPU: NVML Shared Library Not Found')."""
    now: Callable[[], float] = lambda: 0.0
    """Wall-clock time (file ages)."""
    _resolved: dict = field(default_factory=dict)

    def lookup(self, name: str) -> list[str] | BaseException:
        """resolve(name), asked once per Host: the addresses or the error."""
        if name not in self._resolved:
            try:
                self._resolved[name] = list(self.resolve(name))
            except (OSError, ValueError, UnicodeError) as e:  # TimeoutError is an OSError
                self._resolved[name] = e
        return self._resolved[name]


@dataclass(frozen=True, slots=True)
class Options:
    """What the job will be; None where the caller does not know."""

    nproc_per_node: int | None = None
    """Ranks on this node (--nproc-per-node)."""
    nnodes: int | None = None
    """Nodes of the job (the largest of --nnodes MIN:MAX)."""
    ckpt_dir: Path | None = None
    """The job's checkpoint directory (--ckpt-dir, TRAINWATCH_CKPT_DIR)."""
    master_port: int | None = None
    """The port the job's store listens on (--master-port, or --rdzv-endpoint's), over MASTER_PORT."""
    master_addr: str | None = None
    """Its host (--master-addr, or --rdzv-endpoint's), over MASTER_ADDR."""
    port_flag: str = "MASTER_PORT"
    """Where master_port came from, as the user wrote it (named in the message)."""

    def world_size(self, env: Mapping[str, str]) -> int | None:
        if self.nproc_per_node is not None:
            return self.nproc_per_node * (self.nnodes or 1)
        return positive_int(env.get("WORLD_SIZE"))

    def local_ranks(self, env: Mapping[str, str]) -> int | None:
        return self.nproc_per_node or positive_int(env.get("LOCAL_WORLD_SIZE"))


@dataclass(frozen=True, slots=True)
class Check:
    """One check's result: `message` names the fix (for skip: why it did not run)."""

    id: str
    verdict: str
    message: str
    runbook: str
    evidence: dict

    def to_json(self) -> dict:
        return {"id": self.id, "verdict": self.verdict, "message": self.message, "runbook": self.runbook,
                "evidence": self.evidence}


def positive_int(value: object) -> int | None:
    try:
        n = int(str(value).strip())
    except (TypeError, ValueError):
        return None
    return n if n > 0 else None


def number(value: object) -> float | None:
    """A finite number >= 0 (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        n = float(value)
    except (ValueError, OverflowError):
        return None
    return n if math.isfinite(n) and n >= 0 else None


def gib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB" if n < 2**30 else f"{n / 2**30:.1f} GiB"


# ---- network ------------------------------------------------------------------------


def interfaces(host: Host) -> dict[str, str] | None:
    """{interface: operstate} from sys/class/net; None when it cannot be listed."""
    net = host.root / "sys" / "class" / "net"
    try:
        names = sorted(p.name for p in net.iterdir())
    except OSError:
        return None
    states = {}
    for name in names:
        try:
            states[name] = (net / name / "operstate").read_text(errors="replace").strip() or "unknown"
        except OSError:
            states[name] = "unknown"
    return states


def match_ifname(spec: str, names: list[str], *, prefix: bool = True) -> list[str]:
    """The interfaces NCCL would use for NCCL_SOCKET_IFNAME=spec: a comma list of
    prefixes, `=` for exact names, a leading `^` to exclude instead (`^=` both)."""
    spec = spec.strip()
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=") or not prefix
    spec = spec.removeprefix("=")
    wanted = [w.strip() for w in spec.split(",") if w.strip()]

    def hit(name: str) -> bool:
        return any(name == w if exact else name.startswith(w) for w in wanted)

    return [n for n in names if hit(n) != exclude]


def _ifname_check(host: Host, var: str, check_id: str, *, prefix: bool) -> Check:
    value = host.env.get(var)
    if value is None or not value.strip():
        return Check(check_id, "ok", f"{var} is not set: the library picks an interface", "nccl-init-hang",
                     {var: value})
    have = interfaces(host)
    if have is None:
        return Check(check_id, "skip", f"cannot list {host.root / 'sys/class/net'}", "nccl-init-hang",
                     {var: value})
    used = match_ifname(value, list(have), prefix=prefix)
    evidence = {var: value, "interfaces": have, "matched": used}
    if not used:
        return Check(check_id, "fail", f"{var}={value} matches no interface of this machine "
                     f"({', '.join(have) or 'none'}): set it to one of them or unset it", "nccl-init-hang", evidence)
    if all(have[n] == "down" for n in used):
        return Check(check_id, "warn", f"{var}={value} matches only interfaces that are down ({', '.join(used)}): "
                     "bring one up or name another", "nccl-init-hang", evidence)
    return Check(check_id, "ok", f"{var}={value} matches {', '.join(used)}", "nccl-init-hang", evidence)


def check_nccl_socket_ifname(host: Host, opts: Options) -> Check:
    return _ifname_check(host, "NCCL_SOCKET_IFNAME", "nccl-socket-ifname", prefix=True)


def check_gloo_socket_ifname(host: Host, opts: Options) -> Check:
    # gloo takes exact interface names (a comma list), no prefixes.
    return _ifname_check(host, "GLOO_SOCKET_IFNAME", "gloo-socket-ifname", prefix=False)


def check_master_addr(host: Host, opts: Options) -> Check:
    addr = host.env.get("MASTER_ADDR")
    if not addr:
        return Check("master-addr", "ok", "MASTER_ADDR is not set (the launcher's rendezvous sets it per rank)",
                     "nccl-init-hang", {"MASTER_ADDR": addr})
    found = host.lookup(addr)
    if isinstance(found, TimeoutError):
        return Check("master-addr", "skip", f"MASTER_ADDR={addr} did not resolve within "
                     f"{RESOLVE_TIMEOUT_S * 1000:.0f} ms (slow resolver)", "nccl-init-hang", {"MASTER_ADDR": addr})
    if isinstance(found, BaseException) or not found:
        return Check("master-addr", "fail", f"MASTER_ADDR={addr} does not resolve ({found or 'no address'}): "
                     "fix the name or give the master's IP address", "nccl-init-hang",
                     {"MASTER_ADDR": addr, "error": str(found)})
    return Check("master-addr", "ok", f"MASTER_ADDR={addr} resolves to {', '.join(found)}", "nccl-init-hang",
                 {"MASTER_ADDR": addr, "addresses": found})


def check_master_port(host: Host, opts: Options) -> Check:
    raw = str(opts.master_port) if opts.master_port is not None else host.env.get("MASTER_PORT")
    flag = opts.port_flag if opts.master_port is not None else "MASTER_PORT"
    addr = opts.master_addr or host.env.get("MASTER_ADDR")
    evidence: dict = {"MASTER_PORT": raw, "MASTER_ADDR": addr, "from": flag}
    if raw is None:
        return Check("master-port", "ok", "MASTER_PORT is not set", "nccl-init-hang", evidence)
    port = positive_int(raw)
    if port is None or port > 65535:
        return Check("master-port", "fail", f"{flag}={raw} is not a port: set 1..65535 (e.g. 29500)",
                     "nccl-init-hang", evidence)
    found = host.lookup(addr or "127.0.0.1")
    if isinstance(found, BaseException) or not found:
        return Check("master-port", "skip", "MASTER_ADDR does not resolve: port not probed", "nccl-init-hang",
                     evidence)
    state = host.port_probe(found, port)
    evidence["probe"] = state
    if state == "taken":
        return Check("master-port", "fail", f"{flag}={port} is already in use on this machine: pick a free "
                     "port or stop what listens there", "nccl-init-hang", evidence)
    if state == "remote":
        return Check("master-port", "ok", f"MASTER_ADDR is another machine; port {port} is checked there",
                     "nccl-init-hang", evidence)
    if state != "free":
        return Check("master-port", "skip", f"cannot probe port {port} ({state})", "nccl-init-hang", evidence)
    return Check("master-port", "ok", f"{flag}={port} is free here", "nccl-init-hang", evidence)


def port_options(master_port: int | None, master_addr: str | None, rdzv_endpoint: str | None) -> dict:
    """Options' master_port/master_addr/port_flag from launch-style flags: --master-port wins,
    else --rdzv-endpoint HOST:PORT; {} when neither names a port."""
    if master_port is not None:
        return {"master_port": master_port, "master_addr": master_addr, "port_flag": "--master-port"}
    host, sep, port = str(rdzv_endpoint or "").rpartition(":")
    if sep and port.isdigit() and int(port) > 0:
        return {"master_port": int(port), "master_addr": host.strip("[]") or None, "port_flag": "--rdzv-endpoint"}
    return {}


def resolve_with_timeout(name: str, timeout_s: float = RESOLVE_TIMEOUT_S) -> list[str]:
    """The addresses of `name` from the local resolver, waiting at most timeout_s
    (getaddrinfo has no timeout of its own: it runs on a daemon thread)."""
    result: dict = {}

    def work() -> None:
        try:
            infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
            result["addrs"] = sorted({str(info[4][0]) for info in infos})
        except (OSError, ValueError, UnicodeError) as e:
            result["error"] = e

    thread = threading.Thread(target=work, name="trainwatch-doctor-resolve", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {timeout_s * 1000:.0f} ms")
    if "error" in result:
        raise OSError(str(result["error"]))
    return result["addrs"]


def probe_port(addresses: list[str], port: int) -> str:
    """'taken' when something on this machine holds `port`, 'free', 'remote' when
    none of `addresses` is this machine's, 'error: ...' when it cannot tell."""
    local = False
    for addr in addresses:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr, 0))
            local = True
            break
        except OSError:
            continue  # EADDRNOTAVAIL: an address of another machine
    if not local:
        return "remote"
    # torch's TCPStore listens on every address of the master, so any listener on the port collides.
    for family, wildcard in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 here
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((wildcard, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return "taken"
                if family == socket.AF_INET:
                    return f"error: {e.strerror or e}"
    return "free"


# ---- NCCL knobs ------------------------------------------------------------------------


def check_nccl_proto_algo(host: Host, opts: Options) -> Check:
    set_ = {k: host.env[k] for k in ("NCCL_PROTO", "NCCL_ALGO") if host.env.get(k)}
    if not set_:
        return Check("nccl-proto-algo", "ok", "NCCL_PROTO and NCCL_ALGO are not set", "nccl-env-overrides", {})
    shown = " ".join(f"{k}={v}" for k, v in set_.items())
    return Check("nccl-proto-algo", "warn", f"{shown} forces NCCL's protocol/algorithm (a debugging knob that can "
                 "hang or slow collectives): unset it unless a measurement says otherwise", "nccl-env-overrides", set_)


def check_nccl_nvls(host: Host, opts: Options) -> Check:
    value = host.env.get("NCCL_NVLS_ENABLE")
    evidence: dict = {"NCCL_NVLS_ENABLE": value}
    if value is None or value.strip() != "1":
        return Check("nccl-nvls", "ok", "NCCL_NVLS_ENABLE is not forced on", "nccl-env-overrides", evidence)
    if not host.gpus:
        return Check("nccl-nvls", "skip", f"{host.gpu_reason if host.gpus is None else 'no GPU'}: "
                     "NVLS support not checked", "nccl-env-overrides", evidence)
    evidence["gpus"] = [{"index": g.index, "name": g.name, "nvswitch": g.nvswitch,
                         "compute_capability": list(g.compute_capability) if g.compute_capability else None}
                        for g in host.gpus]
    fix = "unset NCCL_NVLS_ENABLE (NCCL turns NVLS on by itself where it works)"
    if any(g.compute_capability and g.compute_capability < (9, 0) for g in host.gpus):
        return Check("nccl-nvls", "warn", f"NCCL_NVLS_ENABLE=1 but NVLS needs Hopper (sm90) or newer GPUs: {fix}",
                     "nccl-env-overrides", evidence)
    if any(g.nvswitch is True for g in host.gpus):
        return Check("nccl-nvls", "ok", "NCCL_NVLS_ENABLE=1 and the GPUs' NVLinks reach an NVSwitch",
                     "nccl-env-overrides", evidence)
    if all(g.nvswitch is False for g in host.gpus):
        return Check("nccl-nvls", "warn", f"NCCL_NVLS_ENABLE=1 but no GPU has an NVLink to an NVSwitch: {fix}",
                     "nccl-env-overrides", evidence)
    return Check("nccl-nvls", "skip", "NVML cannot tell whether the GPUs' NVLinks reach an NVSwitch",
                 "nccl-env-overrides", evidence)


def check_nccl_debug(host: Host, opts: Options) -> Check:
    value = host.env.get("NCCL_DEBUG")
    world = opts.world_size(host.env)
    evidence = {"NCCL_DEBUG": value, "world_size": world}
    if value is None or value.strip().upper() not in ("INFO", "TRACE"):
        return Check("nccl-debug", "ok", "NCCL_DEBUG is not INFO/TRACE", "nccl-env-overrides", evidence)
    if world is None:
        return Check("nccl-debug", "skip", f"NCCL_DEBUG={value}, world size unknown (give --nproc-per-node or "
                     "WORLD_SIZE)", "nccl-env-overrides", evidence)
    if world < LARGE_JOB_RANKS:
        return Check("nccl-debug", "ok", f"NCCL_DEBUG={value} on {world} ranks", "nccl-env-overrides", evidence)
    return Check("nccl-debug", "warn", f"NCCL_DEBUG={value} on {world} ranks floods logs and shared storage: use "
                 "NCCL_DEBUG=WARN, or INFO with NCCL_DEBUG_SUBSYS=INIT for one run", "nccl-env-overrides", evidence)


# ---- GPUs ------------------------------------------------------------------------------


def visible_gpus(gpus: tuple[GpuInfo, ...], value: str | None) -> int:
    """How many GPUs CUDA_VISIBLE_DEVICES=value leaves: CUDA stops at the first
    entry it cannot resolve (so '' and '-1' hide every GPU)."""
    if value is None:
        return len(gpus)
    seen: list[object] = []
    for raw in value.split(","):
        entry = raw.strip()
        if entry.isdigit() and any(g.index == int(entry) for g in gpus):
            key: object = int(entry)
        elif entry.upper().startswith(("GPU-", "MIG-")):
            hits = [g.index for g in gpus if g.uuid and g.uuid.lower().startswith(entry.lower())]
            key = hits[0] if len(hits) == 1 else entry if entry.upper().startswith("MIG-") else None
        else:
            key = None
        if key is None:
            break
        if key not in seen:
            seen.append(key)
    return len(seen)


def check_gpu_count(host: Host, opts: Options) -> Check:
    if host.gpus is None:
        return Check("gpu-count", "skip", host.gpu_reason, "gpu-visibility", {})
    cvd = host.env.get("CUDA_VISIBLE_DEVICES")
    visible = visible_gpus(host.gpus, cvd)
    local_rank = host.env.get("LOCAL_RANK")
    nproc = opts.local_ranks(host.env)
    evidence = {"nvml_gpus": len(host.gpus), "CUDA_VISIBLE_DEVICES": cvd, "visible": visible,
                "nproc_per_node": nproc, "LOCAL_RANK": local_rank}
    if local_rank is not None and not (local_rank.strip().isdigit() and int(local_rank) < visible):
        return Check("gpu-count", "warn", f"LOCAL_RANK={local_rank} but {visible} GPU(s) are visible: "
                     "torch.cuda.set_device(LOCAL_RANK) fails; fix CUDA_VISIBLE_DEVICES or the rank count",
                     "gpu-visibility", evidence)
    if nproc is not None and nproc > visible:
        return Check("gpu-count", "warn", f"{nproc} ranks per node but {visible} GPU(s) visible: ranks from "
                     f"{visible} on have no GPU of their own; lower --nproc-per-node or fix CUDA_VISIBLE_DEVICES "
                     "(fine for CPU/gloo jobs)", "gpu-visibility", evidence)
    return Check("gpu-count", "ok", f"{visible} GPU(s) visible"
                 + (f" for {nproc} ranks per node" if nproc else ""), "gpu-visibility", evidence)
