"""Anthropic cache_control breakpoints as the prompt tokens the client wants kept (services/edge/cache_hints.py and
its use in prep.py), with the tiny model's real tokenizer and template."""

from __future__ import annotations

import json
from array import array

import pytest

from services.edge.cache_hints import common_prefix, last_breakpoint, messages_up_to
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


@pytest.mark.parametrize("a, b, expected", [([], [1], 0), ([1, 2, 3], [1, 2, 4], 2), ([1, 2], [1, 2, 3], 2),
                                            ([5], [6], 0), (list(range(1000)), list(range(999)) + [0], 999)])
def test_common_prefix(a, b, expected):
    assert common_prefix(array("I", a), array("I", b)) == expected


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return ModelTokenizer(str(tiny_model))


def prepared(tokenizer, tiny_model, **fields):
    return prepare(PrepJob("messages", body(**fields), str(tiny_model), 4096), tokenizer)


def test_a_system_breakpoint_keeps_the_system_turns_tokens(tokenizer, tiny_model):
    turns = [{"role": "user", "content": "Read the README."}, {"role": "assistant", "content": "Done."},
             {"role": "user", "content": "Now the edge."}]
    whole = prepared(tokenizer, tiny_model, system=[text(SYSTEM, True)], messages=turns)
    system_alone = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}])
    shared = common_prefix(array("I", system_alone), whole.prompt_ids)
    assert 0 < whole.cache_prefix_tokens == shared < len(whole.prompt_ids)
    assert list(whole.prompt_ids[:shared]) == system_alone[:shared]  # the system turn leads the prompt
    middle = prepared(tokenizer, tiny_model, system=SYSTEM, messages=[
        turns[0], {"role": "assistant", "content": [text("Done.", True)]}, turns[2]])
    assert whole.cache_prefix_tokens < middle.cache_prefix_tokens < len(middle.prompt_ids)


def test_a_breakpoint_on_the_last_message_keeps_the_whole_prompt_and_none_keeps_nothing(tokenizer, tiny_model):
    last = prepared(tokenizer, tiny_model, system=SYSTEM, messages=[{"role": "user", "content": [text("go", True)]}])
    assert last.cache_prefix_tokens == len(last.prompt_ids)
    none = prepared(tokenizer, tiny_model, system=SYSTEM, messages=[{"role": "user", "content": "go"}])
    assert none.cache_prefix_tokens == 0
