"""Sampling that keeps what an operator looks for: every trace the ratio picks, and of the rest, the ones that
erred or were slow.

OpenTelemetry's sampler (``OTEL_TRACES_SAMPLER``, e.g. ``parentbased_traceidratio`` with
``OTEL_TRACES_SAMPLER_ARG=0.1``) decides when a trace starts, before anyone knows how it will end. So when it
is not always-on, the spans it leaves out are still recorded (``AlwaysRecordSampler``: not sampled, so what
they propagate still says "not sampled") and ``KeepErrorsAndSlow`` looks at them when they end:

- a sampled span is exported at once;
- what is kept is exported marked sampled, with ``infermesh.sampling.kept_by`` = ``error`` or ``slow``;
- a left-out span waits with the rest of its trace's spans in this process until the trace's *local root*
  ends (the span whose parent is in another process, or that has none: the edge's request span, the worker's
  ``generate``, the admission leader's ``admission.decide``). Then the trace's spans here are exported if one
  of them has status ERROR or the root lasted ``slow_s`` or more (``INFERMESH_TRACES_SLOW_MS``, default 2000),
  else dropped;
- a span of a decided trace that ends later (the edge bills after the response) follows the decision.

Each process decides for its own part: a request that fails on a worker keeps the worker's spans and the
edge's (its request span errs too); a slow one keeps the edge's and, when the time went there, the worker's.
The router's and admission's parts of such a trace are kept only when they were slow or erred themselves;
for whole trees under sampling, send the spans to an OpenTelemetry Collector with its tail-sampling processor.
Memory is bounded: at most ``max_traces`` traces wait (the oldest is dropped), ``max_spans`` spans each besides
its root.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.sampling import AlwaysRecordSampler, Sampler, _get_from_env_or_default
from opentelemetry.trace import SpanContext, StatusCode, TraceFlags

DEFAULT_SLOW_MS = 2000.0
KEPT_BY = "infermesh.sampling.kept_by"  # on a span the ratio left out and this kept: "error" or "slow"
KEEPS_EVERY_TRACE = ("", "always_on", "parentbased_always_on")  # OpenTelemetry's default: parentbased_always_on


def configured_sampler() -> tuple[Sampler, bool]:
    """The sampler OpenTelemetry's env vars name, and whether it leaves traces out (then it records them all,
    for ``KeepErrorsAndSlow``)."""
    sampler = _get_from_env_or_default()
    if (os.environ.get("OTEL_TRACES_SAMPLER") or "").strip().lower() in KEEPS_EVERY_TRACE:
        return sampler, False
    return AlwaysRecordSampler(sampler), True


def slow_s_from_env() -> float:
    return float(os.environ.get("INFERMESH_TRACES_SLOW_MS") or DEFAULT_SLOW_MS) / 1000.0


def _is_local_root(span: ReadableSpan) -> bool:
    return span.parent is None or span.parent.is_remote


def _erred(span: ReadableSpan) -> bool:
    return span.status.status_code is StatusCode.ERROR


def _as_kept(span: ReadableSpan, why: str) -> ReadableSpan:
    """``span`` marked sampled (exporting processors pass only sampled spans), with why it was kept."""
    ctx = span.context
    kept = SpanContext(ctx.trace_id, ctx.span_id, ctx.is_remote, TraceFlags(ctx.trace_flags | TraceFlags.SAMPLED),
                       ctx.trace_state)
    return ReadableSpan(span.name, kept, span.parent, span.resource, {**(span.attributes or {}), KEPT_BY: why},
                        span.events, span.links, span.kind, status=span.status, start_time=span.start_time,
                        end_time=span.end_time, instrumentation_scope=span.instrumentation_scope)


class KeepErrorsAndSlow(SpanProcessor):
    """In front of the exporting processor: sampled spans pass; left-out ones pass when their trace erred or was
    slow here (see the module's text)."""

    def __init__(self, exporting: SpanProcessor, slow_s: float, max_traces: int = 4096, max_spans: int = 512) -> None:
        self._exporting, self._slow_ns = exporting, int(slow_s * 1e9)
        self._max_traces, self._max_spans = max_traces, max_spans
        self._waiting: OrderedDict[int, list[ReadableSpan]] = OrderedDict()  # trace id -> its ended spans here
        self._decided: OrderedDict[int, str] = OrderedDict()  # trace id -> why kept ("": dropped); late spans follow
        self._lock = threading.Lock()
        self.kept_traces = self.dropped_traces = 0

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        self._exporting.on_start(span, parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        if span.context.trace_flags.sampled:
            self._exporting.on_end(span)
            return
        with self._lock:
            kept, why = self._take(span)
        for done in kept:
            self._exporting.on_end(_as_kept(done, why))

    def _take(self, span: ReadableSpan) -> tuple[list[ReadableSpan], str]:
        """The spans to export now that ``span`` ended, and why (under the lock)."""
        trace_id = span.context.trace_id
        why = self._decided.get(trace_id)
        if why is not None:
            return ([span] if why else []), why
        spans = self._waiting.pop(trace_id, [])
        if not _is_local_root(span):
            if len(spans) < self._max_spans:
                spans.append(span)
            self._waiting[trace_id] = spans  # newest last: the oldest is dropped first
            while len(self._waiting) > self._max_traces:
                self._waiting.popitem(last=False)
            return [], ""
        spans.append(span)
        why = self._why_kept(spans, span)
        self._decided[trace_id] = why
        while len(self._decided) > self._max_traces:
            self._decided.popitem(last=False)
        if why:
            self.kept_traces += 1
        else:
            self.dropped_traces += 1
        return (spans if why else []), why

    def _why_kept(self, spans: list[ReadableSpan], root: ReadableSpan) -> str:
        if any(_erred(s) for s in spans):
            return "error"
        return "slow" if (root.end_time or 0) - (root.start_time or 0) >= self._slow_ns else ""

    def shutdown(self) -> None:
        self._exporting.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._exporting.force_flush(timeout_millis)
