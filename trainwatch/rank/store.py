"""Rank 0's TCPStore, listening only where it should.

When the launcher names an address (TRAINWATCH_STORE_BIND: loopback for a
single-node job), rank 0 creates the worker group's store with a listening
socket bound there (trainwatch.netbind) instead of on every interface.
"""

from __future__ import annotations

import importlib
import os

from trainwatch import env, netbind


def install() -> None:
    """Route rank 0's env:// store through netbind when an address is given."""
    address = os.environ.get(env.STORE_BIND)
    if not address:
        return
    try:
        # The module, not torch.distributed's function of the same name.
        rendezvous = importlib.import_module("torch.distributed.rendezvous")
    except Exception:
        return
    original = getattr(rendezvous, "_create_c10d_store", None)
    if original is None or getattr(original, "_trainwatch", False):
        return

    def create(hostname, port, rank, world_size, timeout, use_libuv=True):
        if rank != 0 or rendezvous._torchelastic_use_agent_store():
            return original(hostname, port, rank, world_size, timeout, use_libuv)
        return netbind.bound_store(address, port, world_size=world_size, timeout=timeout, use_libuv=use_libuv)

    create._trainwatch = True  # type: ignore[attr-defined]
    rendezvous._create_c10d_store = create
