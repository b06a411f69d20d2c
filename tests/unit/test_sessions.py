"""One session id per request from what the harnesses send (services/edge/sessions.py): the precedence table."""

from __future__ import annotations

import json

import pytest

from services.edge.sessions import PRECEDENCE, Session, embedded_session, session_of
from shared import errors
from shared.schema import MAX_TRAJECTORY

CLAUDE = "15e2b4d3-fbff-4a05-aec8-13e4053f7c71"
# metadata.user_id as Claude Code 2.1.197 sent it (recorded against a capture server)
CLAUDE_USER_ID = json.dumps({"device_id": "a97d797ca67fc51a", "account_uuid": "", "session_id": CLAUDE},
                            separators=(",", ":"))
CODEX = "01a24ec3-c9c8-7690-9338-8bdcc1b24d97"
OPENCODE = "ses_db13c21b3ffeo9SJQNJA7xdNWk"

# (headers, prompt_cache_key, user, session_from_user) -> (id, source) or None
TABLE = [
    ({}, None, None, False, None),
    ({"x-session-id": "mine"}, None, None, False, ("mine", "x-session-id")),
    # Claude Code: its header, and the same id inside metadata.user_id (the edge gets that as ``user``)
    ({"x-claude-code-session-id": CLAUDE}, None, CLAUDE_USER_ID, False, (CLAUDE, "x-claude-code-session-id")),
    ({}, None, CLAUDE_USER_ID, False, (CLAUDE, "metadata.user_id")),
    ({}, None, f"user_abc123_account__session_{CLAUDE}", False, (CLAUDE, "metadata.user_id")),
    # Codex: session-id over thread-id (a sub-agent's thread bills to its run), both over prompt_cache_key
    ({"session-id": CODEX, "thread-id": "sub-thread"}, "sub-thread", None, False, (CODEX, "session-id")),
    ({"thread-id": "t-1"}, "t-1", None, False, ("t-1", "thread-id")),
    # OpenCode: x-session-id (and x-session-affinity, the same id)
    ({"x-session-id": OPENCODE, "x-session-affinity": OPENCODE}, None, None, False, (OPENCODE, "x-session-id")),
    ({"x-session-affinity": OPENCODE}, None, None, False, (OPENCODE, "x-session-affinity")),
    # the explicit header wins over everything a body says
    ({"x-session-id": "explicit", "x-claude-code-session-id": CLAUDE, "session-id": CODEX}, "k", CLAUDE_USER_ID,
     True, ("explicit", "x-session-id")),
    ({}, "cache-key", "alice", True, ("cache-key", "prompt_cache_key")),
    # a plain ``user`` names a session only when the edge is so configured
    ({}, None, "alice", False, None),
    ({}, None, "alice", True, ("alice", "user")),
    # an embedded session beats the whole user id even when user ids are sessions
    ({}, None, CLAUDE_USER_ID, True, (CLAUDE, "metadata.user_id")),
    # empty values name nothing
    ({"x-session-id": ""}, "", "", True, None),
]


@pytest.mark.parametrize("headers, cache_key, user, from_user, expected", TABLE)
def test_the_first_candidate_in_precedence_order_names_the_session(headers, cache_key, user, from_user, expected):
    got = session_of(headers, cache_key, user, from_user)
    assert got == (Session(*expected) if expected else None)


def test_every_source_has_a_row_that_picks_it():
    picked = {row[-1][1] for row in TABLE if row[-1]}
    assert picked == set(PRECEDENCE)


@pytest.mark.parametrize("user_id", ["{not json", '{"session_id": 7}', "[1]", '{"device_id": "x"}', "user_1_x",
                                     ""])
def test_user_ids_without_a_session_embed_none(user_id):
    assert embedded_session(user_id) is None


@pytest.mark.parametrize("headers, cache_key, param", [
    ({"x-session-id": "s" * (MAX_TRAJECTORY + 1)}, None, "X-Session-Id"),
    ({"session-id": "s" * (MAX_TRAJECTORY + 1)}, None, "session-id"),
    ({}, "k" * (MAX_TRAJECTORY + 1), "prompt_cache_key"),
])
def test_a_session_id_over_the_bound_is_a_400_naming_its_source(headers, cache_key, param):
    with pytest.raises(errors.ApiError) as caught:
        session_of(headers, cache_key)
    assert caught.value.status == 400 and caught.value.param == param


def test_an_id_at_the_bound_is_kept_whole():
    assert session_of({"x-session-id": "s" * MAX_TRAJECTORY}) == Session("s" * MAX_TRAJECTORY, "x-session-id")


@pytest.mark.parametrize("headers, cache_key, user, param", [
    ({}, "abc\x00", None, "prompt_cache_key"),
    ({"x-session-id": "a\nb"}, None, None, "X-Session-Id"),
    ({}, None, '{"session_id": "s\\u0000"}', "metadata.user_id"),
])
def test_a_session_id_with_a_control_character_is_a_400(headers, cache_key, user, param):
    """A NUL reached usage.trajectory: Postgres refuses it in text, metering dead-lettered the usage, and the
    request was served but never billed."""
    with pytest.raises(errors.ApiError) as raised:
        session_of(headers, cache_key, user)
    assert raised.value.status == 400 and raised.value.param == param


def test_a_deeply_nested_or_huge_user_id_is_not_a_session_and_not_a_500():
    deep = "{" * 1 + '"a":' + "[" * 100_000 + "]" * 100_000 + "}"
    assert embedded_session(deep) is None
    assert embedded_session('{"session_id": "s", "pad": "' + "x" * 2000 + '"}') is None
