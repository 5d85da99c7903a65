"""OpenTelemetry: one span per incident, events for what the sidecar did,
resource attributes for job and node; off unless OTEL_* configures it."""

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from trainwatch.watchdog import otel


def tracer():
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=otel.resource("job-a", "node-3"))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return otel.IncidentTracer(provider), exporter


def test_incident_becomes_a_span_with_events():
    t, exporter = tracer()
    t.incident({
        "kind": "hang", "severity": "high", "summary": "rank 2 stuck in data", "culprit_ranks": [2],
        "victims": [0, 1, 3], "runbook": "dataloader-stall",
        "capture": {"seconds": 0.12, "ranks": 4, "dir": "/x"},
        "verdict": {"category": "dataloader", "culprit_ranks": [2], "confidence": 0.9},
        "checkpoint": {"step": 19, "seconds": 0.3, "written": {"0": 19}},
        "restart": {"requested": True},
    })
    [span] = exporter.get_finished_spans()
    assert span.name == "trainwatch.incident.hang"
    assert span.attributes["trainwatch.incident.culprit_ranks"] == (2,)
    assert span.attributes["trainwatch.incident.victims"] == (0, 1, 3)
    assert span.attributes["trainwatch.incident.runbook"] == "dataloader-stall"
    assert [e.name for e in span.events] == ["detection", "capture", "verdict", "checkpoint", "restart"]
    verdict = next(e for e in span.events if e.name == "verdict")
    assert verdict.attributes["category"] == "dataloader"
    assert span.resource.attributes["trainwatch.job"] == "job-a"
    assert span.resource.attributes["host.name"] == "node-3"


def test_off_unless_configured(monkeypatch):
    for var in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_EXPORTER"):
        monkeypatch.delenv(var, raising=False)
    assert otel.IncidentTracer.from_env(job="j", node="n") is None
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    assert otel.IncidentTracer.from_env(job="j", node="n") is None


def test_configured_by_standard_variables(monkeypatch):
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    t = otel.IncidentTracer.from_env(job="j", node="n")
    assert t is not None
    t.provider.shutdown()
