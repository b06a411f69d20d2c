"""OpenAI request bodies (msgspec Structs) and their validation into one normalized form.

Decoding errors become ``InvalidRequest`` naming the offending param, so the edge
can answer an OpenAI-shaped 400. Parameters infermesh does not implement yet are
rejected loudly rather than silently ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from services.edge.tools import (ResponseFormat, ToolRequestError, ToolSpec, validate_response_format,
                                 validate_tool_messages, validate_tools)

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
PositiveInt = Annotated[int, Meta(ge=1)]


MAX_ID_LENGTH = 256  # session ids and cache salts


class InvalidRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ContentPart(Struct):
    type: str
    text: str | None = None


class ChatMessage(Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class StreamOptions(Struct):
    include_usage: bool = False


class _Common(Struct, kw_only=True):
    model: str
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: PositiveInt = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    user: str | None = None
    logprobs: bool | int | None = None
    ignore_eos: bool = False  # vLLM's extension (extra_body): generate max_tokens, for benchmarks
    cache_salt: str | None = None  # vLLM's extension: prefix cache shared only by requests with the same salt


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: PositiveInt | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any]  # str, [str], [int] (token ids) or [[int]]
    echo: bool = False
    suffix: str | None = None


@dataclass(slots=True)
class Sampling:
    """The sampling options of a validated request, engine-agnostic."""

    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    presence_penalty: float
    frequency_penalty: float
    ignore_eos: bool = False


_PATH = re.compile(r"at `\$(.*?)`")
_MISSING = re.compile(r"missing required field `(\w+)`")


def _param_of(error: msgspec.ValidationError) -> str | None:
    text = str(error)
    missing = _MISSING.search(text)
    path = _PATH.search(text)
    prefix = path.group(1).lstrip(".") if path else ""
    if missing:
        return f"{prefix}.{missing.group(1)}" if prefix else missing.group(1)
    return prefix or None


def parse_body(body: bytes, kind: type[Struct]) -> Any:
    if not body:
        raise InvalidRequest("The request body is empty; expected a JSON object.")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"Invalid request: {exc}", param=_param_of(exc)) from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"We could not parse the JSON body of your request: {exc}") from exc


def _check_common(req: _Common) -> Sampling:
    if req.n != 1:
        raise InvalidRequest("Only n=1 is supported.", param="n")
    if req.logprobs:
        raise InvalidRequest("logprobs are not supported yet.", param="logprobs")
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true.", param="stream_options")
    if req.cache_salt is not None and not 0 < len(req.cache_salt) <= MAX_ID_LENGTH:
        raise InvalidRequest(f"cache_salt must be a non-empty string of at most {MAX_ID_LENGTH} characters.",
                             param="cache_salt")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > 4:
        raise InvalidRequest("At most 4 stop sequences are allowed.", param="stop")
    return Sampling(
        max_tokens=req.max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        seed=req.seed,
        stop=stop,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        ignore_eos=req.ignore_eos,
    )


@dataclass(slots=True)
class ChatOutput:
    """What a chat request asks of its output: tools (None: none declared) and a response format."""

    tools: ToolSpec | None
    response_format: ResponseFormat


def validate_chat(req: ChatCompletionRequest) -> tuple[list[dict[str, Any]], Sampling, ChatOutput]:
    """Normalized messages (content as plain text; assistant ``tool_calls`` and ``tool_call_id`` kept),
    sampling options, and the tools / response format (each validated: a bad one is a 400 naming it)."""
    sampling = _check_common(req)
    if req.max_completion_tokens is not None:
        sampling.max_tokens = req.max_completion_tokens
    if not req.messages:
        raise InvalidRequest("'messages' must contain at least one message.", param="messages")
    try:
        output = ChatOutput(validate_tools(req.tools, req.tool_choice, req.parallel_tool_calls),
                            validate_response_format(req.response_format))
        validate_tool_messages(req.messages)
    except ToolRequestError as exc:
        raise InvalidRequest(exc.message, param=exc.param) from exc
    messages: list[dict[str, Any]] = []
    for i, message in enumerate(req.messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise InvalidRequest(f"Content part type {part.type!r} is not supported; only 'text'.",
                                         param=f"messages[{i}].content[{j}].type")
                texts.append(part.text)
            content = "".join(texts)
        normalized: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.tool_calls:
            normalized["tool_calls"] = message.tool_calls
        if message.tool_call_id is not None:
            normalized["tool_call_id"] = message.tool_call_id
        messages.append(normalized)
    return messages, sampling, output


def validate_completion(req: CompletionRequest) -> tuple[str | list[int], Sampling]:
    sampling = _check_common(req)
    if sampling.max_tokens is None:
        sampling.max_tokens = 16  # OpenAI's default for /v1/completions
    if req.echo:
        raise InvalidRequest("echo is not supported yet.", param="echo")
    if req.suffix:
        raise InvalidRequest("suffix is not supported.", param="suffix")
    prompt = req.prompt
    if isinstance(prompt, list):
        if len(prompt) == 0:
            raise InvalidRequest("'prompt' must not be empty.", param="prompt")
        if _is_token_list(prompt):
            return prompt, sampling
        if len(prompt) != 1:
            raise InvalidRequest("Only one prompt per request is supported.", param="prompt")
        prompt = prompt[0]
        if isinstance(prompt, list):
            if not prompt or not _is_token_list(prompt):
                raise InvalidRequest("'prompt' token lists must be non-empty lists of integers.", param="prompt")
            return prompt, sampling
    if not isinstance(prompt, str) or not prompt:
        raise InvalidRequest("'prompt' must be a non-empty string or a list of token ids.", param="prompt")
    return prompt, sampling


def _is_token_list(items: list[Any]) -> bool:
    """Every item a plain int (bools excluded), checked at C speed: agent prompts run to 100K+ ids."""
    return set(map(type, items)) == {int}
