"""The per-team billing API (JSON) and dashboard page, over the ledger's database.

Every ``/v1/billing/teams/{team}/...`` call needs ``Authorization: Bearer <key>`` where the key is
an admin key of that team: an unknown or revoked key is 401, a key of the team without admin
rights or an admin key of another team is 403. Key lookups are cached for ``key_cache_ttl_s``
(1 s), so a revocation bites within that. Errors are OpenAI-shaped everywhere. Money in the JSON
is exact: ``*_nano`` integers and ``*_usd`` decimal strings (see billing.py).
"""

from __future__ import annotations

import datetime as dt
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

from litestar import Litestar, MediaType, Request, Response, get
from litestar.exceptions import HTTPException
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker

from services.metering import billing
from services.metering.keys import hash_key
from services.metering.models import ApiKey
from shared.errors import ApiError, invalid_api_key, invalid_request

log = logging.getLogger("infermesh.metering.billing")

DASHBOARD_HTML = Path(__file__).parent / "static" / "dashboard.html"
DEFAULT_DAYS = 30
MAX_RANGE_DAYS = 366
MAX_KEYS = 100
MAX_USAGE_ROWS = 500
MAX_JOBS = 100
MAX_TRAJECTORIES = 500
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
# The page is self-contained: nothing may load from elsewhere, and it only talks to this origin.
DASHBOARD_HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'"),
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


@dataclass(frozen=True, slots=True)
class KeyRecord:
    team: str
    prefix: str
    is_admin: bool


class KeyCache:
    """Key hash -> its record (or None when unknown or revoked), each remembered for ``ttl_s``.

    Misses are cached too, so a flood of bad keys costs one query per key per ``ttl_s``.
    """

    def __init__(self, lookup: Callable[[str], Awaitable[KeyRecord | None]], ttl_s: float = 1.0,
                 max_entries: int = 10_000, clock: Callable[[], float] = time.monotonic) -> None:
        self._lookup = lookup
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._clock = clock
        self._hash_to_entry: dict[str, tuple[float, KeyRecord | None]] = {}

    async def get(self, key_hash: str) -> KeyRecord | None:
        now = self._clock()
        entry = self._hash_to_entry.get(key_hash)
        if entry is not None and entry[0] > now:
            return entry[1]
        record = await self._lookup(key_hash)
        if len(self._hash_to_entry) >= self._max_entries:
            self._hash_to_entry = {h: e for h, e in self._hash_to_entry.items() if e[0] > now}
        self._hash_to_entry[key_hash] = (now + self._ttl_s, record)
        return record


def forbidden(message: str, code: str) -> ApiError:
    return ApiError(403, message, "permission_error", None, code)


def authorize(record: KeyRecord | None, team: str) -> None:
    """Raise unless ``record`` is a live admin key of ``team``."""
    if record is None:
        raise invalid_api_key()
    if record.team != team:
        raise forbidden(f"This key cannot read the billing data of team '{team}'.", "team_access_denied")
    if not record.is_admin:
        raise forbidden("Billing data needs an admin key of the team.", "admin_key_required")


def bearer_hash(authorization: str | None) -> str | None:
    if not authorization or not authorization.lower().startswith("bearer "):
        return None
    key = authorization[7:].strip()
    return hash_key(key) if key else None


def _date_param(request: Request, name: str, default: dt.date) -> dt.date:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        if not _DATE.fullmatch(raw):  # fromisoformat alone would also take '20240101' and week dates
            raise ValueError(raw)
        return dt.date.fromisoformat(raw)
    except ValueError:
        raise invalid_request(f"'{name}' must be a date YYYY-MM-DD, got {raw!r}.", name, "invalid_date") from None


def _date_range(request: Request) -> tuple[dt.date, dt.date]:
    """``start``/``end`` (both included), by default the last 30 UTC days up to today."""
    today = dt.datetime.now(dt.timezone.utc).date()
    end = _date_param(request, "end", today)
    start = _date_param(request, "start", end - dt.timedelta(days=DEFAULT_DAYS - 1))
    if start > end:
        raise invalid_request("'start' must not be after 'end'.", "start", "invalid_date_range")
    if (end - start).days >= MAX_RANGE_DAYS:
        raise invalid_request(f"'start' may be at most {MAX_RANGE_DAYS - 1} days before 'end'.", "start",
                              "invalid_date_range")
    return start, end


def _limit_param(request: Request, default: int, maximum: int) -> int:
    raw = request.query_params.get("limit")
    if raw is None or raw == "":
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= maximum:
        raise invalid_request(f"'limit' must be an integer from 1 to {maximum}, got {raw!r}.", "limit",
                              "invalid_limit")
    return int(raw)


def _month_param(request: Request) -> str:
    raw = request.query_params.get("month")
    if raw is None or raw == "":
        return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m")
    try:
        billing.parse_month(raw)
    except ValueError:
        raise invalid_request(f"'month' must be YYYY-MM, got {raw!r}.", "month", "invalid_month") from None
    return raw


def _error_response(exc: ApiError) -> Response[bytes]:
    return Response(exc.json(), status_code=exc.status, media_type=MediaType.JSON, headers=exc.headers)


def _on_api_error(_request: Request, exc: ApiError) -> Response[bytes]:
    return _error_response(exc)


def _on_http_error(_request: Request, exc: HTTPException) -> Response[bytes]:
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return _error_response(ApiError(exc.status_code, str(exc.detail), kind, None, code))


def _on_unexpected(_request: Request, exc: Exception) -> Response[bytes]:
    log.exception("unhandled error", exc_info=exc)
    return _error_response(ApiError(500, "The server had an error while processing your request.",
                                    "server_error", None, "internal_error"))


def create_billing_app(engine: AsyncEngine, key_cache_ttl_s: float = 1.0, trace_url: str = "") -> Litestar:
    """The billing API and dashboard over ``engine`` (the ledger's database; this app only reads). ``trace_url``:
    the trace UI's page of a trace (``{trace_id}`` in it), which usage rows link to."""
    sessions = async_sessionmaker(engine, expire_on_commit=False)

    async def lookup(key_hash: str) -> KeyRecord | None:
        async with sessions() as session:
            row = (await session.execute(select(ApiKey.team, ApiKey.prefix, ApiKey.is_admin)
                                         .where(ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None)))).first()
        return None if row is None else KeyRecord(row.team, row.prefix, bool(row.is_admin))

    keys = KeyCache(lookup, key_cache_ttl_s)

    async def require_admin(request: Request) -> str:
        """The path's team, once the caller's key has proven to be one of its admin keys."""
        team = request.path_params["team"]  # read here, not declared: one spelling across Litestar 2.x
        key_hash = bearer_hash(request.headers.get("authorization"))
        authorize(None if key_hash is None else await keys.get(key_hash), team)
        return team

    # Each handler checks the key before its parameters, so a caller without a key learns nothing else.
    @get("/v1/billing/teams/{team:str}/summary")
    async def summary(request: Request) -> dict[str, Any]:
        team = await require_admin(request)
        month = _month_param(request)
        async with sessions() as session:
            return await billing.team_summary(session, team, month)

    @get("/v1/billing/teams/{team:str}/daily")
    async def daily(request: Request) -> dict[str, Any]:
        team = await require_admin(request)
        start, end = _date_range(request)
        async with sessions() as session:
            days = await billing.daily(session, team, start, end)
        return {"team": team, "start": start.isoformat(), "end": end.isoformat(), "data": days}

    @get("/v1/billing/teams/{team:str}/keys")
    async def top_keys(request: Request) -> dict[str, Any]:
        team = await require_admin(request)
        start, end = _date_range(request)
        limit = _limit_param(request, 10, MAX_KEYS)
        async with sessions() as session:
            rows = await billing.top_keys(session, team, start, end, limit)
        return {"team": team, "start": start.isoformat(), "end": end.isoformat(), "data": rows}

    @get("/v1/billing/teams/{team:str}/usage")
    async def usage(request: Request) -> dict[str, Any]:
        team = await require_admin(request)
        limit = _limit_param(request, 50, MAX_USAGE_ROWS)
        async with sessions() as session:
            rows = await billing.recent_usage(session, team, limit)
        return {"team": team, "data": rows, "trace_url": trace_url}

    @get("/v1/billing/teams/{team:str}/trajectories")
    async def trajectories(request: Request) -> dict[str, Any]:
        team = await require_admin(request)
        start, end = _date_range(request)
        limit = _limit_param(request, 50, MAX_TRAJECTORIES)
        async with sessions() as session:
            rows = await billing.trajectories(session, team, start, end, limit)
        return {"team": team, "start": start.isoformat(), "end": end.isoformat(), "data": rows}

    @get("/v1/billing/teams/{team:str}/jobs")
    async def jobs(request: Request) -> dict[str, Any]:
        team = await require_admin(request)
        limit = _limit_param(request, 20, MAX_JOBS)
        async with sessions() as session:
            rows = await billing.jobs(session, team, limit)
        return {"team": team, "data": rows}

    @get("/dashboard/{team:str}", sync_to_thread=False)
    def dashboard() -> Response[bytes]:
        # The page reads the team from its own path and the key from the fragment; nothing is templated in.
        return Response(DASHBOARD_HTML.read_bytes(), media_type=MediaType.HTML, headers=DASHBOARD_HEADERS)

    @get("/health", sync_to_thread=False)
    def health() -> dict[str, str]:
        return {"status": "ok"}

    return Litestar(
        route_handlers=[summary, daily, top_keys, usage, trajectories, jobs, dashboard, health],
        exception_handlers={ApiError: _on_api_error, HTTPException: _on_http_error, Exception: _on_unexpected},
        openapi_config=None,
        debug=False,
    )
