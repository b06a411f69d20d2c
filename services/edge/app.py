"""The Litestar application of the edge: routes, OpenAI-shaped error handling, health."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from litestar import Litestar, Request, Response, get
from litestar.exceptions import HTTPException
from litestar.handlers import asgi
from litestar.types import Receive, Scope, Send

from services.edge import http
from services.edge.api import EdgeApi
from services.edge.batches import batch_routes
from services.edge.files import FilesApi
from services.edge.messages_api import MessagesApi
from services.edge.responses_api import ResponsesApi
from shared import errors

log = logging.getLogger("infermesh.edge")


def _error_response(exc: errors.ApiError) -> Response[bytes]:
    headers = {"x-request-id": uuid.uuid4().hex, **exc.headers}  # every reply names its request, errors too
    return Response(exc.json(), status_code=exc.status, media_type="application/json", headers=headers)


def _on_api_error(_request: Request, exc: errors.ApiError) -> Response[bytes]:
    return _error_response(exc)


def _on_http_error(_request: Request, exc: HTTPException) -> Response[bytes]:
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return _error_response(errors.ApiError(exc.status_code, str(exc.detail), kind, None, code))


def _on_unexpected(_request: Request, exc: Exception) -> Response[bytes]:
    log.exception("unhandled error", exc_info=exc)
    return _error_response(errors.ApiError(500, "The server had an error while processing your request.",
                                           "server_error", None, "internal_error"))


def _holds_a_key(api: EdgeApi, authorization: str | None) -> bool:
    try:
        api.authenticate(authorization)
    except errors.ApiError:
        return False
    return True


def create_app(api: EdgeApi) -> Litestar:
    @get("/v1/models", sync_to_thread=False)
    def list_models(request: Request) -> dict[str, Any]:
        return api.models(request.headers.get("authorization"))

    # The generating endpoints are raw ASGI inside Litestar's router (see http.py for why): the key is
    # checked before their body is read, which is read within the limits.
    limits = http.BodyLimits(api.config.max_body_bytes, api.config.body_timeout_s)

    def bearer(headers: dict[str, str]) -> Any:
        return api.authenticate(headers.get("authorization"))

    @asgi("/v1/chat/completions", copy_scope=False)
    async def chat_completions(scope: Scope, receive: Receive, send: Send) -> None:
        await http.serve(scope, receive, send, api.chat_completions, limits, bearer)  # type: ignore[arg-type]

    @asgi("/v1/completions", copy_scope=False)
    async def completions(scope: Scope, receive: Receive, send: Send) -> None:
        await http.serve(scope, receive, send, api.completions, limits, bearer)  # type: ignore[arg-type]

    @get("/health", sync_to_thread=False)
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @get("/ready", sync_to_thread=False)
    def ready(request: Request) -> Response[dict[str, Any]]:
        """Ready or not to anyone (probes carry no key); what it serves (workers, models) only to a key's holder."""
        is_ready = api.mesh.is_ready()
        body: dict[str, Any] = {"status": "ready" if is_ready else "not_ready"}
        if _holds_a_key(api, request.headers.get("authorization")):
            live = api.mesh.directory.live()
            body |= {"workers": len(live), "models": sorted({w.model for w in live})}
        return Response(body, status_code=200 if is_ready else 503)

    files = FilesApi(api.config, api.mesh.bus, api.authenticate)  # /v1/files: its own upload bounds (files.py)

    return Litestar(
        route_handlers=[list_models, chat_completions, completions, health, ready, *files.route_handlers(),
                        *MessagesApi(api).route_handlers(), *ResponsesApi(api).route_handlers(),
                        *batch_routes(api.mesh.bus, api.authenticate)],
        exception_handlers={errors.ApiError: _on_api_error, HTTPException: _on_http_error, Exception: _on_unexpected},
        openapi_config=None,
        debug=False,
    )
