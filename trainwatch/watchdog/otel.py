"""OpenTelemetry: one span per incident, with events for detection, capture and
action. Off unless the standard OTEL_* variables configure an exporter."""

from __future__ import annotations

import os
import time
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor


class IncidentTracer:
    def __init__(self, provider: TracerProvider):
        self.provider = provider
        self.tracer = provider.get_tracer("trainwatch")

    @classmethod
    def from_env(cls, *, job: str, node: str) -> "IncidentTracer | None":
        exporter = os.environ.get("OTEL_TRACES_EXPORTER", "")
        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        if exporter == "none" or not (endpoint or exporter == "otlp"):
            return None
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider = TracerProvider(resource=resource(job, node))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        return cls(provider)

    def start(self, record: dict) -> Any:
        """Open the incident's span at its detection; its events come as the responder acts."""
        kind = record.get("kind", "unknown")
        detected_ns = time.time_ns()
        span = self.tracer.start_span(f"trainwatch.incident.{kind}", start_time=detected_ns)
        span.set_attribute("trainwatch.incident.kind", kind)
        span.set_attribute("trainwatch.incident.id", str(record.get("id", "")))
        span.set_attribute("trainwatch.incident.severity", str(record.get("severity", "")))
        span.set_attribute("trainwatch.incident.summary", str(record.get("summary", "")))
        span.set_attribute("trainwatch.incident.culprit_ranks", [int(r) for r in record.get("culprit_ranks") or []])
        span.set_attribute("trainwatch.incident.victims", [int(r) for r in record.get("victims") or []])
        if record.get("runbook"):
            span.set_attribute("trainwatch.incident.runbook", str(record["runbook"]))
        span.add_event("detection", {"summary": str(record.get("summary", ""))}, timestamp=detected_ns)
        return span

    def finish(self, span: Any, results: dict) -> None:
        """One event per action result (capture, verdict, checkpoint, restart), then end the span."""
        for name in ("capture", "verdict", "checkpoint", "restart"):
            info = results.get(name)
            if isinstance(info, dict):
                span.add_event(name, {k: _attr(v) for k, v in info.items() if _attr(v) is not None})
        span.end()

    def incident(self, record: dict) -> None:
        """Record an incident and what was done about it as one span."""
        self.finish(self.start(record), record)

    def shutdown(self) -> None:
        self.provider.shutdown()


def resource(job: str, node: str) -> Resource:
    return Resource.create({"service.name": "trainwatch", "trainwatch.job": job, "host.name": node})


def _attr(v: Any):
    if isinstance(v, (str, bool, int, float)):
        return v
    if isinstance(v, (list, tuple)) and all(isinstance(x, (int, float, str)) for x in v):
        return list(v)
    return None if v is None else str(v)
