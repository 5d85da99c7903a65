"""The agent: its teardown works with torch releases whose agent takes no grace
argument (its restart backoff: test_backoff.py)."""

from __future__ import annotations

import signal

from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from trainwatch.launcher import agent as agent_mod


class _Context:
    def __init__(self) -> None:
        self.closed: list[tuple[int, float]] = []

    def close(self, death_sig: int, timeout: float) -> None:
        self.closed.append((int(death_sig), timeout))


def _bare_agent() -> agent_mod.TrainwatchAgent:
    a = object.__new__(agent_mod.TrainwatchAgent)
    a.preempt_signals = ()
    a.preempted = None
    a._pcontext = _Context()
    a._worker_pids = lambda: []
    return a


def test_teardown_without_a_grace_argument_closes_workers_with_trainwatchs_grace(monkeypatch):
    calls: list[tuple] = []

    def old_style_shutdown(self, death_sig=signal.SIGTERM):  # torch 2.11's signature
        calls.append((death_sig,))

    monkeypatch.setattr(LocalElasticAgent, "_shutdown", old_style_shutdown)
    monkeypatch.setattr(agent_mod, "_SHUTDOWN_TAKES_TIMEOUT", False)
    a = _bare_agent()
    a._shutdown(signal.SIGTERM, 30)
    assert calls == [(signal.SIGTERM,)]
    assert a._pcontext.closed == [(int(signal.SIGTERM), agent_mod.TEARDOWN_S)]


def test_teardown_passes_the_short_grace_where_torch_takes_one(monkeypatch):
    calls: list[tuple] = []

    def new_style_shutdown(self, death_sig=signal.SIGTERM, timeout=30):
        calls.append((death_sig, timeout))

    monkeypatch.setattr(LocalElasticAgent, "_shutdown", new_style_shutdown)
    monkeypatch.setattr(agent_mod, "_SHUTDOWN_TAKES_TIMEOUT", True)
    a = _bare_agent()
    a._shutdown(signal.SIGTERM, 30)
    assert calls == [(signal.SIGTERM, agent_mod.TEARDOWN_S)]
    assert a._pcontext.closed == []


def test_the_installed_torch_is_probed_for_its_signature():
    import inspect

    expected = "timeout" in inspect.signature(LocalElasticAgent._shutdown).parameters
    assert agent_mod._SHUTDOWN_TAKES_TIMEOUT is expected
