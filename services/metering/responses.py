"""Stored responses (the Responses API's ``store`` and ``previous_response_id``) in the ledger, served to edges.

    edge --ResponsesApiRequest--> <ns>.responses.api.<operation> (queue group: any metering replica answers)
         <-- ResponsesApiReply (shared/responses_schema.py)

The ledger's ``stored_responses`` table is the state, so every replica answers every operation. A response lives
``retention_s`` from its creation: past ``expires_at`` no read finds it (the filter is in every query, so it is
gone at once), and the sweep deletes such rows every ``sweep_s``. A team reads, lists and deletes only its own
(another team's id is the same 404 as an unknown one). ``context`` walks the chain of ``previous_response_id`` in
one recursive query: each response's input items, then its output, oldest first; a chain whose older part was
deleted or has expired cannot be continued (400 naming the response that is missing).

Each request runs as a task of its own (a slow write does not hold up the reads behind it). While the database
is away every operation answers 503 ``ledger_unavailable``; the edge then reports the response as not stored.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from typing import Any

import msgspec
from nats.aio.msg import Msg
from sqlalchemy import delete, literal, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from services.metering.db import sessions
from services.metering.models import StoredResponseRow
from shared.bus import Bus, stop_serving
from shared.responses_schema import MAX_CHAIN, OPERATIONS, ResponsesApiReply, ResponsesApiRequest, StoredResponse

log = logging.getLogger("infermesh.metering")
UTC = dt.timezone.utc
SWEEP_BATCH = 1000
_TABLE = StoredResponseRow.__table__


class ResponseNotFound(Exception):
    pass


class BrokenChain(Exception):
    def __init__(self, missing: str) -> None:
        super().__init__(missing)
        self.missing = missing


def _utc(seconds: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(seconds, UTC)


# ------------------------------------------------------------ the table (pure database functions)
async def store(engine: AsyncEngine, record: StoredResponse, retention_s: float) -> None:
    """Keep ``record`` until ``retention_s`` after it was created; a second store of one id changes nothing."""
    created = _utc(record.created_at)
    row = StoredResponseRow(id=record.id, team=record.team, created_at=created,
                            expires_at=created + dt.timedelta(seconds=retention_s),
                            previous_response_id=record.previous_response_id,
                            response=msgspec.json.decode(record.response),
                            input_items=msgspec.json.decode(record.input_items))
    try:
        async with sessions(engine)() as session, session.begin():
            session.add(row)
    except IntegrityError:  # stored already (a request asked again): the first one stands
        async with sessions(engine)() as session:
            if await session.get(StoredResponseRow, record.id) is None:
                raise


async def fetch(engine: AsyncEngine, team: str, response_id: str, now: dt.datetime) -> StoredResponseRow:
    async with sessions(engine)() as session:
        row = await session.get(StoredResponseRow, response_id)
    if row is None or row.team != team or _aware(row.expires_at) <= now:
        raise ResponseNotFound(response_id)
    return row


async def remove(engine: AsyncEngine, team: str, response_id: str, now: dt.datetime) -> None:
    async with sessions(engine)() as session, session.begin():
        done = await session.execute(delete(StoredResponseRow).where(
            StoredResponseRow.id == response_id, StoredResponseRow.team == team, StoredResponseRow.expires_at > now))
    if done.rowcount == 0:  # type: ignore[attr-defined]
        raise ResponseNotFound(response_id)


async def conversation(engine: AsyncEngine, team: str, response_id: str, now: dt.datetime) -> list[Any]:
    """The items a request continuing ``response_id`` sees: along its chain, oldest first, each response's input
    items then its output. ResponseNotFound: ``response_id`` itself; BrokenChain: one it continues is gone."""
    t = _TABLE
    alive = (t.c.team == team) & (t.c.expires_at > now)
    chain = select(t.c.id, t.c.previous_response_id, literal(0).label("depth")).where(
        t.c.id == response_id, alive).cte("chain", recursive=True)
    chain = chain.union_all(select(t.c.id, t.c.previous_response_id, chain.c.depth + 1).join(
        chain, t.c.id == chain.c.previous_response_id).where(alive, chain.c.depth < MAX_CHAIN))
    query = select(t.c.previous_response_id, t.c.input_items, t.c.response).join(chain, t.c.id == chain.c.id)
    async with engine.connect() as conn:
        rows = (await conn.execute(query.order_by(chain.c.depth.desc()))).all()
    if not rows:
        raise ResponseNotFound(response_id)
    if rows[0].previous_response_id is not None:
        raise BrokenChain(rows[0].previous_response_id)
    items: list[Any] = []
    for row in rows:
        items += row.input_items
        items += row.response.get("output") or []
    return items


async def sweep(engine: AsyncEngine, now: dt.datetime, limit: int = SWEEP_BATCH) -> int:
    """Delete up to ``limit`` expired responses; how many went."""
    async with sessions(engine)() as session, session.begin():
        ids = (await session.execute(select(StoredResponseRow.id).where(StoredResponseRow.expires_at <= now)
                                     .limit(limit))).scalars().all()
        if ids:
            await session.execute(delete(StoredResponseRow).where(StoredResponseRow.id.in_(ids)))
    return len(ids)


def _aware(at: dt.datetime) -> dt.datetime:
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)  # SQLite gives back naive UTC


# ------------------------------------------------------------ the bus
def _not_found(response_id: str) -> ResponsesApiReply:
    return ResponsesApiReply(error_status=404, error_message=f"Response with id '{response_id}' not found.",
                             error_param="response_id", error_code="not_found")


class ResponsesServer:
    """Answers ``<ns>.responses.api.*`` from the ledger; sweeps what has expired."""

    def __init__(self, bus: Bus, engine: AsyncEngine, retention_s: float, sweep_s: float) -> None:
        self.bus, self.engine, self.retention_s, self.sweep_s = bus, engine, retention_s, sweep_s
        self._subs: list[Any] = []
        self._running: set[asyncio.Task[None]] = set()
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        for operation in OPERATIONS:
            self._subs.append(await self.bus.subscribe(self.bus.subjects.responses_api(operation),
                                                       ResponsesApiRequest, self._handler(operation),
                                                       queue="metering"))
        await self.bus.nc.flush()  # from here on an edge's request on any connection finds a responder
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="metering-responses-sweep")

    async def stop(self) -> None:
        await stop_serving(self._subs)
        self._subs.clear()
        if self._running:
            await asyncio.wait(self._running, timeout=5.0)
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.wait([self._sweeper], timeout=5.0)

    def _handler(self, operation: str):  # type: ignore[no-untyped-def]
        async def on_request(request: ResponsesApiRequest, raw: Msg) -> None:
            task = asyncio.create_task(self._answer(operation, request, raw), name=f"responses-{operation}")
            self._running.add(task)
            task.add_done_callback(self._running.discard)
        return on_request

    async def _answer(self, operation: str, request: ResponsesApiRequest, raw: Msg) -> None:
        try:
            reply = await self.run(operation, request)
        except Exception as exc:  # the database is away, or refused the write
            log.warning("metering: cannot %s a stored response (%s: %s)", operation, type(exc).__name__, exc)
            reply = ResponsesApiReply(error_status=503, error_message="The ledger is unavailable; stored responses "
                                      "cannot be read or written now.", error_code="ledger_unavailable")
        try:
            await self.bus.respond(raw, reply)
        except Exception as exc:  # NATS away, or the reply is over max_payload
            log.warning("metering: cannot answer %s: %s", raw.subject, exc)
            if reply.items or reply.response:  # over max_payload: say so rather than leave the edge waiting
                try:
                    await self.bus.respond(raw, ResponsesApiReply(
                        error_status=400, error_message=f"The stored conversation is too large to send back ({exc}):"
                        " send it whole as input instead.", error_param="previous_response_id", error_code="too_large"))
                except Exception as again:
                    log.warning("metering: cannot answer %s: %s", raw.subject, again)

    async def run(self, operation: str, request: ResponsesApiRequest) -> ResponsesApiReply:
        """One operation's answer (OpenAI-shaped errors for what is the caller's); raises when the database is."""
        now, response_id = dt.datetime.now(UTC), request.response_id
        try:
            if operation == "store":
                if request.record is None or request.record.team != request.team:
                    return ResponsesApiReply(error_status=400, error_message="store needs the team's own record.")
                await store(self.engine, request.record, self.retention_s)
                return ResponsesApiReply()
            if operation == "delete":
                await remove(self.engine, request.team, response_id, now)
                return ResponsesApiReply()
            if operation == "context":
                items = await conversation(self.engine, request.team, response_id, now)
                return ResponsesApiReply(items=msgspec.json.encode(items))
            row = await fetch(self.engine, request.team, response_id, now)
        except ResponseNotFound:
            if operation == "context":
                return ResponsesApiReply(error_status=400, error_param="previous_response_id",
                                         error_message=f"Previous response with id '{response_id}' not found.",
                                         error_code="previous_response_not_found")
            return _not_found(response_id)
        except BrokenChain as gone:
            return ResponsesApiReply(
                error_status=400, error_param="previous_response_id", error_code="previous_response_not_found",
                error_message=f"Response '{response_id}' continues '{gone.missing}', which was deleted or has "
                              "expired: the conversation cannot be continued by previous_response_id.")
        if operation == "get":
            return ResponsesApiReply(response=msgspec.json.encode(row.response))
        return ResponsesApiReply(items=msgspec.json.encode(row.input_items))

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_s)
            try:
                while await sweep(self.engine, dt.datetime.now(UTC)) == SWEEP_BATCH:
                    pass
            except Exception as exc:  # the database is away: the next round
                log.warning("metering: cannot sweep expired responses: %s", exc)
