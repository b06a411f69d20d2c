"""The bus layer against a real nats-server: typed request/reply, token streams, failures."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry import trace

from shared import schema
from shared.bus import BusError, StreamReceiver, TokenStreamSender
from shared.schema import LoadRequest, LoadSnapshot, StreamEnd, StreamError, TokenChunk

pytestmark = pytest.mark.integration


async def test_request_reply_is_typed_and_carries_trace_context(bus, span_exporter):
    seen = {}

    async def handler(request: LoadRequest, raw):
        seen["traceparent"] = raw.headers.get("traceparent")
        seen["trace_id"] = trace.get_current_span().get_span_context().trace_id
        await bus.respond(raw, LoadSnapshot("w", 1, 0.0, 2, 0, 5, 10))

    await bus.subscribe("svc.load." + bus.subjects.namespace, LoadRequest, handler)
    with trace.get_tracer("test").start_as_current_span("caller") as span:
        reply = await bus.request("svc.load." + bus.subjects.namespace, LoadRequest(), LoadSnapshot)
    assert reply.num_running == 2 and reply.kv_usage == 0.5
    assert seen["traceparent"].split("-")[1] == format(span.get_span_context().trace_id, "032x")
    assert seen["trace_id"] == span.get_span_context().trace_id


async def test_request_without_responder_fails_fast(bus):
    with pytest.raises(BusError, match="no responder"):
        await bus.request(bus.subjects.route, LoadRequest(), LoadSnapshot, timeout=5)


async def test_token_stream_delivers_in_order_and_ends(bus):
    receiver = StreamReceiver(bus, "edge1")
    await receiver.start()
    stream = receiver.open("r1", "w1")
    sender = TokenStreamSender(bus, receiver.subject("r1"), "w1", "r1")
    for i in range(5):
        await sender.tokens([i, i + 100])
    await sender.end("length", 7, 0, 10)
    got = [await asyncio.wait_for(stream.next(), 2) for _ in range(6)]
    assert [m.token_ids for m in got[:5]] == [[i, i + 100] for i in range(5)]
    assert isinstance(got[5], StreamEnd) and got[5].num_output_tokens == 10 and stream.done
    await receiver.stop()


async def test_lost_message_is_reported_as_a_gap(bus):
    receiver = StreamReceiver(bus, "edge2")
    await receiver.start()
    stream = receiver.open("r2", "w1")
    subject = receiver.subject("r2")
    await bus.nc.publish(subject, schema.encode(TokenChunk("w1", 1, 0.0, "r2", [1])))
    await bus.nc.publish(subject, schema.encode(TokenChunk("w1", 3, 0.0, "r2", [3])))
    assert isinstance(await asyncio.wait_for(stream.next(), 2), TokenChunk)
    gap = await asyncio.wait_for(stream.next(), 2)
    assert isinstance(gap, StreamError) and gap.code == "stream_gap"
    await receiver.stop()


async def test_generate_to_a_missing_worker_fails_the_stream(bus):
    receiver = StreamReceiver(bus, "edge3")
    await receiver.start()
    stream = receiver.open("r3", "ghost")
    await bus.nc.publish(bus.subjects.worker_generate("ghost"), b"x", reply=receiver.subject("r3"))
    message = await asyncio.wait_for(stream.next(), 2)
    assert isinstance(message, StreamError) and message.code == "worker_unavailable"
    await receiver.stop()


async def test_failing_a_worker_ends_its_open_streams_only(bus):
    receiver = StreamReceiver(bus, "edge4")
    await receiver.start()
    doomed, other = receiver.open("a", "w-dead"), receiver.open("b", "w-live")
    assert receiver.fail_worker("w-dead", "worker_unavailable", "gone") == 1
    message = await asyncio.wait_for(doomed.next(), 1)
    assert isinstance(message, StreamError) and message.code == "worker_unavailable"
    assert other._queue.empty() and not other.done
    await receiver.stop()


async def test_a_silent_stream_times_out_first_then_between_messages(bus):
    receiver = StreamReceiver(bus, "edge5", sweep_s=0.01)
    await receiver.start()
    silent = receiver.open("s1", "w1", first_timeout_s=0.2, idle_timeout_s=5)
    started = asyncio.get_running_loop().time()
    message = await asyncio.wait_for(silent.next(), 2)
    assert isinstance(message, StreamError) and message.code == "timeout"
    assert 0.2 <= asyncio.get_running_loop().time() - started < 1.0
    stalled = receiver.open("s2", "w1", first_timeout_s=5, idle_timeout_s=0.2)
    sender = TokenStreamSender(bus, receiver.subject("s2"), "w1", "s2")
    await sender.tokens([1])
    assert isinstance(await asyncio.wait_for(stalled.next(), 2), TokenChunk)
    message = await asyncio.wait_for(stalled.next(), 2)
    assert isinstance(message, StreamError) and message.code == "timeout"
    await receiver.stop()
