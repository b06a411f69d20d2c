"""The worker's spans: one per request it serves, named for its part in it, with the engine's own timings.

A request's span is a child of the edge's attempt (its context comes in the generate message's headers):

    prefill          on a prefill worker (it computes the prompt's KV and holds it for the decode worker)
    decode           on the decode worker of a disaggregated request, with a ``kv.transfer`` child (the pull)
    generate         on a worker that does both

Below it, ``engine.queue``, ``engine.prefill`` and ``engine.decode`` are the phases the engine itself timed
(vLLM's per-request stats, the simulator's clock), drawn with those times, so a trace shows where the time went
inside the engine; the span's ``gen_ai.latency.*`` attributes carry the same figures under vLLM's names.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace

from services.worker.engines.base import EngineTimings
from shared.schema import GenerateRequest
from shared.telemetry import tracer

_tracer = tracer("infermesh.worker")


def part(request: GenerateRequest) -> str:
    """The worker's part in a request: ``prefill``, ``decode`` (disaggregated) or ``generate`` (both)."""
    if request.remote_decode:
        return "prefill"
    return "decode" if request.kv_transfer is not None else "generate"


def request_span(request: GenerateRequest, worker_id: str) -> Any:
    """The current span of one request this worker serves (a context manager yielding the span)."""
    return _tracer.start_as_current_span(part(request), kind=trace.SpanKind.SERVER, attributes={
        "infermesh.worker_id": worker_id, "infermesh.request_id": request.request_id,
        "infermesh.attempt": request.attempt, "infermesh.request_class": request.request_class,
        "gen_ai.request.model": request.model, "infermesh.num_prompt_tokens": len(request.prompt_token_ids),
        "infermesh.num_resumed_tokens": len(request.output_token_ids)})


def record_engine(span: trace.Span, timings: EngineTimings | None) -> None:
    """The engine's own account of a finished request: attributes, and its phases as child spans."""
    if timings is None or not span.is_recording():
        return
    t = timings
    span.set_attributes({"gen_ai.latency.time_in_queue": t.scheduled_at - t.queued_at,
                         "gen_ai.latency.time_in_model_prefill": t.first_token_at - t.scheduled_at,
                         "gen_ai.latency.time_in_model_decode": t.last_token_at - t.first_token_at,
                         "gen_ai.latency.time_in_model_inference": t.last_token_at - t.scheduled_at,
                         "infermesh.engine.num_preemptions": t.num_preemptions})
    floor = getattr(span, "start_time", None) or 0  # the SDK's span knows its start: phases never begin before it
    ctx = trace.set_span_in_context(span)
    _phase(ctx, "engine.queue", t.queued_at, t.scheduled_at, floor)
    _phase(ctx, "engine.prefill", t.scheduled_at, t.first_token_at, floor)
    _phase(ctx, "engine.decode", t.first_token_at, t.last_token_at, floor)
    pull = t.kv_pull
    if pull is not None:
        _phase(ctx, "kv.transfer", pull.started_at, pull.ended_at, floor, {
            "infermesh.kv_transfer.bytes": pull.num_bytes, "infermesh.kv_transfer.descriptors": pull.num_descriptors,
            "infermesh.kv_transfer.connector": pull.connector,
            "infermesh.kv_transfer.duration_s": pull.ended_at - pull.started_at}, trace.SpanKind.CLIENT)


def _phase(ctx: Any, name: str, start_s: float, end_s: float, floor_ns: int,
           attributes: dict[str, Any] | None = None, kind: trace.SpanKind = trace.SpanKind.INTERNAL) -> None:
    start_ns = max(int(start_s * 1e9), floor_ns)
    span = _tracer.start_span(name, context=ctx, kind=kind, attributes=attributes, start_time=start_ns)
    span.end(end_time=max(int(end_s * 1e9), start_ns))
