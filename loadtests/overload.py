"""Overload: offered load at 5x capacity on a sim fleet, admission on, two teams weighted 2:1.

The mesh runs as processes (``infermesh up``'s machinery: NATS, router, breaker, admission, sim
workers, edge); this process drives it over HTTP with a lean client, in three phases on the
same fleet:

1. unloaded: one streamed request at a time, for the TTFT baseline and the mean service time;
2. overload: open-loop Poisson arrivals at ``factor`` x capacity (capacity = workers x
   concurrency per worker / mean service time), half from team gold (weight 2), half from team
   silver (weight 1), for ``seconds``;
3. control (``--control``): the same arrivals on a mesh whose edge takes no leases.

Reported: admitted p99 TTFT against the unloaded p99 (target <= 2x), 429s (each with
Retry-After) and 5xx (target 0), and each team's share of the admitted requests (target 2:1
within 10%).

    python -m loadtests.overload --out docs/results/admission_overload
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import msgspec

from infermesh.processes import ProcessGroup
from infermesh.up import MeshOptions, start_processes, wait_ready
from loadtests.lib.sse_client import read_chunks
from loadtests.lib.stats import percentile
from shared.ports import free_port

MODEL = "sim-overload"
KEYS = {"gold": "key-gold", "silver": "key-silver"}
ERROR_CODE = re.compile(rb'"code":\s*"([^"]*)"')
FIRST_TEXT = re.compile(rb'"text":"[^"]')  # a completions chunk with text in it


@dataclass
class Result:
    team: str
    status: int
    ttft_s: float | None
    latency_s: float
    retry_after: str = ""
    code: str = ""


async def call(port: int, team: str, body: dict, timeout_s: float = 60.0) -> Result:
    """One streamed completion on a fresh connection: status, TTFT, Retry-After, error code."""
    payload = msgspec.json.encode(body)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {KEYS[team]}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n")
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        async with asyncio.timeout(timeout_s):
            writer.write(head.encode() + payload)
            raw_head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            status = int(raw_head.split(" ", 2)[1])
            headers = {k.strip().lower(): v.strip() for k, _, v in
                       (line.partition(":") for line in raw_head.split("\r\n")[1:] if line)}
            if status != 200:
                found = ERROR_CODE.search(await reader.read())
                code = found.group(1).decode() if found else ""
                return Result(team, status, None, time.perf_counter() - start, headers.get("retry-after", ""), code)
            first = None
            async for chunk in read_chunks(reader):
                if first is None and FIRST_TEXT.search(chunk):
                    first = time.perf_counter() - start
            return Result(team, 200, first, time.perf_counter() - start)
    finally:
        writer.close()


def request_body(rng: random.Random, args: argparse.Namespace) -> dict:
    prompt = [rng.randrange(10, 1000) for _ in range(args.prompt_tokens)]
    return {"model": MODEL, "prompt": prompt, "max_tokens": args.max_tokens, "stream": True, "ignore_eos": True}


async def unloaded(port: int, args: argparse.Namespace) -> list[Result]:
    rng = random.Random(1)
    return [await call(port, "gold", request_body(rng, args)) for _ in range(args.baseline_requests)]


async def overload(port: int, args: argparse.Namespace, rate: float) -> list[Result]:
    rng = random.Random(2)
    tasks, t, end = [], time.perf_counter(), time.perf_counter() + args.seconds
    i = 0
    while t < end:
        t += rng.expovariate(rate)
        delay = t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(call(port, "gold" if i % 2 == 0 else "silver", request_body(rng, args))))
        i += 1
    results = await asyncio.gather(*tasks, return_exceptions=True)
    return [r if isinstance(r, Result) else Result("?", 0, None, 0.0, code=type(r).__name__) for r in results]


def start_mesh(args: argparse.Namespace, state: Path, admission: bool) -> tuple[ProcessGroup, int]:
    from infermesh.models import make_tiny_llama

    tokenizer = str(make_tiny_llama(state / "tokenizer"))
    os.environ.update({
        "INFERMESH_TEAMS": args.weights, "INFERMESH_CONCURRENCY_PER_WORKER": str(args.concurrency_per_worker),
        "INFERMESH_MAX_QUEUE": str(args.workers * args.concurrency_per_worker),
        "INFERMESH_ADMISSION_WAIT_S": str(args.queue_wait_s), "INFERMESH_ADMISSION": str(admission).lower(),
        "INFERMESH_API_KEYS": ",".join(f"{key}:{team}" for team, key in KEYS.items()),
        # a worker runs at most what admission grants it, so admitted requests never queue inside it
        "INFERMESH_MAX_NUM_SEQS": str(args.concurrency_per_worker),
    })
    port = free_port()
    options = MeshOptions(engine="sim", model=MODEL, model_path=tokenizer, http_port=port,
                          namespace=f"ovl{uuid.uuid4().hex[:8]}", max_model_len=4096, state_dir=str(state),
                          dev_key="dev", ready_timeout_s=120, sim_decoders=args.workers, sim_profile=args.profile,
                          sim_stream_interval=args.stream_interval, sim_engines_per_process=args.workers)
    options.check()
    group = ProcessGroup(state / "logs")
    start_processes(group, options, tokenizer, state)
    if not wait_ready(group, options, threading.Event()):
        group.stop()
        raise RuntimeError("the mesh did not become ready")
    return group, port


def summary(results: list[Result]) -> dict:
    ok = [r for r in results if r.status == 200]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    by_team = {team: sum(1 for r in ok if r.team == team) for team in KEYS}
    return {
        "requests": len(results), "admitted": len(ok), "status_429": sum(r.status == 429 for r in results),
        "status_5xx": sum(r.status >= 500 for r in results), "other": sum(r.status not in (200, 429) and r.status < 500
                                                                         for r in results),
        "429_with_retry_after": sum(r.status == 429 and r.retry_after.isdigit() and int(r.retry_after) >= 1
                                    for r in results),
        "ttft_p50_ms": 1000 * percentile(ttfts, 50) if ttfts else None,
        "ttft_p99_ms": 1000 * percentile(ttfts, 99) if ttfts else None,
        "admitted_by_team": by_team,
        "gold_share": by_team["gold"] / max(1, len(ok)),
    }


async def run_phases(args: argparse.Namespace, port: int, with_baseline: bool) -> dict:
    out = {}
    if with_baseline:
        base = await unloaded(port, args)
        out["unloaded"] = summary(base)
        service_s = sum(r.latency_s for r in base) / len(base)
        out["service_s"] = service_s
        out["capacity_rps"] = args.workers * args.concurrency_per_worker / service_s
    return out


def rewrite(out: Path) -> None:
    """Re-render the markdown and PNG from a report's JSON."""
    report = json.loads((out / "overload.json").read_text())
    write(out, report, report["command"].split()[3:])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--concurrency-per-worker", type=int, default=8)
    p.add_argument("--profile", default="h200-glm53")
    p.add_argument("--factor", type=float, default=5.0)
    p.add_argument("--seconds", type=float, default=30.0)  # of offered load
    p.add_argument("--weights", default="gold:2,silver:1")
    p.add_argument("--queue-wait-s", type=float, default=0.1)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--stream-interval", type=int, default=4)
    p.add_argument("--baseline-requests", type=int, default=80)
    p.add_argument("--control", action="store_true", help="also run the same arrivals without admission")
    p.add_argument("--out", default="")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    report: dict = {"args": vars(args)}
    with tempfile.TemporaryDirectory(prefix="overload-") as tmp:
        group, port = start_mesh(args, Path(tmp) / "admitted", admission=True)
        try:
            report.update(asyncio.run(run_phases(args, port, with_baseline=True)))
            rate = args.factor * report["capacity_rps"]
            report["offered_rps"] = rate
            report["overload"] = summary(asyncio.run(overload(port, args, rate)))
        finally:
            group.stop()
        if args.control:
            group, port = start_mesh(args, Path(tmp) / "control", admission=False)
            try:
                report["control"] = summary(asyncio.run(overload(port, args, report["offered_rps"])))
            finally:
                group.stop()
    report["targets"] = targets(report)
    print(json.dumps({k: v for k, v in report.items() if k != "args"}, indent=1))
    if args.out:
        write(Path(args.out), report, argv)
    return report


def targets(report: dict) -> dict:
    base, over = report["unloaded"], report["overload"]
    ratio = over["ttft_p99_ms"] / base["ttft_p99_ms"] if over["ttft_p99_ms"] and base["ttft_p99_ms"] else None
    share = over["gold_share"]
    return {
        "ttft_p99_ratio": ratio, "ttft_ok": ratio is not None and ratio <= 2.0,
        "no_5xx": over["status_5xx"] == 0 and over["other"] == 0,
        "all_429_have_retry_after": over["429_with_retry_after"] == over["status_429"],
        "gold_share": share, "share_ok": abs(share - 2 / 3) <= 0.1 * (2 / 3),
    }


def write(out: Path, report: dict, argv: list[str] | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    command = "python -m loadtests.overload " + " ".join(argv or [])
    report = {**report, "command": command}
    (out / "overload.json").write_text(json.dumps(report, indent=1, default=str))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    phases = [("unloaded", report["unloaded"]), ("5x, admission", report["overload"])]
    if "control" in report:
        phases.append(("5x, no admission", report["control"]))
    xs = range(len(phases))
    left.bar([x - 0.2 for x in xs], [s["ttft_p50_ms"] or 0 for _, s in phases], width=0.4, color="#8ab", label="p50")
    left.bar([x + 0.2 for x in xs], [s["ttft_p99_ms"] or 0 for _, s in phases], width=0.4, color="#357", label="p99")
    left.set_xticks(list(xs), [n.replace(", ", "\n") for n, _ in phases])
    left.legend()
    left.set_ylabel("TTFT of served requests, ms")
    left.set_yscale("log")
    over = report["overload"]
    right.bar(["gold (w=2)", "silver (w=1)"], [over["admitted_by_team"]["gold"], over["admitted_by_team"]["silver"]],
              color=["#c90", "#999"])
    right.set_ylabel("admitted requests at 5x load")
    right.set_title(f"gold share {over['gold_share']:.1%} (target 66.7% +/- 10%)")
    fig.suptitle(f"Overload at {report['args']['factor']:g}x capacity: {over['status_429']} x 429, "
                 f"{over['status_5xx']} x 5xx")
    fig.tight_layout()
    fig.savefig(out / "overload.png", dpi=110)
    rows = ["| phase | requests | served | 429 | 5xx | no answer in 60 s | TTFT p50 ms | TTFT p99 ms | gold share |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in phases:
        silent = s["requests"] - s["admitted"] - s["status_429"] - s["status_5xx"]
        rows.append(f"| {name} | {s['requests']} | {s['admitted']} | {s['status_429']} | {s['status_5xx']} "
                    f"| {silent} | "
                    f"{s['ttft_p50_ms'] or 0:.0f} | {s['ttft_p99_ms'] or 0:.0f} | {s['gold_share']:.1%} |")
    t = report["targets"]
    text = [f"# Admission under overload\n\nCommand: `{command}`\n", "\n".join(rows), "",
            f"- capacity {report['capacity_rps']:.1f} req/s ({report['args']['workers']} workers x "
            f"{report['args']['concurrency_per_worker']} at once / {report['service_s'] * 1000:.0f} ms service); "
            f"offered {report['offered_rps']:.1f} req/s",
            f"- admitted TTFT p99 / unloaded p99 = {t['ttft_p99_ratio']:.2f} (target <= 2): "
            f"{'met' if t['ttft_ok'] else 'missed'}",
            f"- 5xx: {'none' if t['no_5xx'] else 'some'}; every 429 has Retry-After: {t['all_429_have_retry_after']}",
            f"- gold (weight 2) share of admitted: {t['gold_share']:.1%} (target 66.7% +/- 10%): "
            f"{'met' if t['share_ok'] else 'missed'}", ""]
    (out / "overload.md").write_text("\n".join(text))


if __name__ == "__main__":
    main()
