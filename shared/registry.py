"""The workers registry: a JetStream KV bucket of WorkerInfo with a per-key TTL.

Each worker re-puts its entry every ``heartbeat_s`` with a TTL of ``heartbeat_ttl_s``;
if the process dies the server expires the key and writes a marker, so every
watcher (router, edge) sees a PURGE within about the TTL. A clean stop deletes the key.

nats-py's ``kv.put`` takes no TTL, so heartbeats publish to the key's subject
with a ``Nats-TTL`` header; ``limit_marker_ttl`` makes expiry visible to watchers.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Callable

from nats.js.kv import KeyValue

from shared import schema
from shared.bus import Bus
from shared.kv_cas import ensure_bucket
from shared.kv_watch import follow
from shared.schema import WorkerInfo

log = logging.getLogger(__name__)


async def workers_bucket(bus: Bus) -> KeyValue:
    return await ensure_bucket(bus, bus.subjects.workers_bucket)


class WorkerRegistration:
    """Keeps one worker's registry entry alive while the worker runs."""

    def __init__(self, bus: Bus, info: Callable[[], WorkerInfo], heartbeat_s: float, ttl_s: float) -> None:
        self._bus = bus
        self._info = info
        self._heartbeat_s = heartbeat_s
        self._ttl = f"{max(1, math.ceil(ttl_s))}s"
        self._kv: KeyValue | None = None
        self._task: asyncio.Task[None] | None = None
        self.worker_id = info().worker_id

    async def start(self) -> None:
        self._kv = await workers_bucket(self._bus)
        await self._beat()
        self._task = asyncio.create_task(self._loop(), name="heartbeat")

    async def _beat(self) -> None:
        info = self._info()
        subject = f"$KV.{self._bus.subjects.workers_bucket}.{info.worker_id}"
        await self._bus.js.publish(subject, schema.encode(info), headers={"Nats-TTL": self._ttl})

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_s)
            try:
                await self._beat()
            except Exception as exc:  # NATS briefly away: keep trying; the TTL decides
                log.warning("heartbeat failed: %s", exc)

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._kv is not None:
            try:
                await self._kv.delete(self.worker_id)
            except Exception as exc:
                log.warning("could not deregister %s: %s", self.worker_id, exc)


class WorkerDirectory:
    """A live view of the registry: worker id -> WorkerInfo, with callbacks on arrival and departure."""

    def __init__(self, bus: Bus) -> None:
        self._bus = bus
        self.workers: dict[str, WorkerInfo] = {}
        self._seen_at: dict[str, float] = {}
        self.on_added: list[Callable[[WorkerInfo], None]] = []
        self.on_removed: list[Callable[[str], None]] = []
        self._watcher = None
        self._task: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()
        self._stopping = False

    async def start(self) -> None:
        kv = await workers_bucket(self._bus)
        self._watcher = await kv.watchall()
        self._task = asyncio.create_task(self._watch(), name="registry-watch")
        await asyncio.wait_for(self._synced.wait(), 5)

    async def stop(self) -> None:
        # Stop the watcher first (it wakes the loop with a sentinel): cancelling alone can be
        # swallowed by wait_for inside nats-py when an update lands at the same moment.
        self._stopping = True
        if self._watcher is not None:
            try:
                await self._watcher.stop()
            except Exception:
                pass
        if self._task:
            self._task.cancel()
            await asyncio.wait([self._task], timeout=2)

    def live(self, model: str | None = None) -> list[WorkerInfo]:
        """Workers whose heartbeat is fresh (a backstop to the server TTL), optionally for one model."""
        now = time.monotonic()
        return [
            w for wid, w in self.workers.items()
            if (model is None or w.model == model) and now - self._seen_at[wid] <= 2 * w.heartbeat_ttl_s
        ]

    def models(self) -> dict[str, WorkerInfo]:
        """model name -> one live worker serving it (for tokenizer path and context length)."""
        return {w.model: w for w in self.live()}

    async def _watch(self) -> None:
        assert self._watcher is not None
        await follow(self._watcher, "registry", self._on_put, self._remove, self._synced.set,
                     lambda: self._stopping)

    def _on_put(self, key: str, value: bytes, _revision: int) -> None:
        try:
            info = schema.decode(value, WorkerInfo)
        except Exception:
            log.warning("bad registry entry for %s", key)
            return
        is_new = info.worker_id not in self.workers
        self.workers[info.worker_id] = info
        self._seen_at[info.worker_id] = time.monotonic()
        if is_new:
            for callback in self.on_added:
                callback(info)

    def _remove(self, worker_id: str) -> None:
        if self.workers.pop(worker_id, None) is not None:
            self._seen_at.pop(worker_id, None)
            log.info("worker %s left the registry", worker_id)
            for callback in self.on_removed:
                callback(worker_id)
