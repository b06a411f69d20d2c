"""The bus layer: typed request/reply, subscriptions and token streams over nats-py.

Every publish carries the current W3C trace context in NATS headers, and every
handler runs inside the context its message carried, so one request yields one
trace across services.

Token streams: the edge publishes a GenerateRequest with ``reply`` set to a
stream subject of its own; the worker answers on that subject with numbered
StreamMessages (TokenChunk* then exactly one StreamEnd or StreamError). The
edge holds a single wildcard subscription for all its streams and hands each
message to the waiting request (no SUB/UNSUB per request).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections import deque
from typing import Any, Awaitable, Callable, TypeVar

import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from opentelemetry import context as otel_context

from shared import schema
from shared.nats_auth import NatsCredentials
from shared.schema import StreamEnd, StreamError, StreamMessage, TokenChunk
from shared.subjects import Subjects
from shared.telemetry import extract_context, inject_headers

log = logging.getLogger(__name__)
T = TypeVar("T")
NO_RESPONDERS = "503"


class BusError(Exception):
    """A request on the bus failed: no responder or timeout."""


class NoResponder(BusError):
    """Nobody received the request, so asking again is always safe. NATS also says so, now and then, to a request
    sent just after a queue group's subscribe and flush on another connection (nats-server 2.15, about 1 in 100)."""


class Bus:
    """A connected NATS client plus the namespace's subject names.

    On a locked bus (``infermesh/bus_roles.py``) a service holds two connections: ``nc`` in the MESH account for
    core publish, subscribe and request, ``store`` in the STORE account for JetStream (``js``: streams, KV, object
    stores), which no core traffic uses; and a service that uses the usage streams (edge, metering, admission,
    admin) a third, ``ledger`` in the LEDGER account (``ledger_js``: the usage stream and its dead letters, and
    nothing else). On an open server (tests, dev) they are one connection."""

    def __init__(self, nc: NatsClient, subjects: Subjects, store: NatsClient | None = None,
                 ledger: NatsClient | None = None) -> None:
        self.nc = nc
        self.store = store or nc
        self.ledger = ledger or self.store
        self.subjects = subjects
        self.js = self.store.jetstream()
        self.ledger_js = self.js if self.ledger is self.store else self.ledger.jetstream()
        self.refusals: deque[str] = deque(maxlen=100)  # the server's permission violations (Bus.connect fills it)
        self._reconnect: Callable[[str], Awaitable["Bus"]] | None = None
        # called after the client reconnected (NATS restarted, a network blip): what was in flight may be lost
        self.on_reconnected: list[Callable[[], None]] = []

    async def connect_again(self, name: str) -> "Bus":
        """A second connection like this one (same server, namespace and credentials), e.g. for a thread."""
        if self._reconnect is None:
            raise BusError("this bus was not made by Bus.connect: it cannot connect again")
        return await self._reconnect(name)

    @property
    def is_connected(self) -> bool:
        return self.nc.is_connected and self.store.is_connected and self.ledger.is_connected

    @classmethod
    async def connect(cls, url: str, namespace: str, name: str, credentials: NatsCredentials | None = None) -> "Bus":
        """Connect as ``credentials`` (default: the ``INFERMESH_NATS_*`` env vars, see ``shared/nats_auth.py``) to
        ``url``, or to any of a cluster's servers given comma-separated (the client learns the others from the one
        it reaches, and moves to them when that one is lost); with a store user, a second connection as it, and
        with a ledger user a third.

        An unreachable server is retried forever; credentials or a certificate the server refuses raise
        BusError at once (retrying cannot help). Permission violations later are logged and kept, the
        newest last, in ``refusals``."""
        credentials = NatsCredentials.from_env() if credentials is None else credentials
        refusals: deque[str] = deque(maxlen=100)
        listeners: list[Callable[[], None]] = []
        opened = [await _open(url, name, credentials, refusals, listeners)]
        try:
            for account, user, who in (("store", credentials.store_user, credentials.store()),
                                       ("ledger", credentials.ledger_user, credentials.ledger())):
                opened.append(await _open(url, f"{name}@{account}", who, refusals, listeners) if user else None)
        except BaseException:
            for nc in opened:
                if nc is not None:
                    await nc.close()
            raise
        bus = cls(opened[0], Subjects(namespace), opened[1], opened[2])
        bus.refusals = refusals
        bus.on_reconnected = listeners
        bus._reconnect = lambda again: cls.connect(url, namespace, again, credentials)
        return bus

    async def close(self) -> None:
        for nc in dict.fromkeys((self.nc, self.store, self.ledger)):
            if not nc.is_closed:
                await nc.drain()

    async def publish(self, subject: str, message: Any, reply: str = "") -> None:
        await self.nc.publish(subject, schema.encode(message), reply=reply, headers=inject_headers())

    async def request(self, subject: str, message: Any, reply_type: type[T], timeout: float = 2.0) -> T:
        try:
            msg = await self.nc.request(subject, schema.encode(message), timeout=timeout, headers=inject_headers())
        except nats.errors.NoRespondersError as exc:
            raise NoResponder(f"no responder on {subject}") from exc
        except nats.errors.TimeoutError as exc:
            raise BusError(f"timeout after {timeout}s on {subject}") from exc
        return schema.decode(msg.data, reply_type)

    async def subscribe(
        self,
        subject: str,
        kind: Any,
        handler: Callable[[Any, Msg], Awaitable[None]],
        queue: str = "",
    ) -> Any:
        """Decode each message as ``kind`` and run ``handler(message, raw)`` in its trace context."""

        async def on_message(raw: Msg) -> None:
            try:
                message = schema.decode(raw.data, kind)
            except Exception:  # a malformed message must not kill the subscription
                log.warning("dropping undecodable message on %s", raw.subject)
                return
            carried = extract_context(raw.headers)
            token = otel_context.attach(carried) if carried is not None else None
            try:
                await handler(message, raw)
            except Exception:
                log.exception("handler for %s failed", raw.subject)
            finally:
                if token is not None:
                    otel_context.detach(token)

        return await self.nc.subscribe(subject, queue=queue, cb=on_message)

    async def respond(self, raw: Msg, message: Any) -> None:
        if is_reply_inbox(raw.reply):
            await self.nc.publish(raw.reply, schema.encode(message), headers=inject_headers())
        elif raw.reply:
            log.warning("not answering %s on %r: a reply goes to an inbox only", raw.subject, raw.reply)


class _Client(NatsClient):
    """nats-py's client, but a PONG answering a PING whose flush already timed out is taken in its turn and
    dropped: nats-py sets the result of that cancelled future, the InvalidStateError ends its read loop without
    a reconnect, and the connection goes on sending while it reads nothing (no message, no reply, no PONG). A
    nats-server paused for longer than a flush's timeout (SIGSTOP, a VM frozen) did that to admission: its
    requests unanswered until the ping timer, minutes later (the fault matrix's ``jetstream-away``)."""

    async def _process_pong(self) -> None:
        if self._pongs:
            future = self._pongs.pop(0)  # one PONG per PING, in order: this one was this future's
            if not future.done():
                future.set_result(True)
        self._pongs_received += 1
        self._pings_outstanding = 0


async def _open(url: str, name: str, credentials: NatsCredentials, refusals: deque[str],
                listeners: list[Callable[[], None]]) -> NatsClient:
    """One connection as ``credentials`` (see ``Bus.connect``); its refusals and reconnects go to the lists given."""
    refused: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()

    async def on_error(exc: Exception) -> None:
        text = str(exc).lower()
        if "authorization violation" in text or isinstance(exc, (nats.errors.AuthorizationError, ssl.SSLError)):
            if not refused.done():
                refused.set_result(exc)
        elif "permissions violation" in text:
            refusals.append(str(exc))
        log.warning("NATS (%s as %s): %s", name, credentials.user or "anonymous", exc)

    async def on_reconnected() -> None:
        log.warning("NATS (%s): reconnected", name)
        for listener in list(listeners):
            listener()

    nc = _Client()
    servers = [u.strip() for u in url.split(",") if u.strip()]  # a cluster's seeds: "nats://a:4222,nats://b:4222"
    connecting = asyncio.ensure_future(nc.connect(
        servers if len(servers) > 1 else url, name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
        connect_timeout=5,
        error_cb=on_error, reconnected_cb=on_reconnected, **credentials.connect_options(url)))
    await asyncio.wait([connecting, refused], return_when=asyncio.FIRST_COMPLETED)
    if not connecting.done():
        connecting.cancel()
        await asyncio.gather(connecting, return_exceptions=True)
        await nc.close()
        raise BusError(f"NATS at {url} refused {name} (user {credentials.user or 'none'}): {refused.result()}")
    connecting.result()
    return nc


async def stop_serving(subscriptions: list[Any], timeout_s: float = 5.0) -> None:
    """Stop receiving on ``subscriptions`` and let their handlers answer what was already received.

    ``unsubscribe`` would cancel the handler running and drop the messages queued behind it: their requesters
    hear nothing and wait out their whole timeout (an admission leader stepping down under load left an acquire
    unanswered for 12 s so). A drain that cannot end within ``timeout_s`` (NATS away) is given up on."""

    async def drain(sub: Any) -> None:
        try:
            await asyncio.wait_for(sub.drain(), timeout_s)
        except Exception as exc:  # closed, draining, already gone, or NATS away
            log.warning("could not drain subscription %s: %r", getattr(sub, "subject", "?"), exc)

    await asyncio.gather(*(drain(sub) for sub in subscriptions))


def is_reply_inbox(subject: str) -> bool:
    """Whether ``subject`` is a requester's inbox. NATS lets a responder publish to the reply subject of a
    message it received even where its own permissions deny that subject, so a reply anywhere else is a
    requester borrowing the responder's rights (a worker pinging an edge with ``reply=$KV.<ns>_api_keys.x``
    would have had the edge overwrite an API key with its pong): never answered."""
    return subject.startswith("_INBOX.")


class TokenStreamSender:
    """Worker side of one token stream: numbers messages and guarantees one terminal message."""

    def __init__(self, bus: Bus, subject: str, source_id: str, request_id: str) -> None:
        self._bus = bus
        self._subject = subject
        self._source_id = source_id
        self._request_id = request_id
        self._seq = 0
        self.closed = False
        self._headers = inject_headers()  # the trace context it is created in (once: not per token)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    async def _send(self, message: StreamMessage) -> None:
        await self._bus.nc.publish(self._subject, schema.encode(message), headers=self._headers)

    async def tokens(self, token_ids: list[int]) -> None:
        await self._send(TokenChunk(self._source_id, self._next_seq(), schema.now(), self._request_id, token_ids))

    async def end(self, finish_reason: str, num_prompt: int, num_cached: int, num_output: int,
                  kv_transfer: schema.KvTransfer | None = None) -> None:
        self.closed = True
        await self._send(
            StreamEnd(
                self._source_id, self._next_seq(), schema.now(), self._request_id,
                finish_reason, num_prompt, num_cached, num_output, kv_transfer,  # type: ignore[arg-type]
            )
        )

    async def error(self, code: str, message: str) -> None:
        self.closed = True
        await self._send(StreamError(self._source_id, self._next_seq(), schema.now(), self._request_id, code, message))


class TokenStream:
    """Edge side of one token stream: StreamMessages up to and including the terminal one.

    Timeouts are deadlines checked by the receiver's sweeper, not a timer per
    message: ``first_timeout_s`` until the first message, then ``idle_timeout_s``
    between messages; a lapse ends the stream with a ``timeout`` StreamError.
    """

    def __init__(self, request_id: str, worker_id: str, first_timeout_s: float, idle_timeout_s: float) -> None:
        self.request_id = request_id
        self.worker_id = worker_id
        self._queue: asyncio.Queue[StreamMessage] = asyncio.Queue()
        self._expected_seq = 1
        self._idle_timeout_s = idle_timeout_s
        self._timeout_s = first_timeout_s
        self.deadline = time.monotonic() + first_timeout_s
        self.heard_at = time.monotonic()  # its last message (or its opening): how long it has been silent
        self.done = False
        self._why = ""  # what shortened the deadline, if anything

    def _deliver(self, message: StreamMessage) -> None:
        if self.done:
            return
        if message.seq != self._expected_seq:
            message = StreamError(
                message.source_id, message.seq, schema.now(), self.request_id, "stream_gap",
                f"token stream from {message.source_id} lost messages {self._expected_seq}..{message.seq - 1}",
            )
        self._expected_seq = message.seq + 1
        self._timeout_s, self._why = self._idle_timeout_s, ""
        self.heard_at = time.monotonic()
        self.deadline = self.heard_at + self._idle_timeout_s
        self._queue.put_nowait(message)

    def fail(self, code: str, message: str) -> None:
        """End the stream with an error (worker vanished, no responder, timeout)."""
        if not self.done:
            self.deadline = float("inf")
            self._queue.put_nowait(StreamError(self.worker_id, 0, schema.now(), self.request_id, code, message))

    def expect_within(self, seconds: float, why: str) -> None:
        """Something may have cut the stream (``why``): unless a message arrives within ``seconds``, it failed."""
        if not self.done and time.monotonic() + seconds < self.deadline:
            self.deadline = time.monotonic() + seconds
            self._timeout_s, self._why = seconds, why

    def expire(self, now: float) -> None:
        if not self.done and now > self.deadline:
            why = f" ({self._why})" if self._why else ""
            self.fail("timeout", f"no message from worker {self.worker_id} for {self._timeout_s}s{why}")

    async def next(self) -> StreamMessage:
        message = self._queue.get_nowait() if not self._queue.empty() else await self._queue.get()
        if isinstance(message, (StreamEnd, StreamError)):
            self.done = True
        return message


class StreamReceiver:
    """One wildcard subscription that feeds every open TokenStream of an edge, and expires idle ones."""

    def __init__(self, bus: Bus, edge_id: str, sweep_s: float = 0.05, reconnect_grace_s: float = 5.0) -> None:
        self._bus = bus
        self._reconnect_grace_s = reconnect_grace_s
        self._prefix = bus.subjects.stream_prefix(edge_id)
        self._streams: dict[str, TokenStream] = {}
        self._sub: Any = None
        self._sweep_s = sweep_s
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._sub = await self._bus.nc.subscribe(self._prefix + ".*", cb=self._on_message)
        self._sweeper = asyncio.create_task(self._sweep(), name="stream-timeouts")
        self._bus.on_reconnected.append(self._after_reconnect)

    def _after_reconnect(self) -> None:
        """Messages a worker sent while this edge was away, or before its subscription was back, are gone: a
        stream that hears nothing within the grace has lost its end, and fails instead of waiting out its
        deadline (60 s, 300 s before the first token)."""
        for stream in list(self._streams.values()):
            stream.expect_within(self._reconnect_grace_s, "the bus reconnected: its messages may be lost")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._sub is not None:
            await self._sub.unsubscribe()
        for stream in list(self._streams.values()):
            stream.fail("shutdown", "edge is shutting down")

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self._sweep_s)
            now = time.monotonic()
            for stream in list(self._streams.values()):
                stream.expire(now)

    def subject(self, request_id: str) -> str:
        return f"{self._prefix}.{request_id}"

    def open(self, request_id: str, worker_id: str, first_timeout_s: float = 300.0,
             idle_timeout_s: float = 60.0) -> TokenStream:
        """A stream for ``request_id``'s messages. Ids are unique per run (a batch line's runs each have their
        own); one still open under the same id is failed, never left to wait out its deadline unheard."""
        older = self._streams.get(request_id)
        if older is not None and not older.done:
            log.warning("stream %s opened again while open: the older one fails", request_id)
            older.fail("bad_message", "another request took this stream's id")
        stream = TokenStream(request_id, worker_id, first_timeout_s, idle_timeout_s)
        self._streams[request_id] = stream
        return stream

    def close(self, request_id: str, stream: TokenStream | None = None) -> None:
        """Stop feeding ``request_id``'s stream; given ``stream``, only if it is still that one (not a newer one
        opened under the same id)."""
        if stream is None or self._streams.get(request_id) is stream:
            self._streams.pop(request_id, None)

    def num_open(self, worker_id: str) -> int:
        """Streams served by ``worker_id`` still waiting for their end."""
        return sum(1 for s in self._streams.values() if s.worker_id == worker_id and not s.done)

    def silent_workers(self, now: float, silence_s: float) -> set[str]:
        """The workers of open streams that have heard nothing for more than ``silence_s``."""
        return {s.worker_id for s in self._streams.values() if not s.done and now - s.heard_at > silence_s}

    def fail_worker(self, worker_id: str, code: str, message: str) -> int:
        """Fail every open stream served by ``worker_id``; returns how many."""
        failed = [s for s in self._streams.values() if s.worker_id == worker_id and not s.done]
        for stream in failed:
            stream.fail(code, message)
        return len(failed)

    async def _on_message(self, raw: Msg) -> None:
        request_id = raw.subject.rpartition(".")[2]
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if not raw.data and raw.headers and raw.headers.get("Status") == NO_RESPONDERS:
            stream.fail("worker_unavailable", f"worker {stream.worker_id} has no generate subscriber")
            return
        try:
            stream._deliver(schema.decode(raw.data, StreamMessage))
        except Exception:
            stream.fail("bad_message", "undecodable token stream message")
