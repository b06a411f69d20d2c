"""Caches that save time on content must not save it across tenants (issue 38, review finding 8).

The edge's incremental-tokenizer cache (services/edge/incremental.py) reuses an earlier prompt's tokens: shared by
all teams, another team's ``count_tokens`` of a guessed long prefix answered fast when anyone had sent it. Each
team (and each of its ``cache_salt``s) now reuses only its own prompts: asserted on the cache's reuse decision
(``num_reused``), not on timing."""

from __future__ import annotations

import json

import pytest

from services.edge.incremental import PrefixTokens, cache_scope
from services.edge.prep import PrepJob, prepare
from services.edge.tokenizer import ModelTokenizer

HISTORY = "".join(f"line {i} of a long shared document\n" for i in range(400))  # ~14K characters


def _cache() -> PrefixTokens:
    return PrefixTokens(lambda texts: [[ord(c) for c in text] for text in texts], (), ("line",))


@pytest.mark.parametrize("first, second, reused", [
    (("alpha", None), ("alpha", None), True),  # a team's next turn reuses its last
    (("alpha", None), ("beta", None), False),  # another team's prompt: no reuse, whatever the text
    (("alpha", "s1"), ("alpha", "s2"), False),  # another salt of the same team
    (("alpha", "s1"), ("alpha", None), False),
    (("ab", "c"), ("a", "bc"), False),  # the same joined text, another (team, salt)
])
def test_a_prompt_reuses_only_its_own_scopes_earlier_prompts(first, second, reused):
    cache = _cache()
    cache.encode(HISTORY, cache_scope(*first))
    before = cache.num_reused
    assert cache.encode(HISTORY + "the next turn\n", cache_scope(*second)) == [ord(c) for c in HISTORY] + [
        ord(c) for c in "the next turn\n"]
    assert (cache.num_reused > before) is reused


def test_another_scopes_prompt_does_not_replace_a_teams_entry():
    cache = _cache()
    cache.encode(HISTORY, cache_scope("alpha", None))
    cache.encode(HISTORY + "beta's turn\n", cache_scope("beta", None))
    assert len(cache._entries) == 2  # beta's did not continue (and so replace) alpha's
    before = cache.num_reused
    cache.encode(HISTORY + "alpha's turn\n", cache_scope("alpha", None))
    assert cache.num_reused > before


def _body(text: str, salt: str | None) -> bytes:
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}]}
    return json.dumps(body | ({"cache_salt": salt} if salt else {})).encode()


def test_count_tokens_of_another_teams_prefix_does_not_reuse_its_work(tiny_model):
    """Through preparation (the path ``/v1/messages/count_tokens`` takes): the team comes from the job, the salt
    from the body (a chat body: Anthropic's has no cache_salt)."""
    tokenizer = ModelTokenizer(str(tiny_model))
    assert tokenizer.prefix_tokens.kinds, "the cache must be on for this tokenizer, or the test shows nothing"

    def reused(team: str, text: str, salt: str | None = None) -> int:
        kind = "chat" if salt else "messages_count"
        before = tokenizer.prefix_tokens.num_reused
        prepare(PrepJob(kind, _body(text, salt), str(tiny_model), 1 << 20, team=team), tokenizer)
        return tokenizer.prefix_tokens.num_reused - before

    assert reused("alpha", HISTORY) == 0  # the first time: nothing to reuse
    assert reused("beta", HISTORY + "a guess\n") == 0  # another team's prefix: tokenized whole
    assert reused("alpha", HISTORY + "next\n", salt="private") == 0  # another salt of the team
    assert reused("alpha", HISTORY + "next\n") > 0  # the team's own next turn still reuses its prefix
