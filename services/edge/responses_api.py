"""OpenAI's Responses API on the edge: ``POST /v1/responses`` (Codex CLI speaks only this), and stored responses.

The body is translated into the chat request it asks for (responses_body.py, in prep.py like chat's bodies),
then served by the same run as chat (``EdgeApi.serve``: admission, routing, session affinity, billing,
tracing, abort on disconnect); only the response's shape differs (shapes/responses.py). Errors are OpenAI's.

Stored responses are metering's (services/metering/responses.py, over ``<ns>.responses.api.*``, in the ledger,
per team, kept for its retention):

| route                                   | does                                                              |
|-----------------------------------------|-------------------------------------------------------------------|
| ``POST /v1/responses``                  | ``store`` (default true): a finished response (completed or       |
|                                         | incomplete) is stored before its last event is sent; ``store`` in |
|                                         | it says whether that worked (false: metering or the ledger away)  |
|                                         | ``previous_response_id``: that conversation comes before ``input``|
| ``GET /v1/responses/{id}``              | the stored response object                                        |
| ``GET /v1/responses/{id}/input_items``  | its request's own input items: ``limit`` (1..100, 20), ``order``  |
|                                         | (``desc``), ``after`` (an item id)                                |
| ``DELETE /v1/responses/{id}``           | ``{"id", "object": "response", "deleted": true}``                 |

Another team's response is the same 404 as an unknown one. A response that failed is not stored.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec
from litestar import Request, Response, delete, get
from litestar.handlers import asgi
from litestar.types import Receive, Scope, Send

from services.edge import http
from services.edge.api import EdgeApi, thinker
from services.edge.errors import unavailable
from services.edge.http import HttpRequest, Reply
from services.edge.prep import Peek
from services.edge.shapes.responses import ResponsesShape
from shared import errors
from shared.bus import BusError, NoResponder
from shared.responses_schema import ResponsesApiReply, ResponsesApiRequest, StoredResponse

log = logging.getLogger("infermesh.edge")
ASK_TIMEOUT_S = 10.0
NO_RESPONDER_RETRY_S = 1.0  # how long a request nobody received is asked again
STORE_TIMEOUT_S = 5.0  # the wait before a response's last event for it to be stored (then it says store: false)
_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def _raise_if_error(reply: ResponsesApiReply) -> ResponsesApiReply:
    if reply.error_status:
        kind = "invalid_request_error" if reply.error_status < 500 else "server_error"
        raise errors.ApiError(reply.error_status, reply.error_message, kind, reply.error_param, reply.error_code)
    return reply


def with_ids(items: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """The input items as a listing shows them: each with an id (its own, else one made from the response's)."""
    return [item if item.get("id") else {"id": f"{_ID_PREFIX.get(item.get('type', ''), 'item')}_{key}_in{i}", **item}
            for i, item in enumerate(items)]


def page(items: list[dict[str, Any]], query: dict[str, str]) -> dict[str, Any]:
    """One page of an input-item listing (OpenAI's list object); 400 naming a bad ``limit`` or ``order``."""
    limit, order, after = query.get("limit", "20"), query.get("order", "desc"), query.get("after")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise errors.invalid_request("limit must be a whole number from 1 to 100.", "limit")
    if order not in ("asc", "desc"):
        raise errors.invalid_request("order must be 'asc' or 'desc'.", "order")
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        at = next((i for i, item in enumerate(ordered) if item.get("id") == after), None)
        if at is None:
            raise errors.invalid_request(f"No input item with id '{after}' in this response.", "after")
        ordered = ordered[at + 1:]
    data = ordered[:int(limit)]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(ordered) > len(data)}


class ResponsesApi:
    def __init__(self, api: EdgeApi) -> None:
        self.api = api

    async def ask(self, operation: str, request: ResponsesApiRequest, timeout: float = ASK_TIMEOUT_S
                  ) -> ResponsesApiReply:
        bus = self.api.mesh.bus
        deadline = time.monotonic() + NO_RESPONDER_RETRY_S
        while True:
            try:
                reply = await bus.request(bus.subjects.responses_api(operation), request, ResponsesApiReply, timeout)
                return _raise_if_error(reply)
            except NoResponder as exc:  # nobody got it: metering restarting, or just subscribed; safe to ask again
                if time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                    continue
                raise unavailable("The stored-responses service", "responses_unavailable", exc) from exc
            except BusError as exc:
                raise unavailable("The stored-responses service", "responses_unavailable", exc) from exc

    async def create(self, request: HttpRequest) -> Reply:
        team = request.caller.team

        async def conversation(seen: Peek) -> bytes:
            if seen.previous_response_id is None:
                return b""
            return (await self.ask("context", ResponsesApiRequest(team=team,
                                                                  response_id=seen.previous_response_id))).items

        prepared, tokenizer = await self.api.prepare(request, "responses", conversation)
        parser = self.api.tool_parser(prepared)
        echo = prepared.extra or {}

        def shape(request_id: str) -> ResponsesShape:
            keep = self._keeper(team, echo, request_id) if echo.get("store") else None
            return ResponsesShape(f"resp_{request_id}", prepared.model, parser(request_id[:16]) if parser else None,
                                  echo, keep, thinker(prepared))

        return await self.api.serve(request, "responses", prepared, tokenizer, shape)

    def _keeper(self, team: str, echo: dict[str, Any], request_id: str):  # type: ignore[no-untyped-def]
        """What stores the finished response: True once metering committed it, False when it could not."""
        items = msgspec.json.encode(with_ids(echo.get("input_items") or [], request_id))

        async def keep(response: dict[str, Any]) -> bool:
            record = StoredResponse(id=response["id"], team=team, created_at=response["created_at"],
                                    previous_response_id=echo.get("previous_response_id"),
                                    response=msgspec.json.encode(response), input_items=items)
            try:
                await self.ask("store", ResponsesApiRequest(team=team, record=record), STORE_TIMEOUT_S)
                return True
            except Exception as exc:  # metering or the ledger away, or the record over the bus's max_payload
                log.warning("response %s not stored: %s", response["id"], getattr(exc, "message", exc))
                return False

        return keep

    def route_handlers(self) -> list[Any]:
        limits = http.BodyLimits(self.api.config.max_body_bytes, self.api.config.body_timeout_s)
        authenticate = self.api.authenticate

        def bearer(headers: dict[str, str]) -> Any:
            return authenticate(headers.get("authorization"))

        def asked(request: Request, response_id: str) -> ResponsesApiRequest:
            return ResponsesApiRequest(team=authenticate(request.headers.get("authorization")).team,
                                       response_id=response_id)

        @asgi("/v1/responses", copy_scope=False)
        async def create(scope: Scope, receive: Receive, send: Send) -> None:
            await http.serve(scope, receive, send, self.create, limits, bearer)  # type: ignore[arg-type]

        @get("/v1/responses/{response_id:str}")
        async def retrieve(request: Request, response_id: str) -> Response[bytes]:
            asking = asked(request, response_id)
            if request.query_params.get("stream", "false") not in ("false", "0"):
                raise errors.invalid_request("stream is not supported when retrieving a response.", "stream")
            reply = await self.ask("get", asking)
            return Response(reply.response, media_type="application/json")

        @get("/v1/responses/{response_id:str}/input_items")
        async def input_items(request: Request, response_id: str) -> dict[str, Any]:
            reply = await self.ask("input_items", asked(request, response_id))
            return page(msgspec.json.decode(reply.items), dict(request.query_params))

        @delete("/v1/responses/{response_id:str}", status_code=200)
        async def remove(request: Request, response_id: str) -> dict[str, Any]:
            await self.ask("delete", asked(request, response_id))
            return {"id": response_id, "object": "response", "deleted": True}

        return [create, retrieve, input_items, remove]
