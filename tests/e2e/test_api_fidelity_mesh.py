"""API fidelity on a sim mesh (issue 37.2): what Claude Code and Codex send in their first request (a system turn
inside Anthropic's ``messages``, ``context_management``, ``thinking``, ``output_config``, ``client_metadata``,
``include``, ``namespace`` and built-in tools...) is served, and the built-in tools left out of the prompt are
named in the ``x-infermesh-ignored-tools`` header of whole responses and streams alike."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.test_messages_api import KEY, start_mesh

pytestmark = [pytest.mark.e2e]
HEADERS = {"authorization": f"Bearer {KEY}", "anthropic-version": "2023-06-01",
           "anthropic-beta": "claude-code-20250219,context-management-2025-06-27,mid-conversation-system-2026-04-07"}
READ = {"name": "Read", "description": "Read a file.",
        "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}}
CLAUDE_CODE = {  # the fields and shapes Claude Code 2.1.197's first request has (its prompt and tools, shortened)
    "model": "tiny", "max_tokens": 16, "stream": False,
    "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197;"},
               {"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "ephemeral"}}],
    "messages": [{"role": "user", "content": [{"type": "text", "text": "<system-reminder>skills</system-reminder>"},
                                              {"type": "text", "text": "read a.txt"}]},
                 {"role": "system", "content": "Available agent types for the Agent tool: claude"}],
    "tools": [READ, {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}],
    "metadata": {"user_id": '{"device_id":"d","account_uuid":"","session_id":"3a8c4879"}'},
    "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
}
FUNCTION = {"type": "function", "name": "exec_command", "description": "Run a command.", "strict": False,
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}
CODEX = {  # the fields and shapes Codex 0.171's first request has
    "model": "tiny", "stream": False, "max_output_tokens": 16, "tool_choice": "auto", "parallel_tool_calls": True,
    "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sandbox"}]},
              {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "read a.txt"}]}],
    "tools": [FUNCTION, {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
                         "tools": [{**FUNCTION, "name": "spawn_agent"}]},
              {"type": "web_search", "external_web_access": False}],
    "reasoning": {"summary": "auto"}, "store": False, "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "01a24ec3", "client_metadata": {"x-codex-window-id": "01a24ec3:0"},
}


@pytest.fixture
async def mesh(nats_url, namespace, tiny_model):
    mesh = await start_mesh(nats_url, namespace, tiny_model)
    yield mesh
    await mesh.stop()


@pytest.mark.parametrize("stream", [False, True])
async def test_claude_codes_first_request_is_served_and_names_the_tool_left_out(mesh, stream):
    root = mesh.base_url.removesuffix("/v1")
    async with httpx.AsyncClient(timeout=30) as client:
        reply = await client.post(f"{root}/v1/messages?beta=true", headers=HEADERS,
                                  json={**CLAUDE_CODE, "stream": stream})
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-infermesh-ignored-tools"] == "web_search_20250305"
        counted = await client.post(f"{root}/v1/messages/count_tokens?beta=true", headers=HEADERS,
                                    json={k: v for k, v in CLAUDE_CODE.items()
                                          if k not in ("max_tokens", "stream", "metadata")})
        assert counted.status_code == 200 and counted.json()["input_tokens"] > 0, counted.text


@pytest.mark.parametrize("stream", [False, True])
async def test_codexs_first_request_is_served_and_names_the_tool_left_out(mesh, stream):
    async with httpx.AsyncClient(timeout=30) as client:
        reply = await client.post(f"{mesh.base_url}/responses", json={**CODEX, "stream": stream},
                                  headers={"authorization": f"Bearer {KEY}", "session-id": "01a24ec3"})
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-infermesh-ignored-tools"] == "web_search"


async def test_a_tool_choice_naming_a_tool_left_out_is_a_400_naming_it(mesh):
    root = mesh.base_url.removesuffix("/v1")
    async with httpx.AsyncClient(timeout=30) as client:
        reply = await client.post(f"{root}/v1/messages", headers=HEADERS, json={
            **CLAUDE_CODE, "tool_choice": {"type": "tool", "name": "web_search"}})
    assert reply.status_code == 400 and "tool_choice.name" in reply.json()["error"]["message"], reply.text
