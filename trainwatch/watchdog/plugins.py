"""Optional parts of the sidecar, switched on from the launcher's config:
tracing (OpenTelemetry), hardware sources (NVML, kernel log) and actions
(capture, emergency checkpoint, restart). Kept in one place so the sidecar
loop itself stays small."""

from __future__ import annotations

import logging

log = logging.getLogger("trainwatch.sidecar")


def configure(sidecar, config: dict) -> None:
    from trainwatch.watchdog import otel
    from trainwatch.watchdog.actions import ActionPolicy, IncidentActions

    sidecar.tracer = otel.IncidentTracer.from_env(job=sidecar.job, node=sidecar.node)
    sidecar.actions = IncidentActions(
        ActionPolicy(
            restart=bool(config.get("restart", True)),
            emergency_timeout_s=float(config.get("emergency_timeout_s", 10.0)),
        )
    )
    try:
        from trainwatch.watchdog.hardware import HardwareMonitor

        sidecar.add_hardware(
            HardwareMonitor(
                nproc=sidecar.segment.nslots,
                kernel_log_path=config.get("kernel_log"),
                faults=config.get("faults") or [],
            )
        )
    except Exception:  # hardware checks are an extra; never let them stop the watchdog
        log.exception("trainwatch: hardware checks off")


def shutdown(sidecar) -> None:
    for source in sidecar._hardware:
        try:
            source.close()
        except Exception:
            pass
    if sidecar.tracer is not None:
        sidecar.tracer.shutdown()
