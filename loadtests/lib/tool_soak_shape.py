"""What one tool soak answer was: read through the openai SDK's types, checked for OpenAI's shape, classified.

The SDK builds response objects without validating them, so each ChatCompletion / ChatCompletionChunk is
validated again against the SDK's own pydantic types, and the fields clients rely on are checked:

    completion   id, object "chat.completion", one choice, role assistant, finish_reason in FINISH_REASONS,
                 each tool call an id, type "function", a name and string arguments; usage
    stream       one id over every chunk, object "chat.completion.chunk", exactly one finish_reason, tool
                 call indexes 0..n-1, each call's first delta with its id, type and name (and no second id),
                 a usage chunk (no choices) last when stream_options asked for one
    both         finish_reason "tool_calls" only with calls
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import openai
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.conformance.tool_calls.corpus import argument_errors

if TYPE_CHECKING:
    from loadtests.lib.tool_soak_plan import Plan

FINISH_REASONS = ("stop", "length", "tool_calls")


class Outcome(str, Enum):
    OK_VALID = "ok_valid"
    OK_TEXT = "ok_text"
    CUT = "cut"
    INVALID = "invalid"
    UNPARSEABLE = "unparseable"
    HTTP_ERROR = "http_error"
    SDK_ERROR = "sdk_error"
    HUNG = "hung"
    NOT_OPENAI_SHAPED = "not_openai_shaped"

    @property
    def meaning(self) -> str:
        return _MEANINGS[self]


_MEANINGS = {
    Outcome.OK_VALID: "one call or more; each names a declared tool and its arguments validate (jsonschema "
                      "Draft 2020-12) against that tool's schema",
    Outcome.OK_TEXT: "no call, where tool_choice auto allows none",
    Outcome.CUT: "finish_reason length with the last call's arguments not complete JSON (or no call yet where "
                 "one was required)",
    Outcome.INVALID: "arguments that parse but do not validate, an undeclared or not the named tool, several "
                     "calls with parallel_tool_calls false, or no call where one was required",
    Outcome.UNPARSEABLE: "arguments that are not JSON, without the excuse of finish_reason length",
    Outcome.HTTP_ERROR: "an error status from the edge (by status and code in http_errors)",
    Outcome.SDK_ERROR: "the SDK failed otherwise (connection dropped, a broken stream)",
    Outcome.HUNG: "no answer within the per-request timeout",
    Outcome.NOT_OPENAI_SHAPED: "an answer the SDK's types reject, or missing what OpenAI always sends",
}


@dataclass
class Answer:
    content: str | None
    calls: list[dict[str, str]]  # [{id, name, arguments}]
    finish_reason: str | None
    shape_errors: list[str] = field(default_factory=list)


def _validated(kind: type, value: object, errors: list[str]) -> None:
    try:
        kind.model_validate(value.to_dict())  # type: ignore[attr-defined]
    except Exception as exc:  # pydantic's ValidationError: not a ChatCompletion(Chunk)
        errors.append(f"not a valid {kind.__name__}: {str(exc)[:300]}")


def read_completion(completion: ChatCompletion) -> Answer:
    errors: list[str] = []
    _validated(ChatCompletion, completion, errors)
    if not completion.id or completion.object != "chat.completion" or len(completion.choices or []) != 1:
        errors.append(f"id {completion.id!r}, object {completion.object!r}, {len(completion.choices or [])} choices")
        return Answer(None, [], None, errors)
    if completion.usage is None:
        errors.append("no usage")
    choice = completion.choices[0]
    if choice.message.role != "assistant":
        errors.append(f"role {choice.message.role!r}")
    calls = []
    for call in choice.message.tool_calls or []:
        function = getattr(call, "function", None)
        if not call.id or call.type != "function" or function is None or not function.name or \
                not isinstance(function.arguments, str):
            errors.append(f"a malformed tool call: {call!r}"[:300])
            continue
        calls.append({"id": call.id, "name": function.name, "arguments": function.arguments})
    answer = Answer(choice.message.content, calls, choice.finish_reason, errors)
    _check_finish(answer)
    return answer


async def read_stream(stream: openai.AsyncStream[ChatCompletionChunk], usage: bool = False) -> Answer:
    errors: list[str] = []
    ids, content, calls, finish, usage_seen = set(), [], {}, [], False
    async for chunk in stream:
        _validated(ChatCompletionChunk, chunk, errors)
        ids.add(chunk.id)
        if chunk.object != "chat.completion.chunk":
            errors.append(f"object {chunk.object!r}")
        if chunk.usage is not None and not chunk.choices:
            usage_seen = True
            continue
        if usage_seen:
            errors.append("a chunk after the usage chunk")
        for choice in chunk.choices:
            if choice.index != 0:
                errors.append(f"choice index {choice.index}")
            if choice.delta.content:
                content.append(choice.delta.content)
            for delta in choice.delta.tool_calls or []:
                _add_delta(calls, delta, errors)
            if choice.finish_reason is not None:
                finish.append(choice.finish_reason)
    if len(ids) != 1 or not next(iter(ids)):
        errors.append(f"chunk ids {sorted(map(str, ids))[:3]}")
    if len(finish) != 1:
        errors.append(f"finish reasons {finish}")
    if sorted(calls) != list(range(len(calls))):
        errors.append(f"tool call indexes {sorted(calls)}")
    if usage and not usage_seen:
        errors.append("no usage chunk though stream_options asked for one")
    ordered = [calls[i] for i in sorted(calls)]
    answer = Answer("".join(content) or None, ordered, finish[0] if finish else None, errors)
    _check_finish(answer)
    return answer


def _add_delta(calls: dict[int, dict[str, str]], delta: object, errors: list[str]) -> None:
    index = getattr(delta, "index", None)
    if not isinstance(index, int):
        errors.append(f"a tool call delta without an index: {delta!r}"[:300])
        return
    function = getattr(delta, "function", None)
    if index not in calls:
        if not delta.id or delta.type != "function" or function is None or not function.name:  # type: ignore[attr-defined]
            errors.append(f"call {index}'s first delta lacks id/type/name: {delta!r}"[:300])
        calls[index] = {"id": delta.id or "", "name": "", "arguments": ""}  # type: ignore[attr-defined]
    elif delta.id and delta.id != calls[index]["id"]:  # type: ignore[attr-defined]
        errors.append(f"call {index} got a second id")
    if function is not None:
        calls[index]["name"] += function.name or ""
        calls[index]["arguments"] += function.arguments or ""


def _check_finish(answer: Answer) -> None:
    if answer.finish_reason not in FINISH_REASONS:
        answer.shape_errors.append(f"finish_reason {answer.finish_reason!r}")
    elif answer.finish_reason == "tool_calls" and not answer.calls:
        answer.shape_errors.append("finish_reason tool_calls without a call")


def classify(plan: Plan, answer: Answer) -> tuple[Outcome, str]:
    """The outcome of one answer to ``plan``, and why (empty when fine)."""
    if answer.shape_errors:
        return Outcome.NOT_OPENAI_SHAPED, "; ".join(answer.shape_errors)[:600]
    cut = answer.finish_reason == "length"
    if not answer.calls:
        if plan.choice == "auto":
            return Outcome.OK_TEXT, ""
        if cut:
            return Outcome.CUT, f"finish length before a call (tool_choice {plan.choice})"
        return Outcome.INVALID, f"no call under tool_choice {plan.choice}: {answer.content!r}"[:600]
    declared = {t["function"]["name"] for t in plan.tools}
    if not plan.parallel and len(answer.calls) > 1:
        return Outcome.INVALID, f"{len(answer.calls)} calls with parallel_tool_calls false"
    for n, call in enumerate(answer.calls):
        last = n == len(answer.calls) - 1
        if call["name"] not in declared or (plan.named and call["name"] != plan.named):
            return Outcome.INVALID, f"call of {call['name']!r} (declared {sorted(declared)}, named {plan.named})"
        errors = argument_errors(call["name"], call["arguments"], plan.tools)
        if errors and _not_json(call["arguments"]):
            if cut and last:
                return Outcome.CUT, ""
            return Outcome.UNPARSEABLE, f"{call['name']}: {call['arguments'][:400]!r}"
        if errors:
            return Outcome.INVALID, f"{call['name']}({call['arguments'][:400]}): {errors[:3]}"[:600]
    return Outcome.OK_VALID, ""


def _not_json(arguments: str) -> bool:
    try:
        json.loads(arguments)
    except ValueError:
        return True
    return False
