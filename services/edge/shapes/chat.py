"""OpenAI chat.completion(.chunk) and text_completion shapes (``/v1/chat/completions``, ``/v1/completions``)."""

from __future__ import annotations

import time
from typing import Any

from services.edge.attempt import Usage
from services.edge.reasoning import ReasoningParser, ThoughtDelta
from services.edge.shapes import sse_data
from services.edge.shapes.output import Output
from services.edge.tools import ContentDelta, ToolCallParser
from shared import errors


def openai_usage(done: Usage, reasoning_tokens: int | None = None) -> dict[str, Any]:
    """Chat's usage; ``reasoning_tokens`` (a reasoning model's thought, None: the model does not think) in
    ``completion_tokens_details`` as OpenAI reports it."""
    usage: dict[str, Any] = {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }
    if reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return usage


class ChatShape:
    """chat.completion(.chunk) or text_completion.

    With tools, the model's text goes through the tool-call parser, the same way streamed or not: a
    streamed response sends its deltas (content, or a tool call's id + name, then arguments pieces),
    a whole one their concatenation, so the two always agree (truncated calls included). A reasoning model's
    thought (``thinker``) comes apart as ``reasoning_content`` (and ``reasoning``, current vLLM's name). The
    opening chunk rides with the first text and the closing ones with [DONE] (fewer writes)."""

    def __init__(self, kind: str, response_id: str, model: str, parser: ToolCallParser | None = None,
                 include_usage: bool = False, thinker: ReasoningParser | None = None) -> None:
        self.kind = kind
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.parser = parser
        self.include_usage = include_usage
        self.output = Output(parser, thinker if kind == "chat" else None)

    def _usage(self, done: Usage) -> dict[str, Any]:
        return openai_usage(done, self.output.reasoning_tokens if self.output.thinker is not None else None)

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    async def full(self, parts: list[str], done: Usage) -> dict[str, Any]:
        if self.kind == "chat":
            pieces = [piece for part in parts for piece in self.output.feed(part)]  # as a stream would feed them
            last, result, finish_reason = self.output.finish(done.finish_reason)
            pieces += last
            if result is not None:
                message: dict[str, Any] = {"role": "assistant", "content": result.content}
                if result.tool_calls:
                    message["tool_calls"] = result.tool_calls
            else:
                message = {"role": "assistant", "content": "".join(p.text for p in pieces
                                                                   if isinstance(p, ContentDelta))}
            if self.output.thought is not None:
                message["reasoning_content"] = message["reasoning"] = self.output.thought
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
            return {**self._head("chat.completion"), "choices": [choice], "usage": self._usage(done)}
        choice = {"index": 0, "text": "".join(parts), "logprobs": None, "finish_reason": done.finish_reason}
        return {**self._head("text_completion"), "choices": [choice], "usage": openai_usage(done)}

    def chunk(self, text: str | None, finish_reason: str | None, first: bool = False) -> dict[str, Any]:
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            payload = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            payload = {**self._head("text_completion"), "choices": [choice]}
        if self.include_usage:
            payload["usage"] = None
        return payload

    def opening(self) -> bytes:
        return sse_data(self.chunk(None, None, first=True)) if self.kind == "chat" else b""

    def text(self, delta: str) -> bytes:
        """SSE events for a text delta: as it is, or what the tool-call parser makes of it (maybe nothing yet)."""
        if self.kind != "chat" or (self.parser is None and self.output.thinker is None):  # the common path: as is
            return sse_data(self.chunk(delta, None))
        return self._delta_events(self.output.feed(delta))

    async def closing(self, done: Usage) -> bytes:
        if self.kind != "chat":
            out = sse_data(self.chunk(None, done.finish_reason))
        else:
            pieces, _, finish_reason = self.output.finish(done.finish_reason)
            out = self._delta_events(pieces) + sse_data(self.chunk(None, finish_reason))
        if self.include_usage:
            out += sse_data(self.usage_chunk(done))
        return out + b"data: [DONE]\n\n"

    def failed(self, error: errors.ApiError) -> bytes:
        return sse_data(error.body()) + b"data: [DONE]\n\n"

    def _delta_events(self, deltas: list) -> bytes:
        out = []
        for delta in deltas:
            if isinstance(delta, ContentDelta):
                out.append(sse_data(self.chunk(delta.text, None)))
            elif isinstance(delta, ThoughtDelta):
                chunk = self.chunk(None, None)
                chunk["choices"][0]["delta"] = {"reasoning_content": delta.text, "reasoning": delta.text}
                out.append(sse_data(chunk))
            else:
                chunk = self.chunk(None, None)
                chunk["choices"][0]["delta"] = {"tool_calls": [delta.to_openai()]}
                out.append(sse_data(chunk))
        return b"".join(out)

    def usage_chunk(self, done: Usage) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self._usage(done)}
