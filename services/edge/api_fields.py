"""What the edge does with every request field the real APIs accept: one table per endpoint (issue 37.2).

Each field the published API accepts (OpenAI's chat completions, completions and Responses; Anthropic's Messages
and its count_tokens, beta fields included) and each of vLLM's common extensions is

- ``honored``: it does here what it does there;
- ``ignored``: accepted and changing nothing, because it only labels the request (``metadata``, ``user``...) or
  cannot change the output of one turn here;
- ``refused``: a 400 naming it, only where ignoring it would change the answer (``n`` > 1, ``logprobs``...).
  A refused field's ``accepts`` are the values that ask for nothing more than what is done anyway (``n`` = 1).

The tables drive validation: ``request_struct`` adds every field a table names that the typed body struct does
not declare (as an untyped, optional field), so a body field is accepted exactly when its table names it, and
``check_refused`` answers the refused ones. A field in no table (a typo) stays a 400: ``Unrecognized request
argument supplied: X`` (OpenAI's words) or ``X: Extra inputs are not permitted`` (Anthropic's).
tests/unit/test_api_fidelity.py fails when the published specs (the pinned official SDKs) name a field a table
lacks. services/edge/README.md shows the tables (``markdown``).
"""

from __future__ import annotations

from typing import Any, Callable, Literal, NamedTuple

import msgspec

Treatment = Literal["honored", "ignored", "refused"]
Endpoint = Literal["chat", "completions", "responses", "messages", "count_tokens"]
REASONING = "reasoning models: see services/edge/reasoning.py"
SAMPLED = "sampling (the vLLM engine's; the sim draws its tokens without any)"


class Field(NamedTuple):
    treatment: Treatment
    reason: str
    accepts: tuple[Any, ...] = ()  # refused fields: the values that ask for nothing beyond what is done anyway


Table = dict[str, Field]


def _h(reason: str) -> Field:
    return Field("honored", reason)


def _i(reason: str) -> Field:
    return Field("ignored", reason)


def _r(reason: str, *accepts: Any) -> Field:
    return Field("refused", reason, accepts)


# ------------------------------------------------------------ OpenAI, shared by chat and completions
_SAMPLING: Table = {
    "model": _h("the served model (or a deployment) it names"),
    "max_tokens": _h("the output's length bound"),
    "temperature": _h("sampling"),
    "top_p": _h("sampling"),
    "stream": _h("server-sent events"),
    "stream_options": _h("include_usage: a last chunk with the usage"),
    "stop": _h("up to 4 stop strings of at most 512 characters"),
    "seed": _h("the engine's sampling seed"),
    "presence_penalty": _h("sampling"),
    "frequency_penalty": _h("sampling"),
    "user": _h("labels the request; the session id where the edge is so configured"),
    "n": _r("one choice per request", 1),
    "logprobs": _r("log probabilities are not returned yet", False, 0),
    "logit_bias": _r("token biases change the output and are not applied", {}),
    # OpenAI's bookkeeping: clients with one body builder send them to both endpoints
    "metadata": _i("labels the request (at most 16 pairs)"),
    "store": _i("OpenAI keeps completions for its dashboard; nothing is kept here"),
    "service_tier": _i("one tier here"),
    "safety_identifier": _i("labels the end user"),
    "prompt_cache_key": _h("the trajectory's id: session affinity keeps its prefix cache warm"),
    "prompt_cache_retention": _i("the prefix cache is automatic"),
    "prompt_cache_options": _i("the prefix cache is automatic"),
}

# vLLM's extensions (extra_body), as vLLM's OpenAI server and LiteLLM's hosted_vllm send them
_VLLM: Table = {
    "ignore_eos": _h("generates max_tokens (benchmarks)"),
    "cache_salt": _h("the prefix cache is shared only by requests with the same salt"),
    "top_k": _h(SAMPLED),
    "min_p": _h(SAMPLED),
    "repetition_penalty": _h(SAMPLED),
    "length_penalty": _r("beam search only", 1, 1.0),
    "use_beam_search": _r("no beam search", False),
    "min_tokens": _r("a minimum length is not enforced yet", 0),
    "stop_token_ids": _r("only the model's own stop tokens end the output", []),
    "bad_words": _r("banned words are not applied", []),
    "allowed_token_ids": _r("a token allow-list is not applied", []),
    "include_stop_str_in_output": _r("the stop string is never shown", False),
    "skip_special_tokens": _r("special tokens are always left out of the text (not the thought and tool-call "
                              "tags the parsers read)", True),
    "spaces_between_special_tokens": _r("special tokens are always left out of the text (not the thought and "
                                        "tool-call tags the parsers read)", True),
    "prompt_logprobs": _r("log probabilities are not returned yet"),
    "return_tokens_as_token_ids": _r("tokens are returned as text", False),
    "return_token_ids": _r("tokens are returned as text", False),
    "truncate_prompt_tokens": _r("a prompt is never truncated: too long is a 400"),
    "guided_json": _r("use response_format (json_schema): the same grammar"),
    "guided_regex": _r("regular-expression grammars are not supported"),
    "guided_choice": _r("use response_format (json_schema with an enum)"),
    "guided_grammar": _r("use response_format (json_schema)"),
    "structured_outputs": _r("use response_format (json_schema)"),
    "priority": _i("the order of a busy engine's queue; X-Request-Class sets admission's here"),
    "request_id": _i("labels the request; the edge names it (x-request-id)"),
}

CHAT: Table = {
    **_SAMPLING, **_VLLM,
    "messages": _h("the conversation, through the model's chat template"),
    "max_completion_tokens": _h("the output's length bound (max_tokens' newer name)"),
    "tools": _h("function tools, grammar-enforced calls"),
    "tool_choice": _h("auto / none / required / a named function"),
    "parallel_tool_calls": _h("false: at most one call"),
    "response_format": _h("text / json_object / json_schema, grammar-enforced"),
    "reasoning_effort": _h(REASONING),
    "chat_template_kwargs": _h(REASONING),
    "thinking_token_budget": _h(REASONING),
    "include_reasoning": _h(REASONING),
    "verbosity": _i("a style hint to OpenAI's models; the models here take none"),
    "prediction": _i("predicted outputs only make generation faster; the output is the same"),
    "modalities": _r("text output only", ["text"]),
    "audio": _r("text output only"),
    "top_logprobs": _r("log probabilities are not returned yet", 0),
    "functions": _r("the deprecated functions API: send tools"),
    "function_call": _r("the deprecated functions API: send tool_choice"),
    "web_search_options": _r("no web search runs here"),
    "moderation": _r("no moderation model runs here"),
    "chat_template": _r("the model's own chat template renders every prompt"),
    "add_generation_prompt": _r("the assistant turn is always opened", True),
    "continue_final_message": _r("the assistant turn is always a new one", False),
    "add_special_tokens": _r("the chat template writes the special tokens", False),
    "documents": _r("retrieval documents are not rendered"),
    "echo": _r("the prompt is never echoed", False),
}

COMPLETIONS: Table = {
    **_SAMPLING, **_VLLM,
    "prompt": _h("a string or token ids (one prompt per request)"),
    "echo": _r("the prompt is never echoed", False),
    "suffix": _r("no insertion (fill-in-the-middle)", "", None),
    "best_of": _r("one candidate per request", 1),
}

RESPONSES: Table = {
    "model": _h("the served model (or a deployment) it names"),
    "input": _h("messages, function calls and their outputs (text); a reasoning item's text is the next "
                "assistant turn's thought (reasoning.py)"),
    "instructions": _h("the leading system message"),
    "tools": _h("function tools and namespaces' functions; built-in tools are left out (x-infermesh-ignored-tools)"),
    "tool_choice": _h("auto / none / required / a named function"),
    "parallel_tool_calls": _h("false: at most one call"),
    "max_output_tokens": _h("the output's length bound"),
    "temperature": _h("sampling"),
    "top_p": _h("sampling"),
    "text": _h("format: text / json_object / json_schema, grammar-enforced; verbosity is ignored"),
    "stream": _h("the Responses event stream"),
    "store": _h("kept for previous_response_id and GET /v1/responses/{id}"),
    "previous_response_id": _h("the stored conversation comes before the input"),
    "metadata": _h("echoed in the response"),
    "user": _h("echoed; the session id where the edge is so configured"),
    "prompt_cache_key": _h("the trajectory's id: session affinity keeps its prefix cache warm"),
    "reasoning": _h(REASONING),
    "include": _h(f"reasoning.encrypted_content: {REASONING}; the others add nothing here"),
    "truncation": _i("auto truncates nothing here: a context over the model's length is a 400"),
    "max_tool_calls": _i("it counts built-in tool calls, and none runs here"),
    "stream_options": _i("include_obfuscation: no obfuscation padding is sent"),
    "client_metadata": _i("labels the request (Codex sends it)"),
    "service_tier": _i("one tier here"),
    "safety_identifier": _i("labels the end user"),
    "prompt_cache_retention": _i("the prefix cache is automatic"),
    "prompt_cache_options": _i("the prefix cache is automatic"),
    "access_programs": _i("OpenAI's access programs do not apply here"),
    "image": _i("image options; the models here are text-only"),
    "context_management": _i("compaction past a token threshold; the context is sent whole (over the model's "
                             "length: a 400)"),
    "background_options": _i("only with background, which is refused"),
    "background": _r("background mode is not supported", False),
    "conversation": _r("send the whole conversation as input"),
    "prompt": _r("prompt templates are not supported: send instructions and input"),
    "top_logprobs": _r("log probabilities are not returned yet", 0),
    "moderation": _r("no moderation model runs here"),
}

# ------------------------------------------------------------ Anthropic
_MESSAGES_COMMON: Table = {
    "model": _h("the served model (or a deployment) it names"),
    "messages": _h("user / assistant turns (text, tool_use, tool_result); system turns in place; thinking "
                   "blocks as the assistant turn's thought (the template keeps or drops it)"),
    "system": _h("the leading system message"),
    "tools": _h("client tools, grammar-enforced calls; Anthropic's own tools are left out "
                "(x-infermesh-ignored-tools)"),
    "tool_choice": _h("auto / any / tool / none, disable_parallel_tool_use"),
    "thinking": _h(REASONING),
    "output_config": _h(f"format: JSON outputs, grammar-enforced; effort: {REASONING}"),
    "cache_control": _i("no output changes (messages: the usage's cache-write split, a routing hint)"),
    "speed": _i("one speed here"),
    "user_profile_id": _i("labels the request"),
    "workspace_id": _i("labels the request"),
    "context_management": _i("clear_thinking: thoughts sent back reach the chat template, which keeps only "
                             "the current turn's (GLM, Qwen3); clear_tool_uses past a token threshold: the "
                             "context is sent whole (over the model's length: a 400)"),
    "billing_policy": _i("who is billed at Anthropic; the API key's team is billed here"),
    "mcp_servers": _i("MCP servers Anthropic would call; none is called here (x-infermesh-ignored-tools)"),
    "compaction": _r("a compaction request asks for a summary, not a turn"),
}

MESSAGES: Table = {
    **_MESSAGES_COMMON,
    "max_tokens": _h("the output's length bound"),
    "stream": _h("the Messages event stream"),
    "stop_sequences": _h("up to 4 stop strings of at most 512 characters"),
    "temperature": _h("sampling (older SDKs send it)"),
    "top_p": _h("sampling (older SDKs send it)"),
    "metadata": _h("user_id: the request's user; Claude Code's session id in it names the trajectory"),
    "service_tier": _i("one tier here"),
    "inference_geo": _i("one place here"),
    "diagnostics": _i("Anthropic's diagnostics"),
    "fallbacks": _i("substitute models for a policy refusal; the models here refuse nothing by policy"),
    "fallback_credit_token": _i("Anthropic's billing of a retry"),
    "top_k": _h(SAMPLED),
    "container": _r("no code execution tool runs here"),
    "thread": _r("server-held conversation state is not kept: send the whole conversation"),
}

COUNT_TOKENS: Table = {
    **_MESSAGES_COMMON,
    "output_format": _h("the SDK's older name for output_config.format"),
}

TABLES: dict[Endpoint, Table] = {"chat": CHAT, "completions": COMPLETIONS, "responses": RESPONSES,
                                 "messages": MESSAGES, "count_tokens": COUNT_TOKENS}


def request_struct(base: type[msgspec.Struct], table: Table, name: str) -> type[msgspec.Struct]:
    """``base`` (its typed fields) with every other field ``table`` names added as an optional, untyped one; unknown
    fields are refused. Defined in ``base``'s module under ``name`` (so it pickles): assign it to that name."""
    declared = set(base.__struct_fields__)
    missing = sorted(set(table) - declared)
    undeclared = declared - set(table)
    assert not undeclared, f"{name}: fields in no table: {sorted(undeclared)}"
    return msgspec.defstruct(name, [(field, Any, None) for field in missing], bases=(base,), kw_only=True,
                             forbid_unknown_fields=True, module=base.__module__)


def check_refused(request: Any, table: Table, error: Callable[[str, str], Exception]) -> None:
    """``error(message, param)`` naming the first refused field set to something it does not accept (a request
    built by a translation may lack the table's untyped fields: unset)."""
    for name, field in table.items():
        if field.treatment != "refused":
            continue
        value = getattr(request, name, None)
        if value is not None and not any(value == ok and type(value) is type(ok) for ok in field.accepts):
            raise error(f"{name} is not supported: {field.reason}.", name)


def markdown(table: Table) -> str:
    """The table as services/edge/README.md shows it, by treatment then name."""
    rows = ["| field | treatment | why |", "|---|---|---|"]
    for name, field in sorted(table.items(), key=lambda item: (item[1].treatment, item[0])):
        accepts = ", ".join(f"`{msgspec.json.encode(ok).decode()}`" for ok in field.accepts)
        rows.append(f"| `{name}` | {field.treatment} | {field.reason}{f' (accepted: {accepts})' if accepts else ''} |")
    return "\n".join(rows)
