"""Which lease holders are gone: admission follows the edges bucket and pings an edge that leaves it.

A dead edge's leases would hold their capacity until their TTL (10 s) runs out; an edge's key leaves the
edges bucket sooner (its TTL is 5 s, and a clean stop deletes it). The key alone is no proof: an edge whose
heartbeats NATS was too slow to store is alive and renewing. So an edge that leaves is pinged (its liveness
thread answers, whatever its event loop is doing), and only one that stays silent is gone:

| edge                                            | its leases                                            |
|-------------------------------------------------|-------------------------------------------------------|
| in the bucket                                   | held while renewed (the TTL)                          |
| left the bucket, answers the ping               | held: it lives                                        |
| left the bucket, back in it before the answer   | held                                                  |
| left the bucket, silent for ``probe_timeout_s`` | ``on_gone(edge_id)``: the leader lapses them at once  |
| never seen (its lease restored from the bucket) | the TTL                                               |
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from shared.bus import Bus
from shared.edges import EdgeDirectory
from shared.liveness import ping_edge

log = logging.getLogger(__name__)


class GoneHolders:
    """Calls ``on_gone(edge_id)`` for each edge that left the edges bucket and does not answer a ping."""

    def __init__(self, bus: Bus, on_gone: Callable[[str], None], probe_timeout_s: float = 2.0) -> None:
        self._bus = bus
        self._on_gone = on_gone
        self._probe_timeout_s = probe_timeout_s
        self.directory = EdgeDirectory(bus)
        self.directory.on_removed.append(self._on_removed)
        self._probes: dict[str, asyncio.Task[None]] = {}
        self.num_gone = self.num_alive = 0  # probes that found the edge silent / answering

    async def start(self) -> None:
        try:
            await self.directory.start()
        except asyncio.TimeoutError:  # it goes on in the background; until then leases lapse by their TTL
            log.warning("edges bucket not read within 5 s: a dead edge's leases lapse by their TTL meanwhile")

    async def stop(self) -> None:
        probes, self._probes = list(self._probes.values()), {}
        for probe in probes:
            probe.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        await self.directory.stop()

    def _on_removed(self, edge_id: str) -> None:
        if edge_id not in self._probes:
            self._probes[edge_id] = asyncio.create_task(self._probe(edge_id), name=f"probe-edge-{edge_id}")

    async def _probe(self, edge_id: str) -> None:
        try:
            pong = await ping_edge(self._bus, edge_id, self._probe_timeout_s)
        finally:
            self._probes.pop(edge_id, None)
        if pong is not None or edge_id in self.directory.edges:
            self.num_alive += 1
            log.warning("edge %s left the edges bucket but lives: its leases stay", edge_id)
        else:
            self.num_gone += 1
            self._on_gone(edge_id)
