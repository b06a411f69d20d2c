"""OpenAI Responses shapes (``/v1/responses``): a ``response`` object, or its stream of numbered events.

A stream is ``response.created``, ``response.in_progress``, then per output item ``response.output_item.added``,
for a message ``response.content_part.added`` / ``response.output_text.delta`` / ``response.output_text.done``
/ ``response.content_part.done``, for a function call ``response.function_call_arguments.delta`` /
``.done``, then ``response.output_item.done``; it ends with ``response.completed``, or ``response.incomplete``
(``max_output_tokens``) when the output was cut. A reasoning model's thought is a ``reasoning`` item first, its
text one ``reasoning_text`` content part (``response.content_part.added``, ``response.reasoning_text.delta`` /
``.done``, ``response.content_part.done``); no summary is made (``summary`` stays []). Every event carries its
``sequence_number``. A run failing
mid-stream ends with an ``error`` event and ``response.failed``. A response to be stored is stored before its
``response.completed`` / ``.incomplete`` (the whole response: before it is sent), so its id can be continued
(``previous_response_id``) as soon as the client has it. Both forms come from one ``_Items``
collector fed the same deltas, so the whole response always equals its stream.
"""

from __future__ import annotations

import time
from typing import Any, Awaitable, Callable

from services.edge.attempt import Usage
from services.edge.reasoning import ReasoningParser, ThoughtDelta
from services.edge.shapes import sse_event
from services.edge.shapes.output import Output, Piece
from services.edge.tools import ContentDelta, ToolCallParser
from shared import errors

ECHOED = ("instructions", "max_output_tokens", "metadata", "parallel_tool_calls", "previous_response_id",
          "temperature", "text", "tool_choice", "tools", "top_p", "truncation", "user")  # shown as they came
Keep = Callable[[dict[str, Any]], Awaitable[bool]]  # stores a finished response: whether it was stored


def responses_usage(done: Usage, reasoning_tokens: int = 0) -> dict[str, Any]:
    return {"input_tokens": done.prompt_tokens,
            "input_tokens_details": {"cached_tokens": done.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": done.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": done.prompt_tokens + done.completion_tokens}


class _Items:
    """The output items the deltas make (a ``message`` with one ``output_text`` part, ``function_call``s), and
    the events that make them; ``sequence`` numbers every event of the response."""

    def __init__(self, response_id: str, namespaces: dict[str, str] | None = None) -> None:
        self.key = response_id.removeprefix("resp_")
        self.namespaces = namespaces or {}  # a namespace tool's function -> its namespace (the call names it)
        self.items: list[dict[str, Any]] = []
        self.open = False
        self.sequence = 0

    def event(self, kind: str, payload: dict[str, Any]) -> bytes:
        out = sse_event(kind, {"type": kind, "sequence_number": self.sequence, **payload})
        self.sequence += 1
        return out

    def add(self, delta: Piece) -> bytes:
        if isinstance(delta, ThoughtDelta):
            if not delta.text:
                return b""
            out = b"" if self.open and self.items[-1]["type"] == "reasoning" else self._start_reasoning()
            self.items[-1]["content"][0]["text"] += delta.text
            return out + self.event("response.reasoning_text.delta", {**self._where(), "content_index": 0,
                                                                     "delta": delta.text})
        if isinstance(delta, ContentDelta):
            if not delta.text:
                return b""
            out = b"" if self.open and self.items[-1]["type"] == "message" else self._start_message()
            self.items[-1]["content"][0]["text"] += delta.text
            return out + self.event("response.output_text.delta", {**self._where(), "content_index": 0,
                                                                  "delta": delta.text, "logprobs": []})
        out = b""
        if delta.id is not None:  # a call's first delta: a function_call item of its own
            item = {"id": f"fc_{self.key}_{len(self.items)}", "type": "function_call", "status": "in_progress",
                    "call_id": delta.id, "name": delta.name, "arguments": ""}
            if delta.name in self.namespaces:
                item["namespace"] = self.namespaces[delta.name]
            out = self._start(item)
        if delta.arguments:
            self.items[-1]["arguments"] += delta.arguments
            out += self.event("response.function_call_arguments.delta", {**self._where(), "delta": delta.arguments})
        return out

    def close(self, status: str = "completed") -> bytes:
        """End the open item (``status``: ``incomplete`` when the output was cut inside it)."""
        if not self.open:
            return b""
        self.open = False
        item = self.items[-1]
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            out = self.event("response.output_text.done", {**self._where(), "content_index": 0, "text": part["text"],
                                                           "logprobs": []})
            out += self.event("response.content_part.done", {**self._where(), "content_index": 0, "part": part})
        elif item["type"] == "reasoning":
            part = item["content"][0]
            out = self.event("response.reasoning_text.done", {**self._where(), "content_index": 0,
                                                              "text": part["text"]})
            out += self.event("response.content_part.done", {**self._where(), "content_index": 0, "part": part})
        else:
            out = self.event("response.function_call_arguments.done", {**self._where(), "name": item["name"],
                                                                       "arguments": item["arguments"]})
        return out + self.event("response.output_item.done", {"output_index": len(self.items) - 1, "item": item})

    def _start_message(self) -> bytes:
        out = self._start({"id": f"msg_{self.key}_{len(self.items)}", "type": "message", "status": "in_progress",
                           "role": "assistant", "content": []})
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.items[-1]["content"].append(part)
        return out + self.event("response.content_part.added", {**self._where(), "content_index": 0,
                                                               "part": dict(part)})

    def _start_reasoning(self) -> bytes:
        out = self._start({"id": f"rs_{self.key}_{len(self.items)}", "type": "reasoning", "status": "in_progress",
                           "summary": [], "content": [], "encrypted_content": None})
        part = {"type": "reasoning_text", "text": ""}
        self.items[-1]["content"].append(part)
        return out + self.event("response.content_part.added", {**self._where(), "content_index": 0,
                                                               "part": dict(part)})

    def _start(self, item: dict[str, Any]) -> bytes:
        out = self.close()
        self.items.append(item)
        self.open = True
        return out + self.event("response.output_item.added", {"output_index": len(self.items) - 1, "item": item})

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}


class ResponsesShape:
    """``response`` (whole) or the Responses event stream; ``echo``: the request fields the response shows;
    ``keep``: stores the finished response (``store``), awaited before the last event is sent."""

    def __init__(self, response_id: str, model: str, parser: ToolCallParser | None, echo: dict[str, Any],
                 keep: Keep | None = None, thinker: ReasoningParser | None = None) -> None:
        self.id = response_id
        self.keep = keep
        self.model = model
        self.parser = parser
        self.echo = echo
        self.created_at = int(time.time())
        self.items = _Items(response_id, echo.get("tool_namespaces"))
        self.output = Output(parser, thinker)

    def _response(self, status: str, done: Usage | None = None, error: dict[str, Any] | None = None,
                  cut: bool = False) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "model": self.model,
                "output": [dict(item) for item in self.items.items],
                "reasoning": self.echo.get("reasoning") or {"effort": None, "summary": None},
                "store": self.keep is not None, "background": False,
                "usage": responses_usage(done, self.output.reasoning_tokens) if done is not None else None,
                **{key: self.echo.get(key) for key in ECHOED}}

    def _deltas(self, text: str) -> list[Piece]:
        return self.output.feed(text)

    def _finish(self, done: Usage) -> list[Piece]:
        return self.output.finish(done.finish_reason)[0]

    def opening(self) -> bytes:
        head = self._response("in_progress")
        return (self.items.event("response.created", {"response": head})
                + self.items.event("response.in_progress", {"response": head}))

    def text(self, delta: str) -> bytes:
        return b"".join(self.items.add(d) for d in self._deltas(delta))

    async def closing(self, done: Usage) -> bytes:
        cut = done.finish_reason == "length"
        out = b"".join(self.items.add(d) for d in self._finish(done)) + self.items.close(
            "incomplete" if cut else "completed")
        kind = "response.incomplete" if cut else "response.completed"
        return out + self.items.event(kind, {"response": await self._kept(self._response(
            "incomplete" if cut else "completed", done, cut=cut))})

    def failed(self, error: errors.ApiError) -> bytes:
        code = error.code or ("server_error" if error.status >= 500 else "invalid_request")
        out = self.items.close("incomplete") + self.items.event(
            "error", {"code": code, "message": error.message, "param": error.param})
        return out + self.items.event("response.failed", {"response": self._response(
            "failed", error={"code": code, "message": error.message})})

    async def full(self, parts: list[str], done: Usage) -> dict[str, Any]:
        for part in parts:  # the same deltas a stream would have fed
            for delta in self._deltas(part):
                self.items.add(delta)
        for delta in self._finish(done):
            self.items.add(delta)
        cut = done.finish_reason == "length"
        self.items.close("incomplete" if cut else "completed")
        return await self._kept(self._response("incomplete" if cut else "completed", done, cut=cut))

    async def _kept(self, response: dict[str, Any]) -> dict[str, Any]:
        """``response``, stored first when it is to be; its ``store`` says whether it was."""
        if self.keep is not None:
            response["store"] = await self.keep(response)
        return response
