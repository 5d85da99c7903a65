"""The rendezvous side of a launch: torchelastic's handler with the store bound to
one address, the rendezvous store's address, and how an exporter is listed so
another machine can reach it."""

from __future__ import annotations

import socket

from trainwatch import netbind


def rendezvous_handler(params, bind: str | None):
    """torchelastic's rendezvous handler; for a c10d rendezvous this node hosts,
    with its store listening on `bind` only (not every interface)."""
    from datetime import timedelta

    from torch.distributed.elastic.rendezvous import registry
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    if params.backend != "c10d":
        return registry.get_rendezvous_handler(params), False
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    timeout = timedelta(seconds=int(params.get_as_int("read_timeout", 60) or 60))
    if not bind:
        # Multi-node: the node that hosts the store listens on the endpoint's
        # address only; the other nodes (and a second agent on this machine,
        # which finds the port taken) connect as torchelastic would.
        bind = endpoint_address(host, params)
        if bind is None:
            return registry.get_rendezvous_handler(params), False
        try:
            store = netbind.bound_store(bind, port, timeout=timeout)
        except OSError:
            return registry.get_rendezvous_handler(params), False
    else:
        store = netbind.bound_store(bind, port, timeout=timeout)
    return create_handler(store, C10dRendezvousBackend(store, params.run_id), params), True


def reachable(address: str) -> str:
    """An exporter bound to every interface is listed under this machine's name
    (a Prometheus elsewhere cannot scrape 0.0.0.0)."""
    host, _, port = address.rpartition(":")
    return f"{socket.getfqdn()}:{port}" if host.strip("[]") in ("0.0.0.0", "::", "") else address


def store_address(endpoint: str) -> str:
    host, _, port = endpoint.rpartition(":")
    return f"{host or '127.0.0.1'}:{port if port.isdigit() else 29400}" if host else f"{endpoint}:29400"


def endpoint_address(host: str, params) -> str | None:
    """The local address to host the rendezvous store on, or None when this
    node does not host it (torchelastic's own test: is_host, else the name)."""
    try:  # private in torch; without it, leave hosting to torchelastic
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
            _matches_machine_hostname,
        )
    except ImportError:
        return None
    is_host = params.get_as_bool("is_host")
    if is_host is False or (is_host is None and not _matches_machine_hostname(host)):
        return None
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError):
        return None
