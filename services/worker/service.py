"""Wires one Engine to the bus: generate/abort/load subjects, registry heartbeats, load and KV events.

    edge --GenerateRequest(reply=stream subject)--> <ns>.worker.<id>.generate
    worker --TokenChunk* then StreamEnd|StreamError--> stream subject
    edge --AbortRequest--> <ns>.worker.<id>.abort

A request whose edge dies is aborted and reported on the orphans stream (``orphans.py``).

An engine that dies (``Engine.died``: its process killed, a crash, out of memory) is replaced in-process:

    engine died --> stop taking requests (unsubscribe generate: NATS answers no-responders, retryable)
                --> fail the running ones (worker_unavailable, retryable) --> leave the registry
                --> stop the dead engine, start a fresh one (``engine_restart.py``: at once, then backoff)
                --> a fresh KV log, a new ``started_at``, take requests, register again
    too many failures in a row --> ``fatal`` is set: the process exits 1 and its supervisor restarts it
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from nats.aio.msg import Msg
from opentelemetry.trace import Status, StatusCode

from services.worker import tracing
from services.worker.config import WorkerConfig
from services.worker.engine_restart import EngineRestartPolicy
from services.worker.engines import Engine, EngineRequestError, EngineSpec, create_engine
from services.worker.engines.base import ENGINE_PRIORITY, EngineDead, PromptTokens
from services.worker.kv_log import KvEventLog
from services.worker.metrics import worker_metrics
from services.worker.orphans import OrphanReaper
from shared import schema
from shared.bus import Bus, TokenStreamSender, is_reply_inbox
from shared.registry import WorkerRegistration
from shared.schema import (
    AbortRequest,
    GenerateRequest,
    KvReplayReply,
    KvReplayRequest,
    KvSnapshot,
    KvSnapshotRequest,
    LoadRequest,
    LoadSnapshot,
    WorkerInfo,
)
from shared.tasks import cancel_and_wait
from shared.telemetry import sampled_trace_id, traced

log = logging.getLogger("infermesh.worker")
SNAPSHOT_KEEP_S = 30.0  # how long a paged snapshot stays readable

NO_PROMPT_TOKENS = PromptTokens()  # engines that do not count where prompt tokens came from

class WorkerService:
    def __init__(self, config: WorkerConfig, bus: Bus, engine: Engine | None = None) -> None:
        self.config = config
        self.bus = bus
        self.worker_id = config.worker_id or f"w-{uuid.uuid4().hex[:8]}"
        self.engine = engine or create_engine(config.engine, **{**config.engine_options(), "worker_id": self.worker_id})
        self.spec: EngineSpec | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._background: list[asyncio.Task[None]] = []
        self._subs: list[object] = []
        self._registration: WorkerRegistration | None = None
        self.orphans = OrphanReaper(bus, self.worker_id, self.engine.abort, config.unseen_edge_grace_s,
                                    config.edge_probe_timeout_s)
        self._load_seq = 0
        self.kv_log = KvEventLog(self.worker_id)
        self._started_at = time.time()
        self._snapshots: dict[str, tuple[float, KvSnapshot]] = {}  # id -> (taken at, snapshot)
        self._num_finished = 0
        self._num_aborted = 0
        self._load_changed = asyncio.Event()
        # running requests' streams (failed at once if the engine dies)
        self._streams: dict[str, TokenStreamSender] = {}
        self._generate_sub: object | None = None
        self._kv_task: asyncio.Task[None] | None = None
        self._keeper: asyncio.Task[None] | None = None
        self.serving = False  # the engine is up and the worker takes requests
        self.restarts = EngineRestartPolicy(started_at=time.monotonic())
        self.fatal = asyncio.Event()  # the engine could not be restarted: the process should exit non-zero
        self.metrics, self._genai = worker_metrics(self)

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self.spec = await self.engine.start()
        await self.orphans.start()  # before the first request: each is tracked from its arrival
        s = self.bus.subjects
        self._subs = [
            await self.bus.subscribe(s.worker_abort(self.worker_id), AbortRequest, self._on_abort),
            await self.bus.subscribe(s.worker_load(self.worker_id), LoadRequest, self._on_load_request),
            await self.bus.subscribe(s.worker_kv_replay(self.worker_id), KvReplayRequest, self._on_kv_replay),
            await self.bus.subscribe(s.worker_kv_snapshot(self.worker_id), KvSnapshotRequest, self._on_kv_snapshot),
        ]
        self._background = [asyncio.create_task(self._publish_load_loop(), name="load")]
        await self._open()
        self._keeper = asyncio.create_task(self._keep_engine(), name="engine-keeper")
        log.info("worker %s serving %s (%s engine, role %s)", self.worker_id, self.spec.model, self.engine.name,
                 self.config.role)

    async def stop(self) -> None:
        if self._keeper is not None:  # first: a stop is no death, and never restarts the engine
            await cancel_and_wait(self._keeper)
        for sub in [*self._subs, *([self._generate_sub] if self._generate_sub else [])]:
            await sub.unsubscribe()  # type: ignore[attr-defined]
        if self._registration:
            await self._registration.stop()
        await self.orphans.stop()
        await cancel_and_wait(*self._tasks.values(), *self._background, self._kv_task)
        await self.engine.stop()

    # ------------------------------------------------------------ an engine that dies is replaced
    async def _open(self) -> None:
        """The engine is up: take requests, publish its KV events, join the registry (as a new incarnation)."""
        s = self.bus.subjects
        self.serving = True
        self._generate_sub = await self.bus.subscribe(s.worker_generate(self.worker_id), GenerateRequest,
                                                      self._on_generate)
        self._kv_task = asyncio.create_task(self._publish_kv_events_loop(), name="kv-events")
        self._registration = WorkerRegistration(self.bus, self._info, self.config.heartbeat_s,
                                                self.config.heartbeat_ttl_s,
                                                self.config.max_loop_stall_s)
        await self._registration.start()

    async def _keep_engine(self) -> None:
        """Wait for the engine to die; then close, start a fresh engine and open again, or give up."""
        try:
            while True:
                reason = await self.engine.died()
                next_start = self.restarts.died(time.monotonic())
                log.error("worker %s: the engine died (%s): failing %d requests, leaving the registry, restarting it",
                          self.worker_id, reason, len(self._tasks))
                await self._close(reason)
                if not await self._restart(next_start):
                    log.critical("worker %s: the engine could not be restarted (%d tries): exiting", self.worker_id,
                                 self.restarts.backoff.max_tries)
                    self.fatal.set()
                    return
                await self._open()
                log.info("worker %s serving again with a fresh engine (restart #%d)", self.worker_id,
                         self.restarts.restarts)
        except Exception:  # a recovery that broke half-way leaves a worker that serves nothing: a fresh process
            log.exception("worker %s: replacing the dead engine failed: exiting", self.worker_id)
            self.fatal.set()

    async def _close(self, reason: str) -> None:
        """Refuse new requests, fail the running ones (retryable), leave the registry."""
        self.serving = False
        if self._generate_sub is not None:
            await self._generate_sub.unsubscribe()  # type: ignore[attr-defined]
            self._generate_sub = None
            await self.bus.nc.flush()  # from now on a generate sent here gets no-responders at once
        message = f"worker {self.worker_id}'s engine died ({reason}); it is restarting"
        for stream in list(self._streams.values()):
            if not stream.closed:
                await stream.error("worker_unavailable", message)
        await cancel_and_wait(*self._tasks.values())
        if self._registration is not None:
            await self._registration.stop()  # routers drop it, edges and breakers see it leave
            self._registration = None
        if self._kv_task is not None:
            await cancel_and_wait(self._kv_task)
            self._kv_task = None

    async def _restart(self, next_start: float | None) -> bool:
        """Stop the dead engine and start a fresh one at ``next_start``, again on failure as the policy says."""
        while next_start is not None:
            await asyncio.sleep(max(0.0, next_start - time.monotonic()))  # a due time, not a poll
            try:
                await self.engine.stop()
                self.spec = await self.engine.start()
            except Exception:
                log.exception("worker %s: starting a fresh engine failed", self.worker_id)
                next_start = self.restarts.start_failed(time.monotonic())
                continue
            self.restarts.started(time.monotonic())
            self._started_at = time.time()  # a new incarnation: edges fail whatever they still hold of the old one
            self.kv_log = KvEventLog(self.worker_id)  # the fresh engine holds no blocks; routers load a snapshot
            return True
        return False

    def _info(self) -> WorkerInfo:
        assert self.spec is not None
        sp = self.spec
        return WorkerInfo(
            worker_id=self.worker_id, role=self.config.role, model=sp.model, engine=self.engine.name,  # type: ignore[arg-type]
            block_size=sp.block_size, num_kv_blocks=sp.num_kv_blocks, max_model_len=sp.max_model_len,
            tokenizer=sp.tokenizer, kv_dtype=sp.kv_dtype, max_num_seqs=sp.max_num_seqs, kv_layout=sp.kv_layout,
            kv_connector=sp.kv_connector, kv_endpoint=sp.kv_endpoint,
            heartbeat_ttl_s=self.config.heartbeat_ttl_s,
            started_at=self._started_at, ts=time.time(),
        )

    # ------------------------------------------------------------ handlers
    async def _on_generate(self, request: GenerateRequest, raw: Msg) -> None:
        if not (is_reply_inbox(raw.reply) or self.bus.subjects.edge_of_stream(raw.reply)):
            # a stream goes to an edge's stream subject or a requester's inbox, never elsewhere: NATS would let
            # this worker publish there under the reply exemption whatever its own permissions say
            log.warning("generate %s with reply subject %r: dropped", request.request_id, raw.reply)
            return
        stream = TokenStreamSender(self.bus, raw.reply, self.worker_id, request.request_id)
        if not self.serving:  # delivered before the unsubscribe took effect
            await stream.error("worker_unavailable", f"worker {self.worker_id}'s engine is restarting")
            return
        running = self._tasks.get(request.request_id)
        if running is not None and not running.done():  # engines key requests by id: a second would take the first's
            log.warning("generate %s while a request of that id runs here: refused", request.request_id)
            await stream.error("engine_error", f"a request with id {request.request_id} is already running")
            return
        task = asyncio.create_task(self._run(request, stream), name=f"gen-{request.request_id}")
        self._tasks[request.request_id] = task
        self._streams[request.request_id] = stream
        self.orphans.track(request.request_id, raw.reply)
        task.add_done_callback(lambda done, rid=request.request_id: self._forget(rid, done))
        self._load_changed.set()

    def _forget(self, request_id: str, task: asyncio.Task[None]) -> None:
        """``task`` ended: its entries go, unless a newer request of the same id took them (its callback runs
        after the task ended, and a generate may have come in between)."""
        if self._tasks.get(request_id) is not task:
            return
        del self._tasks[request_id]
        self._streams.pop(request_id, None)
        self.orphans.untrack(request_id)

    async def _run(self, request: GenerateRequest, stream: TokenStreamSender) -> None:
        with tracing.request_span(request, self.worker_id) as span:
            # a migrated request's counts include the tokens it came with (its output so far); its stream only new ones
            resumed = len(request.output_token_ids)
            num_output, received_at, ttft_ms = resumed, time.monotonic(), 0.0
            try:
                async for out in self.engine.generate(request.request_id, request.prompt_token_ids, request.sampling,
                                                      request.kv_transfer, request.cache_salt,
                                                      remote_decode=request.remote_decode,
                                                      output_token_ids=request.output_token_ids,
                                                      priority=ENGINE_PRIORITY[request.request_class]):
                    if out.token_ids and num_output == resumed:
                        ttft_ms = 1000 * (time.monotonic() - received_at)
                        span.add_event("first_token")
                    num_output += len(out.token_ids)
                    if out.token_ids:
                        await stream.tokens(out.token_ids)
                        await asyncio.sleep(0)  # a fast stream must not starve aborts and load requests
                    if out.finish_reason is None:
                        if request.request_id in self.orphans.orphaned:  # aborted before the engine had it
                            await self.engine.abort(request.request_id)
                        continue
                    num_prompt = out.num_prompt_tokens  # what the engine computed (0: it never ran the prompt)
                    await stream.end(out.finish_reason, num_prompt, out.num_cached_tokens, num_output,
                                     out.kv_transfer)
                    if request.request_id in self.orphans.orphaned:
                        await self.orphans.report(request, num_prompt, out.num_cached_tokens, num_output, ttft_ms)
                    else:
                        await self.orphans.ended(request, num_prompt, out.num_cached_tokens, num_output, ttft_ms,
                                                 out.finish_reason)
                    span.set_attributes({"infermesh.finish_reason": out.finish_reason,
                                         "infermesh.num_cached_tokens": out.num_cached_tokens,
                                         "infermesh.num_output_tokens": num_output})
                    span.add_event("finish", {"infermesh.finish_reason": out.finish_reason})
                    tracing.record_engine(span, out.timings)
                    self._genai.observe((request.model,), time.monotonic() - received_at,
                                        ttft_ms / 1000 if num_output > resumed else None, num_output - resumed,
                                        sampled_trace_id(span))
                    if out.finish_reason == "abort":
                        self._num_aborted += 1
                    else:
                        self._num_finished += 1
                    break
                if not stream.closed:
                    await stream.error("engine_error", "engine ended the request without a finish reason")
            except asyncio.CancelledError:
                await self.engine.abort(request.request_id)
                if not stream.closed:
                    await stream.error("worker_shutdown", f"worker {self.worker_id} is shutting down")
                raise
            except EngineRequestError as exc:
                if not stream.closed:
                    await stream.error("bad_request", str(exc))
            except EngineDead as exc:  # the keeper restarts the engine (Engine.died resolved with it)
                span.set_status(Status(StatusCode.ERROR, str(exc)))
                if not stream.closed:
                    await stream.error("worker_unavailable", f"worker {self.worker_id}: {exc}; it is restarting")
            except Exception as exc:
                log.exception("request %s failed", request.request_id)
                span.set_status(Status(StatusCode.ERROR, str(exc)))
                if not stream.closed:
                    # the exception's text stays here (log, span): an edge of before issue 38 showed it to clients
                    await stream.error("engine_error", f"{type(exc).__name__} (the worker's log has the rest)")
            finally:
                self._load_changed.set()

    async def _on_abort(self, request: AbortRequest, raw: Msg) -> None:
        if request.superseded:  # the edge's next attempt bills the request: this one is nobody's orphan
            self.orphans.untrack(request.request_id)
        if request.request_id in self._tasks:
            await self.engine.abort(request.request_id)

    async def _on_load_request(self, _request: LoadRequest, raw: Msg) -> None:
        await self.bus.respond(raw, self.load_snapshot())

    # ------------------------------------------------------------ load and KV events
    def load_snapshot(self) -> LoadSnapshot:
        load = self.engine.load()
        self._load_seq += 1
        prompt = load.prompt_tokens or NO_PROMPT_TOKENS
        return LoadSnapshot(
            source_id=self.worker_id, seq=self._load_seq, ts=schema.now(), num_running=load.num_running,
            num_waiting=load.num_waiting, num_active_blocks=load.num_active_blocks,
            num_kv_blocks=load.num_kv_blocks, num_aborted_total=self._num_aborted,
            num_finished_total=self._num_finished, num_prefill_tokens=load.num_prefill_tokens,
            kv_seq=self.kv_log.seq, prompt_tokens_computed=prompt.computed, prompt_tokens_cached=prompt.cached,
            prompt_tokens_transferred=prompt.transferred,
        )

    async def _publish_load_loop(self) -> None:
        """Publish load on change (coalesced over ``load_min_interval_s``) and at least every ``load_publish_s``.

        Routers weigh queued prefill and active KV: a finished request that still looks busy to them
        for long steers the next turn of its session away from its cache."""
        subject = self.bus.subjects.load(self.worker_id)
        while True:
            try:
                await asyncio.wait_for(self._load_changed.wait(), self.config.load_publish_s)
            except asyncio.TimeoutError:
                pass
            self._load_changed.clear()
            await self.bus.nc.publish(subject, schema.encode(self.load_snapshot()), headers=traced())
            await asyncio.sleep(self.config.load_min_interval_s)

    async def _publish_kv_events_loop(self) -> None:
        subject = self.bus.subjects.kv_events(self.worker_id)
        async for events in self.engine.kv_events():
            # numbered, kept for replay, mirrored for snapshots; each batch one NATS message (kv_log.py)
            for batch in self.kv_log.record_bounded(events, self._kv_batch_ids()):
                await self.bus.nc.publish(subject, schema.encode(batch), headers=traced())

    def _kv_batch_ids(self) -> int:
        """Ids per KV batch or replay page: a fifth of what fits the server's max_payload at msgpack's worst
        (5 bytes an id), leaving room for a replay reply of several batches at the bound."""
        return max(256, self.bus.nc.max_payload // 25)

    async def _on_kv_replay(self, request: KvReplayRequest, raw: Msg) -> None:
        batches = self.kv_log.replay(request.after_seq, min(request.max_tokens or self._kv_batch_ids(),
                                                             self._kv_batch_ids()))
        await self.bus.respond(raw, KvReplayReply(batches or [], complete=batches is not None))

    async def _on_kv_snapshot(self, request: KvSnapshotRequest, raw: Msg) -> None:
        """Page 0 takes a snapshot and keeps it a while under a new id; later pages read that one."""
        now = time.monotonic()
        self._snapshots = {k: v for k, v in self._snapshots.items() if now - v[0] < SNAPSHOT_KEEP_S}
        kept = self._snapshots.get(request.snapshot_id)
        if kept is None:
            snapshot = self.kv_log.snapshot()
            snapshot_id = uuid.uuid4().hex[:12]
            self._snapshots[snapshot_id] = (now, snapshot)
        else:
            snapshot_id, snapshot = request.snapshot_id, kept[1]
        start = request.start if kept is not None else 0
        block_size = snapshot.blocks[0].block_size if snapshot.blocks else 1
        fits = self._kv_batch_ids() // (block_size + 1)  # a page is one message too: fewer blocks than asked, maybe
        page = snapshot.blocks[start:start + max(1, min(request.max_blocks, fits))]
        await self.bus.respond(raw, KvSnapshot(snapshot.source_id, snapshot.seq, snapshot.ts, page, snapshot_id,
                                               start, len(snapshot.blocks)))
