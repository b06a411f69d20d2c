"""API fidelity (issue 37.2): services/edge/api_fields.py's tables hold every field the published specs name, and
drive the real body parsers (honored and ignored fields accepted, refused ones a 400 naming them); system /
developer messages after the first turn, with real chat templates."""

from __future__ import annotations

import json

import pytest

from services.edge import messages_body, responses_body
from services.edge.api_fields import TABLES
from services.edge.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidRequest,
    parse_body,
    validate_chat,
    validate_completion,
)
from services.edge.tokenizer import ModelTokenizer
from tests.unit.test_incremental_tokens import _byte_level_tokenizer

# renders every message where it stands, whatever its role (the tiny model's own template)
IN_PLACE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
# Llama 2 / Mistral style: one leading system turn, anything else raises
ONE_SYSTEM_RAISES = (
    "{% for m in messages %}"
    "{% if m['role'] in ('system', 'developer') and not loop.first %}"
    "{{ raise_exception('Only the first message may be a system message') }}{% endif %}"
    "<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>")
# Qwen style: a leading system turn rendered, a later one (or an unknown role) silently left out
ONE_SYSTEM_DROPS = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' and loop.first %}<system>{{ m['content'] }}\n"
    "{% elif m['role'] in ('user', 'assistant') %}<{{ m['role'] }}>{{ m['content'] }}\n{% endif %}"
    "{% endfor %}<assistant>")

CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "system", "content": "agents: claude"},
                {"role": "user", "content": "go"}]
MERGED = "<system>be brief\n\nagents: claude\n<user>hi\n<assistant>hello\n<user>go\n<assistant>"


def tokenizer(template: str, folder) -> ModelTokenizer:
    hf = _byte_level_tokenizer()
    hf.chat_template = template
    hf.save_pretrained(folder)
    return ModelTokenizer(str(folder))


def test_a_template_that_allows_more_system_turns_renders_them_in_place(tmp_path):
    tok = tokenizer(IN_PLACE, tmp_path)
    assert tok.render(CONVERSATION) == ("<system>be brief\n<user>hi\n<assistant>hello\n<system>agents: claude\n"
                                        "<user>go\n<assistant>")


@pytest.mark.parametrize("template", [ONE_SYSTEM_RAISES, ONE_SYSTEM_DROPS], ids=["raises", "drops"])
def test_a_template_that_allows_one_system_turn_gets_them_merged(template, tmp_path):
    tok = tokenizer(template, tmp_path)
    assert tok.render(CONVERSATION) == MERGED
    developer = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"},
                 {"role": "developer", "content": "agents: claude"}]
    assert tok.render(developer) == "<system>be brief\n\nagents: claude\n<user>hi\n<assistant>"
    no_leading = [{"role": "user", "content": "hi"}, {"role": "system", "content": "agents: claude"}]
    assert tok.render(no_leading) == "<system>agents: claude\n<user>hi\n<assistant>"


# ------------------------------------------------------------ the tables against the published specs
def _keys(*typed_dicts) -> set[str]:
    """The body fields a TypedDict of an SDK's request params names, its bases' included."""
    return {name for td in typed_dicts for klass in td.__mro__ for name in getattr(klass, "__annotations__", {})}


def _specs() -> dict[str, set[str]]:
    """Every field the official SDKs (pinned in pyproject.toml's test extra) send in each endpoint's body: they are
    generated from OpenAI's OpenAPI document and Anthropic's API spec, beta fields included. To update: bump the
    pins, install, run this test and classify each field it names in services/edge/api_fields.py."""
    from anthropic.types import message_count_tokens_params as count, message_create_params as messages
    from anthropic.types.beta import message_count_tokens_params as beta_count, message_create_params as beta_messages
    from openai.types import completion_create_params as completions
    from openai.types.chat import completion_create_params as chat
    from openai.types.responses import response_create_params as responses

    sdk_only = {"betas"}  # Anthropic's SDK sends it as the anthropic-beta header, not in the body
    return {
        "chat": _keys(chat.CompletionCreateParamsBase, chat.CompletionCreateParamsStreaming),
        "completions": _keys(completions.CompletionCreateParamsBase, completions.CompletionCreateParamsStreaming),
        "responses": _keys(responses.ResponseCreateParamsBase, responses.ResponseCreateParamsStreaming),
        "messages": _keys(messages.MessageCreateParamsBase, messages.MessageCreateParamsStreaming,
                          beta_messages.MessageCreateParamsBase) - sdk_only,
        "count_tokens": _keys(count.MessageCountTokensParams, beta_count.MessageCountTokensParams) - sdk_only,
    }


def test_the_sdk_pins_are_the_installed_versions():
    import tomllib
    from importlib.metadata import version
    from pathlib import Path

    extra = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["test"]
    for sdk in ("openai", "anthropic"):
        assert f"{sdk}=={version(sdk)}" in extra, f"{sdk} {version(sdk)} is not the version pyproject.toml pins"


@pytest.mark.parametrize("endpoint", list(TABLES))
def test_every_field_the_published_spec_accepts_is_in_the_table(endpoint):
    missing = sorted(_specs()[endpoint] - set(TABLES[endpoint]))
    assert not missing, f"{endpoint}: classify these in services/edge/api_fields.py: {missing}"


@pytest.mark.parametrize("endpoint", list(TABLES))
def test_the_parsed_struct_accepts_exactly_the_table(endpoint):
    assert set(PARSED[endpoint].__struct_fields__) == set(TABLES[endpoint])


PARSED = {"chat": ChatCompletionRequest, "completions": CompletionRequest,
          "responses": responses_body.ResponsesRequest, "messages": messages_body.MessagesRequest,
          "count_tokens": messages_body.CountTokensRequest}
USER = [{"role": "user", "content": "hi"}]
MINIMAL = {"chat": {"model": "m", "messages": USER}, "completions": {"model": "m", "prompt": "hi"},
           "responses": {"model": "m", "input": "hi"}, "messages": {"model": "m", "max_tokens": 8, "messages": USER},
           "count_tokens": {"model": "m", "messages": USER}}


def _through_the_edge(endpoint: str, body: dict) -> None:
    """``body`` through the parser, translation and validation its endpoint's requests take (prep.py's path)."""
    raw = json.dumps(body).encode()
    if endpoint == "chat":
        validate_chat(parse_body(raw, ChatCompletionRequest))
    elif endpoint == "completions":
        validate_completion(parse_body(raw, CompletionRequest))
    else:
        translate = {"responses": responses_body.translate, "messages": messages_body.translate,
                     "count_tokens": messages_body.translate_count}[endpoint]
        validate_chat(translate(raw).body)


FUNCTION = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
# a value each honored or ignored field takes, as a client sends it (plus any field it needs beside it)
OPENAI = {
    "model": "m", "max_tokens": 8, "temperature": 0.5, "top_p": 0.9, "stream": True,
    "stream_options": ({"include_usage": True}, {"stream": True}), "stop": ["\n"], "seed": 7,
    "presence_penalty": 0.1, "frequency_penalty": 0.1, "user": "u", "metadata": {"k": "v"}, "store": False,
    "service_tier": "auto", "safety_identifier": "s", "prompt_cache_key": "k", "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "auto"}, "ignore_eos": True, "cache_salt": "salt", "priority": 1,
    "request_id": "r", "messages": USER, "max_completion_tokens": 8, "tools": [FUNCTION],
    "tool_choice": ("auto", {"tools": [FUNCTION]}), "parallel_tool_calls": (False, {"tools": [FUNCTION]}),
    "response_format": {"type": "json_object"}, "reasoning_effort": "low",
    "chat_template_kwargs": {"enable_thinking": False}, "thinking_token_budget": 64, "include_reasoning": False,
    "verbosity": "low", "prediction": {"type": "content", "content": "x"}, "prompt": "hi", "top_k": 5, "min_p": 0.1,
    "repetition_penalty": 1.1,
}
RESPONSES = {
    "model": "m", "input": "hi", "instructions": "be brief", "tool_choice": "auto", "parallel_tool_calls": False,
    "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}], "max_output_tokens": 8,
    "temperature": 0.5, "top_p": 0.9, "text": {"format": {"type": "json_object"}, "verbosity": "low"},
    "stream": True, "store": False, "previous_response_id": None, "metadata": {"k": "v"}, "user": "u",
    "prompt_cache_key": "k", "reasoning": {"effort": "low", "summary": "auto"},
    "include": ["reasoning.encrypted_content"], "truncation": "auto", "max_tool_calls": 3,
    "stream_options": {"include_obfuscation": False}, "client_metadata": {"x-codex-window-id": "w"},
    "service_tier": "auto", "safety_identifier": "s", "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "auto"}, "access_programs": {"cyber": "standard"},
    "image": {"context_compression": "auto"}, "context_management": [{"type": "compaction", "compact_threshold": 9}],
    "background_options": {"completion_window": "soonest"},
}
ANTHROPIC = {
    "model": "m", "messages": USER + [{"role": "system", "content": "later"}], "system": "be brief",
    "tools": [{"name": "f", "input_schema": {"type": "object"}}],
    "tool_choice": ({"type": "auto"}, {"tools": [{"name": "f", "input_schema": {"type": "object"}}]}),
    "thinking": {"type": "enabled", "budget_tokens": 64}, "output_config": {"effort": "low"},
    "cache_control": {"type": "ephemeral"}, "speed": "standard", "user_profile_id": "p", "workspace_id": "w",
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "billing_policy": {"type": "billing_policy", "bill_to": "user_profile"},
    "mcp_servers": [{"type": "url", "url": "https://mcp.example", "name": "x"}], "max_tokens": 8, "stream": True,
    "stop_sequences": ["\n"], "temperature": 0.5, "top_p": 0.9, "metadata": {"user_id": "u"},
    "service_tier": "auto", "inference_geo": "us", "diagnostics": {}, "fallbacks": [{"model": "other"}],
    "fallback_credit_token": "t", "output_format": {"type": "json_schema", "schema": SCHEMA}, "top_k": 5,
}
EXAMPLES = {"chat": OPENAI, "completions": OPENAI, "responses": RESPONSES, "messages": ANTHROPIC,
            "count_tokens": ANTHROPIC}
# a value each refused field is refused with (its accepted values are tried too)
REFUSED = {
    "n": 2, "logprobs": True, "logit_bias": {"50": -100}, "length_penalty": 0.5, "use_beam_search": True,
    "min_tokens": 4, "stop_token_ids": [7], "bad_words": ["x"],
    "allowed_token_ids": [1], "include_stop_str_in_output": True, "skip_special_tokens": False,
    "spaces_between_special_tokens": False, "prompt_logprobs": 1, "return_tokens_as_token_ids": True,
    "return_token_ids": True, "truncate_prompt_tokens": 8, "guided_json": SCHEMA, "guided_regex": "a+",
    "guided_choice": ["a"], "guided_grammar": "root ::= 'a'", "structured_outputs": {"json": SCHEMA},
    "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "mp3"}, "top_logprobs": 2,
    "functions": [FUNCTION["function"]], "function_call": "auto", "web_search_options": {},
    "moderation": {"model": "omni-moderation-latest"}, "chat_template": "{{ messages }}",
    "add_generation_prompt": False, "continue_final_message": True, "add_special_tokens": True,
    "documents": [{"text": "d"}], "echo": True, "suffix": "end", "best_of": 2, "background": True,
    "conversation": "conv_1", "prompt": {"id": "pmpt_1"}, "container": "c-1", "thread": {"type": "create"},
    "compaction": {"type": "compaction"},
}


def _value(example):
    return example if isinstance(example, tuple) else (example, {})


@pytest.mark.parametrize("endpoint", list(TABLES))
def test_every_honored_or_ignored_field_is_accepted_by_the_edge(endpoint):
    for name, field in TABLES[endpoint].items():
        if field.treatment == "refused":
            continue
        assert name in EXAMPLES[endpoint], f"{endpoint}.{name}: give this test an example value"
        value, beside = _value(EXAMPLES[endpoint][name])
        _through_the_edge(endpoint, {**MINIMAL[endpoint], **beside, name: value})


@pytest.mark.parametrize("endpoint", list(TABLES))
def test_every_refused_field_is_a_400_naming_it_and_its_accepted_values_are_not(endpoint):
    for name, field in TABLES[endpoint].items():
        if field.treatment != "refused":
            continue
        assert name in REFUSED, f"{endpoint}.{name}: give this test a refused value"
        with pytest.raises(InvalidRequest) as info:
            _through_the_edge(endpoint, {**MINIMAL[endpoint], name: REFUSED[name]})
        assert info.value.param == name and name in info.value.message, (endpoint, name, info.value.message)
        for ok in field.accepts:
            _through_the_edge(endpoint, {**MINIMAL[endpoint], name: ok})


@pytest.mark.parametrize(("endpoint", "says"), [
    ("chat", "Unrecognized request argument supplied: temprature"),
    ("completions", "Unrecognized request argument supplied: temprature"),
    ("responses", "Unrecognized request argument supplied: temprature"),
    ("messages", "temprature: Extra inputs are not permitted"),
    ("count_tokens", "temprature: Extra inputs are not permitted"),
])
def test_a_field_in_no_spec_is_a_400_in_the_apis_words(endpoint, says):
    with pytest.raises(InvalidRequest) as info:
        _through_the_edge(endpoint, {**MINIMAL[endpoint], "temprature": 0.5})
    assert (info.value.message, info.value.param) == (says, "temprature")


def test_the_edge_readme_shows_the_tables_as_they_are():
    from pathlib import Path

    from services.edge.api_fields import markdown

    readme = (Path(__file__).parents[2] / "services/edge/README.md").read_text()
    for endpoint, table in TABLES.items():
        assert markdown(table) in readme, f"services/edge/README.md: paste api_fields.markdown(TABLES[{endpoint!r}])"


def _tool_types(union) -> set[str]:
    """The ``type`` values the tool params of an SDK's union take."""
    import typing

    found: set[str] = set()
    for params in typing.get_args(union):
        kind = typing.get_type_hints(params).get("type")
        found |= {value for arg in typing.get_args(kind) for value in (typing.get_args(arg) or (arg,))
                  if isinstance(value, str)}
    return found


def test_every_tool_type_the_published_specs_name_is_served_or_left_out():
    """A tool type is a function the model may call, one left out of the prompt (BUILT_IN: said so in
    x-infermesh-ignored-tools), or ``custom`` (free-form input, refused with a 400 naming it)."""
    from anthropic.types import ToolUnionParam
    from anthropic.types.beta import BetaToolUnionParam
    from openai.types.responses import ToolParam

    openai_types = _tool_types(ToolParam)
    assert openai_types - {"function", "namespace", "custom"} - responses_body.BUILT_IN == set()
    anthropic_types = _tool_types(ToolUnionParam) | _tool_types(BetaToolUnionParam)
    assert "web_search_20250305" in anthropic_types and "web_search" in openai_types  # the walk finds them
    assert anthropic_types - {"custom"} - messages_body.BUILT_IN == set()


def _nullable(*typed_dicts) -> set[str]:
    """The fields the SDKs' params type ``Optional``: the published spec lets them be null."""
    import typing

    found = set()
    for td in typed_dicts:
        for name, hint in typing.get_type_hints(td).items():
            if type(None) in typing.get_args(hint):
                found.add(name)
    return found


def test_a_field_the_spec_lets_be_null_may_be_null():
    from anthropic.types import message_create_params as messages
    from openai.types import completion_create_params as completions
    from openai.types.chat import completion_create_params as chat
    from openai.types.responses import response_create_params as responses

    specs = {"chat": chat.CompletionCreateParamsNonStreaming,
             "completions": completions.CompletionCreateParamsNonStreaming,
             "responses": responses.ResponseCreateParamsNonStreaming,
             "messages": messages.MessageCreateParamsNonStreaming}
    for endpoint, typed_dict in specs.items():
        nullable = _nullable(typed_dict) - set(MINIMAL[endpoint])
        assert len(nullable) >= 5, (endpoint, nullable)  # the walk finds them
        for name in sorted(nullable):
            _through_the_edge(endpoint, {**MINIMAL[endpoint], name: None})


def _sampling(endpoint: str, **fields):
    """What ``fields`` make of the engine's sampling parameters, through the edge's parsers and prep.py."""
    from services.edge.prep import engine_sampling

    raw = json.dumps({**MINIMAL[endpoint], **fields}).encode()
    chat = parse_body(raw, ChatCompletionRequest) if endpoint == "chat" else messages_body.translate(raw).body
    return engine_sampling(validate_chat(chat)[1], 10, 100, [2])


def test_vllms_sampling_extensions_and_anthropics_top_k_reach_the_engine():
    chosen = _sampling("chat", top_k=5, min_p=0.1, repetition_penalty=1.1)
    assert (chosen.top_k, chosen.min_p, chosen.repetition_penalty) == (5, 0.1, 1.1)
    unset = _sampling("chat", top_k=-1)
    assert (unset.top_k, unset.min_p, unset.repetition_penalty) == (0, 0.0, 1.0)
    assert _sampling("messages", top_k=3).top_k == 3


@pytest.mark.vllm
def test_the_vllm_engine_samples_with_them():
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from services.worker.engines.vllm_engine import VllmEngine

    engine = SimpleNamespace(config=SimpleNamespace(budget_closing=False))
    vllm = VllmEngine._sampling(engine, _sampling("chat", top_k=5, min_p=0.1, repetition_penalty=1.1))
    assert (vllm.top_k, vllm.min_p, vllm.repetition_penalty) == (5, 0.1, 1.1)
