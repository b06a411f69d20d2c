"""Stored responses on the mesh, driven by the official ``openai`` SDK: ``store`` and ``previous_response_id`` (a
conversation continued, a function tool answered), retrieve, input items, delete, a team that reads only its own,
on both ledgers; and a response that cannot be stored (metering away) says ``store: false`` and loses nothing."""

from __future__ import annotations

import json

import openai
import pytest

from tests.e2e.test_messages_api import start_mesh
from tests.e2e.test_metering_mesh import team_key
from tests.e2e.test_responses_api import WEATHER
from tests.utils import eventually

pytestmark = [pytest.mark.e2e]


async def clients(mesh, ledger_url: str, *teams: str) -> list[openai.AsyncOpenAI]:
    out = []
    for team in teams:
        key = await team_key(ledger_url, team)
        await eventually(lambda key=key: mesh.edge.mesh.keys.caller(key) is not None, 10)
        out.append(openai.AsyncOpenAI(base_url=mesh.base_url, api_key=key, max_retries=0))
    return out


async def test_a_stored_conversation_is_continued_read_listed_and_deleted(nats_url, namespace, tiny_model,
                                                                         ledger_url):
    mesh = await start_mesh(nats_url, namespace, tiny_model, ledger_url)
    try:
        codex, other = await clients(mesh, ledger_url, "codex", "other")
        tokenizer = await mesh.edge.mesh.tokenizer(mesh.edge.mesh.model_info("tiny"))
        first = await codex.responses.create(model="tiny", input="My name is Ada.", max_output_tokens=6)
        assert first.store is True
        async with codex.responses.stream(model="tiny", previous_response_id=first.id, input="What is my name?",
                                          max_output_tokens=5) as stream:
            second = [event async for event in stream][-1].response  # cut: response.incomplete
        assert second.store is True and second.previous_response_id == first.id
        seen = tokenizer.apply_chat_template([{"role": "user", "content": "My name is Ada."},
                                              {"role": "assistant", "content": first.output_text},
                                              {"role": "user", "content": "What is my name?"}])
        assert second.usage.input_tokens == len(seen)  # the stored conversation came before the input

        kept = await codex.responses.retrieve(first.id)
        assert (kept.id, kept.output_text, kept.usage, kept.status) == (first.id, first.output_text, first.usage,
                                                                        first.status)
        items = [item async for item in codex.responses.input_items.list(second.id)]
        assert [(item.type, item.role, item.content[0].text) for item in items] == [
            ("message", "user", "What is my name?")]  # its own input only
        for foreign in (other.responses.retrieve(first.id), other.responses.delete(first.id),
                        other.responses.create(model="tiny", previous_response_id=first.id, input="?",
                                               max_output_tokens=2)):
            with pytest.raises((openai.NotFoundError, openai.BadRequestError)):
                await foreign

        await codex.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await codex.responses.retrieve(first.id)
        with pytest.raises(openai.BadRequestError) as info:  # second continues first, which is gone
            await codex.responses.create(model="tiny", previous_response_id=second.id, input="?", max_output_tokens=2)
        assert info.value.param == "previous_response_id" and first.id in info.value.message
        with pytest.raises(openai.BadRequestError) as info:
            await codex.responses.create(model="tiny", previous_response_id="resp_unknown", input="?")
        assert info.value.param == "previous_response_id"

        unstored = await codex.responses.create(model="tiny", input="x", max_output_tokens=2, store=False)
        assert unstored.store is False
        with pytest.raises(openai.NotFoundError):
            await codex.responses.retrieve(unstored.id)
    finally:
        await mesh.stop()


async def test_a_function_call_is_answered_by_previous_response_id(nats_url, namespace, tiny_model, ledger_url):
    mesh = await start_mesh(nats_url, namespace, tiny_model, ledger_url)
    try:
        (codex,) = await clients(mesh, ledger_url, "codex")
        asked = await codex.responses.create(model="tiny", tools=[WEATHER], tool_choice="required",
                                             parallel_tool_calls=False, max_output_tokens=64,
                                             input="Weather in Paris?")
        (call,) = [item for item in asked.output if item.type == "function_call"]
        assert set(json.loads(call.arguments)) == {"city"}
        answered = await codex.responses.create(
            model="tiny", tools=[WEATHER], previous_response_id=asked.id, max_output_tokens=8,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18C, clear"}])
        assert answered.status in ("completed", "incomplete") and answered.previous_response_id == asked.id
        assert answered.usage.input_tokens > asked.usage.input_tokens + asked.usage.output_tokens
    finally:
        await mesh.stop()


async def test_without_metering_a_response_says_it_was_not_stored_and_is_still_served(nats_url, namespace,
                                                                                      tiny_model):
    mesh = await start_mesh(nats_url, namespace, tiny_model)  # no metering: nobody keeps stored responses
    try:
        from tests.e2e.test_messages_api import KEY

        client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key=KEY, max_retries=0)
        reply = await client.responses.create(model="tiny", input="hi", max_output_tokens=3)
        assert reply.store is False and reply.usage.output_tokens == 3
        async with client.responses.stream(model="tiny", input="hi", max_output_tokens=3) as stream:
            final = [event async for event in stream][-1].response
        assert final.store is False and final.output_text == reply.output_text
        with pytest.raises(openai.InternalServerError) as info:  # 503: not a 404 that would say it never existed
            await client.responses.retrieve(reply.id)
        assert info.value.status_code == 503
        with pytest.raises(openai.InternalServerError):
            await client.responses.create(model="tiny", previous_response_id=reply.id, input="?")
    finally:
        await mesh.stop()
