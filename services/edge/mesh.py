"""The edge's side of the bus: route, send to the worker, turn its token stream into text.

``EdgeMesh.generate`` is the one place a request crosses the mesh, and it is I/O only: the request's
life (attempts, retry, migration, stop strings, what it is billed) is ``attempt.RequestRun``, a pure
state machine; this module runs the actions it returns (route, send, abort, report, close) and feeds
it the router's answers and the stream's messages. The HTTP layer (api.py) formats what it yields:
text deltas, then one ``Usage``.

What a request is billed (``Usage``, published by api.py as one UsageEvent):

| how it ended                              | status    | prompt / cached / completion tokens                    |
|-------------------------------------------|-----------|--------------------------------------------------------|
| finished (end message or stop string)     | finished  | the prompt / cached* / what the client was told         |
| the client left, after tokens or before   | cancelled | the engine's counts from its abort end message (drained |
| the first (once a worker had the request) |           | for abort_drain_timeout_s; none in time: what was seen  |
|                                           |           | after tokens, nothing before the first)                 |
| the worker failed after tokens, and the   | failed    | the prompt / cached* / the tokens the client got        |
| stream could not migrate                  |           |                                                        |
| every attempt failed before its first token| (none)   | not billed                                              |
| this edge died                            | cancelled | billed by another edge from the worker's orphan report  |

A migrated stream is one request, billed as above across its workers; what they recomputed is
``migration_prefill_tokens`` (platform cost, not billed).

*Remote prefill: the prompt is billed once, as computed by the prefill worker; cached tokens are the
prefill worker's cache hits, and the KV the decode worker pulled is neither billed again nor counted
as cached. A client that leaves during the remote prefill is billed its prompt from the prefill's end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Iterable

import msgspec
from opentelemetry import trace

from services.edge import tracing
from services.edge.attempt import (
    TERMINAL,
    Abort,
    Action,
    Close,
    Emit,
    Fail,
    Finish,
    Limits,
    Report,
    RequestRun,
    Route,
    Send,
    Settle,
    StreamBroken,
    Usage,
)
from services.edge.config import EdgeConfig
from services.edge.deployments import Failover, Link, bus_in, deployments_of
from services.edge.errors import unavailable
from services.edge.keys import KeyDirectory
from services.edge.orphans import sign
from services.edge.text import IncrementalDetokenizer, StopStringMatcher
from services.edge.tokenizer import ModelTokenizer
from shared import errors
from shared.bus import Bus, BusError, TokenStream
from shared.deployments import DeploymentBreakers
from shared.liveness import Registration, ping
from shared.prefix_hash import PrefixHashes
from shared.schema import (
    AbortRequest,
    BillingContext,
    Outcome,
    RouteDecision,
    RouteReply,
    RouteRequest,
    SamplingParams,
    StreamError,
    WorkerInfo,
)
from shared.usage import UsagePublisher, ensure_usage_stream
from shared.usage_journal import UsageJournal

log = logging.getLogger("infermesh.edge")

SERVED_MEMORY_S = 600.0  # a model served this recently is unavailable (503), not unknown (404), without workers


@dataclass(frozen=True, slots=True)
class RouteHints:
    """What a request tells the router beyond its prompt."""

    session_id: str | None = None  # the trajectory (services/edge/sessions.py)
    cache_salt: str | None = None  # the tenant's prefix-cache salt: no cache sharing across salts
    team: str = ""  # whose session it is: the router keys session affinity by team and id
    cache_prefix_tokens: int = 0  # prompt tokens up to the client's last cache_control breakpoint (0: not known)


@dataclass(slots=True)
class _Wire:
    """One request's open streams, and the deployment each worker and stream of it is in."""

    streams: dict[str, TokenStream] = field(default_factory=dict)
    links: dict[str, Link] = field(default_factory=dict)  # worker id or stream id -> its deployment's link
    attempt_span: trace.Span = trace.INVALID_SPAN  # the current attempt's (ended when the next one starts)

    def next_attempt(self, run: RequestRun, excluded: list[str]) -> None:
        if excluded:  # the attempt before this one failed on its worker
            self.attempt_span.set_status(trace.Status(trace.StatusCode.ERROR, f"failed on {excluded[-1]}"))
        self.attempt_span.end()
        self.attempt_span = tracing.start_attempt(run.attempt.index, excluded, len(run.output))


class EdgeMesh:
    def __init__(self, config: EdgeConfig, bus: Bus, edge_id: str, journal: UsageJournal | None = None) -> None:
        self.config = config
        self.bus = bus
        self._prefix_hashes = PrefixHashes()  # an agent's next turn hashes only its new blocks
        static = {config.dev_key: "default"} if config.dev_key else {}
        self.keys = KeyDirectory(bus, {**static, **config.team_keys()})
        self.usage = UsagePublisher(bus, journal)  # every deployment's usage goes to the local stream: one ledger
        self.edge_id = edge_id
        self._secret = config.edge_secret.encode()
        self.deployments = deployments_of(config)
        self.links = [Link.build(d, bus if d is self.deployments.local else bus_in(bus, d.namespace), edge_id, config,
                                 self._secret, self.usage) for d in self.deployments.in_order()]
        self.local = self.links[0]
        self.directory, self.receiver = self.local.directory, self.local.receiver
        self.admission, self.orphans = self.local.admission, self.local.orphans
        self.failover = Failover(self.links, DeploymentBreakers(self.deployments))
        self._tokenizers: dict[str, ModelTokenizer] = {}
        self._loading: dict[str, asyncio.Task[ModelTokenizer]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._served: dict[str, float] = {}  # model -> when a live worker last served it (monotonic)

    @property
    def registration(self) -> Registration | None:
        return self.local.registration

    async def start(self) -> None:
        for link in self.links:
            link.directory.on_added.append(self._on_worker_added)
            link.directory.on_removed.append(lambda worker_id, link=link: self._on_worker_removed(link, worker_id))
            link.directory.on_restarted.append(lambda worker_id, link=link: self._on_worker_restarted(link, worker_id))
        await ensure_usage_stream(self.bus)
        await self.keys.start()
        for link in self.links:
            await link.start_streams()
            for info in link.directory.live():
                self._on_worker_added(info)
        if not self._secret:
            log.warning("no edge secret (INFERMESH_EDGE_SECRET): requests of this edge go unbilled if it dies")
        for link in self.links:
            await link.start_liveness(self.edge_id, self.config, lambda: self.usage.pending)
        self._spawn(self._probe_silent_workers())

    async def stop(self) -> None:
        """The edges keys go last: workers abort what this edge still had running once it is gone."""
        for task in list(self._background):
            task.cancel()
        await self.keys.stop()
        for link in reversed(self.links):
            await link.stop()

    # ------------------------------------------------------------ models and tokenizers
    def model_info(self, model: str) -> WorkerInfo | None:
        """A live worker's info for ``model`` (in any deployment, the local one first); a model with none right
        now but served before raises 503."""
        info = next((i for i in (link.directory.models().get(model) for link in self.links) if i is not None), None)
        if info is not None:
            self._served[model] = time.monotonic()
        elif self.was_served(model):
            # its workers are away (restarting, or the registry is being re-read after a NATS restart): it exists
            raise errors.service_unavailable(f"No worker serves `{model}` right now; retry.", "no_capacity", 2)
        return info

    def is_ready(self) -> bool:
        return self.bus.is_connected and any(w.tokenizer in self._tokenizers for link in self.links
                                                for w in link.directory.live())

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
            raise unavailable(f"The tokenizer of `{info.model}`", "service_unavailable", exc) from exc
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

    def _on_worker_removed(self, link: Link, worker_id: str) -> None:
        if link.receiver.num_open(worker_id):
            self._spawn(self._fail_streams_if_gone(link, worker_id))

    def _on_worker_restarted(self, link: Link, worker_id: str) -> None:
        """A new incarnation answers pings under the old id: the streams of the old one fail at once."""
        failed = link.receiver.fail_worker(worker_id, "worker_unavailable", f"worker {worker_id} restarted")
        if failed:
            log.warning("worker %s restarted with %d streams open", worker_id, failed)

    async def _fail_streams_if_gone(self, link: Link, worker_id: str) -> None:
        """A registry lapse is not proof of death (NATS can be slow to take a heartbeat on a starved machine):
        ask the worker's liveness thread first, and fail its streams only if it does not answer."""
        pong = await ping(link.bus, worker_id, self.config.liveness_probe_timeout_s)
        if pong is not None:
            log.warning("worker %s lapsed from the registry but answers (its loop ran %.1fs ago): keeping its %d "
                        "streams", worker_id, pong.loop_lag_s, link.receiver.num_open(worker_id))
            return
        failed = link.receiver.fail_worker(worker_id, "worker_unavailable", f"worker {worker_id} left the mesh")
        if failed:
            log.warning("worker %s vanished with %d streams open", worker_id, failed)

    async def _probe_silent_workers(self) -> None:
        """Ask each worker whose streams went silent (``silence_probe_s``) whether it lives, one probe at a time
        per worker: a frozen bus or a stopped worker fails them in seconds, not at the inter-token deadline."""
        probing: set[tuple[str, str]] = set()
        while True:
            await asyncio.sleep(self.config.silence_probe_s / 2)
            now = time.monotonic()
            for link in self.links:
                for worker_id in link.receiver.silent_workers(now, self.config.silence_probe_s):
                    key = (link.deployment.name, worker_id)
                    if key not in probing:
                        probing.add(key)
                        task = asyncio.get_running_loop().create_task(self._probe_silent(link, worker_id))
                        task.add_done_callback(lambda _done, key=key: probing.discard(key))

    async def _probe_silent(self, link: Link, worker_id: str) -> None:
        if await ping(link.bus, worker_id, self.config.liveness_probe_timeout_s) is not None:
            return  # alive (a long prefill, a slow step): its streams wait on their deadlines
        failed = link.receiver.fail_worker(worker_id, "worker_unavailable",
                                           f"worker {worker_id} went silent and did not answer a probe")
        if failed:
            log.warning("worker %s went silent and did not answer a probe: %d streams failed", worker_id, failed)

    def _spawn(self, coro: object) -> None:
        task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------ one request
    async def acquire(self, team: str, klass: str, model: str, prompt_tokens: int, max_tokens: int,
                      wait_s: float) -> tuple[Link, str] | None:
        """An admission lease (None without admission): the local deployment's, else the first other one's
        whose admission can serve ``model`` (one without a live worker of it, or unreachable, is skipped).
        With several deployments the first pass asks for room now, so a full local pool spills the request
        to a deployment with room; only when none has does it wait, in the first one's queue."""
        if self.admission is None:
            return None

        def ask(wait: float) -> Callable[[Link], Awaitable[str]]:
            async def lease(link: Link) -> str:
                if link.admission is None:
                    raise unavailable("Admission", "admission_unavailable", f"deployment {link.name} runs no admission")
                return await link.admission.acquire(team, klass, model, prompt_tokens, max_tokens, wait)
            return lease

        if len(self.links) > 1:
            try:
                link, lease_id = await self.failover.first_of(model, ask(0.0), spill=True)
                return link, lease_id  # type: ignore[return-value]
            except errors.PoolFull:
                pass  # no deployment has room now: queue in the first that can serve
        link, lease_id = await self.failover.first_of(model, ask(wait_s))
        return link, lease_id  # type: ignore[return-value]

    def new_run(self, request_id: str, model: str, prompt_token_ids: list[int], sampling: SamplingParams,
                tokenizer: ModelTokenizer, stop: list[str], billing: BillingContext,
                hints: RouteHints = RouteHints(), migrations: int | None = None) -> RequestRun:
        """A request's state machine; ``migrations`` (at most the edge's limit) caps its moves after tokens."""
        limit = self.config.max_migrations if migrations is None else min(migrations, self.config.max_migrations)
        return RequestRun(request_id, model, prompt_token_ids, sampling,
                          self.route_request(request_id, model, prompt_token_ids, hints),
                          IncrementalDetokenizer(tokenizer), StopStringMatcher(stop), billing, hints.cache_salt,
                          Limits(retries=self.config.max_retries, migrations=limit))

    def route_request(self, request_id: str, model: str, prompt_token_ids: list[int],
                      hints: RouteHints = RouteHints()) -> RouteRequest:
        """What the router is asked: the prompt's block hashes are computed here, once per request."""
        block_size = self.config.route_block_size
        hashes = self._prefix_hashes.hashes(prompt_token_ids, model, None, hints.cache_salt, block_size) \
            if block_size else []
        cache_blocks = min(hints.cache_prefix_tokens // block_size, len(hashes)) if hashes else 0
        return RouteRequest(request_id, model, len(prompt_token_ids), hints.session_id, [], hashes,
                            block_size if hashes else 0, hints.team, cache_blocks)

    async def route(self, bus: Bus, request: RouteRequest) -> RouteDecision:
        """One routing answer from ``bus``'s deployment (its router leaves out workers whose breaker is open);
        asked again only if the router replica died with the request."""
        try:
            reply = await bus.request(bus.subjects.route, request, RouteReply, timeout=self.config.route_timeout_s)
        except BusError as first:  # a replica that died with the request: the queue group has others
            log.warning("route %s: %s; asking again", request.request_id, first)
            try:
                reply = await bus.request(bus.subjects.route, request, RouteReply, timeout=self.config.route_timeout_s)
            except BusError as exc:
                raise unavailable("The router", "router_unavailable", exc) from exc
        if isinstance(reply, RouteDecision):
            return reply
        if reply.code == "model_not_found":
            if not self.was_served(request.model):
                raise errors.model_not_found(request.model)
            raise errors.service_unavailable(f"No worker serves `{request.model}` right now; retry.", "no_capacity", 2)
        raise errors.service_unavailable(reply.message, reply.code)

    async def generate(self, run: RequestRun,
                       on_settled: Callable[[Usage | None], None] = lambda _u: None) -> AsyncIterator[str | Usage]:
        """Yield text deltas, then the request's Usage; raises ApiError before the first token, StreamBroken
        after it (once the stream could not migrate). ``on_settled`` gets what is billed, once, however the
        request ends: when the client leaves, after the abort was drained in the background."""
        wire = _Wire()
        queue: deque[Action] = deque(run.start())
        try:
            while True:
                while queue:
                    action = queue.popleft()
                    if isinstance(action, Emit):
                        yield action.text
                    elif isinstance(action, Finish):
                        yield action.usage
                    elif isinstance(action, Fail):
                        if isinstance(action.error, StreamBroken):  # the client reads a stable text; we, why
                            log.warning("request %s broke after its first token: %s", run.request_id,
                                        action.error.detail)
                        raise action.error
                    else:
                        queue.extend(await self._run_action(run, action, wire, on_settled))
                if run.phase in TERMINAL:
                    return
                message = await wire.streams[run.stream_id].next()
                if isinstance(message, StreamError):
                    _keep_detail(run.request_id, message, wire.attempt_span)
                queue.extend(run.message(message, time.monotonic()))
        finally:
            self._wind_up(run, queue, wire, on_settled)

    def _wind_up(self, run: RequestRun, queue: Iterable[Action], wire: _Wire,
                 on_settled: Callable[[Usage | None], None]) -> None:
        """The generator ended (or was closed): what is queued still happens; a live request is cancelled."""
        rest = [a for a in queue if not isinstance(a, (Emit, Finish, Fail))]
        wire.attempt_span.end()
        if run.phase not in TERMINAL:
            rest += run.client_left()
        if rest or wire.streams:
            self._spawn(self._drain(run, rest, wire, on_settled))

    async def _drain(self, run: RequestRun, actions: list[Action], wire: _Wire,
                     on_settled: Callable[[Usage | None], None]) -> None:
        """In the background: run what is left, and read a cancelled request's abort to its end message."""
        queue = deque(actions)
        try:
            while True:
                while queue:
                    action = queue.popleft()
                    if not isinstance(action, (Emit, Finish, Fail)):
                        queue.extend(await self._run_action(run, action, wire, on_settled))
                if run.settled or run.stream_id not in wire.streams:
                    return
                queue.extend(run.message(await wire.streams[run.stream_id].next(), time.monotonic()))
        finally:
            for stream_id, stream in list(wire.streams.items()):
                wire.links[stream_id].receiver.close(stream_id, stream)
            if not run.settled:
                on_settled(run.usage)

    async def _run_action(self, run: RequestRun, action: Action, wire: _Wire,
                          on_settled: Callable[[Usage | None], None]) -> list[Action]:
        """Do one action; what the machine answers to its result comes back."""
        if isinstance(action, Route):
            if action.request.exclude_worker_ids:
                log.warning("request %s failed on %s (%s tokens sent): %s elsewhere", run.request_id,
                            action.request.exclude_worker_ids[-1], len(run.output),
                            "migrating" if run.output else "retrying")
            wire.next_attempt(run, action.request.exclude_worker_ids)
            asked = time.monotonic()
            try:
                with tracing.current(wire.attempt_span):
                    link, decision = await self.failover.route(action.request, self.route, run.lease_deployment)
            except errors.ApiError as exc:
                wire.attempt_span.set_status(trace.Status(trace.StatusCode.ERROR, exc.message))
                return run.route_failed(exc)
            finally:
                run.route_s += time.monotonic() - asked
            wire.attempt_span.set_attributes({"infermesh.worker_id": decision.worker_id,
                                              "infermesh.prefill_worker_id": decision.prefill_worker_id,
                                              "infermesh.deployment": link.name})
            wire.links[decision.worker_id] = wire.links[decision.prefill_worker_id] = link
            return run.routed(decision, time.monotonic(), link.name)
        if isinstance(action, Send):
            with tracing.current(wire.attempt_span):
                await self._send(action, wire)
        elif isinstance(action, Report):
            self._report(wire.links[action.worker_id].bus, action)
        elif isinstance(action, Abort):
            bus = wire.links[action.worker_id].bus
            self._spawn(self._abort(bus, action.worker_id, action.stream_id, action.superseded))
            stream = wire.streams.get(action.stream_id)
            if action.drain and stream is not None:  # its end message (final counts) is awaited shortly
                stream.deadline = min(stream.deadline, time.monotonic() + self.config.abort_drain_timeout_s)
        elif isinstance(action, Close):
            stream = wire.streams.pop(action.stream_id, None)
            link = wire.links.get(action.stream_id)
            if link is not None and stream is not None:  # only this run's stream (another may reuse its id)
                link.receiver.close(action.stream_id, stream)
        elif isinstance(action, Settle):
            on_settled(action.usage)
        return []

    async def _send(self, action: Send, wire: _Wire) -> None:
        request = action.request
        stream_id = request.request_id
        link = wire.links[stream_id] = wire.links[action.worker_id]
        wire.streams[stream_id] = link.receiver.open(stream_id, action.worker_id, self.config.first_token_timeout_s,
                                                     self.config.inter_token_timeout_s)
        signed = sign(self._secret, stream_id, action.billing) if self._secret else None
        await link.bus.publish(link.bus.subjects.worker_generate(action.worker_id),
                               msgspec.structs.replace(request, billing=signed),
                               reply=link.receiver.subject(stream_id))

    def _report(self, bus: Bus, report: Report) -> None:
        """How an attempt went on a worker, for its breaker (fire and forget: never delays the client)."""
        self._spawn(bus.publish(bus.subjects.outcome(report.worker_id),
                                Outcome(report.worker_id, report.stream_id, report.ok, report.kind, report.ttft_ms,
                                        time.time())))

    async def _abort(self, bus: Bus, worker_id: str, request_id: str, superseded: bool = False) -> None:
        try:
            await bus.publish(bus.subjects.worker_abort(worker_id), AbortRequest(request_id, superseded))
        except Exception as exc:
            log.warning("abort of %s failed: %s", request_id, exc)


def _keep_detail(request_id: str, error: StreamError, span: trace.Span) -> None:
    """A stream error's detail (worker ids, the engine's exception text) for the operators, in the log and on the
    attempt's span: the client is told a stable text naming the request id (errors.py)."""
    log.warning("request %s: stream %s from %s failed: %s: %s", request_id, error.request_id, error.source_id,
                error.code, error.message)
    span.add_event("infermesh.stream_error", {"infermesh.error_code": error.code,
                                              "infermesh.worker_id": error.source_id,
                                              "infermesh.error_detail": error.message})
