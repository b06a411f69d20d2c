"""The edge's ceiling (issue 21.5): streamed tokens per second through the edge, and its CPU per streamed token,
with the sim engine at a high token rate, on the path ``infermesh up`` runs (loadtests/lib/up_mesh.py).

Per configuration, one edge or two sharing one port (SO_REUSEPORT), and the worker's token coalescing off (a
message per token) or on (8 tokens per message): ``--concurrency`` closed-loop streams of
``--max-tokens`` tokens each (``ignore_eos``) for ``--seconds``, at each concurrency in turn. Reported: output
tokens/s through the edge(s), the edges' CPU per streamed token, and each process's share of a core. On this
2-core machine the engine, NATS, the other services and the load generator share the cores with the edges: the
ceiling measured is the machine's unless the edges' share of a core says they were the bottleneck.

    python -m loadtests.edge_ceiling --out docs/results/edge_ceiling
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from loadtests.lib.bench_cli import conclude, parse
from loadtests.lib.sse_client import LeanSseClient
from loadtests.lib.up_mesh import KEY, MODEL, UpMesh


async def _drive(mesh: UpMesh, concurrency: int, seconds: float, max_tokens: int) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count."}], "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}
    clients = [LeanSseClient("127.0.0.1", mesh.port, "/v1/chat/completions", KEY) for _ in range(concurrency)]
    done, failed = [0], [0]
    deadline = time.monotonic() + seconds

    async def loop(client: LeanSseClient) -> None:
        while time.monotonic() < deadline:
            try:
                await client.timings(body, timeout_s=60)
                done[0] += 1
            except Exception:  # counted: the run's report says how many
                failed[0] += 1

    before, start = mesh.cpu_seconds(), time.monotonic()
    await asyncio.gather(*(loop(c) for c in clients))
    wall, after = time.monotonic() - start, mesh.cpu_seconds()
    for client in clients:
        client.close()
    tokens = done[0] * max_tokens
    cpu = {name: after[name] - before.get(name, 0.0) for name in after}
    edges = sum(v for name, v in cpu.items() if name.startswith("edge"))
    return {"concurrency": concurrency, "requests": done[0], "failed": failed[0], "wall_s": wall,
            "tokens_per_s": tokens / wall, "edge_cpu_us_per_token": edges / max(tokens, 1) * 1e6,
            "edge_core_share": edges / wall, "core_share": {name: v / wall for name, v in sorted(cpu.items())}}


async def run(args: argparse.Namespace) -> dict:
    from infermesh.models import make_tiny_llama

    root = Path(tempfile.mkdtemp(prefix="im-edge-ceiling-"))
    model_path = make_tiny_llama(root / "tiny")
    configs = [(edges, coalesce) for edges in args.edges for coalesce in args.coalesce]
    results = []
    for edges, coalesce in configs:
        mesh = UpMesh(root / f"e{edges}c{coalesce}", model_path, 1.0, args.sim_itl_ms,
                      edge_replicas=edges, sim_stream_interval=coalesce)
        await asyncio.to_thread(mesh.start)
        try:
            await _drive(mesh, 4, 2.0, args.max_tokens)  # warm-up: tokenizer loaded, connections made
            for concurrency in args.concurrency:
                row = {"edges": edges, "coalesce": coalesce, **await _drive(mesh, concurrency, args.seconds,
                                                                            args.max_tokens)}
                results.append(row)
                print(f"edge_ceiling: {edges} edge(s), {coalesce} token(s)/message, {concurrency} streams: "
                      f"{row['tokens_per_s']:,.0f} tokens/s, {row['edge_cpu_us_per_token']:.0f} us edge CPU/token, "
                      f"edges {row['edge_core_share'] * 100:.0f}% of a core, {row['failed']} failed",
                      file=sys.stderr, flush=True)
        finally:
            await asyncio.to_thread(mesh.stop)
    return {"command": "python -m loadtests.edge_ceiling " + " ".join(args.argv), "sim_itl_ms": args.sim_itl_ms,
            "max_tokens": args.max_tokens, "seconds": args.seconds, "results": results}


def write_report(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "edge_ceiling.json").write_text(json.dumps(report, indent=1) + "\n")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for edges, coalesce in sorted({(r["edges"], r["coalesce"]) for r in report["results"]}):
        rows = [r for r in report["results"] if (r["edges"], r["coalesce"]) == (edges, coalesce)]
        label = f"{edges} edge{'s' if edges > 1 else ''}, {coalesce} token{'s' if coalesce > 1 else ''}/message"
        left.plot([r["concurrency"] for r in rows], [r["tokens_per_s"] for r in rows], "o-", label=label)
        right.plot([r["concurrency"] for r in rows], [r["edge_cpu_us_per_token"] for r in rows], "o-", label=label)
    left.set(xlabel="concurrent streams", ylabel="output tokens/s through the edge", xscale="log")
    right.set(xlabel="concurrent streams", ylabel="edge CPU per streamed token (us)", xscale="log")
    left.legend(fontsize=8)
    fig.suptitle("The edge's ceiling (sim engine, the path infermesh up runs, 2 cores)")
    fig.tight_layout()
    fig.savefig(out / "edge_ceiling.png", dpi=110)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--sim-itl-ms", type=float, default=2.0, help="the engine's step: tokens/s = streams/step")
    parser.add_argument("--edges", type=int, nargs="+", default=[1, 2], help="edges sharing the port")
    parser.add_argument("--coalesce", type=int, nargs="+", default=[1, 8], help="tokens per message (1: off)")
    parser.add_argument("--out", default="")
    args = parse(parser, argv)
    return conclude(asyncio.run(run(args)), args.out, write_report)


if __name__ == "__main__":
    main()
