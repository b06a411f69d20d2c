"""Budget holds on real NATS: an admission leader SIGKILLed with costs the ledger does not have yet is replaced
by one that still refuses the team, keeps a dead edge's worst case, and admits once the ledger catches up."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid

from infermesh.local import LocalMesh
from services.admission.budgets import month_of
from shared import schema
from shared.bus import Bus, BusError
from shared.kv_cas import ensure_bucket, get_last
from shared.schema import (
    BudgetHold,
    LeaseGranted,
    LeaseRecord,
    LeaseRejected,
    LeaseRelease,
    LeaseReply,
    LeaseRequest,
    ModelPrice,
    PriceSheet,
    TeamSpend,
    UsageEvent,
    WorkerInfo,
)
from shared.usage import UsagePublisher, ensure_usage_stream
from tests.utils import eventually

PRICE = ModelPrice(input_micros=1_000_000, cached_input_micros=100_000, output_micros=4_000_000)  # $1 / $4 per 1M
BUDGET = 1_000_000  # nano-USD; a request of 100 prompt + 100 max tokens costs at most 100_000 + 400_000
WORST = 500_000
# Tests that need one leader throughout: with a 1 s TTL a loaded CI machine let the key lapse, the leader stepped
# down (its holds leave memory until the next one restores them) and a check read 0 mid-handover.
STEADY_LEADER_TTL_S = 10.0


class Edge:
    """The edge's side of admission and metering, by hand: leases, usage messages, releases."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.usage = UsagePublisher(bus)

    async def acquire(self, team: str = "t") -> LeaseGranted | LeaseRejected:
        """Asks until a leader answers (none does while one takes over)."""
        deadline = time.monotonic() + 10
        while True:
            request = LeaseRequest(uuid.uuid4().hex, team, "interactive", "m", 200, "edge-1", 1.0, 100, 100)
            try:
                reply = await self.bus.request(self.bus.subjects.admission_acquire, request, LeaseReply, timeout=3)
            except BusError:
                reply = None
            if isinstance(reply, LeaseGranted) or (reply is not None and reply.code != "admission_moved"):
                return reply
            assert time.monotonic() < deadline, "no admission leader answered"
            await asyncio.sleep(0.1)

    async def bill(self, team: str = "t", completion: int = 100) -> int:
        """Publish one request's usage (100 prompt tokens); its stream sequence."""
        return await self.usage.publish(UsageEvent(uuid.uuid4().hex, 0, team, "", "m", "finished", "length", 100, 0,
                                                   completion, 1.0, 2.0, "w-1"))

    async def release(self, lease_id: str, usage_seq: int = 0) -> None:
        await self.bus.publish(self.bus.subjects.admission_release, LeaseRelease(lease_id, usage_seq, 100, 0, 100))


async def key_exists(bus: Bus, key: str) -> bool:
    data, _ = await get_last(bus, bus.subjects.leases_bucket, key)
    return data is not None


async def setup_mesh(bus: Bus) -> None:
    """A worker for model "m" (no heartbeat needed: its entry never goes stale here), prices, team t's budget."""
    workers = await ensure_bucket(bus, bus.subjects.workers_bucket)
    await workers.put("w-1", schema.encode(WorkerInfo("w-1", "both", "m", "sim", 16, 1000, 4096, "none",
                                                      heartbeat_ttl_s=3600.0)))
    billing = await ensure_bucket(bus, bus.subjects.billing_bucket)
    await billing.put("prices", schema.encode(PriceSheet({"m": PRICE})))
    await ledger_says(bus, spent_nano=0, through_seq=0)
    await ensure_usage_stream(bus)


async def ledger_says(bus: Bus, spent_nano: int, through_seq: int) -> None:
    """What metering would publish for team t: its month's spend in the ledger, complete through ``through_seq``."""
    billing = await ensure_bucket(bus, bus.subjects.billing_bucket)
    await billing.put("spend.t", schema.encode(TeamSpend("t", month_of(time.time()), BUDGET, spent_nano, through_seq)))


async def test_a_new_leader_keeps_the_old_leaders_unledgered_costs_until_the_ledger_has_them(nats_url, namespace):
    bus = await Bus.connect(nats_url, namespace, "test-edge")
    await setup_mesh(bus)
    env = {**os.environ, "INFERMESH_NATS_URL": nats_url, "INFERMESH_NAMESPACE": namespace}
    leader_a = subprocess.Popen([sys.executable, "-m", "services.admission", "--admission-id", "adm-a",
                                 "--lease-ttl-s", "3", "--leader-ttl-s", "1"], env=env)
    mesh = LocalMesh(nats_url, namespace)
    edge = Edge(bus)
    try:
        async def leader() -> str | None:
            data, _ = await get_last(bus, bus.subjects.leases_bucket, "leader")
            return data.decode() if data else None

        await eventually(lambda: _equals(leader(), "adm-a"), 30, 0.1)
        standby = await mesh.start_admission(admission_id="adm-b", lease_ttl_s=3.0, leader_ttl_s=1.0)

        first = await edge.acquire()
        assert isinstance(first, LeaseGranted), first
        seq_first = await edge.bill()
        await edge.release(first.lease_id, seq_first)  # actual cost 500_000, not in the ledger yet: held
        await eventually(lambda: key_exists(bus, f"h-{first.lease_id}"), 5)
        running = await edge.acquire()  # 500_000 committed < budget: admitted, reserves 500_000 more
        assert isinstance(running, LeaseGranted), running
        refused = await edge.acquire()
        assert isinstance(refused, LeaseRejected) and refused.code == "insufficient_quota", refused

        leader_a.send_signal(signal.SIGKILL)  # no clean-up: its leader key lapses after 1 s
        await eventually(lambda: standby.leadership.is_leader, 10)
        refused = await edge.acquire()  # the hold + the running lease's reservation reach the budget
        assert isinstance(refused, LeaseRejected) and refused.code == "insufficient_quota", refused
        assert standby.stats["holds_restored"] == 1 and standby.stats["restored"] == 1

        await edge.bill(team="other")  # another team's usage: the stream moves past the first request's
        await eventually(lambda: standby.stats["lapsed"] == 1, 10)  # nobody renews the running lease: its edge died
        await eventually(lambda: key_exists(bus, f"h-{running.lease_id}"), 5)

        async def lease_record_gone() -> bool:  # the hold is durable first, then the lease record goes
            return not await key_exists(bus, f"l-{running.lease_id}")

        await eventually(lease_record_gone, 5)
        refused = await edge.acquire()  # its worst case is held until the ledger shows whether it billed
        assert isinstance(refused, LeaseRejected) and refused.code == "insufficient_quota", refused

        await ledger_says(bus, spent_nano=WORST, through_seq=seq_first)  # the first request reached the ledger
        await eventually(lambda: standby.budgets.held_nano("t") == WORST, 5)  # the lapsed lease's worst case
        refused = await edge.acquire()
        assert isinstance(refused, LeaseRejected) and refused.code == "insufficient_quota", refused
        last_seq = (await bus.js.stream_info(bus.subjects.usage_stream)).state.last_seq
        await ledger_says(bus, spent_nano=WORST, through_seq=last_seq)  # complete past the lapse: it billed nothing
        await eventually(lambda: standby.budgets.held_nano("t") == 0, 5)
        admitted = await edge.acquire()  # 500_000 in the ledger < budget
        assert isinstance(admitted, LeaseGranted), admitted
        await eventually(lambda: _none(key_exists(bus, f"h-{first.lease_id}"),
                                       key_exists(bus, f"h-{running.lease_id}")),
                         5)
    finally:
        await mesh.stop()
        if leader_a.poll() is None:
            leader_a.kill()
        leader_a.wait(10)
        await bus.close()


async def _equals(value, expected) -> bool:
    return await value == expected


async def _none(*checks) -> bool:
    return not any(await asyncio.gather(*checks))


async def test_a_lease_that_left_a_hold_is_not_restored_as_a_lease(nats_url, namespace):
    """The old leader wrote the hold and died before deleting the lease record: the lease ended, its cost is held."""
    bus = await Bus.connect(nats_url, namespace, "test-edge")
    await setup_mesh(bus)
    leases = await ensure_bucket(bus, bus.subjects.leases_bucket)
    await leases.put("l-ended", schema.encode(LeaseRecord("ended", "t", "interactive", "m", 200, "edge-1", WORST)))
    await leases.put("h-ended", schema.encode(BudgetHold("ended", "t", 400_000, 7)))
    await leases.put("l-running", schema.encode(LeaseRecord("running", "t", "interactive", "m", 200, "edge-1",
                                                            WORST)))
    mesh = LocalMesh(nats_url, namespace)
    try:
        admission = await mesh.start_admission(lease_ttl_s=30.0, leader_ttl_s=STEADY_LEADER_TTL_S)
        await eventually(lambda: admission.stats["restored"] == 1, 10)
        assert admission.stats["holds_restored"] == 1 and set(admission.models) == {"running"}
        assert admission.budgets.committed_nano("t", time.time()) == 400_000 + WORST
        assert not await key_exists(bus, "l-ended") and await key_exists(bus, "h-ended")
        assert await key_exists(bus, "l-running")
    finally:
        await mesh.stop()
        await bus.close()


async def test_a_release_that_arrives_while_a_lapse_is_pending_is_held_at_its_real_cost(nats_url, namespace,
                                                                                        monkeypatch):
    """The lease lapsed (its edge was cut off too long) and the usage stream's last sequence cannot be read yet,
    so its worst case is not a hold yet; the edge's late release must still leave a hold of its real cost.
    It was priced on model "" (nothing), made no hold, and the later lapse found no reservation: fail open."""
    bus = await Bus.connect(nats_url, namespace, "test-edge")
    await setup_mesh(bus)
    edge = Edge(bus)
    mesh = LocalMesh(nats_url, namespace)
    try:
        admission = await mesh.start_admission(lease_ttl_s=0.3, leader_ttl_s=STEADY_LEADER_TTL_S)
        await eventually(lambda: admission.leadership.is_leader, 10)
        unreadable, real_last_seq = True, admission._store.usage_last_seq

        async def last_seq() -> int | None:
            return None if unreadable else await real_last_seq()

        monkeypatch.setattr(admission._store, "usage_last_seq", last_seq)  # the stream info times out meanwhile
        granted = await edge.acquire()
        assert isinstance(granted, LeaseGranted)
        await eventually(lambda: granted.lease_id in admission._lapsed_models, 5)  # lapsed: no renewals
        seq = await edge.bill()
        await edge.release(granted.lease_id, seq)
        # the release's hold (100 in, 100 out), not the reservation (the same worst case): it was read too early,
        # before the release was handled, and the stream's last sequence was faked as 0 after the usage was in
        await eventually(lambda: admission.budgets.held_nano("t") == 500_000, 5)
        unreadable = False
        await eventually(lambda: not admission._lapsed_models, 5)
        assert admission.budgets.committed_nano("t", time.time()) == 500_000  # held once, not dropped, not doubled
    finally:
        await mesh.stop()
        await bus.close()


async def test_a_hold_made_while_a_lapse_is_pending_survives_a_leader_change(nats_url, namespace, monkeypatch):
    """The leader steps down between the late release's hold and the lapse's resolution: the next term restores
    the hold from the bucket, or (when the step-down cancelled the release's handler before its hold was written)
    restores the lease and lapses it again under the stream's real last sequence: held either way, never dropped.
    (CI once read 0 mid-handover, where the stream's sequence was still faked as 0.)"""
    bus = await Bus.connect(nats_url, namespace, "test-edge")
    await setup_mesh(bus)
    edge = Edge(bus)
    mesh = LocalMesh(nats_url, namespace)
    try:
        admission = await mesh.start_admission(lease_ttl_s=0.3, leader_ttl_s=1.0)
        await eventually(lambda: admission.leadership.is_leader, 10)
        unreadable = True

        real_last_seq = admission._store.usage_last_seq

        async def last_seq() -> int | None:
            return None if unreadable else await real_last_seq()

        monkeypatch.setattr(admission._store, "usage_last_seq", last_seq)
        granted = await edge.acquire()
        assert isinstance(granted, LeaseGranted)
        await eventually(lambda: granted.lease_id in admission._lapsed_models, 5)
        await edge.release(granted.lease_id, await edge.bill())
        await eventually(lambda: admission.budgets.committed_nano("t", time.time()) == 500_000, 5)
        await admission.leadership._step_down("test: a missed renewal")
        assert admission.budgets.committed_nano("t", time.time()) == 0  # not the leader: holds nothing
        unreadable = False
        await eventually(lambda: admission.leadership.is_leader and admission.stats["restored"]
                         + admission.stats["holds_restored"] >= 1 and not admission.models
                         and not admission._lapsed_models, 10)
        assert admission.budgets.committed_nano("t", time.time()) == 500_000
    finally:
        await mesh.stop()
        await bus.close()
