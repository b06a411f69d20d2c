"""OpenAI request bodies (msgspec Structs) and their validation into one normalized form.

Decoding errors become ``InvalidRequest`` naming the offending param, so the edge
can answer an OpenAI-shaped 400. Which top-level fields are accepted, and which of them are honored, ignored or
refused, is api_fields.py's tables (``CHAT``, ``COMPLETIONS``): the typed structs below declare what the edge
reads, ``request_struct`` adds the table's other fields, ``check_refused`` answers the refused ones. A field in no
table is ``Unrecognized request argument supplied: X``, as OpenAI answers it.

Nested objects (messages, content parts, stream_options) keep unknown fields: clients send back
what the SDK gave them (``refusal``, ``annotations``, ``include_obfuscation``). Numbers are bounded
(``seed`` an int64, token counts an int32), and nesting deeper than the parser's recursion limit is a
400 naming the top-level field it is under, never a 500.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Literal

import msgspec
from msgspec import Meta, Struct

from services.edge.api_fields import CHAT, COMPLETIONS, Table, check_refused, request_struct
from services.edge.tools import (
    ResponseFormat,
    ToolLimits,
    ToolRequestError,
    ToolSpec,
    validate_response_format,
    validate_tool_messages,
    validate_tools,
)

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
TopK = Annotated[int, Meta(ge=-1, le=2**31 - 1)]  # 0 or -1: every token (vLLM's)
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=100.0)]
PositiveInt = Annotated[int, Meta(ge=1, le=2**31 - 1)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]  # what the engines and the bus carry (int64)
Count = Annotated[int, Meta(ge=0, le=2**31 - 1)]


MAX_ID_LENGTH = 256  # session ids and cache salts
MAX_STOPS = 4  # OpenAI's limit
# a stop string's longest: the stop matcher holds back (and copies per token) up to its length - 1 characters of
# output, on the loop every stream shares (text.py); 4 of 1M characters made a request O(n^2) there
MAX_STOP_CHARS = 512


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
    # an assistant turn's thought, sent back (DeepSeek's and older vLLM's name; current vLLM's ``reasoning``):
    # handed to the chat template as ``reasoning_content``, which renders or drops it as the model was trained
    reasoning_content: str | None = None
    reasoning: str | None = None


class StreamOptions(Struct):
    include_usage: bool = False


class _Common(Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: PositiveInt | None = 1  # null: OpenAI's spec makes these nullable (the default then)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    top_k: TopK | None = None  # vLLM's sampling extensions
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    user: str | None = None
    logprobs: bool | int | None = None
    ignore_eos: bool = False  # vLLM's extension (extra_body): generate max_tokens, for benchmarks
    cache_salt: str | None = None  # vLLM's extension: prefix cache shared only by requests with the same salt
    # OpenAI's, accepted with no effect here (api_fields.py says why)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, str | int | float | bool | None] | None = None

    def __post_init__(self) -> None:
        if self.n is None:
            self.n = 1
        if self.stream is None:
            self.stream = False


class _ChatFields(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: PositiveInt | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None  # a thought budget for reasoning models (services/edge/reasoning.py)
    # vLLM's: extra chat template variables (``enable_thinking``), a thought budget in tokens, and whether the
    # response shows the thought (False: only the answer)
    chat_template_kwargs: dict[str, Any] | None = None
    thinking_token_budget: Count | None = None
    include_reasoning: bool = True
    verbosity: str | None = None
    modalities: list[str] | None = None
    top_logprobs: Count | None = None


class _CompletionFields(_Common, kw_only=True):
    prompt: str | list[Any]  # str, [str], [int] (token ids) or [[int]]
    echo: bool | None = False
    suffix: str | None = None
    best_of: PositiveInt | None = None


# the bodies as parsed: the typed fields above and every other field the endpoint's table accepts
ChatCompletionRequest = request_struct(_ChatFields, CHAT, "ChatCompletionRequest")
CompletionRequest = request_struct(_CompletionFields, COMPLETIONS, "CompletionRequest")


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
    top_k: int = 0  # every token
    min_p: float = 0.0
    repetition_penalty: float = 1.0


_PATH = re.compile(r"at `\$(.*?)`")
_MISSING = re.compile(r"missing required field `(\w+)`")


def _same(param: str) -> str:
    return param


@dataclass(frozen=True, slots=True)
class Translated:
    """Another endpoint's body (Anthropic Messages, OpenAI Responses) as the chat request it asks for."""

    body: ChatCompletionRequest
    extra: Any = None  # what its response's shape keeps (``Prepared.extra``; picklable)
    param: Callable[[str], str] = _same  # a chat request's param -> the endpoint's name for it (errors name it)
    ignored_tools: tuple[str, ...] = ()  # built-in tools left out of the prompt (the response's header says so)


def _param_of(error: msgspec.ValidationError) -> str | None:
    text = str(error)
    missing = _MISSING.search(text)
    path = _PATH.search(text)
    prefix = path.group(1).lstrip(".") if path else ""
    if missing:
        return f"{prefix}.{missing.group(1)}" if prefix else missing.group(1)
    return prefix or None


_UNKNOWN = re.compile(r"^Object contains unknown field `(.+?)`$")
OPENAI_UNKNOWN = "Unrecognized request argument supplied: {}"
ANTHROPIC_UNKNOWN = "{}: Extra inputs are not permitted"


def parse_body(body: bytes, kind: type[Struct], unknown_field: str = OPENAI_UNKNOWN) -> Any:
    """``body`` decoded as ``kind``; a top-level field ``kind`` does not know is a 400 in ``unknown_field``'s words."""
    if not body:
        raise InvalidRequest("The request body is empty; expected a JSON object.")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        unknown = _UNKNOWN.match(str(exc))
        if unknown:  # only the top level forbids unknown fields, so the name is the param
            raise InvalidRequest(unknown_field.format(unknown.group(1)), param=unknown.group(1),
                                 code="unrecognized_argument") from None
        raise InvalidRequest(f"Invalid request: {exc}", param=_param_of(exc)) from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"We could not parse the JSON body of your request: {exc}") from exc
    except RecursionError:
        raise too_deep(nested_field(body)) from None


MAX_NESTING = 64  # what ``nested_field`` calls deep; the parser itself gives up near 1,000


def too_deep(param: str | None) -> InvalidRequest:
    where = f"'{param}'" if param else "The request body"
    return InvalidRequest(f"{where} is nested too deeply.", param=param, code="nesting_too_deep")


def nested_field(body: bytes, limit: int = MAX_NESTING) -> str | None:
    """The top-level field under which ``body`` nests deeper than ``limit`` (None: nowhere, or not JSON).

    An iterative C parser (ijson's yajl2), stopped at the first too-deep value: never recursion."""
    import ijson

    depth, key = 0, None
    try:
        for event, value in ijson.basic_parse(io.BytesIO(body), buf_size=65536):
            if event in ("start_map", "start_array"):
                depth += 1
                if depth > limit:
                    return key
            elif event in ("end_map", "end_array"):
                depth -= 1
            elif event == "map_key" and depth == 1:
                key = value
    except Exception:  # justified: any parse failure here only means "no param to name"
        return None
    return None


def _check_common(req: _Common, table: Table) -> Sampling:
    check_refused(req, table, InvalidRequest)
    if req.metadata is not None and len(req.metadata) > 16:
        raise InvalidRequest("metadata may hold at most 16 pairs.", param="metadata")
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true.", param="stream_options")
    if req.cache_salt is not None and not 0 < len(req.cache_salt) <= MAX_ID_LENGTH:
        raise InvalidRequest(f"cache_salt must be a non-empty string of at most {MAX_ID_LENGTH} characters.",
                             param="cache_salt")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOPS:
        raise InvalidRequest(f"At most {MAX_STOPS} stop sequences are allowed.", param="stop")
    too_long = next((i for i, s in enumerate(stop) if len(s) > MAX_STOP_CHARS), None)
    if too_long is not None:
        raise InvalidRequest(f"Stop sequences may be at most {MAX_STOP_CHARS} characters long; stop sequence "
                             f"{too_long} (from 0) has {len(stop[too_long])}.", "stop", "string_above_max_length")
    return Sampling(
        max_tokens=req.max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        seed=req.seed,
        stop=stop,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        ignore_eos=req.ignore_eos,
        top_k=max(req.top_k or 0, 0),
        min_p=req.min_p or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
    )


@dataclass(slots=True)
class ChatOutput:
    """What a chat request asks of its output: tools (None: none declared) and a response format."""

    tools: ToolSpec | None
    response_format: ResponseFormat


def validate_chat(req: ChatCompletionRequest,
                  limits: ToolLimits = ToolLimits()) -> tuple[list[dict[str, Any]], Sampling, ChatOutput]:
    """Normalized messages (content as plain text; assistant ``tool_calls`` and ``tool_call_id`` kept),
    sampling options, and the tools / response format (each validated: a bad one is a 400 naming it)."""
    sampling = _check_common(req, CHAT)
    if req.max_completion_tokens is not None:
        sampling.max_tokens = req.max_completion_tokens
    if not req.messages:
        raise InvalidRequest("'messages' must contain at least one message.", param="messages")
    try:
        output = ChatOutput(validate_tools(req.tools, req.tool_choice, req.parallel_tool_calls, limits),
                            validate_response_format(req.response_format, limits))
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
        thought = message.reasoning_content if message.reasoning_content is not None else message.reasoning
        if message.role == "assistant" and thought:
            normalized["reasoning_content"] = thought
        messages.append(normalized)
    return messages, sampling, output


def validate_completion(req: CompletionRequest) -> tuple[str | list[int], Sampling]:
    sampling = _check_common(req, COMPLETIONS)
    if sampling.max_tokens is None:
        sampling.max_tokens = 16  # OpenAI's default for /v1/completions
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
