"""trainwatch's keys in a multi-node job's rendezvous store (the c10d TCPStore
torchelastic runs), as a client: node names, node summaries, job incidents,
and stack capture requests from `diagnose` with each node's answer. Used by
the sidecars (trainwatch.watchdog.jobwide) and by `trainwatch diagnose`.

Keys, under `trainwatch/<rendezvous id>/`:
  nodes                     counter: how many node names were registered
  node/<i>                  the i-th node name
  summary/<node>            the node's latest summary (header line + slot rows)
  incidents                 counter: job incidents published
  incident/<n>              the n-th job incident (JSON)
  captures                  counter: stack capture requests
  capture/<n>/from          the node that asked (its own ranks it captures itself)
  capture/<n>/stacks/<node> a node's stack groups for request n (JSON)
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


class JobStore:
    """trainwatch's keys in the rendezvous store (a client connection)."""

    def __init__(self, endpoint: str, namespace: str, *, timeout_s: float = 10.0, store: Any = None):
        if store is None:
            from torch.distributed import TCPStore

            host, port = parse_endpoint(endpoint)
            store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), use_libuv=True)
        self.store = store
        self.prefix = f"trainwatch/{namespace}/"

    def key(self, name: str) -> str:
        return self.prefix + name

    def register(self, node: str) -> None:
        i = self.store.add(self.key("nodes"), 1) - 1
        self.store.set(self.key(f"node/{i}"), node)

    def nodes(self) -> list[str]:
        n = self.store.add(self.key("nodes"), 0)
        if n <= 0:
            return []
        names = self.store.multi_get([self.key(f"node/{i}") for i in range(n)])
        return list(dict.fromkeys(b.decode(errors="replace") for b in names))

    def publish(self, node: str, payload: bytes) -> None:
        self.store.set(self.key(f"summary/{node}"), payload)

    def summaries(self, nodes: list[str]) -> list[bytes | None]:
        keys = [self.key(f"summary/{n}") for n in nodes]
        if not keys:
            return []
        if self.store.check(keys):  # the usual case: every node has published (one round trip)
            return list(self.store.multi_get(keys))
        present = [self.store.check([k]) for k in keys]
        found = self.store.multi_get([k for k, ok in zip(keys, present) if ok]) if any(present) else []
        it = iter(found)
        return [next(it) if ok else None for ok in present]

    def high_water(self, counter: str) -> int:
        """How many records a counter ("incidents", "captures") has numbered so far."""
        return int(self.store.add(self.key(counter), 0))

    def request_capture(self, node: str) -> int:
        """Ask every other node's sidecar to capture its ranks' stacks; the request's number."""
        n = self.store.add(self.key("captures"), 1)
        self.store.set(self.key(f"capture/{n}/from"), node)
        return n

    def capture_requests(self, seen: int, node: str) -> tuple[int, list[int]]:
        """(new high-water mark, capture requests after `seen` that another node made)."""
        n = self.store.add(self.key("captures"), 0)
        out = []
        for i in range(seen + 1, n + 1):
            key = self.key(f"capture/{i}/from")
            if not self.store.check([key]):
                return i - 1, out  # asked, not yet signed: next round
            if self.store.get(key).decode(errors="replace") != node:
                out.append(i)
        return n, out

    def publish_stacks(self, n: int, node: str, groups: list[dict]) -> None:
        self.store.set(self.key(f"capture/{n}/stacks/{node}"), json.dumps(groups, default=str))

    def stacks(self, n: int, nodes: list[str]) -> dict[str, list]:
        """The stack groups each of `nodes` has published for request n so far."""
        out = {}
        for node in nodes:
            key = self.key(f"capture/{n}/stacks/{node}")
            if self.store.check([key]):
                try:
                    groups = json.loads(self.store.get(key))
                except ValueError:
                    groups = None
                if isinstance(groups, list):
                    out[node] = [g for g in groups if isinstance(g, dict)]
        return out

    def add_incident(self, record: dict) -> int:
        n = self.store.add(self.key("incidents"), 1)
        self.store.set(self.key(f"incident/{n}"), json.dumps(record, default=str))
        return n

    def incidents_since(self, seen: int) -> tuple[int, list[dict]]:
        """(new high-water mark, job incidents after `seen`); one not yet written is taken next time."""
        n = self.store.add(self.key("incidents"), 0)
        out: list[dict] = []
        for i in range(seen + 1, n + 1):
            key = self.key(f"incident/{i}")
            if not self.store.check([key]):
                return i - 1, out
            try:
                record = json.loads(self.store.get(key))
            except ValueError:
                record = None
            if isinstance(record, dict):
                out.append(record)
        return n, out
