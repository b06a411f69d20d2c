"""The OpenAI Responses shape (services/edge/shapes/responses.py): event order, sequence numbers, parity."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.edge.attempt import Usage
from services.edge.shapes.responses import ResponsesShape
from services.edge.tools import make_parser
from shared import errors

CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ECHO = {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True, "text": {"format": {"type": "text"}},
        "metadata": {}, "truncation": "disabled", "instructions": "be brief"}


def usage(finish_reason: str = "stop") -> Usage:
    return Usage("finished", finish_reason, 0, "w", "", 20, 16, 5, 1.0)


def shape(tools: bool = True) -> ResponsesShape:
    return ResponsesShape("resp_ab", "tiny", make_parser("hermes", ["weather"], "ab") if tools else None, ECHO)


def events(raw: bytes) -> list[dict]:
    out = []
    for event in raw.decode().split("\n\n"):
        if event:
            name, data = event.split("\n")
            payload = json.loads(data[len("data: "):])
            assert name == f"event: {payload['type']}"
            out.append(payload)
    return out


def stream(s: ResponsesShape, parts: list[str], done: Usage) -> list[dict]:
    return events(s.opening() + b"".join(s.text(p) for p in parts) + asyncio.run(s.closing(done)))


def test_a_text_stream_is_in_openais_order_with_sequence_numbers():
    evs = stream(shape(tools=False), ["Hel", "lo"], usage())
    assert [e["type"] for e in evs] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    assert evs[0]["response"]["status"] == "in_progress" and evs[0]["response"]["output"] == []
    assert evs[6]["text"] == "Hello" and evs[8]["item"]["status"] == "completed"
    final = evs[-1]["response"]
    assert final["status"] == "completed" and final["instructions"] == "be brief" and final["store"] is False
    assert final["usage"] == {"input_tokens": 20,
                              "input_tokens_details": {"cached_tokens": 16, "cache_write_tokens": 0},
                              "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 0},
                              "total_tokens": 25}


def test_a_function_call_streams_as_its_own_item():
    evs = stream(shape(), ["Checking.", CALL[:20], CALL[20:]], usage())
    added = [e["item"] for e in evs if e["type"] == "response.output_item.added"]
    assert [i["type"] for i in added] == ["message", "function_call"]
    assert (added[1]["call_id"], added[1]["name"], added[1]["id"]) == ("call_ab_0", "weather", "fc_ab_1")
    done = next(e for e in evs if e["type"] == "response.function_call_arguments.done")
    deltas = "".join(e["delta"] for e in evs if e["type"] == "response.function_call_arguments.delta")
    assert json.loads(done["arguments"]) == json.loads(deltas) == {"city": "Paris"}
    assert done["output_index"] == 1 and evs[-1]["type"] == "response.completed"


def test_a_cut_output_is_incomplete_with_its_reason():
    evs = stream(shape(tools=False), ["Hel"], usage("length"))
    final = evs[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["response"]["output"][0]["status"] == "incomplete"


@pytest.mark.parametrize("parts", [["plain text"], ["Checking.", CALL], [CALL, CALL], ["cut ", CALL[:30]]])
def test_the_whole_response_equals_its_stream(parts):
    done = usage("length" if len(parts[-1]) == 30 else "stop")
    streamed = stream(shape(), parts, done)[-1]["response"]
    whole = asyncio.run(shape().full(parts, done))
    for response in (streamed, whole):
        response.pop("created_at"), response.pop("completed_at")
    assert streamed == whole


def test_a_failure_mid_stream_ends_in_error_and_response_failed():
    s = shape(tools=False)
    evs = events(s.opening() + s.text("Hel") + s.failed(errors.engine_failed("worker lost")))
    assert [e["type"] for e in evs][-4:] == ["response.content_part.done", "response.output_item.done", "error",
                                             "response.failed"]
    assert evs[-2]["code"] == "engine_error" and "worker lost" in evs[-2]["message"]
    assert evs[-1]["response"]["status"] == "failed" and evs[-1]["response"]["error"]["code"] == "engine_error"
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))


@pytest.mark.parametrize("stored", [True, False])
def test_a_response_to_store_is_stored_before_its_last_event_and_says_whether_it_was(stored):
    kept: list[dict] = []

    async def keep(response: dict) -> bool:
        kept.append(json.loads(json.dumps(response)))  # as it is sent to metering
        return stored

    streamed = ResponsesShape("resp_ab", "tiny", None, {**ECHO, "previous_response_id": "resp_0"}, keep)
    evs = stream(streamed, ["Hi"], usage())
    assert evs[0]["response"]["store"] is True and evs[0]["response"]["previous_response_id"] == "resp_0"
    assert len(kept) == 1 and kept[0]["store"] is True and kept[0]["output"] == evs[-1]["response"]["output"]
    assert evs[-1]["response"]["store"] is stored
    whole = asyncio.run(ResponsesShape("resp_ab", "tiny", None, ECHO, keep).full(["Hi"], usage()))
    assert len(kept) == 2 and whole["store"] is stored and kept[1]["output"] == whole["output"]


def test_a_failed_response_is_not_stored():
    async def keep(response: dict) -> bool:
        raise AssertionError("a failed response was stored")

    s = ResponsesShape("resp_ab", "tiny", None, ECHO, keep)
    evs = events(s.opening() + s.text("Hi") + s.failed(errors.engine_failed("boom")))
    assert evs[-1]["type"] == "response.failed"


def test_a_call_of_a_namespace_tools_function_names_its_namespace():
    s = ResponsesShape("resp_ab", "tiny", make_parser("hermes", ["weather"], "ab"),
                       {**ECHO, "tool_namespaces": {"weather": "forecasts"}})
    evs = stream(s, [CALL], usage("tool_calls"))
    call = evs[-1]["response"]["output"][0]
    assert (call["type"], call["name"], call["namespace"]) == ("function_call", "weather", "forecasts")
    plain = stream(shape(), [CALL], usage("tool_calls"))[-1]["response"]["output"][0]
    assert "namespace" not in plain
