"""Where an Anthropic request asks its prompt cache to end (``cache_control`` breakpoints), pure.

Anthropic caches the prompt in the order tools, system, messages, up to the last block marked ``cache_control``
(a top-level ``cache_control`` marks the last message: automatic caching). Here every engine keeps every computed
KV block anyway (the sim's block pool, vLLM's prefix cache) and drops the least recently used; a breakpoint cannot
make it keep more. It says that the client asked for cache writes (Anthropic's ``cache_creation_input_tokens``,
services/edge/shapes/messages.py) and which prefix it will send again: the prompt tokens up to the breakpoint
(``Prepared.cache_prefix_tokens``), known for free when it marks the last message (the whole prompt); elsewhere
knowing it would take preparing the prefix again (Claude Code's first request: 4.5 -> 6.3 ms of preparation), so
it is left unknown (0). The router records it (services/router/README.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec


class _Marked(msgspec.Struct):
    cache_control: Any = None


class _Message(msgspec.Struct):
    content: str | list[_Marked] = ""


class _Breakpoints(msgspec.Struct):
    """Only what says where the breakpoints are: everything else in the body is skipped unread."""

    cache_control: Any = None
    tools: list[_Marked] | None = None
    system: str | list[_Marked] | None = None
    messages: list[_Message] = []


_decoder = msgspec.json.Decoder(_Breakpoints)


def last_breakpoint(body: bytes) -> str | None:
    """The Messages param holding the last breakpoint: ``messages[i]``, ``system`` or ``tools``; None: no breakpoint
    (or a body this cannot read: the request's own validation says what is wrong with it)."""
    try:
        req = _decoder.decode(body)
    except msgspec.DecodeError:
        return None
    if req.cache_control is not None and req.messages:
        return f"messages[{len(req.messages) - 1}]"
    for i in range(len(req.messages) - 1, -1, -1):
        content = req.messages[i].content
        if not isinstance(content, str) and any(block.cache_control is not None for block in content):
            return f"messages[{i}]"
    if isinstance(req.system, list) and any(block.cache_control is not None for block in req.system):
        return "system"
    if req.tools and any(tool.cache_control is not None for tool in req.tools):
        return "tools"
    return None


def messages_up_to(breakpoint: str | None, origins: Sequence[str]) -> int:
    """How many chat messages (``origins``: the Messages param each came from) the cached prefix covers: up to the
    last one from the breakpoint's param (tools are rendered with the system turn); 0 when none does."""
    if breakpoint is None:
        return 0
    wanted = {"system"} if breakpoint in ("system", "tools") else {breakpoint}
    covered = [i + 1 for i, origin in enumerate(origins) if origin in wanted]
    if breakpoint == "tools" and not covered:  # no system turn: the tools lead the first message's turn
        return 0
    if breakpoint.startswith("messages[") and not covered:  # (an empty message makes no chat message)
        index = int(breakpoint[len("messages["):-1])
        covered = [i + 1 for i, origin in enumerate(origins)
                   if origin.startswith("messages[") and int(origin[len("messages["):-1]) <= index]
    return max(covered, default=0)
