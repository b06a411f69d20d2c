"""Stop strings are bounded in length (issue 38, review finding 14): the stop matcher holds back up to a stop
string's length of output and copies it per token on the edge's shared loop, so 4 stop strings of 1M characters
made one request O(n^2) there. Each endpoint that takes stop strings answers a longer one with a 400 naming its
own param (chat and completions: ``stop``; Anthropic: ``stop_sequences``; the Responses API takes none)."""

from __future__ import annotations

import json
from array import array

import pytest

from services.edge.prep import PrepJob, prepare
from services.edge.protocol import MAX_STOP_CHARS
from shared import errors


class FakeTokenizer:
    vocab_size = 1000
    stop_token_ids = [2]

    def chat_ids(self, messages, template_kwargs=None, scope=""):
        return array("I", [1] * len(messages))

    def encode(self, text):
        return [1] * (1 + len(text) // 4)


def _body(kind: str, stops: list[str]) -> bytes:
    if kind == "chat":
        body = {"messages": [{"role": "user", "content": "hi"}], "stop": stops}
    elif kind == "text":
        body = {"prompt": "hi", "stop": stops}
    else:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stop_sequences": stops}
    return json.dumps({"model": "m", **body}).encode()


def _prepare(kind: str, stops: list[str]):
    return prepare(PrepJob(kind, _body(kind, stops), "unused", 4096), FakeTokenizer())  # type: ignore[arg-type]


@pytest.mark.parametrize("kind, param", [("chat", "stop"), ("text", "stop"), ("messages", "stop_sequences")])
def test_a_stop_string_over_the_cap_is_a_400_naming_the_param(kind, param):
    with pytest.raises(errors.ApiError) as info:
        _prepare(kind, ["fine", "x" * (MAX_STOP_CHARS + 1)])
    error = info.value
    assert (error.status, error.type, error.param, error.code) == (400, "invalid_request_error", param,
                                                                   "string_above_max_length")
    assert f"at most {MAX_STOP_CHARS} characters" in error.message and "stop sequence 1 " in error.message


@pytest.mark.parametrize("kind", ["chat", "text", "messages"])
def test_stop_strings_up_to_the_cap_are_kept(kind):
    stops = ["x" * MAX_STOP_CHARS, "\n\n"]
    assert _prepare(kind, stops).stop == stops


def test_a_single_stop_string_is_capped_too():
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       "stop": "y" * 1_000_000}).encode()
    with pytest.raises(errors.ApiError) as info:
        prepare(PrepJob("chat", body, "unused", 4096), FakeTokenizer())  # type: ignore[arg-type]
    assert info.value.code == "string_above_max_length" and "has 1000000" in info.value.message
