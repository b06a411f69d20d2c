"""A batch job's spans: one root span per job, and each line a span of its own trace linked to it.

A job lives for hours, across restarts and replicas, and may hold 50,000 lines: one trace of them all would be
unreadable and never end. So each line runs in a trace of its own (``batch.line``, the parent of the edge's
request span and everything below it), linked to the job's span (``batch.job``). The job's span ids follow from
its id (the id's 32 hex digits are its trace id), so every line links to it before it is recorded, whichever
replica runs them; it is recorded once the job has ended, from its creation to its end.
"""

from __future__ import annotations

import hashlib
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from opentelemetry import context as otel_context, trace

from shared.batch_schema import BatchJobRecord
from shared.telemetry import preset_ids, tracer, tracing_enabled

_tracer = tracer("infermesh.batch")


def job_span_context(job_id: str) -> trace.SpanContext:
    """The job's span, as its lines link to it: a trace id of the job id's hex digits, a span id of its hash."""
    digest = hashlib.sha256(job_id.encode()).digest()
    hex_part = job_id.removeprefix("batch_")
    try:
        trace_id = int(hex_part[:32], 16) if len(hex_part) >= 32 else int.from_bytes(digest[8:24], "big")
    except ValueError:  # (ids are ours and hex; a foreign one still gets stable ids)
        trace_id = int.from_bytes(digest[8:24], "big")
    return trace.SpanContext(trace_id or 1, int.from_bytes(digest[:8], "big") or 1, is_remote=True,
                             trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))


def line_span(record: BatchJobRecord, line_index: int, custom_id: str) -> AbstractContextManager[Any]:
    """The current span of one line's run (a new trace, linked to its job's span); a no-op when not tracing."""
    if not tracing_enabled():
        return nullcontext()
    return _tracer.start_as_current_span(
        "batch.line", context=otel_context.Context(), kind=trace.SpanKind.PRODUCER,
        links=[trace.Link(job_span_context(record.id), {"infermesh.link": "batch.job"})],
        attributes={"infermesh.batch_id": record.id, "infermesh.team": record.team,
                    "infermesh.batch.line": line_index, "infermesh.batch.custom_id": custom_id,
                    "gen_ai.request.model": record.model, "url.path": record.endpoint})


def record_job(record: BatchJobRecord, ended_at: float) -> None:
    """The job's own span, once it has ended: from its creation to its end, with its final counts."""
    if not tracing_enabled():
        return
    ids = job_span_context(record.id)
    counts = record.request_counts
    with preset_ids(ids.trace_id, ids.span_id):
        span = _tracer.start_span("batch.job", context=otel_context.Context(), kind=trace.SpanKind.CONSUMER,
                                  start_time=int(record.created_at * 1e9), attributes={
                                      "infermesh.batch_id": record.id, "infermesh.team": record.team,
                                      "infermesh.batch.status": record.status, "infermesh.batch.source": record.source,
                                      "gen_ai.request.model": record.model, "url.path": record.endpoint,
                                      "infermesh.batch.total": counts.total, "infermesh.batch.completed":
                                      counts.completed, "infermesh.batch.failed": counts.failed})
    if record.status in ("failed", "expired"):
        span.set_status(trace.Status(trace.StatusCode.ERROR, f"the batch {record.status}"))
    span.end(end_time=max(int(ended_at * 1e9), int(record.created_at * 1e9)))
