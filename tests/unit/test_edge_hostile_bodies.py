"""Hostile and unusual request bodies through the edge's pure preparation (prep.prepare): 400s naming the param.

No HTTP and no bus: a fake tokenizer stands in for the model's.
"""

from __future__ import annotations

import json
from array import array

import pytest
from jsonschema import Draft202012Validator

from services.edge.prep import Failure, PrepJob, _run, peek, prepare
from services.edge.prep_pool import PrepPool
from services.edge.tools import ToolLimits, validate as tool_validate
from shared import errors

USER = [{"role": "user", "content": "hi"}]


class FakeTokenizer:
    vocab_size = 1000
    stop_token_ids = [2]

    def chat_ids(self, messages, template_kwargs=None, scope=""):
        return array("I", [1] * (1 + sum(len(m["content"]) // 4 for m in messages)))

    def encode(self, text):
        return [1] * (1 + len(text) // 4)


def chat(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": USER} | fields).encode()


def completion(**fields) -> bytes:
    return json.dumps({"model": "m", "prompt": "hello"} | fields).encode()


def job(body: bytes, kind: str = "chat", limits: ToolLimits = ToolLimits()) -> PrepJob:
    return PrepJob(kind, body, "unused", 4096, "hermes", 0, limits)  # type: ignore[arg-type]


def rejected(body: bytes, kind: str = "chat", **limits) -> errors.ApiError:
    with pytest.raises(errors.ApiError) as info:
        prepare(job(body, kind, ToolLimits(**limits)), FakeTokenizer())
    assert info.value.status == 400 and info.value.type == "invalid_request_error"
    return info.value


def tool(name: str = "f", parameters=None) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters or {"type": "object"}}}


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("kind, body", [("chat", chat(logit_biass={"50256": -100})),
                                        ("text", completion(logprob=1)), ("chat", chat(temprature=0.5))])
def test_an_unknown_field_is_rejected_by_name(kind, body):
    error = rejected(body, kind)
    name = next(iter(set(json.loads(body)) - {"model", "messages", "prompt"}))
    assert error.message == f"Unrecognized request argument supplied: {name}" and error.param == name


@pytest.mark.parametrize("fields", [
    {"metadata": {"run": "7"}, "store": False, "service_tier": "auto", "user": "u1", "n": 1},
    {"safety_identifier": "h", "prompt_cache_key": "k", "prompt_cache_retention": "24h", "reasoning_effort": "low",
     "verbosity": "low", "modalities": ["text"], "top_logprobs": 0, "logprobs": False},
    {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}},
    {"tools": [tool()], "parallel_tool_calls": False, "tool_choice": "auto"},
    {"ignore_eos": True, "cache_salt": "tenant-a", "seed": -(2**63), "max_completion_tokens": 8},
    {"messages": [{"role": "assistant", "content": "a", "refusal": None, "annotations": []},
                  {"role": "user", "content": "b"}]},
])
def test_what_the_openai_sdk_and_the_vendor_extensions_send_is_accepted(fields):
    prepared = prepare(job(chat(**fields)), FakeTokenizer())
    assert prepared.model == "m" and prepared.prompt_ids


@pytest.mark.parametrize("kind, body, param", [
    ("chat", chat(seed=2**70), "seed"),
    ("chat", chat(seed=2**63), "seed"),
    ("chat", chat(max_tokens=2**40), "max_tokens"),
    ("text", completion(max_tokens=2**70), "max_tokens"),
    ("chat", chat(messages=USER, top_logprobs=3), "top_logprobs"),
    ("chat", chat(modalities=["text", "audio"]), "modalities"),
    ("text", completion(best_of=3), "best_of"),
])
def test_out_of_range_numbers_and_unsupported_options_name_their_param(kind, body, param):
    assert rejected(body, kind).param == param


@pytest.mark.parametrize("raw, param", [
    (b'{"model": "m", "messages": [], "max_tokens": 1e400}', "max_tokens"),
    (b'{"model": "m", "messages": [], "temperature": -1e400}', "temperature"),
])
def test_numbers_beyond_a_double_name_their_param(raw, param):
    assert rejected(raw).param == param


DEEP = '{"a": ' * 1000 + "1" + "}" * 1000  # past the parser's recursion limit


@pytest.mark.parametrize("field, value", [("tools", f"[{DEEP}]"), ("tool_choice", DEEP), ("response_format", DEEP),
                                          ("messages", '[{"role": "user", "content": "x", "extra": %s}]' % DEEP)])
def test_a_thousand_levels_of_nesting_name_the_field(field, value):
    fields = {"model": '"m"', "messages": '[{"role": "user", "content": "x"}]', field: value}
    raw = ("{" + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}").encode()
    error = rejected(raw)
    assert error.param == field and error.code == "nesting_too_deep"
    assert peek(raw) is None  # the edge cannot even read the model: no tokenizer is involved


def test_a_schema_deeper_than_the_cap_names_the_tool():
    error = rejected(chat(tools=[tool("ok"), tool("deep", nested(20))]), max_depth=32)
    assert error.param == "tools[1].function.parameters" and "deeper" in error.message


def test_a_schema_the_checker_would_recurse_on_is_refused_before_it_runs():
    assert rejected(chat(tools=[tool("deep", nested(300))])).param == "tools[0].function.parameters"


def test_a_response_format_schema_deeper_than_the_cap_is_rejected():
    body = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": nested(40)}})
    assert rejected(body).param == "response_format.json_schema.schema"


def test_more_tools_than_the_cap_are_rejected():
    assert rejected(chat(tools=[tool(f"t{i}") for i in range(5)]), max_tools=4).param == "tools"


def test_tools_bigger_than_the_cap_are_rejected_before_their_schemas_are_checked(monkeypatch):
    monkeypatch.setattr(Draft202012Validator, "check_schema", lambda schema: pytest.fail("checked"))
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2000)}}
    error = rejected(chat(tools=[tool("big", big)]), max_bytes=16 << 10)
    assert error.param == "tools" and "bytes" in error.message


def test_deeply_nested_tool_call_arguments_are_a_400_on_the_history():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 100_000}}
    body = chat(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": "c1", "content": "r"}])
    assert rejected(body).param == "messages[1].tool_calls[0].function.arguments"


def test_a_schema_is_checked_once_however_often_it_is_sent(monkeypatch):
    calls = []
    real = Draft202012Validator.check_schema
    monkeypatch.setattr(Draft202012Validator, "check_schema", lambda schema: (calls.append(1), real(schema)))
    parameters = {"type": "object", "properties": {"unique_to_this_test": {"type": "integer"}}}
    for _ in range(3):
        prepare(job(chat(tools=[tool("once", parameters)])), FakeTokenizer())
    assert len(calls) == 1


def test_a_worker_process_failure_carries_the_same_error():
    body = chat(logit_biass={})
    failure = _run(PrepJob("chat", body, None))
    assert isinstance(failure, Failure)
    error = failure.error()
    assert (error.status, error.param, error.code) == (400, "logit_biass", "unrecognized_argument")


def test_a_completion_prompt_that_cannot_fit_is_rejected_on_prompt():
    error = rejected(completion(prompt="x" * 40_000), "text")
    assert error.code == "context_length_exceeded" and error.param == "prompt"


@pytest.mark.parametrize("size, tools, known, inline", [
    (1_000, False, False, True),     # a plain small request: on the loop
    (100_000, False, False, False),  # a big body: a worker process
    (1_000, True, False, False),     # schemas never seen: a worker process
    (1_000, True, True, True),       # schemas prepared before: on the loop
])
def test_where_a_request_is_prepared(size, tools, known, inline):
    pool = PrepPool(processes=1, inline_bytes=64 << 10)
    fields = {"tools": [tool()]} if tools else {}
    body = chat(**fields, messages=[{"role": "user", "content": "x" * size}])
    key = peek(body).schema_key()
    assert (key is not None) == tools
    if known:
        pool._known[key] = None
    assert pool.is_inline(job(body), key) == inline
    assert PrepPool(processes=0, inline_bytes=0).is_inline(job(body), key)  # no processes: always inline


def test_a_remembered_schema_is_not_checked_again(monkeypatch):
    parameters = {"type": "object", "properties": {"checked_elsewhere": {"type": "string"}}}
    tool_validate.remember_checked([tool_validate.schema_key(parameters)])
    monkeypatch.setattr(Draft202012Validator, "check_schema", lambda schema: pytest.fail("checked again"))
    prepare(job(chat(tools=[tool("elsewhere", parameters)])), FakeTokenizer())
