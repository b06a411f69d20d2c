"""The usage stream: every billed attempt, durable in JetStream until metering has committed it.

    await ensure_usage_stream(bus)          # edges and metering both make sure it exists
    seq = await UsagePublisher(bus).publish(event)   # retried until JetStream has it

The edge bills each response through its usage outbox (``UsagePublisher(bus, journal)``: ``open``,
``checkpoint`` while it streams, ``record`` before its last byte, ``submit``; ``replay`` on start).

Each message carries ``Nats-Msg-Id: <request_id>:<attempt>``, so an edge that publishes again
after a lost acknowledgement adds nothing inside the stream's duplicate window; metering's
unique (request_id, attempt) key makes any later duplicate harmless too.

A usage message metering can never write (undecodable, invalid, refused by the database) goes to
the dead-letter stream ``<ns>_usage_dlq`` as a ``DeadLetter`` (``ensure_dead_letter_stream``), kept
30 days for an operator to read and replay; its ``Nats-Msg-Id`` is its usage stream sequence, so a
message dead-lettered twice (metering died before its ack) is kept once.

Both streams are on the bus's ledger connection (``bus.ledger_js``: the LEDGER account of a locked bus, where no
other stream is and only metering and admin make consumers; ``infermesh/bus_roles.py``). Both discard new: a
full stream refuses a publish (the edge's outbox keeps the usage and retries; metering leaves the message unacked)
rather than evicting usage metering has not read. A stream that exists keeps its config (made before: discard
old, until an operator updates it).
"""

from __future__ import annotations

import asyncio
import logging
import random

from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError

from shared import schema
from shared.bus import Bus
from shared.replication import stream_replicas
from shared.schema import UsageEvent
from shared.storage_caps import store_caps
from shared.tasks import cancel_and_wait
from shared.telemetry import traced
from shared.usage_journal import UsageJournal

log = logging.getLogger("infermesh.usage")
RETENTION_S = 7 * 24 * 3600.0  # metering may be away this long without losing usage
DEAD_LETTER_RETENTION_S = 30 * 24 * 3600.0  # an operator has this long to read and replay a dead letter
DUPLICATE_WINDOW_S = 300.0
# a finished request's lease waits this long for its usage's stream sequence (its budget hold becomes what it
# cost); past it the lease goes back without it, and the usage is still published (never dropped)
LEASE_SPENT_WAIT_S = 120.0
ORPHAN_PUBLISH_WAIT_S = 120.0  # an orphan report not billed in this long is naked: it waits in its own stream


async def ensure_usage_stream(bus: Bus) -> None:
    await _ensure_stream(bus, bus.subjects.usage_stream, bus.subjects.usage, RETENTION_S, store_caps().usage)


async def ensure_dead_letter_stream(bus: Bus) -> None:
    await _ensure_stream(bus, bus.subjects.usage_dead_letter_stream, bus.subjects.usage_dead_letters,
                         DEAD_LETTER_RETENTION_S, store_caps().usage_dead_letters)


def dead_letter_id(stream_seq: int) -> str:
    """The dead letter's ``Nats-Msg-Id``: one per usage message, however often it is dead-lettered."""
    return f"usage-seq-{stream_seq}"


async def _ensure_stream(bus: Bus, name: str, subject: str, max_age_s: float, max_bytes: int) -> None:
    """The stream, its ``max_bytes`` reserved (shared/storage_caps.py): no other stream filling up takes its room;
    full, it refuses new messages (``DiscardPolicy.NEW``) and never evicts unread ones."""
    config = StreamConfig(name=name, subjects=[subject], retention=RetentionPolicy.LIMITS, storage=StorageType.FILE,
                          max_age=max_age_s, duplicate_window=DUPLICATE_WINDOW_S,
                          num_replicas=stream_replicas(), max_bytes=max_bytes, discard=DiscardPolicy.NEW)
    try:
        await bus.ledger_js.add_stream(config)
    except BadRequestError:  # it exists with another config (an operator changed it): keep theirs
        log.info("stream %s exists with its own config", config.name)


def dedupe_id(event: UsageEvent) -> str:
    """``<request_id>:<attempt>``; a batch line's run's usage adds ``:<run_id>``: the runs of a line share its
    request id, and a later run's (finished) usage within the duplicate window is not a redelivery."""
    return f"{event.request_id}:{event.attempt}" + (f":{event.run_id}" if event.run_id else "")


class UsagePublisher:
    """Gets usage into the stream, never giving up: each publish is retried with capped backoff until JetStream
    acknowledges it. With a journal (``shared/usage_journal.py``) the usage of each response is durable before
    the response ends, and what a dead edge left unpublished is published again by the next edge of its slot
    (``replay``): a JetStream outage of any length, or the edge's own death, loses no usage.

    ``pending`` (carried by the edge's heartbeat: workers keep the reports of its ended requests while it is
    not 0, ``services/worker/orphans.py``) counts final usage not yet acknowledged by JetStream."""

    def __init__(self, bus: Bus, journal: UsageJournal | None = None, max_delay_s: float = 5.0,
                 concurrency: int = 64) -> None:
        self.bus, self.journal = bus, journal
        self.max_delay_s = max_delay_s
        self.published = 0
        self.retries = 0
        self.lost = 0  # usage given up on: none since the publisher never gives up (the benches report it)
        self.unjournaled = 0  # final usage the journal could not write (kept in memory only)
        self._unpublished: set[int] = set()  # entries whose final usage is not yet in the stream
        self._in_flight = 0  # publish() calls without an entry, not yet in the stream
        self._next_entry = 0  # entry ids without a journal
        self._attempts = asyncio.Semaphore(concurrency)  # a backlog retries a bounded number at a time
        self._tasks: set[asyncio.Task[int]] = set()

    @property
    def pending(self) -> int:
        return len(self._unpublished) + self._in_flight

    def open(self) -> int:
        """A new entry: one response's usage, from its first checkpoint to its retirement."""
        if self.journal is not None:
            return self.journal.outbox.open()
        self._next_entry += 1
        return self._next_entry

    def checkpoint(self, entry: int, event: UsageEvent) -> None:
        """What a running stream delivered so far (billed if the edge dies before its end): group-committed."""
        if self.journal is not None:
            self.journal.write(entry, "checkpoint", event)

    async def record(self, entry: int, event: UsageEvent) -> bool:
        """The response's final usage, durable on return (True) unless the journal failed or there is none: the
        response's last byte may go. Never raises: a failed write keeps the usage in memory (logged)."""
        self._unpublished.add(entry)
        if self.journal is None:
            return False
        try:
            durable = await self.journal.commit(entry, "final", event)
        except Exception:
            log.exception("usage outbox: the final usage of %s was not written", dedupe_id(event))
            durable = False
        self.unjournaled += not durable
        return durable

    def discard(self, entry: int) -> None:
        """Nothing to bill for this entry (no usage, or a preempted batch line): retire it unpublished."""
        self._unpublished.discard(entry)
        if self.journal is not None:
            self.journal.write(entry, "retired")

    def submit(self, entry: int, event: UsageEvent) -> "asyncio.Task[int]":
        """Publish ``entry``'s final usage in the background (until acknowledged), then retire it."""
        self._unpublished.add(entry)
        task = asyncio.get_running_loop().create_task(self._publish_entry(entry, event))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def replay(self) -> int:
        """Publish every entry a previous edge of this slot left in the journal; returns how many."""
        if self.journal is None:
            return 0
        live = self.journal.outbox.live()
        for record in live:
            assert record.event is not None
            log.warning("usage outbox: replaying the %s usage of %s", record.kind, dedupe_id(record.event))
            self.submit(record.id, record.event)
        return len(live)

    async def stop(self) -> None:
        """Stop retrying (what is unpublished stays in the journal for the next edge of the slot)."""
        await cancel_and_wait(*self._tasks)

    async def publish(self, event: UsageEvent) -> int:
        """The message's stream sequence once JetStream has it (retried until it does)."""
        self._in_flight += 1
        try:
            return await self._publish(event)
        finally:
            self._in_flight -= 1

    async def publish_within(self, event: UsageEvent, timeout_s: float) -> int:
        """``publish``, for usage held durably elsewhere (an orphan report): 0 if not in the stream in time."""
        try:
            return await asyncio.wait_for(self.publish(event), timeout_s)
        except asyncio.TimeoutError:
            return 0

    async def _publish_entry(self, entry: int, event: UsageEvent) -> int:
        seq = await self._publish(event)
        self._unpublished.discard(entry)
        if self.journal is not None:
            self.journal.write(entry, "retired")
        return seq

    async def _publish(self, event: UsageEvent) -> int:
        data, headers = schema.encode(event), traced({"Nats-Msg-Id": dedupe_id(event)})
        delay = 0.05
        while True:
            try:
                async with self._attempts:
                    ack = await self.bus.ledger_js.publish(self.bus.subjects.usage, data, headers=headers,
                                                           timeout=2.0)
                self.published += 1
                return ack.seq
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.retries += 1
                log.warning("usage publish of %s failed (%s): retrying in %.2f s", dedupe_id(event), exc, delay)
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(delay * 2, self.max_delay_s)
