"""The agent: its teardown works with torch releases whose agent takes no grace
argument; its restart backoff grows only while the job keeps failing."""

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


def test_restart_backoff_grows_while_the_job_keeps_failing_and_starts_over_after_a_healthy_stretch():
    now = [0.0]
    backoff = agent_mod.Backoff(max_s=30.0, reset_s=60.0, clock=lambda: now[0])
    waits = []
    for ran in (5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0):  # a job failing every 5 s
        backoff.workers_started()
        now[0] += ran
        waits.append(backoff.next())
    assert waits == [0.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    backoff.workers_started()
    now[0] += 60.0  # a long healthy stretch, then a fault: a first fault again
    assert backoff.next() == 0.0
    backoff.workers_started()
    now[0] += 1.0
    assert backoff.next() == 2.0
