"""The edge's spans: one SERVER span per request (OpenTelemetry GenAI conventions) and the children it starts.

Every hop the request makes is a child of its SERVER span: the NATS messages the edge publishes carry its context
(``shared/bus.py``), so the router's, the workers' and admission's spans hang below it. A request's events are
produced in the client's task, step by step, after the handler has returned (a stream), so ``in_span`` puts the
span back in context around each step, and ``usage_span`` around the background billing.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from typing import Any, AsyncIterator, TypeVar

from opentelemetry import context as otel_context, trace
from opentelemetry.propagate import extract

from shared.telemetry import tracer, tracing_enabled

T = TypeVar("T")
_tracer = tracer("infermesh.edge")
PROVIDER = "infermesh"
# gen_ai.operation.name per endpoint kind
OPERATIONS = {"chat": "chat", "text": "text_completion", "messages": "chat", "responses": "chat"}


def start_request_span(kind: str, path: str, headers: Any, request_id: str, model: str, prompt_tokens: int,
                       stream: bool, team: str, session_id: str | None) -> trace.Span:
    """The request's SERVER span, ``{operation} {model}``; a no-op span unless a tracer provider is installed."""
    if not tracing_enabled():
        return trace.INVALID_SPAN
    operation = OPERATIONS.get(kind, kind)
    span = _tracer.start_span(f"{operation} {model}", context=extract(headers), kind=trace.SpanKind.SERVER)
    span.set_attributes({"gen_ai.operation.name": operation, "gen_ai.provider.name": PROVIDER,
                         "gen_ai.request.model": model, "gen_ai.usage.input_tokens": prompt_tokens,
                         "http.request.method": "POST", "url.path": path, "infermesh.request_id": request_id,
                         "infermesh.team": team, "infermesh.stream": stream})
    if session_id:
        span.set_attributes({"infermesh.session_id": session_id, "session.id": session_id})  # OTel's name too
    return span


def traceparent(span: trace.Span) -> str | None:
    """The W3C ``traceparent`` of ``span`` (what the response carries back), or None when it is not recorded."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def record_usage(span: trace.Span, response_id: str, worker_id: str, deployment: str, finish_reason: str,
                 prompt_tokens: int, cached_tokens: int, completion_tokens: int, migrations: int) -> None:
    span.set_attributes({"gen_ai.response.id": response_id, "gen_ai.response.finish_reasons": [finish_reason],
                         "gen_ai.usage.input_tokens": prompt_tokens, "gen_ai.usage.output_tokens": completion_tokens,
                         "gen_ai.usage.cache_read.input_tokens": cached_tokens, "infermesh.worker_id": worker_id,
                         "infermesh.deployment": deployment, "infermesh.migrations": migrations})
    span.add_event("finish", {"gen_ai.response.finish_reasons": [finish_reason]})


def record_admission(span: trace.Span | None, outcome: str, deployment: str, asked_at: float) -> None:
    """How the lease request ended (``granted`` or the error's code), where, and how long it waited."""
    if span is not None:
        span.set_attributes({"infermesh.admission.outcome": outcome, "infermesh.admission.deployment": deployment,
                             "infermesh.admission.wait_s": time.time() - asked_at})


def in_span(events: AsyncIterator[T], span: trace.Span) -> AsyncIterator[T]:
    """``events``, each step run with ``span`` current (so what a step publishes is its child); closing it
    closes ``events`` (whose ``finally`` bills the request and releases its lease)."""
    return _stepped_in(events, trace.set_span_in_context(span)) if span.is_recording() else events


async def _stepped_in(events: AsyncIterator[T], ctx: otel_context.Context) -> AsyncIterator[T]:
    try:
        while True:
            token = otel_context.attach(ctx)
            try:
                item = await events.__anext__()
            except StopAsyncIteration:
                return
            finally:
                otel_context.detach(token)
            yield item
    finally:
        token = otel_context.attach(ctx)
        try:
            await events.aclose()  # type: ignore[attr-defined]
        finally:
            otel_context.detach(token)


def start_attempt(index: int, excluded: list[str], tokens_sent: int) -> trace.Span:
    """One attempt of a request (below the current span, its SERVER span): routing, the prefill and the stream.
    A retry (no token sent yet) or a migration (tokens sent) is a new attempt, with its reason."""
    if not tracing_enabled():
        return trace.INVALID_SPAN
    reason = "first" if not excluded else "migration" if tokens_sent else "retry"
    attributes: dict[str, Any] = {"infermesh.attempt": index, "infermesh.attempt.reason": reason}
    if excluded:
        attributes["infermesh.attempt.failed_worker_id"] = excluded[-1]
    return _tracer.start_span("attempt", attributes=attributes)


def current(span: trace.Span) -> AbstractContextManager[Any]:
    """``span`` as the current span (a no-op for an unrecorded one, which must not hide its parent)."""
    return trace.use_span(span, end_on_exit=False) if span.is_recording() else nullcontext()


def child_span(parent: trace.Span, name: str, kind: trace.SpanKind = trace.SpanKind.INTERNAL,
               attributes: dict[str, Any] | None = None) -> AbstractContextManager[Any]:
    """A current span ``name`` below ``parent`` (which may have ended: the background billing's is); a no-op
    context (yielding None) when ``parent`` is not traced. An ApiError raised inside marks it an error."""
    if not parent.get_span_context().is_valid:
        return nullcontext()
    return _tracer.start_as_current_span(name, context=trace.set_span_in_context(parent), kind=kind,
                                         attributes=attributes)
