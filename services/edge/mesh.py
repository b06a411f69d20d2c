"""The edge's side of the bus: route, send to the worker, turn its token stream into text.

``EdgeMesh.generate`` is the one place a request crosses the mesh; the HTTP layer
(app.py) only formats what it yields. Text comes out of the same detokenizer and
stop-string matcher whether the client streams or not.

What a request is billed (``Tally``, published by api.py as one UsageEvent):

| how it ended                              | status    | prompt / cached / completion tokens                    |
|-------------------------------------------|-----------|--------------------------------------------------------|
| finished (end message or stop string)     | finished  | the prompt / cached* / what the client was told         |
| the client left, after tokens or before   | cancelled | the engine's counts from its abort end message (drained |
| the first (once a worker had the request) |           | for abort_drain_timeout_s; none in time: what was seen  |
|                                           |           | after tokens, nothing before the first)                 |
| the worker failed after tokens            | failed    | the prompt / cached* / the tokens the client got        |
| every attempt failed before its first token| (none)   | not billed                                              |
| this edge died                            | cancelled | billed by another edge from the worker's orphan report  |

*Remote prefill: the prompt is billed once, as computed by the prefill worker; cached tokens are the
prefill worker's cache hits, and the KV the decode worker pulled is neither billed again nor counted
as cached. A client that leaves during the remote prefill is billed its prompt from the prefill's end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator

import msgspec

from shared import errors
from services.edge.admission import AdmissionClient
from services.edge.config import EdgeConfig
from services.edge.keys import KeyDirectory
from services.edge.text import IncrementalDetokenizer, StopStringMatcher
from services.edge.tokenizer import ModelTokenizer
from shared.breakers import BreakerView
from shared.bus import Bus, BusError, StreamReceiver, TokenStream
from shared.prefix_hash import prompt_hashes
from services.edge.orphans import OrphanBiller, sign
from shared.edges import edge_registration
from shared.liveness import Registration, ping
from shared.registry import WorkerDirectory
from shared.usage import UsagePublisher, ensure_usage_stream
from shared.schema import (
    AbortRequest, BillingContext, GenerateRequest, Outcome, RouteDecision, RouteReply, RouteRequest,
    SamplingParams, SignedBilling, StreamEnd, StreamError, TokenChunk, WorkerInfo,
)

log = logging.getLogger("infermesh.edge")


def _settle(tally: Tally, status: str, done: "Finished") -> None:
    tally.status, tally.finish_reason = status, done.finish_reason
    tally.cached_tokens, tally.completion_tokens = done.num_cached_tokens, done.num_completion_tokens


def _cached(prefill_cached: int | None, decode_cached: int) -> int:
    """Prompt tokens served from cache: the prefill worker's count when it computed the prompt."""
    return decode_cached if prefill_cached is None else prefill_cached


@dataclass(slots=True)
class Finished:
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_completion_tokens: int
    worker_id: str


@dataclass(slots=True)
class Tally:
    """What one request consumed, as the mesh learns it: the billed attempt's counts (the usage event).

    ``status`` becomes finished, failed (after tokens) or cancelled (the client left after tokens);
    it stays "" when nothing is billable (every attempt failed before its first token, or the client
    left before a worker reported computing anything). A cancelled attempt's final counts come from
    the worker's end message after the abort: ``draining`` is set while the edge waits for it."""

    attempt: int = 0
    worker_id: str = ""
    prefill_worker_id: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_ms: float = 0.0
    finish_reason: str = ""
    status: str = ""
    draining: "asyncio.Future[None] | None" = None
    billing: BillingContext | None = None  # who pays (attempt and workers filled in per attempt), signed for workers


class StreamBroken(Exception):
    """The worker failed after tokens reached the client: the response cannot be completed."""


class _WorkerFailedEarly(Exception):
    """The worker failed before the first token: the request may run elsewhere."""

    def __init__(self, error: errors.ApiError, worker_id: str) -> None:
        super().__init__(error.message)
        self.error, self.worker_id = error, worker_id


SERVED_MEMORY_S = 600.0  # a model served this recently is unavailable (503), not unknown (404), without workers
RETRYABLE = ("worker_unavailable", "worker_shutdown", "stream_gap", "timeout", "engine_error", "bad_message")


@dataclass(frozen=True, slots=True)
class RouteHints:
    """What a request tells the router beyond its prompt."""

    session_id: str | None = None  # X-Session-Id (or the ``user`` field when so configured)
    cache_salt: str | None = None  # the tenant's prefix-cache salt: no cache sharing across salts


class EdgeMesh:
    def __init__(self, config: EdgeConfig, bus: Bus, edge_id: str) -> None:
        self.config = config
        self.bus = bus
        self.directory = WorkerDirectory(bus)
        self.receiver = StreamReceiver(bus, edge_id)
        self.breakers = BreakerView(bus)
        self.admission = AdmissionClient(bus, edge_id) if config.admission else None
        static = {config.dev_key: "default"} if config.dev_key else {}
        self.keys = KeyDirectory(bus, {**static, **config.team_keys()})
        self.usage = UsagePublisher(bus)
        self.edge_id = edge_id
        self._secret = config.edge_secret.encode()
        self.orphans = OrphanBiller(bus, self._secret, self.usage) if self._secret else None
        self.registration: Registration | None = None
        self._tokenizers: dict[str, ModelTokenizer] = {}
        self._loading: dict[str, asyncio.Task[ModelTokenizer]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._served: dict[str, float] = {}  # model -> when a live worker last served it (monotonic)

    async def start(self) -> None:
        self.directory.on_added.append(self._on_worker_added)
        self.directory.on_removed.append(self._on_worker_removed)
        self.directory.on_restarted.append(self._on_worker_restarted)
        await self.receiver.start()
        await self.breakers.start()
        await ensure_usage_stream(self.bus)
        await self.keys.start()
        if self.admission is not None:
            await self.admission.start()
        await self.directory.start()
        for info in self.directory.live():
            self._on_worker_added(info)
        if self.orphans is not None:
            await self.orphans.start()
        else:
            log.warning("no edge secret (INFERMESH_EDGE_SECRET): requests of this edge go unbilled if it dies")
        self.registration = await edge_registration(self.bus, self.edge_id, self.config.edge_heartbeat_s,
                                                    self.config.edge_ttl_s)

    async def stop(self) -> None:
        """The edges key goes last: workers abort what this edge still had running once it is gone."""
        if self.orphans is not None:
            await self.orphans.stop()
        await self.receiver.stop()
        if self.admission is not None:
            await self.admission.stop()
        await self.breakers.stop()
        await self.keys.stop()
        await self.directory.stop()
        if self.registration is not None:
            await self.registration.stop()

    # ------------------------------------------------------------ models and tokenizers
    def model_info(self, model: str) -> WorkerInfo | None:
        """A live worker's info for ``model``; a model with none right now but served before raises 503."""
        info = self.directory.models().get(model)
        if info is not None:
            self._served[model] = time.monotonic()
        elif self.was_served(model):
            # its workers are away (restarting, or the registry is being re-read after a NATS restart): it exists
            raise errors.service_unavailable(f"No worker serves `{model}` right now; retry.", "no_capacity", 2)
        return info

    def is_ready(self) -> bool:
        return self.bus.nc.is_connected and any(w.tokenizer in self._tokenizers for w in self.directory.live())

    async def tokenizer(self, info: WorkerInfo) -> ModelTokenizer:
        loaded = self._tokenizers.get(info.tokenizer)
        if loaded is not None:
            return loaded
        task = self._loading.get(info.tokenizer)
        if task is None:
            task = asyncio.create_task(asyncio.to_thread(ModelTokenizer, info.tokenizer))
            self._loading[info.tokenizer] = task
        try:
            # shielded: the load is shared, and a waiter that is cancelled (its client left) would cancel it for
            # every other waiter, and for good (a cancelled task stayed in _loading: the edge never became ready)
            loaded = await asyncio.shield(task)
        except Exception as exc:
            self._loading.pop(info.tokenizer, None)
            raise errors.service_unavailable(f"cannot load the tokenizer of {info.model!r}: {exc}") from exc
        self._tokenizers[info.tokenizer] = loaded
        return loaded

    def was_served(self, model: str) -> bool:
        """A live worker served ``model`` within SERVED_MEMORY_S: without one now it is away, not unknown."""
        return time.monotonic() - self._served.get(model, -SERVED_MEMORY_S) < SERVED_MEMORY_S

    def _on_worker_added(self, info: WorkerInfo) -> None:
        self._served[info.model] = time.monotonic()
        if info.tokenizer and info.tokenizer not in self._tokenizers:
            self._spawn(self._preload(info))

    async def _preload(self, info: WorkerInfo) -> None:
        try:
            await self.tokenizer(info)
        except errors.ApiError as exc:
            log.error("%s", exc.message)

    def _on_worker_removed(self, worker_id: str) -> None:
        if self.receiver.num_open(worker_id):
            self._spawn(self._fail_streams_if_gone(worker_id))

    def _on_worker_restarted(self, worker_id: str) -> None:
        """A new incarnation answers pings under the old id: the streams of the old one fail at once."""
        failed = self.receiver.fail_worker(worker_id, "worker_unavailable", f"worker {worker_id} restarted")
        if failed:
            log.warning("worker %s restarted with %d streams open", worker_id, failed)

    async def _fail_streams_if_gone(self, worker_id: str) -> None:
        """A registry lapse is not proof of death (NATS can be slow to take a heartbeat on a starved machine):
        ask the worker's liveness thread first, and fail its streams only if it does not answer."""
        pong = await ping(self.bus, worker_id, self.config.liveness_probe_timeout_s)
        if pong is not None:
            log.warning("worker %s lapsed from the registry but answers (its loop ran %.1fs ago): keeping its %d "
                        "streams", worker_id, pong.loop_lag_s, self.receiver.num_open(worker_id))
            return
        failed = self.receiver.fail_worker(worker_id, "worker_unavailable", f"worker {worker_id} left the mesh")
        if failed:
            log.warning("worker %s vanished with %d streams open", worker_id, failed)

    def _spawn(self, coro: object) -> None:
        task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------ one request
    def route_request(self, request_id: str, model: str, prompt_token_ids: list[int],
                      hints: RouteHints = RouteHints()) -> RouteRequest:
        """What the router is asked: the prompt's block hashes are computed here, once per request."""
        block_size = self.config.route_block_size
        hashes = prompt_hashes(prompt_token_ids, model, None, hints.cache_salt, block_size) if block_size else []
        return RouteRequest(request_id, model, len(prompt_token_ids), hints.session_id, [], hashes,
                            block_size if hashes else 0)

    async def route(self, request: RouteRequest) -> RouteDecision:
        try:
            reply = await self.bus.request(self.bus.subjects.route, request, RouteReply,
                                           timeout=self.config.route_timeout_s)
        except BusError as first:  # a replica that died with the request: the queue group has others
            log.warning("route %s: %s; asking again", request.request_id, first)
            try:
                reply = await self.bus.request(self.bus.subjects.route, request, RouteReply,
                                               timeout=self.config.route_timeout_s)
            except BusError as exc:
                raise errors.service_unavailable(f"the router is unavailable: {exc}", "router_unavailable") from exc
        if isinstance(reply, RouteDecision):
            return reply
        if reply.code == "model_not_found":
            if not self.was_served(request.model):
                raise errors.model_not_found(request.model)
            raise errors.service_unavailable(f"No worker serves `{request.model}` right now; retry.", "no_capacity", 2)
        raise errors.service_unavailable(reply.message, reply.code)

    async def generate(
        self, request_id: str, model: str, prompt_token_ids: list[int], sampling: SamplingParams,
        tokenizer: ModelTokenizer, stop: list[str], hints: RouteHints = RouteHints(), tally: Tally | None = None,
    ) -> AsyncIterator[str | Finished]:
        """Yield text deltas, then one Finished. Raises ApiError before the first token, StreamBroken after.

        A worker that fails before the first token (gone, shutting down, silent) costs one retry on
        another worker, routed afresh without it (a session bound to it is re-pinned there); never
        a retry after tokens reached the client.
        """
        excluded: list[str] = []
        first_failure: _WorkerFailedEarly | None = None
        routing = self.route_request(request_id, model, prompt_token_ids, hints)
        for attempt in range(2):
            attempt_id = request_id if attempt == 0 else f"{request_id}-a{attempt}"  # a fresh stream subject
            try:
                async with aclosing(self._attempt(attempt_id, attempt, model, prompt_token_ids, sampling, tokenizer,
                                                  stop, hints, msgspec.structs.replace(
                                                      routing, request_id=attempt_id,
                                                      exclude_worker_ids=list(excluded)),
                                                  tally if tally is not None else Tally())) as items:
                    async for item in items:
                        yield item
                return
            except errors.ApiError as exc:
                if first_failure is not None and exc.code == "no_capacity":  # nowhere else to go
                    raise first_failure.error from None
                raise
            except _WorkerFailedEarly as failed:
                if attempt == 1:
                    raise failed.error from None
                first_failure = failed
                log.warning("request %s failed on %s before its first token (%s): retrying elsewhere", request_id,
                            failed.worker_id, failed.error.message)
                excluded.append(failed.worker_id)

    async def _attempt(
        self, request_id: str, attempt: int, model: str, prompt_token_ids: list[int], sampling: SamplingParams,
        tokenizer: ModelTokenizer, stop: list[str], hints: RouteHints, routing: RouteRequest, tally: Tally,
    ) -> AsyncIterator[str | Finished]:
        decision = await self.route(routing)
        if self.breakers.is_open(decision.worker_id):  # the router decided before it heard: no traffic there
            decision = await self.route(msgspec.structs.replace(
                routing, exclude_worker_ids=[*routing.exclude_worker_ids, decision.worker_id]))
        worker_id = decision.worker_id
        tally.attempt, tally.worker_id, tally.prefill_worker_id = attempt, worker_id, decision.prefill_worker_id
        tally.prompt_tokens = len(prompt_token_ids)
        kv_transfer, prefill_cached = None, None
        if decision.prefill_worker_id:
            prefilled = await self._remote_prefill(decision.prefill_worker_id, request_id, model, prompt_token_ids,
                                                   sampling, hints.cache_salt, tally)
            if prefilled is not None and prefilled.kv_transfer is not None:
                kv_transfer, prefill_cached = prefilled.kv_transfer, prefilled.num_cached_tokens
        stream = self.receiver.open(request_id, worker_id, self.config.first_token_timeout_s,
                                    self.config.inter_token_timeout_s)
        finished = failed = False
        sent_at, ttft_ms = time.monotonic(), 0.0
        num_output = 0
        try:
            await self.bus.publish(
                self.bus.subjects.worker_generate(worker_id),
                GenerateRequest(request_id, model, prompt_token_ids, sampling, attempt=attempt,
                                kv_transfer=kv_transfer, cache_salt=hints.cache_salt,
                                billing=self._signed(request_id, tally, prefill_cached)),
                reply=self.receiver.subject(request_id),
            )
            detokenizer = IncrementalDetokenizer(tokenizer)
            stopper = StopStringMatcher(stop)
            while True:
                message = await stream.next()
                if isinstance(message, TokenChunk):
                    if not num_output:
                        ttft_ms = tally.ttft_ms = 1000 * (time.monotonic() - sent_at)
                    num_output += len(message.token_ids)
                    tally.completion_tokens = num_output
                    text, hit = stopper.feed(detokenizer.push(message.token_ids))
                    if text:
                        yield text
                    if hit:
                        end = await self._abort_and_drain(stream)
                        finished = True
                        self._report(worker_id, request_id, True, "", ttft_ms)
                        done = Finished("stop", len(prompt_token_ids),
                                        _cached(prefill_cached, end.num_cached_tokens if end else 0), num_output,
                                        worker_id)
                        _settle(tally, "finished", done)
                        yield done
                        return
                elif isinstance(message, StreamEnd):
                    finished = True
                    self._report(worker_id, request_id, True, "", ttft_ms)
                    text, hit = stopper.feed(detokenizer.flush())
                    text += "" if hit else stopper.flush()
                    if text:
                        yield text
                    reason = "stop" if hit else message.finish_reason
                    done = Finished(reason, len(prompt_token_ids), _cached(prefill_cached, message.num_cached_tokens),
                                    num_output, worker_id)
                    _settle(tally, "finished", done)
                    yield done
                    return
                else:  # finished stays False: the abort is a no-op if the worker ended it, vital on a timeout
                    failed = True
                    if num_output:  # billed: the tokens the client got
                        tally.status, tally.finish_reason = "failed", message.code
                    if message.code != "bad_request":  # the client's fault, not the worker's
                        self._report(worker_id, request_id, False, message.code if not num_output else "broken")
                    if not num_output and message.code in RETRYABLE:
                        raise _WorkerFailedEarly(self._stream_error(message), worker_id)
                    self._raise_stream_error(message, num_output)
        finally:
            if not finished and not failed:  # the client left: bill what the engine computed and generated
                if num_output:  # billed even if the end message never comes
                    tally.status, tally.finish_reason = "cancelled", "abort"
                    tally.cached_tokens = prefill_cached or 0
                tally.draining = asyncio.get_running_loop().create_future()
                self._spawn(self._drain_cancelled(stream, tally, prefill_cached))
            else:
                if not finished:  # we failed: stop the engine; never await in a cancelled scope
                    self._spawn(self._abort(worker_id, request_id))
                self.receiver.close(request_id)

    def _signed(self, request_id: str, tally: Tally, prefill_cached: int | None) -> SignedBilling | None:
        """The attempt's billing context, signed for generate request ``request_id`` (None without a secret)."""
        if not self._secret or tally.billing is None:
            return None
        context = msgspec.structs.replace(tally.billing, attempt=tally.attempt, worker_id=tally.worker_id,
                                          prefill_worker_id=tally.prefill_worker_id,
                                          prefill_cached_tokens=prefill_cached)
        return sign(self._secret, request_id, context)

    async def _drain_cancelled(self, stream: TokenStream, tally: Tally, prefill_cached: int | None,
                               is_prefill: bool = False) -> None:
        """Abort a request its client left, and take its final counts from the worker's end message.

        Before the first token (``tally.status`` still ""), the end message decides: the prompt tokens
        the engine reports are billed, cancelled; no end message in time, nothing is. A remote prefill's
        one token was never the client's: it bills no completion tokens."""
        try:
            end = await self._abort_and_drain(stream)
            if end is not None:
                if not tally.status:
                    tally.status, tally.finish_reason = "cancelled", "abort"
                    tally.prompt_tokens = end.num_prompt_tokens
                if not is_prefill:
                    tally.completion_tokens = max(tally.completion_tokens, end.num_output_tokens)
                tally.cached_tokens = _cached(prefill_cached, end.num_cached_tokens)
        finally:
            self.receiver.close(stream.request_id)
            assert tally.draining is not None
            tally.draining.set_result(None)

    async def _remote_prefill(self, worker_id: str, request_id: str, model: str, prompt_token_ids: list[int],
                              sampling: SamplingParams, cache_salt: str | None, tally: Tally) -> StreamEnd | None:
        """Have a prefill worker compute the prompt's KV: its end message (with the KV handle), None on failure.

        A client that leaves meanwhile is billed the prompt the prefill worker reports computing."""
        prefill_id = f"{request_id}-prefill"  # no dots: the id ends a subject
        stream = self.receiver.open(prefill_id, worker_id, self.config.first_token_timeout_s,
                                    self.config.inter_token_timeout_s)
        done = False
        try:
            await self.bus.publish(
                self.bus.subjects.worker_generate(worker_id),
                GenerateRequest(prefill_id, model, prompt_token_ids, msgspec.structs.replace(sampling, max_tokens=1),
                                cache_salt=cache_salt, remote_decode=True,
                                billing=self._signed(prefill_id, tally, None)),
                reply=self.receiver.subject(prefill_id),
            )
            while True:
                message = await stream.next()
                if isinstance(message, StreamEnd):
                    done = True
                    self._report(worker_id, prefill_id, True)
                    if message.kv_transfer is None:
                        log.warning("prefill %s on %s ended %s without a KV handle: prefilling on the decoder",
                                    prefill_id, worker_id, message.finish_reason)
                    return message
                if isinstance(message, StreamError):
                    done = True
                    if message.code == "bad_request":
                        self._raise_stream_error(message, 0)
                    self._report(worker_id, prefill_id, False, message.code)
                    log.warning("prefill %s failed on %s (%s: %s): prefilling on the decoder", prefill_id,
                                worker_id, message.code, message.message)
                    return None
        finally:
            if not done:  # the client left (or the publish failed): drain the abort, bill what was computed
                tally.draining = asyncio.get_running_loop().create_future()
                self._spawn(self._drain_cancelled(stream, tally, None, is_prefill=True))
            else:
                self.receiver.close(prefill_id)

    def _raise_stream_error(self, error: StreamError, num_output: int) -> None:
        log.warning("request %s failed on %s: %s %s", error.request_id, error.source_id, error.code, error.message)
        if num_output:
            raise StreamBroken(f"{error.code}: {error.message}")
        raise self._stream_error(error)

    @staticmethod
    def _stream_error(error: StreamError) -> errors.ApiError:
        if error.code in RETRYABLE:
            return errors.service_unavailable(f"The worker failed: {error.message}", error.code)
        if error.code == "bad_request":
            return errors.invalid_request(error.message)
        return errors.engine_failed(f"The engine failed: {error.message}")

    def _report(self, worker_id: str, request_id: str, ok: bool, kind: str = "", ttft_ms: float = 0.0) -> None:
        """How an attempt went on a worker, for the breaker (fire and forget: never delays the client)."""
        self._spawn(self.bus.publish(self.bus.subjects.outcome(worker_id),
                                     Outcome(worker_id, request_id, ok, kind, ttft_ms, time.time())))

    async def _abort(self, worker_id: str, request_id: str) -> None:
        try:
            await self.bus.publish(self.bus.subjects.worker_abort(worker_id), AbortRequest(request_id))
        except Exception as exc:
            log.warning("abort of %s failed: %s", request_id, exc)

    async def _abort_and_drain(self, stream: TokenStream) -> StreamEnd | None:
        """Abort after a stop string; wait briefly for the worker's end message (cached-token count)."""
        await self._abort(stream.worker_id, stream.request_id)
        stream.deadline = min(stream.deadline, time.monotonic() + self.config.abort_drain_timeout_s)
        while True:
            message = await stream.next()
            if isinstance(message, StreamEnd):
                return message
            if isinstance(message, StreamError):
                return None
