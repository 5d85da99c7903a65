"""Session-wide guarantees: a test run leaves no shared-memory segment behind.

Tests kill launchers on purpose (SIGKILL cannot be cleaned up after); what
they left is what any later `trainwatch jobs` would reap. At the end of the
session every job directory under this session's temporary homes is read
once the way `trainwatch jobs` reads it, which removes those runs' segments
and target files. Only this session's homes are visited: other trainwatch
jobs on the machine are never touched."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def no_leftover_segments(tmp_path_factory):
    yield
    from trainwatch import liveness, state

    base = tmp_path_factory.getbasetemp()
    records = list(base.rglob("jobs/*/job.json")) + list(base.rglob("jobs/*/nodes/*/job.json"))
    saved = {k: os.environ.get(k) for k in ("TRAINWATCH_HOME", "TRAINWATCH_TARGETS_DIR")}
    try:
        for path in records:
            home = next(p for p in path.parents if p.name == "jobs").parent
            os.environ["TRAINWATCH_HOME"] = str(home)
            os.environ.pop("TRAINWATCH_TARGETS_DIR", None)
            record = state.read_json(path)
            if record is not None:
                try:
                    liveness.status_of(record)
                except Exception:  # a hostile record from a test: nothing of ours to reap
                    pass
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def pytest_addoption(parser):
    parser.addoption("--shuffle", type=int, default=None, metavar="SEED",
                     help="run the test modules, and the tests within each, in an order drawn from SEED "
                          "(tests/repeat.py uses it to find tests that depend on what ran before them)")


def _shuffle(config, items) -> None:
    seed = config.getoption("--shuffle")
    if seed is None:
        return
    import random

    rng = random.Random(seed)
    # Shuffle modules and tests within a module, never interleave modules: a
    # module-scoped fixture (a real Prometheus, a finished run) is set up once.
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    order = list(modules)
    rng.shuffle(order)
    items[:] = [item for name in order for item in rng.sample(modules[name], len(modules[name]))]


def _skip_gpu_tests(items) -> None:
    """`gpu`-marked tests need an NVIDIA GPU: without one (NVML sees none) they are
    skipped with NVML's reason, so the suite passes on CPU machines."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    from trainwatch.launcher.preflight import read_gpus

    gpus, reason = read_gpus()
    if gpus:
        return
    skip = pytest.mark.skip(reason=reason or "no GPU")
    for item in gpu_items:
        item.add_marker(skip)


def pytest_collection_modifyitems(config, items):
    _shuffle(config, items)
    _skip_gpu_tests(items)


@pytest.fixture
def store():
    """A real c10d TCPStore on loopback (the rendezvous store a multi-node job
    shares): (address, server)."""
    from datetime import timedelta

    from trainwatch import netbind

    server = netbind.bound_store("127.0.0.1", 0, timeout=timedelta(seconds=10))
    return f"127.0.0.1:{server.port}", server
