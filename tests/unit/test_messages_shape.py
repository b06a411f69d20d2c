"""The Anthropic Messages response shape (services/edge/shapes/messages.py): event order, stop reasons, parity."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.edge.attempt import Usage
from services.edge.shapes.messages import MessagesShape, anthropic_error
from services.edge.tools import make_parser
from shared import errors

CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def usage(finish_reason: str = "stop", stop_sequence: str = "", completion: int = 5) -> Usage:
    return Usage("finished", finish_reason, 0, "w", "", 20, 16, completion, 1.0, stop_sequence=stop_sequence)


def events(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for event in raw.decode().split("\n\n"):
        if event:
            name, data = event.split("\n")
            assert name.startswith("event: ") and data.startswith("data: ")
            payload = json.loads(data[len("data: "):])
            assert payload["type"] == name[len("event: "):]
            out.append((payload["type"], payload))
    return out


def stream(shape: MessagesShape, parts: list[str], done: Usage) -> list[tuple[str, dict]]:
    raw = shape.opening() + b"".join(shape.text(p) for p in parts) + asyncio.run(shape.closing(done))
    return events(raw)


def replay(evs: list[tuple[str, dict]]) -> dict:
    """The message a client accumulates from the events (as the SDKs do)."""
    message = None
    for kind, e in evs:
        if kind == "message_start":
            message = e["message"]
        elif kind == "content_block_start":
            assert e["index"] == len(message["content"])
            message["content"].append(dict(e["content_block"], partial=""))
        elif kind == "content_block_delta":
            block, delta = message["content"][e["index"]], e["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            else:
                block["partial"] += delta["partial_json"]
        elif kind == "message_delta":
            message.update(e["delta"])
            message["usage"].update(e["usage"])
    for block in message["content"]:
        partial = block.pop("partial")
        if block["type"] == "tool_use":
            block["input"] = json.loads(partial) if partial else {}
    return message


def test_a_text_stream_is_in_anthropics_event_order():
    shape = MessagesShape("msg_1", "tiny", None, 20)
    evs = stream(shape, ["Hel", "", "lo"], usage())
    assert [k for k, _ in evs] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                   "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    start = evs[0][1]["message"]
    assert (start["id"], start["role"], start["content"], start["stop_reason"]) == ("msg_1", "assistant", [], None)
    assert start["usage"]["input_tokens"] == 20
    assert evs[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert evs[-2][1]["usage"] == {"input_tokens": 4, "output_tokens": 5, "cache_read_input_tokens": 16,
                                   "cache_creation_input_tokens": 0}


@pytest.mark.parametrize(("done", "reason", "stop"), [
    (usage("stop"), "end_turn", None), (usage("length"), "max_tokens", None),
    (usage("stop", "\n\nHuman:"), "stop_sequence", "\n\nHuman:")])
def test_stop_reasons(done, reason, stop):
    message = asyncio.run(MessagesShape("msg_1", "tiny", None, 20).full(["a"], done))
    assert (message["stop_reason"], message["stop_sequence"]) == (reason, stop)


def test_a_tool_call_streams_as_a_tool_use_block_after_the_text():
    parts = ["Let me check.", CALL[:15], CALL[15:40], CALL[40:]]
    evs = stream(MessagesShape("msg_1", "tiny", make_parser("hermes", ["weather"], "ab"), 20), parts, usage())
    kinds = [k for k, _ in evs]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e["content_block"] for k, e in evs if k == "content_block_start"]
    assert starts == [{"type": "text", "text": ""},
                      {"type": "tool_use", "id": "toolu_ab_0", "name": "weather", "input": {}}]
    assert [e["index"] for k, e in evs if k == "content_block_stop"] == [0, 1]
    assert evs[-2][1]["delta"]["stop_reason"] == "tool_use"
    assert replay(evs)["content"][1]["input"] == {"city": "Paris"}


@pytest.mark.parametrize("parts", [["plain text only"], ["Let me check.", CALL], [CALL, CALL],
                                   ["cut ", CALL[:30]]])
def test_the_whole_message_equals_its_stream(parts):
    done = usage("length" if len(parts[-1]) == 30 else "stop")
    streamed = replay(stream(MessagesShape("msg_1", "tiny", make_parser("hermes", ["weather"], "ab"), 20), parts,
                             done))
    whole = asyncio.run(MessagesShape("msg_1", "tiny", make_parser("hermes", ["weather"], "ab"), 20).full(parts, done))
    assert streamed == whole


def test_a_failure_mid_stream_closes_the_block_and_ends_in_an_error_event():
    shape = MessagesShape("msg_1", "tiny", None, 20)
    evs = events(shape.opening() + shape.text("Hel") + shape.failed(errors.engine_failed("worker lost")))
    assert [k for k, _ in evs][-2:] == ["content_block_stop", "error"]
    assert evs[-1][1]["error"]["type"] == "api_error" and "worker lost" in evs[-1][1]["error"]["message"]


@pytest.mark.parametrize(("error", "status", "kind"), [
    (errors.invalid_request("bad", "max_tokens"), 400, "invalid_request_error"),
    (errors.invalid_api_key(), 401, "authentication_error"),
    (errors.model_not_found("x"), 404, "not_found_error"),
    (errors.ApiError(413, "big", "invalid_request_error"), 413, "request_too_large"),
    (errors.ApiError(429, "slow down", "rate_limit_error"), 429, "rate_limit_error"),
    (errors.ApiError(503, "no capacity", "server_error"), 529, "overloaded_error"),
    (errors.ApiError(504, "late", "server_error"), 504, "timeout_error"),
    (errors.ApiError(502, "worker", "server_error"), 502, "api_error"),
])
def test_errors_take_anthropics_shape_and_status(error, status, kind):
    sent, raw = anthropic_error(error)
    body = json.loads(raw)
    assert sent == status and body["type"] == "error" and body["error"]["type"] == kind
    if error.param:  # Anthropic's errors have no param: the message names it
        assert error.param in body["error"]["message"]
    assert anthropic_error(errors.invalid_request("bad", "max_tokens"))[1].decode().count("max_tokens: bad") == 1


@pytest.mark.parametrize(("requested", "written", "rest"), [
    (False, 0, 4),  # no breakpoint: nothing is a cache write; the tokens not read from the cache are input
    (True, 4, 0),  # a breakpoint: what the engine computed stays in its prefix cache, a cache write
])
def test_cache_writes_are_the_computed_tokens_of_a_request_that_asked_for_caching(requested, written, rest):
    message = asyncio.run(MessagesShape("msg_1", "tiny", None, 20, cache_requested=requested).full(["a"], usage()))
    assert message["usage"] == {"input_tokens": rest, "output_tokens": 5, "cache_read_input_tokens": 16,
                                "cache_creation_input_tokens": written}
    assert rest + 16 + written == 20  # Anthropic's: input_tokens = prompt - cache read - cache creation
    streamed = stream(MessagesShape("msg_1", "tiny", None, 20, cache_requested=requested), ["a"], usage())
    assert streamed[-2][1]["usage"] == message["usage"]


def test_a_thought_cut_by_max_tokens_is_signed_in_the_whole_message_as_in_its_stream():
    """The whole message never closed its last block: a thought cut by max_tokens came back with an empty
    signature while the stream sent one (clients send thinking blocks back with their signature)."""
    from services.edge.reasoning import ReasoningParser

    done = usage("length")
    streamed = replay(stream(MessagesShape("msg_1", "tiny", None, 20, ReasoningParser(True)), ["pondering"], done))
    whole = asyncio.run(MessagesShape("msg_1", "tiny", None, 20, ReasoningParser(True)).full(["pondering"], done))
    assert whole["content"][0]["type"] == "thinking" and whole["content"][0]["signature"]
    assert streamed == whole
