"""Breaker service: outcomes in, one ``Breaker`` per worker, its state in the breakers bucket.

    <ns>.outcome.*  Outcome (edges)  -> Breaker.record      -> transition?
    registry watch: a worker gone    -> heartbeat_lapsed    -> transition?   (back again: reset)
    every tick_s                     -> Breaker.tick        -> transition?   (cool-down over, probe overdue)
    breakers bucket watch            -> Breaker.probe_taken (a router took the half-open permit)
    transition -> CAS write of the worker's BreakerRecord, <ns>.breaker.transitions, a counter

Replicas compute the same transitions from the same streams; the CAS write makes the second one a
no-op. A restarted service takes each worker's state back from the bucket (its outcome windows
start empty).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

from nats.aio.msg import Msg

from services.breaker.config import BreakerConfig
from services.breaker.state import Breaker, State, Transition
from shared.breakers import BreakerView, RecordConflict
from shared.bus import Bus
from shared.metrics import service_registry
from shared.registry import WorkerDirectory
from shared.schema import BreakerRecord, BreakerTransition, Outcome, WorkerInfo
from shared.tasks import cancel_and_wait

log = logging.getLogger("infermesh.breaker")


class BreakerService:
    def __init__(self, bus: Bus, config: BreakerConfig | None = None) -> None:
        self.config = config or BreakerConfig()
        self.bus = bus
        self.view = BreakerView(bus)
        self.directory = WorkerDirectory(bus)
        self.breakers: dict[str, Breaker] = {}
        self.stats: Counter[str] = Counter()  # transitions:<state>, transitions:<reason>, outcomes, ...
        self.metrics = service_registry("infermesh_breaker", lambda: self.stats, lambda: {
            "workers": {state.value: sum(b.state is state for b in self.breakers.values()) for state in State}},
            known=("outcomes", "transitions"))
        self._writes: asyncio.Queue[Transition] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._sub = None

    async def start(self) -> None:
        await self.view.start()
        for worker_id, (record, _) in self.view.records.items():  # take the state back after a restart
            self.breakers[worker_id] = self._from_record(record)
        self.view.on_change.append(self._on_record)
        self.directory.on_added.append(self._on_worker_added)
        self.directory.on_removed.append(self._on_worker_gone)
        await self.directory.start()
        self._sub = await self.bus.subscribe(self.bus.subjects.outcome_all, Outcome, self._on_outcome)
        self._tasks = [asyncio.create_task(self._tick_loop(), name="breaker-tick"),
                       asyncio.create_task(self._write_loop(), name="breaker-write")]
        log.info("breaker ready (%d workers known)", len(self.breakers))

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
        await cancel_and_wait(*self._tasks)
        await self.directory.stop()
        await self.view.stop()

    # ------------------------------------------------------------ inputs
    def breaker(self, worker_id: str) -> Breaker:
        breaker = self.breakers.get(worker_id)
        if breaker is None:
            breaker = self.breakers[worker_id] = Breaker(worker_id, self.config.policy(), since=time.time())
        return breaker

    async def _on_outcome(self, outcome: Outcome, _raw: Msg) -> None:
        self.stats["outcomes"] += 1
        self._apply(self.breaker(outcome.worker_id).record(time.time(), outcome.ok, outcome.request_id))

    def _on_worker_gone(self, worker_id: str) -> None:
        self._apply(self.breaker(worker_id).heartbeat_lapsed(time.time()))

    def _on_worker_added(self, info: WorkerInfo) -> None:
        breaker = self.breakers.get(info.worker_id)
        if breaker is not None and breaker.state is State.OPEN:
            self._apply(breaker.reset(time.time()))  # a new process under the same id

    def _on_record(self, record: BreakerRecord) -> None:
        """Someone else wrote the record: a router took the probe permit, or a replica moved it."""
        breaker = self.breaker(record.worker_id)
        if record.state == State.HALF_OPEN.value and record.probe_request_id and record.period == breaker.period:
            breaker.probe_taken(record.probe_request_id, time.time())

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_s)
            now = time.time()
            for breaker in list(self.breakers.values()):
                self._apply(breaker.tick(now))

    # ------------------------------------------------------------ outputs
    def _apply(self, transition: Transition | None) -> None:
        if transition is None:
            return
        self.stats[f"transitions:{transition.new.value}"] += 1
        self.stats[f"transitions:{transition.reason}"] += 1
        log.info("breaker %s: %s -> %s (%s)", transition.worker_id, transition.old.value, transition.new.value,
                 transition.reason)
        self._writes.put_nowait(transition)

    async def _write_loop(self) -> None:
        """Write transitions in order: the record, then the event."""
        while True:
            transition = await self._writes.get()
            try:
                await self._write(transition)
                await self.bus.publish(self.bus.subjects.breaker_transitions, BreakerTransition(
                    transition.worker_id, transition.old.value, transition.new.value, transition.reason,
                    transition.at))
            except Exception as exc:
                log.error("breaker %s: could not write %s: %s", transition.worker_id, transition.new.value, exc)

    async def _write(self, transition: Transition) -> None:
        breaker = self.breakers[transition.worker_id]
        for _ in range(5):
            current, revision = self.view.records.get(transition.worker_id, (None, 0))
            if current is not None and current.period == breaker.period and current.state == breaker.state.value:
                if current.probe_request_id and breaker.state is State.HALF_OPEN:
                    breaker.probe_taken(current.probe_request_id, time.time())
                if current.since >= breaker.since:
                    return  # already there (a replica wrote it first)
            record = BreakerRecord(breaker.worker_id, breaker.state.value, breaker.since, transition.reason,
                                   breaker.period, breaker.probe_request_id)
            try:
                await self.view.put(record, revision)
                return
            except RecordConflict:  # a router took a probe, or a replica wrote: read and merge
                fresh, rev = await self.view.read(transition.worker_id)
                if fresh is not None:
                    self.view.records[transition.worker_id] = (fresh, rev)
        raise RecordConflict(transition.worker_id)

    def _from_record(self, record: BreakerRecord) -> Breaker:
        return Breaker(record.worker_id, self.config.policy(), State(record.state), record.since, record.period,
                       record.probe_request_id, record.since if record.probe_request_id else 0.0)
