"""No orphans: a worker aborts the requests of an edge that died, and reports what they generated.

A request's edge is the edge id in its reply subject (``<ns>.stream.<edge_id>.<request_id>``). The worker
follows the edges bucket (``shared/edges.py``); an edge that leaves it, or that it has never seen
``grace_s`` after one of its requests arrived, is pinged; no answer and every running request of that
edge is aborted (``engine.abort``) and, once the engine ends it, reported as an ``OrphanUsage`` on the
orphans stream for a surviving edge to bill (``services/edge/orphans.py``).

| edge (for a worker with requests from it) | what the tracker does                                     |
|-------------------------------------------|-----------------------------------------------------------|
| in the bucket                             | nothing                                                   |
| left the bucket                           | ping at once                                              |
| never seen                                | ping ``grace_s`` after its first running request arrived  |
| pinged, answers                           | ping again ``grace_s`` later while it is out of the bucket|
| pinged, silent                            | abort each of its running requests, once                  |

A request that ends on its own is not proof that its edge billed it: the edge may die between the end
message and its usage publish (a short request ends long before its edge's key lapses), or while its usage
waits for the stream (JetStream electing a leader after a lost server: seconds). So the report of each ended
request is kept until its edge is seen beating ``settle_s`` after the end *with no usage pending* (each beat
and pong says how many of its usage messages are not yet in the stream); an edge found silent meanwhile gets
them reported too (``finish_reason`` as the engine ended them). A report the dead edge did
bill costs nothing: it shares the dedupe id ``<request_id>:<attempt>`` with the edge's usage.

``OrphanTracker`` is the pure core (a fake clock in its tests); ``OrphanReaper`` wires it to the bus.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from shared.bus import Bus
from shared.edges import EdgeDirectory
from shared.liveness import ping_edge
from shared.orphans import OrphanPublisher, ensure_orphans_stream
from shared.schema import FinishReason, GenerateRequest, OrphanUsage
from shared.tasks import cancel_and_wait

log = logging.getLogger("infermesh.worker")


class OrphanTracker:
    """Which running requests came from which edge, and which of those edges to ping when.

    Invariants: ``probe_at`` only holds edges out of the bucket with running requests; an edge is in
    ``probing`` while one ping to it is in flight (never two); ``silent`` hands each request out once."""

    def __init__(self, grace_s: float, settle_s: float = 2.0) -> None:
        assert grace_s > 0 and settle_s > 0
        self.grace_s, self.settle_s = grace_s, settle_s
        self._ended: dict[str, dict[str, tuple[float, object]]] = {}  # edge id -> request id -> (ended at, report)
        self.live: set[str] = set()
        self._requests: dict[str, set[str]] = {}  # edge id -> its running request ids
        self._edge_of: dict[str, str] = {}
        self._probe_at: dict[str, float] = {}
        self._probing: set[str] = set()
        self._abandoned: set[str] = set()  # edges found silent: their requests are being aborted

    def track(self, request_id: str, edge_id: str, now: float) -> None:
        self._edge_of[request_id] = edge_id
        self._requests.setdefault(edge_id, set()).add(request_id)
        if edge_id not in self.live and edge_id not in self._probe_at and edge_id not in self._abandoned:
            self._probe_at[edge_id] = now + self.grace_s

    def running_by_edge(self) -> dict[str, int]:
        """How many requests of each edge run here."""
        return {edge_id: len(requests) for edge_id, requests in self._requests.items() if requests}

    def untrack(self, request_id: str) -> None:
        edge_id = self._edge_of.pop(request_id, None)
        if edge_id is None:
            return
        requests = self._requests[edge_id]
        requests.discard(request_id)
        if not requests:
            del self._requests[edge_id]
            self._forget_edge_if_idle(edge_id)

    def _forget_edge_if_idle(self, edge_id: str) -> None:
        if edge_id not in self._requests and edge_id not in self._ended:
            self._probe_at.pop(edge_id, None)
            self._abandoned.discard(edge_id)

    def ended(self, request_id: str, report: object, now: float) -> bool:
        """A request ended on its own: keep its report until its edge beats ``settle_s`` later. True: its edge
        was already found dead, report it now."""
        edge_id = self._edge_of.get(request_id)
        if edge_id is None:
            return False
        if edge_id in self._abandoned:
            self.untrack(request_id)
            return True
        self._ended.setdefault(edge_id, {})[request_id] = (now, report)
        self.untrack(request_id)
        return False

    def edge_beat(self, edge_id: str, now: float, usage_pending: int = 0) -> None:
        """The edge is alive at ``now``: what ended ``settle_s`` before it was billed by the edge itself, unless
        the edge still holds usage it has not got into the stream (then it may die with it: keep every report)."""
        ended = self._ended.get(edge_id)
        if not ended or usage_pending:
            return
        for request_id in [r for r, (at, _) in ended.items() if at + self.settle_s <= now]:
            del ended[request_id]
        if not ended:
            del self._ended[edge_id]
            self._forget_edge_if_idle(edge_id)

    def take_ended(self, edge_id: str) -> list[object]:
        """The reports of a dead edge's ended requests, each handed out once."""
        return [report for _at, report in sorted(self._ended.pop(edge_id, {}).values(), key=lambda e: e[0])]

    def num_ended(self) -> int:
        return sum(len(ended) for ended in self._ended.values())

    def edge_live(self, edge_id: str) -> None:
        self.live.add(edge_id)
        self._probe_at.pop(edge_id, None)

    def edge_left(self, edge_id: str, now: float) -> None:
        self.live.discard(edge_id)
        if (edge_id in self._requests or edge_id in self._ended) and edge_id not in self._abandoned:
            self._probe_at[edge_id] = now

    def due(self, now: float) -> list[str]:
        """Edges to ping now; each is ``probing`` until ``answered`` or ``silent``."""
        edges = sorted(e for e, at in self._probe_at.items() if at <= now and e not in self._probing)
        self._probing.update(edges)
        return edges

    def answered(self, edge_id: str, now: float, usage_pending: int = 0) -> None:
        self._probing.discard(edge_id)
        if edge_id in self._probe_at:
            self._probe_at[edge_id] = now + self.grace_s
        self.edge_beat(edge_id, now, usage_pending)

    def probe_failed(self, edge_id: str, retry_at: float) -> None:
        """The ping itself failed (not an answer, not silence): ask again at ``retry_at``."""
        self._probing.discard(edge_id)
        if edge_id in self._probe_at:
            self._probe_at[edge_id] = retry_at

    def silent(self, edge_id: str) -> list[str]:
        """The edge is dead: its running requests, to abort (an empty list if it came back meanwhile)."""
        self._probing.discard(edge_id)
        if edge_id in self.live or self._probe_at.pop(edge_id, None) is None:
            return []
        self._abandoned.add(edge_id)
        if edge_id not in self._requests:  # only ended ones: nothing more will come from this edge
            self._abandoned.discard(edge_id)
        return sorted(self._requests.get(edge_id, ()))

    def edge_of(self, request_id: str) -> str | None:
        return self._edge_of.get(request_id)


class OrphanReaper:
    """A worker's orphan handling on the bus: follows the edges bucket, pings, aborts, reports."""

    def __init__(self, bus: Bus, worker_id: str, abort: Callable[[str], Awaitable[None]], grace_s: float,
                 probe_timeout_s: float, sweep_s: float = 0.25) -> None:
        self.bus, self.worker_id = bus, worker_id
        self.tracker = OrphanTracker(grace_s)
        self.directory = EdgeDirectory(bus)
        self.publisher = OrphanPublisher(bus, worker_id)
        self.orphaned: set[str] = set()  # request ids aborted because their edge died
        self.stats = {"pings": 0, "answered": 0, "silent": 0, "aborted": 0, "reported": 0}
        self._abort = abort
        self._probe_timeout_s = probe_timeout_s
        self._sweep_s = sweep_s
        self._tasks: set[asyncio.Task[None]] = set()
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await ensure_orphans_stream(self.bus)
        self.directory.on_added.append(self.tracker.edge_live)
        self.directory.on_beat.append(lambda edge_id: self.tracker.edge_beat(
            edge_id, time.monotonic(), self.directory.edges[edge_id].usage_pending))
        self.directory.on_removed.append(lambda edge_id: self.tracker.edge_left(edge_id, time.monotonic()))
        await self.directory.start()
        self._sweeper = asyncio.create_task(self._sweep(), name="orphan-sweep")

    async def stop(self) -> None:
        await cancel_and_wait(*self._tasks, self._sweeper)
        await self.directory.stop()

    def track(self, request_id: str, reply_subject: str) -> None:
        edge_id = self.bus.subjects.edge_of_stream(reply_subject)
        if edge_id is not None:
            self.tracker.track(request_id, edge_id, time.monotonic())

    def untrack(self, request_id: str) -> None:
        self.tracker.untrack(request_id)
        self.orphaned.discard(request_id)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self._sweep_s)
            for edge_id in self.tracker.due(time.monotonic()):
                task = asyncio.create_task(self._probe(edge_id), name=f"probe-{edge_id}")
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _probe(self, edge_id: str) -> None:
        try:
            await self._probe_once(edge_id)
        except Exception:  # the edge stays due: the next sweep pings it again
            log.exception("probing edge %s failed", edge_id)
            self.tracker.probe_failed(edge_id, time.monotonic() + 1.0)

    async def _probe_once(self, edge_id: str) -> None:
        self.stats["pings"] += 1
        pong = await ping_edge(self.bus, edge_id, self._probe_timeout_s)
        if pong is not None:
            self.stats["answered"] += 1
            log.warning("edge %s is out of the edges bucket but answers (its loop ran %.1fs ago): its requests "
                        "run on", edge_id, pong.loop_lag_s)
            self.tracker.answered(edge_id, time.monotonic(), pong.usage_pending)
            return
        self.stats["silent"] += 1
        doomed = self.tracker.silent(edge_id)
        self.stats["aborted"] += len(doomed)
        if doomed:
            log.warning("edge %s is gone: aborting its %d running requests", edge_id, len(doomed))
        for request_id in doomed:
            self.orphaned.add(request_id)
            await self._abort(request_id)
        ended = [] if edge_id in self.tracker.live else self.tracker.take_ended(edge_id)  # back meanwhile: it bills
        if ended:
            log.warning("edge %s is gone: reporting %d requests that ended since its last beat", edge_id, len(ended))
        for report in ended:
            await self._publish(report)  # type: ignore[arg-type]

    def _usage(self, request: GenerateRequest, num_prompt: int, num_cached: int, num_output: int, ttft_ms: float,
               finish_reason: FinishReason) -> OrphanUsage:
        return OrphanUsage(
            worker_id=self.worker_id, edge_id=self.tracker.edge_of(request.request_id) or "",
            request_id=request.request_id, billing=request.billing, remote_decode=request.remote_decode,
            num_prompt_tokens=num_prompt, num_cached_tokens=num_cached, num_output_tokens=num_output,
            ttft_ms=ttft_ms, finish_reason=finish_reason, ts=time.time())

    async def _publish(self, usage: OrphanUsage) -> None:
        self.stats["reported"] += 1
        await self.publisher.publish(usage)

    async def report(self, request: GenerateRequest, num_prompt: int, num_cached: int, num_output: int,
                     ttft_ms: float) -> None:
        """Publish what an orphaned request generated, as the engine reported it at its end."""
        await self._publish(self._usage(request, num_prompt, num_cached, num_output, ttft_ms, "abort"))

    async def ended(self, request: GenerateRequest, num_prompt: int, num_cached: int, num_output: int,
                    ttft_ms: float, finish_reason: FinishReason) -> None:
        """A request ended on its own: its report is kept until its edge proves it lived on (see the table)."""
        if request.billing is None or request.remote_decode:
            # nothing any edge could bill; or a prefill that handed its KV on: the decode worker's report bills
            # the request (a prefill's report shares its dedupe id and, first in, would drop its completion)
            return
        usage = self._usage(request, num_prompt, num_cached, num_output, ttft_ms, finish_reason)
        if self.tracker.ended(request.request_id, usage, time.monotonic()):
            await self._publish(usage)
