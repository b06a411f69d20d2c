"""The usage stream: every billed attempt, durable in JetStream until metering has committed it.

    await ensure_usage_stream(bus)          # edges and metering both make sure it exists
    seq = await UsagePublisher(bus).publish(event)

Each message carries ``Nats-Msg-Id: <request_id>:<attempt>``, so an edge that publishes again
after a lost acknowledgement adds nothing inside the stream's duplicate window; metering's
unique (request_id, attempt) key makes any later duplicate harmless too.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError

from shared import schema
from shared.bus import Bus
from shared.schema import UsageEvent

log = logging.getLogger("infermesh.usage")
RETENTION_S = 7 * 24 * 3600.0  # metering may be away this long without losing usage
DUPLICATE_WINDOW_S = 300.0


async def ensure_usage_stream(bus: Bus) -> None:
    config = StreamConfig(name=bus.subjects.usage_stream, subjects=[bus.subjects.usage],
                          retention=RetentionPolicy.LIMITS, storage=StorageType.FILE, max_age=RETENTION_S,
                          duplicate_window=DUPLICATE_WINDOW_S)
    try:
        await bus.js.add_stream(config)
    except BadRequestError:  # it exists with another config (an operator changed it): keep theirs
        log.info("usage stream %s exists with its own config", config.name)


def dedupe_id(event: UsageEvent) -> str:
    return f"{event.request_id}:{event.attempt}"


class UsagePublisher:
    def __init__(self, bus: Bus, give_up_s: float = 120.0) -> None:
        self.bus = bus
        self.give_up_s = give_up_s
        self.published = 0
        self.lost = 0

    async def publish(self, event: UsageEvent) -> int:
        """The message's stream sequence once JetStream has it (retried while NATS is away); 0 if lost."""
        data, headers = schema.encode(event), {"Nats-Msg-Id": dedupe_id(event)}
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
