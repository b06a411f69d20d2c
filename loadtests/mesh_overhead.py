r"""Mesh overhead on the full request path: TTFT and inter-token latency through the edge minus the same sim
engine called directly on the bus, with the mesh started exactly as ``infermesh up`` starts it (admission leader
and standby, breaker, two routers, metering with its ledger, batch, the worker, two edges; loadtests/lib/up_mesh.py).

Per round and concurrency, both paths hit the same worker process, one after the other, so machine noise lands on
both. "Direct" publishes a GenerateRequest to the worker (with the edge's own bus credentials) and times each
TokenChunk; "edge" sends an OpenAI streaming chat request over HTTP (auth, admission lease, validation, chat
template, tokenization, routing, worker, detokenization, SSE, billing) and times each content chunk. Both clients
are lean (nats-py; a wrk-like keep-alive HTTP/1.1 client, loadtests/lib/sse_client.py). Overhead = median over
rounds of (edge pXX - direct pXX); CPU per request of every process over the edge phase.

``--tracing both`` runs a second, identical mesh beside the first whose services trace every request to an OTLP
receiver (every span exported), and alternates the two edges in each round: the cost of tracing, side by side.
A failed request fails the run (after all rounds are printed).

    python -m loadtests.mesh_overhead --tracing both --concurrency 1 16 64 --rounds 5 --requests 128 \
        --out docs/results/mesh_overhead
    python -m loadtests.mesh_overhead --tracing both --trace-ratio 0.1 --concurrency 16 --rounds 5 --requests 128 \
        --out docs/results/mesh_overhead_sampled
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

from loadtests.lib.mesh_overhead_report import plot, summary
from loadtests.lib.sse_client import LeanSseClient
from loadtests.lib.stats import summarize_ms
from loadtests.lib.up_mesh import KEY, MODEL, WORKER_ID, UpMesh
from shared import schema
from shared.bus import Bus, StreamReceiver
from shared.schema import GenerateRequest, SamplingParams, TokenChunk

PROMPT = "Summarize what a KV-cache-aware router does for agent workloads in one sentence."
MAX_TOKENS = 16


class Failures(list):
    """Every request that failed (kind: message), reported at the end; the run then fails."""


async def direct_timings(bus: Bus, receiver: StreamReceiver, prompt_ids: list[int]) -> tuple[float, list[float]]:
    request_id = uuid.uuid4().hex
    stream = receiver.open(request_id, WORKER_ID, 10.0, 10.0)
    start = time.perf_counter()
    await bus.nc.publish(bus.subjects.worker_generate(WORKER_ID), schema.encode(GenerateRequest(
        request_id, MODEL, prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))),
        reply=receiver.subject(request_id))
    arrivals = []
    try:
        while not stream.done:
            message = await stream.next()
            if isinstance(message, TokenChunk):
                arrivals.append(time.perf_counter())
    finally:
        receiver.close(request_id)
    if not arrivals:
        raise RuntimeError("the worker sent no tokens")
    return arrivals[0] - start, [b - a for a, b in itertools.pairwise(arrivals)]


def edge_body() -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
            "stream": True, "ignore_eos": True}


async def load(fn, concurrency: int, per_stream: int, failures: Failures) -> tuple[list[float], list[float]]:
    """``concurrency`` closed-loop streams of ``per_stream`` requests: (TTFTs, inter-token gaps)."""
    ttfts: list[float] = []
    gaps: list[float] = []

    async def one_stream() -> None:
        for _ in range(per_stream):
            try:
                ttft, itl = await fn()
            except Exception as exc:  # counted and reported; the run fails at the end
                failures.append(f"{type(exc).__name__}: {exc}")
                continue
            ttfts.append(ttft)
            gaps.extend(itl)

    await asyncio.gather(*[one_stream() for _ in range(concurrency)])
    return ttfts, gaps


async def measured(mesh: UpMesh, fn, concurrency: int, per_stream: int, failures: Failures) -> dict:
    before = mesh.cpu_seconds()
    ttfts, gaps = await load(fn, concurrency, per_stream, failures)
    after = mesh.cpu_seconds()
    n = max(len(ttfts), 1)
    return {"ttft": summarize_ms(ttfts), "itl": summarize_ms(gaps),
            "cpu_ms_per_request": {name: (after[name] - before.get(name, 0.0)) * 1000 / n for name in after}}


async def _start(args: argparse.Namespace, root: Path, model_path: Path, traced_to: str) -> UpMesh:
    env = {}
    if traced_to:  # every trace, or OpenTelemetry's ratio sampler (what it leaves out is still recorded)
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": traced_to, "OTEL_TRACES_SAMPLER": "always_on"}
        if args.trace_ratio < 1:
            env.update(OTEL_TRACES_SAMPLER="parentbased_traceidratio", OTEL_TRACES_SAMPLER_ARG=str(args.trace_ratio))
    mesh = UpMesh(root / ("traced" if traced_to else "plain"), model_path, args.sim_ttft_ms, args.sim_itl_ms, env,
                  args.database_url)
    await asyncio.to_thread(mesh.start)  # (start_processes runs its own event loop to provision NATS)
    return mesh


async def run(args: argparse.Namespace, traced_to: str) -> dict:
    from infermesh.models import make_tiny_llama
    from services.edge.tokenizer import ModelTokenizer

    root = Path(tempfile.mkdtemp(prefix="infermesh-bench-"))
    model_path = make_tiny_llama(root / "tiny")
    meshes = {"edge": await _start(args, root, model_path, "")}
    failures = Failures()
    report: dict = {"command": "python -m loadtests.mesh_overhead " + " ".join(args.argv),
                    "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                    "path": "infermesh up (locked NATS, 2 routers, breaker, 2 admission, metering, batch, "
                            "1 sim worker, 2 edges)", "tracing": args.tracing, "trace_ratio": args.trace_ratio,
                    "max_tokens": MAX_TOKENS,
                    "sim_ttft_ms": args.sim_ttft_ms, "sim_itl_ms": args.sim_itl_ms, "rounds": args.rounds,
                    "results": []}
    try:
        if traced_to:
            meshes["edge_traced"] = await _start(args, root, model_path, traced_to)
        bus = await meshes["edge"].direct_bus()
        receiver = StreamReceiver(bus, "benchdirect")
        await receiver.start()
        prompt_ids = ModelTokenizer(str(model_path)).apply_chat_template([{"role": "user", "content": PROMPT}])
        clients = {name: LeanSseClient("127.0.0.1", mesh.port, "/v1/chat/completions", KEY)
                   for name, mesh in meshes.items()}
        paths = {"direct": lambda: direct_timings(bus, receiver, prompt_ids),
                 **{name: (lambda c=client: c.timings(edge_body())) for name, client in clients.items()}}
        for fn in paths.values():  # warm-up: a failure here stops the run at once
            warm = Failures()
            await load(fn, 4, 5, warm)
            if warm:
                raise SystemExit(f"warm-up failed: {warm[:3]}")
        for concurrency in args.concurrency:
            per_stream = max(3, args.requests // concurrency)
            rounds = []
            for _ in range(args.rounds):
                one = {}
                for name, fn in paths.items():
                    mesh = meshes.get(name, meshes["edge"])
                    one[name] = await measured(mesh, fn, concurrency, per_stream, failures)
                rounds.append(one)
            entry = summary(concurrency, per_stream * concurrency, rounds, list(clients))
            report["results"].append(entry)
            print(json.dumps({k: v for k, v in entry.items() if k != "rounds"}), flush=True)
        for client in clients.values():
            client.close()
        await receiver.stop()
        await bus.close()
    finally:
        for mesh in meshes.values():
            mesh.stop()
        shutil.rmtree(root, ignore_errors=True)
    report["failures"] = len(failures)
    if failures:
        raise SystemExit(f"{len(failures)} requests failed, e.g. {failures[:3]}")
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--requests", type=int, default=200, help="requests per round and concurrency, per path")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sim-ttft-ms", type=float, default=20.0)
    parser.add_argument("--sim-itl-ms", type=float, default=5.0)
    parser.add_argument("--tracing", choices=["off", "both"], default="off",
                        help="both: a second mesh tracing every request, its edge measured beside the first")
    parser.add_argument("--trace-ratio", type=float, default=1.0,
                        help="the traced mesh's sampling ratio (1: every trace; below 1, parentbased_traceidratio)")
    parser.add_argument("--database-url", default="", help="the ledger (default: SQLite in the run's folder)")
    parser.add_argument("--out", default="loadtests/out/mesh_overhead", help="path prefix for .json and .png")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if args.tracing == "both":
        from tests.otlp_receiver import OtlpReceiver

        with OtlpReceiver(keep_spans=False) as otlp:  # a sink: takes every export, decodes none
            report = asyncio.run(run(args, otlp.endpoint))
            report["otlp_exports"] = {"requests": otlp.requests, "bytes": otlp.bytes_received}
    else:
        report = asyncio.run(run(args, ""))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return report


if __name__ == "__main__":
    main()
