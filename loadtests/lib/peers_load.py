"""The peers benchmark's load: closed-loop OpenAI streaming chat requests, the same for every stack.

``UsageSseClient`` is the lean keep-alive client of loadtests/lib/sse_client.py that also reads the stream's usage
(``stream_options.include_usage``), so output tokens are the server's count, not a count of content chunks; a stream
that ends with fewer tokens than asked (``ignore_eos``) or carries an error event is a failed request.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from dataclasses import dataclass, field

from loadtests.lib.sse_client import EMPTY_CONTENT, FIRST_CONTENT, LeanSseClient, read_chunks
from loadtests.lib.stats import summarize_ms
from loadtests.lib.up_mesh import MODEL

# A fixed prompt set, cycled over the requests of every phase: the same bodies, in the same order, for every stack.
PROMPTS = [
    "Summarize what a KV-cache-aware router does for agent workloads in one sentence.",
    "Write a short poem about the moon over a quiet harbour.",
    "Explain why a server streams tokens to its client as soon as they are ready.",
    "List five things a baker does before the shop opens in the morning.",
    "Tell me a story about a little model that learned the alphabet, then words, then whole sentences, and in the "
    "end wrote long stories about rivers, mountains, cities and the sea.",
    "What is the difference between a queue and a stack? Answer briefly.",
    "Describe the weather today and tomorrow in two sentences.",
    "Why do programmers write tests before they change a large codebase?",
]
COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')
PROMPT_TOKENS = re.compile(rb'"prompt_tokens":\s*(\d+)')
ERROR_EVENT = re.compile(rb'data:\s*\{\s*"error"\s*:')
SPACED_CONTENT, SPACED_EMPTY = b'"content": "', b'"content": ""'  # servers that put a space after the colon


def chat_body(prompt: str, max_tokens: int) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def _has_content(chunk: bytes) -> bool:
    chunk = chunk.replace(EMPTY_CONTENT, b"").replace(SPACED_EMPTY, b"")
    return FIRST_CONTENT in chunk or SPACED_CONTENT in chunk


class UsageSseClient(LeanSseClient):
    async def stream(self, body: dict, timeout_s: float) -> tuple[float, list[float], int, int]:
        """(seconds to the first content delta, gaps between content chunks after it, the usage's output and prompt
        tokens)."""
        arrivals: list[float] = []
        num_tokens = num_prompt = -1
        async with asyncio.timeout(timeout_s):
            reader, writer, head, start = await self._send(self._request(body))
            try:
                if not head.startswith(b"HTTP/1.1 200"):
                    detail = await asyncio.wait_for(reader.read(500), 2.0)
                    raise RuntimeError(f"HTTP error: {head[:200]!r} {detail!r}")
                async for chunk in read_chunks(reader):
                    if _has_content(chunk):
                        arrivals.append(time.perf_counter())
                    if ERROR_EVENT.search(chunk):
                        raise RuntimeError(f"error event in the stream: {chunk[:500]!r}")
                    usage = COMPLETION_TOKENS.search(chunk)
                    if usage:
                        num_tokens = int(usage.group(1))
                        prompt = PROMPT_TOKENS.search(chunk)
                        num_prompt = int(prompt.group(1)) if prompt else -1
            except BaseException:
                writer.close()  # never reused: what is left of this response may still arrive on it
                raise
        self._idle.append((reader, writer))
        if not arrivals:
            raise RuntimeError("the stream carried no content")
        if num_tokens != body["max_tokens"]:
            raise RuntimeError(f"{num_tokens} output tokens in the usage, {body['max_tokens']} asked (ignore_eos)")
        return arrivals[0] - start, [b - a for a, b in itertools.pairwise(arrivals)], num_tokens, num_prompt


@dataclass
class PhaseLoad:
    """What one closed-loop phase saw: every TTFT and inter-chunk gap, tokens, wall time, and every failure."""

    ttfts: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    num_tokens: int = 0
    num_prompt_tokens: int = 0  # the same prompts through every stack: the same sum, unless templates differ
    wall_s: float = 0.0
    failures: list[str] = field(default_factory=list)

    def figures(self) -> dict:
        return {"requests": len(self.ttfts), "failed": len(self.failures), "output_tokens": self.num_tokens,
                "prompt_tokens": self.num_prompt_tokens,
                "wall_s": self.wall_s, "output_tok_s": self.num_tokens / self.wall_s if self.wall_s else 0.0,
                "ttft": summarize_ms(self.ttfts), "itl": summarize_ms(self.gaps)}


async def closed_loop(client: UsageSseClient, concurrency: int, per_stream: int, max_tokens: int,
                      timeout_s: float) -> PhaseLoad:
    """``concurrency`` streams, each sending ``per_stream`` requests one after another (prompts cycled)."""
    load = PhaseLoad()

    async def one_stream(stream: int) -> None:
        for k in range(per_stream):
            prompt = PROMPTS[(stream * per_stream + k) % len(PROMPTS)]
            try:
                ttft, gaps, num_tokens, num_prompt = await client.stream(chat_body(prompt, max_tokens), timeout_s)
            except Exception as exc:  # every failure is reported; the benchmark then fails
                load.failures.append(f"{type(exc).__name__}: {exc}")
                continue
            load.ttfts.append(ttft)
            load.gaps.extend(gaps)
            load.num_tokens += num_tokens
            load.num_prompt_tokens += num_prompt

    start = time.perf_counter()
    await asyncio.gather(*[one_stream(i) for i in range(concurrency)])
    load.wall_s = time.perf_counter() - start
    return load
