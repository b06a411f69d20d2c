"""The bus way in: ``<ns>.batch.submit.<team>`` submissions, each handled on its own, the loop supervised.

    a submission handled (a job made, or refused: its failed job says why)   ack
    an unexpected error (a database blip, a NATS timeout)                    nak: redelivered after submit_retry_s
    that error again on its submit_max_deliveries-th delivery (poison)       a failed job says why, then term
    the consuming loop dies (its pull subscription lost, a bug)              restarted after submit_restart_s,
                                                                             doubling to submit_restart_max_s
                                                                             (reset after a long run); ``up`` is
                                                                             False meanwhile (/health is 503)

Only the leader consumes (one durable pull consumer, ``batch``); a deposed leader stops it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Awaitable, Callable

from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from services.batch.config import BatchConfig
from shared.bus import Bus
from shared.tasks import cancel_and_wait

log = logging.getLogger("infermesh.batch")
SUBMIT_DURABLE = "batch"
STABLE_S = 30.0  # a loop that ran this long before dying is restarted after submit_restart_s again
STOP_WAIT_S = 3.0  # a fetch ends within its timeout even if nats-py swallowed the cancel

Handle = Callable[[Msg], Awaitable[None]]
Poisoned = Callable[[Msg, str], Awaitable[None]]


class SubmissionConsumer:
    def __init__(self, bus: Bus, config: BatchConfig, handle: Handle, poisoned: Poisoned) -> None:
        """``handle`` makes the submission's job (or its failed job) and raises only on an unexpected error;
        ``poisoned`` records why a submission that keeps failing is given up (a failed job under its id)."""
        self.bus, self.config, self.handle, self.poisoned = bus, config, handle, poisoned
        self.stats: Counter[str] = Counter()  # submissions, submissions_retried, _poisoned, _consumer_restarts
        self._running = False  # nats-py's fetch can swallow a cancel: the loop also ends when this is cleared
        self._supervisor: asyncio.Task[None] | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    @property
    def up(self) -> bool:
        """The consuming loop runs (False between a death and its restart)."""
        return self._loop_task is not None and not self._loop_task.done()

    async def start(self) -> None:
        self._running = True
        self._stopping.clear()
        self._supervisor = asyncio.create_task(self._supervise(), name="batch-submissions-supervisor")

    async def stop(self) -> None:
        self._running = False
        self._stopping.set()
        tasks = [task for task in (self._loop_task, self._supervisor) if task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=STOP_WAIT_S)
        await cancel_and_wait(*tasks)
        self._supervisor = self._loop_task = None

    # ------------------------------------------------------------ supervision
    async def _supervise(self) -> None:
        delay = self.config.submit_restart_s
        while self._running:
            self._loop_task = task = asyncio.create_task(self._consume(), name="batch-submissions")
            started = time.monotonic()
            await asyncio.wait({task})
            if not self._running:
                return
            if time.monotonic() - started >= STABLE_S:
                delay = self.config.submit_restart_s
            self.stats["submissions_consumer_restarts"] += 1
            error = "cancelled" if task.cancelled() else repr(task.exception() or "returned")
            log.error("batch submissions: the consumer died (%s); restarting it in %.1f s", error, delay,
                      exc_info=None if task.cancelled() else task.exception())
            try:
                await asyncio.wait_for(self._stopping.wait(), delay)
            except asyncio.TimeoutError:
                pass
            delay = min(delay * 2, self.config.submit_restart_max_s)

    async def _consume(self) -> None:
        s = self.bus.subjects
        sub = await self.bus.js.pull_subscribe(
            s.batch_submit_all, durable=SUBMIT_DURABLE, stream=s.batch_submit_stream,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=60, deliver_policy=DeliverPolicy.ALL))
        try:
            while self._running:
                try:
                    messages = await sub.fetch(8, timeout=1)
                except asyncio.TimeoutError:
                    continue
                except Exception as exc:  # the bus away a moment
                    log.warning("batch submissions: %s", exc)
                    await asyncio.sleep(1)
                    continue
                for msg in messages:
                    await self._one(msg)
        finally:  # else a fetch's late answer waits in its queue and the connection's drain waits for it
            await sub.unsubscribe()

    # ------------------------------------------------------------ one submission
    async def _one(self, msg: Msg) -> None:
        self.stats["submissions"] += 1
        try:
            await self.handle(msg)
        except Exception as exc:  # justified: any error of one submission must not end the loop for the others
            await self._failed(msg, exc)
            return
        await msg.ack()

    async def _failed(self, msg: Msg, exc: Exception) -> None:
        delivered = msg.metadata.num_delivered or 1
        if delivered < self.config.submit_max_deliveries:
            self.stats["submissions_retried"] += 1
            log.warning("batch submission %s (delivery %d): %r; it comes again in %.1f s", msg.subject, delivered,
                        exc, self.config.submit_retry_s)
            await msg.nak(delay=self.config.submit_retry_s)
            return
        log.error("batch submission %s failed %d times; it is given up", msg.subject, delivered, exc_info=exc)
        try:
            await self.poisoned(msg, f"The submission could not be processed after {delivered} tries.")
        except Exception as again:  # the database still away: it comes again, and is given up then
            log.warning("batch submission %s: its failure could not be recorded: %r", msg.subject, again)
            await msg.nak(delay=self.config.submit_retry_s)
            return
        self.stats["submissions_poisoned"] += 1
        await msg.term()
