"""Concurrent completions against a running mesh: how many fail, and how long they take.

    infermesh up --pd 1:1 --engine vllm --model tiny --model-path DIR --http-port 8200   # or --workers 2
    python -m loadtests.pd_concurrency --base-url http://127.0.0.1:8200/v1 --key KEY [--requests 96 --concurrency 8]

Prompts of 5..900 random token ids, max_tokens 1..60 with ignore_eos, in rounds of ``--concurrency``; prints each
failure and the totals (the figures in the P/D notes: 96 requests, 8 at a time, vs ``up --workers 2``).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import openai

LENGTHS = (5, 60, 127, 128, 129, 200, 256, 300, 429, 600, 900)


async def run(base_url: str, key: str, model: str, requests: int, concurrency: int, seed: int) -> int:
    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)
    rng = random.Random(seed)
    jobs = [([rng.randrange(10, 1000) for _ in range(rng.choice(LENGTHS))], rng.choice((1, 2, 16, 60)))
            for _ in range(requests)]
    failures = 0

    async def one(i: int, prompt: list[int], max_tokens: int) -> None:
        nonlocal failures
        try:
            await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                            extra_body={"ignore_eos": True})
        except openai.APIError as exc:
            failures += 1
            print(f"request {i} ({len(prompt)} prompt tokens): {type(exc).__name__}: {exc}")

    start = time.monotonic()
    for first in range(0, requests, concurrency):
        await asyncio.gather(*[one(first + k, p, m) for k, (p, m) in enumerate(jobs[first:first + concurrency])])
    print(f"{failures} of {requests} failed, {concurrency} at a time, in {time.monotonic() - start:.1f} s")
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(run(args.base_url, args.key, args.model, args.requests, args.concurrency, args.seed))


if __name__ == "__main__":
    main()
