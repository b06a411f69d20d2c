"""services/edge/protocol.py: OpenAI request parsing and validation."""

from __future__ import annotations

import json

import pytest

from services.edge.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidRequest,
    parse_body,
    validate_chat,
    validate_completion,
)

USER = [{"role": "user", "content": "hi"}]


def chat(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": USER} | fields).encode()


def completion(**fields) -> bytes:
    return json.dumps({"model": "m", "prompt": "hello"} | fields).encode()


def run_chat(body: bytes):
    return validate_chat(parse_body(body, ChatCompletionRequest))


def run_completion(body: bytes):
    return validate_completion(parse_body(body, CompletionRequest))


@pytest.mark.parametrize(
    "body, param",
    [
        (json.dumps({"messages": USER}).encode(), "model"),
        (json.dumps({"model": "m"}).encode(), "messages"),
        (chat(messages=[]), "messages"),
        (chat(messages=[{"role": "bogus", "content": "x"}]), "messages[0].role"),
        (chat(messages=[{"content": "x"}]), "messages[0].role"),
        (chat(temperature=3), "temperature"),
        (chat(temperature=-0.1), "temperature"),
        (chat(top_p=0), "top_p"),
        (chat(top_p=1.5), "top_p"),
        (chat(n=2), "n"),
        (chat(n=0), "n"),
        (chat(max_tokens=0), "max_tokens"),
        (chat(stop=["a", "b", "c", "d", "e"]), "stop"),
        (chat(stream_options={"include_usage": True}), "stream_options"),
        (chat(stream=False, stream_options={"include_usage": True}), "stream_options"),
        (chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
         "messages[0].content[0].type"),
        (chat(messages=[{"role": "system", "content": "s"},
                        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio"}]}]),
         "messages[1].content[1].type"),
        (chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages[0].content[0].type"),
        (chat(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools[0].function.name"),
        (chat(tool_choice="required"), "tool_choice"),
        (chat(logprobs=True), "logprobs"),
        (chat(response_format={"type": "xml"}), "response_format.type"),
        (chat(presence_penalty=2.5), "presence_penalty"),
    ],
)
def test_chat_rejected_with_param(body, param):
    with pytest.raises(InvalidRequest) as info:
        run_chat(body)
    assert info.value.param == param


@pytest.mark.parametrize(
    "body, messages",
    [
        (chat(), [{"role": "user", "content": "hi"}]),
        (chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]),
         [{"role": "user", "content": "ab"}]),
        (chat(messages=[{"role": "system", "content": "s"}, {"role": "assistant", "content": None},
                        {"role": "user", "content": []}]),
         [{"role": "system", "content": "s"}, {"role": "assistant", "content": ""}, {"role": "user", "content": ""}]),
    ],
)
def test_chat_messages_normalized(body, messages):
    assert run_chat(body)[0] == messages


@pytest.mark.parametrize(
    "fields, max_tokens, temperature, top_p, stop",
    [
        ({}, None, 1.0, 1.0, []),
        ({"max_tokens": 5, "temperature": 0, "top_p": 0.5, "stop": "x"}, 5, 0.0, 0.5, ["x"]),
        ({"max_tokens": 5, "max_completion_tokens": 9}, 9, 1.0, 1.0, []),
        ({"max_completion_tokens": 9}, 9, 1.0, 1.0, []),
        ({"stop": ["a", "b", "c", "d"], "stream": True, "stream_options": {"include_usage": True}},
         None, 1.0, 1.0, ["a", "b", "c", "d"]),
    ],
)
def test_chat_sampling(fields, max_tokens, temperature, top_p, stop):
    sampling = run_chat(chat(**fields))[1]
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.stop) == (
        max_tokens, temperature, top_p, stop)


@pytest.mark.parametrize(
    "fields, prompt, max_tokens",
    [
        ({}, "hello", 16),  # OpenAI's default max_tokens for /v1/completions
        ({"max_tokens": 3}, "hello", 3),
        ({"prompt": ["only one"]}, "only one", 16),
        ({"prompt": [1, 2, 3]}, [1, 2, 3], 16),
        ({"prompt": [[4, 5]]}, [4, 5], 16),
    ],
)
def test_completion_accepted(fields, prompt, max_tokens):
    got, sampling = run_completion(completion(**fields))
    assert got == prompt
    assert sampling.max_tokens == max_tokens


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"prompt": ["one", "two"]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [""]}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": [[1, "a"]]}, "prompt"),
        ({"prompt": [[1], [2]]}, "prompt"),
        ({"prompt": [True]}, "prompt"),
        ({"prompt": [[1, True]]}, "prompt"),
        ({"prompt": [1, 2.0]}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"echo": True}, "echo"),
        ({"suffix": "end"}, "suffix"),
        ({"n": 3}, "n"),
        ({"temperature": 3}, "temperature"),
    ],
)
def test_completion_rejected_with_param(fields, param):
    with pytest.raises(InvalidRequest) as info:
        run_completion(completion(**fields))
    assert info.value.param == param


def test_completion_missing_prompt():
    with pytest.raises(InvalidRequest) as info:
        run_completion(b'{"model": "m"}')
    assert info.value.param == "prompt"


@pytest.mark.parametrize("kind", [ChatCompletionRequest, CompletionRequest])
@pytest.mark.parametrize("body, says", [(b"", "empty"), (b"{not json", "parse"), (b'{"model": "m",', "parse")])
def test_unparseable_body(kind, body, says):
    with pytest.raises(InvalidRequest) as info:
        parse_body(body, kind)
    assert info.value.param is None
    assert says in info.value.message
