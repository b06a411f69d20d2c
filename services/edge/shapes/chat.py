"""OpenAI chat.completion(.chunk) and text_completion shapes (``/v1/chat/completions``, ``/v1/completions``)."""

from __future__ import annotations

import time
from typing import Any

from services.edge.attempt import Usage
from services.edge.shapes import sse_data
from services.edge.tools import ContentDelta, ToolCallParser
from shared import errors


def openai_usage(done: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }


class ChatShape:
    """chat.completion(.chunk) or text_completion.

    With tools, the model's text goes through the tool-call parser, the same way streamed or not: a
    streamed response sends its deltas (content, or a tool call's id + name, then arguments pieces),
    a whole one their concatenation, so the two always agree (truncated calls included). The opening
    chunk rides with the first text and the closing ones with [DONE] (fewer writes)."""

    def __init__(self, kind: str, response_id: str, model: str, parser: ToolCallParser | None = None,
                 include_usage: bool = False) -> None:
        self.kind = kind
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.parser = parser
        self.include_usage = include_usage

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    async def full(self, parts: list[str], done: Usage) -> dict[str, Any]:
        text = "".join(parts)
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            finish_reason = done.finish_reason
            if self.parser is not None:
                for part in parts:  # the same deltas a stream would have fed
                    self.parser.feed(part)
                _, result = self.parser.finish(done.finish_reason)
                message = {"role": "assistant", "content": result.content}
                if result.tool_calls:
                    message["tool_calls"] = result.tool_calls
                finish_reason = result.finish_reason
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
            return {**self._head("chat.completion"), "choices": [choice], "usage": openai_usage(done)}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": done.finish_reason}
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
        if self.parser is None:
            return sse_data(self.chunk(delta, None))
        return self._delta_events(self.parser.feed(delta))

    async def closing(self, done: Usage) -> bytes:
        if self.parser is None:
            out = sse_data(self.chunk(None, done.finish_reason))
        else:
            deltas, result = self.parser.finish(done.finish_reason)
            out = self._delta_events(deltas) + sse_data(self.chunk(None, result.finish_reason))
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
            else:
                chunk = self.chunk(None, None)
                chunk["choices"][0]["delta"] = {"tool_calls": [delta.to_openai()]}
                out.append(sse_data(chunk))
        return b"".join(out)

    def usage_chunk(self, done: Usage) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": openai_usage(done)}
