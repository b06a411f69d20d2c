"""Request preparation: an HTTP body -> a request ready to route (prompt token ids, sampling, grammar).

``prepare`` is pure (no bus, no HTTP): decode, validate, render tools and history, chat template,
tokenize, context-length check, grammar. It is where a request's CPU goes before routing, and a hostile
body can make it long: a tool schema's meta-schema check costs ~5 s per MiB (jsonschema), tokenizing ~1 s
per MiB of text, a chat template of 100K messages ~2 s. So ``PrepPool`` (prep_pool.py) runs it inline on the
event loop for small bodies with known schemas, else in a prep process (``worker_main``, prep_workers.py), in
the turn the fair queue gives (prep_queue.py).

Not in a thread: jsonschema, jinja and the tokenizer hold the GIL, and the event loop then waits up
to the switch interval (5 ms) after each syscall. Measured here (``python -m loadtests.hostile
--gil-check``): 16 socket round trips' gap p99 17 -> 203 ms while a thread checked a schema, 25 ms
while a process did.

Invariants: the same job gives the same ``Prepared`` (or the same error) on either path; a worker's
error crosses back as ``Failure`` (ApiError's fields), so the client gets the same status, param and
code; a body whose model could not be read (``tokenizer_path`` None) is only decoded and validated,
which raises its error.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
from array import array
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable, Literal, Sequence

import msgspec

from services.edge import cache_hints, messages_body, responses_body
from services.edge.incremental import cache_scope
from services.edge.prep_workers import serve_jobs
from services.edge.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidRequest,
    Sampling,
    Translated,
    parse_body,
    validate_chat,
    validate_completion,
)
from services.edge.reasoning import EFFORT_BUDGETS, TAGS, ReasoningSetup, opens_thought, thought_budget
from services.edge.tools import ToolLimits, ToolSpec, build_constraint
from services.edge.tools.grammar import with_thought
from services.edge.tools.render import render_messages
from services.edge.tools.validate import schema_key
from shared import errors
from shared.schema import SamplingParams, Structured, Thinking

log = logging.getLogger("infermesh.edge")
_RAW_NULL = msgspec.Raw(b"null")


class Peek(msgspec.Struct):
    """What the event loop reads of a body before preparing it: the model, and the schema-bearing fields
    as raw bytes (never decoded here; the rest of the body is skipped, not built)."""

    model: str
    tools: msgspec.Raw = _RAW_NULL
    response_format: msgspec.Raw = _RAW_NULL
    text: msgspec.Raw = _RAW_NULL  # the Responses API's ``text.format``
    previous_response_id: str | None = None  # the Responses API's: the stored conversation a body continues

    def schema_key(self) -> bytes | None:
        if self.tools == _RAW_NULL and self.response_format == _RAW_NULL and self.text == _RAW_NULL:
            return None
        return hashlib.sha256(bytes(self.tools) + b"\0" + bytes(self.response_format) + b"\0"
                              + bytes(self.text)).digest()


def peek(body: bytes) -> Peek | None:
    """The body's model and raw schemas, or None when even that cannot be read (``prepare`` says why)."""
    try:
        return msgspec.json.decode(body, type=Peek)
    except (msgspec.DecodeError, RecursionError):  # ValidationError is a DecodeError
        return None


PrepKind = Literal["chat", "text", "messages", "messages_count", "responses"]


@dataclass(frozen=True, slots=True)
class PrepJob:
    """Everything preparing one request needs; picklable (it may cross into a worker process)."""

    kind: PrepKind
    body: bytes
    tokenizer_path: str | None  # None: the model is not known (its body's error is what comes back)
    max_model_len: int = 0
    tool_format: str = "hermes"
    close_within: int = 0
    limits: ToolLimits = ToolLimits()
    context: bytes = b""  # what the endpoint's translation prepends to the body (a stored conversation)
    reasoning: str = ""  # the model's reasoning parser (services/edge/reasoning.py; "": it does not think)
    team: str = ""  # the caller's: its prompts reuse only its own earlier ones (incremental.cache_scope, with the salt)


# kind -> how its bodies (and a stored conversation, ``PrepJob.context``) become chat requests
TRANSLATIONS: dict[str, Callable[[bytes, bytes], Translated]] = {
    "messages": messages_body.translate, "messages_count": messages_body.translate_count,
    "responses": responses_body.translate,
}


@dataclass(slots=True)
class Prepared:
    """A valid request, ready to route."""

    model: str
    stream: bool
    include_usage: bool
    user: str | None
    cache_salt: str | None
    prompt_ids: Sequence[int]  # a 4-byte array for chat (and from a worker process: crossed()); completions: a list
    params: SamplingParams
    stop: list[str]
    tools: ToolSpec | None  # what the tool-call parser reads the output for; None: no parsing
    checked_schemas: tuple[bytes, ...] = ()  # schema keys that passed their meta-schema check
    extra: Any = None  # what the endpoint's translation keeps for its response's shape (picklable)
    reasoning: ReasoningSetup | None = None  # a reasoning model's: how its response separates the thought
    ignored_tools: tuple[str, ...] = ()  # built-in tools left out of the prompt (x-infermesh-ignored-tools)
    prompt_cache_key: str | None = None  # OpenAI's: a session id candidate (services/edge/sessions.py)
    cache_requested: bool = False  # the body has a cache_control breakpoint (Anthropic): it asked for cache writes
    cache_prefix_tokens: int = 0  # prompt tokens up to the last breakpoint, where known for free (cache_hints.py)


@dataclass(frozen=True, slots=True)
class Failure:
    """An ApiError, as it crosses back from a worker process."""

    status: int
    message: str
    type: str
    param: str | None
    code: str | None

    def error(self) -> errors.ApiError:
        return errors.ApiError(self.status, self.message, self.type, self.param, self.code)


def fit_max_tokens(max_tokens: int | None, num_prompt: int, max_len: int) -> int:
    """The completion budget: ``max_tokens``, or the rest of the context; 400 when it does not fit."""
    if max_tokens is None:
        if num_prompt >= max_len:
            raise errors.context_length_exceeded(max_len, num_prompt, None)
        return max_len - num_prompt
    if num_prompt + max_tokens > max_len:
        raise errors.context_length_exceeded(max_len, num_prompt, max_tokens)
    return max_tokens


def engine_sampling(sampling: Sampling, num_prompt: int, max_len: int, stop_token_ids: list[int],
                    structured: Structured | None = None, thinking: Thinking | None = None) -> SamplingParams:
    max_tokens = fit_max_tokens(sampling.max_tokens, num_prompt, max_len)
    ignore_eos = sampling.ignore_eos and structured is None
    return SamplingParams(  # ignore_eos (vLLM's, for benchmarks): max_tokens, past the model's stop tokens too
        max_tokens=max_tokens, temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed,
        stop_token_ids=[] if ignore_eos else stop_token_ids, presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty, ignore_eos=ignore_eos, structured=structured,
        thinking=thinking, top_k=sampling.top_k, min_p=sampling.min_p, repetition_penalty=sampling.repetition_penalty,
    )


def prepare(job: PrepJob, tokenizer: Any) -> Prepared:
    """The request ``job.body`` asks for; raises ApiError (400 naming the param, 400 context length, ...)."""
    try:
        if job.kind == "text":
            return _prepare_text(job, tokenizer)
        if job.kind == "chat":
            return prepare_chat(parse_body(job.body, ChatCompletionRequest), job, tokenizer)
        return _prepare_translated(TRANSLATIONS[job.kind](job.body, job.context), job, tokenizer)
    except InvalidRequest as exc:
        raise errors.invalid_request(exc.message, exc.param, exc.code) from None
    except RecursionError:  # justified: every field is depth-checked; this is the last line for what is not
        raise errors.invalid_request("The request nests too deeply.", None, "nesting_too_deep") from None
    except OverflowError:  # justified: every number is bounded; the same last line for a value that is not
        raise errors.invalid_request("A number in the request is out of range.", None, "number_out_of_range") from None


def prepare_chat(body: ChatCompletionRequest, job: PrepJob, tokenizer: Any) -> Prepared:
    """A chat request (``/v1/chat/completions``' own, or what another endpoint's body translates into)."""
    messages, sampling, output = validate_chat(body, job.limits)
    assert tokenizer is not None, "a body whose model could not be peeked cannot be valid"
    tools = output.tools if output.tools is not None and output.tools.choice != "none" else None
    if output.tools is not None or any("tool_calls" in m or m["role"] == "tool" for m in messages):
        messages = render_messages(messages, tools.tools if tools else (), job.tool_format)
    response_format = output.response_format if output.response_format.kind != "text" else None
    template_kwargs = _template_kwargs(body, job.reasoning)
    prompt_ids = tokenizer.chat_ids(messages, template_kwargs or None, cache_scope(job.team, body.cache_salt))
    reasoning, thinking = _reasoning(body, job.reasoning, tokenizer, prompt_ids, template_kwargs)
    constraint = build_constraint(job.tool_format, tools, response_format)
    if constraint is not None and reasoning is not None:  # a call or a JSON answer after a free thought
        constraint = with_thought(constraint, *TAGS[reasoning.format], reasoning.inside)
    structured = None if constraint is None else Structured(constraint.kind, constraint.spec,  # type: ignore[arg-type]
                                                            job.close_within)
    params = engine_sampling(sampling, len(prompt_ids), job.max_model_len, tokenizer.stop_token_ids, structured,
                             thinking)
    checked = tuple(schema_key(t.parameters) for t in output.tools.tools) if output.tools else ()
    if response_format is not None and response_format.schema is not None:
        checked += (schema_key(response_format.schema),)
    prepared = _prepared(body, prompt_ids, params, sampling, tools, checked)
    prepared.reasoning = reasoning
    return prepared


# chat_template_kwargs the edge sets itself: a request's own would change what the template is asked to do
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "documents", "conversation", "chat_template",
                                      "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                                      "truncation", "max_length", "return_tensors", "return_dict",
                                      "return_assistant_tokens_mask", "tokenizer_kwargs"})


def _template_kwargs(body: ChatCompletionRequest, fmt: str) -> dict[str, Any]:
    """The request's ``chat_template_kwargs`` (vLLM's), and thinking turned off (``enable_thinking``, the switch
    of Qwen3's and GLM's templates) where a reasoning model was asked not to think."""
    kwargs = dict(body.chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise InvalidRequest(f"chat_template_kwargs.{reserved[0]} is set by the server.",
                             f"chat_template_kwargs.{reserved[0]}")
    if body.reasoning_effort is not None and body.reasoning_effort not in EFFORT_BUDGETS:
        raise InvalidRequest(f"reasoning_effort must be one of {', '.join(EFFORT_BUDGETS)}.", "reasoning_effort")
    if fmt and "enable_thinking" not in kwargs and \
            thought_budget(body.reasoning_effort, body.thinking_token_budget, None) == 0:
        kwargs["enable_thinking"] = False
    return kwargs


def _reasoning(body: ChatCompletionRequest, fmt: str, tokenizer: Any, prompt_ids: Sequence[int],
               template_kwargs: dict[str, Any]) -> tuple[ReasoningSetup | None, Thinking | None]:
    """How the response separates a reasoning model's thought, and the engine's thought budget (None: unbounded)."""
    if not fmt:
        return None, None
    start, end = TAGS[fmt]
    tail = tokenizer.decode(list(prompt_ids[-16:]), skip_special_tokens=False)  # where the generation prompt ends
    start_ids = tuple(tokenizer.encode(start, add_special_tokens=False))
    end_ids = tuple(tokenizer.encode(end, add_special_tokens=False))
    setup = ReasoningSetup(fmt, opens_thought(tail, start, end), start_ids, end_ids, body.include_reasoning)
    enabled = template_kwargs.get("enable_thinking")
    budget = thought_budget(body.reasoning_effort, body.thinking_token_budget,
                            enabled if isinstance(enabled, bool) else None)
    thinking = None if budget is None else Thinking(budget, list(end_ids), list(start_ids), setup.inside)
    return setup, thinking


def _prepare_translated(translated: Translated, job: PrepJob, tokenizer: Any) -> Prepared:
    try:
        prepared = prepare_chat(translated.body, job, tokenizer)
    except (InvalidRequest, errors.ApiError) as exc:  # named as the endpoint names it
        exc.param = exc.param and translated.param(exc.param)
        raise
    prepared.extra = translated.extra
    prepared.ignored_tools = translated.ignored_tools
    if job.kind == "messages":
        breakpoint = cache_hints.last_breakpoint(job.body)
        prepared.cache_requested = breakpoint is not None
        if cache_hints.messages_up_to(breakpoint, translated.param.origins) >= len(translated.body.messages):
            prepared.cache_prefix_tokens = len(prepared.prompt_ids)  # it marks the last message: all of it
    return prepared


def _prepare_text(job: PrepJob, tokenizer: Any) -> Prepared:
    body = parse_body(job.body, CompletionRequest)
    prompt, sampling = validate_completion(body)
    assert tokenizer is not None, "a body whose model could not be peeked cannot be valid"
    prompt_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    if prompt_ids and (min(prompt_ids) < 0 or max(prompt_ids) >= tokenizer.vocab_size):
        raise InvalidRequest(f"Token ids in 'prompt' must be in [0, {tokenizer.vocab_size}).", "prompt")
    try:
        params = engine_sampling(sampling, len(prompt_ids), job.max_model_len, tokenizer.stop_token_ids)
    except errors.ApiError as exc:
        exc.param = "prompt"
        raise
    return _prepared(body, prompt_ids, params, sampling, None, ())


def _prepared(body: Any, prompt_ids: list[int], params: SamplingParams, sampling: Sampling,
              tools: ToolSpec | None, checked: tuple[bytes, ...]) -> Prepared:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Prepared(body.model, body.stream, include_usage, body.user, body.cache_salt, prompt_ids, params,
                    sampling.stop, tools, checked, prompt_cache_key=getattr(body, "prompt_cache_key", None))


# ------------------------------------------------------------ in a worker process
_tokenizers: dict[str, Any] = {}


def _tokenizer(path: str) -> Any:
    from services.edge.tokenizer import ModelTokenizer

    if path not in _tokenizers:
        _tokenizers[path] = ModelTokenizer(path)
    return _tokenizers[path]


def _run(job: PrepJob) -> Prepared | Failure:
    try:
        return crossed(prepare(job, None if job.tokenizer_path is None else _tokenizer(job.tokenizer_path)))
    except errors.ApiError as exc:
        return Failure(exc.status, exc.message, exc.type, exc.param, exc.code)


def crossed(prepared: Prepared) -> Prepared:
    """``prepared`` as it goes back to the edge's loop: its ids a 4-byte array, which pickles as one copy (a list of
    200K ids costs the loop ~8 ms to unpickle). The loop only counts, hashes and packs them."""
    if not isinstance(prepared.prompt_ids, array):
        prepared.prompt_ids = array("I", prepared.prompt_ids)
    return prepared


def _answer(payload: bytes) -> bytes:
    """A prep process's answer to one pickled job: a ``Prepared`` or a ``Failure``, pickled."""
    try:
        result = _run(pickle.loads(payload))
    except Exception:  # justified: a bug in preparation fails its request, not the process (logged here)
        log.exception("request preparation failed")
        result = Failure(500, "The request could not be prepared.", "server_error", None, "internal_error")
    return pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)


def worker_main(conn: Connection, preload: Sequence[str]) -> None:
    """A prep process (services/edge/prep_workers.py): load the tokenizers it will need, then answer jobs."""
    for path in preload:
        try:
            _tokenizer(path)
        except Exception:  # justified: a job for that model reports the same error as its own
            log.exception("could not preload the tokenizer %s", path)
    serve_jobs(conn, _answer)
