"""Thin ASGI plumbing for the two hot endpoints (chat/completions, completions).

They are mounted as Litestar ASGI route handlers: Litestar still routes, but the
request/response objects, signature parsing and the anyio task group of its
streaming response are skipped. Measured on this machine that is ~0.12 ms of CPU
per request, which under a burst of concurrent streams is most of the queueing
the edge adds to TTFT (loadtests/mesh_overhead.py). It also lets every request,
streamed or not, be cancelled when its client disconnects.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from services.edge import errors

log = logging.getLogger("infermesh.edge")
JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


@dataclass(slots=True)
class HttpRequest:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes
    caller: Any = None  # who sent it, once authenticated (services.edge.keys.Caller)


@dataclass(slots=True)
class JsonReply:
    status: int
    body: bytes
    headers: dict[str, str] | None = None


@dataclass(slots=True)
class SseReply:
    chunks: AsyncIterator[bytes]


Reply = JsonReply | SseReply


class ClientGone(Exception):
    """The client disconnected before its request was read."""


async def read_request(scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]]) -> HttpRequest:
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return HttpRequest(scope["method"], scope["path"], headers, b"".join(parts))


async def _send(send: Callable[[dict[str, Any]], Awaitable[None]], reply: Reply) -> None:
    if isinstance(reply, JsonReply):
        extra = [(k.lower().encode(), v.encode()) for k, v in (reply.headers or {}).items()]
        await send({"type": "http.response.start", "status": reply.status, "headers": JSON_HEADERS + extra})
        await send({"type": "http.response.body", "body": reply.body, "more_body": False})
        return
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    chunks = reply.chunks
    try:
        async for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    finally:
        # A disconnect cancels us inside send(), outside the generator: close it now so its
        # finally aborts the engine request at once, not whenever the generator is collected.
        await chunks.aclose()  # type: ignore[attr-defined]
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def error_reply(exc: errors.ApiError) -> JsonReply:
    return JsonReply(exc.status, exc.json(), exc.headers)


async def serve(scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
                send: Callable[[dict[str, Any]], Awaitable[None]],
                handler: Callable[[HttpRequest], Awaitable[Reply]]) -> None:
    """Read the request, run ``handler``, send its reply; a client disconnect cancels all of it."""
    task = asyncio.current_task()
    assert task is not None
    try:
        request = await read_request(scope, receive)
    except ClientGone:
        return
    gone = asyncio.Event()

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        gone.set()
        task.cancel()  # the body iterator's finally aborts the engine request

    watcher = asyncio.get_running_loop().create_task(watch())
    started = False

    async def tracked_send(message: dict[str, Any]) -> None:
        nonlocal started
        started = True
        await send(message)

    try:
        if request.method != "POST":
            reply: Reply = error_reply(errors.ApiError(405, f"Method {request.method} not allowed; use POST.",
                                                       "invalid_request_error", None, "method_not_allowed"))
        else:
            try:
                reply = await handler(request)
            except errors.ApiError as exc:
                reply = error_reply(exc)
        await _send(tracked_send, reply)
    except asyncio.CancelledError:
        if not gone.is_set():
            raise
        task.uncancel()
    except Exception:
        log.exception("unhandled error on %s", request.path)
        if started:
            return  # mid-stream: nothing valid can follow; the server closes the connection
        await _send(send, error_reply(errors.ApiError(
            500, "The server had an error while processing your request.", "server_error", None, "internal_error")))
    finally:
        watcher.cancel()
