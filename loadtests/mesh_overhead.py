"""Mesh overhead: TTFT through the edge minus TTFT of the same sim engine called directly on the bus.

Both paths hit the same worker process in the same run, alternating (direct, edge,
direct, edge, ...) so machine noise lands on both. "Direct" publishes a
GenerateRequest to the worker and waits for the first TokenChunk; "edge" sends an
OpenAI streaming chat request over HTTP (auth, validation, chat template,
tokenization, route request, worker, detokenization, SSE) and waits for the first
content chunk. Both clients are lean (nats-py on one side, a wrk-like keep-alive
HTTP/1.1 client on the other, loadtests/lib/sse_client.py), so what is measured is the
mesh, not the load generator's HTTP parsing. Overhead per concurrency = median over rounds of (edge pXX - direct pXX).

    python -m loadtests.mesh_overhead --concurrency 1 16 64 --rounds 3 --out docs/results/mesh_overhead
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from infermesh.processes import ProcessGroup
from loadtests.lib.sse_client import LeanSseClient
from loadtests.lib.stats import summarize_ms
from shared import schema
from shared.bus import Bus, StreamReceiver
from shared.ports import free_port, wait_for_port
from shared.schema import GenerateRequest, SamplingParams, TokenChunk

KEY = "bench-key"
PROMPT = "Summarize what a KV-cache-aware router does for agent workloads in one sentence."


async def direct_ttft(bus: Bus, receiver: StreamReceiver, worker_id: str, prompt_ids: list[int]) -> float:
    request_id = uuid.uuid4().hex
    stream = receiver.open(request_id, worker_id, 10.0, 10.0)
    start = time.perf_counter()
    await bus.nc.publish(bus.subjects.worker_generate(worker_id),
                         schema.encode(GenerateRequest(request_id, "bench", prompt_ids,
                                                       SamplingParams(max_tokens=4, ignore_eos=True))),
                         reply=receiver.subject(request_id))
    first = await stream.next()
    ttft = time.perf_counter() - start
    assert isinstance(first, TokenChunk), first
    while not stream.done:
        await stream.next()
    receiver.close(request_id)
    return ttft


async def edge_ttft(client: LeanSseClient) -> float:
    body = {"model": "bench", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, "stream": True}
    return await client.ttft(body)


def cpu_seconds(group: ProcessGroup) -> dict[str, float]:
    """User+system CPU time consumed so far by each service process."""
    import psutil

    out = {}
    for child in group.children:
        try:
            times = psutil.Process(child.popen.pid).cpu_times()
            out[child.name] = times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return out


async def _load(fn, concurrency: int, requests_per_stream: int) -> list[float]:
    async def one_stream() -> list[float]:
        return [await fn() for _ in range(requests_per_stream)]

    results = await asyncio.gather(*[one_stream() for _ in range(concurrency)])
    return [t for r in results for t in r]


async def run(args: argparse.Namespace) -> dict:
    state = Path(tempfile.mkdtemp(prefix="infermesh-bench-"))
    group = ProcessGroup(state / "logs")
    nats_port, http_port = free_port(), free_port()
    group.spawn_nats(nats_port, state / "nats")
    assert wait_for_port(nats_port, 10)
    nats_url = f"nats://127.0.0.1:{nats_port}"
    env = {"INFERMESH_NATS_URL": nats_url, "INFERMESH_NAMESPACE": "bench", "INFERMESH_DEV_KEY": KEY}
    from infermesh.models import make_tiny_llama

    tokenizer_dir = make_tiny_llama(state / "tiny")
    group.python_service("router", "services.router", [], env)
    group.python_service("worker", "services.worker", [
        "--worker-id", "sim-0", "--engine", "sim", "--model", "bench", "--model-path", str(tokenizer_dir),
        "--sim-ttft-ms", str(args.sim_ttft_ms), "--sim-itl-ms", str(args.sim_itl_ms)], env)
    group.python_service("edge", "services.edge", ["--http-port", str(http_port)], env)
    report: dict = {"command": "python -m loadtests.mesh_overhead " + " ".join(sys.argv[1:]),
                    "machine": {"cpus": __import__("os").cpu_count(), "python": platform.python_version()},
                    "sim_ttft_ms": args.sim_ttft_ms, "rounds": args.rounds, "results": []}
    try:
        assert wait_for_port(http_port, 60), "edge did not start"
        bus = await Bus.connect(nats_url, "bench", "bench-client")
        receiver = StreamReceiver(bus, "benchdirect")
        await receiver.start()
        from services.edge.tokenizer import ModelTokenizer

        prompt_ids = ModelTokenizer(str(tokenizer_dir)).apply_chat_template([{"role": "user", "content": PROMPT}])
        http = LeanSseClient("127.0.0.1", http_port, "/v1/chat/completions", KEY)
        for _ in range(100):  # wait for readiness, then warm up both paths
            try:
                await edge_ttft(http)
                break
            except Exception:
                await asyncio.sleep(0.2)
        await _load(lambda: direct_ttft(bus, receiver, "sim-0", prompt_ids), 4, 10)
        await _load(lambda: edge_ttft(http), 4, 10)
        for concurrency in args.concurrency:
            per_stream = max(3, args.requests // concurrency)
            rounds = []
            for _ in range(args.rounds):
                direct = summarize_ms(await _load(
                    lambda: direct_ttft(bus, receiver, "sim-0", prompt_ids), concurrency, per_stream))
                cpu_before = cpu_seconds(group)
                edge = summarize_ms(await _load(lambda: edge_ttft(http), concurrency, per_stream))
                cpu_after = cpu_seconds(group)
                cpu_ms = {name: (cpu_after[name] - cpu_before.get(name, 0.0)) * 1000 / (per_stream * concurrency)
                          for name in cpu_after}
                rounds.append({"direct": direct, "edge": edge, "cpu_ms_per_edge_request": cpu_ms})
            entry = {"concurrency": concurrency, "requests_per_round": per_stream * concurrency, "rounds": rounds}
            for q in ("p50", "p99"):
                entry[f"overhead_{q}_ms"] = statistics.median(
                    r["edge"][f"{q}_ms"] - r["direct"][f"{q}_ms"] for r in rounds)
                entry[f"direct_{q}_ms"] = statistics.median(r["direct"][f"{q}_ms"] for r in rounds)
                entry[f"edge_{q}_ms"] = statistics.median(r["edge"][f"{q}_ms"] for r in rounds)
            entry["cpu_ms_per_edge_request"] = {
                name: statistics.median(r["cpu_ms_per_edge_request"][name] for r in rounds)
                for name in rounds[0]["cpu_ms_per_edge_request"]}
            report["results"].append(entry)
            print(json.dumps({k: v for k, v in entry.items() if k != "rounds"}), flush=True)
        http.close()
        await receiver.stop()
        await bus.close()
    finally:
        group.stop()
        shutil.rmtree(state, ignore_errors=True)
    return report


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    labels = [str(r["concurrency"]) for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([i - 0.2 for i in x], [r["overhead_p50_ms"] for r in rows], 0.4, label="overhead p50")
    ax.bar([i + 0.2 for i in x], [r["overhead_p99_ms"] for r in rows], 0.4, label="overhead p99")
    ax.axhline(3.0, color="gray", linestyle="--", linewidth=1, label="target p50 @16: 3 ms")
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("edge TTFT - direct bus TTFT (ms)")
    ax.set_title(f"infermesh mesh overhead (sim engine, median of {report['rounds']} rounds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--requests", type=int, default=200, help="requests per round and concurrency")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sim-ttft-ms", type=float, default=20.0)
    parser.add_argument("--sim-itl-ms", type=float, default=5.0)
    parser.add_argument("--out", default="loadtests/out/mesh_overhead", help="path prefix for .json and .png")
    args = parser.parse_args()
    report = asyncio.run(run(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
