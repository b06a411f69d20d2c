"""Batch lines over the bus: the batch service sends each line of a job to ``<ns>.batch.line``, and any edge (queue
group ``edges``) runs it as the team's own request of class ``batch``: the same validation, admission (which gives
batch only idle capacity and takes it back first), routing, workers and billing as an HTTP request, answered with
the status and body an HTTP client would have got.

    batch service --BatchLineRequest--> <ns>.batch.line (queue "edges") --> EdgeApi, as POST <endpoint>
                  <--BatchLineReply---  (status, body, request id, Retry-After)

Only the batch role may publish there on a locked bus (``infermesh/bus_roles.py``): the line carries its team,
and the bus's permissions are what make that trustworthy. Only such a line is of class ``batch`` (the class is
granted, never claimed: a client's ``X-Request-Class`` only labels its request), and only its preempted run goes
unbilled. The line's request id is its own for good (``batch_<job>_<line>``): every run of the line is billed
under it, once (the ledger keeps one row per batch request id), and the reply names it. Each run has its own id
besides (``run_id``, ``<line id>_r<hex>``): its streams' and its worker's, as runs that overlap (a line timeout,
a preemption's drain, a leader change) must not share one. Each line runs in its own task; how many at once is
the batch service's to bound.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

import msgspec
from nats.aio.msg import Msg

from services.edge.http import HttpRequest, JsonReply, Reply, error_reply
from services.edge.keys import Caller
from shared import errors
from shared.batch_schema import BatchLineReply, BatchLineRequest
from shared.bus import Bus
from shared.telemetry import trace_context_of

log = logging.getLogger("infermesh.edge")
QUEUE = "edges"

Handler = Callable[[HttpRequest], Awaitable[Reply]]


def _streams(body: bytes) -> bool:
    try:
        decoded = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return False  # the endpoint says what is wrong with it
    return isinstance(decoded, dict) and decoded.get("stream") is True


def line_request(line: BatchLineRequest, trace_headers: dict[str, str] | None = None) -> HttpRequest:
    """The line as the HTTP request its team would have sent (class batch, never streamed), under its run's id and
    billed under the line's, in the trace of the line's run (its message's ``traceparent``)."""
    headers = {"content-type": "application/json", "x-request-class": "batch", **(trace_headers or {})}
    return HttpRequest("POST", line.endpoint, headers, line.body, Caller(line.team, line.key_prefix),
                       line.run_id or line.request_id, line.job_id, line.request_id)


async def run_line(line: BatchLineRequest, handlers: dict[str, Handler],
                   trace_headers: dict[str, str] | None = None) -> BatchLineReply:
    """Run one line through ``handlers[endpoint]``; every error becomes the reply an HTTP client would get."""
    handler = handlers.get(line.endpoint)
    try:
        if handler is None:
            raise errors.invalid_request(f"A batch line cannot call {line.endpoint!r}.", "url")
        if _streams(line.body):  # refused before it runs (a stream would be generated and billed)
            raise errors.invalid_request("A batch line cannot stream: set `stream` to false.", "stream")
        reply = await handler(line_request(line, trace_headers))
        if not isinstance(reply, JsonReply):
            raise errors.invalid_request("A batch line cannot stream: set `stream` to false.", "stream")
    except errors.ApiError as exc:
        reply = error_reply(exc)
    retry_after = (reply.headers or {}).get("Retry-After", "0")
    return BatchLineReply(reply.status, reply.body, line.request_id,
                          float(retry_after) if retry_after.isdigit() else 0.0)


class BatchLineServer:
    """This edge's share of the batch lines."""

    def __init__(self, bus: Bus, handlers: dict[str, Handler]) -> None:
        self.bus, self.handlers = bus, handlers
        self.stats = {"lines": 0, "ok": 0, "errors": 0}
        self._sub = None
        self._running: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._sub = await self.bus.subscribe(self.bus.subjects.batch_line, BatchLineRequest, self._on_line, QUEUE)

    async def stop(self) -> None:
        """No new line; those running finish (their replies and bills go out) within the edge's drain."""
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
        if self._running:
            await asyncio.wait(list(self._running), timeout=30)

    async def _on_line(self, line: BatchLineRequest, raw: Msg) -> None:
        task = asyncio.get_running_loop().create_task(self._answer(line, raw))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _answer(self, line: BatchLineRequest, raw: Msg) -> None:
        self.stats["lines"] += 1
        try:
            reply = await run_line(line, self.handlers, trace_context_of(raw.headers))
        except Exception:  # never let one line take the subscription down; the service retries it
            log.exception("batch line %s of %s failed on this edge", line.line_index, line.job_id)
            reply = error_reply(errors.ApiError(500, "The server had an error while processing this line.",
                                                "server_error", None, "internal_error"))
            reply = BatchLineReply(reply.status, reply.body, line.request_id)
        self.stats["ok" if reply.status_code == 200 else "errors"] += 1
        await self.bus.respond(raw, reply)
