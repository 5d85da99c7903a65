"""The exporter's HTTP server under abuse: idle, malformed and reset
connections are closed and counted, never a traceback in the job's log."""

from __future__ import annotations

import socket
import urllib.request

import pytest

from trainwatch.watchdog import exporter
from util import wait_for


class _Empty:
    def collect(self):
        return iter(())


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(exporter._Handler, "timeout", 0.3)
    srv = exporter.serve_metrics(_Empty(), "127.0.0.1", 0)
    yield f"127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def dropped(address: str) -> dict[str, float]:
    page = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    out = {}
    for line in page.splitlines():
        if line.startswith("trainwatch_exporter_dropped_connections_total{"):
            out[line.split('reason="')[1].split('"')[0]] = float(line.split()[-1])
    return out


def test_idle_malformed_and_reset_connections_are_counted_without_a_traceback(server, capfd):
    host, port = server.rsplit(":", 1)
    idle = [socket.create_connection((host, int(port))) for _ in range(40)]
    for s in idle[:5]:
        s.sendall(b"GET /met")  # a request line that never ends
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"\x16\x03\x01 not http at all\r\n\r\n")
        s.recv(1000)
    with socket.create_connection((host, int(port))) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST on close
    wait_for(lambda: dropped(server).get("idle", 0) >= 40, 30, what="every idle connection closed")
    for s in idle:
        assert s.recv(10) == b""  # closed by the server
        s.close()
    counts = dropped(server)
    assert counts["malformed"] >= 1 and counts["error"] == 0, counts
    err = capfd.readouterr().err
    assert "Traceback" not in err and "timed out" not in err, err[:2000]
