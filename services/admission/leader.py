"""Leader election on a KV key: one admission replica at a time serves leases.

The leader holds key ``leader`` in the leases bucket, written with CAS and a per-key TTL and
renewed every TTL/3. A replica that finds the key absent (never written, or expired: its holder
died or stalled) creates it with CAS; of several, one wins. A leader whose renewal fails, or that
has not renewed for TTL - one renewal period, steps down before anyone else can have taken over
(the key it held cannot have expired yet), so two replicas never serve at once. The server times the key's TTL
from when it stored the write, which is after the write was sent: so a leader's tenure is timed from the instant
before it sent its write (``Tenure``), never from when the acknowledgement came back (an ack that took a second
on a loaded machine would otherwise grant a second the key may no longer be ours).

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
SAFE_FRACTION = 2 / 3  # of the TTL: a leader acts for this long after a write, leaving a renewal period's margin


class Tenure:
    """How long a leader may act on the key it wrote, pure: from the instant its last landed write was *sent*
    (the server's TTL cannot have started earlier), for ``ttl_s * SAFE_FRACTION``."""

    __slots__ = ("ttl_s", "sent_at")

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.sent_at: float | None = None  # None: no write of ours landed

    def renewed(self, sent_at: float) -> None:
        """A write sent at ``sent_at`` (the clock read before sending it) landed."""
        self.sent_at = sent_at

    def valid(self, now: float) -> bool:
        return self.sent_at is not None and now - self.sent_at < self.ttl_s * SAFE_FRACTION


class Leadership:
    def __init__(self, bus: Bus, bucket: str, candidate_id: str, ttl_s: float,
                 on_elected: Callable[[], Awaitable[None]], on_deposed: Callable[[], Awaitable[None]],
                 service: str = "admission", clock: Callable[[], float] = time.monotonic) -> None:
        self._bus, self._bucket, self.candidate_id, self.ttl_s = bus, bucket, candidate_id, ttl_s
        self._service = service  # who leads: its logs say so, under its own logger
        self._log = logging.getLogger(f"infermesh.{service}")
        self._on_elected, self._on_deposed = on_elected, on_deposed
        self.is_leader = False
        self._revision = 0
        self._term = uuid.uuid4().hex  # which writes of the key are this replica's
        self._clock = clock
        self._tenure = Tenure(ttl_s)
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
        return self.is_leader and self._tenure.valid(self._clock())

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
        sent_at = self._clock()  # before the write: the server's TTL starts after this, never before
        try:
            self._revision = await self._write(revision)
        except CasConflict:
            return
        self._tenure.renewed(sent_at)
        self.is_leader = True
        self._log.info("%s %s is the leader", self._service, self.candidate_id)
        try:
            await self._on_elected()
        except Exception as exc:  # (it could not read the state it takes over): a leader serving nothing is worse
            await self._step_down(f"could not take over: {exc}")
            await self._release_key()
            raise

    async def _renew(self) -> None:
        sent_at = self._clock()  # a retry below is sent later: timing both from here errs on the safe side
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
        self._tenure.renewed(sent_at)

    async def _write(self, revision: int) -> int:
        return await cas_put(self._bus, self._bucket, LEADER_KEY, self.candidate_id.encode(), revision, self.ttl_s,
                             {TERM_HEADER: self._term})

    async def _step_down(self, why: str) -> None:
        self.is_leader = False
        self._log.warning("%s %s steps down: %s", self._service, self.candidate_id, why)
        await self._on_deposed()
