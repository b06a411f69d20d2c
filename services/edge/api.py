"""OpenAI endpoints on top of EdgeMesh: auth, validation, templating, response shapes, SSE.

The API key is checked by http.serve from the headers, before the body is read;
the body then goes through prep.py (inline, or in a worker process when it is big or
carries tool schemas not seen before). Streaming responses start only after the first token (or the first error)
arrived, so errors before any token get a proper HTTP status. A client that
disconnects cancels the request (see http.py), which aborts the engine request.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import msgspec
from opentelemetry import trace
from prometheus_client import CollectorRegistry

from services.edge import tracing
from services.edge.admission import CLASSES
from services.edge.attempt import RequestRun, StreamBroken, Usage
from services.edge.config import EdgeConfig
from services.edge.deployments import Link
from services.edge.http import HttpRequest, JsonReply, Reply, SseReply
from services.edge.keys import Caller
from services.edge.mesh import EdgeMesh, RouteHints
from services.edge.prep import Peek, Prepared, PrepJob, peek
from services.edge.prep_pool import PrepPool
from services.edge.reasoning import ReasoningParser
from services.edge.sessions import session_of
from services.edge.shapes import Shape
from services.edge.shapes.chat import ChatShape
from services.edge.tokenizer import ModelTokenizer
from services.edge.tools import ToolCallParser, ToolLimits, make_parser
from shared import bus_limits, errors, schema
from shared.metrics import GenAiServerMetrics
from shared.schema import BillingContext, LeaseRelease, RequestClass, SamplingParams, UsageEvent
from shared.telemetry import sampled_trace_id
from shared.usage import LEASE_SPENT_WAIT_S
from shared.usage_outbox import CheckpointClock

log = logging.getLogger("infermesh.edge")
_json = msgspec.json.Encoder()
ShapeFor = Callable[[str], Shape]  # a request id -> the shape of its response
JOURNAL_WAIT_S = 5.0  # the longest a response's last byte waits for its usage to be in the outbox


class EdgeApi:
    def __init__(self, config: EdgeConfig, mesh: EdgeMesh) -> None:
        self.config = config
        self.mesh = mesh
        self._billing: set[asyncio.Task[None]] = set()
        self.prep = PrepPool(config.prep_processes, config.inline_prep_bytes, config.prep_limits())
        self.limits = ToolLimits(config.max_tools, config.max_tools_bytes, config.max_schema_depth)
        self.metrics = CollectorRegistry()  # the edge service adds its counters (service.py)
        self.genai = GenAiServerMetrics(self.metrics)

    # ------------------------------------------------------------ auth
    def authenticate(self, authorization: str | None) -> Caller:
        """Who the bearer key (``Authorization`` header value) belongs to: no database on this path."""
        scheme, _, key = (authorization or "").partition(" ")
        caller = self.mesh.keys.caller(key.strip()) if scheme.lower() == "bearer" else None
        if caller is None:
            raise errors.invalid_api_key()
        return caller

    # ------------------------------------------------------------ endpoints
    def models(self, authorization: str | None) -> dict[str, Any]:
        self.authenticate(authorization)
        data = [
            {"id": name, "object": "model", "created": int(info.started_at), "owned_by": "infermesh",
             "max_model_len": info.max_model_len}
            for name, info in sorted(self.mesh.directory.models().items())
        ]
        return {"object": "list", "data": data}

    async def chat_completions(self, request: HttpRequest) -> Reply:
        return await self._handle(request, "chat")

    async def completions(self, request: HttpRequest) -> Reply:
        return await self._handle(request, "text")

    # ------------------------------------------------------------ shared flow
    async def _handle(self, request: HttpRequest, kind: str) -> Reply:
        """Peek at the model, prepare the request (inline or in a worker process: prep.py), serve it."""
        prepared, tokenizer = await self.prepare(request, kind)
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        parser = self.tool_parser(prepared)
        return await self.serve(request, kind, prepared, tokenizer, lambda request_id: ChatShape(
            kind, f"{prefix}-{request_id}", prepared.model, parser(request_id[:16]) if parser else None,
            prepared.include_usage, thinker(prepared)))

    async def prepare(self, request: HttpRequest, kind: str,
                      context: Callable[[Peek], Awaitable[bytes]] | None = None) -> tuple[Prepared, ModelTokenizer]:
        """``request``'s body of endpoint ``kind`` as a request ready to route, and its model's tokenizer; ApiError
        when it is not valid. ``context``: what prep.py prepends to the body (a stored conversation), read for
        what the body says of it once the body is known to name a model."""
        seen = peek(request.body)
        team = request.caller.team if request.caller is not None else ""  # its prep is limited and counted per team
        if seen is None:  # not even a model: decoding the body says what is wrong with it
            await self.prep.run(PrepJob(kind, request.body, None, team=team), None)  # type: ignore[arg-type]
            raise errors.invalid_request("The request body could not be read.")
        info, tokenizer = await self._model(seen.model)
        prefix = await context(seen) if context is not None else b""
        return await self.prep.run(self._job(kind, request.body, seen, info, prefix, team), tokenizer,
                                   seen.schema_key()), tokenizer

    def tool_parser(self, prepared: Prepared) -> Callable[[str], ToolCallParser] | None:
        """What reads tool calls out of the model's text (given a prefix for call ids), or None: no tools."""
        tools, fmt = prepared.tools, self.config.tool_format(prepared.model)
        return (lambda prefix: make_parser(fmt, tools.tools, prefix)) if tools else None

    def _job(self, kind: str, body: bytes, seen: Peek, info: Any, context: bytes = b"", team: str = "") -> PrepJob:
        return PrepJob(kind, body, info.tokenizer, info.max_model_len, self.config.tool_format(seen.model),  # type: ignore[arg-type]
                       self.config.tool_close_within, self.limits, context, self.config.reasoning_format(seen.model),
                       team)

    async def _model(self, model: str) -> tuple[Any, ModelTokenizer]:
        info = self.mesh.model_info(model)
        if info is None:
            raise errors.model_not_found(model)
        return info, await self.mesh.tokenizer(info)

    async def serve(self, request: HttpRequest, kind: str, prepared: Prepared, tokenizer: ModelTokenizer,
                    shape_for: ShapeFor) -> Reply:
        """Admit, route and run ``prepared``; its response (streamed or whole) in the shape ``shape_for`` makes."""
        model, stream, prompt_ids, params = prepared.model, prepared.stream, prepared.prompt_ids, prepared.params
        self._check_fits_bus(prompt_ids, tokenizer.vocab_size - 1, params, "prompt" if kind == "text" else "messages")
        arrived = time.time()
        caller: Caller = request.caller
        request_id = request.request_id or uuid.uuid4().hex  # its run's: streams, workers (a batch line's run's)
        billing_id = request.line_id or request_id  # what it is billed under: a batch line's every run, once
        hints = RouteHints(self._session_id(request, prepared), prepared.cache_salt, caller.team,
                           prepared.cache_prefix_tokens)
        span = tracing.start_request_span(kind, request.path, request.headers, billing_id, model, len(prompt_ids),
                                          stream, caller.team, hints.session_id)
        if request.line_id:  # the ledger's id on the span (as the batch line's); the run's beside it
            span.set_attribute("infermesh.run_id", request_id)
        klass = self._request_class(request)
        lease, timing = None, _Timing(arrived)
        if self.mesh.admission is not None:  # no lease, no request: 429 / 503 before anything is routed
            try:
                with tracing.child_span(span, "admission.acquire", trace.SpanKind.CLIENT,
                                        {"infermesh.request_class": klass}) as acquire_span:
                    try:
                        lease = await self.mesh.acquire(caller.team, klass, model, len(prompt_ids),
                                                        params.max_tokens, self.config.admission_wait_s)
                    except errors.ApiError as exc:
                        tracing.record_admission(acquire_span, exc.code or str(exc.status), "", arrived)
                        raise
                    tracing.record_admission(acquire_span, "granted", lease[0].name if lease else "", arrived)
            except errors.ApiError as exc:
                _fail(span, exc, request_id)
                raise
            timing.admitted = time.time()
        trace_id = _trace_id(span, request.headers)
        billing = BillingContext(request_id=billing_id, attempt=0, team=caller.team, key_prefix=caller.key_prefix,
                                 model=model, request_class=klass, worker_id="", trace_id=trace_id,
                                 created_at=arrived, batch_id=request.batch_id,
                                 run_id=request_id if request.line_id else "",
                                 trajectory=hints.session_id or "")  # signed per attempt: billed if we die
        run = self.mesh.new_run(request_id, model, prompt_ids, params, tokenizer, prepared.stop, billing, hints,
                                self._max_migrations(request))
        run.lease_deployment = lease[0].name if lease is not None else ""
        bill = _Bill(billing_id, caller, model, arrived, lease, asyncio.get_running_loop().create_future(),
                     run.usage_so_far, trace_id, request.batch_id, span=span, trajectory=hints.session_id or "",
                     run_id=billing.run_id,
                     entry=self.mesh.usage.open(), delivered=lambda: delivered_usage(run))
        events = tracing.in_span(_then(self._revocable(self.mesh.generate(run, bill.settle), klass, bill),
                                       lambda: self._spawn_bill(bill)), span)
        try:
            first = await events.__anext__()
            timing.first_token = time.time()
            bill.first_token_at = timing.first_token if isinstance(first, str) else 0.0
            span.add_event("first_token")
            span.set_attribute("http.response.status_code", 200)  # (a stream's status is sent with its first token)
        except errors.ApiError as exc:
            _fail(span, exc, request_id)
            raise
        except BaseException:
            span.end()
            raise
        shape = shape_for(billing_id)  # the response is named as it is billed (a batch line's: the line's id)
        headers = _trace_headers(request_id, span)
        if prepared.ignored_tools:  # built-in tools the mesh cannot run: left out of the prompt, and said so
            headers["x-infermesh-ignored-tools"] = ",".join(prepared.ignored_tools)
        if prepared.reasoning is not None:  # a reasoning model's: its thought's tokens counted at the end
            events = _thought_counted(events, shape, prepared, run.output)
        if stream:  # where the first token came from (a migration may move the rest elsewhere)
            return SseReply(self._sse_body(first, events, shape, span, bill),
                            {"x-infermesh-deployment": run.deployment or self.mesh.local.name, **headers})
        try:
            reply = await self._complete(first, events, shape, span, bill)
        except errors.ApiError as exc:  # failed mid-generation: the error names the request and its trace too
            exc.headers = {**headers, **exc.headers}
            raise
        timing.route_s = run.route_s
        reply.headers = {**(reply.headers or {}), **headers, "server-timing": timing.header()}
        return reply

    def _revocable(self, events: AsyncIterator[str | Usage], klass: str, bill: _Bill) -> AsyncIterator[str | Usage]:
        """A batch-class request's events (a batch line's: the class is granted, never claimed) end in 429
        ``preempted`` if admission revokes its lease; the batch service runs the line again, billed once."""
        if klass != "batch" or bill.lease is None or bill.lease[0].admission is None:
            return events
        link, lease_id = bill.lease
        revoked = asyncio.get_running_loop().create_future()
        link.admission.watch(lease_id, lambda: revoked.done() or revoked.set_result(None))
        return _until_revoked(events, revoked, bill, self.config.abort_drain_timeout_s + 1)

    def _spawn_bill(self, bill: _Bill) -> None:
        """Bill in the background: the client never waits for it, and a cancelled request is billed too."""
        task = asyncio.get_running_loop().create_task(self._bill(bill))
        self._billing.add(task)
        task.add_done_callback(self._billing.discard)

    async def _bill(self, bill: _Bill) -> None:
        """Publish the request's usage (if it is billable), then give its lease back with what it cost."""
        try:  # a cancelled request's final counts may still be on their way (its abort is drained)
            usage = await asyncio.wait_for(asyncio.shield(bill.settled), self.config.abort_drain_timeout_s + 5)
        except asyncio.TimeoutError:
            log.warning("request %s: no final counts after its cancellation; billing what was seen", bill.request_id)
            usage = bill.seen()
        try:
            with tracing.child_span(bill.span, "usage.publish", trace.SpanKind.PRODUCER) as span:
                await self._publish_usage(bill, usage, span)
        finally:
            bill.journaled.set()

    def _usage_event(self, bill: _Bill, usage: Usage) -> UsageEvent:
        return UsageEvent(
            bill.request_id, usage.attempt, bill.caller.team, bill.caller.key_prefix, bill.model,
            usage.status, usage.finish_reason, usage.prompt_tokens, usage.cached_tokens,  # type: ignore[arg-type]
            usage.completion_tokens, round(usage.ttft_ms, 3), round(1000 * (time.time() - bill.arrived), 3),
            usage.worker_id, usage.prefill_worker_id, bill.trace_id, bill.arrived, usage.migrations,
            usage.migration_prefill_tokens, usage.deployment or self.mesh.local.name, bill.batch_id, bill.trajectory,
            bill.run_id)

    def _checkpoint(self, bill: _Bill) -> None:
        """A running stream's delivered usage into the outbox (at its first token, then every 0.5 s): what the
        next edge of this slot bills were this one to die before the stream's end."""
        # (a batch line is billed once, at its end)
        if bill.delivered is not None and not bill.batch_id and bill.clock.due(time.monotonic()):
            self.mesh.usage.checkpoint(bill.entry, self._usage_event(bill, bill.delivered()))

    async def _publish_usage(self, bill: _Bill, usage: Usage | None, span: trace.Span | None) -> None:
        seq, outbox = 0, self.mesh.usage
        if usage is not None and bill.billable:
            event = self._usage_event(bill, usage)
            await outbox.record(bill.entry, event)  # durable before the response's last byte (see _sse_body)
            bill.journaled.set()
            publishing = outbox.submit(bill.entry, event)  # retried until JetStream has it: never dropped
            try:  # the lease waits this long for the usage's sequence (its budget hold becomes what it cost)
                seq = await asyncio.wait_for(asyncio.shield(publishing), LEASE_SPENT_WAIT_S)
            except asyncio.TimeoutError:
                log.warning("request %s: its usage is not in the stream yet; its lease goes back without it",
                            bill.request_id)
        else:
            outbox.discard(bill.entry)
        if span is not None:
            span.set_attributes({"infermesh.usage_seq": seq, "infermesh.billed": bool(seq)})
        if usage is not None and usage.status == "finished":  # GenAI server metrics: from the request's arrival
            self.genai.observe((bill.model, bill.caller.team), (bill.ended_at or time.time()) - bill.arrived,
                               bill.first_token_at - bill.arrived if bill.first_token_at else None,
                               usage.completion_tokens, sampled_trace_id(bill.span))
        if bill.lease is not None and bill.lease[0].admission is not None:
            link, lease_id = bill.lease
            spent = None
            if usage is not None and seq:  # the lease's budget hold becomes what the request cost
                spent = LeaseRelease(lease_id, seq, usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens)
            link.admission.release(lease_id, spent)

    async def drain_billing(self, timeout_s: float = 10.0) -> None:
        """Wait for the usage of finished requests to be published (a clean stop loses none)."""
        if self._billing:
            await asyncio.wait(list(self._billing), timeout=timeout_s)

    def _check_fits_bus(self, prompt_ids: list[int], max_id: int, params: SamplingParams, param: str) -> None:
        """A prompt whose generate request would exceed the bus's ``max_payload`` is a 400 before it takes a lease
        (it could never be sent to a worker). ``max_id``: the vocabulary's largest id (a bound, known at once)."""
        limit = self.mesh.bus.nc.max_payload
        need = bus_limits.generate_request_bytes(len(prompt_ids), max_id, len(schema.encode(params)))
        if need > limit:
            raise errors.prompt_too_large_for_bus(len(prompt_ids), need, limit, param)

    @staticmethod
    def _request_class(request: HttpRequest) -> RequestClass:
        """The class admission gives the request: granted, never claimed. ``batch`` (idle capacity only, preempted
        for interactive traffic) is the batch service's lines' (they carry their job); a client's
        ``X-Request-Class`` only labels its request, which runs (and is billed) as interactive."""
        asked = request.headers.get("x-request-class", "interactive")
        if asked not in CLASSES:
            raise errors.invalid_request(f"X-Request-Class must be one of {', '.join(CLASSES)}.", "X-Request-Class")
        return "batch" if request.batch_id else "interactive"

    @staticmethod
    def _max_migrations(request: HttpRequest) -> int | None:
        """``X-Infermesh-Max-Migrations``: how often this request's stream may move to another worker after its
        worker failed (0: never; at most the edge's ``max_migrations``; absent: the edge's)."""
        value = request.headers.get("x-infermesh-max-migrations")
        if value is None:
            return None
        if not value.isdigit() or len(value) > 3:
            raise errors.invalid_request("X-Infermesh-Max-Migrations must be a whole number from 0 to 999.",
                                         "X-Infermesh-Max-Migrations")
        return int(value)

    def _session_id(self, request: HttpRequest, body: Prepared) -> str | None:
        """The trajectory the request belongs to (services/edge/sessions.py: the harnesses' headers,
        ``prompt_cache_key``, ``metadata.user_id``; ``user`` when so configured)."""
        session = session_of(request.headers, body.prompt_cache_key, body.user, self.config.session_from_user)
        return session.id if session else None

    async def _complete(self, first: str | Usage, events: AsyncIterator[str | Usage], shape: Shape,
                        span: trace.Span, bill: _Bill) -> JsonReply:
        parts: list[str] = []
        item = first
        try:
            while not isinstance(item, Usage):
                parts.append(item)
                item = await events.__anext__()
            _record(span, shape.id, item)
        except StreamBroken as exc:
            failed = errors.engine_failed(str(exc))  # a stable text: mesh.py logged the detail
            _failed(span, failed)
            raise failed from exc
        finally:
            await events.aclose()
            span.end()
        await bill.wait_journaled()
        return JsonReply(200, _json.encode(await shape.full(parts, item)),
                         {"x-infermesh-deployment": item.deployment or self.mesh.local.name})

    async def _sse_body(self, first: str | Usage, events: AsyncIterator[str | Usage], shape: Shape,
                        span: trace.Span, bill: _Bill) -> AsyncIterator[bytes]:
        """SSE events; the opening ones ride with the first text and the closing ones together (fewer writes)."""
        head, tail = shape.opening(), b""
        try:
            item = first
            while not isinstance(item, Usage):
                out = shape.text(item)
                if out:
                    yield head + out
                    head = b""
                    self._checkpoint(bill)
                item = await events.__anext__()
            _record(span, shape.id, item)
            await events.aclose()  # billed and its lease released now, not after the closing (it may store)
            tail = await shape.closing(item)
        except StreamBroken as exc:
            failed = errors.engine_failed(str(exc))  # a stable text: mesh.py logged the detail
            _failed(span, failed, sent=200)
            tail = shape.failed(failed)
        except errors.ApiError as exc:  # preempted mid-stream (a batch-class stream whose lease was revoked)
            _failed(span, exc, sent=200)
            tail = shape.failed(exc)
        finally:
            await events.aclose()
            span.end()
        await bill.wait_journaled()  # the usage outbox has the final usage before the last byte goes
        yield head + tail


def thinker(prepared: Prepared) -> ReasoningParser | None:
    """What separates a reasoning model's thought in the response (None: the model does not think)."""
    return prepared.reasoning.parser() if prepared.reasoning is not None else None


async def _thought_counted(events: AsyncIterator[str | Usage], shape: Shape, prepared: Prepared,
                           output: list[int]) -> AsyncIterator[str | Usage]:
    """``events``; once the run ended (its usage), the shape's thought parser learns how many of the run's output
    tokens the thought took (usage's ``reasoning_tokens``), counted on the tokens themselves."""
    thought = getattr(getattr(shape, "output", None), "thinker", None)
    async with aclosing(events) as inner:  # type: ignore[type-var]
        async for item in inner:
            if isinstance(item, Usage) and thought is not None and prepared.reasoning is not None:
                thought.tokens = prepared.reasoning.count(output)
            yield item


async def _until_revoked(events: AsyncIterator[str | Usage], revoked: "asyncio.Future[None]", bill: _Bill,
                         drain_s: float) -> AsyncIterator[str | Usage]:
    """``events`` until ``revoked`` resolves: then the run is wound up as if its client left (its worker aborts,
    freeing the KV at once), the bill is marked preempted, and once the abort has drained (at most ``drain_s``:
    its final counts settle it, and the capacity is free before the batch service sends the line again, as a new
    run with its own id) 429 ``preempted`` is raised."""
    async with aclosing(events) as inner:  # type: ignore[type-var]
        while True:
            step = asyncio.ensure_future(inner.__anext__())
            try:
                await asyncio.wait((step, revoked), return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not step.done():  # revoked, or this request cancelled: the run winds up before we go on
                    step.cancel()
                    await asyncio.wait((step,))
            if step.cancelled():
                bill.preempted = True
                await asyncio.wait((bill.settled,), timeout=drain_s)
                raise errors.preempted()
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            yield item


async def _then(events: AsyncIterator[str | Usage], done: Callable[[], None]) -> AsyncIterator[str | Usage]:
    """The request's events, then ``done()`` however they end: finished, failed, or the client left."""
    try:
        async with aclosing(events) as inner:  # type: ignore[type-var]
            async for item in inner:
                yield item
    finally:
        done()


@dataclass(slots=True)
class _Bill:
    """What billing a request needs once it ended."""

    request_id: str
    caller: Caller
    model: str
    arrived: float
    lease: "tuple[Link, str] | None"  # the deployment that granted the lease, and the lease
    settled: "asyncio.Future[Usage | None]"  # what the request is billed, once its run settled it
    seen: Callable[[], Usage | None]  # what was seen so far, if it never settles in time
    trace_id: str
    batch_id: str = ""  # a batch line's job: billed at the batch price
    preempted: bool = False  # admission revoked its lease before it ended: a batch line's run is not billed (the
    # line runs again, billed once); any other request is billed what it was delivered
    span: trace.Span = trace.INVALID_SPAN  # the request's SERVER span (its billing is a child)
    first_token_at: float = 0.0  # when its first token reached the edge (0: none did)
    ended_at: float = 0.0  # when its run settled
    trajectory: str = ""  # the agent run it belongs to (services/edge/sessions.py)
    run_id: str = ""  # a batch line's run (its usage's dedupe id names it): "" for any other request
    entry: int = 0  # its usage outbox entry (shared/usage_outbox.py)
    delivered: Callable[[], Usage] | None = None  # what a stream delivered so far (its outbox checkpoints)
    clock: CheckpointClock = field(default_factory=CheckpointClock)
    journaled: asyncio.Event = field(default_factory=asyncio.Event)  # its final usage is in the outbox (or none)

    @property
    def billable(self) -> bool:
        """Its usage is billed, but for a batch line's run that was preempted (the line runs again, billed once)."""
        return not (self.preempted and self.batch_id)

    def settle(self, usage: Usage | None) -> None:
        if not self.settled.done():
            self.ended_at = time.time()
            self.settled.set_result(usage)

    async def wait_journaled(self) -> None:
        """Until the final usage is durable in the outbox; a slow disk never holds a response for long."""
        try:
            await asyncio.wait_for(self.journaled.wait(), JOURNAL_WAIT_S)
        except asyncio.TimeoutError:
            log.error("request %s: its usage is not in the outbox after %.0f s; ending its response anyway",
                      self.request_id, JOURNAL_WAIT_S)


def delivered_usage(run: RequestRun) -> Usage:
    """A running stream's usage as if its client left now: its prompt and the tokens delivered so far."""
    a = run.attempt
    return Usage("cancelled", "abort", a.index, a.worker_id, a.prefill_worker_id, len(run.prompt_token_ids),
                 a.prefill_cached or 0, len(run.output), run.ttft_ms, run.migrations, run.migration_prefill_tokens,
                 run.deployment)


def _trace_id(span: trace.Span, headers: Any) -> str:
    """The request's trace id: its span's, else the caller's traceparent's (W3C), else none."""
    context = span.get_span_context()
    if context.is_valid:
        return format(context.trace_id, "032x")
    parts = (headers.get("traceparent") or "").split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else ""


def _record(span: trace.Span, response_id: str, done: Usage) -> None:
    tracing.record_usage(span, response_id, done.worker_id, done.deployment, done.finish_reason, done.prompt_tokens,
                         done.cached_tokens, done.completion_tokens, done.migrations)


def _failed(span: trace.Span, exc: errors.ApiError, sent: int | None = None) -> None:
    """Mark the request's span failed with ``exc`` (``sent``: the status a stream already sent, kept)."""
    span.set_status(trace.Status(trace.StatusCode.ERROR, exc.message))
    span.set_attributes({"http.response.status_code": sent or exc.status, "error.type": exc.code or exc.type})


def _fail(span: trace.Span, exc: errors.ApiError, request_id: str) -> None:
    """End the request's span with the error, and let the error response name the request and its trace."""
    _failed(span, exc)
    span.end()
    exc.headers = {**_trace_headers(request_id, span), **exc.headers}


def _trace_headers(request_id: str, span: trace.Span) -> dict[str, str]:
    """What every response carries back: its request id, and its trace (the SERVER span) where it is traced."""
    parent = tracing.traceparent(span)
    return {"x-request-id": request_id, "traceparent": parent} if parent else {"x-request-id": request_id}


@dataclass(slots=True)
class _Timing:
    """When a request passed each stage (wall clock), for ``Server-Timing`` on a whole response."""

    arrived: float
    admitted: float = 0.0
    first_token: float = 0.0
    route_s: float = 0.0

    def header(self) -> str:
        admitted = self.admitted or self.arrived
        parts = [("admission", admitted - self.arrived), ("routing", self.route_s),
                 ("first-token", (self.first_token or admitted) - self.arrived)]
        return ", ".join(f"{name};dur={1000 * seconds:.1f}" for name, seconds in parts)
