"""Metering: the usage stream into the ledger, exactly once in effect; the ledger's views onto the bus.

    edge --UsageEvent--> JetStream <NS>_usage --durable pull consumer--> write_usage (one transaction
    per batch) --> ack every message of the batch
                     a message that can never be written --> <NS>_usage_dlq, then acked

Metering also keeps the Responses API's stored responses (responses.py: ``<ns>.responses.api.*``).

A message is acked only after its batch committed. While the database is away the batch is held
and retried (its messages marked in progress so JetStream does not hand them to another replica);
if metering dies, JetStream redelivers whatever was not acked, and the unique (request_id, attempt)
key makes the second insert a no-op. Replicas may share the durable consumer.

A message that can never be written never holds the others back: one that does not decode or fails
validation is dead-lettered at once; a batch the database refuses for its data (SQLSTATE 22/23) is
split (poison.py) until the messages at fault are found and dead-lettered, and the rest committed.
Each writer runs under a supervisor that restarts it with backoff if it dies; ``health()`` is false
while one is down or while the ledger lags the stream by more than ``max_lag_s``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections import Counter

import msgspec
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from sqlalchemy.ext.asyncio import AsyncEngine

from services.metering.config import MeteringConfig
from services.metering.db import create_engine, database_url, migrate
from services.metering.dead_letters import DeadLetters
from services.metering.ledger import Written, write_usage
from services.metering.metrics import Health, LagWindow, dead_letter_key
from services.metering.poison import Isolation
from services.metering.pricing import PriceBook
from services.metering.responses import ResponsesServer
from services.metering.sync import BusViews, load_keys, load_prices
from shared import schema
from shared.bus import Bus
from shared.kv_cas import ensure_bucket
from shared.schema import DeadLetterReason, UsageEvent
from shared.tasks import cancel_and_wait
from shared.usage import ensure_usage_stream

log = logging.getLogger("infermesh.metering")
UTC = dt.timezone.utc
STOP_WAIT_S = 5.0
WRITER_STABLE_S = 30.0  # a writer that ran this long before dying is restarted after writer_restart_s again
Item = tuple[int, UsageEvent]  # (stream sequence, event)


class MeteringService:
    def __init__(self, bus: Bus, config: MeteringConfig | None = None) -> None:
        self.bus = bus
        self.config = config = config or MeteringConfig()
        self.url = database_url(config.database_url)
        self.engine: AsyncEngine | None = None
        self.prices = PriceBook()
        self.views: BusViews | None = None
        self.stats: Counter[str] = Counter()
        self.lag = LagWindow()
        self.pending = 0  # messages in the stream not yet delivered to us (the consumer's backlog)
        self.db_up = True
        self.dead_letters = DeadLetters(bus)
        self.writer_tasks: dict[int, asyncio.Task[None]] = {}  # writer -> its running task (absent: down)
        self._writing: dict[int, float] = {}  # writer -> when the stream stored the oldest message it writes
        self._sub: object = None
        self._tasks: list[asyncio.Task[None]] = []
        self._sync_now = asyncio.Event()  # keys changed: sync everything now
        self._spend_moved = False  # usage committed: admission should hear of the new spend soon
        self._stopping = asyncio.Event()
        self._billing: object = None
        self.billing_port = 0
        self.responses: ResponsesServer | None = None

    async def start(self) -> None:
        config = self.config
        await self._until_database(lambda: migrate(self.url), "migrate the ledger")
        self.engine = create_engine(self.url)
        await ensure_usage_stream(self.bus)
        await self.dead_letters.start()
        s = self.bus.subjects
        self.views = BusViews(await ensure_bucket(self.bus, s.api_keys_bucket),
                              await ensure_bucket(self.bus, s.billing_bucket))
        await self.views.load_published()
        await self._until_database(self._sync, "sync keys, prices and spend")
        self._sub = await self.bus.ledger_js.pull_subscribe(  # the LEDGER account on a locked bus
            s.usage, durable=self.config.consumer, stream=s.usage_stream,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=self.config.ack_wait_s,
                                  deliver_policy=DeliverPolicy.ALL, max_ack_pending=50_000, filter_subject=s.usage))
        self._keys_sub = await self.bus.nc.subscribe(s.keys_changed, cb=self._on_keys_changed)
        self.responses = ResponsesServer(self.bus, self.engine, config.responses_retention_s, config.responses_sweep_s)
        await self.responses.start()
        self._tasks = [asyncio.create_task(self._supervise(i), name=f"metering-writer-{i}-supervisor")
                       for i in range(self.config.writers)]  # one batch commits while the next is fetched
        self._tasks.append(asyncio.create_task(self._sync_loop(), name="metering-sync"))
        if self.config.billing_port >= 0:
            await self._start_billing()
        log.info("metering: ledger %s, consumer %s", self.engine.url.render_as_string(hide_password=True),
                 self.config.consumer)

    async def stop(self) -> None:
        """A clean stop: the batches being written commit and are acked (a bounded wait), then the rest stops."""
        self._stopping.set()
        if self.responses is not None:
            await self.responses.stop()
        supervisors = self._tasks[:-1]
        if supervisors:
            await asyncio.wait(supervisors, timeout=STOP_WAIT_S)
        await cancel_and_wait(*self._tasks)
        if self._billing is not None:
            await self._billing.stop()  # type: ignore[attr-defined]
        try:
            await self._keys_sub.unsubscribe()
            await self._sub.unsubscribe()  # type: ignore[attr-defined]
        except Exception:
            pass
        if self.engine is not None:
            await self.engine.dispose()

    def health(self) -> Health:
        now = time.time()
        oldest = min(self._writing.values(), default=now)
        return Health(writers=self.config.writers, writers_up=len(self.writer_tasks), lag_s=max(0.0, now - oldest),
                      max_lag_s=self.config.max_lag_s, db_up=self.db_up)

    async def _start_billing(self) -> None:
        from services.metering.http import BillingServer

        assert self.engine is not None
        self._billing = server = BillingServer(self.engine, self, self.config.billing_host, self.config.billing_port,
                                                    self.config.trace_url)
        await server.start()
        self.billing_port = server.port

    # ------------------------------------------------------------ supervision
    async def _supervise(self, writer: int) -> None:
        """Run writer ``writer``; if it dies (an exception, or its task cancelled by anyone but stop), log it,
        wait (``writer_restart_s`` doubling to ``writer_restart_max_s``; reset after a long run), restart it."""
        delay = self.config.writer_restart_s
        while not self._stopping.is_set():
            task = asyncio.create_task(self._consume(writer), name=f"metering-writer-{writer}")
            self.writer_tasks[writer], started = task, time.monotonic()
            try:
                await asyncio.wait({task})
            except asyncio.CancelledError:
                await cancel_and_wait(task)
                raise
            finally:
                self.writer_tasks.pop(writer, None)
                self._writing.pop(writer, None)
            if self._stopping.is_set():  # it finished its batch (or died during the stop): nothing to restart
                return
            if time.monotonic() - started >= WRITER_STABLE_S:
                delay = self.config.writer_restart_s
            error = "cancelled" if task.cancelled() else repr(task.exception() or "returned")
            self.stats["writer_restarts"] += 1
            log.error("metering: usage writer %d died (%s); restarting it in %.1f s", writer, error, delay,
                      exc_info=None if task.cancelled() else task.exception())
            try:
                await asyncio.wait_for(self._stopping.wait(), delay)
            except asyncio.TimeoutError:
                pass
            delay = min(delay * 2, self.config.writer_restart_max_s)

    # ------------------------------------------------------------ usage -> ledger
    async def _consume(self, writer: int) -> None:
        sub = self._sub
        while not self._stopping.is_set():
            try:
                msgs = await sub.fetch(self.config.batch_size, timeout=self.config.fetch_wait_s)  # type: ignore
            except TimeoutError:  # asyncio's or nats-py's: nothing came, ask again
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # NATS away for a moment
                log.warning("usage fetch failed: %s", exc)
                await asyncio.sleep(0.5)
                continue
            if msgs:
                self._writing[writer] = min(msg.metadata.timestamp.timestamp() for msg in msgs)
            try:
                await self._ingest(msgs)
            finally:
                self._writing.pop(writer, None)

    async def _ingest(self, msgs: list[Msg]) -> None:
        """Write one fetched batch: dead-letter what can never be written, commit the rest, ack both."""
        if msgs:
            self.pending = msgs[-1].metadata.num_pending
        by_seq, batch = await self._decode(msgs)
        if not batch:
            return
        job: Isolation[Item] = Isolation(batch)
        while not job.done:
            await self._until_database(lambda: job.step(self._write), "write usage", hold=list(by_seq.values()))
        for (seq, _event), error in job.poisoned:
            await self._dead_letter(by_seq.pop(seq), "rejected", error)
        for msg in by_seq.values():
            try:
                await msg.ack()
            except Exception as exc:  # NATS away: redelivered after ack_wait_s, a duplicate then
                log.warning("cannot ack usage message (seq %d): %s", msg.metadata.sequence.stream, exc)
        self._account(job.written, [item for item in batch if item[0] in by_seq])

    async def _decode(self, msgs: list[Msg]) -> tuple[dict[int, Msg], list[Item]]:
        """The batch's usage events by stream sequence; the undecodable and the invalid are dead-lettered."""
        by_seq: dict[int, Msg] = {}
        batch: list[Item] = []
        for msg in msgs:
            seq = msg.metadata.sequence.stream
            try:
                event = schema.decode(msg.data, UsageEvent)
            except msgspec.ValidationError as exc:  # msgpack, but not a valid UsageEvent
                await self._dead_letter(msg, "invalid", exc)
                continue
            except Exception as exc:
                await self._dead_letter(msg, "undecodable", exc)
                continue
            by_seq[seq] = msg
            batch.append((seq, event))
        return by_seq, batch

    async def _write(self, part: list[Item]) -> Written:
        assert self.engine is not None
        return await write_usage(self.engine, part, self.prices)

    async def _dead_letter(self, msg: Msg, reason: DeadLetterReason, error: BaseException) -> None:
        if await self.dead_letters.put(msg, reason, error):
            self.stats[dead_letter_key(reason)] += 1

    def _account(self, written: Written, batch: list[Item]) -> None:
        self.stats["inserted"] += written.inserted
        self.stats["duplicates"] += written.duplicates
        self.stats["superseded"] += written.superseded
        now = time.time()
        for seq, event in batch:
            self.lag.add(now - event.created_at)
            if event.team in written.teams:
                assert self.views is not None
                self.views.team_last_seq[event.team] = max(self.views.team_last_seq.get(event.team, 0), seq)
        if written.teams:
            self._spend_moved = True

    async def _until_database(self, step, what: str, hold: list[Msg] | None = None):  # type: ignore[no-untyped-def]
        """Run ``step`` until the database lets it; meanwhile keep ``hold``'s messages ours (in progress)."""
        delay = 0.1
        while True:
            try:
                result = await step()
                if not self.db_up:
                    log.warning("metering: the database is back")
                self.db_up = True
                return result
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.stats["db_errors"] += 1
                if self.db_up:
                    log.error("metering: cannot %s (%s: %s); holding and retrying", what, type(exc).__name__, exc)
                self.db_up = False
                for msg in hold or ():
                    try:
                        await msg.in_progress()
                    except Exception:
                        pass
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.config.retry_max_s)

    # ------------------------------------------------------------ ledger -> bus
    async def _on_keys_changed(self, _msg: Msg) -> None:
        self._sync_now.set()

    async def _sync_loop(self) -> None:
        """Everything every ``sync_s`` or when keys changed; only spend, at most every ``spend_sync_s``, after
        usage was committed (under load that is once per interval, not once per batch)."""
        last_full = time.monotonic()
        # not ``while True``: on Python 3.11 wait_for can swallow the stop's cancel (when the event fires as it
        # lands), and the loop ran on past stop(), whose gather then waited forever (seen in a fresh-clone run)
        while not self._stopping.is_set():
            try:
                await asyncio.wait_for(self._sync_now.wait(), self.config.spend_sync_s)
            except asyncio.TimeoutError:
                pass
            full = self._sync_now.is_set() or time.monotonic() - last_full >= self.config.sync_s
            if not full and not self._spend_moved:
                continue
            self._sync_now.clear()
            self._spend_moved = False
            try:
                if full:
                    last_full = time.monotonic()
                    await self._sync()
                else:
                    await self._sync_spend()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.stats["sync_errors"] += 1
                log.warning("metering sync failed: %s", exc)

    async def _sync(self) -> None:
        assert self.engine is not None and self.views is not None
        self.stats["key_changes"] += await self.views.sync_keys(await load_keys(self.engine))
        book = await load_prices(self.engine)
        if book != self.prices:
            self.prices = book
        await self.views.sync_prices(self.prices, time.time())
        await self._sync_spend()

    async def _sync_spend(self) -> None:
        assert self.engine is not None and self.views is not None
        through = await self._through_seq()  # the floor first, then the sums: they hold at least that much
        await self.views.sync_spend(self.engine, dt.datetime.now(UTC), through)

    async def _through_seq(self) -> int:
        """Every usage message up to this stream sequence is in the ledger (the consumer's ack floor)."""
        if self._sub is None:
            return 0
        try:
            info = await self._sub.consumer_info()  # type: ignore[attr-defined]
            return info.ack_floor.stream_seq if info.ack_floor else 0
        except Exception:
            return 0
