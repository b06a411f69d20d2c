"""The usage stream: every billed attempt, durable in JetStream until metering has committed it.

    await ensure_usage_stream(bus)          # edges and metering both make sure it exists
    seq = await UsagePublisher(bus).publish(event)

Each message carries ``Nats-Msg-Id: <request_id>:<attempt>``, so an edge that publishes again
after a lost acknowledgement adds nothing inside the stream's duplicate window; metering's
unique (request_id, attempt) key makes any later duplicate harmless too.

A usage message metering can never write (undecodable, invalid, refused by the database) goes to
the dead-letter stream ``<ns>_usage_dlq`` as a ``DeadLetter`` (``ensure_dead_letter_stream``), kept
30 days for an operator to read and replay; its ``Nats-Msg-Id`` is its usage stream sequence, so a
message dead-lettered twice (metering died before its ack) is kept once.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError

from shared import schema
from shared.bus import Bus
from shared.replication import stream_replicas
from shared.schema import UsageEvent
from shared.telemetry import traced

log = logging.getLogger("infermesh.usage")
RETENTION_S = 7 * 24 * 3600.0  # metering may be away this long without losing usage
DEAD_LETTER_RETENTION_S = 30 * 24 * 3600.0  # an operator has this long to read and replay a dead letter
DUPLICATE_WINDOW_S = 300.0


async def ensure_usage_stream(bus: Bus) -> None:
    await _ensure_stream(bus, bus.subjects.usage_stream, bus.subjects.usage, RETENTION_S)


async def ensure_dead_letter_stream(bus: Bus) -> None:
    await _ensure_stream(bus, bus.subjects.usage_dead_letter_stream, bus.subjects.usage_dead_letters,
                         DEAD_LETTER_RETENTION_S)


def dead_letter_id(stream_seq: int) -> str:
    """The dead letter's ``Nats-Msg-Id``: one per usage message, however often it is dead-lettered."""
    return f"usage-seq-{stream_seq}"


async def _ensure_stream(bus: Bus, name: str, subject: str, max_age_s: float) -> None:
    config = StreamConfig(name=name, subjects=[subject], retention=RetentionPolicy.LIMITS, storage=StorageType.FILE,
                          max_age=max_age_s, duplicate_window=DUPLICATE_WINDOW_S,
                          num_replicas=stream_replicas())
    try:
        await bus.js.add_stream(config)
    except BadRequestError:  # it exists with another config (an operator changed it): keep theirs
        log.info("stream %s exists with its own config", config.name)


def dedupe_id(event: UsageEvent) -> str:
    return f"{event.request_id}:{event.attempt}"


class UsagePublisher:
    def __init__(self, bus: Bus, give_up_s: float = 120.0) -> None:
        self.bus = bus
        self.give_up_s = give_up_s
        self.published = 0
        self.lost = 0
        # usage messages not yet in the stream (JetStream away or electing a leader): the edge's heartbeat
        # carries this, and workers keep the reports of its ended requests while it is not 0 (worker/orphans.py)
        self.pending = 0

    async def publish(self, event: UsageEvent) -> int:
        """The message's stream sequence once JetStream has it (retried while NATS is away); 0 if lost."""
        self.pending += 1
        try:
            return await self._publish(event)
        finally:
            self.pending -= 1

    async def _publish(self, event: UsageEvent) -> int:
        data, headers = schema.encode(event), traced({"Nats-Msg-Id": dedupe_id(event)})
        deadline, delay = time.monotonic() + self.give_up_s, 0.05
        while True:
            try:
                ack = await self.bus.js.publish(self.bus.subjects.usage, data, headers=headers, timeout=2.0)
                self.published += 1
                return ack.seq
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if time.monotonic() + delay > deadline:
                    self.lost += 1
                    log.error("usage of %s lost after %.0f s of retries (%s): %s", dedupe_id(event), self.give_up_s,
                              exc, event)
                    return 0
                log.warning("usage publish of %s failed (%s): retrying", dedupe_id(event), exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
