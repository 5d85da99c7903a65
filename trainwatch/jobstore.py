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

The store itself is not authenticated: anyone who reaches its port reads and
writes any key. Every record trainwatch writes is therefore sealed with the
job's secret (`RecordSeal`: AES-256-GCM, the full key name as associated data,
so a record is neither readable, forgeable, nor movable to another key
without the secret). A record that does not open is counted (`rejected`) and
never acted on. The counters cannot be sealed (they are the store's own
`add`): a reader takes at most MAX_BACKLOG records a round and gives up on a
number that stays empty or forged for HOLE_GRACE_S, so a bumped counter
neither floods nor stalls it.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from typing import Any, Callable

from trainwatch import env

SEAL_MAGIC = b"tw1"
NONCE_BYTES = 12
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
MAX_BACKLOG = 256
"""Most numbered records a reader takes in one round (a legitimate writer adds a few a second)."""
HOLE_GRACE_S = 10.0
"""How long a reader retries a numbered record that is missing or does not open (a
writer between its `add` and its `set`, or a forged record it later overwrites)."""


class SecretError(ValueError):
    """The job secret is missing, unreadable or too short; the message names the fix."""


def read_secret(*, secret_file: str | None = None, environ: dict | None = None) -> bytes | None:
    """The job's secret: the file's contents (trailing whitespace dropped), else
    $TRAINWATCH_JOB_SECRET, else None."""
    environ = os.environ if environ is None else environ
    if secret_file:
        try:
            with open(secret_file, "rb") as f:
                secret = f.read(MAX_SECRET_BYTES + 1).rstrip()
        except OSError as e:
            raise SecretError(f"--job-secret-file {secret_file}: cannot read it ({e.strerror}); give a readable "
                              "file holding the job's secret") from None
        source = f"--job-secret-file {secret_file}"
    elif environ.get(env.JOB_SECRET):
        secret, source = environ[env.JOB_SECRET].strip().encode(errors="surrogateescape"), env.JOB_SECRET
    else:
        return None
    if not MIN_SECRET_BYTES <= len(secret) <= MAX_SECRET_BYTES:
        raise SecretError(f"{source}: the job secret must be {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} bytes (got "
                          f"{len(secret)}); make one with `openssl rand -hex 32`, the same on every node")
    return secret


class RecordSeal:
    """Seals and opens trainwatch's records in the rendezvous store with the job's
    secret. Without a secret (`--insecure-store`) records pass as they are."""

    def __init__(self, secret: bytes | None):
        self.secret = secret
        self._aead = None
        if secret:
            from cryptography.hazmat.primitives import hashes
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
            from cryptography.hazmat.primitives.kdf.hkdf import HKDF

            key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                       info=b"trainwatch rendezvous-store records v1").derive(secret)
            self._aead = AESGCM(key)

    @property
    def authenticated(self) -> bool:
        return self._aead is not None

    def seal(self, key: str, payload: bytes) -> bytes:
        if self._aead is None:
            return payload
        nonce = os.urandom(NONCE_BYTES)
        return SEAL_MAGIC + nonce + self._aead.encrypt(nonce, payload, key.encode())

    def open(self, key: str, blob: bytes | None) -> bytes | None:
        """The payload, or None for a record that was not sealed under `key` with this job's secret."""
        if blob is None:
            return None
        if self._aead is None:
            return bytes(blob)
        if len(blob) < len(SEAL_MAGIC) + NONCE_BYTES + 16 or not blob.startswith(SEAL_MAGIC):
            return None
        from cryptography.exceptions import InvalidTag

        nonce = blob[len(SEAL_MAGIC):len(SEAL_MAGIC) + NONCE_BYTES]
        try:
            return self._aead.decrypt(nonce, bytes(blob[len(SEAL_MAGIC) + NONCE_BYTES:]), key.encode())
        except InvalidTag:
            return None


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


class JobStore:
    """trainwatch's keys in the rendezvous store (a client connection)."""

    def __init__(self, endpoint: str, namespace: str, *, timeout_s: float = 10.0, store: Any = None,
                 seal: RecordSeal | None = None, clock: Callable[[], float] = time.monotonic):
        if store is None:
            from torch.distributed import TCPStore

            host, port = parse_endpoint(endpoint)
            store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), use_libuv=True)
        self.store = store
        self.prefix = f"trainwatch/{namespace}/"
        self.seal = seal if seal is not None else RecordSeal(None)
        self.clock = clock
        self.rejected = 0
        """Records that did not open with the job's secret (forged, or another job's): never acted on."""
        self._rejected_keys: set[str] = set()
        self._pending: dict[str, dict[int, float]] = {}
        self._names: dict[int, str] = {}

    def key(self, name: str) -> str:
        return self.prefix + name

    def _set(self, name: str, payload: bytes | str) -> None:
        key = self.key(name)
        self.store.set(key, self.seal.seal(key, payload.encode() if isinstance(payload, str) else payload))

    def _open(self, key: str, blob: bytes | None) -> bytes | None:
        payload = self.seal.open(key, blob)
        if payload is None and blob is not None and key not in self._rejected_keys:
            if len(self._rejected_keys) > 16 * MAX_BACKLOG:
                self._rejected_keys.clear()
            self._rejected_keys.add(key)  # counted once per key, however often it is read again
            self.rejected += 1
        return payload

    def _get(self, name: str) -> bytes | None:
        key = self.key(name)
        if not self.store.check([key]):
            return None
        return self._open(key, self.store.get(key))

    def register(self, node: str) -> None:
        i = self.store.add(self.key("nodes"), 1) - 1
        self._set(f"node/{i}", node)

    def nodes(self) -> list[str]:
        """The registered node names. A name once read is kept; of the numbers
        not read yet, the newest MAX_BACKLOG are tried each round."""
        n = int(self.store.add(self.key("nodes"), 0))
        unknown = [i for i in range(max(0, n - MAX_BACKLOG - len(self._names)), n) if i not in self._names]
        unknown = unknown[-MAX_BACKLOG:]
        keys = [self.key(f"node/{i}") for i in unknown]
        for i, key, blob in zip(unknown, keys, self._multi_get(keys)):
            name = self._open(key, blob)
            if name:
                self._names[i] = name.decode(errors="replace")
        return list(dict.fromkeys(self._names[i] for i in sorted(self._names)))

    def _multi_get(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        if self.store.check(keys):  # the usual case: every key is there (one round trip)
            return list(self.store.multi_get(keys))
        present = [self.store.check([k]) for k in keys]
        found = self.store.multi_get([k for k, ok in zip(keys, present) if ok]) if any(present) else []
        it = iter(found)
        return [next(it) if ok else None for ok in present]

    def publish(self, node: str, payload: bytes) -> None:
        self._set(f"summary/{node}", payload)

    def summaries(self, nodes: list[str]) -> list[bytes | None]:
        keys = [self.key(f"summary/{n}") for n in nodes]
        return [self._open(k, b) for k, b in zip(keys, self._multi_get(keys))]

    def high_water(self, counter: str) -> int:
        """How many records a counter ("incidents", "captures") has numbered so far."""
        return int(self.store.add(self.key(counter), 0))

    def _numbered(self, counter: str, seen: int, name: Callable[[int], str]) -> tuple[int, list[tuple[int, bytes]]]:
        """(new high-water mark, the records numbered after `seen` that open), at most
        MAX_BACKLOG a round. A number whose record is missing or does not open is
        tried again next round, for HOLE_GRACE_S."""
        n = int(self.store.add(self.key(counter), 0))
        pending = self._pending.setdefault(counter, {})
        now = self.clock()
        first = max(seen + 1, n - MAX_BACKLOG + 1)
        todo = sorted(set(pending) | set(range(first, n + 1)))
        out = []
        for i in todo:
            payload = self._get(name(i))
            if payload is not None:
                pending.pop(i, None)
                out.append((i, payload))
            elif now - pending.setdefault(i, now) > HOLE_GRACE_S:
                del pending[i]
        while len(pending) > MAX_BACKLOG:
            del pending[min(pending)]
        return max(n, seen), out

    def request_capture(self, node: str) -> int:
        """Ask every other node's sidecar to capture its ranks' stacks; the request's number."""
        n = self.store.add(self.key("captures"), 1)
        self._set(f"capture/{n}/from", node)
        return n

    def capture_requests(self, seen: int, node: str) -> tuple[int, list[int]]:
        """(new high-water mark, capture requests after `seen` that another node made)."""
        n, found = self._numbered("captures", seen, lambda i: f"capture/{i}/from")
        return n, [i for i, payload in found if payload.decode(errors="replace") != node]

    def publish_stacks(self, n: int, node: str, groups: list[dict]) -> None:
        self._set(f"capture/{n}/stacks/{node}", json.dumps(groups, default=str))

    def stacks(self, n: int, nodes: list[str]) -> dict[str, list]:
        """The stack groups each of `nodes` has published for request n so far."""
        out = {}
        for node in nodes:
            groups = _json(self._get(f"capture/{n}/stacks/{node}"))
            if isinstance(groups, list):
                out[node] = [g for g in groups if isinstance(g, dict)]
        return out

    def add_incident(self, record: dict) -> int:
        n = self.store.add(self.key("incidents"), 1)
        self._set(f"incident/{n}", json.dumps(record, default=str))
        return n

    def incidents_since(self, seen: int) -> tuple[int, list[dict]]:
        """(new high-water mark, job incidents after `seen`); one not yet written is taken next time."""
        n, found = self._numbered("incidents", seen, lambda i: f"incident/{i}")
        records = [_json(payload) for _i, payload in found]
        return n, [r for r in records if isinstance(r, dict)]


def _json(payload: bytes | None) -> Any:
    if payload is None:
        return None
    try:
        return json.loads(payload)
    except (ValueError, RecursionError):
        return None
