"""The breakers bucket, as every router and edge sees it: one ``BreakerRecord`` per worker, watched live.

    breaker service --CAS put (transitions)--> <ns>_breakers[worker] <--CAS (probe permit)-- a router
                                                   |
                                   watched by every router and edge (BreakerView)

Writes name the revision they replace, so the breaker service and the routers taking a probe
permit never overwrite each other: of two routers taking one half-open period's permit, one wins.
"""

from __future__ import annotations

import logging
from typing import Callable

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from shared import schema
from shared.bus import Bus
from shared.kv_cas import ensure_bucket
from shared.kv_follower import KvFollower
from shared.schema import BreakerRecord

log = logging.getLogger(__name__)
CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class RecordConflict(Exception):
    """The record changed since the revision the writer read."""


class BreakerView:
    """worker id -> (BreakerRecord, revision), kept current by a watch on the bucket."""

    def __init__(self, bus: Bus) -> None:
        self._bus = bus
        self._kv: KeyValue | None = None
        self.records: dict[str, tuple[BreakerRecord, int]] = {}
        self.on_change: list[Callable[[BreakerRecord], None]] = []
        self._follower = KvFollower(bus, bus.subjects.breakers_bucket, "breakers",
                                    lambda _key, data: schema.decode(data, BreakerRecord))
        self._follower.on_put.append(self._on_put)
        self._follower.on_delete.append(lambda key: self.records.pop(key, None))

    async def start(self) -> None:
        self._kv = await ensure_bucket(self._bus, self._bus.subjects.breakers_bucket)
        await self._follower.start(5)

    async def stop(self) -> None:
        await self._follower.stop()

    def blocked(self) -> frozenset[str]:
        """Workers that take no normal traffic: open, or half-open (only their probe goes there)."""
        return frozenset(w for w, (r, _) in self.records.items() if r.state != CLOSED)

    def is_open(self, worker_id: str) -> bool:
        entry = self.records.get(worker_id)
        return entry is not None and entry[0].state == OPEN

    def free_probes(self) -> list[str]:
        """Half-open workers whose current permit nobody has taken."""
        return sorted(w for w, (r, _) in self.records.items() if r.state == HALF_OPEN and not r.probe_request_id)

    async def take_probe(self, worker_id: str, request_id: str) -> bool:
        """Take the worker's half-open permit for ``request_id``: True for exactly one taker per period."""
        entry = self.records.get(worker_id)
        if entry is None or entry[0].state != HALF_OPEN or entry[0].probe_request_id:
            return False
        record, revision = entry
        taken = BreakerRecord(record.worker_id, record.state, record.since, record.reason, record.period, request_id)
        try:
            await self.put(taken, revision)
        except RecordConflict:
            return False
        return True

    async def put(self, record: BreakerRecord, revision: int) -> int:
        """Write ``record`` if the key is still at ``revision`` (0: absent). Raises RecordConflict."""
        assert self._kv is not None
        try:
            if revision:
                new = await self._kv.update(record.worker_id, schema.encode(record), last=revision)
            else:
                new = await self._kv.create(record.worker_id, schema.encode(record))
        except KeyWrongLastSequenceError as exc:
            raise RecordConflict(record.worker_id) from exc
        self.records[record.worker_id] = (record, new)  # our own write, before the watch echoes it
        return new

    async def read(self, worker_id: str) -> tuple[BreakerRecord | None, int]:
        assert self._kv is not None
        try:
            entry = await self._kv.get(worker_id)
        except KeyNotFoundError:
            return None, 0
        return (schema.decode(entry.value, BreakerRecord) if entry.value else None), entry.revision or 0

    def _on_put(self, _key: str, record: BreakerRecord, revision: int) -> None:
        current = self.records.get(record.worker_id)
        if current is not None and current[1] >= revision:
            return  # our own write, already applied
        self.records[record.worker_id] = (record, revision)
        for callback in self.on_change:
            callback(record)
