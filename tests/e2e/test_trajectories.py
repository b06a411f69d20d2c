"""One trajectory per agent run, through the whole mesh (router, admission, metering, two sim workers, edge) on
both ledgers: two Responses turns with Codex's ``session-id`` header are one trajectory in the ledger and in the
billing API, at the cost of their counts (cached tokens at the cached price); the turns stay on one worker; and
Claude Code's session (its header, or the session inside ``metadata.user_id``) names its run the same way."""

from __future__ import annotations

import datetime as dt
import json

import anthropic
import openai
import pytest
from sqlalchemy.ext.asyncio import async_sessionmaker

from services.metering import billing
from services.metering.db import create_engine
from tests.e2e.test_messages_api import start_mesh
from tests.e2e.test_metering_mesh import ledger_rows, team_key
from tests.utils import eventually

pytestmark = [pytest.mark.e2e]
CODEX_SESSION = "01a24ec3-c9c8-7690-9338-8bdcc1b24d97"
CLAUDE_SESSION = "15e2b4d3-fbff-4a05-aec8-13e4053f7c71"
TASK = "Read the file README.md, then list the services the mesh runs and say what each of them does. " * 4


def cost_nano(row) -> int:
    """The price team_key sets ($1 / $0.25 cached / $4 per 1M tokens) applied to a ledger row's counts."""
    micro_tokens = (row.prompt_tokens - row.cached_tokens) * 1_000_000 + row.cached_tokens * 250_000 \
        + row.completion_tokens * 4_000_000
    return (micro_tokens + 500) // 1000


async def trajectories(ledger_url: str, team: str) -> list[dict]:
    engine = create_engine(ledger_url)
    today = dt.datetime.now(dt.timezone.utc).date()
    try:
        async with async_sessionmaker(engine)() as session:
            return await billing.trajectories(session, team, today - dt.timedelta(days=1), today)
    finally:
        await engine.dispose()


async def test_two_codex_turns_with_one_session_id_are_one_trajectory(nats_url, namespace, tiny_model, ledger_url):
    mesh = await start_mesh(nats_url, namespace, tiny_model, ledger_url)
    try:
        key = await team_key(ledger_url, "codex")
        await eventually(lambda: mesh.edge.mesh.keys.caller(key) is not None, 10)
        client = openai.AsyncOpenAI(base_url=mesh.base_url, api_key=key, max_retries=0)
        codex = {"session-id": CODEX_SESSION, "thread-id": CODEX_SESSION}  # as Codex 0.171 sends them
        first = await client.responses.create(model="tiny", input=TASK, max_output_tokens=6, extra_headers=codex,
                                              extra_body={"prompt_cache_key": CODEX_SESSION})
        history = [{"role": "user", "content": TASK}, {"role": "assistant", "content": first.output_text},
                   {"role": "user", "content": "Now the edge only."}]
        second = await client.responses.create(model="tiny", input=history, max_output_tokens=6,
                                               extra_headers=codex, extra_body={"prompt_cache_key": CODEX_SESSION})
        again = await client.responses.create(model="tiny", input=TASK, max_output_tokens=6, extra_headers=codex)
        # exact, from the engine's prefix hits: the sim reads every full 16-token block but the one with the last
        # prompt token (it computes that token again, as vLLM does)
        prompt = again.usage.input_tokens
        assert first.usage.input_tokens_details.cached_tokens == 0  # a fresh mesh
        assert again.usage.input_tokens_details.cached_tokens == (prompt - 1) // 16 * 16 > 0
        other = await client.responses.create(model="tiny", input=TASK, max_output_tokens=6,
                                              extra_headers={"session-id": "another-run"})
        await client.responses.create(model="tiny", input="No session.", max_output_tokens=6)
        keyed = await client.chat.completions.create(  # chat's prompt_cache_key alone names a run
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            extra_body={"prompt_cache_key": "cache-key-run"})
        opencode = await client.chat.completions.create(  # as OpenCode 1.18 sends its session (both headers)
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            extra_headers={"x-session-id": "ses_opencode", "x-session-affinity": "ses_opencode"})
        await eventually(lambda: mesh.meterings[0].stats["inserted"] >= 7, 10)
        rows = await ledger_rows(ledger_url)
        turns = [rows[r.id.removeprefix("resp_")] for r in (first, second, again)]
        assert [row.trajectory for row in turns] == [CODEX_SESSION] * 3
        assert rows[other.id.removeprefix("resp_")].trajectory == "another-run"
        assert rows[keyed.id.removeprefix("chatcmpl-")].trajectory == "cache-key-run"
        assert rows[opencode.id.removeprefix("chatcmpl-")].trajectory == "ses_opencode"
        assert sorted(row.trajectory for row in rows.values()) == [
            "", *[CODEX_SESSION] * 3, "another-run", "cache-key-run", "ses_opencode"]
        assert turns[0].worker_id == turns[1].worker_id == turns[2].worker_id  # the session kept its worker
        told = second.usage.input_tokens_details.cached_tokens
        assert turns[1].cached_tokens == told > 0  # the second turn read the first turn's prefix from the cache
        listed = {t["trajectory"]: t for t in await trajectories(ledger_url, "codex")}
        assert set(listed) == {CODEX_SESSION, "another-run", "cache-key-run", "ses_opencode"}
        run = listed[CODEX_SESSION]
        assert (run["requests"], run["prompt_tokens"], run["cached_tokens"], run["completion_tokens"]) == (
            3, sum(r.usage.input_tokens for r in (first, second, again)),
            sum(r.usage.input_tokens_details.cached_tokens for r in (first, second, again)),
            sum(r.usage.output_tokens for r in (first, second, again)))
        assert run["cost_nano"] == sum(cost_nano(row) for row in turns) == sum(row.cost_nano for row in turns)
    finally:
        await mesh.stop()


async def test_claude_codes_session_names_its_trajectory(nats_url, namespace, tiny_model, ledger_url, span_exporter):
    mesh = await start_mesh(nats_url, namespace, tiny_model, ledger_url)
    try:
        key = await team_key(ledger_url, "claude")
        await eventually(lambda: mesh.edge.mesh.keys.caller(key) is not None, 10)
        client = anthropic.AsyncAnthropic(base_url=mesh.base_url.removesuffix("/v1"), api_key=key, max_retries=0)
        user_id = json.dumps({"device_id": "d", "account_uuid": "", "session_id": CLAUDE_SESSION})
        messages = [{"role": "user", "content": TASK}]
        marked = [{"role": "user", "content": [{"type": "text", "text": TASK, "cache_control": {"type": "ephemeral"}}]}]
        span_exporter.clear()
        by_header = await client.messages.create(model="tiny", messages=marked, max_tokens=4,
                                                 extra_headers={"X-Claude-Code-Session-Id": CLAUDE_SESSION})
        # its breakpoint marks the last message: the router is told the whole prompt's full blocks
        route = next(s for s in span_exporter.get_finished_spans() if s.name == "router.route")
        assert route.attributes["session.id"] == CLAUDE_SESSION
        told = by_header.usage
        prompt = told.input_tokens + told.cache_read_input_tokens + told.cache_creation_input_tokens
        assert route.attributes["infermesh.router.cache_blocks"] == prompt // 16 > 0
        # what it did not read from the cache up to its breakpoint (here: all of it) was written to the cache
        assert (told.input_tokens, told.cache_creation_input_tokens) == (0, prompt - told.cache_read_input_tokens)
        by_user_id = await client.messages.create(model="tiny", messages=messages, max_tokens=4,
                                                  metadata={"user_id": user_id})
        assert by_user_id.usage.cache_creation_input_tokens == 0  # no breakpoint: no cache write
        await eventually(lambda: mesh.meterings[0].stats["inserted"] >= 2, 10)
        rows = await ledger_rows(ledger_url)
        assert [rows[m.id.removeprefix("msg_")].trajectory for m in (by_header, by_user_id)] == [CLAUDE_SESSION] * 2
        assert rows[by_header.id.removeprefix("msg_")].prompt_tokens == prompt  # billed: every prompt token
    finally:
        await mesh.stop()
