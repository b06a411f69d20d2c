"""Batch jobs on idle capacity (issue 17, point 4): what a large batch costs interactive traffic, how much of the
idle capacity it gets, and what grouping its lines by prompt prefix does to the KV cache, on one sim fleet.

Every service is its own process (loadtests/lib/batch_mesh.py): NATS, router, admission, metering, edge, the
batch service, sim workers. Each run is these phases, back to back on the same mesh:

    probe      a closed loop of streams, more than the pool admits: the fleet's capacity in lines/s of the
               batch's shape (prompt, max_tokens)
    alone      interactive streams alone, Poisson at --interactive-share of the first run's capacity
    mixed      the same interactive load while a --batch-lines batch runs (its lines of the same shape);
               TTFT and batch rate over the batch's steady window (10% to 90% of its lines done)
    prefix     --prefixes system prompts x --questions questions as one batch, dispatched in prefix order
    shuffled   the same shape, fresh prompts, with the batch service restarted as --dispatch-order shuffled
               (prefix and shuffled alternate which goes first from run to run)

Figures per run, then their medians over --runs (loadtests/lib/batch_report.py):

    TTFT p50 / p99 with the batch / alone                                  goal: p99 <= 1.2x
    batch lines/s / (capacity - interactive lines/s)                       goal: >= 80% of the idle capacity
    cached prompt tokens / prompt tokens, prefix order vs shuffled

    python -m loadtests.batch --runs 3 --out docs/results/batch
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from loadtests.lib.batch_load import (
    TextClient,
    interactive,
    plain_lines,
    prefix_lines,
    probe,
    run_batch,
    sdk_client,
    steady_window,
)
from loadtests.lib.batch_mesh import KEY, BenchMesh, FleetSpec
from loadtests.lib.batch_report import hit_rate, run_figures, summarize, ttft_figures, write_report


def _say(message: str) -> None:
    print(f"batch: {message}", file=sys.stderr, flush=True)


class Bench:
    def __init__(self, args: argparse.Namespace, mesh: BenchMesh) -> None:
        self.args, self.mesh = args, mesh
        self.http = TextClient("127.0.0.1", mesh.port, "/v1/completions", KEY)
        self.sdk = sdk_client(mesh.port, KEY)
        self.rate = args.interactive_rate

    async def run(self, index: int) -> dict:
        a, seed = self.args, 1000 * (index + 1)
        capacity = await probe(self.http, a.probe_concurrency, a.probe_s, seed, a.prompt_tokens, a.max_tokens)
        self.rate = self.rate or a.interactive_share * capacity["lines_per_s"]
        _say(f"run {index}: capacity {capacity['lines_per_s']:.1f} lines/s; interactive at {self.rate:.1f}/s")
        stop = asyncio.Event()
        alone_task = asyncio.create_task(interactive(self.http, self.rate, stop, seed + 1, a.prompt_tokens,
                                                     a.max_tokens))
        await asyncio.sleep(a.interactive_s)  # the phase's length: a benchmark's clock, not a wait on a condition
        stop.set()
        alone = await alone_task
        _say(f"run {index}: alone done ({len(alone)} requests); mixed with {a.batch_lines} batch lines")
        mixed = await self.mixed(seed + 2)
        prefix = {}
        orders = ("prefix", "shuffled") if index % 2 == 0 else ("shuffled", "prefix")
        for k, order in enumerate(orders):
            if self.mesh.dispatch_order != order:
                self.mesh.restart_batch(order)
            lines = prefix_lines(seed + 10 + k, a.prefixes, a.questions, a.prefix_tokens, a.question_tokens,
                                 a.prefix_max_tokens)
            start = time.perf_counter()
            job = await run_batch(self.sdk, lines)
            prefix[order] = {**hit_rate(job), "seconds": time.perf_counter() - start}
            _say(f"run {index}: {order}: hit rate {prefix[order]['hit_rate']:.1%}, {prefix[order]['seconds']:.1f} s")
        return run_figures(capacity, self.rate, a.interactive_s, alone, mixed, prefix)

    async def mixed(self, seed: int) -> dict:
        a, stop = self.args, asyncio.Event()
        load = asyncio.create_task(interactive(self.http, self.rate, stop, seed, a.prompt_tokens, a.max_tokens))
        job = await run_batch(self.sdk, plain_lines(seed, a.batch_lines, a.prompt_tokens, a.max_tokens))
        stop.set()
        shots = await load
        start, end, lines_per_s = steady_window(job["samples"], job["total"])
        window = [s for s in shots if start <= s.sent_at <= end]
        return {"ttft": ttft_figures(window), "requests_in_window": len(window),
                "failed": sum(bool(s.error) for s in shots), "requests": len(shots),
                "batch": {k: job[k] for k in ("status", "total", "completed", "failed")},
                "batch_lines_per_s": lines_per_s, "window_s": end - start,
                "batch_s": job["samples"][-1][0] - job["samples"][0][0]}


async def bench(args: argparse.Namespace, mesh: BenchMesh) -> list[dict]:
    b = Bench(args, mesh)
    try:
        return [await b.run(i) for i in range(args.runs)]
    finally:
        b.http.close()
        await b.sdk.close()


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--batch-lines", type=int, default=3000)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--interactive-share", type=float, default=0.3, help="of the first probe's capacity")
    p.add_argument("--interactive-rate", type=float, default=0.0, help="requests/s (overrides the share)")
    p.add_argument("--interactive-s", type=float, default=60.0, help="the alone phase, in s")
    p.add_argument("--probe-s", type=float, default=8.0)
    p.add_argument("--probe-concurrency", type=int, default=48)
    p.add_argument("--prefixes", type=int, default=50)
    p.add_argument("--questions", type=int, default=40)
    p.add_argument("--prefix-tokens", type=int, default=128)
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--prefix-max-tokens", type=int, default=4)
    p.add_argument("--max-in-flight", type=int, default=64, help="the batch service's lines at once")
    p.add_argument("--batch-share", type=float, default=None,
                   help="admission's ceiling for batch leases, of the pool (default: admission's own default)")
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--kv-blocks", type=int, default=96)
    p.add_argument("--ttft-ms", type=float, default=10.0)
    p.add_argument("--prefill-us-per-token", type=float, default=20.0)
    p.add_argument("--itl-ms", type=float, default=10.0)
    p.add_argument("--out", default="")
    return p.parse_args(argv)


def admission_args(args: argparse.Namespace) -> list[str]:
    return [] if args.batch_share is None else ["--batch-share", str(args.batch_share)]


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    fleet = FleetSpec(args.processes, args.engines, args.kv_blocks, 16, args.ttft_ms, args.prefill_us_per_token,
                      args.itl_ms)
    from infermesh.models import make_tiny_llama

    with tempfile.TemporaryDirectory(prefix="batch-bench-") as tmp:
        state = Path(tmp)
        mesh = BenchMesh(state, fleet, str(make_tiny_llama(state / "tokenizer")), args.max_in_flight,
                         admission_args(args))
        try:
            mesh.start("prefix")
            runs = asyncio.run(bench(args, mesh))
        finally:
            mesh.stop()
    report = summarize(args, fleet, runs, "python -m loadtests.batch " + " ".join(argv))
    if args.out:
        write_report(Path(args.out), report)
    return report


if __name__ == "__main__":
    main()
