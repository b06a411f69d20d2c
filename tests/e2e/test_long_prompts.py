"""Long prompts and the bus's message limit (shared/bus_limits.py), on a sim mesh whose NATS server allows only
64 KiB per message, so its limit is met at ~24K tokens instead of NATS' default ~500K: a prompt whose generate
request fits goes through and is billed as sent, and its KV events reach the router in batches that fit; one
token more is a clear 400 (``prompt_too_large``), in the API's own shape for each endpoint, before it takes a
lease; the mesh serves on."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from infermesh.local import LocalMesh
from shared import bus_limits, schema
from shared.ports import free_port
from shared.schema import SamplingParams
from tests.utils import eventually, nats_server

pytestmark = [pytest.mark.e2e]
KEY = "test-key"
MAX_PAYLOAD = 64 << 10
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def small_nats(tmp_path_factory):
    folder = tmp_path_factory.mktemp("small-nats")
    port = free_port()
    (folder / "nats.json").write_text(json.dumps({"listen": f"127.0.0.1:{port}", "max_payload": MAX_PAYLOAD,
                                                  "jetstream": {"store_dir": str(folder / "store")}}))
    with nats_server(port, ["-c", str(folder / "nats.json")]) as url:
        yield url


@pytest.fixture
async def mesh(small_nats, namespace, tiny_model):
    mesh = LocalMesh(small_nats, namespace, dev_key=KEY)
    await mesh.start_admission()
    await mesh.start_router()
    await mesh.start_worker(worker_id="sim-0", engine="sim", model="tiny", model_path=str(tiny_model),
                            max_model_len=64_000, num_kv_blocks=8_000, sim_ttft_ms=1, sim_itl_ms=1)
    await mesh.start_edge()
    await eventually(mesh.edge.mesh.is_ready, 10)
    yield mesh
    await mesh.stop()


def _largest_prompt_that_fits(max_id: int) -> int:
    """Tokens (each 2 bytes packed: the tiny vocabulary is below 65536) whose request the edge lets through."""
    sampling = len(schema.encode(SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=[1, 2], seed=1)))
    n = (MAX_PAYLOAD - bus_limits.ENVELOPE_BYTES - sampling - 1) // 2
    assert bus_limits.generate_request_bytes(n, max_id, sampling) <= MAX_PAYLOAD
    return n


async def test_a_prompt_at_the_limit_runs_and_one_token_more_is_a_clear_400(mesh):
    assert mesh.edge.mesh.bus.nc.max_payload == MAX_PAYLOAD
    tokenizer = await mesh.edge.mesh.tokenizer(mesh.edge.mesh.model_info("tiny"))
    fits = _largest_prompt_that_fits(tokenizer.vocab_size - 1)
    prompt = [(i * 7919) % (tokenizer.vocab_size - 200) + 100 for i in range(fits)]
    body = {"model": "tiny", "max_tokens": MAX_TOKENS, "seed": 1}
    async with httpx.AsyncClient(base_url=mesh.base_url, timeout=120,
                                 headers={"Authorization": f"Bearer {KEY}"}) as http:
        ok = await http.post("/completions", json={**body, "prompt": prompt})
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["prompt_tokens"] == fits
        # its KV events reached the router too: ~50K ids, in batches that each fit a message (kv_log.py)
        router, worker = mesh.routers[0], mesh.workers[0]
        await eventually(lambda: router.kv_sync.last_seq("sim-0") == worker.kv_log.seq > 1, 10)
        assert worker.kv_log.num_blocks() * 16 >= fits - 16
        too_long = await http.post("/completions", json={**body, "prompt": prompt + [prompt[0]] * 2_000})
    assert too_long.status_code == 400
    error = too_long.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "prompt", "prompt_too_large")
    assert "max_payload" in error["message"] and f"{MAX_PAYLOAD} bytes" in error["message"]
    leases = mesh.admissions[0].ledgers["tiny"].leases
    await eventually(lambda: not leases, 5)  # the 200's released; the 400 never took one

    client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key=KEY, max_retries=0)
    words = " ".join(f"w{i}" for i in range(8_000))  # more tokens than fit the bus, fewer than the context
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": words}],
                                             max_tokens=MAX_TOKENS)
    assert refused.value.code == "prompt_too_large" and refused.value.param == "messages"
    answer = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=MAX_TOKENS)  # and the mesh serves on
    assert answer.usage.completion_tokens == MAX_TOKENS
