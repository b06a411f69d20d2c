"""What the admission leader keeps durable in the leases bucket, so that a new leader starts where it stopped.

    <ns>_leases   l-<lease>   LeaseRecord   a granted lease and its budget reservation (put before the grant is
                                            answered; deleted when the lease ends)
                  h-<lease>   BudgetHold    a cost the ledger may not have yet (put when a lease ends with one;
                                            deleted once the ledger has passed it, budgets.py)
                  leader      the leader's id (leader.py)

Order is the invariant: a lease's hold is written before its lease record is deleted, so at every moment
each unledgered cost is in the bucket at least once (as a reservation or a hold). A leader that finds
both for one lease keeps the hold and deletes the record: the lease ended, only its cost is pending.
A write that fails raises (the caller keeps the record it would have replaced); a delete that fails is
logged (a stale hold only delays the team, it is cleared again when the ledger passes it).
"""

from __future__ import annotations

import logging

from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue

from services.admission.budgets import HoldChanges
from shared import schema
from shared.bus import Bus
from shared.kv_cas import traced_delete, traced_put
from shared.kv_keys import live_keys
from shared.schema import BudgetHold, LeaseRecord

log = logging.getLogger("infermesh.admission")
LEASE, HOLD = "l-", "h-"
# a lease's or hold's delete marker expires then: each key is used once, so kept markers (one per request ever
# admitted) filled the bucket to its max_bytes, and then every grant failed (503 "could not record the lease");
# nothing watches this bucket (a new leader reads its live keys), so the marker need not outlive the delete long
MARKER_TTL_S = 60.0


class LeaseStore:
    def __init__(self, bus: Bus, kv: KeyValue, marker_ttl_s: float = MARKER_TTL_S) -> None:
        self.bus, self.kv = bus, kv
        self._bucket = bus.subjects.leases_bucket  # written with the request's trace (shared/kv_cas.py)
        self._marker_ttl_s = marker_ttl_s

    async def put_lease(self, record: LeaseRecord) -> None:
        await traced_put(self.bus, self._bucket, LEASE + record.lease_id, schema.encode(record))

    async def forget_lease(self, lease_id: str) -> None:
        await self._delete(LEASE + lease_id)

    async def apply(self, changes: HoldChanges) -> None:
        for hold in changes.put:
            await traced_put(self.bus, self._bucket, HOLD + hold.hold_id, schema.encode(hold))
        for hold_id in changes.gone:
            await self._delete(HOLD + hold_id)

    async def load(self) -> tuple[list[LeaseRecord], list[BudgetHold]]:
        """Every lease record and hold in the bucket; the records of leases that already left a hold are deleted."""
        keys = await live_keys(self.kv)  # raises on any error: a leader that read nothing would forget every lease
        holds = [hold for key in keys if key.startswith(HOLD)
                 if (hold := await self._get(key, BudgetHold)) is not None]
        held = {hold.hold_id for hold in holds}
        leases = []
        for key in keys:
            if key.startswith(LEASE) and (record := await self._get(key, LeaseRecord)) is not None:
                if record.lease_id in held:
                    await self.forget_lease(record.lease_id)
                else:
                    leases.append(record)
        return leases, holds

    async def usage_last_seq(self) -> int | None:
        """The usage stream's last sequence (0: no stream, so no usage was ever sent); None if it cannot be read."""
        try:
            info = await self.bus.ledger_js.stream_info(self.bus.subjects.usage_stream)  # LEDGER, when locked
        except NotFoundError:
            return 0
        except Exception as exc:
            log.warning("cannot read the usage stream's last sequence: %s", exc)
            return None
        return info.state.last_seq

    async def _get(self, key: str, kind: type) -> object | None:
        try:
            entry = await self.kv.get(key)
        except Exception:  # deleted meanwhile
            return None
        return schema.decode(entry.value, kind) if entry.value else None

    async def _delete(self, key: str) -> None:
        try:
            await traced_delete(self.bus, self._bucket, key, self._marker_ttl_s)
        except Exception as exc:
            log.warning("could not delete %s: %s", key, exc)
