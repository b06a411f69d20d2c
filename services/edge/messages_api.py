"""Anthropic's Messages API on the edge: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

The body is translated into the chat request it asks for (messages_body.py, in prep.py's worker processes
like chat's), then served by the same run as chat (``EdgeApi.serve``: admission, routing, session affinity,
billing, tracing, abort on disconnect); only the response's shape (shapes/messages.py) and the errors'
(``{"type": "error", "error": {...}}``, Anthropic's status codes) differ. The key comes as ``x-api-key`` or
``Authorization: Bearer``; ``anthropic-version`` and ``anthropic-beta`` are accepted and change nothing.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar.handlers import asgi
from litestar.types import Receive, Scope, Send

from services.edge import http
from services.edge.api import EdgeApi, thinker
from services.edge.http import HttpRequest, JsonReply, Reply
from services.edge.keys import Caller
from services.edge.shapes.messages import MessagesShape, anthropic_error
from shared import errors

_json = msgspec.json.Encoder()


class MessagesApi:
    def __init__(self, api: EdgeApi) -> None:
        self.api = api

    def authenticate(self, headers: dict[str, str]) -> Caller:
        """The caller whose key is ``x-api-key`` (Anthropic's SDK) or a bearer token (Claude Code's
        ``ANTHROPIC_AUTH_TOKEN``)."""
        key = headers.get("x-api-key")
        if key is None:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            key = token if scheme.lower() == "bearer" else None
        caller = self.api.mesh.keys.caller(key.strip()) if key else None
        if caller is None:
            raise errors.ApiError(401, "invalid x-api-key: pass the key as 'x-api-key: <key>' or "
                                  "'Authorization: Bearer <key>'.", "authentication_error", None, "invalid_api_key")
        return caller

    async def messages(self, request: HttpRequest) -> Reply:
        prepared, tokenizer = await self.api.prepare(request, "messages")
        parser = self.api.tool_parser(prepared)
        return await self.api.serve(request, "messages", prepared, tokenizer, lambda request_id: MessagesShape(
            f"msg_{request_id}", prepared.model, parser(request_id[:16]) if parser else None,
            len(prepared.prompt_ids), thinker(prepared), prepared.cache_requested))

    async def count_tokens(self, request: HttpRequest) -> Reply:
        """The prompt's tokens as generation would see them: the same translation, chat template and tokenizer."""
        prepared, _ = await self.api.prepare(request, "messages_count")
        return JsonReply(200, _json.encode({"input_tokens": len(prepared.prompt_ids)}),
                         {"x-request-id": request.request_id})

    def route_handlers(self) -> list[Any]:
        limits = http.BodyLimits(self.api.config.max_body_bytes, self.api.config.body_timeout_s)

        @asgi("/v1/messages", copy_scope=False)
        async def messages(scope: Scope, receive: Receive, send: Send) -> None:
            await http.serve(scope, receive, send, self.messages, limits, self.authenticate,  # type: ignore[arg-type]
                             anthropic_error)

        @asgi("/v1/messages/count_tokens", copy_scope=False)
        async def count_tokens(scope: Scope, receive: Receive, send: Send) -> None:
            await http.serve(scope, receive, send, self.count_tokens, limits, self.authenticate,  # type: ignore[arg-type]
                             anthropic_error)

        return [messages, count_tokens]
