"""The workers registry: a JetStream KV bucket of WorkerInfo with a per-key TTL.

Each worker re-puts its entry every ``heartbeat_s`` with a TTL of ``heartbeat_ttl_s``, from a
thread of its own (``shared/liveness.py``: a busy event loop cannot starve it); if the process
dies or hangs the server expires the key and writes a marker, so every watcher (router, edge) sees
a PURGE within about the TTL. A clean stop deletes the key.

nats-py's ``kv.put`` takes no TTL, so heartbeats publish to the key's subject
with a ``Nats-TTL`` header; ``limit_marker_ttl`` makes expiry visible to watchers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from nats.js.kv import KeyValue

from shared import schema
from shared.bus import Bus
from shared.kv_cas import ensure_bucket
from shared.kv_follower import KvFollower
from shared.liveness import DEFAULT_MAX_STALL_S, LivenessThread, LoopWatch, tick_forever, worker_beacon
from shared.schema import WorkerInfo
from shared.tasks import cancel_and_wait

log = logging.getLogger(__name__)


async def workers_bucket(bus: Bus) -> KeyValue:
    return await ensure_bucket(bus, bus.subjects.workers_bucket)


class WorkerRegistration:
    """Keeps one worker's registry entry alive while the worker runs, from a thread of its own.

    Heartbeats come from a ``LivenessThread`` (its own connection), so they go on while the worker's
    event loop is busy; they stop when that loop has not run for ``max_stall_s`` (a hang) or the
    process stops. ``stop`` deletes the key on the worker's own connection."""

    def __init__(self, bus: Bus, info: Callable[[], WorkerInfo], heartbeat_s: float, ttl_s: float,
                 max_stall_s: float = DEFAULT_MAX_STALL_S) -> None:
        self._bus = bus
        self._info = info
        self._heartbeat_s = heartbeat_s
        self._ttl_s = ttl_s
        self.watch = LoopWatch(max_stall_s, time.monotonic())
        self._ticker: asyncio.Task[None] | None = None
        self._thread: LivenessThread | None = None
        self._kv: KeyValue | None = None
        self.worker_id = info().worker_id

    async def start(self) -> None:
        self._kv = await workers_bucket(self._bus)
        self._ticker = asyncio.create_task(tick_forever(self.watch), name="loop-ticks")
        self._thread = LivenessThread(lambda: self._bus.connect_again(f"liveness-{self.worker_id}"),
                                      worker_beacon(self._bus, self._info()),
                                      self._heartbeat_s, self._ttl_s, self.watch)
        await self._thread.start()

    async def stop(self) -> None:
        """Stop beating, then deregister: watchers see the worker leave at once."""
        await self.halt()
        if self._kv is not None:
            try:
                await self._kv.delete(self.worker_id)
            except Exception as exc:
                log.warning("could not deregister %s: %s", self.worker_id, exc)

    async def halt(self) -> None:
        """Stop beating without deregistering (as a dead process would): the TTL removes the entry."""
        if self._ticker:
            await cancel_and_wait(self._ticker)
        if self._thread is not None:
            await self._thread.stop()


class WorkerDirectory:
    """A live view of the registry: worker id -> WorkerInfo, with callbacks on arrival and departure."""

    def __init__(self, bus: Bus) -> None:
        self.workers: dict[str, WorkerInfo] = {}
        self._seen_at: dict[str, float] = {}
        self.on_added: list[Callable[[WorkerInfo], None]] = []
        self.on_removed: list[Callable[[str], None]] = []
        # the same worker id back with a new ``started_at`` before its old entry lapsed (a supervisor restarted it
        # within the TTL): the old incarnation is dead, whatever it was doing is lost
        self.on_restarted: list[Callable[[str], None]] = []
        self._follower = KvFollower(bus, bus.subjects.workers_bucket, "registry",
                                    lambda _key, data: schema.decode(data, WorkerInfo))
        self._follower.on_put.append(self._on_put)
        self._follower.on_delete.append(self._remove)

    async def start(self) -> None:
        await self._follower.start(5)

    async def stop(self) -> None:
        await self._follower.stop()

    def live(self, model: str | None = None) -> list[WorkerInfo]:
        """Workers whose heartbeat is fresh (a backstop to the server TTL), optionally for one model; when none
        is, every one still in the bucket: heartbeats that all went stale together are the bucket failing (no
        leader for seconds after its NATS server was lost), not every worker dying (the TTL removes those)."""
        now = time.monotonic()
        known = [w for w in self.workers.values() if model is None or w.model == model]
        return [w for w in known if now - self._seen_at[w.worker_id] <= 2 * w.heartbeat_ttl_s] or known

    def models(self) -> dict[str, WorkerInfo]:
        """model name -> one live worker serving it (for tokenizer path and context length)."""
        return {w.model: w for w in self.live()}

    def _on_put(self, _key: str, info: WorkerInfo, _revision: int) -> None:
        previous = self.workers.get(info.worker_id)
        self.workers[info.worker_id] = info
        self._seen_at[info.worker_id] = time.monotonic()
        if previous is None:
            for callback in self.on_added:
                callback(info)
        elif previous.started_at != info.started_at:
            log.info("worker %s restarted (a new incarnation registered before the old one lapsed)", info.worker_id)
            for restarted in self.on_restarted:
                restarted(info.worker_id)

    def _remove(self, worker_id: str) -> None:
        if self.workers.pop(worker_id, None) is not None:
            self._seen_at.pop(worker_id, None)
            log.info("worker %s left the registry", worker_id)
            for callback in self.on_removed:
                callback(worker_id)
