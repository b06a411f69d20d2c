"""An edge asks again for a ticket it heard nothing of (its ask was lost with a dead leader, or its ask timed out
while queued), on real NATS: admission answers the ticket as it stands and never counts it twice. Queued: one
place in the queue, the newest ask answered when it is granted. Granted: the same lease again."""

from __future__ import annotations

import asyncio
import uuid

from infermesh.local import LocalMesh
from shared import schema
from shared.bus import BusError
from shared.kv_cas import ensure_bucket
from shared.schema import LeaseGranted, LeaseRelease, LeaseReply, LeaseRequest, WorkerInfo
from tests.utils import eventually


async def _ask(bus, ticket: str, wait_s: float, timeout: float) -> LeaseReply | str:
    request = LeaseRequest(ticket, "t", "interactive", "m", 16, "edge-1", wait_s, 8, 8)
    try:
        return await bus.request(bus.subjects.admission_acquire, request, LeaseReply, timeout=timeout)
    except BusError as exc:
        return str(exc)


async def test_a_ticket_asked_again_is_answered_as_it_stands_and_counted_once(nats_url, namespace, bus):
    workers = await ensure_bucket(bus, bus.subjects.workers_bucket)
    await workers.put("w-1", schema.encode(WorkerInfo("w-1", "both", "m", "sim", 1, 16, 4096, "none",
                                                      heartbeat_ttl_s=3600.0)))  # 16 tokens: one lease at a time
    mesh = LocalMesh(nats_url, namespace)
    try:
        leader = await mesh.start_admission(admission_id="adm-a", admit_fraction=1.0)
        await eventually(lambda: leader.leadership.is_leader, 10)
        holder = uuid.uuid4().hex
        granted = await _ask(bus, holder, 0.0, 5)
        assert isinstance(granted, LeaseGranted) and granted.lease_id == holder
        again = await _ask(bus, holder, 0.0, 5)  # its grant's answer was lost: the same lease, not a second
        assert isinstance(again, LeaseGranted) and again.lease_id == holder
        assert len(leader.ledgers["m"].leases) == 1

        waiting = uuid.uuid4().hex
        assert "timeout" in await _ask(bus, waiting, 10.0, 0.5)  # queued behind the holder; the edge moves on
        newest = asyncio.create_task(_ask(bus, waiting, 10.0, 10))  # and asks again
        await eventually(lambda: leader.stats["asked_again"] == 2, 5)
        assert len(leader.ledgers["m"].waiters) == 1  # one place in the queue
        await bus.publish(bus.subjects.admission_release, LeaseRelease(holder))
        answer = await newest
        assert isinstance(answer, LeaseGranted) and answer.lease_id == waiting
    finally:
        await mesh.stop()
