"""One trajectory id per request: what the agent harnesses send to name their run, normalized. Pure.

An agent run (a trajectory) is many requests. Each harness names it its own way (recorded from Claude Code
2.1.197, Codex CLI 0.171 and OpenCode 1.18.33 against a capture server):

    Claude Code   X-Claude-Code-Session-Id: <uuid>, and the same uuid in metadata.user_id, a JSON string
                  {"device_id": ..., "account_uuid": ..., "session_id": <uuid>} (older releases:
                  "user_<hash>_account_<uuid>_session_<uuid>")
    Codex         session-id and thread-id headers, equal for a run's root thread; its x-codex-turn-metadata
                  (session_id, thread_id, thread_source "user") says a spawned thread has its own thread-id
                  under the run's session-id (no sub-agent was recorded); prompt_cache_key = the thread id
    OpenCode      x-session-id and x-session-affinity: ses_<id> (the same id in both)
    anyone        X-Session-Id; OpenAI's prompt_cache_key (chat, Responses); ``user`` when the edge is so
                  configured (--session-from-user), which for /v1/messages is metadata.user_id

The first one present wins, in ``PRECEDENCE`` order: headers a client sets on purpose before body fields that
also mean other things. Codex's session-id ranks above its thread-id, so a run's sub-agents bill to the run.
A session id longer than ``MAX_TRAJECTORY``, or holding a control character, is refused (400 naming where it
came from), never cut or cleaned: two sessions must not merge. The router scopes it by team (affinity), so a
guessed id pins nothing of another team.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

from shared import errors
from shared.schema import MAX_TRAJECTORY

SessionSource = Literal["x-session-id", "x-claude-code-session-id", "session-id", "thread-id",
                        "x-session-affinity", "prompt_cache_key", "metadata.user_id", "user"]
PRECEDENCE: tuple[SessionSource, ...] = get_args(SessionSource)  # first present wins
HEADERS: tuple[SessionSource, ...] = PRECEDENCE[:5]
# Claude Code before its JSON user id: "user_<device hash>_account_<uuid or empty>_session_<uuid>"
_LEGACY_USER_ID = re.compile(r"^user_[0-9a-f]+_account_[0-9a-f-]*_session_([0-9a-f-]+)$")
MAX_USER_ID_JSON = 1024  # Claude Code's is ~150 characters; a longer one is not parsed (it runs on the event loop)
# control characters: Postgres refuses NUL in text (the usage would be dead-lettered: served, never billed), and
# none belongs in an id that traces and the dashboard show
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True, slots=True)
class Session:
    id: str
    source: SessionSource


def embedded_session(user_id: str | None) -> str | None:
    """The session uuid Claude Code puts in ``metadata.user_id`` (JSON or its older underscore form), or None."""
    if not user_id:
        return None
    if user_id.startswith("{"):
        if len(user_id) > MAX_USER_ID_JSON:
            return None
        try:
            value = json.loads(user_id)
        except (ValueError, RecursionError):
            return None
        session = value.get("session_id") if isinstance(value, dict) else None
        return session if isinstance(session, str) and session else None
    legacy = _LEGACY_USER_ID.match(user_id)
    return legacy[1] if legacy else None


def candidates(headers: Mapping[str, str], prompt_cache_key: str | None, user: str | None,
               session_from_user: bool) -> dict[SessionSource, str]:
    """Every session id the request names, by source (``headers``: lower-case names)."""
    found: dict[SessionSource, str] = {name: headers[name] for name in HEADERS if headers.get(name)}
    if prompt_cache_key:
        found["prompt_cache_key"] = prompt_cache_key
    embedded = embedded_session(user)
    if embedded:
        found["metadata.user_id"] = embedded
    elif user and session_from_user:
        found["user"] = user
    return found


def session_of(headers: Mapping[str, str], prompt_cache_key: str | None = None, user: str | None = None,
               session_from_user: bool = False) -> Session | None:
    """The request's one session id (the first candidate in ``PRECEDENCE``), or None; ApiError 400 when too long
    or holding a control character."""
    found = candidates(headers, prompt_cache_key, user, session_from_user)
    for source in PRECEDENCE:
        value = found.get(source)
        if value is not None:
            if len(value) > MAX_TRAJECTORY:
                raise errors.invalid_request(f"The session id ({source}) is longer than {MAX_TRAJECTORY} characters.",
                                             _PARAM[source])
            if _CONTROL.search(value):
                raise errors.invalid_request(f"The session id ({source}) holds a control character.", _PARAM[source])
            return Session(value, source)
    return None


_PARAM: dict[SessionSource, str] = {
    "x-session-id": "X-Session-Id", "x-claude-code-session-id": "X-Claude-Code-Session-Id",
    "session-id": "session-id", "thread-id": "thread-id", "x-session-affinity": "x-session-affinity",
    "prompt_cache_key": "prompt_cache_key", "metadata.user_id": "metadata.user_id", "user": "user",
}
