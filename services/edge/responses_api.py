"""OpenAI's Responses API on the edge: ``POST /v1/responses`` (Codex CLI speaks only this).

The body is translated into the chat request it asks for (responses_body.py, in prep.py like chat's bodies),
then served by the same run as chat (``EdgeApi.serve``: admission, routing, session affinity, billing,
tracing, abort on disconnect); only the response's shape differs (shapes/responses.py). Errors are OpenAI's.
Responses are not stored yet: ``store`` is reported ``false``, ``previous_response_id`` is refused (400), and
``GET`` / ``DELETE /v1/responses/{id}`` (and its ``input_items``) answer 404 as for an unknown id.
"""

from __future__ import annotations

from typing import Any

from litestar import Request, delete, get
from litestar.handlers import asgi
from litestar.types import Receive, Scope, Send

from services.edge import http
from services.edge.api import EdgeApi
from services.edge.http import HttpRequest, Reply
from services.edge.shapes.responses import ResponsesShape
from shared import errors


def response_not_found(response_id: str) -> errors.ApiError:
    return errors.ApiError(404, f"No response found with id '{response_id}': responses are not stored here "
                           "(store is not supported yet).", "invalid_request_error", "response_id", "not_found")


class ResponsesApi:
    def __init__(self, api: EdgeApi) -> None:
        self.api = api

    async def create(self, request: HttpRequest) -> Reply:
        prepared, tokenizer = await self.api.prepare(request, "responses")
        parser = self.api.tool_parser(prepared)
        echo = prepared.extra or {}
        return await self.api.serve(request, "responses", prepared, tokenizer, lambda request_id: ResponsesShape(
            f"resp_{request_id}", prepared.model, parser(request_id[:16]) if parser else None, echo))

    def route_handlers(self) -> list[Any]:
        limits = http.BodyLimits(self.api.config.max_body_bytes, self.api.config.body_timeout_s)
        authenticate = self.api.authenticate

        def bearer(headers: dict[str, str]) -> Any:
            return authenticate(headers.get("authorization"))

        @asgi("/v1/responses", copy_scope=False)
        async def create(scope: Scope, receive: Receive, send: Send) -> None:
            await http.serve(scope, receive, send, self.create, limits, bearer)  # type: ignore[arg-type]

        @get("/v1/responses/{response_id:str}", sync_to_thread=False)
        def retrieve(request: Request, response_id: str) -> None:
            authenticate(request.headers.get("authorization"))
            raise response_not_found(response_id)

        @get("/v1/responses/{response_id:str}/input_items", sync_to_thread=False)
        def input_items(request: Request, response_id: str) -> None:
            authenticate(request.headers.get("authorization"))
            raise response_not_found(response_id)

        @delete("/v1/responses/{response_id:str}", sync_to_thread=False, status_code=200)
        def remove(request: Request, response_id: str) -> None:
            authenticate(request.headers.get("authorization"))
            raise response_not_found(response_id)

        return [create, retrieve, input_items, remove]
