"""What the batch benchmark sends: interactive streams (open-loop Poisson, their TTFT), a saturating probe of the
fleet's capacity, and batch jobs through the OpenAI SDK (upload, create, progress samples, the output's usage).

Every prompt is token ids (``/v1/completions``), so its length and what it shares with others are exact:

    plain_lines    n lines of ``prompt_tokens`` random ids each: nothing shared (the load of points 1 and 2)
    prefix_lines   ``prefixes`` system prompts x ``questions`` questions, the file ordered question by question
                   (q0 of every prefix, then q1, ...), so only the dispatcher can group a prefix's lines
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import openai

from loadtests.lib.batch_mesh import MODEL
from loadtests.lib.sse_client import LeanSseClient, read_chunks

FIRST_TEXT = b'"text":"'
EMPTY_TEXT = b'"text":""'
VOCAB = (10, 1000)  # token ids drawn from here (the tiny tokenizer's vocabulary is larger)


def body(prompt: list[int], max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


def plain_lines(seed: int, n: int, prompt_tokens: int, max_tokens: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions",
             "body": body(random_ids(rng, prompt_tokens), max_tokens)} for i in range(n)]


def prefix_lines(seed: int, prefixes: int, questions: int, prefix_tokens: int, question_tokens: int,
                 max_tokens: int) -> list[dict]:
    rng = random.Random(seed)
    systems = [random_ids(rng, prefix_tokens) for _ in range(prefixes)]
    return [{"custom_id": f"s{s}q{q}", "method": "POST", "url": "/v1/completions",
             "body": body(systems[s] + random_ids(rng, question_tokens), max_tokens)}
            for q in range(questions) for s in range(prefixes)]


class TextClient(LeanSseClient):
    """The lean keep-alive client, for streamed ``/v1/completions`` (``"text"`` deltas)."""

    async def first_text(self, request_body: dict, timeout_s: float = 60.0) -> float:
        """Seconds from sending to the first non-empty text delta; reads the whole stream."""
        first: float | None = None
        async with asyncio.timeout(timeout_s):
            reader, writer, head, start = await self._send(self._request({**request_body, "stream": True}))
            if not head.startswith(b"HTTP/1.1 200"):
                writer.close()
                raise RuntimeError(head.split(b"\r\n", 1)[0].decode(errors="replace"))
            async for chunk in read_chunks(reader):
                if first is None and FIRST_TEXT in chunk.replace(EMPTY_TEXT, b""):
                    first = time.perf_counter() - start
        self._idle.append((reader, writer))
        if first is None:
            raise RuntimeError("the stream carried no text")
        return first


@dataclass(slots=True)
class Shot:
    """One interactive request: when it was sent (perf_counter), its TTFT, or why it failed."""

    sent_at: float
    ttft_s: float | None = None
    error: str = ""


async def _one(client: TextClient, request_body: dict, shots: list[Shot]) -> None:
    shot = Shot(time.perf_counter())
    shots.append(shot)
    try:
        shot.ttft_s = await client.first_text(request_body)
    except Exception as exc:  # recorded, counted as a failure in the report
        shot.error = str(exc)[:200] or type(exc).__name__


async def interactive(client: TextClient, rate: float, stop: asyncio.Event, seed: int, prompt_tokens: int,
                      max_tokens: int) -> list[Shot]:
    """Poisson arrivals at ``rate``/s until ``stop``; every request sent is waited for."""
    rng, shots, tasks = random.Random(seed), [], []
    due = time.perf_counter()
    while not stop.is_set():
        due += rng.expovariate(rate)
        try:
            await asyncio.wait_for(stop.wait(), max(0.0, due - time.perf_counter()))
            break
        except asyncio.TimeoutError:
            pass
        tasks.append(asyncio.create_task(_one(client, body(random_ids(rng, prompt_tokens), max_tokens), shots)))
    await asyncio.gather(*tasks)
    return shots


async def probe(client: TextClient, concurrency: int, seconds: float, seed: int, prompt_tokens: int,
                max_tokens: int) -> dict:
    """A closed loop of ``concurrency`` streams (more than the pool admits at once) for ``seconds``: what the
    fleet completes per second when it is never idle."""
    rng, shots = random.Random(seed), []
    end = time.perf_counter() + seconds

    async def loop() -> None:
        while time.perf_counter() < end:
            await _one(client, body(random_ids(rng, prompt_tokens), max_tokens), shots)

    start = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    done = [s for s in shots if not s.error]
    return {"lines_per_s": len(done) / elapsed, "requests": len(shots), "failed": len(shots) - len(done)}


def sdk_client(port: int, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=2, timeout=120)


async def run_batch(client: openai.AsyncOpenAI, lines: list[dict], poll_s: float = 0.2,
                    timeout_s: float = 1800.0) -> dict:
    """Upload, create, follow to the end (samples of completed lines over time), read the output's usage."""
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    upload = await client.files.create(file=("batch.jsonl", data), purpose="batch")
    batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                        completion_window="24h")
    samples: list[tuple[float, int]] = []
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        batch = await client.batches.retrieve(batch.id)
        counts = batch.request_counts
        samples.append((time.perf_counter(), (counts.completed + counts.failed) if counts else 0))
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            break
        await asyncio.sleep(poll_s)
    usage = []
    if batch.output_file_id:
        raw = (await client.files.content(batch.output_file_id)).read()
        for line in raw.splitlines():
            reply = json.loads(line)["response"]["body"]["usage"]
            usage.append((reply["prompt_tokens"], reply["prompt_tokens_details"]["cached_tokens"],
                          reply["completion_tokens"]))
    counts = batch.request_counts
    return {"id": batch.id, "status": batch.status, "total": counts.total if counts else 0,
            "completed": counts.completed if counts else 0, "failed": counts.failed if counts else 0,
            "samples": samples, "usage": usage}


def steady_window(samples: list[tuple[float, int]], total: int, lo: float = 0.1, hi: float = 0.9
                  ) -> tuple[float, float, float]:
    """(start, end, lines/s) between the first sample at >= lo of the lines done and the first at >= hi: the
    batch's steady rate, without its ramp-up and its tail (the last lines finish one by one)."""
    start = next(s for s in samples if s[1] >= lo * total)
    end = next(s for s in samples if s[1] >= hi * total)
    if end[0] <= start[0]:
        return start[0], samples[-1][0], total / max(1e-9, samples[-1][0] - samples[0][0])
    return start[0], end[0], (end[1] - start[1]) / (end[0] - start[0])
