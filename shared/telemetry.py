"""OpenTelemetry bootstrap and W3C trace-context propagation through NATS headers.

With ``OTEL_EXPORTER_OTLP_ENDPOINT`` set, spans go to that OTLP/HTTP collector
(Jaeger, Phoenix); otherwise no exporter is installed and tracing costs almost
nothing. Tests install their own provider with an in-memory exporter.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, Mapping

from opentelemetry import context, trace
from opentelemetry.propagate import extract, inject
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

_configured = False
_preset: ContextVar[tuple[int, int] | None] = ContextVar("infermesh_preset_ids", default=None)


class PresetIds(RandomIdGenerator):
    """Random trace and span ids, except inside ``preset_ids``: the span of a durable thing (a batch job) must
    carry the ids its parts already link to, whichever replica records it, after any restart."""

    def generate_trace_id(self) -> int:
        preset = _preset.get()
        return preset[0] if preset else super().generate_trace_id()

    def generate_span_id(self) -> int:
        preset = _preset.get()
        return preset[1] if preset else super().generate_span_id()


@contextmanager
def preset_ids(trace_id: int, span_id: int) -> Iterator[None]:
    """The next root span started here gets these ids (start exactly one: every span inside would)."""
    token = _preset.set((trace_id, span_id))
    try:
        yield
    finally:
        _preset.reset(token)


def setup_tracing(service_name: str) -> None:
    """Install a tracer provider for this process, once. No-op without an OTLP endpoint."""
    global _configured
    if _configured or not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from shared.trace_sampling import KeepErrorsAndSlow, configured_sampler, slow_s_from_env

    # the sampler is OpenTelemetry's own setting: OTEL_TRACES_SAMPLER (e.g. parentbased_traceidratio) and
    # OTEL_TRACES_SAMPLER_ARG (the ratio); by default every trace is kept. What a ratio leaves out is still
    # kept when it errs or is slow (shared/trace_sampling.py)
    sampler, leaves_out = configured_sampler()
    provider = TracerProvider(sampler=sampler, resource=Resource.create({"service.name": service_name}),
                              id_generator=PresetIds())
    exporting = BatchSpanProcessor(OTLPSpanExporter())
    provider.add_span_processor(KeepErrorsAndSlow(exporting, slow_s_from_env()) if leaves_out else exporting)
    trace.set_tracer_provider(provider)
    _configured = True


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def sampled_trace_id(span: trace.Span | None) -> str:
    """The span's trace id (hex) when its trace is sampled, else "": what a metric's exemplar carries (a trace
    left out by the sampler is exported only if it errs or is slow, so an exemplar would mostly point nowhere)."""
    ctx = span.get_span_context() if span is not None else None
    return f"{ctx.trace_id:032x}" if ctx is not None and ctx.is_valid and ctx.trace_flags.sampled else ""


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
