"""The official TypeScript SDKs (``@anthropic-ai/sdk``, ``openai``, pinned in tests/ts/package.json) against a sim
mesh: one streamed round trip each (Messages, chat, and a Responses turn continued by ``previous_response_id``), which
must equal what the Python SDKs get."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from pathlib import Path

import anthropic
import openai
import pytest

from tests.e2e.test_messages_api import KEY, MESSAGES, root, start_mesh

pytestmark = [pytest.mark.e2e]
TS = Path(__file__).parent.parent / "ts"


def installed_sdks() -> Path:
    """tests/ts with its node_modules (./scripts/test installs them; this installs them when run alone)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        # justified: the TypeScript SDKs need Node.js; ./scripts/test reports it missing, this test cannot run
        pytest.skip("node and npm are needed for the TypeScript SDK test")
    if not (TS / "node_modules" / "@anthropic-ai" / "sdk").exists():
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--silent"], cwd=TS, check=True, timeout=300)
    return TS


@pytest.fixture
async def mesh(nats_url, namespace, tiny_model, tmp_path):
    mesh = await start_mesh(nats_url, namespace, tiny_model, f"sqlite:///{tmp_path}/ledger.db")  # stores responses
    yield mesh
    await mesh.stop()


async def test_a_streamed_round_trip_with_each_typescript_sdk(mesh):
    ts = installed_sdks()
    env = {**os.environ, "ROOT": root(mesh), "KEY": KEY}
    node = await asyncio.create_subprocess_exec("node", "round_trip.mjs", cwd=ts, env=env,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(node.communicate(), 60)
    assert node.returncode == 0, err.decode()
    seen = json.loads(out)
    events = seen["anthropic"]["events"]
    assert events[0] == "message_start" and events[-1] == "message_stop" and "content_block_delta" in events
    expected = await anthropic.AsyncAnthropic(base_url=root(mesh), api_key=KEY, max_retries=0).messages.create(
        model="tiny", max_tokens=8, messages=MESSAGES)
    assert seen["anthropic"]["text"] == expected.content[0].text and seen["anthropic"]["stop_reason"] == "max_tokens"
    assert seen["anthropic"]["usage"]["output_tokens"] == 8
    chat = await openai.AsyncOpenAI(base_url=mesh.base_url, api_key=KEY, max_retries=0).chat.completions.create(
        model="tiny", max_tokens=8, messages=MESSAGES)
    assert seen["openai"]["text"] == chat.choices[0].message.content
    assert seen["openai"]["usage"]["completion_tokens"] == 8
    await check_the_responses_turn(mesh, seen["responses"])


async def check_the_responses_turn(mesh, seen: dict) -> None:
    events = seen["events"]
    assert events[:2] == ["response.created", "response.in_progress"] and events[-1] == "response.incomplete"
    assert events.index("response.output_text.delta") < events.index("response.output_text.done") < events.index(
        "response.output_item.done")
    assert seen["first"]["store"] is True and seen["store"] is True
    assert seen["previous_response_id"] == seen["first"]["id"] and seen["status"] == "incomplete"
    python = openai.AsyncOpenAI(base_url=mesh.base_url, api_key=KEY, max_retries=0)
    kept = await python.responses.retrieve(seen["id"])  # what the TS stream made, read back by the Python SDK
    assert kept.output_text == seen["text"] and kept.usage.output_tokens == seen["usage"]["output_tokens"] == 5
    tokenizer = await mesh.edge.mesh.tokenizer(mesh.edge.mesh.model_info("tiny"))
    conversation = tokenizer.apply_chat_template([{"role": "user", "content": "My name is Ada."},
                                                  {"role": "assistant", "content": seen["first"]["text"]},
                                                  {"role": "user", "content": "What is my name?"}])
    assert seen["usage"]["input_tokens"] == len(conversation)  # the stored first turn came before the input
