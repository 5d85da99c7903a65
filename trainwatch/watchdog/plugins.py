"""Optional parts of the sidecar, switched on from the launcher's config:
tracing (OpenTelemetry), hardware sources (NVML, kernel log) and actions
(capture, emergency checkpoint, restart). Kept in one place so the sidecar
loop itself stays small."""

from __future__ import annotations

import logging

log = logging.getLogger("trainwatch.sidecar")


def configure(sidecar, config: dict) -> None:
    try:
        from trainwatch.watchdog import otel

        sidecar.tracer = otel.IncidentTracer.from_env(job=sidecar.job, node=sidecar.node)
    except ImportError:
        sidecar.tracer = None


def shutdown(sidecar) -> None:
    if sidecar.tracer is not None:
        sidecar.tracer.shutdown()
