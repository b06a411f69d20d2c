"""Thin ASGI plumbing for the generating endpoints (chat/completions, completions, messages, responses).

They are mounted as Litestar ASGI route handlers: Litestar still routes, but the
request/response objects, signature parsing and the anyio task group of its
streaming response are skipped. Measured on this machine that is ~0.12 ms of CPU
per request, which under a burst of concurrent streams is most of the queueing
the edge adds to TTFT (loadtests/mesh_overhead.py). It also lets every request,
streamed or not, be cancelled when its client disconnects.

What a request costs before it is answered (a hostile client gets no more):

| step                  | bound                                                  | else                  |
|-----------------------|--------------------------------------------------------|-----------------------|
| method                | POST, checked before the body is read                  | 405, connection closed |
| API key               | checked from the headers, before the body is read      | 401, connection closed |
| Content-Length        | at most ``max_bytes``, checked before reading          | 413, connection closed |
| body, as it arrives   | at most ``max_bytes`` (chunked bodies stop there)      | 413, connection closed |
| body, in time         | whole within ``timeout_s`` of the app asking for it    | 408, connection closed |
|                       | (the edge's own loop stalls not counted: deadlines.py) |                       |

Headers (their size and deadline) are bounded one layer down, in ``connection.py``.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, AsyncIterator, Awaitable, Callable

from services.edge.deadlines import PatientDeadline
from shared import errors

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
    request_id: str = ""  # "": a new one; a batch line's run's own (services/edge/batch_lines.py)
    batch_id: str = ""  # the batch job a line belongs to (billed at the batch price)
    line_id: str = ""  # a batch line's id for good: billed under it, once, whatever its runs ("": request_id)


@dataclass(slots=True)
class JsonReply:
    status: int
    body: bytes
    headers: dict[str, str] | None = None


@dataclass(slots=True)
class SseReply:
    chunks: AsyncIterator[bytes]
    headers: dict[str, str] | None = None


Reply = JsonReply | SseReply
Authenticate = Callable[[dict[str, str]], Any]  # a request's headers -> its caller, or ApiError (401)
ErrorBody = Callable[[errors.ApiError], tuple[int, bytes]]  # an error -> its status and body in the API's shape


def openai_error(exc: errors.ApiError) -> tuple[int, bytes]:
    return exc.status, exc.json()


class ClientGone(Exception):
    """The client disconnected before its request was read."""


@dataclass(frozen=True, slots=True)
class BodyLimits:
    """How much of a request body the edge reads, and for how long."""

    max_bytes: int
    timeout_s: float


def _headers(scope: dict[str, Any]) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


def _check_length(headers: dict[str, str], limits: BodyLimits) -> None:
    """413 before reading a body whose declared length is over the limit (the parser enforced its syntax)."""
    declared = headers.get("content-length", "").strip()
    if declared.isdigit() and int(declared) > limits.max_bytes:
        raise errors.body_too_large(limits.max_bytes)


async def read_body(receive: Callable[[], Awaitable[dict[str, Any]]], limits: BodyLimits) -> bytes:
    """The whole body, or 413 as soon as it passes ``max_bytes``, or 408 past ``timeout_s`` (a trickle too)."""
    too_large = partial(errors.body_too_large, limits.max_bytes)
    async with read_window(limits.timeout_s):
        return b"".join([chunk async for chunk in body_chunks(receive, limits.max_bytes, too_large)])


@asynccontextmanager
async def read_window(timeout_s: float) -> AsyncIterator[None]:
    """408 (the body's) unless the block ends within ``timeout_s``; the edge's own loop stalls not counted."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(None) as window:
            deadline = PatientDeadline(loop, timeout_s, lambda: window.reschedule(loop.time()))
            try:
                yield
            finally:
                deadline.cancel()
    except TimeoutError:
        raise errors.request_timeout("body", timeout_s) from None


async def body_chunks(receive: Callable[[], Awaitable[dict[str, Any]]], max_bytes: int,
                      too_large: Callable[[], Exception]) -> AsyncIterator[bytes]:
    """The body's chunks as they arrive; ``too_large()`` raised once they pass ``max_bytes``."""
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise too_large()
        yield chunk
        if not message.get("more_body"):
            return


async def read_request(scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
                       limits: BodyLimits, authenticate: Authenticate) -> HttpRequest:
    """Method, caller and declared length first, then the body: a rejected request's body is never read."""
    headers = _headers(scope)
    if scope["method"] != "POST":
        raise errors.ApiError(405, f"Method {scope['method']} not allowed; use POST.", "invalid_request_error",
                              None, "method_not_allowed")
    caller = authenticate(headers)
    _check_length(headers, limits)
    return HttpRequest(scope["method"], scope["path"], headers, await read_body(receive, limits), caller)


async def _send(send: Callable[[dict[str, Any]], Awaitable[None]], reply: Reply) -> None:
    if isinstance(reply, JsonReply):
        extra = [(k.lower().encode(), v.encode()) for k, v in (reply.headers or {}).items()]
        extra.append((b"content-length", str(len(reply.body)).encode()))
        await send({"type": "http.response.start", "status": reply.status, "headers": JSON_HEADERS + extra})
        await send({"type": "http.response.body", "body": reply.body, "more_body": False})
        return
    extra = [(k.lower().encode(), v.encode()) for k, v in (reply.headers or {}).items()]
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS + extra})
    chunks = reply.chunks
    try:
        async for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    finally:
        # A disconnect cancels us inside send(), outside the generator: close it now so its
        # finally aborts the engine request at once, not whenever the generator is collected.
        await chunks.aclose()  # type: ignore[attr-defined]
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def error_reply(exc: errors.ApiError, close: bool = False, request_id: str = "",
                error_body: ErrorBody = openai_error) -> JsonReply:
    """The error as a reply; ``close``: the body may be unread, so the connection must not be reused. Every
    reply names its request (``x-request-id``, as OpenAI's do): the request's own, else a new one."""
    headers = {"x-request-id": request_id or uuid.uuid4().hex, **exc.headers}
    if close:
        headers["Connection"] = "close"
    status, body = error_body(exc)
    return JsonReply(status, body, headers)


async def serve(scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
                send: Callable[[dict[str, Any]], Awaitable[None]],
                handler: Callable[[HttpRequest], Awaitable[Reply]],
                limits: BodyLimits, authenticate: Authenticate, error_body: ErrorBody = openai_error) -> None:
    """Read the request (bounded, see the table above), run ``handler``, send its reply; a client
    disconnect cancels all of it. Errors are sent as ``error_body`` shapes them (OpenAI's by default)."""
    task = asyncio.current_task()
    assert task is not None
    try:
        request = await read_request(scope, receive, limits, authenticate)
    except ClientGone:
        return
    except errors.ApiError as exc:
        await _send(send, error_reply(exc, close=True, error_body=error_body))
        return
    request.request_id = request.request_id or uuid.uuid4().hex  # named now: its errors carry it too
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
        try:
            reply = await handler(request)
        except errors.ApiError as exc:
            reply = error_reply(exc, request_id=request.request_id, error_body=error_body)
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
            500, "The server had an error while processing your request.", "server_error", None, "internal_error"),
            request_id=request.request_id, error_body=error_body))
    finally:
        watcher.cancel()
