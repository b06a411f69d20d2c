"""A team's reads of its own batch jobs, answered over core request/reply (MESH): a team creates no consumer and
calls no JetStream API (infermesh/batch_client.py asks these; infermesh/bus_roles.py ``team_permissions``).

    <ns>.batch.team.<team>.status   BatchTeamRequest(job_id)        -> BatchTeamReply(job, revision)
    <ns>.batch.team.<team>.follow   (job_id, revision, wait_s)      -> the job once its revision is not ``revision``,
                                                                       or as it is after ``wait_s`` (a long poll)
    <ns>.batch.team.<team>.results  (job_id, after, limit)          -> the job's results stored after sequence
                                                                       ``after``: ``last``, and ``more`` if full

The team is the subject's, never the body's: a team user may publish its own team's subjects only. A record's
revision is a digest of it: a job's record only moves forward (store.py), so another digest is a later record.
A follow waits on the service's own saves (``changed``), never by polling; a team has at most
``max_follows_per_team`` waiting at once (one more: 429 with ``retry_after_s``), each at most
``follow_wait_max_s``. Status and results are answered each in its own task, at most ``max_reads_per_team`` of a
team's at once (one more: 429), so a team flooding its reads waits on its own share and never delays another's;
a results page is at most ``results_page_max`` message gets and one message's bytes.

Invariants: a follow registers its watch before it reads the record, so a save between the two wakes it; when the
service stops leading, every waiting follow is answered at once with the record as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections import Counter
from typing import Iterator

import msgspec
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError
from sqlalchemy.ext.asyncio import AsyncEngine

from services.batch import store
from services.batch.config import BatchConfig
from shared.batch_schema import (
    BATCH_TEAM_READS,
    MAX_BATCH_ID,
    BatchJobRecord,
    BatchLineResult,
    BatchTeamReply,
    BatchTeamRequest,
)
from shared.bus import Bus, stop_serving
from shared.bus_limits import ENVELOPE_BYTES

log = logging.getLogger("infermesh.batch")
FOLLOWS_RETRY_S = 1.0  # a team past its follows at once asks again after this


class BadRead(Exception):
    """A read the service cannot answer (its job id is no job id): 400."""


def revision_of(record: BatchJobRecord | None) -> str:
    return "" if record is None else hashlib.sha256(msgspec.json.encode(record)).hexdigest()[:24]


def team_and_read(subject: str) -> tuple[str, str]:
    """``<ns>.batch.team.<team>.<read>`` -> (team, read)."""
    *_, team, read = subject.split(".")
    return team, read


def checked_job_id(job_id: str) -> str:
    if not job_id or len(job_id) > MAX_BATCH_ID or any(c in job_id for c in ". *>\t\r\n"):
        raise BadRead(f"'{job_id[:MAX_BATCH_ID]}' is not a batch id")
    return job_id


class JobWatches:
    """Who waits for a change of which job; ``changed`` wakes them (pure: no I/O)."""

    def __init__(self) -> None:
        self._waiting: dict[tuple[str, str], set[asyncio.Event]] = {}

    @contextlib.contextmanager
    def watch(self, team: str, job_id: str) -> Iterator[asyncio.Event]:
        key, event = (team, job_id), asyncio.Event()
        self._waiting.setdefault(key, set()).add(event)
        try:
            yield event
        finally:
            waiting = self._waiting[key]
            waiting.discard(event)
            if not waiting:
                del self._waiting[key]

    def changed(self, team: str, job_id: str) -> None:
        for event in self._waiting.get((team, job_id), ()):
            event.set()

    def wake_all(self) -> None:
        for waiting in self._waiting.values():
            for event in waiting:
                event.set()

    def __len__(self) -> int:
        return sum(len(waiting) for waiting in self._waiting.values())


class TeamSlots:
    """At most ``limit`` of one team's long polls at once (pure)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held: Counter[str] = Counter()

    def take(self, team: str) -> bool:
        if self.held[team] >= self.limit:
            return False
        self.held[team] += 1
        return True

    def give_back(self, team: str) -> None:
        self.held[team] -= 1
        if self.held[team] <= 0:
            del self.held[team]


class TeamReads:
    """The leader's answers to teams' reads (started and stopped with the lead, as the edges' API)."""

    def __init__(self, bus: Bus, engine: AsyncEngine, config: BatchConfig) -> None:
        self.bus, self.engine, self.config = bus, engine, config
        self.watches = JobWatches()
        self.slots = TeamSlots(config.max_follows_per_team)
        self.read_slots = TeamSlots(config.max_reads_per_team)
        self._sub = None
        self._follows: set[asyncio.Task[None]] = set()  # follows and reads being answered
        self._stopping = False

    async def start(self) -> None:
        self._stopping = False
        self._sub = await self.bus.subscribe(self.bus.subjects.batch_team_all, BatchTeamRequest, self._on_request)

    async def stop(self) -> None:
        if self._sub is not None:
            await stop_serving([self._sub])
            self._sub = None
        self._stopping = True
        self.watches.wake_all()  # each waiting follow answers with the record as it is
        await asyncio.gather(*self._follows, return_exceptions=True)

    def changed(self, record: BatchJobRecord) -> None:
        """The job was saved: its followers read it again."""
        self.watches.changed(record.team, record.id)

    async def _on_request(self, request: BatchTeamRequest, raw: Msg) -> None:
        team, read = team_and_read(raw.subject)
        if read not in BATCH_TEAM_READS:
            return
        slots, what = (self.slots, "follows") if read == "follow" else (self.read_slots, "reads")
        if not slots.take(team):
            await self.bus.respond(raw, BatchTeamReply(
                error_status=429, retry_after_s=FOLLOWS_RETRY_S,
                error_message=f"Team {team} has {slots.limit} batch {what} in progress already."))
            return
        reads = {"follow": lambda: self._follow(team, request), "status": lambda: self._status(team, request.job_id),
                 "results": lambda: self._results(team, request)}
        task = asyncio.create_task(self._answer(raw, reads[read]()), name=f"batch-{read}")
        self._follows.add(task)
        task.add_done_callback(lambda done: (self._follows.discard(done), slots.give_back(team)))

    async def _answer(self, raw: Msg, reading) -> None:  # noqa: ANN001 (a coroutine of a BatchTeamReply)
        try:
            reply = await reading
        except BadRead as exc:
            reply = BatchTeamReply(error_status=400, error_message=str(exc))
        except Exception:
            log.exception("a team's read on %s failed", raw.subject)
            reply = BatchTeamReply(error_status=500, error_message="The batch service had an error.")
        await self.bus.respond(raw, reply)

    async def _status(self, team: str, job_id: str) -> BatchTeamReply:
        record = await store.get_job(self.engine, team, checked_job_id(job_id))
        return BatchTeamReply(job=record, revision=revision_of(record))

    async def _follow(self, team: str, request: BatchTeamRequest) -> BatchTeamReply:
        """The job once its revision is not the caller's, or as it is when the wait is over."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(max(request.wait_s, 0.0), self.config.follow_wait_max_s)
        with self.watches.watch(team, checked_job_id(request.job_id)) as changed:
            while True:
                changed.clear()  # before the read: a save after it sets it again
                reply = await self._status(team, request.job_id)
                left = deadline - loop.time()
                if reply.revision != request.revision or left <= 0 or self._stopping:
                    return reply
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(left):
                        await changed.wait()

    async def _results(self, team: str, request: BatchTeamRequest) -> BatchTeamReply:
        """The job's results after sequence ``after``, up to the page's size and one message's bytes."""
        s = self.bus.subjects
        subject = s.batch_results(team, checked_job_id(request.job_id))
        limit = max(1, min(request.limit, self.config.results_page_max))
        room = self.bus.nc.max_payload - ENVELOPE_BYTES
        results: list[BatchLineResult] = []
        last = max(request.after, 0)
        while len(results) < limit:
            try:
                msg = await self.bus.js.get_msg(s.batch_results_stream, seq=last + 1, subject=subject, next=True)
            except NotFoundError:
                return BatchTeamReply(results=results, last=last)
            data = msg.data or b""
            room -= len(data)
            if results and room < 0:  # on the next page
                break
            results.append(msgspec.json.decode(data, type=BatchLineResult))
            last = msg.seq
        return BatchTeamReply(results=results, last=last, more=True)
