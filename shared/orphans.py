"""The orphans stream: what workers generated for requests whose edge died, until a surviving edge bills it.

    await ensure_orphans_stream(bus)                 # workers and edges both make sure it exists
    await OrphanPublisher(bus, worker_id).publish(report)    # a worker, after aborting an orphan
    consumer: every edge pulls from one shared durable consumer (ORPHANS_DURABLE), services/edge/orphans.py

| step                                   | guarantees                                                       |
|----------------------------------------|------------------------------------------------------------------|
| worker publishes OrphanUsage           | ``Nats-Msg-Id: orphan:<request_id>``: a re-publish adds nothing; |
|                                        | retried until JetStream has it (never given up)                  |
| no edge is up                          | reports wait in the stream (``RETENTION_S``)                     |
| an edge verifies, publishes usage, acks| usage dedupe id ``<request_id>:<attempt>``, as the dead edge's:  |
|                                        | a duplicate report, or usage the edge did publish, bills once    |
| the edge dies before its ack           | redelivered to another edge after ``ACK_WAIT_S``                 |
"""

from __future__ import annotations

import asyncio
import logging

from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError

from shared import schema
from shared.bus import Bus
from shared.replication import stream_replicas
from shared.schema import OrphanUsage
from shared.storage_caps import store_caps
from shared.telemetry import traced

log = logging.getLogger("infermesh.orphans")
RETENTION_S = 7 * 24 * 3600.0  # as the usage stream: no edge may be up for this long without losing a report
DUPLICATE_WINDOW_S = 300.0
ORPHANS_DURABLE = "edges"  # the one consumer every edge pulls from (each report goes to one edge)
ACK_WAIT_S = 30.0


async def ensure_orphans_stream(bus: Bus) -> None:
    config = StreamConfig(name=bus.subjects.orphans_stream, subjects=[bus.subjects.orphans_all],
                          retention=RetentionPolicy.LIMITS, storage=StorageType.FILE, max_age=RETENTION_S,
                          duplicate_window=DUPLICATE_WINDOW_S, num_replicas=stream_replicas(),
                          max_bytes=store_caps().orphans, discard=DiscardPolicy.NEW)
    try:
        await bus.js.add_stream(config)
    except BadRequestError:  # it exists with another config (an operator changed it): keep theirs
        log.info("stream %s exists with its own config", config.name)


def orphan_msg_id(report: OrphanUsage) -> str:
    return f"orphan:{report.request_id}"


class OrphanPublisher:
    """A worker's side: publish a report until JetStream has it, never giving up (retried with capped backoff
    while NATS or JetStream is away, however long): the report is the usage of a request whose edge is gone, and
    nothing else holds it."""

    def __init__(self, bus: Bus, worker_id: str, max_delay_s: float = 5.0) -> None:
        self.bus = bus
        self.subject = bus.subjects.orphans(worker_id)
        self.max_delay_s = max_delay_s
        self.published = 0
        self.retries = 0

    async def publish(self, report: OrphanUsage) -> bool:
        data, headers = schema.encode(report), traced({"Nats-Msg-Id": orphan_msg_id(report)})
        delay = 0.05
        while True:
            try:
                await self.bus.js.publish(self.subject, data, headers=headers, timeout=2.0)
                self.published += 1
                return True
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.retries += 1
                log.warning("orphan report %s failed (%s): retrying in %.2f s", orphan_msg_id(report), exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.max_delay_s)
