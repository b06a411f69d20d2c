"""Leader election on a KV key: one admission replica at a time serves leases.

The leader holds key ``leader`` in the leases bucket, written with CAS and a per-key TTL and
renewed every TTL/3. A replica that finds the key absent (never written, or expired: its holder
died or stalled) creates it with CAS; of several, one wins. A leader whose renewal fails, or that
has not renewed for TTL - one renewal period, steps down before anyone else can have taken over
(the key it held cannot have expired yet), so two replicas never serve at once.

Each write carries the replica's term (a random token; its id alone is not enough, a restarted replica
reuses it). A write whose acknowledgement was lost (it timed out on a loaded machine, yet landed) leaves
the key one revision past the one the replica knows: its next renewal then conflicts, and finding its own
term on the key it goes on from that revision instead of stepping down with no leader for a whole TTL.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

from shared.bus import Bus
from shared.kv_cas import CasConflict, cas_put, get_last_with_headers
from shared.tasks import cancel_and_wait

LEADER_KEY = "leader"
TERM_HEADER = "Infermesh-Leader-Term"


class Leadership:
    def __init__(self, bus: Bus, bucket: str, candidate_id: str, ttl_s: float,
                 on_elected: Callable[[], Awaitable[None]], on_deposed: Callable[[], Awaitable[None]],
                 service: str = "admission") -> None:
        self._bus, self._bucket, self.candidate_id, self.ttl_s = bus, bucket, candidate_id, ttl_s
        self._service = service  # who leads: its logs say so, under its own logger
        self._log = logging.getLogger(f"infermesh.{service}")
        self._on_elected, self._on_deposed = on_elected, on_deposed
        self.is_leader = False
        self._revision = 0
        self._term = uuid.uuid4().hex  # which writes of the key are this replica's
        self._renewed_at = 0.0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"{self._service}-leadership")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        if self.is_leader:
            await self._step_down("stopping")
            await self._release_key()

    async def _release_key(self) -> None:
        """Hand over at once instead of after the TTL. The key is read first: a renewal cancelled by the stop
        may have landed after all, one revision past the one we know (CI saw the delete refused so)."""
        try:
            holder, revision, headers = await get_last_with_headers(self._bus, self._bucket, LEADER_KEY)
            if holder is not None and headers.get(TERM_HEADER) == self._term:
                kv = await self._bus.js.key_value(self._bucket)
                await kv.delete(LEADER_KEY, last=revision)
        except Exception as exc:
            self._log.warning("could not release the leader key: %s", exc)

    def still_leader(self) -> bool:
        """True while our key cannot have expired (checked before every grant)."""
        return self.is_leader and time.monotonic() - self._renewed_at < self.ttl_s * 2 / 3

    async def _loop(self) -> None:
        period = self.ttl_s / 3
        while True:
            try:
                if self.is_leader:
                    await self._renew()
                else:
                    await self._campaign()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._log.warning("leadership of %s: %s", self.candidate_id, exc)
                if self.is_leader and not self.still_leader():
                    await self._step_down(f"could not renew: {exc}")
            await asyncio.sleep(period)

    async def _campaign(self) -> None:
        holder, revision, headers = await get_last_with_headers(self._bus, self._bucket, LEADER_KEY)
        if holder is not None and headers.get(TERM_HEADER) != self._term:
            return  # someone leads (if it is our own write, a campaign whose ack was lost, we take it up again)
        try:
            self._revision = await self._write(revision)
        except CasConflict:
            return
        self._renewed_at = time.monotonic()
        self.is_leader = True
        self._log.info("%s %s is the leader", self._service, self.candidate_id)
        try:
            await self._on_elected()
        except Exception as exc:  # (it could not read the state it takes over): a leader serving nothing is worse
            await self._step_down(f"could not take over: {exc}")
            await self._release_key()
            raise

    async def _renew(self) -> None:
        try:
            self._revision = await self._write(self._revision)
        except CasConflict:
            holder, revision, headers = await get_last_with_headers(self._bus, self._bucket, LEADER_KEY)
            if holder is None or headers.get(TERM_HEADER) != self._term:
                await self._step_down("another replica holds the key" if holder else "the key lapsed")
                return
            self._log.info("%s %s: a renewal whose ack was lost had landed; going on from it", self._service,
                           self.candidate_id)
            self._revision = await self._write(revision)
        self._renewed_at = time.monotonic()

    async def _write(self, revision: int) -> int:
        return await cas_put(self._bus, self._bucket, LEADER_KEY, self.candidate_id.encode(), revision, self.ttl_s,
                             {TERM_HEADER: self._term})

    async def _step_down(self, why: str) -> None:
        self.is_leader = False
        self._log.warning("%s %s steps down: %s", self._service, self.candidate_id, why)
        await self._on_deposed()
