"""The wire shapes of one response: what an endpoint sends for the text a run generates.

Every endpoint serves the same run (admission, routing, the worker, billing: api.py); a ``Shape`` is what
differs between them: OpenAI chat / text completions (chat.py), Anthropic Messages (messages.py), OpenAI
Responses (responses.py). A shape is made per request and sees that request's deltas in order:

- streamed: ``opening()`` (sent with the first text), ``text(delta)`` per delta (b"" holds it back, e.g. a
  tool call's name still arriving), then ``closing(usage)`` or, when the run failed mid-stream,
  ``failed(error)``; each returns the SSE bytes to send;
- whole: ``full(deltas, usage)``, the JSON body, always equal to the concatenated stream.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from services.edge.attempt import Usage
from shared import errors

_json = msgspec.json.Encoder()


class Shape(Protocol):
    id: str  # the response's id (chatcmpl-..., msg_..., resp_...)

    def opening(self) -> bytes: ...

    def text(self, delta: str) -> bytes: ...

    async def closing(self, done: Usage) -> bytes: ...

    def failed(self, error: errors.ApiError) -> bytes: ...

    async def full(self, parts: list[str], done: Usage) -> dict[str, Any]: ...


def sse_data(payload: dict[str, Any]) -> bytes:
    """One ``data:`` event (OpenAI's chat and completions streams)."""
    return b"data: " + _json.encode(payload) + b"\n\n"


def sse_event(name: str, payload: dict[str, Any]) -> bytes:
    """One named event (Anthropic's and the Responses API's streams)."""
    return b"event: " + name.encode() + b"\ndata: " + _json.encode(payload) + b"\n\n"
