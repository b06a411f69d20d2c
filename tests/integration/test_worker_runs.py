"""A sim worker on real NATS (issue 38, point 7): a request aborted while it waited in the engine's queue ends
with no prompt tokens computed (what its client is billed), and a request id already running there is refused
instead of taking the running request's entries (an engine keys its requests by id)."""

from __future__ import annotations

import asyncio

import pytest

from services.worker.config import WorkerConfig
from services.worker.service import WorkerService
from shared.bus import Bus, StreamReceiver
from shared.schema import AbortRequest, GenerateRequest, SamplingParams, StreamEnd, StreamError, TokenChunk
from tests.utils import eventually

pytestmark = pytest.mark.integration
PROMPT = list(range(3, 40))


@pytest.fixture
async def worker(nats_url, namespace):
    bus = await Bus.connect(nats_url, namespace, "worker")
    config = WorkerConfig(nats_url=nats_url, namespace=namespace, worker_id="w-runs", engine="sim",
                          sim_ttft_ms=1, sim_itl_ms=20, max_num_seqs=1, unseen_edge_grace_s=60.0)
    service = WorkerService(config, bus)
    await service.start()
    yield service
    await service.stop()
    await bus.close()


@pytest.fixture
async def receiver(bus):
    receiver = StreamReceiver(bus, "e-runs")
    await receiver.start()
    yield receiver
    await receiver.stop()


async def generate(bus: Bus, receiver: StreamReceiver, request_id: str, max_tokens: int = 5000):
    stream = receiver.open(request_id, "w-runs")
    await bus.publish(bus.subjects.worker_generate("w-runs"),
                      GenerateRequest(request_id, "sim-model", PROMPT, SamplingParams(max_tokens=max_tokens)),
                      reply=receiver.subject(request_id))
    return stream


async def ended(stream) -> StreamEnd | StreamError:
    while isinstance(message := await stream.next(), TokenChunk):
        pass
    return message


async def test_a_request_aborted_in_the_engines_queue_ends_with_no_prompt_computed(worker, bus, receiver):
    running = await generate(bus, receiver, "running")
    assert isinstance(await running.next(), TokenChunk)  # it holds the engine's only slot
    queued = await generate(bus, receiver, "queued", 5)
    await eventually(lambda: worker.engine.load().num_waiting == 1, 5, 0.01)
    await bus.publish(bus.subjects.worker_abort("w-runs"), AbortRequest("queued"))
    end = await ended(queued)
    assert isinstance(end, StreamEnd) and (end.finish_reason, end.num_prompt_tokens, end.num_cached_tokens,
                                           end.num_output_tokens) == ("abort", 0, 0, 0)
    await bus.publish(bus.subjects.worker_abort("w-runs"), AbortRequest("running"))
    end = await ended(running)
    assert isinstance(end, StreamEnd) and end.num_prompt_tokens == len(PROMPT)  # it ran: its prompt was computed


async def test_a_request_id_already_running_is_refused_and_the_running_one_stays_abortable(worker, bus, receiver):
    first = await generate(bus, receiver, "dup")
    assert isinstance(await first.next(), TokenChunk)
    other_edge = StreamReceiver(bus, "e-other")  # the second run's answers go elsewhere, to be told apart
    await other_edge.start()
    try:
        second = other_edge.open("dup", "w-runs")
        await bus.publish(bus.subjects.worker_generate("w-runs"),
                          GenerateRequest("dup", "sim-model", PROMPT, SamplingParams(max_tokens=5000)),
                          reply=other_edge.subject("dup"))
        refused = await second.next()
        assert isinstance(refused, StreamError) and refused.code == "engine_error", refused
    finally:
        await other_edge.stop()
    await bus.publish(bus.subjects.worker_abort("w-runs"), AbortRequest("dup"))  # still the first's
    end = await ended(first)
    assert isinstance(end, StreamEnd) and end.finish_reason == "abort"
    await eventually(lambda: not worker._tasks and worker.engine.load().num_running == 0, 5, 0.01)


async def test_an_ended_runs_cleanup_leaves_a_newer_run_of_the_same_id_alone(worker):
    async def run() -> None:
        await asyncio.Event().wait()

    old, new = asyncio.create_task(run()), asyncio.create_task(run())
    try:
        worker._tasks["same"] = new  # the newer run came in before the old one's done-callback ran
        worker._forget("same", old)
        assert worker._tasks["same"] is new
        worker._forget("same", new)
        assert "same" not in worker._tasks
    finally:
        old.cancel()
        new.cancel()
        await asyncio.gather(old, new, return_exceptions=True)
