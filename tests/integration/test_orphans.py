"""Orphans on real NATS: a sim worker aborts the requests of an edge that died (and only then) and reports
what they generated; an edge's biller bills signed reports exactly once and never a forged one."""

from __future__ import annotations

import time

import msgspec
import pytest

from services.edge.orphans import OrphanBiller, orphan_usage_event, sign, verify
from services.worker.config import WorkerConfig
from services.worker.service import WorkerService
from shared import schema
from shared.bus import Bus, StreamReceiver
from shared.edges import edge_registration, edges_bucket
from shared.orphans import ORPHANS_DURABLE, OrphanPublisher, ensure_orphans_stream
from shared.schema import (
    BillingContext,
    GenerateRequest,
    OrphanUsage,
    SamplingParams,
    SignedBilling,
    StreamEnd,
    TokenChunk,
    UsageEvent,
)
from shared.usage import UsagePublisher, ensure_usage_stream
from tests.utils import eventually

pytestmark = pytest.mark.integration
SECRET = b"k" * 32
CONTEXT = BillingContext(request_id="req1", attempt=0, team="alpha", key_prefix="im-AbCd", model="sim-model",
                         request_class="interactive", worker_id="w-orph", created_at=time.time(), trajectory="run-7")


@pytest.fixture
async def worker(nats_url, namespace):
    bus = await Bus.connect(nats_url, namespace, "worker")
    config = WorkerConfig(nats_url=nats_url, namespace=namespace, worker_id="w-orph", engine="sim",
                          sim_ttft_ms=1, sim_itl_ms=20, unseen_edge_grace_s=1.0, edge_probe_timeout_s=0.5)
    service = WorkerService(config, bus)
    await service.start()
    yield service
    await service.stop()
    await bus.close()


async def orphan_reports(bus: Bus) -> list[OrphanUsage]:
    sub = await bus.js.pull_subscribe(bus.subjects.orphans_all, stream=bus.subjects.orphans_stream)
    try:
        msgs = await sub.fetch(100, timeout=1)
    except Exception:
        return []
    finally:
        await sub.unsubscribe()
    return [schema.decode(m.data, OrphanUsage) for m in msgs]


async def usage_messages(bus: Bus) -> int:
    return (await bus.js.stream_info(bus.subjects.usage_stream)).state.messages


async def start_long_request(bus: Bus, edge_id: str, request_id: str) -> tuple[StreamReceiver, object]:
    receiver = StreamReceiver(bus, edge_id)
    await receiver.start()
    stream = receiver.open(request_id, "w-orph")
    await bus.publish(bus.subjects.worker_generate("w-orph"),
                      GenerateRequest(request_id, "sim-model", list(range(3, 40)), SamplingParams(max_tokens=5000),
                                      billing=sign(SECRET, request_id, CONTEXT)),
                      reply=receiver.subject(request_id))
    assert isinstance(await stream.next(), TokenChunk)
    return receiver, stream


async def test_a_dead_edges_request_is_aborted_and_reported_with_what_it_generated(worker, bus):
    registration = await edge_registration(bus, "e-dies", heartbeat_s=0.2, ttl_s=1)
    await eventually(lambda: "e-dies" in worker.orphans.directory.edges, 2)
    receiver, stream = await start_long_request(bus, "e-dies", "req1")
    await registration.halt()  # the edge "dies": its key lapses, its pings go unanswered
    halted_at = time.monotonic()
    await eventually(lambda: worker.engine.load().num_running == 0 and not worker._tasks, 1 + 0.5 + 3)
    assert time.monotonic() - halted_at < 4
    while not isinstance(end := await stream.next(), StreamEnd):
        pass
    assert end.finish_reason == "abort"
    (report,) = await orphan_reports(bus)
    assert (report.worker_id, report.edge_id, report.request_id) == ("w-orph", "e-dies", "req1")
    assert report.num_output_tokens == end.num_output_tokens > 0 and report.num_prompt_tokens == 37
    assert report.billing == sign(SECRET, "req1", CONTEXT)
    await receiver.stop()


async def test_a_request_that_ended_just_before_its_edge_died_is_reported_for_billing(worker, bus):
    """The edge got the end message and died before publishing the usage (a short request ends long before
    its edge's key lapses): the worker kept the report and hands it in once the edge is found silent."""
    registration = await edge_registration(bus, "e-ends", heartbeat_s=0.2, ttl_s=1)
    await eventually(lambda: "e-ends" in worker.orphans.directory.edges, 2)
    receiver = StreamReceiver(bus, "e-ends")
    await receiver.start()
    stream = receiver.open("req1", "w-orph")
    await bus.publish(bus.subjects.worker_generate("w-orph"),
                      GenerateRequest("req1", "sim-model", list(range(3, 40)), SamplingParams(max_tokens=5),
                                      billing=sign(SECRET, "req1", CONTEXT)),
                      reply=receiver.subject("req1"))
    while not isinstance(end := await stream.next(), StreamEnd):
        pass
    await registration.halt()  # dies before billing it
    assert end.finish_reason == "length"
    await eventually(lambda: worker.orphans.stats["reported"] == 1, 1 + 0.5 + 3)
    (report,) = await orphan_reports(bus)
    assert (report.request_id, report.finish_reason, report.num_output_tokens) == ("req1", "length", 5)
    event = orphan_usage_event(report, verify(SECRET, report.request_id, report.billing))  # as the worker echoed it
    assert (event.status, event.finish_reason, event.completion_tokens) == ("finished", "length", 5)
    assert event.trajectory == "run-7"  # an orphan's usage is in its agent run's trajectory too
    await receiver.stop()


async def test_a_request_that_ended_while_its_edge_lived_on_is_not_reported(worker, bus):
    registration = await edge_registration(bus, "e-lives", heartbeat_s=0.2, ttl_s=1)
    await eventually(lambda: "e-lives" in worker.orphans.directory.edges, 2)
    receiver = StreamReceiver(bus, "e-lives")
    await receiver.start()
    stream = receiver.open("req2", "w-orph")
    await bus.publish(bus.subjects.worker_generate("w-orph"),
                      GenerateRequest("req2", "sim-model", list(range(3, 40)), SamplingParams(max_tokens=5),
                                      billing=sign(SECRET, "req2", CONTEXT)),
                      reply=receiver.subject("req2"))
    while not isinstance(await stream.next(), StreamEnd):
        pass
    await eventually(lambda: worker.orphans.tracker.num_ended() == 0, worker.orphans.tracker.settle_s + 2)
    await registration.halt()  # dies later: what ended before its last beats was its own to bill
    await eventually(lambda: "e-lives" not in worker.orphans.directory.edges, 1 + 2)
    # nothing of the edge is left to bill, so it is not even pinged
    assert worker.orphans.stats["pings"] == worker.orphans.stats["reported"] == 0 and await orphan_reports(bus) == []
    await receiver.stop()


async def test_an_attempt_aborted_as_superseded_is_never_reported_when_its_edge_dies(worker, bus):
    """A retry or a migration carries the request on elsewhere and bills it: the old attempt, aborted as
    superseded, is nobody's orphan even if its edge dies right after (it would bill the tokens twice)."""
    registration = await edge_registration(bus, "e-moves", heartbeat_s=0.2, ttl_s=1)
    await eventually(lambda: "e-moves" in worker.orphans.directory.edges, 2)
    receiver, stream = await start_long_request(bus, "e-moves", "req1")
    await bus.publish(bus.subjects.worker_abort("w-orph"), schema.AbortRequest("req1", superseded=True))
    while not isinstance(end := await stream.next(), StreamEnd):
        pass
    assert end.finish_reason == "abort"
    await registration.halt()  # the edge dies before its next attempt's usage is published
    await eventually(lambda: "e-moves" not in worker.orphans.directory.edges, 1 + 2)
    await eventually(lambda: not worker._tasks, 2)
    assert worker.orphans.stats["reported"] == 0 and await orphan_reports(bus) == []
    await receiver.stop()


async def test_a_live_edge_out_of_the_bucket_keeps_its_requests(worker, bus):
    registration = await edge_registration(bus, "e-lapsed", heartbeat_s=5, ttl_s=10)
    await eventually(lambda: "e-lapsed" in worker.orphans.directory.edges, 2)
    receiver, _stream = await start_long_request(bus, "e-lapsed", "req2")
    await (await edges_bucket(bus)).purge("e-lapsed")  # as a missed heartbeat: the key is gone, the edge is not
    await eventually(lambda: "e-lapsed" not in worker.orphans.directory.edges, 2)
    await eventually(lambda: worker.orphans.stats["answered"] == 1, 3)  # pinged, and it answered
    assert "req2" in worker._tasks and not worker.orphans.orphaned and worker.orphans.stats["silent"] == 0
    await registration.stop()
    await eventually(lambda: not worker._tasks, 3)  # gone for good now: aborted
    await receiver.stop()


async def test_a_request_from_an_edge_never_seen_is_aborted_after_the_grace(worker, bus):
    receiver, _stream = await start_long_request(bus, "e-ghost", "req3")
    started = time.monotonic()
    await eventually(lambda: not worker._tasks, 1 + 0.25 + 2)
    assert time.monotonic() - started >= 0.9  # not before the grace
    (report,) = await orphan_reports(bus)
    assert report.edge_id == "e-ghost" and worker.orphans.stats == {"pings": 1, "answered": 0, "silent": 1,
                                                                    "aborted": 1, "reported": 1}
    await receiver.stop()


def signed_report(request_id: str = "req1", **changes: object) -> OrphanUsage:
    report = OrphanUsage(worker_id="w-orph", edge_id="e-dead", request_id=request_id,
                         billing=sign(SECRET, request_id, CONTEXT), num_prompt_tokens=37, num_cached_tokens=0,
                         num_output_tokens=50, ts=time.time())
    return msgspec.structs.replace(report, **changes)


async def start_biller(bus: Bus) -> OrphanBiller:
    await ensure_usage_stream(bus)
    biller = OrphanBiller(bus, SECRET, UsagePublisher(bus), fetch_wait_s=0.2, deployment="east")
    await biller.start()
    return biller


async def all_acked(bus: Bus) -> bool:
    info = await bus.js.consumer_info(bus.subjects.orphans_stream, ORPHANS_DURABLE)
    return info.num_pending == 0 and info.num_ack_pending == 0


async def test_a_forged_or_unsigned_report_is_acked_and_not_billed(bus):
    await ensure_orphans_stream(bus)
    publisher = OrphanPublisher(bus, "w-orph")
    forged = schema.encode(msgspec.structs.replace(CONTEXT, team="victim"))
    await publisher.publish(signed_report(billing=SignedBilling(forged, sign(SECRET, "req1", CONTEXT).signature)))
    await publisher.publish(signed_report("req9", billing=None))
    biller = await start_biller(bus)
    try:
        await eventually(lambda: biller.stats["forged"] == 1 and biller.stats["unsigned"] == 1, 5)
        await eventually(lambda: all_acked(bus), 2)
        assert await usage_messages(bus) == 0 and biller.stats["billed"] == 0
    finally:
        await biller.stop()


async def test_reports_wait_for_an_edge_and_a_duplicate_or_the_edges_own_usage_bills_once(bus):
    await ensure_orphans_stream(bus)
    await ensure_usage_stream(bus)
    own = orphan_usage_event(signed_report("req7"), msgspec.structs.replace(CONTEXT, request_id="req7"))  # the edge's
    await UsagePublisher(bus).publish(msgspec.structs.replace(own, status="finished", finish_reason="length"))
    publisher = OrphanPublisher(bus, "w-orph")
    await publisher.publish(signed_report("req1"))
    await publisher.publish(signed_report("req1"))  # published twice (a lost ack): one message in the stream
    await bus.js.publish(bus.subjects.orphans("w-orph"), schema.encode(signed_report("req1")),  # past the window
                         headers={"Nats-Msg-Id": "orphan:req1:late"})
    context7 = msgspec.structs.replace(CONTEXT, request_id="req7")
    await publisher.publish(msgspec.structs.replace(signed_report("req7"), billing=sign(SECRET, "req7", context7)))
    assert (await bus.js.stream_info(bus.subjects.orphans_stream)).state.messages == 3
    biller = await start_biller(bus)  # no edge was up: the reports waited
    try:
        await eventually(lambda: biller.stats["billed"] == 3, 5)
        await eventually(lambda: all_acked(bus), 2)
        assert await usage_messages(bus) == 2  # req7 (the edge's own) and req1, once each
        sub = await bus.js.pull_subscribe(bus.subjects.usage, stream=bus.subjects.usage_stream)
        events = [schema.decode(m.data, UsageEvent) for m in await sub.fetch(10, timeout=1)]
        await sub.unsubscribe()
        assert [(e.request_id, e.status, e.completion_tokens) for e in events] == [
            ("req7", "finished", 50), ("req1", "cancelled", 50)]
        assert events[1].deployment == "east"  # the biller's deployment: its workers served the request
    finally:
        await biller.stop()


async def test_an_orphan_report_outlasts_any_jetstream_outage(bus, monkeypatch):
    # the report is the only record of a dead edge's usage: the old publisher gave it up after 120 s (here every
    # look at the clock is 200 s later, so a deadline passes at once); it must wait for JetStream however long
    import asyncio
    import types
    skew = {"s": 0.0}

    def monotonic() -> float:
        skew["s"] += 200.0
        return time.monotonic() + skew["s"]

    monkeypatch.setattr("shared.orphans.time", types.SimpleNamespace(monotonic=monotonic, time=time.time),
                        raising=False)
    publisher = OrphanPublisher(bus, "w-orph", max_delay_s=0.05)
    publishing = asyncio.create_task(publisher.publish(signed_report("req-outage")))  # no stream: refused
    try:
        await eventually(lambda: publisher.retries >= 5, 10)
        assert not publishing.done()
        await ensure_orphans_stream(bus)  # JetStream takes it again
        assert await asyncio.wait_for(publishing, 10) is True
        assert (await bus.js.stream_info(bus.subjects.orphans_stream)).state.messages == 1
    finally:
        publishing.cancel()
