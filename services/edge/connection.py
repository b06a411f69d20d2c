"""The edge's HTTP/1.1 connections: uvicorn's httptools protocol with the bounds it lacks.

uvicorn (0.54, httptools) arms no timer until a request's headers are complete and httptools caps no
header size, so a client that sends its headers slowly, or forever, holds a connection and memory
(slowloris). This protocol adds, per connection:

| bound                                                         | else                                 |
|---------------------------------------------------------------|--------------------------------------|
| request line + headers at most ``max_header_bytes``           | 431, connection closed               |
| headers complete within ``header_timeout_s`` of the request's | 408, connection closed               |
| first byte (or of the connection, before any byte)            | (the edge's own stalls not counted:  |
|                                                               | deadlines.py)                        |

An idle keep-alive connection is closed after ``keep_alive_s`` (uvicorn's timer, made patient the same way: a stalled
loop ran the plain timer before the bytes of the request the client had just sent on that connection, and closed it
under the client: an httpx ``ReadError``, the likely cause of one seen in CI), and a lingering close: when the edge
answers before the request's body arrived (401, 413, 408, see http.py; or any route, e.g. a 405 from Litestar) it
closes the connection, and closing at once with unread bytes makes the kernel reset the connection, and the client
(still sending) sees "connection reset" instead of the answer. So such a close half-closes (FIN after the reply),
drops whatever still arrives, and closes for good when the client does or after
``LINGER_S``. Bodies themselves (size, deadline) are bounded one layer up, in http.py.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from services.edge.deadlines import PatientDeadline
from shared import errors

log = logging.getLogger("infermesh.edge")
LINGER_S = 2.0  # at most this long spent draining a rejected request's body before closing


@dataclass(frozen=True, slots=True)
class HeaderLimits:
    max_bytes: int
    timeout_s: float


class _LingeringTransport:
    """The transport as uvicorn sees it: ``close()`` mid-request lingers (see the module docstring)."""

    def __init__(self, transport: asyncio.Transport, protocol: "GuardedHttpProtocol") -> None:
        self._transport = transport
        self._protocol = protocol
        self._closing = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self._closing or self._transport.is_closing()

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        transport = self._transport
        if not self._protocol.in_message or not transport.can_write_eof() or transport.is_closing():
            transport.close()
            return
        self._protocol.lingering = True
        transport.write_eof()  # after the reply already buffered: the client reads it, then our FIN
        transport.resume_reading()
        asyncio.get_running_loop().call_later(LINGER_S, transport.close)


class GuardedHttpProtocol(HttpToolsProtocol):
    """HttpToolsProtocol with a header size cap, a header deadline and lingering closes.

    State: ``in_message`` from a request's first byte to its last body byte; ``_awaiting_headers``
    from the connection's start or the end of the previous request to the end of the next one's headers
    (its bytes are counted against the cap); the deadline runs from the connection's start or a
    request's first byte to the end of its headers, never while a reply streams."""

    header_limits = HeaderLimits(64 << 10, 30.0)  # set per server by ``guarded_protocol``

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = _LingeringTransport(transport, self)  # type: ignore[assignment]
        self.in_message = False
        self.lingering = False
        self._awaiting_headers = True
        self._header_bytes = 0
        self._deadline: PatientDeadline | None = None
        self._opened_at = self.loop.time()
        self._requests = 0
        self._arm_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return  # the rest of a rejected request: dropped unparsed
        if self._awaiting_headers:
            self._header_bytes += len(data)
        super().data_received(data)
        if self._awaiting_headers and self._header_bytes > self.header_limits.max_bytes:
            self._reject(431, "Request Header Fields Too Large", errors.ApiError(
                431, f"The request line and headers are larger than {self.header_limits.max_bytes} bytes.",
                "invalid_request_error", None, "headers_too_large"))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.in_message = True
        self._requests += 1
        if self._deadline is None:
            self._arm_deadline()

    def on_headers_complete(self) -> None:
        self._awaiting_headers = False
        self._disarm_deadline()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self.in_message = False
        self._awaiting_headers = True
        self._header_bytes = 0

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.in_message and not self.transport.is_closing():
            self.transport.close()  # answered before its body ended (any route): never read the rest; lingers
        elif isinstance(self.timeout_keep_alive_task, asyncio.TimerHandle):  # uvicorn's idle close: not a stall's
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = PatientDeadline(  # type: ignore[assignment]  (it has cancel() too)
                self.loop, self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def _arm_deadline(self) -> None:
        self._deadline = PatientDeadline(self.loop, self.header_limits.timeout_s, self._on_deadline)  # not a stall's

    def _disarm_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _on_deadline(self) -> None:
        deadline, self._deadline = self._deadline, None
        if self._awaiting_headers and not self.transport.is_closing():
            log.warning("408 on a connection from %s: open %.1f s, request %d, %d header bytes read, reading %s, "
                        "deferred %d times for loop stalls", self.client, self.loop.time() - self._opened_at,
                        self._requests, self._header_bytes,
                        "paused" if self.flow.read_paused else "on", deadline.deferrals if deadline else 0)
            self._reject(408, "Request Timeout", errors.request_timeout("headers", self.header_limits.timeout_s))

    def _reject(self, status: int, reason: str, error: errors.ApiError) -> None:
        """Answer ``error`` outside any ASGI cycle and close; mid-reply (a pipelining client) only close."""
        self._disarm_deadline()
        if self.cycle is None or self.cycle.response_complete:
            body = error.json()
            head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
            self.transport.write(head + body)
        self.transport.close()


def guarded_protocol(limits: HeaderLimits) -> type[GuardedHttpProtocol]:
    """The protocol class for one server (uvicorn instantiates it per connection)."""
    return type("EdgeHttpProtocol", (GuardedHttpProtocol,), {"header_limits": limits})
