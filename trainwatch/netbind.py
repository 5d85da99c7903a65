"""Listening sockets bound where they should be, for torch's TCPStore.

torch's TCPStore server listens on every interface; the store is not
authenticated, so trainwatch binds the listening socket itself (to loopback
for a single-node job, to the given address for a multi-node one) and hands
it over (`master_listen_fd`).
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

BACKLOG = 4096
_sockets: list[socket.socket] = []
"""Listening sockets handed to TCPStores: kept open for the process's life."""


def listening_socket(address: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, port))
    sock.listen(BACKLOG)
    _sockets.append(sock)
    return sock


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) is this machine's loopback only."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(info[4][0]).is_loopback
                       for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
        except (OSError, ValueError):
            return False


def exposure_warnings(*, metrics_host: str | None, store: str | None, rank_store_bind: str | None,
                      sealed: bool) -> list[str]:
    """One line per listener a job opens beyond loopback, naming what it exposes."""
    out = []
    if metrics_host and not is_loopback(metrics_host):
        out.append(f"warning: the metrics exporter listens on {metrics_host} (not loopback): anyone who reaches it "
                   "reads the job's telemetry; give --metrics-host 127.0.0.1 or firewall the port")
    if store:
        host = store.rpartition(":")[0] or store
        if not is_loopback(host):
            records = ("trainwatch's records in it are sealed with the job secret" if sealed else
                       "with --insecure-store trainwatch's records in it are not authenticated either")
            out.append(f"warning: the rendezvous store {store} is reachable from the network and torch's store is "
                       f"not authenticated ({records}); keep the port inside the cluster's network")
        if rank_store_bind is None:
            out.append("warning: rank 0's process-group store listens on every interface; give --local-addr "
                       "(this node's cluster address) to bind it to one")
    return out


def free_port(address: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (for tests and benchmarks)."""
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def is_listening(address: str, port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex((address, port)) == 0


def bound_store(address: str, port: int, *, world_size: int | None = None, timeout: Any,
                use_libuv: bool = True) -> Any:
    """A TCPStore server listening on address:port only (port 0: a free one)."""
    from torch.distributed import TCPStore

    sock = listening_socket(address, port)
    return TCPStore(host_name=address, port=sock.getsockname()[1], world_size=world_size, is_master=True,
                    timeout=timeout, multi_tenant=True, use_libuv=use_libuv, master_listen_fd=sock.fileno())
