"""Stored responses in the ledger (services/metering/responses.py), on SQLite and Postgres, and served over a real
NATS: kept once, read only by their team, gone at their expiry, chains walked oldest first, 503 with no database."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
from types import SimpleNamespace

import msgspec
import pytest

from services.edge.responses_api import ResponsesApi
from services.metering.db import create_engine
from services.metering.responses import (
    BrokenChain,
    ResponseNotFound,
    ResponsesServer,
    conversation,
    fetch,
    remove,
    store,
    sweep,
)
from shared.errors import ApiError
from shared.responses_schema import ResponsesApiReply, ResponsesApiRequest, StoredResponse

pytestmark = pytest.mark.integration
UTC = dt.timezone.utc
DAY = 86_400.0


def now() -> dt.datetime:
    return dt.datetime.now(UTC)


def record(response_id: str, team: str = "acme", previous: str | None = None, created_at: float | None = None,
           text: str = "") -> StoredResponse:
    output = [{"id": f"msg_{response_id}", "type": "message", "role": "assistant",
               "content": [{"type": "output_text", "text": text or f"answer {response_id}"}]}]
    return StoredResponse(
        id=response_id, team=team, created_at=time.time() if created_at is None else created_at,
        previous_response_id=previous,
        response=json.dumps({"id": response_id, "object": "response", "output": output, "store": True}).encode(),
        input_items=json.dumps([{"id": f"in_{response_id}", "type": "message", "role": "user",
                                 "content": [{"type": "input_text", "text": f"ask {response_id}"}]}]).encode())


@pytest.fixture
async def engine(ledger_url):
    engine = create_engine(ledger_url)
    yield engine
    await engine.dispose()


async def test_a_response_is_kept_once_and_read_back_only_by_its_team(engine):
    await store(engine, record("resp_1", text="first"), DAY)
    await store(engine, record("resp_1", text="asked again"), DAY)  # the request asked twice: the first stands
    row = await fetch(engine, "acme", "resp_1", now())
    assert row.response["output"][0]["content"][0]["text"] == "first"
    assert row.input_items[0]["id"] == "in_resp_1"
    with pytest.raises(ResponseNotFound):
        await fetch(engine, "other-team", "resp_1", now())
    with pytest.raises(ResponseNotFound):
        await remove(engine, "other-team", "resp_1", now())
    await remove(engine, "acme", "resp_1", now())
    with pytest.raises(ResponseNotFound):
        await fetch(engine, "acme", "resp_1", now())
    with pytest.raises(ResponseNotFound):
        await remove(engine, "acme", "resp_1", now())


async def test_a_chain_is_walked_oldest_first_and_breaks_where_a_response_is_gone(engine):
    await store(engine, record("resp_a"), DAY)
    await store(engine, record("resp_b", previous="resp_a"), DAY)
    await store(engine, record("resp_c", previous="resp_b"), DAY)
    items = await conversation(engine, "acme", "resp_c", now())
    assert [item["id"] for item in items] == ["in_resp_a", "msg_resp_a", "in_resp_b", "msg_resp_b", "in_resp_c",
                                              "msg_resp_c"]
    assert [item["id"] for item in await conversation(engine, "acme", "resp_a", now())] == ["in_resp_a",
                                                                                          "msg_resp_a"]
    with pytest.raises(ResponseNotFound):
        await conversation(engine, "other-team", "resp_c", now())
    await remove(engine, "acme", "resp_a", now())
    with pytest.raises(BrokenChain) as info:
        await conversation(engine, "acme", "resp_c", now())
    assert info.value.missing == "resp_a"


async def test_a_chain_does_not_cross_into_another_teams_response(engine):
    await store(engine, record("resp_theirs", team="other-team"), DAY)
    await store(engine, record("resp_mine", previous="resp_theirs"), DAY)  # a forged link
    with pytest.raises(BrokenChain):
        await conversation(engine, "acme", "resp_mine", now())


async def test_an_expired_response_is_gone_at_once_and_swept_later(engine):
    old = time.time() - 2 * DAY
    await store(engine, record("resp_old", created_at=old), DAY)  # expired a day ago
    await store(engine, record("resp_new", previous="resp_old"), DAY)
    for read in (fetch, conversation):
        with pytest.raises(ResponseNotFound):
            await read(engine, "acme", "resp_old", now())
    with pytest.raises(BrokenChain):
        await conversation(engine, "acme", "resp_new", now())
    assert await sweep(engine, now()) == 1
    assert await sweep(engine, now()) == 0
    assert (await fetch(engine, "acme", "resp_new", now())).id == "resp_new"


# ---------------------------------------------------------------- over the bus
async def ask(bus, operation: str, **fields) -> ResponsesApiReply:
    return await bus.request(bus.subjects.responses_api(operation), ResponsesApiRequest(**fields), ResponsesApiReply,
                             timeout=10)


async def test_metering_answers_every_operation_over_nats(engine, bus):
    server = ResponsesServer(bus, engine, DAY, sweep_s=3600)
    await server.start()
    try:
        replies = await asyncio.gather(*(ask(bus, "store", team="acme", record=record(f"resp_{i}")) for i in range(8)))
        assert all(reply.error_status == 0 for reply in replies)  # concurrent stores, each its own task
        got = await ask(bus, "get", team="acme", response_id="resp_3")
        assert msgspec.json.decode(got.response)["id"] == "resp_3"
        assert msgspec.json.decode((await ask(bus, "input_items", team="acme", response_id="resp_3")).items)[0][
            "id"] == "in_resp_3"
        assert (await ask(bus, "get", team="other-team", response_id="resp_3")).error_status == 404
        missing = await ask(bus, "context", team="acme", response_id="resp_nope")
        assert (missing.error_status, missing.error_param, missing.error_code) == (
            400, "previous_response_id", "previous_response_not_found")
        forged = await ask(bus, "store", team="acme", record=record("resp_x", team="other-team"))
        assert forged.error_status == 400
        assert (await ask(bus, "delete", team="acme", response_id="resp_3")).error_status == 0
        assert (await ask(bus, "get", team="acme", response_id="resp_3")).error_status == 404
    finally:
        await server.stop()


async def test_the_edge_asks_again_while_no_metering_has_subscribed_yet(engine, bus, writer):
    """A request nobody received is safe to repeat: the edge asks again for a moment (metering restarting, or NATS
    saying "no responders" just after its subscribe) instead of answering 503 at once."""
    edge = ResponsesApi(SimpleNamespace(mesh=SimpleNamespace(bus=writer)))  # only its bus is used by ask()
    server = ResponsesServer(bus, engine, DAY, sweep_s=3600)

    async def start_late() -> None:
        await asyncio.sleep(0.3)  # the delay is the point: metering comes after the edge's first ask
        await server.start()

    starting = asyncio.create_task(start_late())
    try:
        stored = await edge.ask("store", ResponsesApiRequest(team="acme", record=record("resp_late")))
        assert stored.error_status == 0 and starting.done()
    finally:
        await starting
        await server.stop()
    with pytest.raises(ApiError) as away:  # nobody at all: 503 once the moment is over
        await edge.ask("get", ResponsesApiRequest(team="acme", response_id="resp_late"))
    assert (away.value.status, away.value.code) == (503, "responses_unavailable")


async def test_with_the_database_away_every_operation_answers_503(bus, tmp_path):
    away = create_engine(f"sqlite:///{tmp_path}/no/such/folder/ledger.db")  # cannot be opened
    server = ResponsesServer(bus, away, DAY, sweep_s=3600)
    await server.start()
    try:
        for operation, fields in (("store", {"record": record("resp_1")}), ("get", {"response_id": "resp_1"}),
                                  ("context", {"response_id": "resp_1"}), ("delete", {"response_id": "resp_1"})):
            reply = await ask(bus, operation, team="acme", **fields)
            assert (reply.error_status, reply.error_code) == (503, "ledger_unavailable"), operation
    finally:
        await server.stop()
        await away.dispose()
