"""OpenTelemetry bootstrap and W3C trace-context propagation through NATS headers.

With ``OTEL_EXPORTER_OTLP_ENDPOINT`` set, spans go to that OTLP/HTTP collector
(Jaeger, Phoenix); otherwise no exporter is installed and tracing costs almost
nothing. Tests install their own provider with an in-memory exporter.
"""

from __future__ import annotations

import os
from typing import Mapping

from opentelemetry import context, trace
from opentelemetry.propagate import extract, inject

_configured = False


def setup_tracing(service_name: str) -> None:
    """Install a tracer provider for this process, once. No-op without an OTLP endpoint."""
    global _configured
    if _configured or not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _configured = True


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def tracing_enabled() -> bool:
    """False until a tracer provider is installed: the hot paths then skip spans and propagation."""
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def inject_headers() -> dict[str, str] | None:
    """NATS headers carrying the current span's W3C trace context, or None when not tracing."""
    if not tracing_enabled():
        return None
    carrier: dict[str, str] = {}
    inject(carrier)
    return carrier or None


def traced(headers: dict[str, str] | None = None) -> dict[str, str] | None:
    """``headers`` plus the current span's trace context: what every publish on the bus sends."""
    carried = inject_headers()
    if carried is None:
        return headers
    return {**carried, **headers} if headers else carried


def trace_context_of(headers: Mapping[str, str] | None) -> dict[str, str] | None:
    """The W3C trace-context headers among a message's headers (what a raw reply passes on), or None."""
    if not headers or "traceparent" not in headers:
        return None
    return {name: headers[name] for name in ("traceparent", "tracestate") if name in headers}


def extract_context(headers: Mapping[str, str] | None) -> context.Context | None:
    """The trace context a message's headers carry; None when they carry none."""
    if not headers or "traceparent" not in headers:
        return None
    return extract(dict(headers))
