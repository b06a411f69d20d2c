"""Tool calls over the conformance corpus through a mesh (router + one worker + edges), with budget-aware
closing on (edge tool_close_within 128) and off (0).

For every corpus tool and seed, the same request is sent non-streamed and streamed (same seed) with
max_tokens 512, tool_choice ``required`` (the tool and two neighbours declared; parallel_tool_calls false
unless --parallel) and ``named`` (that tool). Counted per (closing, choice): calls, valid % (jsonschema
Draft 2020-12 against the declared schema), undeclared names, cut % (responses with finish_reason
"length"; and calls whose arguments are not complete JSON), and streamed vs non-streamed agreement % (same
calls name+arguments, content and finish_reason; ids may differ). Per tool-call format (--format hermes, glm
or all: an edge per format and closing, one worker). JSON + PNG under --out.

    python -m loadtests.tool_calls --engine sim --out docs/results/tool_calls
    python -m loadtests.tool_calls --engine vllm --seeds 1 --out docs/results/tool_calls
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import openai

from infermesh.local import LocalMesh
from infermesh.processes import nats_server_binary
from services.edge.tools import TOOL_FORMATS
from shared.ports import free_port, wait_for_port
from tests.conformance.tool_calls.corpus import TOOLS, argument_errors
from tests.conformance.tool_calls.harness import Answer, ask_both

CLOSINGS = (128, 0)
CHOICES = ("required", "named")
MODEL = "tiny"


async def start_mesh(nats_url: str, engine: str, model_path: str, formats: tuple[str, ...]) -> LocalMesh:
    """Edge ``i * len(CLOSINGS) + j`` writes ``formats[i]`` with tool_close_within ``CLOSINGS[j]``."""
    mesh = LocalMesh(nats_url, f"tcl{uuid.uuid4().hex[:8]}")
    await mesh.start_router()
    if engine == "sim":
        await mesh.start_worker(worker_id="sim-0", engine="sim", model=MODEL, model_path=model_path,
                                max_model_len=8192, block_size=16, num_kv_blocks=16384, sim_ttft_ms=0.5,
                                sim_itl_ms=0.0, heartbeat_ttl_s=60.0)
    else:
        await mesh.start_worker(worker_id="vllm-0", engine="vllm", model=MODEL, model_path=model_path,
                                max_model_len=2048, cpu_core=0, heartbeat_ttl_s=60.0)
    for fmt in formats:
        for close_within in CLOSINGS:
            await mesh.start_edge(admission=False, tool_close_within=close_within, tool_call_format=fmt)
    deadline = time.monotonic() + 120
    while not all(edge.mesh.is_ready() for edge in mesh.edges):
        assert time.monotonic() < deadline, "the mesh did not get ready"
        await asyncio.sleep(0.1)
    return mesh


def _neighbours(i: int) -> list[dict]:
    return [TOOLS[(i + d) % len(TOOLS)] for d in range(3)]


def _same(a: Answer, b: Answer) -> bool:
    return a.same_as(b)


async def run_cell(client: openai.AsyncOpenAI, choice: str, seeds: int, max_tokens: int, concurrency: int,
                   parallel: bool, tools_limit: int) -> dict:
    gate = asyncio.Semaphore(concurrency)
    jobs = [(i, seed) for i in range(min(tools_limit, len(TOOLS))) for seed in range(seeds)]

    async def one(i: int, seed: int) -> tuple[int, Answer, Answer]:
        declared = _neighbours(i)
        name = TOOLS[i]["function"]["name"]
        body = dict(model=MODEL, tools=declared, seed=seed, max_tokens=max_tokens,
                    tool_choice={"type": "function", "function": {"name": name}} if choice == "named" else "required")
        if choice == "required":
            body["parallel_tool_calls"] = parallel
        async with gate:
            # each with a cache salt of its own: a prefix-cache hit's logits differ in the last bits (vLLM)
            plain, streamed = await ask_both(client, **body)
        return i, plain, streamed

    t0 = time.monotonic()
    results = await asyncio.gather(*(one(i, seed) for i, seed in jobs))
    elapsed = time.monotonic() - t0
    calls = valid = undeclared = calls_cut = cut = agree = no_call = 0
    examples: list = []
    for i, plain, streamed in results:
        names = {t["function"]["name"] for t in _neighbours(i)}
        agree += _same(plain, streamed)
        cut += plain.finish_reason == "length"
        no_call += not plain.tool_calls
        for answer in (plain, streamed):
            for call in answer.tool_calls:
                calls += 1
                if call["name"] not in names:
                    undeclared += 1
                    continue
                errors = argument_errors(call["name"], call["arguments"], _neighbours(i))
                if not errors:
                    valid += 1
                    continue
                if errors[0].startswith("arguments are not JSON"):
                    calls_cut += 1
                if len(examples) < 5:
                    examples.append({"name": call["name"], "arguments": call["arguments"][:400], "errors": errors[:3],
                                     "finish_reason": answer.finish_reason})
    n = len(results)
    return {"requests": n, "responses": 2 * n, "calls": calls, "valid_pct": 100.0 * valid / max(calls, 1),
            "invalid": calls - valid, "undeclared": undeclared, "calls_cut": calls_cut,
            "calls_cut_pct": 100.0 * calls_cut / max(calls, 1), "cut_pct": 100.0 * cut / max(n, 1),
            "responses_without_call_pct": 100.0 * no_call / max(n, 1),
            "stream_agreement_pct": 100.0 * agree / max(n, 1), "elapsed_s": round(elapsed, 2),
            "invalid_examples": examples}


def plot(report: dict, path: Path) -> None:
    """One row of panels per format."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [(c, k) for c in CLOSINGS for k in CHOICES]
    labels = [f"{k}\nclose {c}" for c, k in cells]
    metrics = [("valid_pct", "valid %"), ("cut_pct", "cut % (finish length)"), ("calls_cut_pct", "calls cut %"),
               ("stream_agreement_pct", "stream = plain %")]
    formats = list(report["results"])
    fig, grid = plt.subplots(len(formats), len(metrics), figsize=(4 * len(metrics), 3.6 * len(formats)),
                             squeeze=False)
    for fmt, axes in zip(formats, grid, strict=True):
        for ax, (key, title) in zip(axes, metrics, strict=True):
            values = [report["results"][fmt][str(c)][k][key] for c, k in cells]
            bars = ax.bar(range(len(cells)), values, color=["#2b7bba", "#2b7bba", "#d95f02", "#d95f02"])
            ax.set_xticks(range(len(cells)), labels, fontsize=8)
            ax.set_title(f"{fmt}: {title}", fontsize=10)
            ax.set_ylim(0, 115)
            for bar, v in zip(bars, values, strict=True):
                ax.text(bar.get_x() + bar.get_width() / 2, min(v, 100) + 1, f"{v:.1f}", ha="center", fontsize=8)
    fig.suptitle(f"tool calls, {report['engine']} engine, {report['num_schemas']} schemas x {report['seeds']} seeds, "
                 f"max_tokens {report['max_tokens']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


async def main(args: argparse.Namespace) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="tool-calls-"))
    model_path = args.model_path
    if not model_path:
        from infermesh.models import make_tiny_llama

        model_path = str(make_tiny_llama(workdir / "tiny-llama"))
    port = free_port()
    nats = subprocess.Popen([nats_server_binary(), "-js", "-a", "127.0.0.1", "-p", str(port), "-sd",
                             str(workdir / "nats")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_for_port(port, 10), "nats-server did not start"
        formats = TOOL_FORMATS if args.format == "all" else (args.format,)
        mesh = await start_mesh(f"nats://127.0.0.1:{port}", args.engine, model_path, formats)
        try:
            results: dict = {fmt: {} for fmt in formats}
            cells = [(fmt, c) for fmt in formats for c in CLOSINGS]
            for i, (fmt, close_within) in enumerate(cells):
                client = openai.AsyncOpenAI(base_url=mesh.url_of(i), api_key=mesh.dev_key, max_retries=0,
                                            timeout=600)
                results[fmt][str(close_within)] = {}
                for choice in CHOICES:
                    closings = mesh.workers[0].engine.num_closings
                    cell = await run_cell(client, choice, args.seeds, args.max_tokens, args.concurrency,
                                          args.parallel, args.tools)
                    cell["closing_activations"] = mesh.workers[0].engine.num_closings - closings
                    results[fmt][str(close_within)][choice] = cell
                    print(f"{fmt:<6} close_within={close_within:<3} {choice:<8} calls={cell['calls']} "
                          f"valid={cell['valid_pct']:.2f}% undeclared={cell['undeclared']} cut={cell['cut_pct']:.2f}% "
                          f"calls_cut={cell['calls_cut_pct']:.2f}% agree={cell['stream_agreement_pct']:.2f}% "
                          f"closings={cell['closing_activations']} "
                          f"({cell['elapsed_s']} s)", flush=True)
                await client.close()
        finally:
            await mesh.stop()
    finally:
        nats.terminate()
        nats.wait(10)
    return {
        "command": "python -m loadtests.tool_calls " + " ".join(sys.argv[1:]),
        "engine": args.engine, "model": "tiny random-weight Llama (infermesh.models.make_tiny_llama)",
        "num_schemas": min(args.tools, len(TOOLS)), "seeds": args.seeds, "max_tokens": args.max_tokens,
        "parallel_tool_calls_for_required": args.parallel, "tool_call_formats": list(formats),
        "closing": {"128": "edge tool_close_within 128 (budget-aware closing on)", "0": "off"},
        "definitions": {
            "calls": "tool calls over both responses (non-streamed and streamed) of every request",
            "valid_pct": ("calls whose arguments parse and validate (jsonschema Draft 2020-12) "
                          "against the declared tool"),
            "cut_pct": "non-streamed responses with finish_reason length",
            "calls_cut_pct": "calls whose arguments are not complete JSON (cut by max_tokens)",
            "stream_agreement_pct": "requests whose streamed and non-streamed answers have the same calls "
                                    "(name + arguments), content and finish_reason",
            "closing_activations": "responses (both kinds) in which budget-aware closing forced tokens "
                                   "(Engine.num_closings)",
        },
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "results": results,  # format -> close_within -> choice
    }


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["sim", "vllm"], default="sim")
    parser.add_argument("--format", choices=[*TOOL_FORMATS, "all"], default="all",
                        help="the edges' tool_call_format (all: an edge per format, results per format)")
    parser.add_argument("--model-path", default="", help="the model (vllm) / tokenizer (sim); default: a tiny "
                                                         "random Llama made now")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--tools", type=int, default=len(TOOLS), help="use the first N corpus tools")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--parallel", action="store_true", help="parallel_tool_calls true for tool_choice required")
    parser.add_argument("--out", default="docs/results/tool_calls")
    args = parser.parse_args()
    report = asyncio.run(main(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"tool_calls_{args.engine}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    plot(report, stem.with_suffix(".png"))
    print(f"wrote {stem}.json and {stem}.png")


if __name__ == "__main__":
    cli()
