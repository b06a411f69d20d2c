"""Hostile requests vs. the streams on one edge: ITL p99 of N streams alone, then while hostile requests arrive.

A sim mesh as processes (NATS, router, admission, one sim worker, two edges): edge "guarded" runs with its
defaults (heavy preparation in a worker process), edge "inline" with ``--prep-processes 0`` (everything on
its event loop, as before the hostile-edge work) for contrast. Each run has three phases of ``--phase-s``:

1. ``alone``: N streaming chat requests back to back on the guarded edge (ignore_eos, ``--max-tokens``);
2. ``hostile``: the same streams while ``--hostile-concurrency`` loops send hostile requests to it;
3. ``hostile_inline``: the same on the inline edge.

Hostile kinds, round robin: ``huge_tools`` (~400 KiB of tool schema, new each time, under the cap: checked,
rendered, tokenized, then too long a prompt), ``over_cap_tools`` (1.4 MiB), ``deep_nesting`` (1,000 levels),
``big_body`` (3.9 MiB of message: tokenized, then too long), ``oversized`` (Content-Length 100 MiB, never
sent), ``bad_args`` (``seed: 2**70``, ``logit_bias``); and, held open the whole phase, ``--slow-clients``
connections that send their headers and then a body byte a second (408 at the body deadline).

ITL = the gaps between a stream's content chunks as its client reads them (pooled over streams); the
result is the median over ``--runs`` of each phase's p99, and hostile / alone (goal: at most 1.5).

    python -m loadtests.hostile --runs 3 --out docs/results/hostile/hostile

``--gil-check`` instead measures why the edge prepares in a process, not a thread: 16 socket round trips
every 10 ms on one event loop, their gaps p50/p99, with nothing else running, with a thread checking a
big schema meanwhile, and with a worker process doing it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import msgspec

from infermesh.processes import ProcessGroup
from loadtests.lib.sse_client import EMPTY_CONTENT, FIRST_CONTENT, read_chunks
from loadtests.lib.stats import summarize_ms
from shared.ports import free_port, wait_for_port

KEY = "bench-key"
PHASES = ("alone", "hostile", "hostile_inline")
KINDS = ("huge_tools", "over_cap_tools", "deep_nesting", "big_body", "oversized", "bad_args")
MESSAGES = [{"role": "user", "content": "Summarize what a KV-cache-aware router does, at length."}]


def _head(port: int, length: int) -> bytes:
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


def _tools(num_properties: int, salt: str) -> list[dict]:
    properties = {f"f{i}_{salt}": {"type": "string", "description": "d" * 40, "enum": ["a", "b"]}
                  for i in range(num_properties)}
    return [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object",
                                                                               "properties": properties}}}]


def hostile_body(kind: str) -> bytes:
    """One hostile request (``oversized`` is built by the sender: its body is never sent)."""
    base = {"model": "bench", "messages": MESSAGES, "max_tokens": 8}
    if kind == "huge_tools":
        return msgspec.json.encode({**base, "tools": _tools(3500, uuid.uuid4().hex[:6])})
    if kind == "over_cap_tools":
        return msgspec.json.encode({**base, "tools": _tools(15000, "x")})
    if kind == "deep_nesting":
        return b'{"model": "bench", "messages": [], "tools": [' + b'{"a": ' * 1000 + b"1" + b"}" * 1000 + b"]}"
    if kind == "big_body":
        return msgspec.json.encode({**base, "messages": [{"role": "user", "content": "word " * 800_000}]})
    return msgspec.json.encode({**base, "seed": 2**70, "logit_bias": {"1": 5}})


async def _exchange(port: int, request: bytes) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        status = await reader.readline()
        return int(status.split()[1])
    finally:
        writer.close()


class Bodies:
    """Hostile bodies built before any phase (building 4 MiB while streams are read would skew their gaps);
    ``huge_tools`` ones are all different (the edge remembers schemas it checked)."""

    def __init__(self, num_huge: int) -> None:
        self.huge = [hostile_body("huge_tools") for _ in range(num_huge)]
        self.fixed = {kind: hostile_body(kind) for kind in KINDS if kind not in ("huge_tools", "oversized")}
        self.num_huge_sent = 0

    def request(self, port: int, kind: str) -> bytes:
        if kind == "oversized":
            return _head(port, 100 << 20)  # declared, never sent
        if kind == "huge_tools":
            body = self.huge[self.num_huge_sent % len(self.huge)]
            self.num_huge_sent += 1
        else:
            body = self.fixed[kind]
        return _head(port, len(body)) + body


async def hostile_loop(port: int, bodies: Bodies, offset: int, until: float,
                       counts: dict[str, dict[int, int]]) -> None:
    i = offset
    while time.monotonic() < until:
        kind = KINDS[i % len(KINDS)]
        i += 1
        request = bodies.request(port, kind)
        try:
            status = await asyncio.wait_for(_exchange(port, request), max(0.1, until - time.monotonic() + 30))
        except (OSError, asyncio.TimeoutError):
            status = 0
        by_status = counts.setdefault(kind, {})
        by_status[status] = by_status.get(status, 0) + 1


async def slow_client(port: int, until: float, counts: dict[str, dict[int, int]]) -> None:
    """Headers, then a body byte a second: the edge answers 408 at its body deadline (or the phase ends)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    status = 0
    try:
        writer.write(_head(port, 1000))
        while time.monotonic() < until:
            writer.write(b" ")
            await writer.drain()
            try:
                line = await asyncio.wait_for(reader.readline(), 1.0)
            except asyncio.TimeoutError:
                continue
            status = int(line.split()[1]) if line else 0
            break
    except OSError:
        pass
    finally:
        writer.close()
    by_status = counts.setdefault("slow_body", {})
    by_status[status] = by_status.get(status, 0) + 1


async def stream_gaps(port: int, body: bytes, until: float, refused: list[bytes]) -> list[float]:
    """Streams back to back until ``until``; the gaps between content chunks (first chunk excluded).
    A stream the edge refuses (its status line) goes to ``refused``."""
    gaps: list[float] = []
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.monotonic() < until:
            writer.write(_head(port, len(body)) + body)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                refused.append(head.split(b"\r\n")[0])
                writer.close()
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                continue
            last = None
            async for chunk in read_chunks(reader):
                if FIRST_CONTENT in chunk.replace(EMPTY_CONTENT, b""):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
    finally:
        writer.close()
    return gaps


async def phase(port: int, hostile_port: int | None, bodies: Bodies, args: argparse.Namespace) -> dict:
    body = msgspec.json.encode({"model": "bench", "messages": MESSAGES, "max_tokens": args.max_tokens,
                                "stream": True, "ignore_eos": True})
    until = time.monotonic() + args.phase_s
    counts: dict[str, dict[int, int]] = {}
    side = []
    if hostile_port is not None:
        side = [asyncio.create_task(hostile_loop(hostile_port, bodies, k, until, counts))
                for k in range(args.hostile_concurrency)]
        side += [asyncio.create_task(slow_client(hostile_port, until, counts)) for _ in range(args.slow_clients)]
    refused: list[bytes] = []
    gaps = await asyncio.gather(*[stream_gaps(port, body, until, refused) for _ in range(args.streams)])
    await asyncio.gather(*side)
    return {"itl": summarize_ms([g for per in gaps for g in per]), "streams_refused": len(refused),
            "refusals": sorted({r.decode() for r in refused}), "hostile_status_counts": counts}


def start_mesh(state: Path, args: argparse.Namespace) -> tuple[ProcessGroup, int, int]:
    group = ProcessGroup(state / "logs")
    nats_port, guarded_port, inline_port = free_port(), free_port(), free_port()
    group.spawn_nats(nats_port, state / "nats")
    assert wait_for_port(nats_port, 10)
    env = {"INFERMESH_NATS_URL": f"nats://127.0.0.1:{nats_port}", "INFERMESH_NAMESPACE": "bench",
           "INFERMESH_DEV_KEY": KEY}
    from infermesh.models import make_tiny_llama

    model = make_tiny_llama(state / "tiny")
    group.python_service("router", "services.router", [], env)
    group.python_service("admission", "services.admission", [], env)
    group.python_service("worker", "services.worker", [
        "--worker-id", "sim-0", "--engine", "sim", "--model", "bench", "--model-path", str(model),
        "--max-model-len", "4096", "--sim-ttft-ms", "20", "--sim-itl-ms", str(args.sim_itl_ms)], env)
    group.python_service("edge", "services.edge", ["--http-port", str(guarded_port)], env)
    group.python_service("edge-inline", "services.edge", ["--http-port", str(inline_port), "--prep-processes", "0"],
                         env)
    return group, guarded_port, inline_port


async def run(args: argparse.Namespace) -> dict:
    state = Path(tempfile.mkdtemp(prefix="infermesh-hostile-"))
    group, guarded, inline = start_mesh(state, args)
    report: dict = {"command": "python -m loadtests.hostile " + " ".join(sys.argv[1:]),
                    "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                "load_avg_at_start": os.getloadavg()},
                    "settings": {k: v for k, v in vars(args).items() if k != "out"}, "runs": []}
    try:
        for port in (guarded, inline):
            assert wait_for_port(port, 90), "an edge did not start"
            await _ready(port)
        bodies = Bodies(num_huge=20 * args.runs)
        # the guarded edge's worker process starts (and loads the tokenizer) on its first heavy request: once
        await asyncio.wait_for(_exchange(guarded, bodies.request(guarded, "huge_tools")), 120)
        for i in range(args.runs):
            result = {"alone": await phase(guarded, None, bodies, args),
                      "hostile": await phase(guarded, guarded, bodies, args),
                      "hostile_inline": await phase(inline, inline, bodies, args)}
            report["runs"].append(result)
            print(json.dumps({"run": i, **{p: round(result[p]["itl"]["p99_ms"], 1) for p in PHASES},
                              "refused": {p: result[p]["streams_refused"] for p in PHASES}}), flush=True)
    finally:
        group.stop()
        shutil.rmtree(state, ignore_errors=True)
    for name in PHASES:
        for q in ("p50_ms", "p99_ms"):
            report[f"{name}_itl_{q}"] = statistics.median(r[name]["itl"][q] for r in report["runs"])
    report["num_huge_tools_sent"] = bodies.num_huge_sent
    report["hostile_over_alone_p99"] = report["hostile_itl_p99_ms"] / report["alone_itl_p99_ms"]
    report["inline_over_alone_p99"] = report["hostile_inline_itl_p99_ms"] / report["alone_itl_p99_ms"]
    return report


async def _ready(port: int) -> None:
    body = msgspec.json.encode({"model": "bench", "messages": MESSAGES, "max_tokens": 2})
    for _ in range(300):
        try:
            if await _exchange(port, _head(port, len(body)) + body) == 200:
                return
        except OSError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"edge on {port} never served")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["alone", "hostile\n(guarded edge)", "hostile\n(prep on the loop)"]
    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(PHASES))
    ax.bar([i - 0.2 for i in x], [report[f"{p}_itl_p50_ms"] for p in PHASES], 0.4, label="ITL p50")
    ax.bar([i + 0.2 for i in x], [report[f"{p}_itl_p99_ms"] for p in PHASES], 0.4, label="ITL p99")
    ax.axhline(1.5 * report["alone_itl_p99_ms"], color="gray", linestyle="--", linewidth=1,
               label="goal: 1.5x p99 alone")
    ax.set_yscale("log")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("inter-token gap at the client (ms, log)")
    ax.set_title(f"{report['settings']['streams']} streams on one edge, median of {len(report['runs'])} runs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _check_schema(num_properties: int = 3000) -> None:
    from jsonschema import Draft202012Validator

    Draft202012Validator.check_schema(_tools(num_properties, "g")[0]["function"]["parameters"])


async def gil_check(duration_s: float = 4.0) -> dict[str, dict[str, float]]:
    """Round-trip gaps of 16 echo streams on this loop while a schema is checked nowhere / in a thread / in a
    process (the edge's choice, prep.py)."""
    from concurrent.futures import ProcessPoolExecutor

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1):
            writer.write(data)

    async def stream(port: int, until: float, gaps: list[float]) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        last = None
        while time.monotonic() < until:
            await asyncio.sleep(0.01)
            writer.write(b"x")
            await reader.readexactly(1)
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    out = {}
    with ProcessPoolExecutor(1) as pool:
        await loop.run_in_executor(pool, int)
        for mode in ("nothing", "thread", "process"):
            until, gaps = time.monotonic() + duration_s, []

            async def hostile(mode: str, until: float) -> None:
                while mode != "nothing" and time.monotonic() < until:
                    if mode == "thread":
                        await asyncio.to_thread(_check_schema)
                    else:
                        await loop.run_in_executor(pool, _check_schema)

            await asyncio.gather(hostile(mode, until), *[stream(port, until, gaps) for _ in range(16)])
            out[mode] = summarize_ms(gaps)
            print(mode, {k: round(v, 1) for k, v in out[mode].items()}, flush=True)
    server.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--phase-s", type=float, default=8.0)
    parser.add_argument("--max-tokens", type=int, default=100)
    parser.add_argument("--sim-itl-ms", type=float, default=20.0)
    parser.add_argument("--hostile-concurrency", type=int, default=2)
    parser.add_argument("--slow-clients", type=int, default=32)
    parser.add_argument("--out", default="loadtests/out/hostile", help="path prefix for .json and .png")
    parser.add_argument("--gil-check", action="store_true", help="only the thread-vs-process check (prints it)")
    args = parser.parse_args()
    if args.gil_check:
        asyncio.run(gil_check())
        return
    report = asyncio.run(run(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in report.items() if k.endswith(("p99_ms", "_p99"))}, indent=1))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
