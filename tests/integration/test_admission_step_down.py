"""An admission leader that steps down answers what it had received, on real NATS.

Seen in CI (the disaggregated vLLM e2e, a loaded 2-core machine): an acquire went unanswered for its whole 12 s
timeout and the client got 503 ``admission is unavailable``. A leader stepping down unsubscribed, which cancels
the handler running and drops the requests queued behind it in the subscription; none of them is ever answered.
Here the leader's first decision is held up while more acquires queue behind it, and another replica takes the
key: every request gets an answer (ask the new leader) at once.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from infermesh.local import LocalMesh
from services.admission.leader import LEADER_KEY
from shared import schema
from shared.bus import Bus, BusError
from shared.kv_cas import ensure_bucket
from shared.kv_keys import live_keys
from shared.schema import LeaseGranted, LeaseRejected, LeaseReply, LeaseRequest, WorkerInfo
from tests.utils import eventually


class SlowFirstDecision:
    """The leader's decisions as they are, except that the first waits until ``go`` is set (a handler held up, as
    on a loaded machine); ``entered`` once it waits."""

    def __init__(self, decide) -> None:
        self.decide, self.entered, self.go = decide, asyncio.Event(), asyncio.Event()

    async def __call__(self, request, raw):
        if not self.entered.is_set():
            self.entered.set()
            await self.go.wait()
        return await self.decide(request, raw)


async def _acquire(bus: Bus) -> LeaseReply | str:
    request = LeaseRequest(uuid.uuid4().hex, "t", "interactive", "m", 200, "edge-1", 0.0, 100, 100)
    try:
        return await bus.request(bus.subjects.admission_acquire, request, LeaseReply, timeout=8)
    except BusError as exc:
        return str(exc)


async def test_a_leader_stepping_down_answers_every_request_it_received(nats_url, namespace, bus):
    workers = await ensure_bucket(bus, bus.subjects.workers_bucket)
    await workers.put("w-1", schema.encode(WorkerInfo("w-1", "both", "m", "sim", 16, 1000, 4096, "none",
                                                      heartbeat_ttl_s=3600.0)))
    mesh = LocalMesh(nats_url, namespace)
    try:
        leader = await mesh.start_admission(admission_id="adm-a", leader_ttl_s=3.0)
        await eventually(lambda: leader.leadership.is_leader, 10)
        slow = leader._decide = SlowFirstDecision(leader._decide)
        first = asyncio.create_task(_acquire(bus))
        await asyncio.wait_for(slow.entered.wait(), 5)  # its handler is running
        queued = [asyncio.create_task(_acquire(bus)) for _ in range(4)]  # waiting behind it in the subscription
        await bus.nc.flush()

        leases = await bus.js.key_value(bus.subjects.leases_bucket)
        await leases.put(LEADER_KEY, b"adm-b")  # another replica's write: the next renewal finds the key taken
        await eventually(lambda: not leader.leadership.is_leader, 10)
        stepped_down_at = time.monotonic()
        slow.go.set()
        replies = await asyncio.gather(first, *queued)

        assert time.monotonic() - stepped_down_at < 5, "requests waited out their timeout"
        for reply in replies:  # decided after the step-down: each is told to ask the new leader
            assert isinstance(reply, LeaseRejected) and reply.code == "admission_moved", reply
    finally:
        await mesh.stop()


class FailingWrites:
    """The leases bucket's lease writes fail (its NATS server lost) while ``failing`` is set."""

    def __init__(self, put_lease) -> None:
        self.put_lease, self.failing = put_lease, True

    async def __call__(self, record) -> None:
        if self.failing:
            raise TimeoutError("nats: timeout")
        await self.put_lease(record)


async def test_a_lease_that_cannot_be_recorded_is_refused_at_once_and_its_capacity_comes_back(nats_url, namespace,
                                                                                              bus):
    """A grant's record must be durable before it is answered; when the bucket cannot take it the requester hears
    ``admission_unavailable`` at once (it waited out its whole timeout), and the capacity is not held."""
    workers = await ensure_bucket(bus, bus.subjects.workers_bucket)
    await workers.put("w-1", schema.encode(WorkerInfo("w-1", "both", "m", "sim", 1, 16, 4096, "none",
                                                      heartbeat_ttl_s=3600.0)))  # 16 tokens: one lease at a time
    mesh = LocalMesh(nats_url, namespace)
    try:
        leader = await mesh.start_admission(admission_id="adm-a", leader_ttl_s=3.0, admit_fraction=1.0)
        await eventually(lambda: leader.leadership.is_leader, 10)
        writes = leader._store.put_lease = FailingWrites(leader._store.put_lease)

        async def ask() -> LeaseReply | str:
            request = LeaseRequest(uuid.uuid4().hex, "t", "interactive", "m", 16, "edge-1", 0.0, 8, 8)
            try:
                return await bus.request(bus.subjects.admission_acquire, request, LeaseReply, timeout=5)
            except BusError as exc:
                return str(exc)

        asked_at = time.monotonic()
        refused = await ask()
        assert isinstance(refused, LeaseRejected) and refused.code == "admission_unavailable", refused
        assert time.monotonic() - asked_at < 2
        writes.failing = False
        granted = await ask()  # the refused lease holds no capacity: the pool's only slot is free
        assert isinstance(granted, LeaseGranted), granted
    finally:
        await mesh.stop()


class HeldLeaseWrite:
    """The leader's lease writes as they are, except that the first waits until ``go`` is set (a slow JetStream
    round trip); ``entered`` once it waits."""

    def __init__(self, put_lease) -> None:
        self.put_lease, self.entered, self.go = put_lease, asyncio.Event(), asyncio.Event()

    async def __call__(self, record) -> None:
        if not self.entered.is_set():
            self.entered.set()
            await self.go.wait()
        await self.put_lease(record)


async def test_a_grant_being_written_when_the_leader_steps_down_is_not_answered_granted(nats_url, namespace, bus):
    """Review finding 11: a grant's task wrote its lease record and answered granted after its leader had stepped
    down, while the new leader granted from the same capacity. It is fenced: the requester asks the new leader,
    and the record does not stay in the bucket."""
    workers = await ensure_bucket(bus, bus.subjects.workers_bucket)
    await workers.put("w-1", schema.encode(WorkerInfo("w-1", "both", "m", "sim", 16, 1000, 4096, "none",
                                                      heartbeat_ttl_s=3600.0)))
    mesh = LocalMesh(nats_url, namespace)
    try:
        leader = await mesh.start_admission(admission_id="adm-a", leader_ttl_s=3.0)
        await eventually(lambda: leader.leadership.is_leader, 10)
        held = leader._store.put_lease = HeldLeaseWrite(leader._store.put_lease)
        asked = asyncio.create_task(_acquire(bus))
        await asyncio.wait_for(held.entered.wait(), 5)  # granted; its record is being written

        leases = await bus.js.key_value(bus.subjects.leases_bucket)
        await leases.put(LEADER_KEY, b"adm-b")  # another replica's write: the leader steps down
        await eventually(lambda: not leader.leadership.is_leader, 10)
        held.go.set()
        reply = await asked

        assert isinstance(reply, LeaseRejected) and reply.code == "admission_moved", reply
        assert leader.stats["grants_fenced"] == 1
        assert [key for key in await live_keys(leases) if key.startswith("l-")] == []
    finally:
        await mesh.stop()
