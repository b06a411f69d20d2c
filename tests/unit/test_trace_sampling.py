"""shared/trace_sampling.py: what a ratio sampler leaves out is still exported when it erred or was slow, a
trace's spans in a process decided together at its local root, late spans following the decision, memory bounded.

Real OpenTelemetry SDK providers and its in-memory exporter; span times are given explicitly (no clock)."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import AlwaysRecordSampler, ParentBased, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shared.trace_sampling import KEPT_BY, KeepErrorsAndSlow, configured_sampler

MS = 1_000_000  # ns
SLOW_S = 2.0


def _tracer(ratio: float, **bounds) -> tuple[trace.Tracer, InMemorySpanExporter, KeepErrorsAndSlow]:
    exporter = InMemorySpanExporter()
    keeper = KeepErrorsAndSlow(SimpleSpanProcessor(exporter), SLOW_S, **bounds)
    provider = TracerProvider(sampler=AlwaysRecordSampler(ParentBased(TraceIdRatioBased(ratio))))
    provider.add_span_processor(keeper)
    return provider.get_tracer("test"), exporter, keeper


def _request(tracer: trace.Tracer, duration_ms: int, child_fails: bool = False, parent=None) -> trace.Span:
    """A root span with one child, ended; returns the root."""
    root = tracer.start_span("request", context=parent, start_time=0)
    child = tracer.start_span("child", context=trace.set_span_in_context(root), start_time=1 * MS)
    if child_fails:
        child.set_status(trace.Status(trace.StatusCode.ERROR, "worker gone"))
    child.end(end_time=2 * MS)
    root.end(end_time=duration_ms * MS)
    return root


def _names(exporter: InMemorySpanExporter) -> list[str]:
    return [s.name for s in exporter.get_finished_spans()]


@pytest.mark.parametrize(("duration_ms", "child_fails", "kept"), [
    (50, False, []),  # fast and fine: left out
    (50, True, ["child", "request"]),  # a span erred: the whole tree here
    (int(SLOW_S * 1000), False, ["child", "request"]),  # the root lasted slow_s: kept
    (int(SLOW_S * 1000) - 1, False, []),
])
def test_a_left_out_trace_is_exported_whole_when_it_erred_or_was_slow(duration_ms, child_fails, kept):
    tracer, exporter, keeper = _tracer(0.0)
    root = _request(tracer, duration_ms, child_fails)
    assert not root.get_span_context().trace_flags.sampled  # left out by the ratio, yet recorded:
    assert _names(exporter) == kept
    assert (keeper.kept_traces, keeper.dropped_traces) == ((1, 0) if kept else (0, 1))
    why = "error" if child_fails else "slow"
    assert all(s.attributes[KEPT_BY] == why and s.context.trace_flags.sampled for s in exporter.get_finished_spans())


def test_sampled_spans_pass_at_once_without_waiting_for_their_root():
    tracer, exporter, _ = _tracer(1.0)
    root = tracer.start_span("request", start_time=0)
    tracer.start_span("child", context=trace.set_span_in_context(root), start_time=MS).end(end_time=2 * MS)
    assert _names(exporter) == ["child"]  # the root is still open
    root.end(end_time=3 * MS)
    assert _names(exporter) == ["child", "request"]


@pytest.mark.parametrize("root_fails", [True, False])
def test_a_span_ending_after_its_root_follows_the_traces_decision(root_fails):
    """The edge bills (usage.publish, a child of the request span) after the response: it goes where its trace went."""
    tracer, exporter, _ = _tracer(0.0)
    root = tracer.start_span("request", start_time=0)
    late = tracer.start_span("usage.publish", context=trace.set_span_in_context(root), start_time=MS)
    if root_fails:
        root.set_status(trace.Status(trace.StatusCode.ERROR, "boom"))
    root.end(end_time=2 * MS)
    late.end(end_time=3 * MS)
    assert _names(exporter) == (["request", "usage.publish"] if root_fails else [])


def test_a_span_whose_parent_is_in_another_process_is_this_process_local_root():
    """The worker's span under the edge's unsampled one: recorded (not sampled), decided when it ends."""
    edge_tracer, _, _ = _tracer(0.0)
    edge_span = edge_tracer.start_span("request", start_time=0)
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, trace.set_span_in_context(edge_span))
    assert int(carrier["traceparent"][-2:], 16) & 1 == 0  # what it propagates still says: not sampled
    worker_tracer, worker_exporter, _ = _tracer(0.0)
    remote = TraceContextTextMapPropagator().extract(carrier)
    span = _request(worker_tracer, 10, child_fails=True, parent=remote)
    assert not span.get_span_context().trace_flags.sampled
    assert _names(worker_exporter) == ["child", "request"]  # recorded, and kept: its child erred
    assert {s.context.trace_id for s in worker_exporter.get_finished_spans()} == {edge_span.get_span_context().trace_id}


def test_waiting_traces_are_bounded_the_oldest_dropped_first():
    tracer, exporter, _ = _tracer(0.0, max_traces=2)
    roots = []
    for _ in range(3):  # three traces whose child ended while their root is open
        root = tracer.start_span("request", start_time=0)
        tracer.start_span("child", context=trace.set_span_in_context(root), start_time=MS).end(end_time=2 * MS)
        roots.append(root)
    for root in roots:
        root.set_status(trace.Status(trace.StatusCode.ERROR, "boom"))
        root.end(end_time=3 * MS)
    spans = exporter.get_finished_spans()
    by_trace = [[s.name for s in spans if s.context.trace_id == r.get_span_context().trace_id] for r in roots]
    assert by_trace == [["request"], ["child", "request"], ["child", "request"]]  # the first one's child was let go


def test_spans_kept_per_trace_are_bounded():
    tracer, exporter, _ = _tracer(0.0, max_spans=3)
    root = tracer.start_span("request", start_time=0)
    for i in range(5):
        tracer.start_span(f"child-{i}", context=trace.set_span_in_context(root), start_time=MS).end(end_time=2 * MS)
    root.set_status(trace.Status(trace.StatusCode.ERROR, "boom"))
    root.end(end_time=3 * MS)
    assert _names(exporter) == ["child-0", "child-1", "child-2", "request"]  # the root is always kept


@pytest.mark.parametrize(("env", "leaves_out"), [
    ({}, False), ({"OTEL_TRACES_SAMPLER": "always_on"}, False),
    ({"OTEL_TRACES_SAMPLER": "parentbased_always_on"}, False),
    ({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"}, True),
    ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.5"}, True),
])
def test_only_a_sampler_that_leaves_traces_out_records_them_all(monkeypatch, env, leaves_out):
    monkeypatch.delenv("OTEL_TRACES_SAMPLER", raising=False)
    monkeypatch.delenv("OTEL_TRACES_SAMPLER_ARG", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    sampler, left_out = configured_sampler()
    assert left_out is leaves_out and isinstance(sampler, AlwaysRecordSampler) is leaves_out
