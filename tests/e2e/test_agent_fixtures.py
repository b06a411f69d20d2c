"""Every request the real harnesses sent (tests/fixtures/agents, recorded by ``python -m tests.agents.record``)
replayed against the edge of an in-process sim mesh: each is served as it was when recorded (the status, a stream
when it streamed, the API's own event sequence) and answered the same way (a tool call or text: the sim script of
the recording, tests/agents/harnesses.py, picks the same answers). No harness needed: this runs in every CI run,
and fails when an edge change stops serving what Claude Code, Codex or OpenCode really send."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from infermesh.local import LocalMesh
from tests.agents.fixtures import FIXTURES, NORMALIZED_ROOT, load_fixtures
from tests.agents.harnesses import HARNESSES, write_script
from tests.agents.session import MODEL, SIM_MAX_MODEL_LEN
from tests.utils import eventually

pytestmark = [pytest.mark.e2e]
KEY = "replay-key"
RECORDED = load_fixtures()
# per endpoint: the first and last events of a stream, and what marks a tool call in it
STREAMS = {
    "/v1/messages": ("message_start", "message_stop", '"tool_use"'),
    "/v1/responses": ("response.created", "response.completed", '"function_call"'),
    "/v1/chat/completions": (None, "[DONE]", '"tool_calls"'),
}


@pytest.fixture(scope="module")
async def edge_url(nats_url, tiny_model, tmp_path_factory):
    script = write_script(tmp_path_factory.mktemp("replay") / "script.json",
                          {name: Path(NORMALIZED_ROOT) / name / "repo" for name in HARNESSES})
    mesh = LocalMesh(nats_url, f"r{uuid.uuid4().hex[:8]}", dev_key=KEY)
    await mesh.start_router()
    await mesh.start_worker(worker_id="sim-0", engine="sim", model=MODEL, model_path=str(tiny_model),
                            max_model_len=SIM_MAX_MODEL_LEN, sim_ttft_ms=0, sim_itl_ms=0, sim_script=str(script))
    await mesh.start_edge()
    await eventually(mesh.edge.mesh.is_ready, 20)
    yield mesh.base_url.removesuffix("/v1")
    await mesh.stop()


def test_fixtures_cover_every_harness():
    assert {f["harness"] for f in RECORDED} == set(HARNESSES), f"python -m tests.agents.record writes {FIXTURES}"
    for fixture in RECORDED:  # what a fixture must never keep
        assert not {"authorization", "x-api-key"} & set(fixture["headers"]), fixture["path"]


def events(path: str, text: str) -> list[str]:
    """The stream's event names (Anthropic, Responses) or its data lines (chat completions), in order."""
    if path == "/v1/chat/completions":
        return [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    return [line.removeprefix("event: ") for line in text.splitlines() if line.startswith("event: ")]


def check_shape(path: str, streamed: bool, answer: str, reply: httpx.Response) -> None:
    first, last, tool_mark = STREAMS[path]
    if not streamed:
        body: dict[str, Any] = reply.json()
        assert {"/v1/messages": "content", "/v1/responses": "output", "/v1/chat/completions": "choices"}[path] in body
        assert (tool_mark in reply.text) == (answer == "tool_call"), reply.text[:2000]
        return
    assert reply.headers["content-type"].startswith("text/event-stream"), reply.headers
    names = events(path, reply.text)
    assert names and names[-1] == last and (first is None or names[0] == first), names
    if path == "/v1/chat/completions":
        chunks = [json.loads(data) for data in names[:-1]]
        assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
        assert chunks[-1]["choices"] == [] or chunks[-1]["choices"][0]["finish_reason"], chunks[-1]
    assert (tool_mark in reply.text) == (answer == "tool_call"), reply.text[-2000:]


@pytest.mark.parametrize("fixture", RECORDED, ids=[f"{f['harness']}-{i}" for i, f in enumerate(RECORDED)])
async def test_recorded_request_is_served_as_recorded(edge_url, fixture):
    headers = {**fixture["headers"], "authorization": f"Bearer {KEY}"}
    body = json.dumps(fixture["body"]).encode() if fixture["body"] is not None else None
    async with httpx.AsyncClient(base_url=edge_url, timeout=120) as client:
        reply = await client.request(fixture["method"], fixture["path"], content=body, headers=headers)
    assert reply.status_code == fixture["status"], reply.text[:2000]
    path = fixture["path"].split("?")[0]
    if path in STREAMS and reply.status_code == 200:
        check_shape(path, fixture["streamed"], fixture["answer"], reply)
