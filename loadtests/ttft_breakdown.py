"""Where a request's time goes on the full path: every service traces every request to an OTLP receiver while
closed-loop streams run through the edge of a mesh started as ``infermesh up`` starts it (loadtests/lib/up_mesh.py);
per span name (and service), the median and p90 duration over the measured requests.

Read with mesh_overhead: its overhead is TTFT through the edge minus the engine's; this says which hop holds it
(the edge's ``admission.acquire`` is the lease round trip as the edge sees it, ``admission.decide`` the leader's
own part of it, ``attempt`` minus the worker's span the routing and NATS hops). Tracing itself costs some
(mesh_overhead --tracing both), so these durations are those of a traced mesh.

    python -m loadtests.ttft_breakdown --concurrency 16 --requests 160 --out docs/results/mesh_overhead_breakdown
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from loadtests.lib.sse_client import LeanSseClient
from loadtests.lib.up_mesh import KEY, UpMesh
from loadtests.mesh_overhead import Failures, edge_body, load
from tests.otlp_receiver import OtlpReceiver


def durations_by_span(spans, since_ns: int) -> list[dict]:
    """Per (service, span name) of the spans started after ``since_ns``: count, p50 and p90 in ms, longest first."""
    by: dict[tuple[str, str], list[float]] = defaultdict(list)
    for span in spans:
        if span.start_ns >= since_ns:
            by[(span.service, span.name)].append((span.end_ns - span.start_ns) / 1e6)
    rows = [{"service": service, "span": name, "n": len(ms), "p50_ms": statistics.median(ms),
             "p90_ms": statistics.quantiles(ms, n=10)[-1] if len(ms) > 1 else ms[0]}
            for (service, name), ms in by.items()]
    return sorted(rows, key=lambda row: -row["p50_ms"])


async def run(args: argparse.Namespace, otlp: OtlpReceiver) -> dict:
    from infermesh.models import make_tiny_llama

    root = Path(tempfile.mkdtemp(prefix="infermesh-breakdown-"))
    mesh = UpMesh(root / "mesh", make_tiny_llama(root / "tiny"), args.sim_ttft_ms, args.sim_itl_ms,
                  {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint, "OTEL_TRACES_SAMPLER": "always_on"})
    await asyncio.to_thread(mesh.start)
    failures = Failures()
    try:
        client = LeanSseClient("127.0.0.1", mesh.port, "/v1/chat/completions", KEY)
        await load(lambda: client.timings(edge_body()), 4, 5, failures)  # warm-up
        since_ns = time.time_ns()
        ttfts, _gaps = await load(lambda: client.timings(edge_body()), args.concurrency,
                                  max(3, args.requests // args.concurrency), failures)
        expected = len(ttfts)
        deadline = time.monotonic() + 30  # the services export in batches: wait for every request's spans
        while time.monotonic() < deadline:
            edge_spans = [s for s in list(otlp.spans) if s.start_ns >= since_ns and s.name == "usage.publish"]
            if len(edge_spans) >= expected:
                break
            await asyncio.sleep(0.5)
        client.close()
    finally:
        mesh.stop()
    if failures:
        raise SystemExit(f"{len(failures)} requests failed, e.g. {failures[:3]}")
    return {"command": "python -m loadtests.ttft_breakdown " + " ".join(sys.argv[1:]),
            "concurrency": args.concurrency, "requests": len(ttfts), "sim_ttft_ms": args.sim_ttft_ms,
            "sim_itl_ms": args.sim_itl_ms, "ttft_p50_ms": statistics.median(ttfts) * 1000,
            "spans": durations_by_span(list(otlp.spans), since_ns)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--sim-ttft-ms", type=float, default=20.0)
    parser.add_argument("--sim-itl-ms", type=float, default=5.0)
    parser.add_argument("--out", default="loadtests/out/ttft_breakdown", help="path prefix of the .json")
    args = parser.parse_args()
    with OtlpReceiver() as otlp:
        report = asyncio.run(run(args, otlp))
    for row in report["spans"]:
        print(f"{row['service']:22s} {row['span']:28s} n={row['n']:5d} p50={row['p50_ms']:8.2f} "
              f"p90={row['p90_ms']:8.2f} ms")
    out = Path(args.out).with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"TTFT p50 {report['ttft_p50_ms']:.1f} ms; wrote {out}")


if __name__ == "__main__":
    main()
