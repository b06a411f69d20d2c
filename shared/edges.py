"""The edges registry: a JetStream KV bucket of EdgeInfo with a per-key TTL, as the workers registry is.

    registration = edge_registration(bus, edge_id, heartbeat_s=1, ttl_s=5)   # the edge
    directory = EdgeDirectory(bus); directory.on_removed.append(cb)          # a worker

Each edge re-puts ``EdgeInfo`` every ``heartbeat_s`` from its liveness thread (``shared/liveness.py``) and
answers ``<ns>.edge.<id>.ping`` there; if the edge dies or hangs the server expires its key and every
watcher sees it leave within about the TTL. A clean stop deletes the key. Workers follow the bucket to
find requests whose edge is gone (``services/worker/orphans.py``).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import msgspec
from nats.js.kv import KeyValue

from shared import schema
from shared.bus import Bus
from shared.kv_cas import ensure_bucket
from shared.kv_follower import KvFollower
from shared.liveness import DEFAULT_MAX_STALL_S, Beacon, Registration
from shared.schema import EdgeInfo, EdgePong

log = logging.getLogger(__name__)


async def edges_bucket(bus: Bus) -> KeyValue:
    return await ensure_bucket(bus, bus.subjects.edges_bucket)


def edge_beacon(bus: Bus, edge_id: str, started_at: float, usage_pending: Callable[[], int] = lambda: 0) -> Beacon:
    """Each beat and pong says how much of the edge's usage is not yet in the stream (``usage_pending``, read
    from the liveness thread: an int)."""
    info = EdgeInfo(edge_id, started_at)
    return Beacon(edge_id, bus.subjects.edges_bucket, edge_id,
                  lambda: msgspec.structs.replace(info, ts=time.time(), usage_pending=usage_pending()),
                  bus.subjects.edge_ping(edge_id), lambda lag: EdgePong(edge_id, lag, usage_pending()))


async def edge_registration(bus: Bus, edge_id: str, heartbeat_s: float, ttl_s: float,
                            max_stall_s: float = DEFAULT_MAX_STALL_S,
                            usage_pending: Callable[[], int] = lambda: 0) -> Registration:
    """A started registration of this edge: its key is in the bucket when this returns."""
    await edges_bucket(bus)
    registration = Registration(bus, edge_beacon(bus, edge_id, time.time(), usage_pending), heartbeat_s, ttl_s,
                                max_stall_s)
    await registration.start()
    return registration


class EdgeDirectory:
    """A live view of the edges bucket: the ids of the edges in it, with callbacks on arrival and departure."""

    def __init__(self, bus: Bus) -> None:
        self.edges: dict[str, EdgeInfo] = {}
        self.on_added: list[Callable[[str], None]] = []
        self.on_removed: list[Callable[[str], None]] = []
        self.on_beat: list[Callable[[str], None]] = []  # every heartbeat of every edge
        self._follower = KvFollower(bus, bus.subjects.edges_bucket, "edges",
                                    lambda _key, data: schema.decode(data, EdgeInfo))
        self._follower.on_put.append(self._on_put)
        self._follower.on_delete.append(self._on_delete)

    async def start(self) -> None:
        await self._follower.start(5)

    async def stop(self) -> None:
        await self._follower.stop()

    def _on_put(self, _key: str, info: EdgeInfo, _revision: int) -> None:
        is_new = info.edge_id not in self.edges
        self.edges[info.edge_id] = info
        if is_new:
            for callback in self.on_added:
                callback(info.edge_id)
        for beat in self.on_beat:
            beat(info.edge_id)

    def _on_delete(self, edge_id: str) -> None:
        if self.edges.pop(edge_id, None) is not None:
            log.info("edge %s left the edges bucket", edge_id)
            for callback in self.on_removed:
                callback(edge_id)
