"""Requests through the official openai SDK, streamed and not, accumulated the way SDK users do."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import openai
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.conformance.tool_calls.corpus import argument_errors

USER = [{"role": "user", "content": "Please use the tools to help me with my request."}]


@dataclass
class Answer:
    """One response, streamed or not, in one comparable shape."""

    content: str | None
    tool_calls: list[dict[str, str]]  # [{id, name, arguments}]
    finish_reason: str | None
    chunks: list[ChatCompletionChunk] = field(default_factory=list)
    snapshot: Any = None  # the SDK's own accumulation (ChatCompletionStreamState) for a stream

    def calls(self) -> list[tuple[str, str]]:
        """(name, arguments) of each call: what must agree streamed and not (ids may differ)."""
        return [(c["name"], c["arguments"]) for c in self.tool_calls]

    def same_as(self, other: "Answer") -> bool:
        return (self.calls(), self.content or None, self.finish_reason) == \
            (other.calls(), other.content or None, other.finish_reason)


def from_completion(completion: ChatCompletion) -> Answer:
    assert isinstance(completion, ChatCompletion) and len(completion.choices) == 1
    choice = completion.choices[0]
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
             for c in choice.message.tool_calls or []]
    for call in choice.message.tool_calls or []:
        assert call.type == "function" and call.id
    return Answer(choice.message.content, calls, choice.finish_reason)


async def accumulate(stream: openai.AsyncStream[ChatCompletionChunk], tools: Any = None) -> Answer:
    """Deltas joined by index, as SDK users do; also fed to the SDK's own ChatCompletionStreamState."""
    state = ChatCompletionStreamState(input_tools=tools if tools is not None else openai.omit)
    content: list[str] = []
    calls: dict[int, dict[str, str]] = {}
    finish, chunks = None, []
    async for chunk in stream:
        assert isinstance(chunk, ChatCompletionChunk)
        chunks.append(chunk)
        state.handle_chunk(chunk)
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content.append(delta.content)
            for tc in delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                if tc.id:
                    assert not entry["id"], "a call's id came twice"
                    entry["id"] = tc.id
                if tc.function is not None:
                    if tc.function.name:
                        entry["name"] += tc.function.name
                    if tc.function.arguments:
                        entry["arguments"] += tc.function.arguments
            if choice.finish_reason is not None:
                assert finish is None, "two finish reasons"
                finish = choice.finish_reason
    assert sorted(calls) == list(range(len(calls))), f"tool call indexes not 0..n-1: {sorted(calls)}"
    ordered = [calls[i] for i in range(len(calls))]
    for call in ordered:
        assert call["id"] and call["name"], f"a streamed call without id or name: {call}"
    return Answer("".join(content) or None, ordered, finish, chunks, state.current_completion_snapshot)


async def ask(client: openai.AsyncOpenAI, stream: bool, **body: Any) -> Answer:
    body.setdefault("model", "tiny")
    body.setdefault("messages", USER)
    if stream:
        return await accumulate(await client.chat.completions.create(stream=True, **body), body.get("tools"))
    return from_completion(await client.chat.completions.create(**body))


async def ask_both(client: openai.AsyncOpenAI, **body: Any) -> tuple[Answer, Answer]:
    """The same request (seed included) non-streamed and streamed.

    Each with a cache salt of its own, so neither reuses the other's prompt KV: vLLM's logits from a
    prefix-cache hit differ from a fresh prefill in the last bits (another batch shape), and with the
    tiny random model's near-uniform logits that alone can change a seeded draw. That is the engine's
    numerics, not this parity (which is about the edge answering the same tokens the same way)."""
    body.setdefault("seed", 0)
    extra = body.pop("extra_body", None) or {}
    salt = uuid.uuid4().hex
    plain = await ask(client, False, extra_body={**extra, "cache_salt": f"{salt}-plain"}, **body)
    streamed = await ask(client, True, extra_body={**extra, "cache_salt": f"{salt}-stream"}, **body)
    return plain, streamed


def check_calls(answer: Answer, tools: list[dict[str, Any]], allow_cut: bool = True) -> list[dict]:
    """Every call names a declared tool and its arguments validate; with finish_reason "length" the last call
    may be cut (a JSON prefix). Returns the parsed arguments of the complete calls."""
    declared = {t["function"]["name"] for t in tools}
    parsed = []
    for i, call in enumerate(answer.tool_calls):
        assert call["name"] in declared, f"undeclared tool {call['name']!r}"
        last_cut = allow_cut and answer.finish_reason == "length" and i == len(answer.tool_calls) - 1
        errors = argument_errors(call["name"], call["arguments"], tools)
        if last_cut and errors and errors[0].startswith("arguments are not JSON"):
            continue
        assert not errors, f"{call['name']}({call['arguments']}): {errors}"
        parsed.append(json.loads(call["arguments"]))
    if answer.tool_calls and answer.finish_reason not in ("length",):
        assert answer.finish_reason == "tool_calls", answer.finish_reason
    return parsed


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}
