"""A process's proof of life, on a thread of its own: a busy event loop cannot starve it.

    the process's event loop ──tick every TICK_S──► LoopWatch.last_tick
    liveness thread (its own event loop and NATS connection), for one Beacon:
        every heartbeat_s, while the loop is responsive: re-put the beacon's key (fresh payload, per-key TTL)
        the beacon's ping subject ──► its pong (loop lag), only while the loop is responsive

Workers (``<ns>_workers`` / ``<ns>.worker.<id>.ping``, ``shared/registry.py``) and edges (``<ns>_edges`` /
``<ns>.edge.<id>.ping``, ``shared/edges.py``) use the same thread:

| the process                                 | heartbeats | pings   | so its bucket              |
|---------------------------------------------|------------|---------|----------------------------|
| serving, loop idle or busy < max_stall_s    | yes        | answered| keeps it                   |
| loop blocked (grammar compile, engine step) | yes        | answered| keeps it                   |
| loop blocked >= max_stall_s (a hang)        | no         | silent  | drops it within the TTL    |
| SIGSTOPped, SIGKILLed, host gone            | no         | silent  | drops it within the TTL    |
| stopped cleanly                             | —          | —       | deletes the key at once    |

Grammar compilation for a 262K vocabulary, vLLM engine steps and NIXL's spinning threads all hold
the worker's event loop for seconds; on the loop, a heartbeat waited with them and the worker "left
the mesh" while it was serving. ``LoopWatch`` is the pure core (a fake clock in its tests). A key that
left its bucket is not proof of death either (NATS on a starved machine can miss a beat): watchers ping
before they act.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import msgspec
from nats.aio.msg import Msg

from shared import schema
from shared.bus import Bus, BusError, is_reply_inbox
from shared.schema import EdgePong, WorkerInfo, WorkerPong
from shared.tasks import cancel_and_wait
from shared.telemetry import trace_context_of, traced

log = logging.getLogger(__name__)
TICK_S = 0.25  # how often the watched loop proves it runs
DEFAULT_MAX_STALL_S = 60.0  # a loop blocked this long is hung, not busy: the worker goes quiet


class LoopWatch:
    """When an event loop last ran: ``responsive`` while it ran within ``max_stall_s``.

    ``tick`` is called on the watched loop, the other methods on the liveness thread: a float
    assignment is atomic in CPython, so no lock is needed."""

    def __init__(self, max_stall_s: float, now: float) -> None:
        assert max_stall_s > 0
        self.max_stall_s = max_stall_s
        self.last_tick = now

    def tick(self, now: float) -> None:
        self.last_tick = now

    def lag(self, now: float) -> float:
        return max(0.0, now - self.last_tick)

    def responsive(self, now: float) -> bool:
        return self.lag(now) < self.max_stall_s


@dataclass(frozen=True, slots=True)
class Beacon:
    """What one liveness thread keeps alive: a key in a bucket, re-put with a fresh payload, and a ping subject.

    ``payload()`` and ``pong(loop_lag_s)`` run on the liveness thread: they must only read immutable state."""

    owner: str  # the worker or edge id (logs, the thread's name)
    bucket: str
    key: str
    payload: Callable[[], Any]  # a fresh struct for each heartbeat
    ping_subject: str
    pong: Callable[[float], Any]  # the struct that answers a ping, given the watched loop's lag


def worker_beacon(bus: Bus, info: WorkerInfo) -> Beacon:
    """A worker's: its WorkerInfo (fresh ``ts``) in ``<ns>_workers``, pings on ``<ns>.worker.<id>.ping``."""
    return Beacon(info.worker_id, bus.subjects.workers_bucket, info.worker_id,
                  lambda: msgspec.structs.replace(info, ts=time.time()), bus.subjects.worker_ping(info.worker_id),
                  lambda lag: WorkerPong(info.worker_id, lag))


class LivenessThread:
    """Heartbeats and ping replies for one beacon, from a daemon thread with its own bus connection.

    ``start`` returns once the thread is connected and the first heartbeat is in the bucket (so a
    started process is registered); ``stop`` ends the thread. Deleting the key is the caller's (it owns
    the main connection, which must outlive the thread's)."""

    def __init__(self, connect: Callable[[], Awaitable[Bus]], beacon: Beacon, heartbeat_s: float,
                 ttl_s: float, watch: LoopWatch, clock: Callable[[], float] = time.monotonic) -> None:
        self._connect = connect
        self._beacon = beacon
        self._heartbeat_s = heartbeat_s
        self._ttl = f"{max(1, math.ceil(ttl_s))}s"
        self._watch = watch
        self._clock = clock
        self._ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name=f"liveness-{beacon.owner}", daemon=True)
        self.num_beats = 0
        self.num_skipped = 0  # beats withheld because the watched loop was stalled

    async def start(self) -> None:
        self._thread.start()
        await asyncio.wrap_future(self._ready)

    async def stop(self) -> None:
        if self._loop is not None and self._stopping is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._stopping.set)
            except RuntimeError:  # the thread's loop already closed
                pass
        await asyncio.to_thread(self._thread.join, 10)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # noqa: BLE001 - reported to start() if it is still waiting
            if not self._ready.done():
                self._ready.set_exception(exc)
            else:
                log.exception("liveness thread of %s ended", self._beacon.owner)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        bus = await self._connect()
        try:
            async def on_ping(msg: Msg) -> None:
                await self._on_ping(bus, msg)

            await bus.nc.subscribe(self._beacon.ping_subject, cb=on_ping)
            await self._beat(bus)
            self._ready.set_result(None)
            while not self._stopping.is_set():
                try:
                    await asyncio.wait_for(self._stopping.wait(), self._heartbeat_s)
                except asyncio.TimeoutError:
                    await self._maybe_beat(bus)
        finally:
            await bus.close()

    async def _maybe_beat(self, bus: Bus) -> None:
        owner = self._beacon.owner
        if not self._watch.responsive(self._clock()):
            self.num_skipped += 1
            if self.num_skipped == 1:
                log.error("%s: event loop stalled %.1fs; heartbeats withheld until it runs again", owner,
                          self._watch.lag(self._clock()))
            return
        if self.num_skipped:
            log.warning("%s: event loop runs again; heartbeats resume", owner)
            self.num_skipped = 0
        try:
            await self._beat(bus)
        except Exception as exc:  # NATS briefly away: keep trying; the TTL decides
            log.warning("heartbeat of %s failed: %s", owner, exc)

    async def _beat(self, bus: Bus) -> None:
        beacon = self._beacon
        subject = f"$KV.{beacon.bucket}.{beacon.key}"
        await bus.js.publish(subject, schema.encode(beacon.payload()), headers=traced({"Nats-TTL": self._ttl}))
        self.num_beats += 1

    async def _on_ping(self, bus: Bus, msg: Msg) -> None:
        now = self._clock()
        if is_reply_inbox(msg.reply) and self._watch.responsive(now):
            await bus.nc.publish(msg.reply, schema.encode(self._beacon.pong(self._watch.lag(now))),
                                 headers=trace_context_of(msg.headers))  # the pinger's, as any reply carries


async def tick_forever(watch: LoopWatch, clock: Callable[[], float] = time.monotonic) -> None:
    """Run on the watched loop: its ticks are what the liveness thread reads."""
    while True:
        watch.tick(clock())
        await asyncio.sleep(TICK_S)


async def ping(bus: Bus, worker_id: str, timeout_s: float) -> WorkerPong | None:
    """Ask a worker whether it is alive: its pong, or None (no responder, or silent for ``timeout_s``)."""
    return await _ping(bus, bus.subjects.worker_ping(worker_id), schema.WorkerPing(), WorkerPong, timeout_s)


async def ping_edge(bus: Bus, edge_id: str, timeout_s: float) -> EdgePong | None:
    """Ask an edge whether it is alive: its pong, or None (no responder, or silent for ``timeout_s``)."""
    return await _ping(bus, bus.subjects.edge_ping(edge_id), schema.EdgePing(), EdgePong, timeout_s)


async def _ping(bus: Bus, subject: str, message: Any, reply_type: type, timeout_s: float) -> Any:
    try:
        return await bus.request(subject, message, reply_type, timeout=timeout_s)
    except BusError:
        return None


class Registration:
    """Keeps one beacon's key alive while its process runs: ticks on this loop, beats from a LivenessThread.

    ``stop`` stops beating, then deletes the key on the caller's connection (watchers see the process leave
    at once); ``halt`` only stops beating, as a dead process would (the TTL removes the key)."""

    def __init__(self, bus: Bus, beacon: Beacon, heartbeat_s: float, ttl_s: float,
                 max_stall_s: float = DEFAULT_MAX_STALL_S) -> None:
        assert 0 < heartbeat_s < ttl_s, "a key must be re-put before its TTL runs out"
        self._bus = bus
        self.beacon = beacon
        self.watch = LoopWatch(max_stall_s, time.monotonic())
        self._thread = LivenessThread(lambda: bus.connect_again(f"liveness-{beacon.owner}"), beacon, heartbeat_s,
                                      ttl_s, self.watch)
        self._ticker: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._ticker = asyncio.create_task(tick_forever(self.watch), name="loop-ticks")
        await self._thread.start()

    async def stop(self) -> None:
        await self.halt()
        try:
            kv = await self._bus.js.key_value(self.beacon.bucket)
            await kv.delete(self.beacon.key)
        except Exception as exc:
            log.warning("could not delete %s from %s: %s", self.beacon.key, self.beacon.bucket, exc)

    async def halt(self) -> None:
        if self._ticker is not None:
            await cancel_and_wait(self._ticker)
        await self._thread.stop()
