"""Anthropic Messages shapes (``/v1/messages``): a ``message`` body, or its stream of named events.

A stream is ``message_start``, ``ping``, then per content block ``content_block_start``,
``content_block_delta`` (``text_delta`` / ``input_json_delta``) and ``content_block_stop``, then
``message_delta`` (stop reason, usage) and ``message_stop``; a run failing mid-stream ends it with an
``error`` event. Both forms are built by one ``_Blocks`` collector from the same deltas (the tool-call
parser's, with tools), so a whole response always equals its stream.

A reasoning model's thought is a ``thinking`` block first (``thinking_delta`` events, then one ``signature_delta``
before its ``content_block_stop``, as Anthropic sends them). Its ``signature`` is a digest of the thought: the
SDKs and Claude Code keep it and send the block back in later turns, where it is accepted (messages_body.py); it
proves nothing (no secret is involved), a model here keeps no hidden thought to restore from it.

Usage follows Anthropic's meaning: ``cache_read_input_tokens`` are the prompt tokens the engine read from its
prefix cache (its hits); ``cache_creation_input_tokens``, for a request with a ``cache_control`` breakpoint, the
ones it computed instead, which its prefix cache keeps for the next turn (it keeps every computed block: where
the breakpoint is changes nothing there); without a breakpoint 0; ``input_tokens`` the rest: prompt - read -
creation. A cache write costs no more than any input token.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

import msgspec

from services.edge.attempt import Usage
from services.edge.reasoning import ReasoningParser, ThoughtDelta
from services.edge.shapes import sse_event
from services.edge.shapes.output import Output, Piece
from services.edge.tools import ContentDelta, ToolCallParser
from shared import errors

_json = msgspec.json.Encoder()

# an error's status -> Anthropic's error type, and the status it is sent with (503 is Anthropic's 529)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               500: "api_error", 504: "timeout_error", 529: "overloaded_error"}
SENT_AS = {503: 529}


def error_object(exc: errors.ApiError) -> dict[str, Any]:
    """``{"type": ..., "message": ...}``: the error's Anthropic type, its message naming the param it is about."""
    status = SENT_AS.get(exc.status, exc.status)
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    message = exc.message if not exc.param or exc.param in exc.message else f"{exc.param}: {exc.message}"
    return {"type": kind, "message": message}


def anthropic_error(exc: errors.ApiError) -> tuple[int, bytes]:
    """An error's status and body as Anthropic's API sends them (``http.ErrorBody``)."""
    body = {"type": "error", "error": error_object(exc)}
    return SENT_AS.get(exc.status, exc.status), _json.encode(body)


def stop_reason(done: Usage, finish_reason: str) -> str:
    if finish_reason == "tool_calls":
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if done.stop_sequence else "end_turn"


def message_usage(done: Usage, cache_requested: bool = False) -> dict[str, Any]:
    """Anthropic's usage; ``cache_requested``: the request has a ``cache_control`` breakpoint."""
    written = done.prompt_tokens - done.cached_tokens if cache_requested else 0
    return {"input_tokens": done.prompt_tokens - done.cached_tokens - written, "output_tokens": done.completion_tokens,
            "cache_read_input_tokens": done.cached_tokens, "cache_creation_input_tokens": written}


def tool_use_id(call_id: str) -> str:
    """Anthropic's ``toolu_`` ids for the parser's ``call_`` ones."""
    return "toolu_" + call_id.removeprefix("call_")


class _Blocks:
    """The content blocks the deltas make, and the stream events that make them."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []  # text blocks' text and tool_use blocks' raw arguments, so far
        self.open = False

    def add(self, delta: Piece) -> bytes:
        if isinstance(delta, ThoughtDelta):
            if not delta.text:
                return b""
            thinking = self.open and self.blocks[-1]["type"] == "thinking"
            out = b"" if thinking else self._start({"type": "thinking", "thinking": "", "signature": ""})
            self.blocks[-1]["thinking"] += delta.text
            return out + self._delta({"type": "thinking_delta", "thinking": delta.text})
        if isinstance(delta, ContentDelta):
            if not delta.text:
                return b""
            out = b"" if self.open and self.blocks[-1]["type"] == "text" else self._start({"type": "text", "text": ""})
            self.blocks[-1]["text"] += delta.text
            return out + self._delta({"type": "text_delta", "text": delta.text})
        out = b""
        if delta.id is not None:  # a call's first delta: a tool_use block of its own
            out = self._start({"type": "tool_use", "id": tool_use_id(delta.id), "name": delta.name, "input": {}})
            self.blocks[-1]["arguments"] = ""
        if delta.arguments:
            self.blocks[-1]["arguments"] += delta.arguments
            out += self._delta({"type": "input_json_delta", "partial_json": delta.arguments})
        return out

    def close(self) -> bytes:
        if not self.open:
            return b""
        self.open = False
        out = b""
        block = self.blocks[-1]
        if block["type"] == "thinking":
            block["signature"] = thought_signature(block["thinking"])
            out = self._delta({"type": "signature_delta", "signature": block["signature"]})
        return out + sse_event("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})

    def content(self) -> list[dict[str, Any]]:
        """The blocks as a message's ``content``: a tool call's ``input`` is its arguments' object ({} if cut)."""
        out = []
        for block in self.blocks:
            if block["type"] == "tool_use":
                block = {k: v for k, v in block.items() if k != "arguments"} | {"input": _input(block["arguments"])}
            out.append(block)
        return out

    def _start(self, block: dict[str, Any]) -> bytes:
        out = self.close()
        self.blocks.append(block)
        self.open = True
        start = {k: v for k, v in block.items() if k != "arguments"}
        return out + sse_event("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                                       "content_block": dict(start)})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                                 "delta": delta})


def thought_signature(thinking: str) -> str:
    """A thinking block's ``signature``: a digest of its text (see the module docstring)."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


def _input(arguments: str) -> Any:
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:  # cut by max_tokens mid-arguments: the call is there, its input is not
        return {}
    return value if isinstance(value, dict) else {}


class MessagesShape:
    """``message`` (whole) or the Messages event stream, for one request of ``input_tokens`` prompt tokens."""

    def __init__(self, response_id: str, model: str, parser: ToolCallParser | None, input_tokens: int,
                 thinker: ReasoningParser | None = None, cache_requested: bool = False) -> None:
        self.id = response_id
        self.cache_requested = cache_requested  # a cache_control breakpoint: what was computed is a cache write
        self.model = model
        self.parser = parser
        self.input_tokens = input_tokens
        self.blocks = _Blocks()
        self.output = Output(parser, thinker)

    def _message(self, content: list[dict[str, Any]], reason: str | None, stop: str | None,
                 usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": stop, "usage": usage}

    def _deltas(self, text: str) -> list[Piece]:
        return self.output.feed(text)

    def _finish(self, done: Usage) -> tuple[list[Piece], str]:
        pieces, _, finish_reason = self.output.finish(done.finish_reason)
        return pieces, finish_reason

    def opening(self) -> bytes:
        usage = {"input_tokens": self.input_tokens, "output_tokens": 0, "cache_read_input_tokens": 0,
                 "cache_creation_input_tokens": 0}  # the cache's share is known once the run ends (message_delta)
        start = {"type": "message_start", "message": self._message([], None, None, usage)}
        return sse_event("message_start", start) + sse_event("ping", {"type": "ping"})

    def text(self, delta: str) -> bytes:
        return b"".join(self.blocks.add(d) for d in self._deltas(delta))

    async def closing(self, done: Usage) -> bytes:
        deltas, finish_reason = self._finish(done)
        out = b"".join(self.blocks.add(d) for d in deltas) + self.blocks.close()
        reason = stop_reason(done, finish_reason)
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": done.stop_sequence or None},
                 "usage": message_usage(done, self.cache_requested)}
        return out + sse_event("message_delta", delta) + sse_event("message_stop", {"type": "message_stop"})

    def failed(self, error: errors.ApiError) -> bytes:
        return self.blocks.close() + sse_event("error", {"type": "error", "error": error_object(error)})

    async def full(self, parts: list[str], done: Usage) -> dict[str, Any]:
        for part in parts:  # the same deltas a stream would have fed
            for delta in self._deltas(part):
                self.blocks.add(delta)
        deltas, finish_reason = self._finish(done)
        for delta in deltas:
            self.blocks.add(delta)
        self.blocks.close()  # a thought still open (cut by max_tokens) gets its signature, as streamed
        return self._message(self.blocks.content(), stop_reason(done, finish_reason), done.stop_sequence or None,
                             message_usage(done, self.cache_requested))

