"""One team's preparation flood vs. another team's agent turns on one edge (issue 38, point 1).

A mesh as ``infermesh up --engine sim`` starts it (loadtests/lib/up_mesh.py), with one edge (so every request
meets the same prep processes) and two teams' keys:

- team ``agents`` sends agent-sized turns: streamed chat of ``--turn-kb`` of fresh text each (a new conversation
  every turn, so no cache helps), ``--agents`` of them back to back;
- team ``flooders`` runs ``--flooders`` loops, half sending ``/v1/messages/count_tokens`` with a fresh
  ``--count-mb`` body, half chat with a fresh ``--schema-kb`` tool schema (each one new: checked again).

Two phases of ``--turns`` turns per agent: ``alone``, then ``flood`` (the flooders started first). The result:
the agents' TTFT (from the request's first byte sent to its first content chunk) p50/p90 per phase, the ratio
flood / alone of the p90 (goal: at most 2), and what the flooders got (status counts: 429s are the limits at work).

    python -m loadtests.prep_isolation --out docs/results/prep_isolation
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
import uuid
from pathlib import Path

import msgspec

from loadtests.lib.sse_client import EMPTY_CONTENT, FIRST_CONTENT, read_chunks
from loadtests.lib.stats import percentile
from loadtests.lib.up_mesh import MODEL, UpMesh

AGENT_KEY, FLOOD_KEY = "agent-key", "flood-key"
PHASES = ("alone", "flood")
WORDS = ("route", "cache", "prefill", "decode", "token", "lease", "edge", "worker", "stream", "schema")


def fresh_text(num_bytes: int) -> str:
    """``num_bytes`` of words starting with a new id: no earlier prompt shares its beginning."""
    words = (WORDS[i % len(WORDS)] + str(i % 97) for i in range(num_bytes // 6 + 1))
    return (uuid.uuid4().hex + " " + " ".join(words))[:num_bytes]


def agent_body(turn_kb: int) -> bytes:
    return msgspec.json.encode({"model": MODEL, "stream": True, "max_tokens": 4, "messages": [
        {"role": "system", "content": fresh_text(turn_kb * 512)},
        {"role": "user", "content": fresh_text(turn_kb * 512)}]})


def count_body(count_mb: float) -> bytes:
    return msgspec.json.encode({"model": MODEL, "messages": [
        {"role": "user", "content": fresh_text(int(count_mb * (1 << 20)))}]})


def schema_body(schema_kb: int, tool_choice: str = "auto") -> bytes:
    salt = uuid.uuid4().hex[:8]
    properties = {f"f{i}_{salt}": {"type": "string", "description": "a field of the lookup"}
                  for i in range(schema_kb * 1024 // 60)}
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object",
                                                                              "properties": properties}}}
    return msgspec.json.encode({"model": MODEL, "max_tokens": 8, "tools": [tool], "tool_choice": tool_choice,
                                "messages": [{"role": "user", "content": "look it up"}]})


def _head(port: int, path: str, key: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


async def _status(port: int, path: str, body: bytes) -> int:
    """One flooder's request on its own connection: the status (the body is not waited for)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(_head(port, path, FLOOD_KEY, len(body)) + body)
        await writer.drain()
        return int((await reader.readline()).split()[1])
    finally:
        writer.close()


async def flooder(port: int, kind: str, args: argparse.Namespace, stop: asyncio.Event,
                  counts: dict[str, dict[int, int]]) -> None:
    path = "/v1/messages/count_tokens" if kind == "count_tokens" else "/v1/chat/completions"
    while not stop.is_set():
        body = count_body(args.count_mb) if kind == "count_tokens" else schema_body(args.schema_kb, args.tool_choice)
        try:
            status = await _status(port, path, body)
        except OSError:
            status = 0
        counts.setdefault(kind, {}).setdefault(status, 0)
        counts[kind][status] += 1
        if status == 429:  # as a client honouring Retry-After would, briefly
            await asyncio.sleep(args.retry_pause_s)


async def agent_turns(port: int, args: argparse.Namespace, ttfts: list[float], errors: list[str]) -> None:
    """``args.turns`` streamed turns back to back on one connection; each turn's TTFT (or its error)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for _ in range(args.turns):
            body = agent_body(args.turn_kb)
            started = time.perf_counter()
            writer.write(_head(port, "/v1/chat/completions", AGENT_KEY, len(body)) + body)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                errors.append(head.split(b"\r\n")[0].decode() + " " + (await reader.read(400)).decode(errors="replace"))
                writer.close()
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                continue
            first = None
            async for chunk in read_chunks(reader):
                if first is None and FIRST_CONTENT in chunk.replace(EMPTY_CONTENT, b""):
                    first = time.perf_counter() - started
            ttfts.append(first if first is not None else float("nan"))
    finally:
        writer.close()


async def phase(port: int, args: argparse.Namespace, flood: bool) -> dict:
    stop, counts = asyncio.Event(), {}
    kinds = ["count_tokens" if i % 2 == 0 else "schema" for i in range(args.flooders)] if flood else []
    flooders = [asyncio.create_task(flooder(port, kind, args, stop, counts)) for kind in kinds]
    if flood:  # the flood is under way before the turns start
        await asyncio.sleep(args.flood_lead_s)
    ttfts: list[float] = []
    errors: list[str] = []
    await asyncio.gather(*(agent_turns(port, args, ttfts, errors) for _ in range(args.agents)))
    stop.set()
    await asyncio.gather(*flooders)
    ms = [1000 * t for t in ttfts]
    return {"turns": len(ttfts), "errors": errors, "ttft_p50_ms": round(percentile(ms, 50), 1),
            "ttft_p90_ms": round(percentile(ms, 90), 1), "ttft_max_ms": round(max(ms, default=0.0), 1),
            "flooders": {kind: {str(s): n for s, n in sorted(by.items())} for kind, by in counts.items()}}


async def _warm(port: int, args: argparse.Namespace) -> None:
    """A few turns first: the prep processes start and load the tokenizer (not what is measured)."""
    warm = argparse.Namespace(**{**vars(args), "turns": 2})
    await asyncio.gather(*(agent_turns(port, warm, [], []) for _ in range(max(2, args.agents))))


def run(args: argparse.Namespace) -> dict:
    from infermesh.models import make_tiny_llama

    with tempfile.TemporaryDirectory(prefix="prep-isolation-") as tmp:
        model = make_tiny_llama(Path(tmp) / "tiny", max_position_embeddings=1 << 20)
        mesh = UpMesh(Path(tmp) / "state", model, args.sim_ttft_ms, args.sim_itl_ms, edge_replicas=1,
                      max_model_len=1 << 20,
                      service_env={"INFERMESH_API_KEYS": f"{AGENT_KEY}:agents,{FLOOD_KEY}:flooders"})
        mesh.start()
        try:
            asyncio.run(_warm(mesh.port, args))
            phases = {name: asyncio.run(phase(mesh.port, args, name == "flood")) for name in PHASES}
        finally:
            mesh.stop()
    alone, flood = phases["alone"], phases["flood"]
    return {"command": "python -m loadtests.prep_isolation " + " ".join(sys.argv[1:]),
            "settings": {k: v for k, v in vars(args).items() if k != "out"},
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "phases": phases, "p90_ratio": round(flood["ttft_p90_ms"] / max(alone["ttft_p90_ms"], 1e-9), 2),
            "goal_p90_ratio": 2.0, "baseline_issue_38": {"alone_ms": 136, "flood_ms": 3760, "ratio": 27.6}}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for offset, q in ((-0.2, "p50"), (0.2, "p90")):
        ax.bar([i + offset for i in range(len(PHASES))], [report["phases"][p][f"ttft_{q}_ms"] for p in PHASES], 0.4,
               label=f"TTFT {q}")
    ax.axhline(2 * report["phases"]["alone"]["ttft_p90_ms"], color="gray", linestyle="--", linewidth=1,
               label="goal: 2x p90 alone")
    ax.set_xticks(range(len(PHASES)), ["agent turns alone", "beside the prep flood"])
    ax.set_ylabel("time to first token at the client (ms)")
    ax.set_title(f"team B's {report['settings']['turn_kb']} KB turns; p90 ratio {report['p90_ratio']}x")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=2, help="team B's concurrent agents")
    parser.add_argument("--turns", type=int, default=20, help="turns per agent per phase")
    parser.add_argument("--turn-kb", type=int, default=80)
    parser.add_argument("--flooders", type=int, default=4, help="team A's loops (half count_tokens, half schemas)")
    parser.add_argument("--count-mb", type=float, default=1.5)
    parser.add_argument("--schema-kb", type=int, default=400)
    parser.add_argument("--tool-choice", default="auto", choices=("auto", "none"),
                        help="the schema flood's: none prepares (checks) the schema but asks the engine for no grammar")
    parser.add_argument("--flood-lead-s", type=float, default=2.0, help="flood alone before the turns start")
    parser.add_argument("--retry-pause-s", type=float, default=0.2, help="a flooder's pause after a 429")
    parser.add_argument("--sim-ttft-ms", type=float, default=20.0)
    parser.add_argument("--sim-itl-ms", type=float, default=10.0)
    parser.add_argument("--out", default="loadtests/out/prep_isolation", help="folder for the .json and .png")
    args = parser.parse_args(argv)
    report = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prep_isolation.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out / "prep_isolation.png")
    print(json.dumps({p: {k: v for k, v in report["phases"][p].items() if k.startswith("ttft")} for p in PHASES}))
    print(f"p90 flood/alone: {report['p90_ratio']}x; wrote {out}/prep_isolation.json and .png")
    return report


if __name__ == "__main__":
    main()
