"""Anthropic cache_control breakpoints as the prompt tokens the client wants kept (services/edge/cache_hints.py and
its use in prep.py), with the tiny model's real tokenizer and template."""

from __future__ import annotations

import json

import pytest

from services.edge.cache_hints import last_breakpoint, messages_up_to
from services.edge.prep import PrepJob, prepare
from services.edge.tokenizer import ModelTokenizer

EPHEMERAL = {"type": "ephemeral"}
SYSTEM = "You are a careful agent. " * 20


def body(**fields) -> bytes:
    return json.dumps({"model": "tiny", "max_tokens": 4, **fields}).encode()


def text(value: str, marked: bool = False) -> dict:
    return {"type": "text", "text": value, **({"cache_control": EPHEMERAL} if marked else {})}


@pytest.mark.parametrize("fields, expected", [
    ({"messages": [{"role": "user", "content": "hi"}]}, None),
    ({"messages": [{"role": "user", "content": [text("a", True)]}, {"role": "assistant", "content": "b"},
                   {"role": "user", "content": [text("c")]}]}, "messages[0]"),
    ({"system": [text("s", True)], "messages": [{"role": "user", "content": [text("a"), text("b", True)]}]},
     "messages[0]"),  # the last breakpoint wins
    ({"system": [text("s"), text("t", True)], "messages": [{"role": "user", "content": "a"}]}, "system"),
    ({"tools": [{"name": "f", "input_schema": {}, "cache_control": EPHEMERAL}],
      "messages": [{"role": "user", "content": "a"}]}, "tools"),
    ({"cache_control": EPHEMERAL, "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                               {"role": "user", "content": "c"}]}, "messages[2]"),  # automatic
])
def test_the_last_breakpoint_in_anthropics_order(fields, expected):
    assert last_breakpoint(body(**fields)) == expected


def test_an_unreadable_body_has_no_breakpoint():
    assert last_breakpoint(b"{not json") is None and last_breakpoint(b'{"messages": 3}') is None


@pytest.mark.parametrize("breakpoint, origins, expected", [
    (None, ["system", "messages[0]"], 0),
    ("system", ["system", "messages[0]"], 1),
    ("tools", ["system", "messages[0]"], 1),  # tools are rendered with the system turn
    ("tools", ["messages[0]"], 0),
    ("messages[1]", ["system", "messages[0]", "messages[1]", "messages[1]", "messages[2]"], 4),  # split in two
    ("messages[1]", ["messages[0]", "messages[2]"], 1),  # messages[1] made no chat message
])
def test_the_chat_messages_a_breakpoint_covers(breakpoint, origins, expected):
    assert messages_up_to(breakpoint, origins) == expected


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return ModelTokenizer(str(tiny_model))


def prepared(tokenizer, tiny_model, **fields):
    return prepare(PrepJob("messages", body(**fields), str(tiny_model), 4096), tokenizer)


def test_a_breakpoint_on_the_last_message_marks_the_whole_prompt(tokenizer, tiny_model):
    last = prepared(tokenizer, tiny_model, system=SYSTEM, messages=[{"role": "user", "content": [text("go", True)]}])
    assert (last.cache_requested, last.cache_prefix_tokens) == (True, len(last.prompt_ids))
    automatic = prepared(tokenizer, tiny_model, cache_control=EPHEMERAL, messages=[{"role": "user", "content": "go"}])
    assert (automatic.cache_requested, automatic.cache_prefix_tokens) == (True, len(automatic.prompt_ids))


def test_an_earlier_breakpoint_asks_for_caching_at_an_unknown_position(tokenizer, tiny_model):
    # knowing it would take preparing the prefix a second time: the hint is not worth that on every request
    turns = [{"role": "user", "content": "Read the README."}, {"role": "assistant", "content": "Done."},
             {"role": "user", "content": "Now the edge."}]
    system = prepared(tokenizer, tiny_model, system=[text(SYSTEM, True)], messages=turns)
    assert (system.cache_requested, system.cache_prefix_tokens) == (True, 0)
    none = prepared(tokenizer, tiny_model, system=SYSTEM, messages=turns)
    assert (none.cache_requested, none.cache_prefix_tokens) == (False, 0)
