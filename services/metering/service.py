"""Metering: the usage stream into the ledger, exactly once in effect; the ledger's views onto the bus.

    edge --UsageEvent--> JetStream <NS>_usage --durable pull consumer--> write_usage (one transaction
    per batch) --> ack every message of the batch

A message is acked only after its batch committed. While the database is away the batch is held
and retried (its messages marked in progress so JetStream does not hand them to another replica);
if metering dies, JetStream redelivers whatever was not acked, and the unique (request_id, attempt)
key makes the second insert a no-op. Replicas may share the durable consumer.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections import Counter

import nats.errors
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from sqlalchemy.ext.asyncio import AsyncEngine

from services.metering.config import MeteringConfig
from services.metering.db import create_engine, database_url, migrate
from services.metering.ledger import write_usage
from services.metering.metrics import LagWindow
from services.metering.pricing import PriceBook
from services.metering.sync import BusViews, load_keys, load_prices
from shared import schema
from shared.bus import Bus
from shared.kv_cas import ensure_bucket
from shared.schema import UsageEvent
from shared.usage import ensure_usage_stream

log = logging.getLogger("infermesh.metering")
UTC = dt.timezone.utc
STOP_WAIT_S = 5.0


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
        self._sub: object = None
        self._tasks: list[asyncio.Task[None]] = []
        self._sync_now = asyncio.Event()  # keys changed: sync everything now
        self._spend_moved = False  # usage committed: admission should hear of the new spend soon
        self._stopping = False
        self._billing: object = None
        self.billing_port = 0

    async def start(self) -> None:
        await self._until_database(lambda: migrate(self.url), "migrate the ledger")
        self.engine = create_engine(self.url)
        await ensure_usage_stream(self.bus)
        s = self.bus.subjects
        self.views = BusViews(await ensure_bucket(self.bus, s.api_keys_bucket),
                              await ensure_bucket(self.bus, s.billing_bucket))
        await self.views.load_published()
        await self._until_database(self._sync, "sync keys, prices and spend")
        self._sub = await self.bus.js.pull_subscribe(
            s.usage, durable=self.config.consumer, stream=s.usage_stream,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=self.config.ack_wait_s,
                                  deliver_policy=DeliverPolicy.ALL, max_ack_pending=50_000, filter_subject=s.usage))
        self._keys_sub = await self.bus.nc.subscribe(s.keys_changed, cb=self._on_keys_changed)
        self._tasks = [asyncio.create_task(self._consume(), name=f"metering-consume-{i}")
                       for i in range(self.config.writers)]  # one batch commits while the next is fetched
        self._tasks.append(asyncio.create_task(self._sync_loop(), name="metering-sync"))
        if self.config.billing_port >= 0:
            await self._start_billing()
        log.info("metering: ledger %s, consumer %s", self.engine.url.render_as_string(hide_password=True),
                 self.config.consumer)

    async def stop(self) -> None:
        """A clean stop: the batches being written commit and are acked (a bounded wait), then the rest stops."""
        self._stopping = True
        consumers = self._tasks[:-1]
        if consumers:
            await asyncio.wait(consumers, timeout=STOP_WAIT_S)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._billing is not None:
            await self._billing.stop()  # type: ignore[attr-defined]
        try:
            await self._keys_sub.unsubscribe()
            await self._sub.unsubscribe()  # type: ignore[attr-defined]
        except Exception:
            pass
        if self.engine is not None:
            await self.engine.dispose()

    async def _start_billing(self) -> None:
        from services.metering.http import BillingServer

        assert self.engine is not None
        self._billing = server = BillingServer(self.engine, self, self.config.billing_host, self.config.billing_port)
        await server.start()
        self.billing_port = server.port

    # ------------------------------------------------------------ usage -> ledger
    async def _consume(self) -> None:
        sub = self._sub
        while not self._stopping:
            try:
                msgs = await sub.fetch(self.config.batch_size, timeout=self.config.fetch_wait_s)  # type: ignore
            except nats.errors.TimeoutError:
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # NATS away for a moment
                log.warning("usage fetch failed: %s", exc)
                await asyncio.sleep(0.5)
                continue
            await self._ingest(msgs)

    async def _ingest(self, msgs: list[Msg]) -> None:
        batch: list[tuple[int, UsageEvent]] = []
        for msg in msgs:
            try:
                batch.append((msg.metadata.sequence.stream, schema.decode(msg.data, UsageEvent)))
            except Exception as exc:  # never decodable: do not let it come back forever
                self.stats["malformed"] += 1
                log.error("malformed usage message (seq %s) dropped: %s", msg.metadata.sequence.stream, exc)
                await msg.term()
        if msgs:
            self.pending = msgs[-1].metadata.num_pending
        if not batch:
            return
        written = await self._until_database(lambda: write_usage(self.engine, batch, self.prices),  # type: ignore
                                             "write usage", hold=msgs)
        for msg in msgs:
            await msg.ack()
        self.stats["inserted"] += written.inserted
        self.stats["duplicates"] += written.duplicates
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
        while True:
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
